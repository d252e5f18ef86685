"""Quantize-and-append on CPU: the compiled appends (kernels/append_cpu.cpp, kvcal.runtime.cpu_kernel.CpuAppend)
against the torch codec they replace, per recipe and side, with the bundles' own codecs. An append is what a decode
step writes into a packed body: one token per sequence of the batch (per-token codecs), or one whole block per
sequence (per-channel key blocks, KIVI's and KVmix's keys, which leave the fp16 residual a block at a time). The rows
are seeded normal fp16 at the bundle's width (KV heads x head_dim). Both encoders write into stores of the same
shape, in rounds that alternate them; a cell is the median of its rounds. --tokens N appends N rows per sequence
instead (whole blocks for per-channel key blocks), each time into an empty store: a prompt's prefill, which on CPU
pays for every row's encoding before the first new token.

    python -m benchmarks.kernels cpu-append --bundles /tmp/kvcal-bench-bundles
    python -m benchmarks.kernels cpu-append --tokens 2048 --batch 1 --appends 2 --name cpu_append_prefill
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import ensure_bundles, provenance, write_markdown, write_result
from benchmarks.kernels.cpu_step import cpu_name


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels cpu-append", description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundles", type=Path, default=Path("/tmp/kvcal-bench-bundles"),
                        help="folder of <recipe>.safetensors bundles; missing ones are made there for SmolLM2 (default: %(default)s)")
    parser.add_argument("--recipes", default="kvquant,mixed,skvq,kivi,kvmix", help="recipes, comma-separated (default: %(default)s)")
    parser.add_argument("--profile", type=Path, help="an existing kvcal profile to fit missing bundles from")
    parser.add_argument("--batch", type=int, default=8, help="sequences appended to at once (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=None,
                        help="rows appended per sequence at once, each time into an empty store, as a prompt's (in whole "
                             "key blocks, at least one; default: one token, or one block for per-channel key blocks, onto a "
                             "store holding rows: a decode step's)")
    parser.add_argument("--appends", type=int, default=20, help="appends timed per round and encoder (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of both encoders in turn (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the appended rows (default: %(default)s)")
    parser.add_argument("--name", default="cpu_append", help="result file name in benchmarks/results (default: %(default)s)")
    args = parser.parse_args(argv)
    for name in ("batch", "appends", "rounds", "tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, not {getattr(args, name)}")
    return args


def rows_per_append(codec, tokens: int | None) -> int:
    """The rows an append writes per sequence: `tokens` in whole blocks of the codec (at least one), else one block
    (one token for per-token codecs)."""
    block = codec.block_tokens
    return block if tokens is None else max(block, tokens // block * block)


def time_appends(codec, width: int, head_dim: int, batch: int, appends: int, rounds: int, seed: int,
                 tokens: int | None = None) -> dict:
    """Microseconds per append of the torch codec and of the compiled append (median of rounds), and the rows an
    append writes per sequence (rows_per_append). A decode step's rows go onto a store that holds some already (its
    buffers made before the clock starts); a prompt's (`tokens`) each into an empty store, as a prefill's do."""
    from kvcal.runtime import cpu_kernel
    from kvcal.runtime.store import PackedRows

    rows = rows_per_append(codec, tokens)
    x = torch.randn(appends * batch * rows, width, generator=torch.Generator().manual_seed(seed)).half()
    seqs, counts = list(range(batch)), [rows] * batch
    times: dict[str, list[float]] = {"torch codec": [], "cpu-append": []}
    for _ in range(rounds):
        for name, encoder_for in (("torch codec", None), ("cpu-append", cpu_kernel.append_encoder)):
            stores = [PackedRows(codec, batch, width, "cpu", encoder_for, head_dim=head_dim)  # the cache's layout
                      for _ in range(1 if tokens is None else appends)]
            if tokens is None:
                stores[0].append_rows(seqs, counts, x[: batch * rows])
                stores *= appends
            began = time.perf_counter()
            for i, store in enumerate(stores):
                store.append_rows(seqs, counts, x[i * batch * rows : (i + 1) * batch * rows])
            times[name].append((time.perf_counter() - began) / appends * 1e6)
    return {"rows": rows, **{name: statistics.median(values) for name, values in times.items()}}


def main(argv=None) -> None:
    args = parse_args(argv)
    from kvcal.bundle import load_bundle
    from kvcal.runtime import backends, cpu_kernel

    started = {**provenance(), "cpu": cpu_name(), "threads": torch.get_num_threads()}
    if cpu_kernel.append_library() is None:
        raise SystemExit("the CPU appends did not build here (see the warning): nothing to compare")
    bundles = ensure_bundles(args.bundles, args.recipes.split(","), args.profile)
    rows = []
    for recipe, path in bundles.items():
        bundle = load_bundle(path)
        fingerprint = bundle.fingerprint
        head_dim, width = fingerprint["head_dim"], fingerprint["num_kv_heads"] * fingerprint["head_dim"]
        codecs = bundle.layer_codecs(0)
        for side, codec in (("K", codecs.key_codec), ("V", codecs.value_codec)):
            if backends.append_path(codec, width, "cpu") != "cpu-append":
                continue  # the torch codec serves it either way
            timing = time_appends(codec, width, head_dim, args.batch, args.appends, args.rounds, args.seed, args.tokens)
            row = {"recipe": recipe, "side": side, "codec": backends.codec_name(codec), **timing}
            rows.append(row)
            print(f"{recipe} {side} {row['codec']}: torch codec {row['torch codec']:.0f} us, cpu-append {row['cpu-append']:.0f} us",
                  flush=True)
    header = [f"# Quantize-and-append on CPU: compiled appends against the torch codec ({fingerprint['architecture']}, layer 0)", "",
              f"{started['cpu']}, {started['threads']} torch threads. Commit {started['commit']}, {started['date']}. From "
              f"`python -m benchmarks.kernels cpu-append` (see its docstring): batch {args.batch}, {args.appends} appends per "
              f"round, median of {args.rounds} rounds alternating the encoders; us per append of "
              + ("one token per sequence (a block of tokens per sequence for per-channel key blocks)." if args.tokens is None
                 else f"{args.tokens} tokens per sequence (whole blocks for per-channel key blocks)."), "",
              "| recipe | side | codec | rows per sequence | torch codec us | cpu-append us | speedup |", "|---|---|---|---|---|---|---|"]
    lines = [f"| {r['recipe']} | {r['side']} | {r['codec']} | {r['rows']} | {r['torch codec']:.0f} | {r['cpu-append']:.0f} | "
             f"{r['torch codec'] / r['cpu-append']:.1f}x |" for r in rows]
    write_result(args.name, {"batch": args.batch, "tokens": args.tokens, "appends": args.appends, "rounds": args.rounds,
                             "seed": args.seed, "rows": rows}, started)
    write_markdown(args.name, header + lines)


if __name__ == "__main__":
    main()
