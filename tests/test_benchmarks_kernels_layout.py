"""benchmarks/kernels/layout.py: the reading kernel (benchmarks/kernels/read_pieces.cu, run under the CPU emulation)
against the host's expected folds in each layout, the measurement loop through it, its NVRTC compile for the GPUs it
runs on, and the argument errors (the timing itself needs a CUDA GPU)."""

import ctypes

import numpy as np
import pytest

from benchmarks.kernels import layout
from helpers import emulator_library, refused
from kvcal.runtime import kernel_source
from tools.kernel_emulation import EMULATION

PIECE_CHUNKS = (2, 3)  # 32-byte pieces (int2 at head_dim 128) and 48 (3-bit codes)


@pytest.fixture(scope="module")
def emulated_reads():
    """run_read_pieces_<chunks>(grid, read_pieces' arguments) of read_pieces.cu, unchanged, on the CPU."""
    lines = ['#include "cuda_on_cpu.h"', '#include "read_pieces.cu"']
    for n in PIECE_CHUNKS:
        lines.append(f'extern "C" void run_read_pieces_{n}(unsigned gx, unsigned gy, unsigned gz, const uint4* cache, long long ss, '
                     "long long bs, long long ts, long long hs, int shift, int tokens, int per_split, unsigned* folded) { "
                     "emulation::launch({gx, gy, gz}, {128, 1, 1}, [&] { "
                     f"read_pieces<{n}>(cache, ss, bs, ts, hs, shift, tokens, per_split, folded); }}); }}")
    library = ctypes.CDLL(str(emulator_library("\n".join(lines) + "\n", [EMULATION, layout.SOURCE.parent, kernel_source.KERNEL_DIR],
                                                         "read_pieces_on_cpu.so")))
    for n in PIECE_CHUNKS:
        getattr(library, f"run_read_pieces_{n}").argtypes = ([ctypes.c_uint] * 3 + [ctypes.c_void_p] + [ctypes.c_longlong] * 4
                                                             + [ctypes.c_int] * 3 + [ctypes.c_void_p])
    return library


@pytest.mark.emulation
@pytest.mark.parametrize("piece_chunks", PIECE_CHUNKS)
@pytest.mark.parametrize("tokens,block_tokens,slots", [(44, 4, 20), (6, 2, 64)])  # a short last split; splits of one token
def test_every_block_folds_exactly_its_heads_pieces_of_its_tokens_in_every_layout(emulated_reads, piece_chunks, tokens,
                                                                                   block_tokens, slots):
    batch, heads = 2, 3
    per_split, splits = layout.split_plan(tokens, batch * heads, slots)
    assert (splits - 1) * per_split < tokens <= splits * per_split and per_split % block_tokens  # splits cut blocks
    words = np.random.default_rng(tokens).integers(0, 2**32, batch * heads * tokens * piece_chunks * 4, dtype=np.uint32)
    expected = {name: layout.expected_folds(words, name, batch, heads, tokens, piece_chunks, block_tokens, per_split, splits)
                for name in layout.LAYOUTS}
    assert len({folds.tobytes() for folds in expected.values()}) == 3  # the layouts read other words
    for name in layout.LAYOUTS:
        folded = np.full((batch, heads, splits), 0xFFFFFFFF, dtype=np.uint32)
        getattr(emulated_reads, f"run_read_pieces_{piece_chunks}")(
            splits, heads, batch, words.ctypes.data, *layout.strides(name, heads, tokens, piece_chunks, block_tokens), tokens,
            per_split, folded.ctypes.data)
        assert np.array_equal(folded, expected[name]), name


@pytest.mark.emulation
def test_a_measurement_checks_every_launch_of_every_layout_and_flags_one_that_read_other_bytes(emulated_reads, monkeypatch):
    """measure() as on a GPU, its launches run by the emulated kernel on CPU tensors (the timer only calls them)."""
    monkeypatch.setattr(layout, "_function", lambda piece_chunks: getattr(emulated_reads, f"run_read_pieces_{piece_chunks}"))
    monkeypatch.setattr(layout, "launch", lambda entry, grid, block, args: entry(*grid, *(int(a) for a in args)))
    monkeypatch.setattr(layout, "timed", lambda run, iterations: (run(), 1e-3)[1])
    args = layout.parse_args(["--pieces", "32,48", "--tokens", "40", "--block-tokens", "8", "--heads", "3", "--seed", "5"])
    per_split, splits, rows = layout.measure(args, slots=50, bandwidth=1e9, device="cpu")
    assert (per_split, splits) == layout.split_plan(40, layout.BATCH * 3, 50) and splits > 1
    assert [(r["piece_bytes"], r["layout"], r["checked"]) for r in rows] == [
        (piece, name, True) for piece in (32, 48) for name in ("tokens", "blocks", "heads")]
    assert rows[0]["bytes_read"] == layout.BATCH * 3 * 40 * 32
    swapped = {"tokens": "heads", "blocks": "tokens", "heads": "blocks"}
    strides = layout.strides
    monkeypatch.setattr(layout, "strides", lambda name, *rest: strides(swapped[name], *rest))  # each launch reads the other layout
    assert not any(r["checked"] for r in layout.measure(args, slots=50, bandwidth=1e9, device="cpu")[2])


@pytest.mark.nvrtc
@pytest.mark.parametrize("arch", kernel_source.ARCHITECTURES)
def test_the_reads_of_every_default_piece_size_compile_without_spills(arch):
    sizes = layout.parse_args([]).pieces
    names = [f"read_pieces<{size // layout.CHUNK}>" for size in sizes]
    compiled = kernel_source.nvrtc_compile(layout.SOURCE.read_text(), layout.SOURCE.name, arch, names)
    assert len(compiled.functions) == len(sizes) and all(f.spill_bytes == 0 for f in compiled.functions)


def test_each_layout_places_a_chunk_where_its_store_keeps_it():
    heads, tokens, chunks, block_tokens = 8, 128, 2, 16

    def place(name, sequence, token, head, chunk):  # read_pieces' address of it
        sequence_stride, block, token_stride, head_stride, shift = layout.strides(name, heads, tokens, chunks, block_tokens)
        return (sequence * sequence_stride + (token >> shift) * block + (token & ((1 << shift) - 1)) * token_stride
                + head * head_stride + chunk)

    stores = {"tokens": np.arange(2 * tokens * heads * chunks).reshape(2, tokens, heads, chunks),  # PackedRows' rows
              "blocks": np.arange(2 * tokens * heads * chunks).reshape(2, tokens // block_tokens, heads, block_tokens, chunks),
              "heads": np.arange(2 * heads * tokens * chunks).reshape(2, heads, tokens, chunks)}
    for sequence, token, head, chunk in ((0, 0, 0, 0), (1, 37, 5, 1), (1, tokens - 1, heads - 1, 1)):
        at = {"tokens": (sequence, token, head, chunk), "blocks": (sequence, token // block_tokens, head, token % block_tokens, chunk),
              "heads": (sequence, head, token, chunk)}
        for name, store in stores.items():
            assert place(name, sequence, token, head, chunk) == store[at[name]], name


@pytest.mark.parametrize("arguments,problem", [
    (["--pieces", "32,24"], "--pieces 32,24: positive multiples of 16 bytes"),
    (["--pieces", "a"], "--pieces a: whole numbers of bytes"),
    (["--blocks-per-sm", "0"], "at least 1"),
    (["--block-tokens", "48"], "--block-tokens 48: a power of two that divides --tokens 65536"),
    (["--tokens", "100"], "--block-tokens 64: a power of two that divides --tokens 100"),
])
def test_bad_arguments_exit_2_with_one_line_naming_the_problem_and_write_nothing(arguments, problem, monkeypatch, capsys):
    assert problem in refused(layout.main, arguments, monkeypatch, capsys)
