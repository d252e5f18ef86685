"""How much the token-major cache layout costs the tensor-core decode kernel on a CUDA GPU.

The runtime's stores are token-major: a token's row holds every KV head, so a block (one KV head) reads 32-64 bytes
per token at a stride of the whole row, and its value scales and zeros likewise. With one KV head per store (B = 64,
1 KV head, 4 query heads) the same kernel reads the same bytes as contiguous rows, as a head-major layout would give
it. This times both shapes (the token-major one before and after the contiguous one) at L = 32768, launcher plans,
with bench_decode.py's method (median of CUDA-event timings, L2 flushed before each launch).

Usage (CUDA + CuPy): python benchmarks/bench_layout_tc.py [--only int2-g128,int4-g128] [--tokens 32768]
Prints one line per shape; writes nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from kvcal.quantizers import CodebookCodec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import HEADS, KV_HEADS, timed  # noqa: E402
from bench_decode_tc import HEAD_DIM, filled_stores, inv_freq, variants  # noqa: E402

SHAPES = ((8, 8), (64, 1), (8, 8))  # (sequences, KV heads): token-major, one head per row, token-major again
GQA = HEADS // KV_HEADS  # bench_decode.py's group: 4 query heads per KV head


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="int2-g128,int4-g128", help="comma-separated uniform-code variants of bench_decode_tc.py")
    parser.add_argument("--tokens", type=int, default=32768, help="cached tokens per sequence")
    parser.add_argument("--iters", type=int, default=20, help="timed launches per measurement (median reported)")
    args = parser.parse_args()
    table = variants()
    names = args.only.split(",")
    unknown = [n for n in names if n not in table or table[n][0] is None or isinstance(table[n][0][0], CodebookCodec)]
    if unknown:
        parser.error(f"--only {unknown[0]}: a uniform-code variant of bench_decode_tc.py (int2-g128, int4-g64-pre-rope, ...); "
                     "codebook keys' thresholds there are sized for 8 KV heads")
    if args.tokens <= 0:
        parser.error(f"--tokens {args.tokens}: a positive number of tokens")
    if not torch.cuda.is_available():
        sys.exit("bench_layout_tc.py needs a CUDA GPU; nothing was measured")
    from kvcal.runtime import tensor_core

    for name in names:
        codecs, rope = table[name]
        for batch, kv_heads in SHAPES:
            stores = filled_stores(codecs, batch, args.tokens, kv_heads * HEAD_DIM)
            query = torch.randn(batch, kv_heads * GQA, HEAD_DIM, device="cuda")
            run = tensor_core.prepare_decode_tc(query, stores[0], stores[1], kv_heads, HEAD_DIM**-0.5,
                                                inv_freq=inv_freq() if rope else None)
            seconds = timed(run, args.iters)
            read = sum(s.used_bytes(b) for s in stores for b in range(batch))
            print(f"{name} B {batch} kv_heads {kv_heads} splits {run.splits} {seconds * 1e6:.1f} us {read / seconds / 1e9:.0f} GB/s",
                  flush=True)
            del stores, run
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
