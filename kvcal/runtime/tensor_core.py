"""Decode attention on tensor cores (kernels/decode_attention_tc.cu): one query token per sequence over an fp16
cache (kvcal.runtime.store.Fp16Rows), a KIVI-style uniform int4 / int3 / int2 body (kvcal.runtime.store.PackedRows
with ChannelBlockUniform keys and TokenUniform values) or a KVQuant nuq4 / nuq3 / nuq2 body (CodebookCodec keys with
per-channel thresholds and values with per-token thresholds, outliers kept exact), 3-bit codes in
"planes3", the others "lsb", or an SKVQ body (SkvqTensor on both sides: 1- to 4-bit codes in channel order, a scale and zero per token
and permuted channel group, fp16 or fp8; pre-RoPE keys), keys and values of one code width or two (KVmix's and mixed
layers), head_dim 64, 128 or 256, 1-8 query heads per KV head; packed keys may be pre-RoPE (rotated in the kernel:
pass inv_freq and each sequence's first position), at head_dim 256 codebook and SKVQ keys only.

The cache on CUDA decodes with it alone (kvcal.runtime.backends decides which layers: the others go to the torch
reference), through `serve`: a `ServedBody` takes the body rows both sides of a launch hold, and its segment blocks
the launch's other tokens (fp16 sinks and windows; uniform bodies' rows one side holds alone), so that a layer is one
launch a step (kvcal.runtime.kernels.prepare_decode). Outliers are patched in the pre-RoPE variants (KVQuant's
recipe); post-RoPE codebook keys with outliers take them too, rotated by angle 0 (`rotates_by_zero`). `operands` maps
two stores to the kernel's arguments (the CPU emulation in tools/kernel_emulation.py calls the same kernel with the
same arguments); `decode_attention_tc` launches it alone over two stores with CuPy on torch's current stream, split
over the sequence, the last block of each (sequence, KV head) merging the splits (tests and benchmarks): one launch.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch

from kvcal.errors import KvcalError
from kvcal.packing import OUTLIER_TILE_TOKENS
from kvcal.quantizers import CodecKind
from kvcal.runtime import kernel_source as src
from kvcal.runtime import kernels
from kvcal.runtime.kernels import CODEBOOKS
from kvcal.runtime.store import channel_slots_and_groups, upload

MODULE = "decode_attention_tc.cu"
THREADS, WARPS = 128, 4  # tc::THREADS, tc::WARPS
STAGE_TOKENS, WIDE_STAGE_TOKENS = 64, 128  # tc::Shape::BLOCK_ST of most variants (and tc::OUT_TILE), and of the WIDE ones
OUTLIER_SLOTS = 192  # tc::Shape::OUT_SLOTS: outliers per side a stage copies (a crowded tile's rest is read from global memory)
GROUP_SLOTS = 16  # tc::Shape::GROUP_SLOTS: SKVQ's channel groups a KV head's channels may fall in, per side
PARAMETER_CHUNK_TOKENS = 16  # channel groups: a stage's parameter runs are copied in 16-byte chunks (16 fp8 tokens)
HEAD_DIMS = src.HEAD_DIMS
GQA_SIZES = tuple(range(1, kernels.MAX_GQA + 1))
A100_SHARED_BYTES = 163 * 1024  # the most dynamic shared memory a block of an sm_80 GPU takes (every variant fits it)
SM90_SHARED_BYTES, RESERVED_SHARED_BYTES = 228 * 1024, 1024  # an SM of sm_90's shared memory; the driver's per block
LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class Variant:
    head_dim: int
    bits: int  # 16: fp16 rows; 4, 3 or 2: uniform or codebook codes; 4 to 1: channel groups (the keys', the values' too but for value_bits)
    key_group: int  # tokens per key block (0 for fp16 and codebooks)
    value_group: int  # channels per value group (0 for fp16; head_dim for codebooks)
    gqa: int
    rope: bool = False  # pre-RoPE keys, rotated in the kernel
    codebook: bool = False  # KVQuant's nuq codes (CodebookCodec)
    outliers: bool = False  # codebook codes with outliers kept exact (dense-and-sparse)
    value_bits: int = 0  # the values' code width where it is not the keys' (KVmix's and mixed layers); 0: the keys'
    channel_groups: int = 0  # SKVQ's permuted channel groups (tc::Shape's PG): 1 with fp16 parameters, 2 with fp8; 0: none

    @property
    def vbits(self) -> int:
        """The values' code width (tc::Shape's VBITS)."""
        return self.value_bits or self.bits

    @property
    def name(self) -> str:
        flag = lambda x: "true" if x else "false"  # noqa: E731
        # the template's last two parameters default to the keys' width and no channel groups
        widths = f", {self.vbits}, {self.channel_groups}" if self.channel_groups else f", {self.value_bits}" if self.value_bits else ""
        return (f"decode_tc<{self.head_dim}, {self.bits}, {self.key_group}, {self.value_group}, {self.gqa}, {flag(self.rope)}, "
                f"{flag(self.codebook)}, {flag(self.outliers)}{widths}>")

    def check(self) -> None:
        """The constraints of kernels/decode_attention_tc.cu's static_asserts, as a KvcalError on the host."""
        d, bits, kg, vg = self.head_dim, self.bits, self.key_group, self.value_group
        widths = (4, 3, 2, 1) if self.channel_groups else (4, 3, 2) if self.codebook else (16, 4, 3, 2)
        two_widths = self.value_bits and (self.value_bits == bits or 16 in (bits, self.value_bits))
        if d not in HEAD_DIMS or self.gqa not in GQA_SIZES:
            raise KvcalError(f"the tensor-core kernel reads head_dim {', '.join(map(str, HEAD_DIMS))} with 1 to "
                             f"{GQA_SIZES[-1]} query heads per KV head in a launch, not {d} with {self.gqa}")
        if two_widths:
            raise KvcalError(f"value_bits is the packed values' width where it differs from the packed keys', not {self}")
        if bits not in widths or self.vbits not in widths:
            kind = "channel-group" if self.channel_groups else "codebook" if self.codebook else "uniform"
            codes = [w for w in widths if w != 16]  # whole widths from 1 or 2 to 4
            raise KvcalError(f"the tensor-core kernel reads {min(codes)}-{max(codes)}-bit {kind} codes, not {bits}-bit keys "
                             f"with {self.vbits}-bit values")
        if self.outliers and not (self.codebook and self.rope):
            raise KvcalError(f"outliers are served with codebook codes and pre-RoPE keys (KVQuant's), not {self}")
        if self.channel_groups:  # dequantized into fp16 rows per stage, keys rotated there: every head_dim
            if not (self.channel_groups in (1, 2) and self.rope and not self.codebook and kg == 0 and vg == d):
                raise KvcalError(f"channel groups are served as SKVQ stores them (pre-RoPE keys, 1- to 4-bit codes), not {self}")
        elif self.codebook:
            if kg != 0 or vg != d:
                raise KvcalError(f"codebook codes are served with one key block and one value group per head, not {self}")
        elif bits != 16:
            vge = min(vg, d)
            if kg % 16 or (kg % STAGE_TOKENS if kg >= STAGE_TOKENS else STAGE_TOKENS % kg):
                raise KvcalError(f"key blocks of {kg} tokens: the kernel needs a multiple of 64, or 16 / 32")
            if (vg % d and d % vg) or vge // 8 * self.vbits < 8 or (self.vbits == 3 and vge < 32):  # 3-bit: whole eighths of units a lane
                raise KvcalError(f"value groups of {vg} channels with {self.vbits}-bit codes and head_dim {d} are not served")
        if self.rope and not self.channel_groups:
            if bits == 3 and not self.codebook:
                raise KvcalError(f"uniform 3-bit keys are served post-RoPE (KVmix's), not {self}")
            if d == 256 and not self.codebook:
                raise KvcalError(f"pre-RoPE keys at head_dim 256 are served with codebook codes (KVQuant's), not {self}")
            if bits == 16 or (d * bits < 256 and not self.codebook):
                raise KvcalError(f"pre-RoPE keys are served for int4 at head_dim 64 / 128, int2 at 128, codebooks and channel "
                                 f"groups, not {bits} bits at {d}")
        if self.shared_bytes() > A100_SHARED_BYTES:  # none today (the stage counts keep every variant under it)
            raise KvcalError(f"{self.name} takes {self.shared_bytes()} bytes of shared memory a block, past an A100's "
                             f"{A100_SHARED_BYTES}: not served")

    @property
    def wide(self) -> bool:
        """tc::Shape<...>::WIDE: uniform codes with post-RoPE keys take stages of 128 tokens (32 per warp between
        barriers): int2 in key blocks of 32, 64 or a multiple of 128 tokens, int4 in blocks of 32 or 64 (in larger ones it
        keeps more bytes in flight with 6 stages of 64: the kernel's Shape says what the H100 measured)."""
        kg = self.key_group
        return self.bits in (4, 3, 2) and not (self.codebook or self.rope) and kg > 0 and (kg in (32, 64) or self.widest == 2 and kg % 128 == 0)

    @property
    def widest(self) -> int:
        """tc::Shape<...>::WIDEST: the wider side's code width, which sizes the stages."""
        return max(self.bits, self.vbits)

    @property
    def private(self) -> bool:
        """tc::Shape<...>::PRIVATE: packed codes stream warp-private pipelines (each warp copies, waits for and computes
        its own quarter of the split, pre-RoPE keys rotating its own query, outliers corrected per its own tiles; no
        barrier of the block in the loop), but for channel groups (work shared per stage) and pre-RoPE keys at head_dim
        256."""
        return self.bits != 16 and not (self.channel_groups or (self.rope and self.head_dim > 128))

    @property
    def key_pairs_shared(self) -> bool:
        """tc::Shape<...>::KEY_PAIRS_SHARED: pre-RoPE codebook keys at head_dim 256 keep the lanes' scale and zero pairs
        in shared memory, reloaded per n-tile (in registers they spilled)."""
        return self.rope and self.head_dim == 256 and not self.channel_groups

    @property
    def stage_tokens(self) -> int:
        """tc::Shape<...>::BLOCK_ST: tokens the block streams per iteration, a quarter of them per warp; splits hold
        whole ones."""
        return WIDE_STAGE_TOKENS if self.wide else STAGE_TOKENS

    @property
    def buffer_tokens(self) -> int:
        """tc::Shape<...>::ST: tokens per stage buffer (a warp's quarter of the block's where its pipeline is private)."""
        return self.stage_tokens // WARPS if self.private else self.stage_tokens

    @property
    def stages(self) -> int:
        """tc::Shape<...>::STAGES: the cp.async pipeline's depth: most_stages, but at head_dim 256 a private pipeline
        takes no more than let two blocks share an SM of sm_90, where that leaves it 3 or more (TWO_BLOCK_STAGES)."""
        most = self.most_stages
        if self.head_dim == 256 and self.private and not self._fits_two_blocks_of_sm_90(most):
            return next((s for s in range(most - 1, 2, -1) if self._fits_two_blocks_of_sm_90(s)), most)
        return most

    def _fits_two_blocks_of_sm_90(self, stages: int) -> bool:
        return 2 * (self._shared_bytes(stages) + RESERVED_SHARED_BYTES) <= SM90_SHARED_BYTES

    @property
    def most_stages(self) -> int:
        """tc::Shape<...>::MOST_STAGES: the most stages a variant's pipelines take."""
        if self.bits == 16:
            return 2 if self.head_dim == 256 else 3  # a block of 256-channel rows fits an A100's shared memory
        if self.channel_groups:  # beside the fp16 rows of the stage computed
            return 2 if self.head_dim == 256 else 4
        if self.wide:
            return 3 if self.widest == 4 else 4
        if self.outliers:  # a warp's ring of two outlier tiles allows 5; at 256 (the block's pipeline) a block of nuq3
            return 5 if self.private else 2 if self.widest == 4 else 3  # fits an A100's 163 KB in 3 stages, nuq4 in 2
        if self.rope and self.codebook and self.head_dim == 256:  # two blocks on an SM of sm_90 beside the rotation table
            return 3 if self.widest == 4 else 5
        if self.widest == 4:
            return 5 if self.codebook else 6  # nuq4: 2 blocks of its padded rows still fit an A100
        return 8

    @functools.cache  # asked at every decode step (a variant is a frozen value)
    def shared_bytes(self) -> int:
        """tc::Shape<...>::SMEM_BYTES: the dynamic shared memory of one block."""
        return self._shared_bytes(self.stages)

    def _shared_bytes(self, stages: int) -> int:
        d, bits, kg, vg = self.head_dim, self.bits, self.key_group, self.value_group
        fp16, st = bits == 16, self.buffer_tokens
        # tc::Shape::KSROW / VSROW: a side's row in shared memory (nuq4's padded)
        srows = [d * b // 8 + (16 if self.codebook and b == 4 else 0) for b in (bits, self.vbits)]
        kblocks = 0 if fp16 or self.codebook or self.channel_groups else (1 if kg >= st else st // kg)  # per stage
        vgroups = 1 if fp16 else d // min(vg, d)
        vp_halves = 0 if fp16 else 2 * vgroups * st
        value_params = st * 8 if self.codebook else (vp_halves * 2 + 15) // 16 * 16  # codebooks: fp32 scale, zero
        if self.channel_groups:  # [side][scale, zero][GROUP_SLOTS slots] runs of a stage's parameters, padded by 16 bytes
            value_params = 2 * 2 * GROUP_SLOTS * (st * (1 if self.channel_groups == 2 else 2) + 16)
        stage = st * sum(srows) + (0 if fp16 else kblocks * 4 * d) + value_params
        merge = WARPS * (8 * d + 16 + 8 * vgroups) * 4
        query = 0 if fp16 or self.rope else d // 8 * 32 * 4
        # rotated queries (the block's two, or a warp's own), the cos / sin table of a block stage's offsets
        queries = WARPS if self.private else 2
        rope = queries * (d // 8 * 32 * 4) + (0 if self.channel_groups else rope_row_start(self.stage_tokens, d) * 4) if self.rope else 0
        work = 2 * st * d * 2 if self.channel_groups else 0  # tc::Shape::WORK_BYTES: the stage computed as fp16 rows
        # codebooks' tc::EntryPlanes, 2^bits / 2 words a side from a 16-byte boundary (uniform 3-bit codes' are
        # constants); 3-bit codes read from a lane's places in a row (tc::Planes3Place); codebook keys' one block of
        # parameters
        planes3 = not self.channel_groups and 3 in (bits, self.vbits)
        planes = sum(max(16, 2**b * 2) for b in (bits, self.vbits) if self.codebook)
        key_block = 4 * d if self.codebook else 0
        places = 32 * 2 * 16 if planes3 else 0
        key_pairs = 2 * (d // 8) * 4 * 4 if self.key_pairs_shared else 0  # [scale, zero][pair][lane part t]
        rings = WARPS if self.private else 1  # a pipeline per warp, or one for the block
        outliers = 0
        if self.outliers:
            # per pipeline its tiles' areas (one a stage, or a warp's two: a 32-byte header, OUTLIER_SLOTS positions and
            # values per side), its tile's score corrections (int [head][tile]) and P (fp16 [head][tile]) and its
            # slices' 32-byte runs; the warps' value corrections (fp32 [warp][d][head]), 4 floats per key channel, the
            # two sides' 32-byte run descriptions; the launch's gqa heads
            areas = 2 if self.private else stages
            tile = self.stage_tokens
            outliers = (rings * (areas * (32 + 4 * OUTLIER_SLOTS * 2) + self.gqa * tile * (4 + 2) + 32)
                        + WARPS * self.gqa * d * 4 + 4 * d * 4 + 2 * 32)
        return max(rings * stages * stage + query + rope + planes + key_block + places + key_pairs + outliers + work, merge)


# (key bits, value bits; 0: the keys') of the packed variants: one width, or KVmix's and mixed layers' two
UNIFORM_WIDTHS = ((4, 0), (3, 0), (2, 0), (4, 2), (2, 4), (3, 4), (3, 2), (4, 3), (2, 3))
CODEBOOK_WIDTHS = ((4, 0), (3, 0), (2, 0), (4, 3), (3, 4), (4, 2), (2, 4), (3, 2), (2, 3))
GROUP_WIDTHS = tuple((k, 0 if v == k else v) for k in (4, 3, 2, 1) for v in (4, 3, 2, 1))  # SKVQ's whole-bit ones


def variants() -> list[Variant]:
    """Every variant this module may launch (the NVRTC compile check covers them all): the candidates Variant.check
    passes."""
    candidates = []
    for d in HEAD_DIMS:
        for gqa in GQA_SIZES:
            candidates.append(Variant(d, 16, 0, 0, gqa))
            candidates += [Variant(d, bits, group, group, gqa, rope, value_bits=vbits) for bits, vbits in UNIFORM_WIDTHS
                           for group in (32, 64, 128) for rope in (False, True)]
            candidates += [Variant(d, bits, 0, d, gqa, rope, True, outliers, vbits) for bits, vbits in CODEBOOK_WIDTHS
                           for rope in (False, True) for outliers in ((False, True) if rope else (False,))]
            candidates += [Variant(d, bits, 0, d, gqa, True, value_bits=vbits, channel_groups=pg) for bits, vbits in GROUP_WIDTHS
                           for pg in (1, 2)]
    out = []
    for v in candidates:
        try:
            v.check()
        except KvcalError:
            continue
        out.append(v)
    return out


def _is_packed(store) -> bool:
    return hasattr(store, "words")


def _keeps_outliers(kc, vc) -> bool:
    return kc.outlier_fraction > 0 or vc.outlier_fraction > 0


def rotates_by_zero(keys, values, inv_freq: torch.Tensor | None) -> bool:
    """Whether the stores' post-RoPE keys (inv_freq None) decode on the pre-RoPE variant, rotated by angle 0 (inv_freq
    zero: every rotation the identity): codebook bodies with outliers (`variant_for_codecs`)."""
    return (inv_freq is None and _is_packed(keys) and _is_nuq(keys.codec, values.codec)
            and _keeps_outliers(keys.codec, values.codec))


def _is_nuq(kc, vc) -> bool:
    """KVQuant's pair the kernel serves: codebook keys with per-channel thresholds, values with per-token ones."""
    return kc.kind is CodecKind.CODEBOOK_CHANNEL and vc.kind is CodecKind.CODEBOOK_TOKEN


def variant_for_codecs(key_codec, value_codec, head_dim: int, gqa: int, rope: bool = False) -> Variant:
    """The kernel variant for bodies of these codecs, packed in the runtime's layouts (kvcal.packing.layout_for) with
    outliers per KV head of head_dim channels: ChannelBlockUniform keys with TokenUniform values, nuq keys and
    values (`_is_nuq`), or SKVQ's channel groups on both sides (pre-RoPE keys, each KV head's channels in at most
    GROUP_SLOTS groups per side), each side's codes of the widths the kernel reads (the two may differ); rope: the
    keys are pre-RoPE."""
    kc, vc = key_codec, value_codec
    uniform = kc.kind is CodecKind.UNIFORM_CHANNEL and vc.kind is CodecKind.UNIFORM_TOKEN
    groups = kc.kind is CodecKind.PERMUTED_GROUPS and vc.kind is CodecKind.PERMUTED_GROUPS
    if not (uniform or groups or _is_nuq(kc, vc)):
        raise KvcalError("the tensor-core kernel reads uniform per-channel keys with per-token values, codebook keys with "
                         "per-channel thresholds and values with per-token ones, or SKVQ's channel groups on both sides")
    if groups and (float(kc.bits) != int(kc.bits) or float(vc.bits) != int(vc.bits)):
        raise KvcalError(f"the tensor-core kernel reads whole-bit codes, not {kc.bits} / {vc.bits}-bit channel groups")
    value_bits = int(vc.bits) if int(vc.bits) != int(kc.bits) else 0
    if groups:
        if kc.fp8 != vc.fp8:
            raise KvcalError("the tensor-core kernel reads channel groups whose keys and values store parameters alike (fp16 or fp8)")
        if not rope:
            raise KvcalError("the tensor-core kernel reads channel groups with pre-RoPE keys (SKVQ's)")
        most = max(int(slots.max()) + 1 for slots, _ in (head_group_slots(c, head_dim) for c in (kc, vc)))
        if most > GROUP_SLOTS:
            raise KvcalError(f"a KV head's channels fall in {most} parameter groups; the tensor-core kernel reads at most {GROUP_SLOTS}")
        v = Variant(head_dim, int(kc.bits), 0, head_dim, gqa, True, value_bits=value_bits, channel_groups=2 if kc.fp8 else 1)
    elif uniform:
        v = Variant(head_dim, int(kc.bits), kc.group, vc.group, gqa, rope, value_bits=value_bits)
    else:
        outliers = _keeps_outliers(kc, vc)
        if outliers and OUTLIER_TILE_TOKENS != STAGE_TOKENS:
            raise KvcalError(f"the tensor-core kernel reads outliers in tiles of {STAGE_TOKENS} rows")
        # post-RoPE keys with outliers: the pre-RoPE variant (its outlier pass patches keys as it dequantizes them),
        # rotating them by angle 0 (`constant_operands`)
        v = Variant(head_dim, int(kc.bits), 0, head_dim, gqa, rope or outliers, codebook=True, outliers=outliers, value_bits=value_bits)
    v.check()
    return v


def variant_for(keys, values, head_dim: int, gqa: int, rope: bool = False) -> Variant:
    """The kernel variant for a pair of stores: both Fp16Rows, or PackedRows of codecs variant_for_codecs serves, in
    the layout it reads ("planes3" for 3 bits, else "lsb"), outliers kept per KV head of head_dim channels; rope: the
    keys are pre-RoPE."""
    if not _is_packed(keys) and not _is_packed(values):
        v = Variant(head_dim, 16, 0, 0, gqa, rope)
        v.check()
        return v
    if not (_is_packed(keys) and _is_packed(values)):
        raise KvcalError("keys and values must both be fp16 rows or both packed")
    for store in (keys, values):
        layout = "planes3" if int(store.codec.bits) == 3 else "lsb"
        if store.layout != layout:
            raise KvcalError(f"the tensor-core kernel reads {store.codec.bits}-bit codes in the '{layout}' packing")
    if any(s.keeps_outliers and s.head_dim != head_dim for s in (keys, values)):
        raise KvcalError(f"the tensor-core kernel reads outliers per KV head of {head_dim} channels")
    return variant_for_codecs(keys.codec, values.codec, head_dim, gqa, rope)


def head_group_slots(codec, head_dim: int) -> tuple[np.ndarray, list[list[int]]]:
    """SKVQ's channel groups per KV head, as the kernel reads them: the slot of every channel of the KV width among
    its head's groups (int32, (width,)), and per head the parameter column of each of its slots, in column order."""
    group = channel_slots_and_groups(codec, "cpu")[1].numpy()
    heads = group.reshape(-1, head_dim)
    columns = [sorted(set(row.tolist())) for row in heads]
    slots = np.concatenate([np.searchsorted(np.array(c), row) for c, row in zip(columns, heads)]).astype(np.int32)
    return slots, columns


def group_tables(key_codec, value_codec, head_dim: int) -> torch.Tensor:
    """The kernel's channel group tables (decode_tc's `codebooks` with channel groups), int32: per side (keys, values)
    and KV head the parameter column of each of its GROUP_SLOTS slots (0 past the used ones), per side and KV head how
    many slots it uses, per side the slot of every channel of the KV width."""
    made = [head_group_slots(c, head_dim) for c in (key_codec, value_codec)]
    columns = np.zeros((2, len(made[0][1]), GROUP_SLOTS), dtype=np.int32)
    counts = np.zeros((2, len(made[0][1])), dtype=np.int32)
    for side, (_, per_head) in enumerate(made):
        for h, cols in enumerate(per_head):
            columns[side, h, : len(cols)] = cols
            counts[side, h] = len(cols)
    return torch.from_numpy(np.concatenate([columns.ravel(), counts.ravel(), made[0][0], made[1][0]]))


def _leads(keys, values) -> list[int | None]:
    """Per sequence, how many rows before its first live row the kernel reads (the rows it reads first are multiples of
    both stores' alignment: kvcal.runtime.store.PackedRows.aligned, key blocks and outlier tiles; fp16 rows from the
    live one), or None where K's and V's live rows sit differently past those multiples (after compactions that
    moved them by different multiples of a larger alignment)."""
    if not _is_packed(keys):
        return [0] * len(keys.head)
    aligned = math.lcm(keys.aligned, values.aligned)
    if keys.codec.kind is CodecKind.PERMUTED_GROUPS:  # whole chunks of the parameter runs
        aligned = math.lcm(aligned, PARAMETER_CHUNK_TOKENS)
    return [k % aligned if k % aligned == v % aligned else None for k, v in zip(keys.head, values.head)]


def _stores_lengths(keys, values, lengths: list[int] | None) -> list[int]:
    """Tokens per sequence: lengths (the first lengths[b] live tokens) checked against the stores, or all."""
    stored = [min(k, v) for k, v in zip(keys.length, values.length)]
    if lengths is None:
        if list(keys.length) != list(values.length):
            raise KvcalError("keys and values hold different numbers of tokens")
        return stored
    if any(n > s for n, s in zip(lengths, stored)):
        raise KvcalError(f"lengths {lengths} exceed the stored tokens {stored}")
    return list(lengths)


def _value_parameter_strides(scale: torch.Tensor | None, zero: torch.Tensor | None) -> tuple[np.int64, np.int64]:
    """(sequence, group) strides in elements of per-token parameters (batch, rows, groups), which the kernel copies in
    16-byte chunks (8 fp16 tokens, 16 fp8 ones): each group's run along the tokens (kvcal.runtime.store), 16-byte
    aligned."""
    if scale is None or scale.numel() == 0:
        return np.int64(0), np.int64(0)
    per_chunk = 16 // scale.element_size()
    aligned = (scale.stride(0) % per_chunk == 0 and scale.stride(2) % per_chunk == 0 and scale.data_ptr() % 16 == 0
               and zero.data_ptr() % 16 == 0)
    if scale.stride() != zero.stride() or scale.stride(1) != 1 or not aligned:
        raise KvcalError("the tensor-core kernel reads per-token parameters as a store keeps them: each group "
                         "along the tokens, 16-byte aligned (kvcal.runtime.store.PackedRows)")
    return np.int64(scale.stride(0)), np.int64(scale.stride(2))


def _code_strides(data: torch.Tensor, kv_heads: int) -> tuple[np.int64, np.int64, np.int64]:
    """(sequence, KV head, row) strides in bytes of a body's codes as the kernel reads them: fp16 rows (batch, capacity,
    width), or PackedRows' words (batch, capacity, pieces, words a piece) with one piece a KV head, or one a row, its
    KV heads side by side. Each KV head's codes of a row lie together (its piece's words, or its slice of the row)."""
    if data.numel() == 0:
        return np.int64(0), np.int64(0), np.int64(0)
    size = data.element_size()
    pieces = data.shape[2] if data.dim() == 4 else 1
    if data.stride(-1) != 1 or pieces not in (1, kv_heads):
        raise KvcalError("the tensor-core kernel reads a body whose rows are whole or cut in one piece a KV head, each "
                         "piece's words together")
    head = data.stride(2) if pieces > 1 else data.shape[-1] // kv_heads
    return np.int64(data.stride(0) * size), np.int64(head * size), np.int64(data.stride(1) * size)


def _strides(t: torch.Tensor | None) -> tuple[np.int64, np.int64]:
    """(sequence, row) strides of a buffer in elements, as the kernel's long long arguments."""
    if t is None or t.numel() == 0:
        return np.int64(0), np.int64(0)
    return np.int64(t.stride(0)), np.int64(t.stride(1))


def rope_row_start(delta, head_dim: int):
    """tc::rope_row_start: the rotation table's first word of token offset delta (ints or an array of them): rows of
    D / 2 words, 16 words of padding after each odd one."""
    return delta * (head_dim // 2) + (delta + 1) // 2 * 16


def rope_channels(head_dim: int, bits: int, codebook: bool) -> np.ndarray:
    """tc::key_channel's pre-RoPE mapping for the first halves: [lane part t][frequency pair q][element e] -> the
    channel (= frequency index) in [0, head_dim / 2); the pair's partners are the same + head_dim / 2."""
    t, q, e = np.meshgrid(np.arange(4), np.arange(head_dim // 16), np.arange(2), indexing="ij")
    if codebook:  # tc::pair_code: neighbours
        return t * (head_dim // 8) + 2 * q + e
    codes = 32 // bits
    half = codes // 2
    return t * (head_dim // 8) + (q // half) * codes + q % half + e * half


def _half_words(x: np.ndarray) -> np.ndarray:
    """fp16 pairs (last axis: 2) as uint32 words, element 0 in the low half."""
    bits16 = x.astype(np.float16).view(np.uint16).astype(np.uint32)
    return bits16[..., 0] | bits16[..., 1] << 16


CODEBOOK_WORDS = 16  # a side of the kernel's codebooks operand (tc::CODEBOOK_WORDS): the largest codebook's entries


def codebook_entries(codebook: torch.Tensor) -> torch.Tensor:
    """A side of the kernel's codebooks operand: CODEBOOK_WORDS int32 words, word x the fp16 bits of entry x (zero
    past the codebook). The kernel makes the side's tc::EntryPlanes of them, and its outlier pass reads the first and
    last entries."""
    if len(codebook) not in (4, 8, 16):
        raise KvcalError(f"the tensor-core kernel's codebook tables hold 2-, 3- or 4-bit codebooks, not {len(codebook)} entries")
    words = np.zeros(CODEBOOK_WORDS, dtype=np.uint32)
    words[: len(codebook)] = codebook.double().cpu().numpy().astype(np.float16).view(np.uint16)
    return torch.from_numpy(words.view(np.int32).copy())


def rope_table(inv_freq: torch.Tensor, head_dim: int, bits: int, codebook: bool = False) -> torch.Tensor:
    """The kernel's rotation table, as the int32 image of its shared memory (tc::rope_pair_word): for each token
    offset delta < 64 in a stage and lane part t, the fp16 pairs {cos, sin}(delta theta) of the lane's frequency pairs,
    from float64 angles."""
    channels = rope_channels(head_dim, bits, codebook)  # (4, D/16, 2)
    delta = np.arange(STAGE_TOKENS)[:, None, None, None]
    angles = delta * inv_freq.double().cpu().numpy()[channels][None]  # (64, 4, D/16, 2)

    d_, t_, q_ = np.meshgrid(np.arange(STAGE_TOKENS), np.arange(4), np.arange(head_dim // 16), indexing="ij")
    word = rope_row_start(d_, head_dim) + ((q_ >> 1) * 4 + t_) * 4 + 2 * (q_ & 1)
    table = np.zeros(rope_row_start(STAGE_TOKENS, head_dim), dtype=np.uint32)
    table[word] = _half_words(np.cos(angles))
    table[word + 1] = _half_words(np.sin(angles))
    return torch.from_numpy(table.view(np.int32).copy())


def constant_operands(keys, values, head_dim: int, device, inv_freq: torch.Tensor | None = None) -> dict:
    """The operands that stay as the stores grow, on `device`: codebook keys' per-channel scale and zero (the whole
    sequence's key block) and the two codebook tables; inv_freq and the rotation table for pre-RoPE keys (zeros where
    post-RoPE keys take the pre-RoPE variant: `rotates_by_zero`)."""
    out = {}
    if _is_packed(keys) and keys.codec.kind in CODEBOOKS:  # kvcal.quantizers.denormalize's scale and zero
        lo, hi = keys.codec.lo.float(), keys.codec.hi.float()
        out["key_scale"] = ((hi - lo) / 2).clamp(min=1e-8).half().to(device)
        out["key_zero"] = ((hi + lo) / 2).half().to(device)
        out["codebooks"] = torch.cat((codebook_entries(keys.codec.codebook), codebook_entries(values.codec.codebook))).to(device)
    groups = _is_packed(keys) and keys.codec.kind is CodecKind.PERMUTED_GROUPS
    if groups:
        out["codebooks"] = group_tables(keys.codec, values.codec, head_dim).to(device)
    if rotates_by_zero(keys, values, inv_freq):
        inv_freq = torch.zeros(head_dim // 2)
    if inv_freq is not None:
        out["freq"] = inv_freq.to(device=device, dtype=torch.float32).contiguous()
        if not groups:  # (channel groups rotate their keys as they dequantize them)
            out["table"] = rope_table(inv_freq, head_dim, int(keys.codec.bits), _is_packed(keys) and keys.codec.kind in CODEBOOKS).to(device)
    return out


class StoreOperands(NamedTuple):
    """decode_tc's arguments that follow from a launch's stores and its layer, the same at every step until a store
    replaces a buffer (its `moves`): three runs, between which the step's own arguments go (`launch_operands`)."""

    bodies: tuple  # the key and value codes (fp16 rows), the key scale and zero, the value scale and zero
    tables: tuple  # inv_freq, the rotation table, the codebook or channel group tables
    rest: tuple  # the outliers' buffers, the buffers' strides, the outliers' strides, kv_heads
    scale_log2: float
    softcap_log2: float  # the scores' soft-cap in log2 units, 0.0 where they are not capped

    def converted(self) -> StoreOperands:
        """The same as the kernel's argument values (`_arg`)."""
        return StoreOperands(*(tuple(map(_arg, run)) for run in (self.bodies, self.tables, self.rest)), _arg(self.scale_log2),
                             _arg(self.softcap_log2))


def store_operands(keys, values, kv_heads: int, scaling: float, constants: dict, inv_freq: torch.Tensor | None = None,
                   attention_scaling: float = 1.0, softcap: float | None = None) -> StoreOperands:
    """The stores' part of decode_tc's arguments (see `operands`); their buffers checked as the kernel reads them.
    softcap: the layer's scores soft-capped (kvcal.kv.softcapped), None where they are not."""
    packed = _is_packed(keys)
    codebook = packed and keys.codec.kind in CODEBOOKS
    k_data, v_data = (keys.words, values.words) if packed else (keys.data, values.data)
    groups = packed and keys.codec.kind is CodecKind.PERMUTED_GROUPS
    key_parameters = keys.token if groups else keys.blocks if packed else {}  # channel groups: per token, like values'
    ks, kz = key_parameters.get("scale"), key_parameters.get("zero")
    vs = values.token.get("scale") if packed else None
    vz = values.token.get("zero") if packed else None
    if codebook:  # keys: one block of per-channel scale and zero for the whole sequence; values: per-token lo, hi
        ks, kz = constants["key_scale"], constants["key_zero"]
        vs, vz = values.token.get("lo"), values.token.get("hi")  # none yet in an empty body
    _check_contiguous(*(() if groups else (ks, kz)))  # (runs along the tokens: strides checked)
    k_seq, k_head, k_row = _code_strides(k_data, kv_heads)
    v_seq, v_head, v_row = _code_strides(v_data, kv_heads)
    if groups:  # [sequence][column][token], as the values'
        kp_seq, kp_row = _value_parameter_strides(ks, kz)
    else:
        kp_seq, kp_row = _strides(ks) if not codebook else (np.int64(0), np.int64(0))  # one block, copied once
    vp_seq, vp_group = _value_parameter_strides(vs, vz)
    if inv_freq is not None:
        scaling = scaling * attention_scaling  # cos and sin scaled (transformers' attention_scaling): the query carries it
    k_outliers, v_outliers = _outlier_operands(keys), _outlier_operands(values)
    return StoreOperands((k_data, v_data, ks, kz, vs, vz), (constants.get("freq"), constants.get("table"), constants.get("codebooks")),
                         (*k_outliers[:4], *v_outliers[:4], k_seq, k_head, k_row, v_seq, v_head, v_row, kp_seq, kp_row,
                          vp_seq, vp_group, *k_outliers[4:], *v_outliers[4:], kv_heads), float(scaling * LOG2E),
                         float((softcap or 0.0) * LOG2E))


def step_operands(query, meta, out_partial, lse_partial, per_split: int, split_offset: int, merge: tuple | None = None,
                  segments: tuple | None = None, row_first: torch.Tensor | None = None) -> tuple:
    """decode_tc's arguments that change from step to step (see `operands`), in the order `launch_operands` takes them."""
    return (query, meta, out_partial, lse_partial, per_split, split_offset, out_partial.shape[2], *(merge or (None, None)),
            *(segments or (None, None, None, 0)), row_first)


def launch_operands(stores: StoreOperands, step: tuple) -> tuple:
    """decode_tc's arguments in order: the stores' runs with the step's own (`step_operands`), as given (tensors, or
    already the kernel's argument values)."""
    query, meta, out_partial, lse_partial, per_split, split_offset, total_splits, *merge_and_segments = step
    return (query, *stores.bodies, meta, *stores.tables, out_partial, lse_partial, *stores.rest, per_split, split_offset,
            total_splits, stores.scale_log2, stores.softcap_log2, *merge_and_segments)


def operands(query: torch.Tensor, keys, values, kv_heads: int, scaling: float, per_split: int, split_offset: int,
             out_partial: torch.Tensor, lse_partial: torch.Tensor, meta: torch.Tensor, inv_freq: torch.Tensor | None = None,
             attention_scaling: float = 1.0, constants: dict | None = None, merge: tuple | None = None,
             segments: tuple | None = None, row_first: torch.Tensor | None = None) -> tuple:
    """decode_tc's arguments, in order: tensors (passed by pointer) and Python ints / floats. meta: the int32
    (batch, 7) tensor of `meta_rows`; inv_freq (head_dim / 2) for pre-RoPE keys. The launch's splits write slots
    split_offset .. of the partial buffers (batch, heads, total slots[, head_dim]). constants: `constant_operands`
    (made here when None). merge: (out, arrivals) where the launch merges every slot into out (batch, heads,
    head_dim) float32 (the kernel's fused merge; arrivals: kvcal.runtime.kernels.arrival_counters), None where it
    leaves the slots. segments: (descriptor, meta, positions, splits) where the launch's last `splits` blocks along the
    sequence attend its tokens beside the served body rows (fp16 rows, and uniform bodies' rows one side holds alone:
    `segment_blocks_read_bodies`; a kvcal.runtime.kernels.Segments descriptor, the segments' meta (segments.cuh's
    MetaField), each sequence's position of its first stored token), into the slots after the body's; None: no segment
    blocks. row_first: None, or the int32 (2, batch, heads) of each query row's first body row and first segment
    token it sees (decode_attention_tc.cu). Tensors must be contiguous and on the kernel's device."""
    if constants is None:
        constants = constant_operands(keys, values, query.shape[-1], query.device, inv_freq)
    _check_contiguous(query, meta, out_partial, lse_partial, row_first)
    stores = store_operands(keys, values, kv_heads, scaling, constants, inv_freq, attention_scaling)
    return launch_operands(stores, step_operands(query, meta, out_partial, lse_partial, per_split, split_offset, merge, segments,
                                                 row_first))


def _check_contiguous(*tensors: torch.Tensor | None) -> None:
    if any(t is not None and t.numel() and not t.is_contiguous() for t in tensors):
        raise KvcalError("the tensor-core kernel reads contiguous buffers")


def _outlier_operands(store) -> tuple:
    """A store's outliers as decode_tc reads them: positions, values, offset table, counts (None each where it keeps
    none), then the strides per (sequence, KV head) run of the first and the third, in elements."""
    if not getattr(store, "keeps_outliers", False):
        return None, None, None, None, np.int64(0), np.int64(0)
    return (store.outlier_positions, store.outlier_values, store.outlier_offsets, store.outlier_count,
            np.int64(store.outlier_positions.stride(1)), np.int64(store.outlier_offsets.stride(1)))


def meta_rows(keys, values, lengths: list[int] | None = None, positions: list[int] | None = None,
              visible: list[int] | None = None) -> list[list[int]]:
    """Per sequence, as the kernel reads them: the keys' first row, tokens, position of the first row (pre-RoPE keys),
    the key and value stores' rows from row 0 (their started outlier tiles), the first of the tokens the query sees,
    the values' first row. lengths: the live tokens attended (default all); positions: of each sequence's first live
    row; visible: its first live token the query sees (a sliding window; default 0). Packed bodies are read from their
    first live row rounded down to a multiple of both stores' alignment (`_leads`), the rows before it weighing
    nothing; positions then default to that row at 0."""
    n = _stores_lengths(keys, values, lengths)
    lead = _leads(keys, values)
    if any(e is None and c for e, c in zip(lead, n)):
        raise KvcalError("the key and value bodies' live rows sit differently in their blocks: the kernel reads them as one")
    lead = [e if c else 0 for e, c in zip(lead, n)]
    positions = lead if positions is None else [p - e for p, e in zip(positions, lead)]
    if len(positions) != len(n) or any(p < 0 or p + e + c >= 2**29 for p, e, c in zip(positions, lead, n)):
        raise KvcalError(f"positions {positions}: one per sequence, from 0, below 2^29 with the sequence's tokens")
    visible = [0] * len(n) if visible is None else list(visible)
    return [[kh - e, e + c if c else 0, p, kh + k, vh + v, e + s, vh - e]
            for kh, vh, e, c, p, k, v, s in zip(keys.head, values.head, lead, n, positions, keys.length, values.length, visible)]


def row_first_rows(meta: list[list[int]], visible: list[int], body: torch.Tensor, segment: torch.Tensor) -> torch.Tensor:
    """decode_tc's row_first on the host, (2, batch, heads) int32: each query row's first live body row it sees
    (`body`, counted as `visible` is), from row 0 as `meta_rows` counts its field (the body read from a lead before
    its first live row), then its first token of the segment blocks (`segment`)."""
    leads = torch.tensor([row[5] - first for row, first in zip(meta, visible)])[:, None]
    return torch.stack([body + leads, segment]).to(torch.int32)


def split_plan(lengths: list[int], pairs: int, slots: int, stage_tokens: int) -> tuple[int, int]:
    """(tokens per split, splits): splits of whole stages (the variant's stage_tokens), as many as one wave of `slots` resident blocks
    holds for `pairs` (sequence, KV head); more splits only where the pairs alone fill less than a wave. Measured on an
    H100 (B = 8, 8 KV heads, L = 32K; benchmarks/results/decode_tc_nvidia-h100-80gb-hbm3.md): one wave of long splits
    was 6-17% faster than 2048-token splits (two to four waves) for every quantized variant: a block's start (the
    query, the pipeline's first stages) and end (its partial output) are paid once per block."""
    longest = max(lengths, default=0)
    if longest == 0:
        return stage_tokens, 1
    wanted = max(1, slots // max(pairs, 1))
    per_split = math.ceil(math.ceil(longest / wanted) / stage_tokens) * stage_tokens
    return per_split, math.ceil(longest / per_split)


# ------------------------------------------------------------------------------------------------ CUDA (CuPy)

@functools.cache
def _module(name: str):
    """One module per kernel name: NVRTC compiles only the variants a process launches (all of them take minutes)."""
    import cupy

    options = (*src.OPTIONS, f"--include-path={src.KERNEL_DIR}")
    return cupy.RawModule(code=src.source(MODULE), options=options, name_expressions=[name])


@functools.cache
def _function(name: str, shared: int = 0):
    function = _module(name).get_function(name)
    if shared > 48 * 1024:  # beyond the default dynamic shared memory: opt in (cuFuncSetAttribute)
        function.max_dynamic_shared_size_bytes = shared
    return function


@functools.cache
def resident_blocks(name: str, shared: int, device_index: int) -> int:
    """Blocks of `name` resident on the whole device at once."""
    import cupy

    function = _function(name, shared)
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    per_sm = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(function.kernel.ptr, THREADS, shared)
    return sms * max(int(per_sm), 1)


def _arg(x):
    if isinstance(x, torch.Tensor):
        return np.uint64(x.data_ptr())
    if x is None:
        return np.uint64(0)
    if isinstance(x, np.generic):  # already typed (the byte strides, long long)
        return x
    if isinstance(x, float):
        return np.float32(x)
    return np.int64(x) if abs(x) >= 2**31 else np.int32(x)


def prepare_decode_tc(query: torch.Tensor, keys, values, kv_heads: int, scaling: float, lengths: list[int] | None = None,
                      per_split: int | None = None, inv_freq: torch.Tensor | None = None, attention_scaling: float = 1.0,
                      positions: list[int] | None = None):
    """Everything on the host (variant, split plan, buffers, arguments); returns the function that launches the
    kernel (which merges its splits) and returns (batch, heads, head_dim) float32. Benchmarks time that function alone.
    inv_freq: the keys are pre-RoPE, each sequence's first row at positions[b] (default 0)."""
    batch, heads, head_dim = query.shape
    if heads % kv_heads:
        raise KvcalError(f"{heads} query heads do not divide into {kv_heads} KV heads")
    v = variant_for(keys, values, head_dim, heads // kv_heads, rope=inv_freq is not None)
    device = query.device
    rows = meta_rows(keys, values, lengths, positions)
    n = [row[1] for row in rows]  # tokens per sequence
    shared = v.shared_bytes()
    if per_split is None:
        per_split, splits = split_plan(n, batch * kv_heads, resident_blocks(v.name, shared, device.index or 0), v.stage_tokens)
    else:
        if per_split % v.stage_tokens:
            raise KvcalError(f"splits hold whole stages of {v.stage_tokens} tokens ({v.name})")
        splits = max(1, math.ceil(max(n, default=0) / per_split))
    query = query.float().contiguous()
    meta = torch.tensor(rows, dtype=torch.int32).to(device)
    out = torch.empty(batch, heads, head_dim, dtype=torch.float32, device=device)
    out_partial = torch.empty(batch, heads, splits, head_dim, dtype=torch.float32, device=device)
    lse_partial = torch.empty(batch, heads, splits, dtype=torch.float32, device=device)
    arrivals = kernels.arrival_counters(batch, kv_heads, device)
    args_source = operands(query, keys, values, kv_heads, scaling, per_split, 0, out_partial, lse_partial, meta, inv_freq,
                           attention_scaling, merge=(out, arrivals))
    args = tuple(_arg(x) for x in args_source)
    kernel = _function(v.name, shared)

    def run() -> torch.Tensor:
        kernels.launch(kernel, (splits, kv_heads, batch), (THREADS,), args, shared)
        return out

    run.splits, run.per_split = splits, per_split
    run.operands = args_source  # the kernel reads these buffers by pointer: they live as long as `run`
    run.outputs = (out, out_partial, lse_partial)  # what a launch writes (a check poisons them first)
    return run


def decode_attention_tc(query: torch.Tensor, keys, values, kv_heads: int, scaling: float, lengths: list[int] | None = None,
                        per_split: int | None = None, inv_freq: torch.Tensor | None = None, attention_scaling: float = 1.0,
                        positions: list[int] | None = None) -> torch.Tensor:
    """Attention of query (batch, heads, head_dim) over each sequence's stored tokens (or its first lengths[b]);
    (batch, heads, head_dim) float32, zeros for a sequence without tokens. Pre-RoPE keys: see prepare_decode_tc."""
    return prepare_decode_tc(query, keys, values, kv_heads, scaling, lengths, per_split, inv_freq, attention_scaling, positions)()


# ------------------------------------------------------------------------------------------------ in the cache

def segment_blocks_read_bodies(key_codec) -> bool:
    """Whether the segment blocks of a variant for these keys read body rows (segments.cuh's attend_rows dequantizes
    uniform ones: KIVI's and KVmix's), so that they take every token the body blocks do not; with other codecs they
    read fp16 rows only."""
    return key_codec.kind is CodecKind.UNIFORM_CHANNEL


class ServedBody:
    """The tensor-core kernel's share of one cache launch (kvcal.runtime.kernels.Segments whose two packed bodies it
    serves): per sequence, body rows 0 .. n - 1 with n the rows both sides' bodies hold, where the two sides' fp16
    sinks are equally long (so those rows are the same tokens at the same positions); none elsewhere. The launch's
    segment blocks take its other tokens (kvcal.runtime.kernels.prepare_decode). Made once per launch
    (`serve`); the constant operands are made once per device, the stores' operands again only after a store
    replaced a buffer (`store_operands`). variants: per query heads of a pass (the GQA group, or
    kvcal.runtime.kernels.head_passes' parts of it), the kernel variant."""

    def __init__(self, segments, variants: dict[int, Variant], inv_freq: torch.Tensor | None, attention_scaling: float,
                 softcap: float | None):
        (self.key_sink, self.keys, _), (self.value_sink, self.values, _) = segments.keys, segments.values
        self.variants, self.inv_freq, self.attention_scaling, self.softcap = variants, inv_freq, attention_scaling, softcap
        self.segments_read_bodies = segment_blocks_read_bodies(self.keys.codec)
        self._constants: dict = {}
        self._stores: tuple | None = None  # (what they were made at, StoreOperands, converted)

    def store_operands(self, kv_heads: int, scaling: float, constants: dict) -> tuple[StoreOperands, StoreOperands]:
        """The stores' operands and their argument values, made again only after a store replaced a buffer."""
        made_at = (self.keys.moves, self.values.moves, kv_heads, scaling, id(constants))
        if self._stores is None or self._stores[0] != made_at:
            stores = store_operands(self.keys, self.values, kv_heads, scaling, constants, self.inv_freq, self.attention_scaling,
                                    self.softcap)
            self._stores = (made_at, stores, stores.converted())
        return self._stores[1], self._stores[2]

    def variant(self, gqa: int) -> Variant:
        """The variant of a pass of `gqa` query heads a KV head: serve's, or one more group size (a short step's
        queries are more query heads: kvcal.runtime.backends' stored_attention), which differs in nothing else."""
        if gqa not in self.variants:
            v = replace(next(iter(self.variants.values())), gqa=gqa)
            v.check()
            self.variants[gqa] = v
        return self.variants[gqa]

    def rows(self, batch: int) -> list[int]:
        """Live body rows served per sequence, from the first: none where the two sides' sinks differ or their live
        rows sit differently in their blocks (`_leads`)."""
        none = [0] * batch
        key_sink = self.key_sink.length if self.key_sink is not None else none
        value_sink = self.value_sink.length if self.value_sink is not None else none
        return [min(k, v) if ks == vs and lead is not None else 0
                for ks, vs, k, v, lead in zip(key_sink, value_sink, self.keys.length, self.values.length,
                                              _leads(self.keys, self.values))]

    def prepare(self, query: torch.Tensor, kv_heads: int, scaling: float, rows: list[int], positions: list[int], step,
                visible: list[int] | None = None, segments: tuple | None = None, row_first: tuple | None = None):
        """(splits, bind): the launch's split count, and bind(split_offset, out_partial, lse_partial, merge=None) -> the
        function that launches it (merge: `operands`' (out, arrivals) where it merges every slot). query: float32
        (batch, heads, head_dim) on the device; positions: of each sequence's first live body row; step: the decode
        step's shared uploads (kvcal.runtime.kernels.DecodeStep); visible: each sequence's first live body row the
        query sees (a sliding window; default 0); segments: `operands`' segment blocks (their splits counted in);
        row_first: (each query row's first live body row it sees, its first token of the segment blocks), each
        (batch, heads), where rows see tokens of their own (at least their sequence's `visible`)."""
        batch, heads, head_dim = query.shape
        v, device = self.variant(heads // kv_heads), query.device
        shared = v.shared_bytes()
        meta_list = meta_rows(self.keys, self.values, rows, positions if v.rope else None, visible)
        per_split, splits = split_plan([row[1] for row in meta_list], batch * kv_heads,
                                       resident_blocks(v.name, shared, device.index or 0), v.stage_tokens)
        meta = step.shared(("tensor-core meta", tuple(map(tuple, meta_list))), lambda: upload(meta_list, device, torch.int32))
        key = str(device)
        if key not in self._constants:
            self._constants[key] = constant_operands(self.keys, self.values, head_dim, device, self.inv_freq)
        constants = self._constants[key]
        kernel = _function(v.name, shared)
        splits += segments[3] if segments is not None else 0
        if row_first is not None:
            row_first = upload(row_first_rows(meta_list, visible or [0] * batch, *row_first).numpy(), device, torch.int32)

        def bind(split_offset: int, out_partial: torch.Tensor, lse_partial: torch.Tensor, merge: tuple | None = None):
            _check_contiguous(query, meta, out_partial, lse_partial)
            stores, store_args = self.store_operands(kv_heads, scaling, constants)
            step = step_operands(query, meta, out_partial, lse_partial, per_split, split_offset, merge, segments, row_first)
            source = launch_operands(stores, step)
            args = launch_operands(store_args, tuple(map(_arg, step)))

            def launch() -> None:
                kernels.launch(kernel, (splits, kv_heads, batch), (THREADS,), args, shared)

            launch.operands = source  # the kernel reads these tensors by pointer (meta among them): they live as long as it
            return launch

        return splits, bind


def serve(segments, heads: int, kv_heads: int, head_dim: int, inv_freq: torch.Tensor | None = None,
          attention_scaling: float = 1.0, softcap: float | None = None) -> ServedBody:
    """The tensor-core kernel's share of a cache launch (kvcal.runtime.kernels.Segments with a packed body or an
    Fp16Rows one per side); a KvcalError where no variant reads its bodies (kvcal.runtime.backends refuses such
    layers first). inv_freq: the keys are pre-RoPE; softcap: the layer's scores soft-capped (Gemma 2), or None."""
    keys, values = segments.keys[1], segments.values[1]
    if keys is None or values is None or heads % kv_heads:
        raise KvcalError("the tensor-core kernel serves launches with a body on both sides and whole GQA groups")
    variants = {gqa: variant_for(keys, values, head_dim, gqa, rope=inv_freq is not None)
                for gqa in set(kernels.head_passes(heads // kv_heads))}
    return ServedBody(segments, variants, inv_freq, attention_scaling, softcap)
