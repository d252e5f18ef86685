"""The CUDA kernels on the CPU (tests/kernel_emulation: every CUDA thread a fiber, the PTX primitives modelled), built
with g++ into shared libraries; for kernels/decode_attention_tc.cu a driver with one C entry point per variant (the
kernel compiled unchanged) and its launch over two stores. Used by the tests (tests/test_tensor_core_decode.py,
tests/test_kernel_emulation.py, through tests/helpers, which skip where no g++ is)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from kvcal.build_cache import cached
from kvcal.runtime import kernel_source, kernels, tensor_core
from kvcal.runtime.tensor_core import Variant

EMULATION = Path(__file__).resolve().parents[1] / "tests" / "kernel_emulation"
# g++ flags of every build of the CUDA emulation. -U_FORTIFY_SOURCE: distributions that fortify by default (Ubuntu)
# turn the fibers' _longjmp between stacks into __longjmp_chk, which aborts ("longjmp causes uninitialized stack
# frame"). -fno-gnu-unique: a process loads several emulator libraries, and g++ gives static locals of templates (a
# kernel variant's shared-memory array) STB_GNU_UNIQUE binding, one copy per process, so a variant built into two
# libraries (the kernel and a mutant of it) would run on the first library's array, sized by that library's shape.
EMULATION_FLAGS = ["-std=c++20", "-O1", "-ffp-contract=off", "-fPIC", "-shared", "-U_FORTIFY_SOURCE", "-fno-gnu-unique",
                   "-DKVCAL_HOST_EMULATION"]
# decode_tc's parameters: tensors, byte / element strides, ints, then the float scale and soft-cap, the fused merge's
# output and arrival counters, the segment blocks' descriptor, meta and positions and their count, and the rows'
# first tokens
POINTERS, LONGS, INTS, MERGE, SEGMENTS = 21, 14, 4, 2, 3


def compiler_missing() -> bool:
    return shutil.which("g++") is None


def emulator_library(driver: str, include_dirs: list[Path], name: str) -> Path:
    """The C++ `driver` built with g++ and EMULATION_FLAGS against `include_dirs` into a shared library `name`, once
    per content: the build cache (kvcal.build_cache) keys it by the driver, the flags, the compiler and the files
    the driver includes (kernel_source.included_sources), so a rerun over unchanged kernels builds nothing."""
    if compiler_missing():
        raise RuntimeError("the kernel emulation needs g++ (install the distribution's g++ package)")
    compiler = shutil.which("g++")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    sources = kernel_source.included_sources(driver, include_dirs)

    def build(target: Path) -> None:
        with tempfile.TemporaryDirectory() as folder:
            (Path(folder) / "driver.cpp").write_text(driver)
            command = [compiler, *EMULATION_FLAGS, *(f"-I{d}" for d in include_dirs), str(Path(folder) / "driver.cpp"), "-o", str(target)]
            built = subprocess.run(command, capture_output=True, text=True)
            if built.returncode != 0:
                raise RuntimeError(f"g++ failed on the emulation driver:\n{built.stderr[-6000:]}")

    return cached(name, [driver, *EMULATION_FLAGS, compiler, version, *sources], build)


def symbol(v: Variant) -> str:
    return (f"run_d{v.head_dim}_b{v.bits}_k{v.key_group}_v{v.value_group}_q{v.gqa}_r{int(v.rope)}_c{int(v.codebook)}"
            f"_o{int(v.outliers)}_vb{v.vbits}_pg{v.channel_groups}")


# decode_tc's long long arguments (LONGS of them, after the outliers' buffers): the codes', parameters' and outliers'
# strides
STRIDE_NAMES = ", ".join(f"a{i}" for i in range(LONGS))
STRIDES = ", ".join(f"long long a{i}" for i in range(LONGS))


def driver(variants: list[Variant]) -> str:
    lines = ['#include "cuda_on_cpu.h"', '#include "decode_attention_tc.cu"', 'extern "C" {']
    for v in variants:
        lines.append(
            f"void {symbol(v)}(unsigned gx, unsigned gy, unsigned gz, const float* q, const unsigned char* k, const unsigned char* v,"
            " const unsigned short* ks, const unsigned short* kz, const unsigned short* vs, const unsigned short* vz, const int* meta,"
            " const float* freq, const unsigned* table, const unsigned* books, float* op, float* lp, const unsigned short* kop,"
            " const unsigned short* kov, const int* koo, const int* koc, const unsigned short* vop, const unsigned short* vov,"
            f" const int* voo, const int* voc, {STRIDES}, int kvh, int per_split,"
            " int split_offset, int total_splits, float scale, float softcap, float* out, unsigned* arrivals, const long long* sd,"
            " const int* sm,"
            " const int* sp, int segment_splits, const int* rf) {"
            f" emulation::launch({{gx, gy, gz}}, {{128, 1, 1}}, [&] {{ {v.name}(q, k, v, ks, kz, vs, vz, meta, freq, table,"
            f" books, op, lp, kop, kov, koo, koc, vop, vov, voo, voc, {STRIDE_NAMES}, kvh,"
            " per_split, split_offset, total_splits, scale, softcap, out, arrivals, sd, sm, sp, segment_splits, rf); }); }")
        flags = ", ".join("true" if x else "false" for x in (v.rope, v.codebook, v.outliers))
        lines.append(f"int smem_{symbol(v)}() {{ return tc::Shape<{v.head_dim}, {v.bits}, {v.key_group}, {v.value_group}, {flags}, "
                     f"{v.vbits}, {v.channel_groups}, {v.gqa}>::SMEM_BYTES; }}")
    lines.append("void schedule_in_reverse(int on) { emulation::reverse_schedule = on != 0; }")
    lines.append("}")
    return "\n".join(lines) + "\n"


def build(variants: list[Variant], kernel_dir: Path = kernel_source.KERNEL_DIR) -> ctypes.CDLL:
    """The library of `variants`, built from kernel_dir's decode_attention_tc.cu (the build cached by content:
    emulator_library)."""
    library = emulator_library(driver(variants), [EMULATION, kernel_dir, kernel_source.KERNEL_DIR], "decode_tc_on_cpu.so")
    lib = ctypes.CDLL(str(library))
    pointer, long, integer = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int
    lib.schedule_in_reverse.argtypes = [ctypes.c_int]
    for v in variants:
        getattr(lib, symbol(v)).argtypes = ([ctypes.c_uint] * 3 + [pointer] * POINTERS + [long] * LONGS + [integer] * INTS
                                            + [ctypes.c_float] * 2 + [pointer] * (MERGE + SEGMENTS) + [integer, pointer])
    return lib


def decode(lib: ctypes.CDLL, v: Variant, query: torch.Tensor, keys, values, kv_heads: int, lengths: list[int], scaling: float,
           per_split: int, inv_freq: torch.Tensor | None = None, attention_scaling: float = 1.0,
           positions: list[int] | None = None, visible: list[int] | None = None,
           row_first: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch of variant v over two CPU stores as the runtime makes its arguments (tensor_core.operands), each
    sequence's first lengths[b] rows (pre-RoPE keys: inv_freq, and each sequence's first position; visible: its first
    row the query sees; row_first (batch, heads): each query row's, at least its sequence's), split every per_split
    rows and merged in the launch: (out (batch, heads, head_dim) float32, the arrival counters the merging blocks
    leave). The buffers start as NaNs, so a value the kernel does not write shows."""
    batch, heads, d = query.shape
    splits = max(1, -(-max(lengths) // per_split))
    rows = tensor_core.meta_rows(keys, values, lengths, positions, visible)
    meta = torch.tensor(rows, dtype=torch.int32)
    if row_first is not None:  # (no segment blocks here)
        row_first = tensor_core.row_first_rows(rows, visible or [0] * batch, row_first, row_first)
    out_partial = torch.full((batch, heads, splits, d), float("nan"))
    lse_partial = torch.full((batch, heads, splits), float("nan"))
    out = torch.full((batch, heads, d), float("nan"))
    arrivals = kernels.arrival_counters(batch, kv_heads, "cpu")
    ops = tensor_core.operands(query.float().contiguous(), keys, values, kv_heads, scaling, per_split, 0, out_partial,
                               lse_partial, meta, inv_freq, attention_scaling, merge=(out, arrivals), row_first=row_first)
    args = [x.data_ptr() if isinstance(x, torch.Tensor) else (0 if x is None else x) for x in ops]
    getattr(lib, symbol(v))(splits, kv_heads, batch, *args)
    return out, arrivals


def schedule_in_reverse(lib: ctypes.CDLL, on: bool) -> None:
    """Run each block's threads last to first between synchronization points (on) or first to last (the default):
    a kernel whose results depend on that order (floating-point atomics into one word) gives other bits."""
    lib.schedule_in_reverse(int(on))

