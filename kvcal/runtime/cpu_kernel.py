"""The CPU kernels of the runtime cache. Decode attention (kernels/decode_attention_cpu.cpp): a decode step on
the CPU attends over the packed stores directly, as the CUDA kernel does on the GPU, instead of dequantizing
every sequence's whole cache into a float tensor and concatenating it for SDPA (the torch reference,
kvcal.runtime.reference, which stays the specification and the fallback). Quantize-and-append
(kernels/append_cpu.cpp, `CpuAppend`): what a decode step appends every step (codebooks with outliers,
per-token uniform values, SKVQ) is encoded straight into the store, bit for bit as the torch encoders do.

Each source is compiled at first use with the host C++ compiler (`$CXX`, else `c++`/`g++`) for `-march=` the
instruction set `$KVCAL_CPU_TARGET` names (default native: this CPU's; x86-64-v3 gives the AVX2 build on any newer
x86 CPU) into a shared library kept in the build cache (kvcal.build_cache) by a hash of the source, the
flags, the compiler and the CPU, and loaded with ctypes; `describe()` says which build runs. Without a compiler, or
with KVCAL_CPU_KERNEL=0, the cache uses the torch reference and the torch encoders (a warning says why). The kernel reads the same store descriptor as the CUDA kernel
(kvcal.runtime.kernels.Segments) plus two fields: the codec, and for SKVQ's permuted groups the group of every
channel.
"""

from __future__ import annotations

import array
import ctypes
import enum
import functools
import os
import platform
import shutil
import subprocess
import warnings
from pathlib import Path

import numpy as np
import torch

from kvcal.packing import OUTLIER_TILE_TOKENS
from kvcal.runtime import kernel_source as src
from kvcal.runtime import kernels
from kvcal.runtime.store import spans
from kvcal.build_cache import cached

DECODE_FLAGS = ("-O3", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-fno-trapping-math",
                "-fassociative-math", "-fno-signed-zeros")
APPEND_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off")  # torch's roundings
# Threads: OpenMP. torch's CPU wheels load libgomp.so.1 before kvcal builds anything, so the kernel's libgomp.so.1 is
# that same library and shares torch's thread pool; without OpenMP the kernel builds and runs on one thread.
THREAD_FLAGS = (("-fopenmp",), ())
TARGET_VARIABLE = "KVCAL_CPU_TARGET"  # the -march the kernels are built for: native (default), x86-64-v3, armv8-a, ...
# the CPU kernel's descriptor: the CUDA kernel's fields (kernels.SideField), then its own (a test checks the order)
CpuSideField = enum.IntEnum("CpuSideField", src.enum_members("decode_attention_cpu.cpp", "SideField"))
# per (side, sequence): kernels.side_lengths' four, the body's first row, the first token seen
META_FIELDS = src.enum_members("decode_attention_cpu.cpp", "MetaField")["META_FIELDS"]
_P, _I, _F, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_longlong


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_id() -> str:
    """What -march=native compiles for: the CPU model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor() or platform.machine()


class _CompileFailed(Exception):
    pass


def target() -> str:
    """The instruction set the CPU kernels are built for (`-march`): $KVCAL_CPU_TARGET, default native."""
    return os.environ.get(TARGET_VARIABLE) or "native"


def _compiled(name: str, flags: tuple[str, ...], functions: dict[str, list], thread_flags=((),)) -> ctypes.CDLL | None:
    """kernels/<name> built for target() into a shared library (once per source, flags, compiler and CPU), with the
    first of `thread_flags` that compiles, and loaded with `functions`' argument types; None (with a warning) where it
    cannot be."""
    if os.environ.get("KVCAL_CPU_KERNEL", "1") == "0":
        return None
    compiler = _compiler()
    if compiler is None:
        warnings.warn("kvcal: no C++ compiler found (set CXX); CPU decode steps use the torch reference, which is slower",
                      stacklevel=3)
        return None
    source = src.KERNEL_DIR / name
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout

    march = f"-march={target()}"

    def build_with(extra: tuple[str, ...]):
        def build(path: Path) -> None:
            result = subprocess.run([compiler, *flags, march, *extra, str(source), "-o", str(path)], capture_output=True, text=True)
            if result.returncode != 0:
                raise _CompileFailed(result.stderr[-2000:])
        return build

    failure = None
    for extra in thread_flags:
        try:
            built = cached(f"{source.stem}.so", [source.read_text(), *flags, march, *extra, compiler, version, _cpu_id()],
                           build_with(extra))
            break
        except _CompileFailed as exc:
            failure = exc
    else:
        warnings.warn(f"kvcal: compiling {name} for {march} failed; the torch path serves instead:\n{failure}", stacklevel=3)
        return None
    lib = ctypes.CDLL(str(built))
    for function, argtypes in functions.items():
        getattr(lib, function).restype = None
        getattr(lib, function).argtypes = argtypes
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled decode-attention kernel (built on first use), or None."""
    lib = _compiled("decode_attention_cpu.cpp", DECODE_FLAGS,
                    {"kvcal_decode_attention_cpu": [_P, _P, _P, _P, _P, _L, _I, _I, _I, _I, _I, _I, _F, _F, _P, _P, _P, _P, _I,
                                                   _I, _I]},
                    THREAD_FLAGS)
    if lib is not None:
        for function in ("kvcal_cpu_lanes", "kvcal_cpu_openmp"):
            getattr(lib, function).restype, getattr(lib, function).argtypes = _I, []
    return lib


def describe() -> str:
    """Which CPU decode kernel runs here: its target, vector lanes and threads (or why the torch reference serves)."""
    lib = library()
    if lib is None:
        return "CPU decode kernel: none (the torch reference serves)"
    threads = f"{torch.get_num_threads()} threads (OpenMP)" if lib.kvcal_cpu_openmp() else "1 thread (built without OpenMP)"
    return f"CPU decode kernel: built for -march={target()}, {lib.kvcal_cpu_lanes()} float lanes, {threads}"


@functools.cache
def append_library() -> ctypes.CDLL | None:
    """The compiled appends (built on first use), or None."""
    lib = _compiled("append_cpu.cpp", APPEND_FLAGS, {
        "kvcal_append_codebook_cpu": [_P, _I, _I, _I, _I, _P, _P, _F, _F, _I, _P, _P, _P, _P, _P, _P, _L, _P,
                                      _I, _P, _P, _L, _P, _L, _P],
        "kvcal_place_outliers_cpu": [_P, _I, _I, _I, _I, _P, _P, _P, _P, _L, _P, _P, _P, _P, _L, _P, _L, _P],
        "kvcal_append_token_uniform_cpu": [_P, _I, _I, _I, _I, _P, _P, _P, _P, _P, _L, _L, _L],
        "kvcal_append_channel_block_cpu": [_P, _I, _I, _I, _I, _P, _P, _P, _P, _P, _L, _L],
        "kvcal_append_permuted_groups_cpu": [_P, _I, _I, _I, _P, _P, _I, _P, _P, _P, _P, _P, _P, _L, _L, _L, _I]})
    if lib is not None:
        lib.kvcal_append_codebook_cpu.restype = _I  # whether it placed the outliers too (else: room first, then place)
    return lib


def decode_supported(key_codec, value_codec) -> bool:
    """Whether the CPU kernel serves this pair of body codecs (any head_dim, GQA group and batch): the CUDA kernels'
    codecs, in the 1-, 2-, 3- and 4-bit layouts (not SKVQ's 1.5-bit ternary values)."""
    return all(kernels.codec_id(c) is not None and kernels.layout_id(c) is not None for c in (key_codec, value_codec))


def side_descriptor(sink, body, recent) -> list[int]:
    """kernels.side_descriptor's fields, then the body's codec."""
    fields = kernels.side_descriptor(sink, body, recent) + [0] * (CpuSideField.SIDE_FIELDS - kernels.SIDE_FIELDS)
    fields[CpuSideField.CODEC] = src.FP16_ONLY if body is None else kernels.codec_id(body.codec)
    return fields


def _meta(segments: kernels.Segments, batch: int, first: list[int] | None) -> array.array | None:
    """(2, batch, META_FIELDS) int32: per side and sequence kernels.side_lengths' four, the body's first live row
    and the first token the query sees; None when the launch holds no token (it adds nothing)."""
    fields, tokens = [], 0
    for sink, body, recent in (segments.keys, segments.values):
        for b, (sinks, bodies, recent_head, recents) in enumerate(kernels.side_lengths(sink, body, recent, batch)):
            tokens += sinks + bodies + recents
            fields += (sinks, bodies, recent_head, recents, body.head[b] if body else 0, first[b] if first else 0)
    return array.array("i", fields) if tokens else None


def decode_attention(query: torch.Tensor, launches: list[kernels.Segments], kv_heads: int, scaling: float,
                     rope: tuple[torch.Tensor, torch.Tensor] | None = None, first: list[int] | None = None,
                     sinks: torch.Tensor | None = None, softcap: float | None = None,
                     value_dim: int | None = None, values_scored: bool = False, with_lse: bool = False,
                     row_first: torch.Tensor | None = None):
    """Attention of one query token per sequence, query (batch, heads, head_dim), over every launch's tokens;
    rope: cos, sin (batch or 1, >= tokens, head_dim / 2) float32 contiguous, the first half of each row of
    kvcal.runtime.reference.rope_tables (`half_rope_tables`), at each sequence's stored tokens' positions (one set of
    rows for the whole batch when the first dimension is 1) for keys stored before RoPE (None: keys are stored
    rotated); first: per sequence, its first stored token the query sees (a sliding window; default 0); sinks: (heads,)
    attention sinks' logits, added to the kernel's softmax state after its last launch (kvcal.kv.softmax_with_sinks);
    softcap: the scores' soft-cap (kvcal.kv.softcapped), which the kernel applies (None: not capped); value_dim: a
    KV head's value channels where they are not head_dim's; values_scored (MLA's latent,
    kvcal.adapters.LatentAttention): the query's last value_dim channels score the values beside its first ones the
    keys, which are then head_dim - value_dim wide. (batch, heads, value_dim) float32; a sequence without tokens gets
    zeros. with_lse (no sinks): also each row's log-sum-exp of its scores, (batch, heads), -inf where it saw no token,
    to merge with attention over other tokens. row_first (batch, heads) int32: each query row's first stored token
    seen, at or past its sequence's `first` (a step's queries as query heads under a sliding window; None: its
    sequence's). The stores must live on the CPU."""
    lib = library()
    batch, heads, head_dim = query.shape
    value_dim = value_dim or head_dim
    if values_scored:
        head_dim -= value_dim
    query = query.float().contiguous()
    row_first = row_first.to(torch.int32).contiguous() if row_first is not None else None
    cos = sin = None
    rope_stride = 0
    if rope is not None:
        cos, sin = rope
        rope_stride = 0 if cos.shape[0] == 1 else cos.shape[1] * cos.shape[2]
    calls = []
    for segments in launches:
        meta = _meta(segments, batch, first)
        if meta is not None:
            descriptor = segments.describe("cpu", lambda: _held_array(side_descriptor(*segments.keys) + side_descriptor(*segments.values)))
            calls.append((descriptor, meta))
    if with_lse and sinks is not None:
        raise ValueError("a log-sum-exp is asked without sinks: the caller adds them where it merges")
    out = torch.empty(batch, heads, value_dim)  # the kernel's running output, acc
    if not calls:
        out.zero_()
        return (out, torch.full((batch, heads), float("-inf"))) if with_lse else out
    # the running softmax state: m, then l, batch x heads each (host arrays: no torch operation per call)
    state = array.array("f", bytes(8 * batch * heads))
    m_pointer = state.buffer_info()[0]
    for i, ((_, descriptor), meta) in enumerate(calls):
        lib.kvcal_decode_attention_cpu(
            query.data_ptr(), descriptor, meta.buffer_info()[0], 0 if cos is None else cos.data_ptr(),
            0 if sin is None else sin.data_ptr(), rope_stride, batch, kv_heads, heads // kv_heads, head_dim, value_dim,
            int(values_scored), scaling, softcap or 0.0, m_pointer, m_pointer + 4 * batch * heads, out.data_ptr(),
            _ptr(row_first), i == 0, sinks is None and i == len(calls) - 1, torch.get_num_threads())
    if sinks is not None:  # the sink joins the running state (m, l, acc), then acc / l as the kernel's last launch does
        m, l = torch.frombuffer(state, dtype=torch.float32).view(2, batch, heads)
        top = torch.maximum(m, sinks.float())
        kept = torch.exp(m - top)  # 0 where no token was seen (m = -inf)
        out *= (kept / (l * kept + torch.exp(sinks.float() - top)))[..., None]
    if with_lse:
        m, l = torch.frombuffer(state, dtype=torch.float32).view(2, batch, heads)
        return out, m + torch.log(l)  # (l = 0 where no token was seen: -inf)
    return out


def _held_array(fields: list[int]) -> tuple[np.ndarray, int]:
    """fields as an int64 array with its address (the array is held beside it, so the address stays valid)."""
    array = np.asarray(fields, dtype=np.int64)
    return array, array.ctypes.data


def half_rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's RoPE tables from reference.rope_tables' (..., tokens, head_dim): the first half of each row,
    contiguous (rotate_half's rows repeat it; the kernel reads half the bytes)."""
    half = cos.shape[-1] // 2
    return tuple(t.reshape(t.shape[0], -1, t.shape[-1])[..., :half].contiguous() for t in (cos, sin))


# ---------------------------------------------------------------------------------------------------------
# quantize-and-append


def _ptr(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.data_ptr()


class CpuAppend:
    """The encoder a CPU PackedRows quantizes with (kvcal.runtime.store's encoder_for hook), for every codec the kernels
    read: codebooks, per-token uniform values, per-channel key blocks and SKVQ's permuted groups.
    kernels/append_cpu.cpp writes the torch encoder's codes, parameters (fp16; SKVQ --fp8's e4m3) and outliers, bit
    for bit, straight into the store, instead of a dozen torch operations (and a numpy placement of outliers) per
    append."""

    rows_together = False  # the store's layout: the CPU decode kernel reads a KV head's rows in turn

    def parameter_columns(self, codec, width: int) -> tuple[dict[str, int], dict[str, int]]:
        return kernels.parameter_columns(codec, width)

    def parameter_dtype(self, codec) -> torch.dtype:
        return kernels.parameter_dtype(codec)

    def __init__(self, codec, layout: int):
        """One encoder serves one store: its codec (kernel codec id) and kernel layout id do not change."""
        self.codec_id, self.layout, self.lib = kernels.codec_id(codec), layout, append_library()
        # SKVQ: permutation, group starts and clipping as the kernel reads them
        self.groups = (tuple(t.contiguous() for t in (codec.permutation.to(torch.int32), codec.starts.to(torch.int32),
                                                     codec.clip.float()))
                       if self.codec_id == src.PERMUTED_GROUPS else None)
        self.tables: dict | None = None  # codebooks: the store's kernels.codec_tables, looked up at its first append
        self.codebook_arguments: tuple | None = None  # codebooks: what the append kernel takes of them, made with them
        self._held: tuple = (None, None)  # (store.moves, its buffers' pointers and strides): see _buffers
        self._rows = np.zeros((3, 0), dtype=np.int32)  # a decode step's row index, kept between appends: _row_index
        self._rows_at = 0  # the address of self._rows

    def _buffers(self, store) -> dict[str, tuple]:
        """The pointers and strides the append kernels take of the store's buffers, made again only when the store
        replaced a buffer (store.moves), not at every append."""
        if self._held[0] != store.moves:
            words = store.words
            # append_cpu.cpp's RowWords: the words, the sequence, row and piece strides, words a piece, pieces a row
            target = np.array([words.data_ptr(), *words.stride()[:3], words.shape[3], words.shape[2]], dtype=np.int64)
            held = {"words": (target.ctypes.data,), "target": target}  # (target: alive while its address is held)
            if "scale" in store.token:
                scale = store.token["scale"]
                held["token"] = (scale.data_ptr(), store.token["zero"].data_ptr(), *scale.stride())
            if "scale" in store.blocks:
                scale = store.blocks["scale"]
                held["blocks"] = (scale.data_ptr(), store.blocks["zero"].data_ptr(), *scale.stride()[:2])
            lo, hi = store.token.get("lo"), store.token.get("hi")
            held["thresholds"] = (_ptr(lo), _ptr(hi), 0 if lo is None else lo.stride(0))
            if store.keeps_outliers:
                held["outliers"] = (store.outlier_positions.data_ptr(), store.outlier_values.data_ptr(),
                                    store.outlier_positions.shape[2], store.outlier_offsets.data_ptr(),
                                    store.outlier_offsets.shape[2], store.outlier_count.data_ptr())
            self._held = (store.moves, held)
        return self._held[1]

    def _row_index(self, seqs: list[int], starts: list[int], counts: list[int], rows: int,
                   heads: int) -> tuple[np.ndarray, tuple[int, int, int]]:
        """(3, >= rows x heads) int32: each row's sequence and body row, and room for the outliers it has per KV head;
        and the addresses of the three. A decode step's (one row per sequence) is kept between appends and filled
        again (a decode step appends to every store of every layer); a larger append's is its own, let go after it
        (kept, a prefill's would hold 12 bytes per row and KV head for as long as the cache)."""
        if rows == len(seqs):
            if self._rows.shape[1] < rows * heads:
                self._rows = np.zeros((3, rows * heads), dtype=np.int32)
                self._rows_at = self._rows.ctypes.data
            index, at = self._rows, self._rows_at
            index[0, :rows], index[1, :rows] = seqs, starts
        else:
            index = np.zeros((3, rows * heads), dtype=np.int32)
            index[0, :rows] = np.repeat(np.asarray(seqs, dtype=np.int32), counts)
            index[1, :rows] = spans(starts, counts)
            at = index.ctypes.data
        stride = index.strides[0]
        return index, (at, at + stride, at + 2 * stride)

    def encode_rows(self, store, seqs: list[int], starts: list[int], counts: list[int], x: torch.Tensor) -> None:
        """Rows x (sum(counts), C), counts[i] of them for sequence seqs[i] from body row starts[i] (capacity and
        parameter buffers already there)."""
        lib, codec, cid, layout = self.lib, store.codec, self.codec_id, self.layout
        if x.dtype != torch.float16 or not x.is_contiguous():
            x = x.to(torch.float16).contiguous()
        rows, width = x.shape
        head_dim = store.head_dim or width
        index, (seq_of_row, row_in_seq, found) = self._row_index(seqs, starts, counts, rows, width // head_dim)
        buffers = self._buffers(store)
        destination = (seq_of_row, row_in_seq, *buffers["words"])
        if cid == src.UNIFORM_TOKEN:
            lib.kvcal_append_token_uniform_cpu(x.data_ptr(), rows, width, layout, codec.group, *destination, *buffers["token"])
            return
        if cid == src.UNIFORM_CHANNEL:
            lib.kvcal_append_channel_block_cpu(x.data_ptr(), rows, width, layout, codec.group, *destination, *buffers["blocks"])
            return
        if cid == src.PERMUTED_GROUPS:
            permutation, group_starts, clip = self.groups
            lib.kvcal_append_permuted_groups_cpu(x.data_ptr(), rows, width, layout, permutation.data_ptr(), group_starts.data_ptr(),
                                                 clip.numel(), clip.data_ptr(), *destination, *buffers["token"], int(codec.fp8))
            return
        self._codebook(store, lib, x, seqs, counts, head_dim, index, found, destination, buffers)

    def _codebook(self, store, lib, x, seqs, counts, head_dim, index, found, destination, buffers) -> None:
        """Codes and thresholds, and the outliers after each (sequence, KV head)'s own: in the same call where they
        fit the outlier arrays, else after the store made room for exactly the outliers found."""
        rows, width = x.shape
        heads = width // head_dim
        if self.tables is None:  # the codec's tables and thresholds, as the kernel takes them (they never change)
            self.tables = kernels.codec_tables(store)
            t = 1.0 - store.codec.outlier_fraction / 2
            self.codebook_arguments = (_ptr(self.tables.get("lo")), _ptr(self.tables.get("hi")), np.float32(1.0 - t),
                                       np.float32(t), int(store.codec.outlier_fraction > 0), self.tables["midpoints"].data_ptr())
        channel_lo, channel_hi, low, high, keep, midpoints = self.codebook_arguments
        thresholds = buffers["thresholds"]
        outliers = buffers["outliers"] if keep else (0,) * 6
        if lib.kvcal_append_codebook_cpu(x.data_ptr(), rows, width, head_dim, self.layout, channel_lo, channel_hi, low,
                                         high, keep, midpoints, *destination, *thresholds, found, OUTLIER_TILE_TOKENS, *outliers):
            return
        added = index[2, :rows * heads].reshape(rows, heads)
        per_sequence = added if rows == len(seqs) else np.add.reduceat(added, np.cumsum([0, *counts[:-1]]), axis=0)
        store.reserve_outlier_room_on_host(seqs, per_sequence)  # may move the outlier arrays: pointers after it
        lib.kvcal_place_outliers_cpu(x.data_ptr(), rows, width, head_dim, OUTLIER_TILE_TOKENS, channel_lo, channel_hi,
                                     *thresholds, *destination[:2], *self._buffers(store)["outliers"])


def append_encoder(codec, width: int, layout: str, device) -> CpuAppend | None:
    """The compiled encoder for a CPU store of `codec`, or None where the torch codec encodes (codecs and layouts
    without a kernel number)."""
    layout_id, cid = kernels.layout_id(codec, layout), kernels.codec_id(codec)
    if torch.device(device).type != "cpu" or cid is None or layout_id is None or not width:
        return None
    return CpuAppend(codec, layout_id) if append_library() is not None else None
