"""Packing of 1/2/3/4-bit codes into int32 words. Every layout kvcal writes is documented here.

Codes are unsigned integers in [0, 2^bits). Within a row (the last dimension), code i goes to word
i // per_word at bit offset slot(i % per_word); bits are filled LSB-first. Rows are padded with zero
codes to a whole number of words. Words are stored as int32 (two's complement of the uint32 pattern).

Layouts:
- "lsb": per_word = 32 // bits codes of `bits` bits at offsets 0, bits, 2*bits, ... (1 bit: 32 codes,
  2 bits: 16, 3 bits: 10 with the top 2 bits unused, 4 bits: 8). Lossless.
- "kvmix10x3+1x2" (3 bits only, KVmix's layout): 11 codes per word, ten 3-bit codes at offsets
  0..27 and an eleventh 2-bit code at offset 30. The eleventh code is clamped to [0, 3]: lossy by design.
- "ternary20" (SKVQ 1.5-bit values, codes 0..2): 20 codes per word as base-3 digits, word = sum c_i 3^i
  (3^20 < 2^32), 1.6 bits per code. Lossless.

The runtime cache (kvcal.runtime) packs every token row with `layout_for(bits)`: "lsb", or "ternary20"
for 1.5 bits. A row of C channels takes packed_words(C, bits) words.
"""

from __future__ import annotations

import math

import torch

from kvcal.errors import KvcalError

LAYOUTS = ("lsb", "kvmix10x3+1x2", "ternary20")
OUTLIER_BYTES = 4 + 2 + 2  # a sparse outlier as the runtime stores it: token row int32, channel int16, value fp16
TERNARY_PER_WORD = 20


def layout_for(bits: float) -> str:
    return "ternary20" if bits == 1.5 else "lsb"


def _slots(bits: int, layout: str) -> list[tuple[int, int]]:
    """(bit offset, width) of every code slot in one word."""
    if layout == "lsb":
        if bits not in (1, 2, 3, 4):
            raise KvcalError(f"cannot pack {bits}-bit codes; widths 1-4 are supported")
        bits = int(bits)  # recipes may carry 2.0
        return [(i * bits, bits) for i in range(32 // bits)]
    if layout == "kvmix10x3+1x2":
        if bits != 3:
            raise KvcalError(f"layout kvmix10x3+1x2 holds 3-bit codes, not {bits}-bit")
        return [(3 * i, 3) for i in range(10)] + [(30, 2)]
    raise KvcalError(f"unknown packing layout '{layout}'; choose one of {', '.join(LAYOUTS)}")


def codes_per_word(bits: float, layout: str = "lsb") -> int:
    return TERNARY_PER_WORD if layout == "ternary20" else len(_slots(bits, layout))


def packed_words(length: int, bits: float, layout: str = "lsb") -> int:
    return math.ceil(length / codes_per_word(bits, layout))


def packed_row_bits(channels: int, bits: float) -> int:
    """Bits the runtime stores for the codes of one token row of `channels` channels (whole int32 words)."""
    return 32 * packed_words(channels, bits, layout_for(bits))


def pack(codes: torch.Tensor, bits: float, layout: str = "lsb") -> torch.Tensor:
    """codes (..., n) in [0, 2^bits) (0..2 for ternary20) -> int32 words (..., ceil(n / per_word))."""
    per_word = codes_per_word(bits, layout)
    n = codes.shape[-1]
    padded = torch.zeros(*codes.shape[:-1], packed_words(n, bits, layout) * per_word, dtype=torch.int64, device=codes.device)
    padded[..., :n] = codes.to(torch.int64)
    limit = 3 if layout == "ternary20" else 2**bits
    if padded.numel() and (padded.min() < 0 or padded.max() >= limit):
        raise ValueError(f"codes outside [0, {limit}) cannot be packed in layout {layout}")
    grouped = padded.view(*codes.shape[:-1], -1, per_word)
    words = torch.zeros(grouped.shape[:-1], dtype=torch.int64, device=codes.device)
    if layout == "ternary20":
        for slot in range(per_word):
            words += grouped[..., slot] * 3**slot
    else:
        for slot, (offset, width) in enumerate(_slots(bits, layout)):
            words |= grouped[..., slot].clamp(max=2**width - 1) << offset
    return (words - (words >= 2**31).to(torch.int64) * 2**32).to(torch.int32)


def unpack(words: torch.Tensor, bits: float, length: int, layout: str = "lsb") -> torch.Tensor:
    """int32 words (..., w) -> codes (..., length) as int64."""
    unsigned = words.to(torch.int64) & 0xFFFFFFFF
    if layout == "ternary20":
        codes = torch.stack([(unsigned // 3**slot) % 3 for slot in range(TERNARY_PER_WORD)], dim=-1)
    else:
        codes = torch.stack([(unsigned >> offset) & (2**width - 1) for offset, width in _slots(bits, layout)], dim=-1)
    return codes.flatten(-2)[..., :length]
