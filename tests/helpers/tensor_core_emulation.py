"""kernels/decode_attention_tc.cu on the CPU: a driver with one C entry point per variant (the kernel compiled
unchanged against tests/kernel_emulation/cuda_on_cpu.h) built with g++ into a shared library. Used by
tests/test_tensor_core_decode.py (the kernel alone) and tests/test_kernel_emulation.py (the cache's decode steps)."""

from __future__ import annotations

import ctypes
from pathlib import Path

from helpers import emulator_library
from kvcal.runtime import kernel_source
from kvcal.runtime.tensor_core import Variant

EMULATION = Path(__file__).resolve().parents[1] / "kernel_emulation"
# decode_tc's parameters: tensors, byte / element strides, ints, then the float scale, the fused merge's output and
# arrival counters, and the segment blocks' descriptor, meta and positions and their count
POINTERS, LONGS, INTS, MERGE, SEGMENTS = 21, 12, 4, 2, 3


def symbol(v: Variant) -> str:
    return (f"run_d{v.head_dim}_b{v.bits}_k{v.key_group}_v{v.value_group}_q{v.gqa}_r{int(v.rope)}_c{int(v.codebook)}"
            f"_o{int(v.outliers)}_vb{v.vbits}_pg{v.channel_groups}")


def driver(variants: list[Variant]) -> str:
    lines = ['#include "cuda_on_cpu.h"', '#include "decode_attention_tc.cu"', 'extern "C" {']
    for v in variants:
        lines.append(
            f"void {symbol(v)}(unsigned gx, unsigned gy, unsigned gz, const float* q, const unsigned char* k, const unsigned char* v,"
            " const unsigned short* ks, const unsigned short* kz, const unsigned short* vs, const unsigned short* vz, const int* meta,"
            " const float* freq, const unsigned* table, const unsigned* books, float* op, float* lp, const unsigned short* kop,"
            " const unsigned short* kov, const int* koo, const int* koc, const unsigned short* vop, const unsigned short* vov,"
            " const int* voo, const int* voc, long long a0, long long a1, long long a2, long long a3, long long a4, long long a5,"
            " long long a6, long long a7, long long a8, long long a9, long long a10, long long a11, int kvh, int per_split,"
            " int split_offset, int total_splits, float scale, float* out, unsigned* arrivals, const long long* sd, const int* sm,"
            " const int* sp, int segment_splits) {"
            f" emulation::launch({{gx, gy, gz}}, {{128, 1, 1}}, [&] {{ {v.name}(q, k, v, ks, kz, vs, vz, meta, freq, table,"
            " books, op, lp, kop, kov, koo, koc, vop, vov, voo, voc, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, kvh,"
            " per_split, split_offset, total_splits, scale, out, arrivals, sd, sm, sp, segment_splits); }); }")
        flags = ", ".join("true" if x else "false" for x in (v.rope, v.codebook, v.outliers))
        lines.append(f"int smem_{symbol(v)}() {{ return tc::Shape<{v.head_dim}, {v.bits}, {v.key_group}, {v.value_group}, {flags}, "
                     f"{v.vbits}, {v.channel_groups}>::SMEM_BYTES; }}")
    lines.append("void take_lookups(unsigned long long* out) { out[0] = emulation::lookups.loads; out[1] = "
                 "emulation::lookups.wavefronts; emulation::lookups.loads = emulation::lookups.wavefronts = 0; }")
    lines.append("}")
    return "\n".join(lines) + "\n"


def build(variants: list[Variant], kernel_dir: Path = kernel_source.KERNEL_DIR) -> ctypes.CDLL:
    """The library of `variants`, built from kernel_dir's decode_attention_tc.cu (the build cached
    by content: helpers.emulator_library)."""
    library = emulator_library(driver(variants), [EMULATION, kernel_dir, kernel_source.KERNEL_DIR], "decode_tc_on_cpu.so")
    lib = ctypes.CDLL(str(library))
    pointer, long, integer = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int
    lib.take_lookups.argtypes = [ctypes.POINTER(ctypes.c_ulonglong)]
    for v in variants:
        getattr(lib, symbol(v)).argtypes = ([ctypes.c_uint] * 3 + [pointer] * POINTERS + [long] * LONGS + [integer] * INTS
                                            + [ctypes.c_float] + [pointer] * (MERGE + SEGMENTS) + [integer])
    return lib


def take_lookups(lib: ctypes.CDLL) -> tuple[int, int]:
    """(warp-wide table lookups, their shared-memory wavefronts) of the launches since the last call (the emulator's
    bank-conflict count: tests/kernel_emulation/cuda_on_cpu.h's Lookups)."""
    counts = (ctypes.c_ulonglong * 2)()
    lib.take_lookups(counts)
    return counts[0], counts[1]
