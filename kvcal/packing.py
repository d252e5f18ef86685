"""Packing of 1/2/3/4-bit codes into int32 words. Every layout kvcal writes is documented here.

Codes are unsigned integers in [0, 2^bits). Within a row (the last dimension), code i goes to word
i // per_word at bit offset slot(i % per_word); bits are filled LSB-first. Rows are padded with zero
codes to a whole number of words. Words are stored as int32 (two's complement of the uint32 pattern).

Layouts:
- "lsb": per_word = 32 // bits codes of `bits` bits at offsets 0, bits, 2*bits, ... (1 bit: 32 codes,
  2 bits: 16, 3 bits: 10 with the top 2 bits unused, 4 bits: 8). Lossless.
- "kvmix10x3+1x2" (3 bits only, KVmix's layout): 11 codes per word, ten 3-bit codes at offsets
  0..27 and an eleventh 2-bit code at offset 30. The eleventh code is clamped to [0, 3]: lossy by design.
"""

from __future__ import annotations

import math

import torch

from kvcal.errors import KvcalError

LAYOUTS = ("lsb", "kvmix10x3+1x2")


def _slots(bits: int, layout: str) -> list[tuple[int, int]]:
    """(bit offset, width) of every code slot in one word."""
    if layout == "lsb":
        if bits not in (1, 2, 3, 4):
            raise KvcalError(f"cannot pack {bits}-bit codes; widths 1-4 are supported")
        return [(i * bits, bits) for i in range(32 // bits)]
    if layout == "kvmix10x3+1x2":
        if bits != 3:
            raise KvcalError(f"layout kvmix10x3+1x2 holds 3-bit codes, not {bits}-bit")
        return [(3 * i, 3) for i in range(10)] + [(30, 2)]
    raise KvcalError(f"unknown packing layout '{layout}'; choose one of {', '.join(LAYOUTS)}")


def codes_per_word(bits: int, layout: str = "lsb") -> int:
    return len(_slots(bits, layout))


def packed_words(length: int, bits: int, layout: str = "lsb") -> int:
    return math.ceil(length / codes_per_word(bits, layout))


def pack(codes: torch.Tensor, bits: int, layout: str = "lsb") -> torch.Tensor:
    """codes (..., n) in [0, 2^bits) -> int32 words (..., ceil(n / per_word))."""
    slots = _slots(bits, layout)
    per_word = len(slots)
    n = codes.shape[-1]
    padded = torch.zeros(*codes.shape[:-1], packed_words(n, bits, layout) * per_word, dtype=torch.int64, device=codes.device)
    padded[..., :n] = codes.to(torch.int64)
    if padded.numel() and (padded.min() < 0 or padded.max() >= 2**bits):
        raise ValueError(f"codes outside [0, {2**bits}) cannot be packed in {bits} bits")
    grouped = padded.view(*codes.shape[:-1], -1, per_word)
    words = torch.zeros(grouped.shape[:-1], dtype=torch.int64, device=codes.device)
    for slot, (offset, width) in enumerate(slots):
        words |= grouped[..., slot].clamp(max=2**width - 1) << offset
    return (words - (words >= 2**31).to(torch.int64) * 2**32).to(torch.int32)


def unpack(words: torch.Tensor, bits: int, length: int, layout: str = "lsb") -> torch.Tensor:
    """int32 words (..., w) -> codes (..., length) as int64."""
    slots = _slots(bits, layout)
    unsigned = words.to(torch.int64) & 0xFFFFFFFF
    codes = torch.stack([(unsigned >> offset) & (2**width - 1) for offset, width in slots], dim=-1)
    return codes.flatten(-2)[..., :length]
