"""CUDA kernels (kernels/*.cu, CuPy RawModule) for the runtime cache: quantize-and-append into the stores
(append.cu) and the decode step's launch data for the tensor-core kernel (kvcal.runtime.tensor_core: one launch per
layer and step attends the bodies and the fp16 segments beside them, and merges its splits). The cache selects them
on its own for CUDA tensors where the layer's codecs and head counts have a kernel (`heads_refusal`,
`append_supported`, kvcal.runtime.backends); the others decode on the torch reference. A GQA group larger than one
launch takes (`MAX_GQA`) is decoded in passes over its query heads (`head_passes`), each reading the whole cache.

Torch tensors are shared with the kernels by pointer (no copy) and the kernels run on torch's current
stream. Per launch the host writes two small int arrays (store descriptors and per-sequence lengths);
the cache itself is never copied, transposed or concatenated.

Within a decode step nothing here waits for the device: small host arrays go up through pinned memory
without blocking (kvcal.runtime.store.upload); a store's descriptor is uploaded again only when one of its
buffers moved (Segments.descriptor); what the layers of a step share (position offsets, per-sequence lengths of
layers with the same layout, scratch buffers) is made once per step (DecodeStep);
appends encode the batch's rows with one launch straight into the stores (per-channel key blocks, which leave
the fp16 segment a whole block at a time, through a staging area scattered into them); the outlier kernel writes
straight into the stores' per-(sequence, KV head) outlier arrays, whose counts stay on the device, the host sizing
the arrays by an upper bound (kvcal.runtime.store.PackedRows.reserve_outlier_room); in a decode step one launch
per side finds, places and counts them (no torch operation places them). Only a bulk append (a prefill, more than
one token of a sequence) reads the number of outliers it made per (sequence, KV head), to size the arrays exactly.
"""

from __future__ import annotations

import enum
import functools
import math
import weakref
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from kvcal.errors import KvcalError
from kvcal.packing import OUTLIER_TILE_TOKENS, layout_for
from kvcal.quantizers import CodecKind
from kvcal.runtime import kernel_source as src

from kvcal.runtime.store import channel_slots_and_groups, row_index, started_tiles, upload

if TYPE_CHECKING:
    from kvcal.runtime.store import Fp16Rows, PackedRows

THREADS = 128  # append.cu's blocks
MAX_GQA = 8  # query heads per KV head one tensor-core launch serves (decode_attention_tc.cu: GQA 1 to 8)


def head_passes(group: int) -> list[int]:
    """The query heads of a GQA group per decode pass, in order: the fewest passes of at most MAX_GQA heads, as
    even as can be (16: [8, 8]; 12: [6, 6]; 11: [6, 5]). Each pass reads the whole cache."""
    passes = -(-group // MAX_GQA)
    return [group // passes + (i < group % passes) for i in range(passes)]


MAX_WIDTH, MAX_GROUPS = 4096, 1024  # kernels/append.cu
LOG2E = 1.4426950408889634
_LAYOUTS = src.enum_members("common.cuh", "Layout")
LAYOUT_IDS = {"lsb": {1: _LAYOUTS["LSB1"], 2: _LAYOUTS["LSB2"], 4: _LAYOUTS["LSB4"]}, "planes3": {3: _LAYOUTS["PLANES3"]},
              "kvmix10x3+1x2": {3: _LAYOUTS["KVMIX3"]}}  # layout -> bits -> enum Layout


def cuda_ready(device) -> bool:
    """True when `device` is a CUDA device and CuPy is installed."""
    if torch.device(device).type != "cuda":
        return False
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _module(name: str):
    import cupy

    options = (*src.OPTIONS, f"--include-path={src.KERNEL_DIR}")
    return cupy.RawModule(code=src.source(name), options=options, name_expressions=src.variants(name))


def _function(module: str, name: str):
    return _module(module).get_function(name)


def _ptr(tensor: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if tensor is None else tensor.data_ptr())


def launch(function, grid: tuple, block: tuple, args: tuple, shared: int = 0) -> None:
    """Launch a CuPy kernel on torch's current stream, with `shared` bytes of dynamic shared memory."""
    import cupy

    with _cupy_stream(cupy, torch.cuda.current_stream()):
        function(grid, block, args, shared_mem=shared)


def _cupy_stream(cupy, stream: torch.cuda.Stream):
    """torch's stream as a CuPy stream: by the CUDA stream protocol where both take it (CuPy 14 deprecates
    ExternalStream for it), else as ExternalStream of its handle."""
    if hasattr(cupy.cuda.Stream, "from_external") and hasattr(stream, "__cuda_stream__"):
        return cupy.cuda.Stream.from_external(stream)
    return cupy.cuda.ExternalStream(stream.cuda_stream)


CODEBOOKS = (CodecKind.CODEBOOK_CHANNEL, CodecKind.CODEBOOK_TOKEN)
_CODEC_IDS = {CodecKind.UNIFORM_TOKEN: src.UNIFORM_TOKEN, CodecKind.UNIFORM_CHANNEL: src.UNIFORM_CHANNEL,
              CodecKind.CODEBOOK_CHANNEL: src.CODEBOOK_CHANNEL, CodecKind.CODEBOOK_TOKEN: src.CODEBOOK_TOKEN,
              CodecKind.PERMUTED_GROUPS: src.PERMUTED_GROUPS}


def codec_id(codec) -> int | None:
    """The kernels' number for a codec's kind (kernels/common.cuh enum Codec), None where they read none."""
    return _CODEC_IDS.get(codec.kind)


def layout_id(codec, layout: str | None = None) -> int | None:
    """The kernels' number for a packing layout (by default the runtime's, kvcal.packing.layout_for) of the codec's
    code width (kernels/common.cuh enum Layout); None where they have none."""
    return LAYOUT_IDS.get(layout or layout_for(codec.bits), {}).get(codec.bits)


def append_supported(codec, width: int, layout: str | None = None) -> bool:
    """Whether the CUDA append kernels encode a store of `codec` and `width` channels (not one of none, an MLA key on a
    layer without RoPE: nothing to launch for, the torch codec encodes its empty rows)."""
    cid = codec_id(codec)
    if cid is None or layout_id(codec, layout) is None or not 0 < width <= MAX_WIDTH:
        return False
    if cid == src.PERMUTED_GROUPS:
        return codec.clip.numel() <= MAX_GROUPS
    return cid != src.UNIFORM_TOKEN or math.ceil(width / codec.group) <= MAX_GROUPS


def heads_refusal(heads: int, kv_heads: int, head_dim: int) -> str | None:
    """Why the decode kernels do not serve a layer of these head counts, or None."""
    if head_dim not in src.HEAD_DIMS:
        return f"they read head_dim {', '.join(map(str, src.HEAD_DIMS))}, not {head_dim}"
    if heads % kv_heads:
        return f"{heads} query heads do not divide into {kv_heads} KV heads"
    return None


# ---------------------------------------------------------------------------------------------------------
# quantize-and-append

def parameter_dtype(codec) -> torch.dtype:
    """The dtype of a codec's stored parameters: fp16, or fp8 e4m3 for SKVQ --fp8."""
    return torch.float8_e4m3fn if codec_id(codec) == src.PERMUTED_GROUPS and codec.fp8 else torch.float16


def parameter_columns(codec, width: int) -> tuple[dict[str, int], dict[str, int]]:
    """The parameters a codec stores (per token, per block): name -> columns, as its torch encode makes them."""
    cid = codec_id(codec)
    if cid == src.UNIFORM_TOKEN:
        groups = math.ceil(width / codec.group)
        return {"scale": groups, "zero": groups}, {}
    if cid == src.UNIFORM_CHANNEL:
        return {}, {"scale": width, "zero": width}
    if cid == src.CODEBOOK_TOKEN:
        return {"lo": 1, "hi": 1}, {}
    if cid == src.PERMUTED_GROUPS:
        return {"scale": codec.clip.numel(), "zero": codec.clip.numel()}, {}
    return {}, {}

_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # codec -> {device: tables}, gone with the codec
_SKVQ: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # SKVQ codec -> {device: its tables}


def _skvq_tables(codec, device) -> tuple[torch.Tensor, ...]:
    """SKVQ's tables as the kernels read them, on `device` (their pointers stay valid while the codec lives; made once
    per codec and device): the group of every channel, the permutation and group starts (int32), the clipping."""
    per_device = _SKVQ.setdefault(codec, {})
    key = str(device)
    if key not in per_device:
        per_device[key] = (channel_slots_and_groups(codec, device)[1].to(torch.int32).contiguous(),
                           codec.permutation.to(device, torch.int32).contiguous(), codec.starts.to(device, torch.int32).contiguous(),
                           codec.clip.to(device, torch.float32).contiguous())
    return per_device[key]


def channel_groups(codec, device) -> torch.Tensor:
    """SKVQ's parameter group of every channel, int32 on `device`."""
    return _skvq_tables(codec, device)[0]


def codec_tables(store: PackedRows) -> dict:
    """Codebook, its midpoints and fixed thresholds of a store's codec as float32 on its device (made once per codec)."""
    per_device = _TABLES.setdefault(store.codec, {})
    key = str(store.device)
    if key not in per_device:
        codec, tables = store.codec, {}
        if codec.kind in CODEBOOKS:
            codebook = codec.codebook.to(store.device, torch.float32).contiguous()
            tables = {"codebook": codebook, "midpoints": ((codebook[1:] + codebook[:-1]) / 2).contiguous()}
            if codec.lo is not None:
                tables["lo"] = codec.lo.to(store.device, torch.float32).contiguous()
                tables["hi"] = codec.hi.to(store.device, torch.float32).contiguous()
        per_device[key] = tables
    return per_device[key]


def encode_rows(store: PackedRows, seqs: list[int], starts: list[int], counts: list[int], x: torch.Tensor) -> None:
    """Quantize fp16 rows x (sum(counts), C), grouped by sequence, into rows starts[i].. of sequence seqs[i] of
    `store` (capacity reserved, parameter buffers allocated) with one launch for the whole batch: per-token codecs
    write each row in place (`_row_target`), per-channel blocks into a staging area then one indexed store per
    buffer. Outliers (codebook codecs) go into each sequence's arrays after its own, in row order, and the device
    counts (store.outlier_count) grow by as many: in a step of one token per sequence, found, placed and counted by
    one kernel in arrays sized by an upper bound (every element of every row), so that nothing waits for the device;
    in a bulk append, counted by the append kernel, placed by a prefix sum whose totals the host reads, and written
    by the outlier kernel."""
    codec, cid = store.codec, codec_id(store.codec)
    x = x.to(torch.float16).contiguous()
    rows, width = x.shape
    device = x.device
    target = row_index(seqs, starts, counts, device)
    words_per_row = np.int32(store.row_words)
    layout = np.int32(layout_id(codec, store.layout))
    if cid == src.UNIFORM_CHANNEL:
        blocks = rows // codec.group
        words = torch.empty(rows, store.row_words, dtype=torch.int32, device=device)
        scale = torch.empty(blocks, width, dtype=torch.float16, device=device)
        zero = torch.empty_like(scale)
        launch(_function("append.cu", "append_channel_block"), (blocks,), (THREADS,),
                (_ptr(x), np.int32(width), layout, np.int32(codec.group), _ptr(words), words_per_row, _ptr(scale), _ptr(zero)))
        block_target = row_index(seqs, [s // codec.group for s in starts], [c // codec.group for c in counts], device)
        store.words.index_put_(target, words.view(rows, store.pieces, -1))
        store.blocks["scale"].index_put_(block_target, scale)
        store.blocks["zero"].index_put_(block_target, zero)
        return
    to = _row_target(store, target)
    if cid in (src.UNIFORM_TOKEN, src.PERMUTED_GROUPS):  # a scale and zero per (token, group of channels)
        scale, zero = store.token["scale"], store.token["zero"]
        outputs = (*to.rows, *to.words, *to.parameters, _ptr(store.words), words_per_row, _ptr(scale), _ptr(zero),
                   np.int32(scale.shape[2]))
        if cid == src.UNIFORM_TOKEN:
            launch(_function("append.cu", "append_token_uniform"), (rows,), (THREADS,),
                    (_ptr(x), np.int32(width), layout, np.int32(codec.group), *outputs))
        else:
            group_of_channel, permutation, starts, clip = _skvq_tables(codec, device)
            name = "append_permuted_groups_fp8" if codec.fp8 else "append_permuted_groups"
            launch(_function("append.cu", name), (rows,), (THREADS,),
                    (_ptr(x), np.int32(width), layout, _ptr(permutation), _ptr(starts), _ptr(clip), _ptr(group_of_channel),
                     *outputs))
        return
    tables = codec_tables(store)
    token_lo, token_hi = store.token.get("lo"), store.token.get("hi")  # per-token thresholds (None: per channel)
    keep = codec.outlier_fraction > 0
    t = 1.0 - codec.outlier_fraction / 2
    q_low, q_high = np.float32(1.0 - t), np.float32(t)  # float32, as kvcal.quantizers computes them
    step = keep and max(counts) == 1  # a decode step: the same launch places the outliers (_step_outliers)
    # outliers per (row, KV head), for a bulk append's placement
    found = torch.zeros(rows, store.kv_heads, dtype=torch.int32, device=device) if keep and not step else None
    launch(_function("append.cu", "append_codebook"), (rows,), (THREADS,),
            (_ptr(x), np.int32(width), np.int32(store.head_dim or width), layout, _ptr(tables.get("lo")), _ptr(tables.get("hi")),
             q_low, q_high, np.int32(keep), _ptr(tables["midpoints"]), *to.rows, *to.words, *to.parameters[:2],
             _ptr(store.words), words_per_row,
             _ptr(token_lo), _ptr(token_hi), _ptr(found), *_step_outliers(store, seqs, rows, step)))
    if step:
        store.snapshot_outlier_count()
    elif keep:
        _place_outliers(store, seqs, starts, counts, x, to, found, tables, token_lo, token_hi)


class RowTarget(NamedTuple):
    """append.cu's RowTarget, as the kernels' arguments: the rows' index arrays; where their code words go (sequence,
    row and piece strides, words a piece); their per-token parameters' sequence, row and column strides (0 where the
    store keeps none), in elements."""

    rows: tuple
    words: tuple
    parameters: tuple


def _row_target(store: PackedRows, target: tuple[torch.Tensor, torch.Tensor]) -> RowTarget:
    """append.cu's RowTarget of rows (sequence, row) = target in `store`."""
    parameters = next(iter(store.token.values()), None)
    strides = parameters.stride() if parameters is not None else (0, 0, 0)
    words = store.words
    return RowTarget((_ptr(target[0]), _ptr(target[1])), (*map(np.int64, words.stride()[:3]), np.int32(words.shape[3])),
                     tuple(map(np.int64, strides)))


def _step_outliers(store: PackedRows, seqs: list[int], rows: int, step: bool) -> tuple:
    """append_codebook's last arguments: in a decode step (row i: the one new row of sequence seqs[i]) the outlier
    arrays it places the rows' outliers in itself, found, placed and counted on the device, the host only growing the
    arrays for an upper bound (every element of every row); else none."""
    if not step:
        return (np.int32(0), _ptr(None), _ptr(None), np.int32(0), np.int32(0), _ptr(None), _ptr(None))
    store.reserve_outlier_room(seqs, [[store.head_dim] * store.kv_heads] * rows)
    return (np.int32(OUTLIER_TILE_TOKENS), _ptr(store.outlier_count), _ptr(store.outlier_offsets),
            np.int32(store.outlier_offsets.shape[2]), np.int32(store.outlier_positions.shape[2]), _ptr(store.outlier_positions),
            _ptr(store.outlier_values))


def _place_outliers(store: PackedRows, seqs, starts, counts, x, to, found, tables, token_lo, token_hi) -> None:
    """Write the outliers that append_codebook counted (found: per row of x and KV head; to: the rows' _row_target)
    into each (sequence, KV head) run after its own, and the offsets of the tiles this append starts: where a row's
    outliers of a head go is the run's count before the append plus the group's earlier rows' outliers of that head."""
    rows, width = x.shape
    device = x.device
    row_ends = torch.cumsum(found, 0, dtype=torch.int32)
    row_firsts = row_ends - found  # per (row, head): the outliers of earlier rows of x
    # per group (sequence): its first and last row in x
    last_rows = [int(end) - 1 for end in np.cumsum(counts)]
    first_rows = [end - c + 1 for end, c in zip(last_rows, counts)]
    tile_group, tile = started_tiles(starts, counts)
    tile_rows = np.array(first_rows, dtype=np.int64)[tile_group] + tile * OUTLIER_TILE_TOKENS - np.array(starts, dtype=np.int64)[tile_group]
    groups = upload([first_rows, last_rows, seqs], device)
    group_of_row = upload(np.repeat(np.arange(len(counts)), counts), device)
    tiles = upload(np.stack([tile_group, np.array(seqs, dtype=np.int64)[tile_group], tile, tile_rows]), device)
    group_firsts = row_firsts.index_select(0, groups[0])  # (groups, heads)
    per_group = row_ends.index_select(0, groups[1]) - group_firsts
    most = per_group.tolist()  # a bulk append: the exact numbers, read once
    store.reserve_outlier_room(seqs, most)
    before = store.outlier_count.index_select(0, groups[2])  # (groups, heads): each run's count before this append
    # where row r's outliers of head h start in their run, less r's outliers of heads before h (the kernel adds the rank in r)
    first_slot = (before - group_firsts).index_select(0, group_of_row) + row_firsts - (torch.cumsum(found, 1, dtype=torch.int32) - found)
    launch(_function("append.cu", "append_codebook_outliers"), (rows,), (32,),
            (_ptr(x), np.int32(width), np.int32(store.head_dim), np.int32(OUTLIER_TILE_TOKENS), _ptr(tables.get("lo")),
             _ptr(tables.get("hi")), _ptr(token_lo), _ptr(token_hi), *to.rows, *to.parameters[:2], _ptr(first_slot),
             np.int32(store.outlier_positions.shape[2]), _ptr(store.outlier_positions), _ptr(store.outlier_values)))
    # a started tile's offset: its run's count before the tile's first row
    offsets = before.index_select(0, tiles[0]) + row_firsts.index_select(0, tiles[3]) - group_firsts.index_select(0, tiles[0])
    store.outlier_offsets[tiles[1], :, tiles[2]] = offsets
    store.outlier_count.index_add_(0, groups[2], per_group)
    store.snapshot_outlier_count()


class AppendKernels:
    """The encoder a PackedRows on CUDA quantizes with (kvcal.runtime.store): the append kernels of its codec.
    rows_together: the layout of its stores, each token's row whole or each KV head's rows together (the kernels read
    and write either)."""

    def __init__(self, rows_together: bool = True):
        self.rows_together = rows_together

    def parameter_columns(self, codec, width: int) -> tuple[dict[str, int], dict[str, int]]:
        return parameter_columns(codec, width)

    def parameter_dtype(self, codec) -> torch.dtype:
        return parameter_dtype(codec)

    def encode_rows(self, store: PackedRows, seqs: list[int], starts: list[int], counts: list[int], x: torch.Tensor) -> None:
        encode_rows(store, seqs, starts, counts, x)


def append_encoder(codec, width: int, layout: str, device, rows_together: bool = True) -> AppendKernels | None:
    """The CUDA encoder for a store of `codec` on `device` laying rows out as `rows_together` says (AppendKernels),
    or None where the torch codec must do (CPU, no kernel)."""
    return AppendKernels(rows_together) if cuda_ready(device) and append_supported(codec, width, layout) else None


# ---------------------------------------------------------------------------------------------------------
# decode attention

# a side's descriptor and the per-sequence meta, field by field as segments.cuh's enums number them
SideField = enum.IntEnum("SideField", src.enum_members("segments.cuh", "SideField"))
MetaField = enum.IntEnum("MetaField", src.enum_members("segments.cuh", "MetaField"))
SIDE_FIELDS, META_FIELDS = int(SideField.SIDE_FIELDS), int(MetaField.META_FIELDS)
PARAMETERS = slice(SideField.PARAM0, SideField.PARAM_COLUMN + 1)  # what parameter_fields fills
SEGMENT_SPLIT_TOKENS = src.enum_members("segments.cuh", "SegmentShape")["SEGMENT_SPLIT_TOKENS"]  # per segment block


def side_descriptor(sink: Fp16Rows | None, body: PackedRows | None, recent: Fp16Rows | None) -> list[int]:
    """One side's descriptor (enum SideField); absent parts and buffers not yet allocated are 0."""
    F = SideField
    fields = [0] * SIDE_FIELDS
    if sink is not None:
        fields[F.SINK], fields[F.SINK_STRIDE] = sink.data.data_ptr(), sink.data.shape[1] * sink.data.shape[2]
    if recent is not None:
        fields[F.RECENT], fields[F.RECENT_STRIDE] = recent.data.data_ptr(), recent.data.shape[1] * recent.data.shape[2]
    if body is None:
        return fields
    codec, cid = body.codec, codec_id(body.codec)
    words = body.words
    fields[F.WORDS], fields[F.WORDS_STRIDE], fields[F.WORDS_PER_ROW] = words.data_ptr(), words.stride(0), words.stride(1)
    fields[F.PIECE_STRIDE], fields[F.PIECE_CHANNELS] = words.stride(2), body.width // body.pieces
    if cid == src.CODEBOOK_CHANNEL:  # fixed thresholds: one row of channels for every token and sequence
        tables = codec_tables(body)
        fields[PARAMETERS] = [tables["lo"].data_ptr(), tables["hi"].data_ptr(), 0, body.width, 1, 0, 1]
    else:
        params = body.token if cid in (src.UNIFORM_TOKEN, src.CODEBOOK_TOKEN, src.PERMUTED_GROUPS) else body.blocks
        names = ("lo", "hi") if cid == src.CODEBOOK_TOKEN else ("scale", "zero")
        extra = codec.group if cid in (src.UNIFORM_TOKEN, src.UNIFORM_CHANNEL) else 1
        fields[F.PARAM_EXTRA] = extra
        if names[0] in params:
            fields[PARAMETERS] = parameter_fields(params[names[0]], params[names[1]], extra)
    if cid == src.PERMUTED_GROUPS:
        fields[F.GROUP_OF_CHANNEL] = channel_groups(codec, body.device).data_ptr()
        fields[F.PARAM_FP8] = int(codec.fp8)
    if codec.kind in CODEBOOKS:
        fields[F.CODEBOOK] = codec_tables(body)["codebook"].data_ptr()
    if body.keeps_outliers:
        fields[F.OUTLIER_POSITIONS:F.OUTLIER_TILE_SHIFT + 1] = [
            body.outlier_positions.data_ptr(), body.outlier_values.data_ptr(), body.outlier_positions.shape[2],
            body.outlier_offsets.data_ptr(), body.outlier_offsets.shape[2], body.outlier_count.data_ptr(),
            OUTLIER_TILE_TOKENS.bit_length() - 1]
    fields[F.LAYOUT] = layout_id(codec, body.layout)
    return fields


def parameter_fields(first: torch.Tensor, second: torch.Tensor, extra: int) -> list[int]:
    """Fields PARAM0 .. PARAM_COLUMN of a side's two (batch, rows, columns) parameter tensors, a store's per-token or
    per-block ones (the two share their strides: kvcal.runtime.store.PackedRows._parameter); extra: PARAM_EXTRA."""
    if first.stride(0) >= 2**31:  # the kernels index a sequence's parameters with 32-bit offsets
        raise KvcalError(f"{first.stride(0)} parameters per sequence: the decode kernels take fewer than 2^31; use a shorter "
                         "cache or a larger quantization group")
    return [first.data_ptr(), second.data_ptr(), first.stride(0), first.shape[2], extra, first.stride(1), first.stride(2)]


def side_lengths(sink: Fp16Rows | None, body: PackedRows | None, recent: Fp16Rows | None, batch: int) -> list[list[int]]:
    """Per sequence: sink tokens, body tokens, first live recent row, recent tokens (outlier counts are read by the
    kernel from the store's device counts). The CUDA kernel's meta appends the body rows it skips (prepare_decode);
    the CPU kernel reads these four."""
    if sink is not None and any(sink.head):
        raise ValueError("a sink segment never drops tokens from its front")
    return [[sink.length[b] if sink else 0, body.length[b] if body else 0, recent.head[b] if recent else 0,
             recent.length[b] if recent else 0] for b in range(batch)]


class Segments:
    """What one decode-attention launch reads: per side (K, V) an fp16 sink, a packed body and an fp16 recent
    segment, any of them absent. Both sides hold the same tokens in the same order. Keep one per launch across
    steps (RuntimeLayer does): its descriptor is uploaded again only when a buffer moved."""

    def __init__(self, keys: tuple, values: tuple):
        self.keys, self.values = keys, values
        self._parts = [part for side in (keys, values) for part in side if part is not None]
        self._made: dict = {}  # what describe() made, with the stores' buffer moves it was made at

    def describe(self, name: str, make):
        """make() (a descriptor of the stores' buffers), made again only after a store replaced a buffer."""
        moves = [part.moves for part in self._parts]
        made = self._made.get(name)
        if made is None or made[0] != moves:
            made = self._made[name] = (moves, make())
        return made[1]

    def descriptor(self, device) -> torch.Tensor:
        """Both sides' descriptors (enum SideField order) on the device."""

        return self.describe("device", lambda: upload(side_descriptor(*self.keys) + side_descriptor(*self.values), device,
                                                      torch.int64))


def arrival_counters(batch: int, kv_heads: int, device) -> torch.Tensor:
    """The tensor-core kernel's fused-merge counters, one per (sequence, KV head), zero (each launch that merges leaves
    them so: decode_attention_tc.cu's merge_when_last)."""
    return torch.zeros(batch * kv_heads, dtype=torch.int32, device=device)


class DecodeStep:
    """What the decode-attention launches of every layer of one step share, made once: the position offsets on the
    device, per-sequence lengths per store layout (layers with the same segment lengths
    share one upload), the split scratch buffers and the fused merge's counters."""

    def __init__(self, device):
        self.device = device
        self._shared: dict = {}

    def shared(self, key, make):
        if key not in self._shared:
            self._shared[key] = make()
        return self._shared[key]

    def positions(self, position_offset: list[int]) -> torch.Tensor:
        """Each sequence's position of its first stored token, on the device (the sliding-window layers that dropped
        tokens have their own)."""
        return self.shared(("positions", tuple(position_offset)), lambda: upload(position_offset, self.device, torch.int32))

    def meta(self, key_lengths: list[list[int]], value_lengths: list[list[int]]) -> torch.Tensor:
        key = (tuple(map(tuple, key_lengths)), tuple(map(tuple, value_lengths)))
        return self.shared(("meta", key), lambda: upload([key_lengths, value_lengths], self.device, torch.int32))

    def arrivals(self, batch: int, kv_heads: int) -> torch.Tensor:
        return self.shared(("arrivals", batch, kv_heads), lambda: arrival_counters(batch, kv_heads, self.device))

    def scratch(self, batch: int, heads: int, splits: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.shared(("scratch", batch, heads, splits, head_dim), lambda: (
            torch.empty(batch, heads, splits, head_dim, dtype=torch.float32, device=self.device),
            torch.empty(batch, heads, splits, dtype=torch.float32, device=self.device)))


def prepare_decode(query: torch.Tensor, launches: list[Segments], kv_heads: int, scaling: float, position_offset: list[int],
                   served: list, step: DecodeStep | None = None, first: list[int] | None = None,
                   sinks: torch.Tensor | None = None, with_lse: bool = False, row_first: torch.Tensor | None = None):
    """Everything decode_attention does on the host (descriptors, lengths, buffers, split sizes); returns the
    function that launches the kernels and returns the output. Benchmarks time that function alone.
    served: per launch, the tensor-core kernel's share of it (kvcal.runtime.tensor_core.ServedBody: `rows` and
    `prepare`): its body blocks take the body rows both sides hold, its segment blocks the launch's other tokens
    (fp16 sinks and windows, and where they read the bodies, uniform codecs: the rows one side holds alone); the last
    launch merges every launch's splits. step: what the layers of a decode step share (made here when None);
    position_offset: each sequence's position of its first stored token.
    first: per sequence, its first stored token the query sees (a sliding window; default 0); the tokens before it
    are read and weigh nothing (a window drops whole blocks: kvcal.kv.window_dropped). A GQA group larger than one
    launch serves is decoded in passes over its query heads (`head_passes`). sinks: (heads,) attention sinks' logits,
    which join each row's softmax after the merge, from the splits' log-sum-exps the kernel leaves in its scratch.
    with_lse (no sinks): the function returns (output, each row's log-sum-exp of its scores (batch, heads), natural
    log, -inf where it saw no token). row_first (batch, heads): each query row's first stored token it sees, at
    least its sequence's `first` (a step's queries as query heads under a sliding window or chunk); None: the
    sequence's."""
    batch, heads, head_dim = query.shape
    device = query.device
    if with_lse and sinks is not None:
        raise ValueError("a log-sum-exp is asked without sinks: the caller adds them where it merges")
    step = step or DecodeStep(device)
    passes = head_passes(heads // kv_heads)
    if len(passes) > 1:
        grouped = query.reshape(batch, kv_heads, heads // kv_heads, head_dim)
        heads_before = np.cumsum([0, *passes[:-1]]).tolist()
        pass_sinks = [None if sinks is None else sinks.view(kv_heads, -1)[:, h : h + n].reshape(-1)
                      for h, n in zip(heads_before, passes)]
        pass_rows = [None if row_first is None else row_first.reshape(batch, kv_heads, -1)[:, :, h : h + n].reshape(batch, -1)
                     for h, n in zip(heads_before, passes)]
        runs = [prepare_decode(grouped[:, :, h : h + n].reshape(batch, kv_heads * n, head_dim), launches, kv_heads, scaling,
                               position_offset, served, step, first, sink, with_lse, rows)
                for h, n, sink, rows in zip(heads_before, passes, pass_sinks, pass_rows)]

        def run_passes():  # one after another on the stream: the passes share the step's scratch
            results = [run() if with_lse else (run(), None) for run in runs]
            out = torch.cat([o.view(batch, kv_heads, n, head_dim) for (o, _), n in zip(results, passes)], 2)
            if not with_lse:
                return out.view(batch, heads, head_dim)
            lse = torch.cat([log_z.view(batch, kv_heads, n) for (_, log_z), n in zip(results, passes)], 2)
            return out.view(batch, heads, head_dim), lse.view(batch, heads)

        return run_passes
    query = query.float().contiguous()
    offsets = step.positions(position_offset)
    first = first or [0] * batch
    body_plans = []
    for segments, served_body in zip(launches, served):
        sides = (segments.keys, segments.values)
        key_lengths, value_lengths = (side_lengths(*side, batch) for side in sides)
        skip = served_body.rows(batch)
        # the most tokens of a sequence beside the served body rows
        longest = max((sink + body_rows + recent - s for (sink, body_rows, _, recent), s in zip(key_lengths, skip)), default=0)
        # the segment blocks read the bodies' rows (uniform codecs), or else fp16 rows of the same tokens on both sides
        rows_alike = served_body.segments_read_bodies or all(
            s == k[1] == v[1] and k[0] == v[0] and k[3] == v[3] for s, k, v in zip(skip, key_lengths, value_lengths))
        if longest and not rows_alike:  # kvcal.runtime.backends refuses such layers: a store broke its policy
            raise KvcalError("K and V keep different tokens fp16 beside a body the tensor-core kernel's segment blocks do not read")
        body_heads = [[side[1].head[b] for b in range(batch)] for side in sides]
        meta = step.meta([row + [h, s, f] for row, h, s, f in zip(key_lengths, body_heads[0], skip, first)],
                         [row + [h, s, f] for row, h, s, f in zip(value_lengths, body_heads[1], skip, first)])
        positions = [o + k[0] for o, k in zip(position_offset, key_lengths)]  # of the bodies' first live rows: past the sinks
        visible = [max(f - k[0], 0) for f, k in zip(first, key_lengths)]
        segment_blocks = (segments.descriptor(device), meta, offsets, -(-longest // SEGMENT_SPLIT_TOKENS))
        rows = None
        if row_first is not None:  # the body's rows past its sinks, the segment blocks' tokens as the sequence's
            sinks_before = torch.tensor([k[0] for k in key_lengths])[:, None]
            rows = ((row_first - sinks_before).clamp(min=0), row_first)
        body_plans.append(served_body.prepare(query, kv_heads, scaling, skip, positions, step, visible, segment_blocks, rows))
    total = sum(splits for splits, _ in body_plans)  # at least one split per launch: the merge writes every row
    out = torch.empty(batch, heads, head_dim, dtype=torch.float32, device=device)
    out_partial, lse_partial = step.scratch(batch, heads, total, head_dim)
    tensor_core_launches, slot = [], 0
    for i, (splits, bind) in enumerate(body_plans):  # the last merges every slot
        merge = (out, step.arrivals(batch, kv_heads)) if i == len(body_plans) - 1 else None
        tensor_core_launches.append(bind(slot, out_partial, lse_partial, merge))
        slot += splits

    def run():
        for launch_tensor_core in tensor_core_launches:
            launch_tensor_core()
        if sinks is None and not with_lse:
            return out
        log_z = torch.logsumexp(lse_partial * math.log(2.0), dim=-1)  # the splits' lse are in log2 units
        if with_lse:  # (a tensor of its own: the next pass or layer writes the scratch)
            return out, log_z
        # out = acc / Z; with the sink acc / (Z + e^sink) = out * sigmoid(ln Z - sink)
        out.mul_(torch.sigmoid(log_z - sinks.float())[..., None])
        return out

    return run


def decode_attention(query: torch.Tensor, launches: list[Segments], kv_heads: int, scaling: float, position_offset: list[int],
                     served: list, step: DecodeStep | None = None, first: list[int] | None = None,
                     sinks: torch.Tensor | None = None, with_lse: bool = False, row_first: torch.Tensor | None = None):
    """Attention of one query token per sequence, query (batch, heads, head_dim), over every launch's tokens from
    each sequence's `first` on (a sliding window; default all), each launch's share served by the tensor-core kernel
    (`served`, kvcal.runtime.tensor_core.serve: pre-RoPE keys rotated there); (batch, heads, head_dim) float32. A
    sequence without tokens gets zeros. step: what the layers of a step share (see DecodeStep); sinks: (heads,)
    attention sinks' logits; with_lse: also each row's log-sum-exp; row_first: each row's first token (see
    prepare_decode)."""
    return prepare_decode(query, launches, kv_heads, scaling, position_offset, served, step, first, sinks, with_lse,
                          row_first)()
