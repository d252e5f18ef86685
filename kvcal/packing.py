"""Packing of 1-8-bit codes into int32 words, and the runtime's outlier layout. Every layout kvcal writes is
documented here.

Codes are unsigned integers in [0, 2^bits). A row (the last dimension) is packed in units of a fixed number of
codes and words (`unit_shape`); the row is padded with zero codes to a whole number of units. Within a word
bits are filled LSB-first. Words are stored as int32 (two's complement of the uint32 pattern).

Layouts:
- "lsb": one word per unit of 32 // bits codes of `bits` bits at offsets 0, bits, 2*bits, ... (1 bit: 32 codes,
  2 bits: 16, 3 bits: 10 with the top 2 bits unused, 4 bits: 8, 8 bits: 4); code i is in word i // per_word.
  Lossless.
- "planes3", "planes5", "planes6", "planes7" (exactly `bits` bits per code): bit-planes, low bits first, of widths
  PLANE_WIDTHS[bits] (3 = 2 + 1, 5 = 4 + 1, 6 = 4 + 2, 7 = 4 + 2 + 1). Per unit of 32 consecutive codes, `bits`
  words: a plane of width w takes w words, its field of code i (bits [s, s + w) of the code, s the widths of the
  planes before it) in the plane's word (i * w) >> 5 at bit (i * w) & 31. planes3: word 0 holds the low 2 bits of
  codes 0-15 at bit 2*i, word 1 those of codes 16-31 at bit 2*(i - 16), word 2 the high bit of codes 0-31 at bit
  i; code i's low bits are in word 3*(i >> 5) + ((i >> 4) & 1) at bit 2*(i & 15), its high bit in word
  3*(i >> 5) + 2 at bit i & 31 (no division by 3 or 10). Lossless.
- "kvmix10x3+1x2" (3 bits only, KVmix's layout): 11 codes per word, ten 3-bit codes at offsets
  0..27 and an eleventh 2-bit code at offset 30. The eleventh code is clamped to [0, 3]: lossy by design.
- "ternary20" (SKVQ 1.5-bit values, codes 0..2): 20 codes per word as base-3 digits, word = sum c_i 3^i
  (3^20 < 2^32), 1.6 bits per code. Lossless.

The runtime cache (kvcal.runtime) packs every token row with `layout_for(bits)`: "planesN" for 3, 5, 6 and 7
bits, "ternary20" for 1.5 bits, "lsb" otherwise (1, 2, 4, 8). A row of C channels takes
packed_words(C, bits, layout_for(bits)) words; with head_dim a multiple of 32, no word holds codes of two KV heads.

Outliers (dense-and-sparse codecs) are kept per (sequence, KV head) in append order, each OUTLIER_BYTES: a uint16
position inside its tile of OUTLIER_TILE_TOKENS body rows (token_in_tile * head_dim + channel_in_head) and its
fp16 value. Rows are appended in order and a row's outliers in channel order, so a tile's positions increase (the
tensor-core decode kernel finds each warp's tokens' outliers by it). An int32 offset table per (sequence, KV head,
tile) says where each started tile's outliers begin: tile t's are [offset[t], offset[t + 1]), the last started
tile's end at the (sequence, KV head) count. The cache stores OUTLIER_BYTES per outlier and OUTLIER_OFFSET_BYTES per
table entry (`outlier_table_bytes`).
"""

from __future__ import annotations

import math

import torch

from kvcal.errors import KvcalError

PLANE_WIDTHS = {3: (2, 1), 5: (4, 1), 6: (4, 2), 7: (4, 2, 1)}  # a planesN layout's bit-planes, low bits first
PLANES_CODES = 32  # codes of a planesN unit (in N words)
LAYOUTS = ("lsb", *(f"planes{bits}" for bits in PLANE_WIDTHS), "kvmix10x3+1x2", "ternary20")
TERNARY_PER_WORD = 20

OUTLIER_TILE_TOKENS = 64  # body rows per outlier tile
OUTLIER_BYTES = 2 + 2  # an outlier as the runtime stores it: uint16 position in its tile, fp16 value
OUTLIER_OFFSET_BYTES = 4  # an int32 entry of the offset table, per (sequence, KV head, started tile)
POSITIONS_IN_TILE = 2**16  # positions a uint16 holds


def layout_for(bits: float) -> str:
    if bits == 1.5:
        return "ternary20"
    return f"planes{int(bits)}" if bits in PLANE_WIDTHS else "lsb"


def is_planes(layout: str) -> bool:
    """Whether `layout` stores its codes as bit-planes (planesN)."""
    return layout in LAYOUTS and layout.startswith("planes")


def _check_width(bits: float, layout: str) -> None:
    """Refuse codes of a width the layout does not hold (planesN: N bits, kvmix10x3+1x2: 3 bits)."""
    held = int(layout[len("planes"):]) if is_planes(layout) else 3
    if bits != held:
        raise KvcalError(f"layout {layout} holds {held}-bit codes, not {bits}-bit")


def _slots(bits: int, layout: str) -> list[tuple[int, int]]:
    """(bit offset, width) of every code slot in one word of a one-word-per-unit layout."""
    if layout == "lsb":
        if bits not in (1, 2, 3, 4, 8):
            raise KvcalError(f"cannot pack {bits}-bit codes in lsb words; widths 1-4 and 8 are (5-7 bits: planesN)")
        bits = int(bits)  # recipes may carry 2.0
        return [(i * bits, bits) for i in range(32 // bits)]
    if layout == "kvmix10x3+1x2":
        _check_width(bits, layout)
        return [(3 * i, 3) for i in range(10)] + [(30, 2)]
    if is_planes(layout):
        raise KvcalError(f"layout {layout} packs 32 codes in {layout[6:]} words, not a number of codes per word (see unit_shape)")
    raise KvcalError(f"unknown packing layout '{layout}'; choose one of {', '.join(LAYOUTS)}")


def codes_per_word(bits: float, layout: str = "lsb") -> int:
    return TERNARY_PER_WORD if layout == "ternary20" else len(_slots(bits, layout))


def unit_shape(bits: float, layout: str = "lsb") -> tuple[int, int]:
    """(words, codes) of one packing unit: rows are padded to whole units."""
    if is_planes(layout):
        _check_width(bits, layout)
        return int(bits), PLANES_CODES
    return 1, codes_per_word(bits, layout)


def packed_words(length: int, bits: float, layout: str = "lsb") -> int:
    words, codes = unit_shape(bits, layout)
    return words * math.ceil(length / codes)


def packed_row_bits(channels: int, bits: float) -> int:
    """Bits the runtime stores for the codes of one token row of `channels` channels (whole int32 words)."""
    return 32 * packed_words(channels, bits, layout_for(bits))


def outlier_table_bytes(body_rows: int, kv_heads: int, first_row: int = 0) -> int:
    """Bytes of the outlier offset table of one sequence's `body_rows` quantized rows from its body row `first_row`
    on (a sliding-window layer drops the first ones): an entry per KV head and started tile that holds one."""
    if not body_rows:
        return 0
    tiles = math.ceil((first_row + body_rows) / OUTLIER_TILE_TOKENS) - first_row // OUTLIER_TILE_TOKENS
    return kv_heads * tiles * OUTLIER_OFFSET_BYTES


def check_outlier_head_dim(head_dim: int) -> None:
    """Refuse a head_dim whose outlier positions inside a tile do not fit a uint16."""
    if OUTLIER_TILE_TOKENS * head_dim > POSITIONS_IN_TILE:
        raise KvcalError(f"head_dim {head_dim} is too large for the cache's outliers: a tile of {OUTLIER_TILE_TOKENS} tokens "
                         f"x head_dim must number its positions in 16 bits (head_dim <= {POSITIONS_IN_TILE // OUTLIER_TILE_TOKENS}); "
                         "use a recipe without outliers (outlier fraction 0) for this model")


_PLANE_SHIFTS: dict = {}


def plane_shifts(bits: int, device, dtype=torch.int64) -> list[tuple[int, int, torch.Tensor]]:
    """A planesN unit's bit-planes, low bits first: (first word in the unit, width w, bit offsets w*i of the 32 // w
    fields in each of the plane's words)."""
    key = (bits, str(device), dtype)
    if key not in _PLANE_SHIFTS:
        planes, first = [], 0
        for width in PLANE_WIDTHS[bits]:
            planes.append((first, width, width * torch.arange(32 // width, dtype=dtype, device=device)))
            first += width
        _PLANE_SHIFTS[key] = planes
    return _PLANE_SHIFTS[key]


def pack_planes(units: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (..., units, 32) int64 in range -> the planesN words (..., units, bits) int64 (uint32 patterns)."""
    words = []
    for first, width, shifts in plane_shifts(bits, units.device):
        field = (units >> first) & (2**width - 1)  # plane bits start at the widths before: the same as `first`
        words.append((field.view(*units.shape[:-1], width, 32 // width) << shifts).sum(-1))  # disjoint bits: sum = OR
    return torch.cat(words, -1)


def unpack_planes(units: torch.Tensor, bits: int) -> torch.Tensor:
    """planesN words (..., units, bits), int64 uint32 patterns or int32 (the arithmetic shift's sign bits are masked
    off) -> codes (..., units, 32) of the same dtype."""
    codes = None
    for first, width, shifts in plane_shifts(bits, units.device, units.dtype):
        field = ((units[..., first:first + width, None] >> shifts) & (2**width - 1)).flatten(-2) << first
        codes = field if codes is None else codes | field
    return codes


_SLOT_TABLES: dict = {}


def _slot_table(bits: float, layout: str, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per slot of a one-word unit: its place value (2^offset; 3^slot for ternary20) int64, its bit offset int32 and
    the largest code it holds int64."""
    key = (bits, layout, str(device))
    if key not in _SLOT_TABLES:
        if layout == "ternary20":
            places, offsets, limits = [3**slot for slot in range(TERNARY_PER_WORD)], [0] * TERNARY_PER_WORD, [2] * TERNARY_PER_WORD
        else:
            slots = _slots(bits, layout)
            places, offsets, limits = [2**o for o, _ in slots], [o for o, _ in slots], [2**w - 1 for _, w in slots]
        _SLOT_TABLES[key] = (torch.tensor(places, dtype=torch.int64, device=device),
                             torch.tensor(offsets, dtype=torch.int32, device=device),
                             torch.tensor(limits, dtype=torch.int64, device=device))
    return _SLOT_TABLES[key]


def pack(codes: torch.Tensor, bits: float, layout: str = "lsb", check: bool = True) -> torch.Tensor:
    """codes (..., n) in [0, 2^bits) (0..2 for ternary20) -> int32 words (..., packed_words(n, bits, layout)), in a few
    tensor ops whatever the codes per word: every slot's code times its place value, summed per word (the slots' bits
    do not overlap, so the sum is their OR); planesN shifts and sums each bit-plane's fields so. check=False skips the
    range check (for codes a codec made)."""
    words_per_unit, per_unit = unit_shape(bits, layout)
    n = codes.shape[-1]
    units = math.ceil(n / per_unit)
    padded = torch.nn.functional.pad(codes.to(torch.int64), (0, units * per_unit - n)).view(*codes.shape[:-1], units, per_unit)
    limit = 3 if layout == "ternary20" else 2**bits
    if check and padded.numel() and (padded.min() < 0 or padded.max() >= limit):
        raise ValueError(f"codes outside [0, {limit}) cannot be packed in layout {layout}")
    if is_planes(layout):
        packed = pack_planes(padded, words_per_unit).flatten(-2)
    else:
        places, _, limits = _slot_table(bits, layout, codes.device)
        if layout == "kvmix10x3+1x2":
            padded = padded.minimum(limits)  # the eleventh code keeps 2 bits: lossy by design
        packed = (padded * places).sum(-1)
    return packed.sub_(packed.ge(2**31).to(torch.int64) << 32).to(torch.int32)  # the uint32 pattern as int32


def unpack_units(words: torch.Tensor, bits: float, layout: str = "lsb") -> torch.Tensor:
    """int32 words (..., w) -> codes (..., units, codes per unit) int32, every slot (the row's padding included): an
    arithmetic shift of the int32 word keeps the slot's bits and the mask drops the sign extension; for planesN each
    bit-plane's words are shifted apart and the planes joined; ternary20's base-3 digits from the uint32 pattern."""
    if layout == "ternary20":
        unsigned = words.to(torch.int64) & 0xFFFFFFFF
        places, _, _ = _slot_table(bits, layout, words.device)
        return torch.div(unsigned[..., None], places, rounding_mode="floor").remainder_(3).to(torch.int32)
    if is_planes(layout):
        words_per_unit, _ = unit_shape(bits, layout)
        return unpack_planes(words.view(*words.shape[:-1], -1, words_per_unit), words_per_unit)
    _, offsets, limits = _slot_table(bits, layout, words.device)
    return (words[..., None] >> offsets).bitwise_and_(limits.to(torch.int32))


def unpack(words: torch.Tensor, bits: float, length: int, layout: str = "lsb") -> torch.Tensor:
    """int32 words (..., w) -> codes (..., length) as int64."""
    return unpack_units(words, bits, layout).flatten(-2)[..., :length].to(torch.int64)
