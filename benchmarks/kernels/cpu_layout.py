"""The CPU decode kernel on the same cached tokens in the two layouts a store can keep (kvcal.runtime.store.PackedRows):
each token's row whole (a KV head's piece of it a few dozen bytes beside the other heads'), or each KV head's rows
together (a CPU store's layout). Both are read by the runtime's own kernel (kvcal.runtime.cpu_kernel.decode_attention)
over the same codes, in turn, --rounds calls each after one untimed call; a cell's time is the median of its calls,
and the two outputs must be equal bit for bit (the same arithmetic, other addresses).

Shape: B sequences (--batch), 8 KV heads, 32 query heads, head_dim 128, L tokens (--lengths), random N(0, 1) keys and
values encoded by the torch codecs of the tensor-core benchmark's variants (benchmarks/kernels/tensor_core.py; pre-RoPE
keys rotated by Llama's frequencies from position 0).

Usage: python -m benchmarks.kernels cpu-layout [--variants int2-g128,int4-g128] [--lengths 4096,32768] [--batch 1]
       [--threads N] [--rounds 15]
Writes benchmarks/results/cpu_layout_<cpu>.{json,md}.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import device_slug, provenance, timed_in_turn, write_markdown, write_result
from benchmarks.kernels.tensor_core import inv_freq, packed_variant_refusal, variants

HEAD_DIM, KV_HEADS, GROUP = 128, 8, 4
DEFAULT_VARIANTS = "int2-g128,int4-g128,int2-g32,nuq3-pre-rope,nuq3-1%-pre-rope"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels cpu-layout", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma-separated tensor-core benchmark variants (packed ones)")
    parser.add_argument("--lengths", default="4096,32768", help="cached tokens per sequence, comma-separated")
    parser.add_argument("--batch", type=int, default=1, help="sequences")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="the kernel's threads (default: torch's)")
    parser.add_argument("--rounds", type=int, default=15, help="timed calls per layout and cell, taken in turn")
    parser.add_argument("--seed", type=int, default=0, help="seed of the cached tokens and the query")
    parser.add_argument("--name", default=None, help="results file name (default cpu_layout_<cpu>)")
    args = parser.parse_args(argv)
    refused = packed_variant_refusal(args.variants, HEAD_DIM)
    if refused:
        parser.error(refused)
    try:
        args.lengths = [int(n) for n in args.lengths.split(",")]
    except ValueError:
        parser.error(f"--lengths: {args.lengths!r} is not comma-separated token counts")
    if min(args.lengths) < 1 or args.batch < 1 or args.threads < 1 or args.rounds < 1:
        parser.error("--lengths, --batch, --threads and --rounds take positive numbers")
    return args


def stores(codecs, batch: int, length: int, seed: int) -> dict:
    """layout -> (K, V) stores of the same `length` random tokens per sequence."""
    from kvcal.runtime.store import STORE_LAYOUTS, PackedRows

    width = KV_HEADS * HEAD_DIM
    made = {name: tuple(PackedRows(codec, batch, width, "cpu", head_dim=HEAD_DIM, rows_together=together) for codec in codecs)
            for name, together in STORE_LAYOUTS.items()}
    generator = torch.Generator().manual_seed(seed)
    for b in range(batch):
        for side in range(2):
            x = torch.randn(length, width, generator=generator).half()
            for pair in made.values():
                pair[side].append(b, x)
    return made


def measure(name: str, batch: int, length: int, args) -> dict:
    """One cell: each layout's median seconds a call, and whether the two gave the same bits."""
    from kvcal.runtime import cpu_kernel, kernels, reference

    codecs, rope = variants(HEAD_DIM)[name]
    made = stores(codecs, batch, length, args.seed)
    query = torch.randn(batch, KV_HEADS * GROUP, HEAD_DIM, generator=torch.Generator().manual_seed(args.seed + 1))
    tables = (cpu_kernel.half_rope_tables(*reference.rope_tables(torch.arange(length)[None], inv_freq(HEAD_DIM), 1.0))
              if rope else None)
    calls = {layout: (lambda pair=pair: cpu_kernel.decode_attention(query, [kernels.Segments((None, pair[0], None), (None, pair[1], None))],
                                                                    KV_HEADS, HEAD_DIM**-0.5, rope=tables))
             for layout, pair in made.items()}
    outputs, ms = timed_in_turn(calls, args.rounds)
    ms = {layout: round(value, 3) for layout, value in ms.items()}
    return {"variant": name, "batch": batch, "tokens": length, "rows_ms": ms["rows"], "heads_ms": ms["heads"],
            "rows_over_heads": round(ms["rows"] / ms["heads"], 3), "same_bits": bool(torch.equal(outputs["rows"], outputs["heads"]))}


def main(argv=None) -> None:
    args = parse_args(argv)
    from kvcal.runtime import cpu_kernel

    torch.set_num_threads(args.threads)
    started = provenance()
    rows = []
    for name in args.variants.split(","):
        for length in args.lengths:
            rows.append(measure(name, args.batch, length, args))
            print(rows[-1], flush=True)
    name = args.name or "cpu_layout_" + device_slug(started["device"])
    settings = {"batch": args.batch, "kv_heads": KV_HEADS, "group": GROUP, "head_dim": HEAD_DIM, "threads": args.threads,
                "rounds": args.rounds, "seed": args.seed, "kernel": cpu_kernel.describe()}
    write_result(name, {"settings": settings, "results": rows}, started)
    lines = [f"# CPU decode kernel by store layout, {started['device']} (commit {started['commit']}, {started['date']})", "",
             f"`python -m benchmarks.kernels cpu-layout`: {settings['kernel']}; B={args.batch}, {KV_HEADS} KV heads, "
             f"{KV_HEADS * GROUP} query heads, head_dim {HEAD_DIM}; the median of {args.rounds} calls a layout, taken in turn. "
             "rows: each token's row whole (a KV head's piece beside the others'); heads: each KV head's rows together.", "",
             "| variant | tokens | rows ms | heads ms | rows / heads | same bits |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['tokens']} | {r['rows_ms']} | {r['heads_ms']} | {r['rows_over_heads']}x | "
              f"{'yes' if r['same_bits'] else 'NO'} |" for r in rows]
    write_markdown(name, lines)
    if not all(r["same_bits"] for r in rows):
        raise SystemExit("the two layouts gave different outputs: the kernel read other bytes in one of them")


if __name__ == "__main__":
    main()
