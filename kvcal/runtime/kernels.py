"""CUDA kernels (kernels/*.cu, CuPy RawModule) for the runtime cache: fused decode attention over the
stores and quantize-and-append into them. The cache selects them on its own for CUDA tensors when the
layer's codecs have a kernel (`decode_supported`, `append_supported`); SKVQ's permuted groups and
1.5-bit ternary values, head dims other than 64/128 and more than 8 query heads per KV head use the torch
reference instead, as every case does on CPU.

Torch tensors are shared with the kernels by pointer (no copy) and the kernels run on torch's current
stream. Per launch the host writes two small int arrays (store descriptors and per-sequence lengths);
the cache itself is never copied, transposed or concatenated.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvcal.runtime import kernel_source as src

if TYPE_CHECKING:
    from kvcal.runtime.store import Fp16Rows, PackedRows

THREADS = 128
TILE = 32
MAX_GROUP = 8  # query heads per KV head (GMAX in decode_attention.cu)
MAX_WIDTH, MAX_GROUPS = 4096, 1024  # kernels/append.cu
LOG2E = 1.4426950408889634
KVMIX_LAYOUT = 5  # kernels/common.cuh code_at: "lsb" layouts are numbered by their code width 1-4


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


def _launch(function, grid: tuple, block: tuple, args: tuple) -> None:
    import cupy

    with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
        function(grid, block, args)


def codec_id(codec) -> int | None:
    from kvcal.quantizers import ChannelBlockUniform, CodebookCodec, TokenUniform

    if isinstance(codec, TokenUniform):
        return src.UNIFORM_TOKEN
    if isinstance(codec, ChannelBlockUniform):
        return src.UNIFORM_CHANNEL
    if isinstance(codec, CodebookCodec):
        return src.CODEBOOK_CHANNEL if codec.lo is not None else src.CODEBOOK_TOKEN
    return None


def _layout_id(codec, layout: str = "lsb") -> int | None:
    """The kernels' number for a packing layout (kernels/common.cuh code_at); None where they have none."""
    bits = codec.bits
    if layout == "kvmix10x3+1x2":
        return KVMIX_LAYOUT if bits == 3 else None
    return int(bits) if layout == "lsb" and bits in (1, 2, 3, 4) else None


def append_supported(codec, width: int, layout: str = "lsb") -> bool:
    cid = codec_id(codec)
    if cid is None or _layout_id(codec, layout) is None or width > MAX_WIDTH:
        return False
    return cid != src.UNIFORM_TOKEN or math.ceil(width / codec.group) <= MAX_GROUPS


def decode_supported(key_codec, value_codec, heads: int, kv_heads: int, head_dim: int) -> bool:
    pair = (codec_id(key_codec), codec_id(value_codec))
    return (pair in src.CODEC_PAIRS and _layout_id(key_codec) is not None and _layout_id(value_codec) is not None
            and head_dim in src.HEAD_DIMS and heads % kv_heads == 0 and heads // kv_heads <= MAX_GROUP)


# ---------------------------------------------------------------------------------------------------------
# quantize-and-append

def parameter_columns(codec, width: int) -> tuple[dict[str, int], dict[str, int]]:
    """The fp16 parameters a codec stores (per token, per block): name -> columns, as its torch encode makes them."""
    cid = codec_id(codec)
    if cid == src.UNIFORM_TOKEN:
        groups = math.ceil(width / codec.group)
        return {"scale": groups, "zero": groups}, {}
    if cid == src.UNIFORM_CHANNEL:
        return {}, {"scale": width, "zero": width}
    if cid == src.CODEBOOK_TOKEN:
        return {"lo": 1, "hi": 1}, {}
    return {}, {}

def _device_tables(store: PackedRows) -> dict:
    """Codebook, its midpoints and fixed thresholds of a store's codec as float32 on its device (made once)."""
    tables = getattr(store, "_kernel_tables", None)
    if tables is None:
        codec, tables = store.codec, {}
        if hasattr(codec, "codebook"):
            codebook = codec.codebook.to(store.device, torch.float32).contiguous()
            tables = {"codebook": codebook, "midpoints": ((codebook[1:] + codebook[:-1]) / 2).contiguous()}
            if codec.lo is not None:
                tables["lo"] = codec.lo.to(store.device, torch.float32).contiguous()
                tables["hi"] = codec.hi.to(store.device, torch.float32).contiguous()
        store._kernel_tables = tables
    return tables


def encode_into(store: PackedRows, b: int, x: torch.Tensor, start: int) -> int:
    """Quantize fp16 rows x (count, C) into sequence b's rows start.. of `store` (capacity reserved, parameter
    buffers allocated); returns how many outliers were appended."""
    codec, cid = store.codec, codec_id(store.codec)
    x = x.to(torch.float16).contiguous()
    count, width = x.shape
    if count == 0:  # CUDA refuses an empty grid
        return 0
    words_per_row = store.words.shape[2]
    words = store.words[b, start:]
    layout = np.int32(_layout_id(codec, store.layout))
    if cid == src.UNIFORM_TOKEN:
        scale, zero = store.token["scale"][b, start:], store.token["zero"][b, start:]
        _launch(_function("append.cu", "append_token_uniform"), (count,), (THREADS,),
                (_ptr(x), np.int32(width), layout, np.int32(codec.group), _ptr(words), np.int32(words_per_row),
                 _ptr(scale), _ptr(zero), np.int32(scale.shape[1])))
        return 0
    if cid == src.UNIFORM_CHANNEL:
        first = start // codec.group
        _launch(_function("append.cu", "append_channel_block"), (count // codec.group,), (THREADS,),
                (_ptr(x), np.int32(width), layout, np.int32(codec.group), _ptr(words), np.int32(words_per_row),
                 _ptr(store.blocks["scale"][b, first:]), _ptr(store.blocks["zero"][b, first:])))
        return 0
    tables = _device_tables(store)
    token_lo = store.token["lo"][b, start:] if "lo" in store.token else None
    token_hi = store.token["hi"][b, start:] if "hi" in store.token else None
    keep = codec.outlier_fraction > 0
    t = 1.0 - codec.outlier_fraction / 2
    q_low, q_high = torch.tensor([1.0 - t, t]).tolist()  # float32, as kvcal.quantizers computes them
    counts = torch.zeros(count, dtype=torch.int32, device=x.device)
    _launch(_function("append.cu", "append_codebook"), (count,), (THREADS,),
            (_ptr(x), np.int32(width), layout, _ptr(tables.get("lo")), _ptr(tables.get("hi")), np.float32(q_low),
             np.float32(q_high), np.int32(keep), _ptr(tables["midpoints"]), _ptr(words), np.int32(words_per_row),
             _ptr(token_lo), _ptr(token_hi), _ptr(counts)))
    if not keep:
        return 0
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    total = int(ends[-1])  # the host must know it to grow the outlier arrays
    if total:
        starts = ends - counts  # held by name: a pointer into a temporary would dangle
        first = store.outliers[b]
        store.reserve_outliers(first + total)
        _launch(_function("append.cu", "append_codebook_outliers"), (count,), (32,),
                (_ptr(x), np.int32(width), _ptr(tables.get("lo")), _ptr(tables.get("hi")), _ptr(token_lo), _ptr(token_hi),
                 _ptr(starts), np.int32(start), _ptr(store.outlier_rows[b, first:]),
                 _ptr(store.outlier_channels[b, first:]), _ptr(store.outlier_values[b, first:])))
    return total


# ---------------------------------------------------------------------------------------------------------
# decode attention

SIDE_FIELDS = 18  # enum SideField in decode_attention.cu
META_FIELDS = 5


def _side(sink: Fp16Rows | None, body: PackedRows | None, recent: Fp16Rows | None) -> list[int]:
    """One side's descriptor (enum SideField order); absent parts and buffers not yet allocated are 0."""
    fields = [0] * SIDE_FIELDS
    if sink is not None:
        fields[0:2] = [sink.data.data_ptr(), sink.data.shape[1] * sink.data.shape[2]]
    if recent is not None:
        fields[2:4] = [recent.data.data_ptr(), recent.data.shape[1] * recent.data.shape[2]]
    if body is None:
        return fields
    codec, cid = body.codec, codec_id(body.codec)
    fields[4:7] = [body.words.data_ptr(), body.words.shape[1] * body.words.shape[2], body.words.shape[2]]
    if cid == src.CODEBOOK_CHANNEL:
        tables = _device_tables(body)
        fields[7:12] = [tables["lo"].data_ptr(), tables["hi"].data_ptr(), 0, body.width, 1]
    else:
        params = body.token if cid in (src.UNIFORM_TOKEN, src.CODEBOOK_TOKEN) else body.blocks
        names = ("lo", "hi") if cid == src.CODEBOOK_TOKEN else ("scale", "zero")
        if names[0] in params:
            first = params[names[0]]
            fields[7:11] = [first.data_ptr(), params[names[1]].data_ptr(), first.shape[1] * first.shape[2], first.shape[2]]
        fields[11] = codec.group if cid in (src.UNIFORM_TOKEN, src.UNIFORM_CHANNEL) else 1
    if hasattr(codec, "codebook"):
        fields[12] = _device_tables(body)["codebook"].data_ptr()
    fields[13:17] = [body.outlier_rows.data_ptr(), body.outlier_channels.data_ptr(), body.outlier_values.data_ptr(),
                     body.outlier_rows.shape[1]]
    fields[17] = _layout_id(codec, body.layout)
    return fields


def _lengths(sink: Fp16Rows | None, body: PackedRows | None, recent: Fp16Rows | None, batch: int) -> list[list[int]]:
    rows = []
    for b in range(batch):
        if sink is not None and sink.head[b]:
            raise ValueError("a sink segment never drops tokens from its front")
        rows.append([sink.length[b] if sink else 0, body.length[b] if body else 0, recent.head[b] if recent else 0,
                     recent.length[b] if recent else 0, body.outliers[b] if body else 0])
    return rows


class Segments:
    """What one decode-attention launch reads: per side (K, V) an fp16 sink, a packed body and an fp16 recent
    segment, any of them absent. Both sides hold the same tokens in the same order."""

    def __init__(self, keys: tuple, values: tuple):
        self.keys, self.values = keys, values

    def codecs(self) -> tuple[int, int]:
        return tuple(codec_id(side[1].codec) if side[1] is not None else src.FP16_ONLY for side in (self.keys, self.values))


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def prepare_decode(query: torch.Tensor, launches: list[Segments], kv_heads: int, scaling: float, position_offset: list[int],
                   inv_freq: torch.Tensor | None = None, rope_scaling: float = 1.0):
    """Everything decode_attention does on the host (descriptors, lengths, buffers, split sizes); returns the
    function that launches the kernels and returns the output. Benchmarks time that function alone."""
    batch, heads, head_dim = query.shape
    group = heads // kv_heads
    device = query.device
    query = query.float().contiguous()
    rope = inv_freq is not None
    freq = (inv_freq if rope else torch.zeros(head_dim // 2)).to(device, torch.float32).contiguous()
    offsets = torch.tensor(position_offset, dtype=torch.int32, device=device)
    blocks_wanted = 2 * _multiprocessors(device)
    plans = []
    for segments in launches:
        key_lengths = _lengths(*segments.keys, batch)
        longest = max((sink + body + recent for sink, body, _, recent, _ in key_lengths), default=0)
        if longest == 0:
            continue
        # enough blocks to fill the GPU twice over, splits of whole 32-token tiles
        wanted = max(1, math.ceil(blocks_wanted / (batch * kv_heads)))
        per_split = math.ceil(math.ceil(longest / wanted) / TILE) * TILE
        descriptor = torch.tensor(_side(*segments.keys) + _side(*segments.values), dtype=torch.int64, device=device)
        meta = torch.tensor([key_lengths, _lengths(*segments.values, batch)], dtype=torch.int32, device=device)
        plans.append((src.decode_variant(head_dim, rope, *segments.codecs()), descriptor, meta, per_split, math.ceil(longest / per_split)))
    total = sum(plan[-1] for plan in plans)
    out = torch.zeros(batch, heads, head_dim, dtype=torch.float32, device=device)
    out_partial = torch.empty(batch, heads, max(total, 1), head_dim, dtype=torch.float32, device=device)
    lse_partial = torch.empty(batch, heads, max(total, 1), dtype=torch.float32, device=device)

    def run() -> torch.Tensor:
        if total == 0:
            return out
        first = 0
        for name, descriptor, meta, per_split, splits in plans:
            _launch(_function("decode_attention.cu", name), (splits, kv_heads, batch), (THREADS,),
                    (_ptr(query), _ptr(descriptor), _ptr(meta), _ptr(offsets), _ptr(freq), _ptr(out_partial), _ptr(lse_partial),
                     np.int32(batch), np.int32(kv_heads), np.int32(group), np.int32(per_split), np.int32(first), np.int32(total),
                     np.float32(scaling * LOG2E), np.float32(rope_scaling)))
            first += splits
        _launch(_function("decode_attention.cu", "merge_splits"), (batch * heads,), (min(head_dim, 256),),
                (_ptr(out_partial), _ptr(lse_partial), _ptr(out), np.int32(total), np.int32(head_dim)))
        return out

    return run


def decode_attention(query: torch.Tensor, launches: list[Segments], kv_heads: int, scaling: float, position_offset: list[int],
                     inv_freq: torch.Tensor | None = None, rope_scaling: float = 1.0) -> torch.Tensor:
    """Attention of one query token per sequence, query (batch, heads, head_dim), over every launch's tokens
    (keys rotated on the fly when inv_freq is given: pre-RoPE keys); (batch, heads, head_dim) float32. A
    sequence without tokens gets zeros."""
    return prepare_decode(query, launches, kv_heads, scaling, position_offset, inv_freq, rope_scaling)()
