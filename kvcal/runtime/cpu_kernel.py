"""The CPU decode-attention kernel (kernels/decode_attention_cpu.cpp): a decode step on the CPU attends over
the packed stores directly, as the CUDA kernel does on the GPU, instead of dequantizing every sequence's whole
cache into a float tensor and concatenating it for SDPA (the torch reference, kvcal.runtime.reference, which
stays the specification and the fallback).

The source is compiled at first use with the host C++ compiler (`$CXX`, else `c++`/`g++`) into a shared
library cached under `$KVCAL_CACHE_DIR` (default ~/.cache/kvcal), named by a hash of the source, the flags, the
compiler and the CPU, written to a temporary name and renamed (so concurrent first uses cannot load half a
file), and loaded with ctypes. Without a compiler, or with KVCAL_CPU_KERNEL=0, the cache uses the torch
reference (one warning says why). The kernel reads the same store descriptor as the CUDA kernel
(kvcal.runtime.kernels.Segments) plus three fields: the codec, and for SKVQ's permuted groups the slot and
group of every channel.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
import weakref
from pathlib import Path

import numpy as np
import torch

from kvcal.packing import layout_for
from kvcal.runtime import kernel_source as src
from kvcal.runtime import kernels
from kvcal.runtime.store import permuted_groups

SOURCE = src.KERNEL_DIR / "decode_attention_cpu.cpp"
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-fno-trapping-math",
         "-fassociative-math", "-fno-signed-zeros")
PERMUTED_GROUPS = 5  # enum Codec in decode_attention_cpu.cpp, beyond the CUDA kernels' codecs
LAYOUTS = {"lsb": {1, 2, 4}, "planes3": {3}, "kvmix10x3+1x2": {3}}


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


def cache_dir() -> Path:
    return Path(os.environ.get("KVCAL_CACHE_DIR") or Path.home() / ".cache" / "kvcal")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel, compiling it on first use; None (with a warning) where it cannot be."""
    if os.environ.get("KVCAL_CPU_KERNEL", "1") == "0":
        return None
    compiler = _compiler()
    if compiler is None:
        warnings.warn("kvcal: no C++ compiler found (set CXX); CPU decode steps use the torch reference, which is slower",
                      stacklevel=2)
        return None
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256("\0".join([SOURCE.read_text(), *FLAGS, compiler, version, _cpu_id()]).encode()).hexdigest()[:16]
    target = cache_dir() / f"decode_attention_cpu-{digest}.so"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as folder:
            built = Path(folder) / target.name
            result = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built)], capture_output=True, text=True)
            if result.returncode != 0:
                warnings.warn(f"kvcal: compiling {SOURCE.name} failed; CPU decode steps use the torch reference:\n"
                              f"{result.stderr[-2000:]}", stacklevel=2)
                return None
            os.replace(built, target)
    lib = ctypes.CDLL(str(target))
    lib.kvcal_decode_attention_cpu.restype = None
    lib.kvcal_decode_attention_cpu.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                               ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                               ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return lib


def codec_id(codec) -> int | None:
    if permuted_groups(codec):
        return PERMUTED_GROUPS if not codec.fp8 else None
    return kernels.codec_id(codec)


def _layout_supported(codec) -> bool:
    return codec.bits in LAYOUTS.get(layout_for(codec.bits), ())


def decode_supported(key_codec, value_codec) -> bool:
    """Whether the CPU kernel serves this pair of body codecs (any head_dim, GQA group and batch): the CUDA kernels'
    codecs and SKVQ's permuted groups with fp16 parameters, in the 1-, 2-, 3- and 4-bit layouts (not SKVQ's
    1.5-bit ternary values nor fp8 parameters)."""
    return all(codec_id(c) is not None and _layout_supported(c) for c in (key_codec, value_codec))


_PERMUTATIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # SKVQ codec -> (slot, group) of every channel


def _permuted_tables(codec) -> tuple[torch.Tensor, torch.Tensor]:
    if codec not in _PERMUTATIONS:
        permutation = codec.permutation.long().cpu()
        slot_of_channel = torch.argsort(permutation)  # channel c sits in permuted slot slot_of_channel[c]
        sizes = (codec.starts[1:] - codec.starts[:-1]).long().cpu()
        group_of_slot = torch.repeat_interleave(torch.arange(len(sizes)), sizes)
        _PERMUTATIONS[codec] = (slot_of_channel.to(torch.int32).contiguous(), group_of_slot[slot_of_channel].to(torch.int32).contiguous())
    return _PERMUTATIONS[codec]


def side_descriptor(sink, body, recent) -> list[int]:
    """kernels.side_descriptor's fields, then the codec and SKVQ's per-channel slot and group."""
    fields = kernels.side_descriptor(sink, body, recent)
    extra = [src.FP16_ONLY, 0, 0]
    if body is not None:
        extra[0] = codec_id(body.codec)
        if extra[0] == PERMUTED_GROUPS:
            slot, group = _permuted_tables(body.codec)
            scale = body.token.get("scale")
            if scale is not None:
                fields[7:12] = [scale.data_ptr(), body.token["zero"].data_ptr(), scale.shape[1] * scale.shape[2], scale.shape[2], 1]
            extra[1:] = [slot.data_ptr(), group.data_ptr()]
    return fields + extra


def decode_attention(query: torch.Tensor, launches: list[kernels.Segments], kv_heads: int, scaling: float,
                     rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Attention of one query token per sequence, query (batch, heads, head_dim), over every launch's tokens;
    rope: cos, sin (batch, 1 or more, >= tokens, head_dim) float32 at each sequence's positions for keys stored
    before RoPE (None: keys are stored rotated). (batch, heads, head_dim) float32; a sequence without tokens gets
    zeros. The stores must live on the CPU."""
    lib = library()
    batch, heads, head_dim = query.shape
    query = query.float().contiguous()
    m = torch.full((batch, heads), float("-inf"))
    total = torch.zeros(batch, heads)
    acc = torch.zeros(batch, heads, head_dim)
    cos = sin = None
    if rope is not None:
        cos, sin = (t.reshape(batch, -1, head_dim).contiguous() for t in rope)
    for segments in launches:
        fields = side_descriptor(*segments.keys) + side_descriptor(*segments.values)
        descriptor = np.asarray(fields, dtype=np.int64)
        lengths = [kernels.side_lengths(*side, batch) for side in (segments.keys, segments.values)]
        meta = np.asarray(lengths, dtype=np.int32)
        if not meta[0, :, [0, 1, 3]].any():
            continue
        lib.kvcal_decode_attention_cpu(
            query.data_ptr(), descriptor.ctypes.data, meta.ctypes.data, 0 if cos is None else cos.data_ptr(),
            0 if sin is None else sin.data_ptr(), 0 if cos is None else cos.shape[1] * head_dim, batch, kv_heads,
            heads // kv_heads, head_dim, scaling, m.data_ptr(), total.data_ptr(), acc.data_ptr())
    return torch.where(total[..., None] > 0, acc / total[..., None].clamp(min=1e-30), 0.0)
