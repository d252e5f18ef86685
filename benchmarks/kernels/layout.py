"""How fast a GPU reads one side of a KV cache by its layout alone: the decode kernel's reads, without its arithmetic.

Why: the static bound and its calibrated model (tools/bound_decode.py) take a cache's bytes at the device's copy
bandwidth, and the packed caches decode well below it (benchmarks/results/decode_tc_*.md). kvcal's stores hold a
token's row of every KV head together (kvcal.runtime.store.PackedRows: (batch, tokens, KV heads x row)), so a decode
block, which serves one KV head, reads a piece of 32 bytes (int2 at head_dim 128) to 256 (fp16) out of every row, KV
heads x piece bytes apart. This times reading exactly those pieces, block for block as the decode launch reads them
(benchmarks/kernels/read_pieces.cu: blocks of (split, KV head, sequence) of 128 threads, one wave of --blocks-per-sm
a multiprocessor, a cp.async pipeline of 16-byte copies, 12 in flight a thread), beside the same bytes paged and
stored per KV head: what the layout costs before any instruction of the decode kernel runs.

Per piece size (--pieces, bytes: 32 int2, 48 3-bit codes, 64 int4, 128, 256 fp16, at head_dim 128) and layout
(`tokens`: kvcal's, a token's pieces of every KV head together; `blocks`: paged, as vLLM's and FlashInfer's caches,
blocks of --block-tokens tokens holding a KV head's run of the block's tokens after another's; `heads`: a KV head's
tokens together), the median of --iters launches with L2 flushed before each (gpu_timing.timed), and the bytes read
over it as a fraction of the device-to-device copy bandwidth. Before timing, every block's xor of what it read is
checked against the host's (expected_folds) on random data drawn under --seed.

Usage (CUDA + CuPy): python -m benchmarks.kernels layout [--pieces 32,48,64,128,256] [--iters 30] [--blocks-per-sm 4]
                                                        [--tokens 65536] [--block-tokens 64] [--seed 0]
Writes benchmarks/results/layout_read_<device>.{json,md}.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import device_slug, provenance, write_markdown, write_result
from benchmarks.kernels.gpu_timing import KV_HEADS, copy_bandwidth, timed
from kvcal.runtime.kernels import launch

SOURCE = Path(__file__).with_name("read_pieces.cu")
THREADS = 128  # read_pieces' block
CHUNK = 16  # bytes a load
BATCH = 8
LAYOUTS = ("tokens", "blocks", "heads")


def strides(layout: str, heads: int, tokens: int, piece_chunks: int, block_tokens: int) -> tuple[int, int, int, int, int]:
    """read_pieces' (sequence, block, token, head) strides in 16-byte chunks and block shift for one side of a cache of
    `heads` KV heads, `tokens` tokens a sequence and pieces of `piece_chunks` chunks in `layout`: `tokens`, a token's
    row of every head's piece (kvcal's stores); `blocks`, paged: blocks of `block_tokens` tokens (a power of two that
    divides `tokens`), a head's run of the block's tokens in each; `heads`, a head's run of every token's piece."""
    row = heads * piece_chunks  # a token's pieces of every head
    if layout == "tokens":
        return tokens * row, row, 0, piece_chunks, 0
    if layout == "blocks":
        return tokens * row, block_tokens * row, piece_chunks, block_tokens * piece_chunks, block_tokens.bit_length() - 1
    if layout == "heads":
        return tokens * row, 0, piece_chunks, tokens * piece_chunks, 30  # one block of every token (fewer than 2^30)
    raise ValueError(f"layout {layout!r}: one of {', '.join(LAYOUTS)}")


def split_plan(tokens: int, pairs: int, slots: int) -> tuple[int, int]:
    """(tokens per split, splits): as many splits as fill one wave of `slots` resident blocks over `pairs` (sequence,
    KV head), as the decode launcher plans them (kvcal.runtime.tensor_core.split_plan), in tokens rather than whole
    stages."""
    splits = max(1, min(tokens, slots // max(pairs, 1)))
    per_split = math.ceil(tokens / splits)
    return per_split, math.ceil(tokens / per_split)


def expected_folds(words: np.ndarray, layout: str, batch: int, heads: int, tokens: int, piece_chunks: int, block_tokens: int,
                   per_split: int, splits: int) -> np.ndarray:
    """What read_pieces writes for a cache of uint32 `words` read in `layout` (see strides): per (sequence, head,
    split), the xor of every word of its tokens' pieces; (batch, heads, splits) uint32."""
    piece_words = piece_chunks * CHUNK // 4
    if layout == "tokens":
        per_token = np.bitwise_xor.reduce(words.reshape(batch, tokens, heads, piece_words), axis=-1).transpose(0, 2, 1)
    elif layout == "blocks":
        blocks = words.reshape(batch, tokens // block_tokens, heads, block_tokens, piece_words)
        per_token = np.bitwise_xor.reduce(blocks, axis=-1).transpose(0, 2, 1, 3).reshape(batch, heads, tokens)
    else:
        per_token = np.bitwise_xor.reduce(words.reshape(batch, heads, tokens, piece_words), axis=-1)
    padded = np.zeros((batch, heads, per_split * splits), dtype=np.uint32)  # 0, xor's identity, past the last token
    padded[:, :, :tokens] = per_token
    return np.bitwise_xor.reduce(padded.reshape(batch, heads, splits, per_split), axis=-1)


@functools.cache
def _function(piece_chunks: int):
    import cupy

    from kvcal.runtime.kernel_source import KERNEL_DIR, OPTIONS

    name = f"read_pieces<{piece_chunks}>"  # (it includes kernels/intrinsics.cuh: the decode kernel's cp.async)
    options = (*OPTIONS, f"--include-path={KERNEL_DIR}")
    return cupy.RawModule(code=SOURCE.read_text(), options=options, name_expressions=[name]).get_function(name)


def prepare(cache: torch.Tensor, layout: str, batch: int, heads: int, tokens: int, piece_chunks: int, block_tokens: int,
            per_split: int, splits: int):
    """The launch of read_pieces over `cache` (CUDA, int32 words) in `layout`; returns the function that launches it
    and returns its folds (batch, heads, splits), the buffer they are written to (`folded`)."""
    sequence, block, token, head, shift = strides(layout, heads, tokens, piece_chunks, block_tokens)
    folded = torch.empty(batch, heads, splits, dtype=torch.int32, device=cache.device)
    args = (np.uint64(cache.data_ptr()), np.int64(sequence), np.int64(block), np.int64(token), np.int64(head), np.int32(shift),
            np.int32(tokens), np.int32(per_split), np.uint64(folded.data_ptr()))
    function = _function(piece_chunks)

    def run() -> torch.Tensor:
        launch(function, (splits, heads, batch), (THREADS,), args)  # (on torch's current stream, as the runtime's)
        return folded

    run.folded = folded
    return run


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--pieces", default="32,48,64,128,256",
                        help="bytes of a KV head's piece of a token's row, multiples of 16, comma-separated (default: %(default)s)")
    parser.add_argument("--iters", type=int, default=30, help="timed launches per measurement, median reported (default: %(default)s)")
    parser.add_argument("--blocks-per-sm", type=int, default=4,
                        help="resident blocks a multiprocessor the split plan fills (default: %(default)s, int2 g128's)")
    parser.add_argument("--tokens", type=int, default=65536,
                        help="tokens a sequence (default: %(default)s: both sides of a 32K-token cache, as one)")
    parser.add_argument("--heads", type=int, default=KV_HEADS, help="KV heads (default: %(default)s)")
    parser.add_argument("--block-tokens", type=int, default=64,
                        help="tokens a block of the paged layout, a power of two that divides --tokens (default: %(default)s, "
                             "the decode kernel's stage)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random cache (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        args.pieces = [int(p) for p in args.pieces.split(",")]
    except ValueError:
        parser.error(f"--pieces {args.pieces}: whole numbers of bytes, comma-separated")
    if any(p <= 0 or p % CHUNK for p in args.pieces):
        parser.error(f"--pieces {','.join(map(str, args.pieces))}: positive multiples of {CHUNK} bytes (whole loads)")
    if min(args.iters, args.blocks_per_sm, args.tokens, args.heads) < 1:
        parser.error("--iters, --blocks-per-sm, --tokens and --heads are at least 1")
    if args.block_tokens < 1 or args.block_tokens & (args.block_tokens - 1) or args.tokens % args.block_tokens:
        parser.error(f"--block-tokens {args.block_tokens}: a power of two that divides --tokens {args.tokens}")
    if args.tokens >= 2**30:
        parser.error(f"--tokens {args.tokens}: fewer than 2^30")
    return args


def measure(args: argparse.Namespace, slots: int, bandwidth: float, device: str = "cuda") -> tuple[int, int, list[dict]]:
    """(tokens per split, splits, a row per piece size and layout): each launch checked against expected_folds after
    its folds were poisoned, then timed (gpu_timing.timed); `slots`: the resident blocks the split plan fills."""
    per_split, splits = split_plan(args.tokens, BATCH * args.heads, slots)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    rows = []
    for piece in args.pieces:
        chunks = piece // CHUNK
        words = BATCH * args.heads * args.tokens * piece // 4
        cache = torch.randint(-2**31, 2**31 - 1, (words,), dtype=torch.int32, device=device, generator=generator)
        host, read = cache.cpu().numpy().view(np.uint32), 4 * words
        for layout in LAYOUTS:
            run = prepare(cache, layout, BATCH, args.heads, args.tokens, chunks, args.block_tokens, per_split, splits)
            run.folded.fill_(-1)  # poisoned: a block that writes nothing shows
            got = run().cpu().numpy().view(np.uint32)
            want = expected_folds(host, layout, BATCH, args.heads, args.tokens, chunks, args.block_tokens, per_split, splits)
            correct = bool(np.array_equal(got, want))
            seconds = timed(run, args.iters)
            rows.append({"piece_bytes": piece, "layout": layout, "bytes_read": read, "latency_us": round(seconds * 1e6, 2),
                         "bandwidth_gbps": round(read / seconds / 1e9, 1),
                         "fraction_of_copy_bandwidth": round(read / seconds / bandwidth, 3), "checked": correct})
            print(rows[-1], flush=True)
        del cache
        torch.cuda.empty_cache()
    return per_split, splits, rows


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("the layout benchmark needs a CUDA GPU; nothing was measured")
    started = provenance()
    bandwidth = copy_bandwidth()
    import cupy

    for piece in args.pieces:  # a wave of blocks_per_sm a multiprocessor must fit at once
        held = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(_function(piece // CHUNK).kernel.ptr, THREADS, 0)
        if held < args.blocks_per_sm:
            print(f"--blocks-per-sm {args.blocks_per_sm}: a multiprocessor holds {held} blocks of read_pieces at {piece}-byte "
                  f"pieces; give {held} or fewer", file=sys.stderr)
            sys.exit(2)
    slots = torch.cuda.get_device_properties(0).multi_processor_count * args.blocks_per_sm
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s; {slots} resident blocks", flush=True)
    per_split, splits, rows = measure(args, slots, bandwidth)
    name = f"layout_read_{device_slug(started['device'])}"
    write_result(name, {"copy_bandwidth_gbps": round(bandwidth / 1e9, 1), "batch": BATCH, "heads": args.heads,
                        "tokens": args.tokens, "block_tokens": args.block_tokens, "blocks_per_sm": args.blocks_per_sm,
                        "tokens_per_split": per_split, "splits": splits, "iterations": args.iters, "results": rows}, started)
    by = {(r["piece_bytes"], r["layout"]): r for r in rows}
    lines = [f"# One side of a KV cache read by layout alone, {started['device']} (commit {started['commit']}, {started['date']})", "",
             f"`python -m benchmarks.kernels layout`: B={BATCH}, {args.heads} KV heads, {args.tokens} tokens a sequence, "
             f"{splits} splits of {per_split} tokens ({args.blocks_per_sm} blocks a multiprocessor); copy bandwidth "
             f"{bandwidth / 1e9:.0f} GB/s; L2 flushed. tokens: a token's pieces of every KV head together (kvcal's stores); "
             f"blocks: paged, {args.block_tokens} tokens a block, a KV head's run of them after another's; heads: a KV head's "
             "tokens together. Each: latency, and bytes read over it as a share of copy bandwidth.", "",
             "| piece bytes | MB | tokens | blocks | heads | tokens / heads time | blocks / heads time | checked |",
             "|---|---|---|---|---|---|---|---|"]
    for piece in args.pieces:
        t, b, h = (by[piece, layout] for layout in LAYOUTS)
        lines.append(f"| {piece} | {t['bytes_read'] / 1e6:.1f} | "
                     + " | ".join(f"{r['latency_us']} us, {r['fraction_of_copy_bandwidth']:.0%}" for r in (t, b, h))
                     + f" | {t['latency_us'] / h['latency_us']:.2f}x | {b['latency_us'] / h['latency_us']:.2f}x | "
                     f"{'yes' if t['checked'] and b['checked'] and h['checked'] else 'NO'} |")
    write_markdown(name, lines)
    if not all(r["checked"] for r in rows):
        sys.exit("a launch read other bytes than its pieces' (checked: NO above): its timing is not of this layout")


if __name__ == "__main__":
    main()
