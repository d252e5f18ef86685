"""The tensor-core, cp.async and bit-trick primitives of kernels/intrinsics.cuh, through the test kernels of
tests/kernel_emulation/intrinsics_probe.cu:

- NVRTC compiles them for sm_80 and sm_90 (the inline PTX is valid) to the intended SASS;
- the CPU emulator (tests/kernel_emulation/intrinsics_on_cpu.h) runs them to what the PTX ISA specifies,
  checked here against torch (mma as a matrix product, fp16 and bf16, and bit for bit against the
  rounding rule the emulator documents), against the ISA's ldmatrix layouts written out independently in
  Python, byte for byte (cp.async, lop3, prmt) and against the documented code order (the converters);
- the checks can fail: emulators with a planted layout or timing bug are built and must be caught, and so
  must pipeline bugs in a kernel (reading a stage before waiting for it, refilling a buffer too early);
- where a GPU and CuPy are present, the same kernels run on it and must agree with the emulator bit for
  bit (seen on an H100; the mma rounding rule was measured there).
"""

import ctypes
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import emulator_library, requires_gpu
from kvcal.runtime import kernel_source
from tools import sass

pytestmark = pytest.mark.emulation

EMULATION = Path(__file__).resolve().parent / "kernel_emulation"
PROBE = EMULATION / "intrinsics_probe.cu"
DRIVER = """#include "cuda_on_cpu.h"
#include "intrinsics_probe.cu"
#define LAUNCH(...) emulation::launch({gx, 1, 1}, {bx, 1, 1}, [&] { __VA_ARGS__; })
extern "C" {
void run_probe_mma(unsigned gx, unsigned bx, const unsigned short* a, const unsigned short* b, const float* c, float* d,
                   int bf16, int path) { LAUNCH(probe_mma(a, b, c, d, bf16, path)); }
void run_probe_ldmatrix(unsigned gx, unsigned bx, const unsigned short* tile, unsigned* out, int variant) {
    LAUNCH(probe_ldmatrix(tile, out, variant)); }
void run_probe_movmatrix(unsigned gx, unsigned bx, const unsigned* in, unsigned* out) { LAUNCH(probe_movmatrix(in, out)); }
void run_probe_cp_async(unsigned gx, unsigned bx, const unsigned char* src, int bytes, uint4* dst, int stages, int bug) {
    LAUNCH(probe_cp_async(src, bytes, dst, stages, bug)); }
void run_probe_bits(unsigned gx, unsigned bx, const unsigned* a, const unsigned* b, const unsigned* c, unsigned* out,
                    int n) { LAUNCH(probe_bits(a, b, c, out, n)); }
void run_probe_dequant(unsigned gx, unsigned bx, const unsigned* words, unsigned* out, int n, int bits) {
    LAUNCH(probe_dequant(words, out, n, bits)); }
}
"""
WARP, BLOCK = 32, 64


# ------------------------------------------------------------------------------------------------ runners

class Emulated:
    """The probe kernels on the CPU emulator (a g++ build of intrinsics_probe.cu)."""

    def __init__(self, library: Path):
        self.lib = ctypes.CDLL(str(library))

    def launch(self, name, grid, block, *args):
        def c(x):
            if isinstance(x, np.ndarray):
                assert x.flags.c_contiguous
                return ctypes.c_void_p(x.ctypes.data)
            return ctypes.c_int(int(x))
        getattr(self.lib, f"run_{name}")(ctypes.c_uint(grid), ctypes.c_uint(block), *map(c, args))


class OnGpu:
    """The same kernels compiled by CuPy's NVRTC and run on the GPU."""

    def __init__(self):
        import cupy

        self.cp = cupy
        options = (*kernel_source.OPTIONS, f"-I{kernel_source.KERNEL_DIR}")
        self.module = cupy.RawModule(code=PROBE.read_text(), options=options)

    def launch(self, name, grid, block, *args):
        cp = self.cp
        on_device = [cp.asarray(x) if isinstance(x, np.ndarray) else np.int32(x) for x in args]
        self.module.get_function(name)((grid,), (block,), tuple(on_device))
        cp.cuda.runtime.deviceSynchronize()
        for host, device in zip(args, on_device):
            if isinstance(host, np.ndarray):
                host[...] = cp.asnumpy(device)


def run_mma(runner, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, path: int) -> torch.Tensor:
    """D = A (16x16) @ B (16x16) + C through probe_mma; a, b fp16 or bf16, c fp32."""
    bits = [x.contiguous().view(torch.int16).numpy().view(np.uint16).copy() for x in (a, b)]
    d = np.zeros((16, 16), np.float32)
    runner.launch("probe_mma", 1, WARP, *bits, c.numpy().astype(np.float32), d, int(a.dtype == torch.bfloat16), path)
    return torch.from_numpy(d)


def run_ldmatrix(runner, tile: np.ndarray, variant: int) -> np.ndarray:
    out = np.zeros((WARP, 4), np.uint32)
    runner.launch("probe_ldmatrix", 1, WARP, tile, out, variant)
    return out


def run_movmatrix(runner, words: np.ndarray) -> np.ndarray:
    out = np.zeros(WARP, np.uint32)
    runner.launch("probe_movmatrix", 1, WARP, words, out)
    return out


def run_cp_async(runner, src: np.ndarray, stages: int, bug: int = 0) -> np.ndarray:
    whole = -(-len(src) // 1024) * 1024
    dst = np.full(whole, 0xAB, np.uint8)  # neither the data nor the zero fill nor the poison
    runner.launch("probe_cp_async", 1, BLOCK, src, len(src), dst, stages, bug)
    return dst


def run_bits(runner, a, b, c) -> np.ndarray:
    out = np.zeros((len(a), 8), np.uint32)
    runner.launch("probe_bits", -(-len(a) // BLOCK), BLOCK, a, b, c, out, len(a))
    return out


def run_dequant(runner, words: np.ndarray, bits: int) -> np.ndarray:
    n = len(words) // 2 if bits == 3 else len(words)
    out = np.zeros((n, {4: 4, 2: 8, 3: 8, 8: 2}[bits]), np.uint32)
    runner.launch("probe_dequant", -(-n // BLOCK), BLOCK, words, out, n, bits)
    return out


# ------------------------------------------------------------------------------------------------ builds

def build_emulator(emulation_dir: Path = EMULATION) -> Path:
    return emulator_library(DRIVER, [emulation_dir, EMULATION, kernel_source.KERNEL_DIR], "probe_on_cpu.so")


@pytest.fixture(scope="module")
def emulated():
    return Emulated(build_emulator())


def mutant(tmp_path_factory, name: str, old: str, new: str) -> Emulated:
    """The emulator with one planted bug: `old` replaced by `new` in intrinsics_on_cpu.h."""
    folder = tmp_path_factory.mktemp(f"mutant-{name}")
    text = (EMULATION / "intrinsics_on_cpu.h").read_text()
    assert text.count(old) == 1, old
    (folder / "intrinsics_on_cpu.h").write_text(text.replace(old, new))
    return Emulated(build_emulator(emulation_dir=folder))


def nvrtc_compile(arch: str) -> tuple[str, bytes]:
    """(ptxas log, cubin) of intrinsics_probe.cu for `arch`, compiled as kvcal.runtime.kernel_source compiles."""
    pytest.importorskip("cuda.bindings.nvrtc", reason="NVRTC (cuda-bindings + nvidia-cuda-nvrtc-cu12) is not installed")
    compiled = kernel_source.nvrtc_compile(PROBE.read_text(), PROBE.name, arch)
    return compiled.log, compiled.cubin


def disassemble(cubin: bytes) -> str:
    """nvdisasm's listing of the cubin (tools.sass, the nvidia-cuda-nvdisasm wheel's binary)."""
    try:
        sass.nvdisasm()
    except SystemExit:
        pytest.skip("nvidia-cuda-nvdisasm is not installed")
    return sass.disassemble(cubin, line_info=False)


def gpu_runner():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    pytest.importorskip("cupy", reason="CuPy runs the kernels on the GPU")
    return OnGpu()


# ------------------------------------------------------------------------------------------------ NVRTC

PROBE_KERNELS = ("probe_mma", "probe_ldmatrix", "probe_movmatrix", "probe_cp_async", "probe_bits", "probe_dequant")
# SASS each primitive must become (sm_80 and sm_90): tensor-core HMMA, LDSM (.MT88 = transposed), MOVM, LDGSTS
# (cp.async) with its barrier-free waits (LDGDEPBAR / DEPBAR), LOP3, PRMT, paired fp16 arithmetic.
SASS = {"probe_mma": ("HMMA.16816.F32", "HMMA.16816.F32.BF16", "LDSM.16.M88.4", "LDSM.16.MT88.4", "LDSM.16.M88.2",
                      "LDSM.16.MT88.2"),
        "probe_ldmatrix": ("LDSM.16.M88.4", "LDSM.16.MT88.4", "LDSM.16.M88.2", "LDSM.16.MT88.2"),
        "probe_movmatrix": ("MOVM.16.MT88",),
        "probe_cp_async": ("LDGSTS.E.BYPASS.128", "LDGDEPBAR", "DEPBAR"),
        "probe_bits": ("LOP3.LUT", "PRMT", "HMNMX2"),
        "probe_dequant": ("LOP3.LUT", "HADD2", "HFMA2", "PRMT")}


@pytest.mark.nvrtc
@pytest.mark.parametrize("arch", kernel_source.ARCHITECTURES)
def test_the_probe_kernels_compile_with_nvrtc_to_the_intended_instructions(arch):
    log, cubin = nvrtc_compile(arch)
    report = kernel_source.parse_ptxas_report(log)
    assert sorted(f.name for f in report) == sorted(PROBE_KERNELS)
    assert {f.name: f.spill_bytes + f.stack_bytes for f in report if f.spill_bytes + f.stack_bytes} == {}
    listing = disassemble(cubin)
    for kernel, opcodes in SASS.items():
        body = re.search(r"\.text\." + kernel + r":(.*?)(?=\.section|\Z)", listing, re.S)
        assert body, kernel
        for opcode in opcodes:
            assert re.search(r"\b" + re.escape(opcode) + r"\b", body.group(1)), f"{kernel} on {arch}: no {opcode}"
    # the converters' constant tables fold into immediates: the only memory reads are the probe's 5 input words
    dequant = re.search(r"\.text\.probe_dequant:(.*?)(?=\.section|\Z)", listing, re.S).group(1)
    assert len(re.findall(r"\bLDG\.E\b", dequant)) == 5 and not re.search(r"\b(LDL|STL|LDS)\b", dequant)


# ------------------------------------------------------------------------------------------------ mma

def tensor_core_rule(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """A @ B + C by the rule the emulator documents (measured on an H100): exact products; every term
    truncated toward zero to a multiple of 2^(e - 25), e the largest exponent among c and the products
    (a product's exponent taken as the sum of its factors'); exact sum; rounded toward zero to fp32."""
    a, b, c = a.double().tolist(), b.double().tolist(), c.double().tolist()
    exponent = lambda x: math.frexp(x)[1] - 1  # noqa: E731
    d = torch.zeros(len(a), len(b[0]), dtype=torch.float32)
    for i, row in enumerate(a):
        for j in range(len(b[0])):
            terms = [(c[i][j], exponent(c[i][j]))] + [(x * b[k][j], exponent(x) + exponent(b[k][j])) for k, x in enumerate(row)]
            e = max((e for t, e in terms if t), default=None)
            if e is None:
                continue
            total = sum(int(math.ldexp(t, 25 - e)) for t, _ in terms)  # int() truncates toward zero
            magnitude = abs(total)
            shift = max(magnitude.bit_length() - 1 + e - 25 - 23, -149) - (e - 25) if magnitude else 0
            if shift > 0:
                magnitude = magnitude >> shift << shift
            d[i, j] = math.copysign(math.ldexp(magnitude, e - 25), total)
    return d


def mma_inputs(dtype, seed: int):
    """Random A, B, C at one of several scales (fp16 subnormals included at 2^-12)."""
    g = torch.Generator().manual_seed(seed)
    scale = (1.0, 3.0, 100.0, 1e-3, 2.0**-12)[seed % 5]
    a, b = (torch.randn(16, 16, generator=g) * scale).to(dtype), torch.randn(16, 16, generator=g).to(dtype)
    return a, b, torch.randn(16, 16, generator=g) * scale * (seed % 3)


def subnormal_code_inputs(seed: int):
    """A as the tensor-core kernel reads raw value codes: fp16 subnormals code * 2^(s - 24) (2-bit codes s = 0, 2, 4
    or 6 bits up the mantissa, exponent field 0); B as its P' (probabilities times a scale); C a running sum."""
    g = torch.Generator().manual_seed(seed)
    a = (torch.randint(0, 4, (16, 16), generator=g) << 2 * torch.randint(0, 4, (16, 16), generator=g)).to(torch.int16).view(torch.float16)
    b = (torch.rand(16, 16, generator=g) * 2.0 ** -(seed % 12)).to(torch.float16)
    return a, b, (a.float() @ b.float()) * torch.rand(16, 16, generator=g) * 100


def assert_is_the_product(d, a, b, c):
    """D = A @ B + C up to fp32 summation error: |D - exact| <= 17 u (|C| + |A| @ |B|), u = 2^-24. A wrong
    fragment, register or half mapping moves whole products and fails by orders of magnitude more."""
    a64, b64, c64 = a.double(), b.double(), c.double()
    exact = a64 @ b64 + c64
    bound = 17 * 2.0**-24 * (c64.abs() + a64.abs() @ b64.abs()) + 1e-30
    excess = ((d.double() - exact).abs() / bound).max().item()
    assert excess <= 1.0, f"D differs from A @ B + C by {excess:.3g} times the fp32 summation bound"


@pytest.mark.parametrize("path", (0, 1, 2, 3), ids=("registers", "ldmatrix-x4-trans", "ldmatrix-x2", "ldmatrix-x2-trans"))
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=("f16", "bf16"))
def test_emulated_mma_is_the_matrix_product(emulated, dtype, path):
    for seed in range(path, 20, 4):
        a, b, c = mma_inputs(dtype, seed)
        d = run_mma(emulated, a, b, c, path)
        assert_is_the_product(d, a, b, c)
        torch.testing.assert_close(d, tensor_core_rule(a, b, c), rtol=0, atol=0)  # the documented rounding, bit for bit
    # distinct small integers: every product and sum is exact, so any order gives these very bits
    a = torch.arange(256).reshape(16, 16).remainder(13).sub(6).to(dtype)
    b = torch.arange(256).reshape(16, 16).mul(7).remainder(11).sub(5).to(dtype)
    c = torch.arange(256, dtype=torch.float32).reshape(16, 16)
    torch.testing.assert_close(run_mma(emulated, a, b, c, path), a.double() @ b.double() + c.double(), rtol=0, atol=0,
                               check_dtype=False)
    a, b, c = subnormal_code_inputs(path)
    assert (a.view(torch.int16) < 1024).all() and a.abs().max() < 2.0**-14  # every element subnormal
    assert_is_the_product(run_mma(emulated, a, b, c, path), a, b, c)


# ------------------------------------------------------------------------------------------------ ldmatrix

def ldmatrix_expected(tile: np.ndarray, variant: int) -> np.ndarray:
    """The PTX ISA's ldmatrix section, written out: lane 8i + j addresses row j of matrix i; the probe's lane L points
    at tile row L % 16, column 8 (L / 16). Lane L gets matrix i's row L/4, columns 2(L%4) + {0, 1}
    (.trans: column L/4, rows 2(L%4) + {0, 1}), the first element in the low 16 bits."""
    out = np.zeros((WARP, 4), np.uint32)
    tiles = 4 if variant in (0, 1) else 2
    for lane in range(WARP):
        for i in range(tiles):
            def element(r, col):  # element (r, col) of matrix i
                source = 8 * i + r  # the lane whose address is row r of matrix i
                return int(tile[source % 16, 8 * (source // 16) + col])
            g, t = lane // 4, lane % 4
            if variant in (0, 2):
                lo, hi = element(g, 2 * t), element(g, 2 * t + 1)
            else:
                lo, hi = element(2 * t, g), element(2 * t + 1, g)
            out[lane, i] = lo | hi << 16
    return out


@pytest.mark.parametrize("variant", (0, 1, 2, 3), ids=("x4", "x4-trans", "x2", "x2-trans"))
def test_emulated_ldmatrix_follows_the_ptx_layout(emulated, variant):
    tile = np.arange(256, dtype=np.uint16).reshape(16, 16) * 3 + 1  # every element distinct
    np.testing.assert_array_equal(run_ldmatrix(emulated, tile, variant), ldmatrix_expected(tile, variant))


def movmatrix_expected(words: np.ndarray) -> np.ndarray:
    """The PTX ISA's movmatrix section, written out: lane L holds row L/4, columns 2(L%4) + {0, 1} of an 8x8 matrix
    (the first in the low 16 bits) and receives the transpose's: column L/4, rows 2(L%4) + {0, 1}."""
    matrix = np.zeros((8, 8), np.uint32)
    for lane, word in enumerate(words):
        matrix[lane // 4, 2 * (lane % 4)], matrix[lane // 4, 2 * (lane % 4) + 1] = word & 0xFFFF, word >> 16
    return np.array([matrix[2 * (lane % 4), lane // 4] | matrix[2 * (lane % 4) + 1, lane // 4] << 16 for lane in range(WARP)],
                    np.uint32)


def test_emulated_movmatrix_transposes_the_warps_matrix(emulated):
    words = np.random.default_rng(7).integers(0, 2**32, WARP, dtype=np.uint64).astype(np.uint32)
    np.testing.assert_array_equal(run_movmatrix(emulated, words), movmatrix_expected(words))
    np.testing.assert_array_equal(run_movmatrix(emulated, run_movmatrix(emulated, words)), words)  # its own inverse


# ------------------------------------------------------------------------------------------------ cp.async

LENGTHS = (1, 16, 17, 1024, 3007, 4096)


@pytest.mark.parametrize("stages", (2, 3, 4))
def test_emulated_cp_async_pipeline_copies_exactly_with_a_zero_filled_tail(emulated, stages):
    rng = np.random.default_rng(stages)
    for length in LENGTHS:
        src = rng.integers(0, 256, length, dtype=np.uint8)
        dst = run_cp_async(emulated, src, stages)
        np.testing.assert_array_equal(dst[:length], src)
        assert not dst[length:].any(), "the src-size form zero-fills the rest of each 16-byte chunk and empty chunks"


@pytest.mark.parametrize("bug", (1, 2), ids=("read-before-wait", "refill-before-barrier"))
@pytest.mark.parametrize("stages", (2, 3))
def test_emulated_cp_async_exposes_a_pipeline_that_does_not_wait(emulated, stages, bug):
    """Reading a stage that is still in flight, or refilling a buffer that other threads still read, must
    not pass by luck: the emulator poisons destinations until the wait that retires their group."""
    src = np.random.default_rng(0).integers(0, 255, 4096, dtype=np.uint8)  # never 0xFF, the poison
    dst = run_cp_async(emulated, src, stages, bug)
    assert (dst == 0xFF).any(), "the pipeline bug went unnoticed"


# ------------------------------------------------------------------------------------------------ lop3, prmt

def bit_words(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    words = [rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32) for _ in range(3)]
    edge = np.array([0, 0xFFFFFFFF, 0x80808080, 0x7F7F7F7F, 0x76543210, 0xFEDCBA98, 0x88888888, 0x01234567], np.uint32)
    for w, shift in zip(words, (0, 3, 5)):  # every edge pattern against every other, including as selectors
        w[: len(edge) ** 2] = np.roll(np.repeat(edge, len(edge)) if shift == 0 else np.tile(edge, len(edge)), shift)
    return words


def prmt_expected(a, b, c):
    out = np.zeros_like(a)
    for i in range(4):
        nibble = (c >> np.uint32(4 * i)) & np.uint32(0xF)
        source = np.where((nibble & 7) < 4, a, b)
        byte = (source >> (np.uint32(8) * (nibble & np.uint32(3)))) & np.uint32(0xFF)
        byte = np.where(nibble & 8, np.where(byte & 0x80, np.uint32(0xFF), np.uint32(0)), byte)
        out |= byte.astype(np.uint32) << np.uint32(8 * i)
    return out


def hmax2_expected(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """max.f16x2 per lane: a NaN loses to a number, two NaNs give 0x7FFF, +0 beats -0."""
    out = np.zeros_like(a)
    for lane in (0, 1):
        x, y = (a >> np.uint32(16 * lane)) & np.uint32(0xFFFF), (b >> np.uint32(16 * lane)) & np.uint32(0xFFFF)
        u, v = x.astype(np.uint16).view(np.float16), y.astype(np.uint16).view(np.float16)
        pick_x = np.where(np.isnan(v), True, np.where(np.isnan(u), False, (u > v) | ((u == v) & (x < 0x8000))))
        r = np.where(np.isnan(u) & np.isnan(v), np.uint32(0x7FFF), np.where(pick_x, x, y))
        out |= r.astype(np.uint32) << np.uint32(16 * lane)
    return out


def nan_lanes(words: np.ndarray) -> np.ndarray:
    """The bits of the fp16 lanes of `words` that hold a NaN."""
    out = np.zeros_like(words)
    for lane in (0, 1):
        x = (words >> np.uint32(16 * lane)) & np.uint32(0xFFFF)
        out |= np.where((x & 0x7C00 == 0x7C00) & (x & 0x3FF != 0), np.uint32(0xFFFF), np.uint32(0)) << np.uint32(16 * lane)
    return out


def test_emulated_lop3_prmt_hmax2_and_hneg2_compute_their_ptx_definitions(emulated):
    a, b, c = bit_words(4096, seed=1)
    out = run_bits(emulated, a, b, c)
    expected = [(a & b) | c, (a & c) | (b & ~c), a ^ b ^ c, ~(a | b | c), a ^ (b & c), prmt_expected(a, b, c),
                hmax2_expected(a, b), a ^ np.uint32(0x80008000)]  # hneg2: NaN lanes too (one of the NaNs PTX allows)
    for column, want in enumerate(expected):
        np.testing.assert_array_equal(out[:, column], want, err_msg=f"probe_bits column {column}")


# ------------------------------------------------------------------------------------------------ converters

def half_bits(values) -> np.ndarray:
    return np.asarray(values, np.float16).view(np.uint16).astype(np.uint32)


def pairs(codes: np.ndarray) -> np.ndarray:
    """Documented order: a word of N codes -> out[j] = {code j (low half), code j + N/2 (high half)}."""
    half = codes.shape[1] // 2
    return half_bits(codes[:, :half]) | half_bits(codes[:, half:]) << 16


def code_words(bits: int, per_word: int, n_random: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Words with every code value at every position (code i = (v + i) mod 2^bits), then random words;
    returns (words, codes[n, per_word])."""
    levels = 1 << bits
    structured = (np.arange(levels)[:, None] + np.arange(per_word)[None, :]) % levels
    random = np.random.default_rng(seed).integers(0, levels, (n_random, per_word))
    codes = np.concatenate([structured, random]).astype(np.uint64)
    words = (codes << (bits * np.arange(per_word, dtype=np.uint64))).sum(axis=1).astype(np.uint32)
    return words, codes


@pytest.mark.parametrize("bits", (2, 4, 8))
def test_emulated_converters_give_each_code_in_the_documented_order(emulated, bits):
    words, codes = code_words(bits, 32 // bits, 2000, seed=bits)
    np.testing.assert_array_equal(run_dequant(emulated, words, bits), pairs(codes))


def three_bit_planes(n_random: int, seed: int):
    """(interleaved {low2, high1} words, codes[n, 16]) with the plane layout of u3_planes_to_half2: code 2j's
    third bit at bit 4j + 2 of high1, code 2j+1's at 4j + 3; bits 0 and 1 of each nibble are random junk."""
    structured = (np.arange(8)[:, None] + np.arange(16)[None, :]) % 8
    rng = np.random.default_rng(seed)
    codes = np.concatenate([structured, rng.integers(0, 8, (n_random, 16))]).astype(np.uint64)
    positions = np.arange(16, dtype=np.uint64)
    low2 = ((codes & 3) << (2 * positions)).sum(axis=1)
    plane_bit = 4 * (positions // 2) + 2 + positions % 2
    junk = rng.integers(0, 2**32, len(codes), dtype=np.uint64) & 0x33333333
    high1 = ((codes >> 2) << plane_bit).sum(axis=1) | junk
    return np.stack([low2, high1], axis=1).astype(np.uint32).reshape(-1), codes


def test_emulated_three_bit_plane_converter_reads_both_planes(emulated):
    words, codes = three_bit_planes(2000, seed=3)
    np.testing.assert_array_equal(run_dequant(emulated, words, 3), pairs(codes))


# ------------------------------------------------------------------------------------------------ the checks bite

MUTANTS = {  # planted emulator bugs, each of which one of the checks above must catch
    "a-registers-swapped": ("[(row >> 3) + 2 * (k >> 3)]", "[2 * (row >> 3) + (k >> 3)]"),
    "b-lanes-by-row": ("slots[base + col * 4 + (k & 7u) / 2].b[k >> 3]", "slots[base + ((k & 7u) / 2) * 8 + col / 2].b[k >> 3]"),
    "ldmatrix-trans-halves-swapped": ("out[i] = lo | (unsigned)hi << 16;", "out[i] = hi | (unsigned)lo << 16;"),
    "movmatrix-not-transposed": ("element(row, column) | element(row + 1, column) << 16", "element(column, row) | element(column, row + 1) << 16"),
    "cp-async-lands-at-issue": ("std::memset(shared_dst, 0xFF, size);", "std::memcpy(shared_dst, copy.bytes, size);"),
}


@pytest.mark.parametrize("name", MUTANTS)
def test_a_planted_emulator_bug_is_caught(tmp_path_factory, name):
    broken = mutant(tmp_path_factory, name, *MUTANTS[name])
    g = torch.Generator().manual_seed(0)
    a, b, c = torch.randn(16, 16, generator=g).half(), torch.randn(16, 16, generator=g).half(), torch.zeros(16, 16)
    if name == "cp-async-lands-at-issue":
        # the copies themselves still look right; only the kernel with the missing wait slips through
        src = np.random.default_rng(0).integers(0, 255, 4096, dtype=np.uint8)
        np.testing.assert_array_equal(run_cp_async(broken, src, 2, bug=0), src)
        with pytest.raises(AssertionError, match="went unnoticed"):
            test_emulated_cp_async_exposes_a_pipeline_that_does_not_wait(broken, 2, 1)
    elif name.startswith("movmatrix"):
        with pytest.raises(AssertionError):
            test_emulated_movmatrix_transposes_the_warps_matrix(broken)
    elif name.startswith("ldmatrix"):
        with pytest.raises(AssertionError):
            test_emulated_ldmatrix_follows_the_ptx_layout(broken, 1)
        with pytest.raises(AssertionError):
            assert_is_the_product(run_mma(broken, a, b, c, 1), a, b, c)
        assert_is_the_product(run_mma(broken, a, b, c, 0), a, b, c)  # mma alone is untouched
    else:
        with pytest.raises(AssertionError, match="fp32 summation bound"):
            assert_is_the_product(run_mma(broken, a, b, c, 0), a, b, c)


# ------------------------------------------------------------------------------------------------ GPU

@requires_gpu
def test_the_gpu_runs_the_probe_kernels_as_the_emulator_does(emulated):
    """Same inputs on the GPU and the emulator, bit for bit; mma included, whose rounding the PTX ISA leaves
    unspecified and the emulator takes from measurements on an H100 (other GPUs may round differently)."""
    gpu = gpu_runner()
    tile = np.arange(256, dtype=np.uint16).reshape(16, 16) * 3 + 1
    for variant in range(4):
        np.testing.assert_array_equal(run_ldmatrix(gpu, tile, variant), ldmatrix_expected(tile, variant))
    words = np.random.default_rng(7).integers(0, 2**32, WARP, dtype=np.uint64).astype(np.uint32)
    np.testing.assert_array_equal(run_movmatrix(gpu, words), movmatrix_expected(words))
    for stages in (2, 3, 4):
        src = np.random.default_rng(stages).integers(0, 256, 3007, dtype=np.uint8)
        dst = run_cp_async(gpu, src, stages)
        np.testing.assert_array_equal(dst[:3007], src)
        assert not dst[3007:].any()
    a, b, c = bit_words(4096, seed=1)
    on_gpu, emulated_bits = run_bits(gpu, a, b, c), run_bits(emulated, a, b, c)
    np.testing.assert_array_equal(on_gpu[:, :7], emulated_bits[:, :7])
    numbers = ~nan_lanes(a)  # hneg2 of a NaN: some NaN (unspecified)
    np.testing.assert_array_equal(on_gpu[:, 7] & numbers, emulated_bits[:, 7] & numbers)
    assert not ((nan_lanes(on_gpu[:, 7]) ^ nan_lanes(a)).any())
    for bits, words in ((2, code_words(2, 16, 2000, 2)[0]), (4, code_words(4, 8, 2000, 4)[0]), (8, code_words(8, 4, 2000, 8)[0]),
                        (3, three_bit_planes(2000, 3)[0])):
        np.testing.assert_array_equal(run_dequant(gpu, words, bits), run_dequant(emulated, words, bits))
    for dtype in (torch.float16, torch.bfloat16):
        for seed in range(40):
            a, b, c = mma_inputs(dtype, seed)
            on_gpu = run_mma(gpu, a, b, c, seed % 4)
            assert_is_the_product(on_gpu, a, b, c)
            torch.testing.assert_close(on_gpu, run_mma(emulated, a, b, c, seed % 4), rtol=0, atol=0)
    for seed in range(24):  # the decode kernel's raw value codes, fp16 subnormals: exact products on the tensor core
        a, b, c = subnormal_code_inputs(seed)
        on_gpu = run_mma(gpu, a, b, c, seed % 4)
        assert_is_the_product(on_gpu, a, b, c)
        torch.testing.assert_close(on_gpu, run_mma(emulated, a, b, c, seed % 4), rtol=0, atol=0)
