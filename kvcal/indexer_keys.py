"""How a cache keeps a sparse layer's indexer keys (DeepSeek Sparse Attention's, MiniMax-M3's and Qwen4-Exp's; GLM-5
Next's packed indexer states): each token's row of `width` channels in one of FORMATS.

- "model": as the model computes them (bf16 in the released checkpoints), width x the model's bytes a token.
- "fp8": FP8 e4m3 codes with one fp32 scale per GROUP channels of a token, width + 4 x ceil(width / GROUP) bytes a
  token, as DeepSeek-V3.2's own inference (act_quant, scale_fmt "ue8m0") and vLLM (indexer_k_quant_and_cache with
  use_ue8m0) keep its indexer keys: the scale is the power of two at or above max(the group's largest magnitude,
  1e-4) / 448 (e4m3's largest value), computed exactly here (vLLM's CUDA log2f may round a hair's breadth from a
  power of two), and a code is e4m3(x / scale), saturating. FP8 is floating point, so a large channel costs the
  others of its group little precision: a value comes back within 1/16 of itself down to 2^-6 of the scale (e4m3's
  smallest normal), within 2^-10 of the scale below. Zero stays zero: GLM-5 Next's real-token flag keeps which
  tokens are real (exactly, where its key width is a multiple of GROUP: the flag is then a group of its own). A group
  holding a NaN or an infinity comes back not finite.

A row is encoded on its own, when it is stored: a cache that hands back every token's keys so far decodes what it
stored, and the simulation's round trip gives the same values.
"""

from __future__ import annotations

import torch

FORMATS = ("model", "fp8")
GROUP = 128  # channels a scale serves (DeepSeek-V3.2's indexer key: one group)
DESCRIPTIONS = {"model": "as the model computes them (in its dtype; dots.note3's in fp32)",
                "fp8": f"FP8 e4m3, one power-of-two fp32 scale per {GROUP} channels of a token"}
FP8 = torch.float8_e4m3fn
SCALE_BYTES = 4
SMALLEST_MAGNITUDE = 1e-4  # the largest magnitude a scale is made for, at least (a group of zeros: this)


def groups(width: int) -> int:
    return -(-width // GROUP)


def token_bytes(format_name: str, width: int, model_bytes: int) -> int:
    """Bytes one token's indexer row of `width` channels takes in `format_name` (model_bytes: a channel's as
    computed)."""
    return {"model": width * model_bytes, "fp8": width + SCALE_BYTES * groups(width)}[_known(format_name)]


def _known(format_name: str) -> str:
    if format_name not in FORMATS:
        raise ValueError(f"indexer keys format {format_name!r} is not one of {', '.join(FORMATS)}")
    return format_name


class StoredRows:
    """One cache layer's indexer rows (batch, tokens, width) as a format keeps them: "model" the rows themselves,
    "fp8" their codes and scales (batch, tokens, groups). Rows stay as stored; decoded() gives them back in the dtype
    the model handed them in."""

    def __init__(self, format_name: str, parts: tuple[torch.Tensor, ...], dtype: torch.dtype):
        self.format, self.parts, self.dtype = format_name, parts, dtype

    @classmethod
    def encoded(cls, format_name: str, rows: torch.Tensor) -> StoredRows:
        if _known(format_name) == "model":
            return cls(format_name, (rows,), rows.dtype)
        width = rows.shape[-1]
        grouped = _in_groups(rows.float())
        # (a group holding a NaN or an infinity: a scale of its own kind, so that it comes back not finite)
        scales = _power_of_two_at_or_above(grouped.abs().amax(-1).clamp(min=SMALLEST_MAGNITUDE) / torch.finfo(FP8).max)
        codes = (grouped / scales[..., None]).clamp(-torch.finfo(FP8).max, torch.finfo(FP8).max).to(FP8)
        return cls(format_name, (codes.flatten(-2)[..., :width].contiguous(), scales), rows.dtype)

    @property
    def nbytes(self) -> int:
        return sum(part.numel() * part.element_size() for part in self.parts)

    def decoded(self) -> torch.Tensor:
        if self.format == "model":
            return self.parts[0]
        codes, scales = self.parts
        grouped = _in_groups(_e4m3_over_256(codes)) * (scales * 2.0**8)[..., None]
        return grouped.flatten(-2)[..., : codes.shape[-1]].to(self.dtype)

    def appended(self, step: StoredRows) -> StoredRows:
        return StoredRows(self.format, tuple(torch.cat(pair, 1) for pair in zip(self.parts, step.parts)), self.dtype)

    def first(self, tokens: int) -> StoredRows:
        return StoredRows(self.format, tuple(part.narrow(1, 0, tokens) for part in self.parts), self.dtype)

    def sequences(self, index: torch.Tensor) -> StoredRows:
        """Sequences index[0], index[1], ... as sequences 0, 1, ..."""
        return StoredRows(self.format, tuple(part.index_select(0, index) for part in self.parts), self.dtype)


def _power_of_two_at_or_above(x: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2 x) of positive x, exactly (x itself where it is not finite): x = m 2^e with m in [0.5, 1) is
    2^(e - 1) where m is 0.5, else below 2^e."""
    mantissa, exponent = torch.frexp(x)
    return torch.ldexp(torch.ones_like(x), exponent - (mantissa == 0.5).to(exponent.dtype)).where(x.isfinite(), x)


def _in_groups(rows: torch.Tensor) -> torch.Tensor:
    """rows (..., width) as (..., groups, GROUP), zero-padded to whole groups."""
    missing = groups(rows.shape[-1]) * GROUP - rows.shape[-1]
    return (torch.nn.functional.pad(rows, (0, missing)) if missing else rows).unflatten(-1, (-1, GROUP))


def _e4m3_over_256(codes: torch.Tensor) -> torch.Tensor:
    """e4m3 codes' values / 2^8 as fp32, exact for every finite code: an fp16 holding the code's sign, then its exponent
    and mantissa bits at the top of its own (fp16's exponent bias is 8 more than e4m3's; e4m3's subnormals land on
    fp16's); a NaN code's group has a NaN scale (StoredRows.encoded). torch converts FP8 on the CPU a value at a time;
    these steps work on the whole tensor."""
    bits = codes.view(torch.uint8).to(torch.int16)
    return ((bits & 0x80) << 8).bitwise_or_((bits & 0x7F) << 7).view(torch.float16).float()


def round_trip(format_name: str, rows: torch.Tensor) -> torch.Tensor:
    """Rows (..., width) as a cache keeping them in `format_name` hands them back."""
    return StoredRows.encoded(format_name, rows).decoded()
