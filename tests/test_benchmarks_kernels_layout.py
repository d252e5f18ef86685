"""benchmarks/kernels/layout.py: the reading kernel (benchmarks/kernels/read_pieces.cu, run under the CPU emulation) against
the host's expected folds in both layouts, its NVRTC compile for the GPUs it runs on, and the argument errors (the
timing itself needs a CUDA GPU)."""

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
                     "long long ts, long long hs, int tokens, int per_split, unsigned* folded) { emulation::launch({gx, gy, gz}, "
                     f"{{128, 1, 1}}, [&] {{ read_pieces<{n}>(cache, ss, ts, hs, tokens, per_split, folded); }}); }}")
    library = ctypes.CDLL(str(emulator_library("\n".join(lines) + "\n", [EMULATION, layout.SOURCE.parent], "read_pieces_on_cpu.so")))
    for n in PIECE_CHUNKS:
        getattr(library, f"run_read_pieces_{n}").argtypes = ([ctypes.c_uint] * 3 + [ctypes.c_void_p] + [ctypes.c_longlong] * 3
                                                             + [ctypes.c_int] * 2 + [ctypes.c_void_p])
    return library


@pytest.mark.emulation
@pytest.mark.parametrize("piece_chunks", PIECE_CHUNKS)
@pytest.mark.parametrize("tokens,slots", [(41, 20), (5, 64)])  # a short last split; splits of one and two tokens
def test_every_block_folds_exactly_its_heads_pieces_of_its_tokens_in_either_layout(emulated_reads, piece_chunks, tokens, slots):
    batch, heads = 2, 3
    per_split, splits = layout.split_plan(tokens, batch * heads, slots)
    assert (splits - 1) * per_split < tokens <= splits * per_split
    words = np.random.default_rng(tokens).integers(0, 2**32, batch * heads * tokens * piece_chunks * 4, dtype=np.uint32)
    expected = {name: layout.expected_folds(words, name, batch, heads, tokens, piece_chunks, per_split, splits) for name in layout.LAYOUTS}
    assert not np.array_equal(expected["tokens"], expected["heads"])  # the two layouts read other words
    for name in layout.LAYOUTS:
        folded = np.full((batch, heads, splits), 0xFFFFFFFF, dtype=np.uint32)
        getattr(emulated_reads, f"run_read_pieces_{piece_chunks}")(
            splits, heads, batch, words.ctypes.data, *layout.strides(name, heads, tokens, piece_chunks), tokens, per_split,
            folded.ctypes.data)
        assert np.array_equal(folded, expected[name]), name


@pytest.mark.emulation
def test_a_measurement_checks_every_launch_of_both_layouts_and_flags_one_that_read_other_bytes(emulated_reads, monkeypatch):
    """measure() as on a GPU, its launches run by the emulated kernel on CPU tensors (the timer only calls them)."""
    def emulated(piece_chunks):
        entry = getattr(emulated_reads, f"run_read_pieces_{piece_chunks}")
        return lambda grid, block, args: entry(*grid, *(int(a) for a in args))

    monkeypatch.setattr(layout, "_function", emulated)
    monkeypatch.setattr(layout, "timed", lambda run, iterations: (run(), 1e-3)[1])
    args = layout.parse_args(["--pieces", "32,48", "--tokens", "41", "--heads", "3", "--seed", "5"])
    per_split, splits, rows = layout.measure(args, slots=50, bandwidth=1e9, device="cpu")
    assert (per_split, splits) == layout.split_plan(41, layout.BATCH * 3, 50) and splits > 1
    assert [(r["piece_bytes"], r["layout"], r["checked"]) for r in rows] == [
        (32, "tokens", True), (32, "heads", True), (48, "tokens", True), (48, "heads", True)]
    assert rows[0]["bytes_read"] == layout.BATCH * 3 * 41 * 32
    swapped = {"tokens": "heads", "heads": "tokens"}
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


def test_the_tokens_layout_is_the_stores_row_of_every_heads_piece_and_the_heads_layout_a_run_per_head():
    heads, tokens, chunks = 8, 100, 2
    sequence, token, head = layout.strides("tokens", heads, tokens, chunks)
    assert (token, head, sequence) == (heads * chunks, chunks, tokens * heads * chunks)  # PackedRows: (batch, tokens, heads x row)
    sequence, token, head = layout.strides("heads", heads, tokens, chunks)
    assert (token, head, sequence) == (chunks, tokens * chunks, heads * tokens * chunks)


@pytest.mark.parametrize("arguments,problem", [
    (["--pieces", "32,24"], "--pieces 32,24: positive multiples of 16 bytes"),
    (["--pieces", "a"], "--pieces a: whole numbers of bytes"),
    (["--blocks-per-sm", "0"], "at least 1"),
])
def test_bad_arguments_exit_2_with_one_line_naming_the_problem_and_write_nothing(arguments, problem, monkeypatch, capsys):
    assert problem in refused(layout.main, arguments, monkeypatch, capsys)
