"""Memory of generate() on CPU as a user runs it: the prompt prefilled through each cache (kvcal's quantized cache
per recipe, transformers' DynamicCache, and its QuantizedCache where its backend imports), then greedy decoding;
each cache in a fresh process, so that no cache inherits the heap another left.

Per cache: peak MiB, the peak resident set size (VmHWM) from just before the cache is made to the end of generate();
held MiB, the resident set size at the end of generate() with the cache still open (what a server holding it keeps);
both above the RSS before the cache, in a process whose freed heap was trimmed and whose high-water mark was reset
(/proc/self/clear_refs) then. Memory glibc keeps for reuse counts, as it does for the process: kvcal's cache gives
the freed heap back where the resident set grew (kvcal.runtime.heap), transformers' caches do not. cache MiB: the
cache's own storage after decoding (kvcal: WiredCache.used_bytes; DynamicCache: its tensors; QuantizedCache: not
counted).
Beside them, the prefill's seconds and the decode steps' median ms/token (the first new token's step not timed),
and that over DynamicCache's (its runs first and last, their median).

Usage: python -m benchmarks.kernels cpu-memory [--length 4096] [--batch 4] [--recipes all] [--new-tokens 16]
       [--baselines quanto,hqq] [--bundles DIR] [--threads N]   (see --help)
Writes benchmarks/results/memory_cpu.{json,md} (--out).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import statistics
import time
from pathlib import Path

from benchmarks.common import write_markdown, write_result
from benchmarks.kernels.cpu_step import (MIB, Holding, Stamps, add_cache_arguments, cache_bytes, parse_caches, prepare, prompts,
                                         reset_peak, status_kib)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=4096, help="prompt length in tokens (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=4, help="sequences in the batch (default: %(default)s)")
    add_cache_arguments(parser)
    parser.add_argument("--new-tokens", type=int, default=16, help="new tokens per generate(); the first is not timed "
                                                                   "(default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    parser.add_argument("--out", default="memory_cpu", help="result name under benchmarks/results (default: %(default)s)")
    args = parser.parse_args(argv)
    parse_caches(parser, args)
    if args.length < 2 or args.batch < 1:
        parser.error("--length must be at least 2 and --batch at least 1")
    if args.new_tokens < 3:
        parser.error("--new-tokens must be at least 3 (the first step is not timed)")
    return args


def run_cache(cache: str, bundle, args: dict) -> dict:
    """generate() from the prompt with one cache, named `cache`: a kvcal cache of `bundle` (a path or a Bundle), else
    'DynamicCache' or 'QuantizedCache <backend>'; measured as the module says (in a fresh process: in_fresh_process)."""
    import torch
    from transformers import DynamicCache, QuantizedCache, StoppingCriteriaList

    from kvcal.model_caches import cache_argument
    from kvcal.models import load_model
    from kvcal.runtime import quantized_cache

    if args["threads"]:
        torch.set_num_threads(args["threads"])
    model, tokenizer, _ = load_model(None)
    prompt = prompts(tokenizer, Path(args["text"]), args["length"], args["batch"])
    reset_peak()
    before = status_kib("VmRSS")
    began = time.perf_counter()
    with torch.inference_mode():
        if bundle is not None:
            opened = quantized_cache(model, bundle)
        elif cache == "DynamicCache":
            opened = Holding(DynamicCache())
        else:
            opened = Holding(QuantizedCache(backend=cache.split()[-1], config=model.config))
        with opened as made:
            stamps = Stamps()
            out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), **cache_argument(made),
                                 max_new_tokens=args["new_tokens"], min_new_tokens=args["new_tokens"], do_sample=False,
                                 pad_token_id=tokenizer.eos_token_id, stopping_criteria=StoppingCriteriaList([stamps]))
            held, stored = status_kib("VmRSS"), cache_bytes(made)
    peak = status_kib("VmHWM")
    steps = [1000 * (b - a) for a, b in zip(stamps.times, stamps.times[1:])]
    return {"cache": cache, "prefill_s": stamps.times[0] - began, "ms_per_token": statistics.median(steps),
            "peak_rss_mib": (peak - before) / 1024, "held_rss_mib": (held - before) / 1024,
            "cache_mib": None if stored is None else stored / MIB, "tokens": out[:, prompt.shape[1]:].tolist(),
            "threads": torch.get_num_threads()}


def in_fresh_process(cache: str, bundle, settings: dict) -> dict:
    """run_cache in a process of its own (spawned: a fork would inherit this process's heap)."""
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
        return pool.submit(run_cache, cache, bundle, settings).result()


def main(argv=None) -> None:
    args = parse_args(argv)
    started, baselines, missing, bundles = prepare(args)
    settings = {"length": args.length, "batch": args.batch, "new_tokens": args.new_tokens, "threads": args.threads,
                "text": str(args.text)}
    order = ([("DynamicCache", None)] + [(f"QuantizedCache {b}", None) for b in baselines]
             + [(f"kvcal {recipe}", path) for recipe, path in bundles.items()] + [("DynamicCache", None)])
    runs, began = [], time.perf_counter()
    for i, (cache, bundle) in enumerate(order, 1):
        run = in_fresh_process(cache, bundle, settings)
        runs.append(run)
        print(f"  {i}/{len(order)} {cache:28s} prefill {run['prefill_s']:6.1f} s  {run['ms_per_token']:7.1f} ms/token  "
              f"peak +{run['peak_rss_mib']:7.0f} MiB  held +{run['held_rss_mib']:7.0f} MiB", flush=True)
    rows = summarize(runs)
    settings.update(recipes=args.recipes, baselines=baselines, baselines_left_out=missing, threads=runs[0]["threads"],
                    seconds=round(time.perf_counter() - began, 1),
                    memory="VmHWM and VmRSS above the RSS before the cache, each cache in a fresh (spawned) process")
    write_result(args.out, {"settings": settings, "results": rows}, started)
    write_markdown(args.out, table(rows, settings, missing, started))


def summarize(runs: list[dict]) -> list[dict]:
    """One row per cache (DynamicCache's two runs as one: the median of their decode times, the larger memory and
    prefill time), with its decode time over DynamicCache's and whether its greedy tokens are DynamicCache's first
    run's."""
    reference = runs[0]["tokens"]
    rows: dict[str, dict] = {}
    for run in runs:
        row = {key: value for key, value in run.items() if key not in ("tokens", "threads")}
        row["tokens_equal_dynamic"] = statistics.fmean(a == b for ours, theirs in zip(run["tokens"], reference)
                                                       for a, b in zip(ours, theirs))
        if run["cache"] in rows:  # DynamicCache's second run
            first = rows[run["cache"]]
            row["runs_ms"] = [first["ms_per_token"], row["ms_per_token"]]
            row["ms_per_token"] = statistics.median(row["runs_ms"])
            for key in ("peak_rss_mib", "held_rss_mib", "prefill_s"):
                row[key] = max(first[key], row[key])
        rows[run["cache"]] = row
    dynamic = rows["DynamicCache"]["ms_per_token"]
    for row in rows.values():
        row["ratio_to_dynamic"] = row["ms_per_token"] / dynamic
    return list(rows.values())


def table(rows: list[dict], settings: dict, missing: dict[str, str], started: dict) -> list[str]:
    lines = [f"# Memory of generate() on CPU: {settings['batch']} x {settings['length']} tokens (SmolLM2-135M fp32, "
             f"{settings['threads']} threads)", "",
             f"{started['cpu']}; {started['kernel']}. Commit {started['commit']}, {started['date']}.", "",
             "Each cache in a fresh process: the prompt prefilled through it, then "
             f"{settings['new_tokens']} greedy new tokens (see benchmarks/kernels/cpu_memory.py). peak MiB: peak RSS "
             "(VmHWM) from the cache's making to the end of generate(); held MiB: RSS at the end with the cache still "
             "open; both above the RSS before the cache. cache MiB: the cache's own storage; prefill s; ms/token: the "
             "decode steps' median (DynamicCache: its two runs, first and last, in brackets); x Dyn: over "
             "DynamicCache's; same tokens: greedy tokens equal to DynamicCache's first run.", ""]
    if missing:
        lines += [f"Left out: QuantizedCache {b}: {why}." for b, why in missing.items()] + [""]
    lines += ["| cache | peak MiB | held MiB | cache MiB | prefill s | ms/token | x Dyn | same tokens |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        note = f" ({' / '.join(f'{t:.0f}' for t in r['runs_ms'])})" if "runs_ms" in r else ""
        stored = "-" if r["cache_mib"] is None else f"{r['cache_mib']:.1f}"
        lines.append(f"| {r['cache']} | {r['peak_rss_mib']:.0f} | {r['held_rss_mib']:.0f} | {stored} | {r['prefill_s']:.1f} | "
                     f"{r['ms_per_token']:.0f}{note} | {r['ratio_to_dynamic']:.2f} | {r['tokens_equal_dynamic']:.0%} |")
    return lines


if __name__ == "__main__":
    main()
