"""End-to-end generate() time per new token on SmolLM2-135M (CPU) with kvcal's quantized cache, for every recipe,
against transformers' DynamicCache and transformers' QuantizedCache (quanto and HQQ backends, where they import),
measured in one run as ratios to DynamicCache, with peak memory beside it.

Per (prompt length, batch): the prompts (wikitext-2 test, a different passage per sequence) but their last token
are prefilled once with the fp model (kvcal.runtime.fp_context) and that context is loaded into every cache
(kvcal: WiredCache.load, as its own prefill would store it; DynamicCache: a copy; QuantizedCache: its update() with
the whole context, which quantizes it as its own prefill would). Then model.generate() runs greedily from the whole
prompt: its first step feeds the last prompt token, and the new tokens after it are timed one by one (a
StoppingCriteria stamps every step), so the time per new token is a decode step of generate() with everything
around it (logits, sampling, the attention mask), never the prefill. Every cache runs --rounds times in turn,
DynamicCache first and last in each round, and a cache's time is the median of all its timed steps: a slow spell
of a shared machine shows in the spread of DynamicCache's runs, printed beside it, and moves the medians less than
it moved single runs' means.

Memory: peak resident set size of the process (VmHWM in /proc/self/status) while the cache is
made, loaded and decoded, minus the RSS just before it was made: before each cache the freed heap goes back to the
system (glibc malloc_trim) and the high-water mark is reset to the current RSS through /proc/self/clear_refs.
Memory glibc keeps for reuse during the run counts, as it does for the process (kvcal's cache gives the freed heap
back where the resident set grew: kvcal.runtime.heap; fixing glibc's mmap threshold low instead would slow
allocation-heavy decode steps, DynamicCache's, which grows its tensors every step, most). For the prefill through
each cache, as a user runs it, see the cpu-memory mode (benchmarks/kernels/cpu_memory.py). `cache MiB` is the
cache's own storage after decoding (kvcal: WiredCache.used_bytes; DynamicCache: its tensors; QuantizedCache: not
counted).

Threads: torch's default is one per core; on a machine shared with other work, --threads 1 avoids the stalls of
intra-op parallel regions waiting for a descheduled thread, which cost every step and more so the steps with many
small operations.

Bundles: --bundles DIR holds <recipe>.safetensors; a missing one is made there: the first with `kvcal calibrate`
(kvcal.calibration.calibrate, which writes profile.safetensors beside it), the others fitted from that profile (or
from --profile) and exported with kvcal.calibration.build_bundle.

Usage: python -m benchmarks.kernels cpu [--lengths 512,2048,8000] [--batches 1,8] [--recipes all]
       [--baselines quanto,hqq] [--new-tokens 32] [--rounds 3] [--bundles DIR] [--profile PATH]   (see --help)
Quick: python -m benchmarks.kernels cpu --lengths 512,2048 --new-tokens 16 --recipes kvquant,kivi
Writes benchmarks/results/decode_step_cpu.{json,md} (--out).
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.util
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks.common import SHARED, ensure_bundles, provenance, write_markdown, write_result

BASELINES = ("quanto", "hqq")  # transformers' QuantizedCache backends
BACKEND_PACKAGES = {"quanto": ("optimum.quanto", "optimum-quanto"), "hqq": ("hqq", "hqq")}
MIB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="512,2048,8000", help="prompt lengths in tokens, comma-separated (default: %(default)s)")
    parser.add_argument("--batches", default="1,8", help="batch sizes, comma-separated (default: %(default)s)")
    add_cache_arguments(parser)
    parser.add_argument("--new-tokens", type=int, default=32, help="new tokens per generate(); the first (the last prompt token's "
                                                                   "step) is not timed (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of every cache per cell, in turn (DynamicCache first and "
                                                             "last in each round); a cache's time is the median of all its "
                                                             "timed steps, so a slow spell of a shared machine moves it little "
                                                             "(default: %(default)s)")
    parser.add_argument("--quantized-nbits", type=int, default=4, help="QuantizedCache code width (default: %(default)s, "
                                                                      "transformers' default)")
    parser.add_argument("--quantized-residual", type=int, default=128, help="QuantizedCache fp residual length "
                                                                           "(default: %(default)s, transformers' default)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads, which the CPU decode kernel uses too "
                                                                  "(default: torch's own choice)")
    parser.add_argument("--march", default="native", help="the instruction set the CPU kernels are built for (-march): native, "
                                                         "x86-64-v3 (AVX2), x86-64-v4 (AVX-512), ... (default: %(default)s)")
    parser.add_argument("--out", default="decode_step_cpu", help="result name under benchmarks/results (default: %(default)s)")
    args = parser.parse_args(argv)
    args.lengths = [int(n) for n in args.lengths.split(",")]
    args.batches = [int(b) for b in args.batches.split(",")]
    parse_caches(parser, args)
    if args.new_tokens < 3:
        parser.error("--new-tokens must be at least 3 (the first step is not timed)")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return args


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """The caches a CPU mode measures (--recipes, --baselines), where their bundles come from and the prompts' text."""
    from kvcal import registry

    parser.add_argument("--recipes", default="all", help=f"kvcal recipes, comma-separated, or 'all' ({', '.join(registry.recipes())}) "
                                                         "or 'none' (default: %(default)s)")
    parser.add_argument("--baselines", default=",".join(BASELINES), help="transformers QuantizedCache backends to include besides "
                                                                        "DynamicCache: quanto, hqq, or 'none' (default: %(default)s)")
    parser.add_argument("--bundles", type=Path, default=Path("/tmp/kvcal-bench-bundles"),
                        help="folder of <recipe>.safetensors bundles; missing ones are made there (default: %(default)s)")
    parser.add_argument("--profile", type=Path, default=None, help="an existing kvcal profile to fit missing bundles from, "
                                                                  "instead of calibrating one")
    parser.add_argument("--text", type=Path, default=SHARED / "data" / "wikitext-2" / "test.txt",
                        help="prompt text (default: wikitext-2 test; the builtin corpus if missing)")


def parse_caches(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """args.recipes and args.baselines as lists; an unknown name refused in one line (exit 2)."""
    from kvcal import registry
    from kvcal.errors import KvcalError

    args.recipes = (registry.recipes() if args.recipes == "all" else [] if args.recipes == "none"
                    else [r.strip() for r in args.recipes.split(",")])
    for recipe in args.recipes:
        try:
            registry.recipe(recipe)
        except KvcalError as refusal:  # an unknown name, with the list
            parser.error(str(refusal))
    args.baselines = [] if args.baselines == "none" else [b.strip() for b in args.baselines.split(",")]
    unknown = set(args.baselines) - set(BASELINES)
    if unknown:
        parser.error(f"unknown baseline(s) {', '.join(sorted(unknown))}; choose from {', '.join(BASELINES)}")


# ---------------------------------------------------------------------------------------------------------
# measuring


def status_kib(field: str) -> int:
    """A memory figure of this process from /proc/self/status (VmRSS, VmHWM), in KiB; 0 where there is none."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    return 0


def reset_peak() -> None:
    from kvcal.runtime import heap

    gc.collect()
    if heap.MALLOC_TRIM is not None:
        heap.MALLOC_TRIM(0)
    try:
        Path("/proc/self/clear_refs").write_text("5")  # the high-water mark back to the current RSS
    except OSError:
        pass


class Stamps:
    """A StoppingCriteria that never stops and records when each generated token is done."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def cache_bytes(cache) -> int | None:
    from transformers import DynamicCache

    from kvcal.runtime import WiredCache

    if isinstance(cache, WiredCache):
        return cache.used_bytes()
    if isinstance(cache, DynamicCache):
        return sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values) if isinstance(t, torch.Tensor))
    return None


def run_cache(model, tokenizer, prompt: torch.Tensor, new_tokens: int, make_cache) -> dict:
    """generate() with a cache from make_cache(): time per new token (the first new token's step excluded), peak
    RSS above the RSS before the cache, the cache's bytes and the new tokens."""
    from transformers import StoppingCriteriaList

    from kvcal.model_caches import cache_argument

    reset_peak()
    before = status_kib("VmRSS")
    began = time.perf_counter()
    with torch.inference_mode(), make_cache() as cache:
        loaded = time.perf_counter() - began
        stamps = Stamps()
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), **cache_argument(cache),
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id, stopping_criteria=StoppingCriteriaList([stamps]))
        stored = cache_bytes(cache)
    peak = status_kib("VmHWM")
    steps = [1000 * (b - a) for a, b in zip(stamps.times, stamps.times[1:])]
    return {"steps_ms": steps, "load_s": loaded, "peak_rss_mib": (peak - before) / 1024,
            "cache_mib": None if stored is None else stored / MIB, "tokens": out[:, prompt.shape[1]:]}


def summarize(name: str, runs: list[dict]) -> dict:
    """One cache's runs in a cell as one row: ms/token the median of every timed step of every run."""
    steps = sorted(step for run in runs for step in run["steps_ms"])
    row = {"cache": name, "ms_per_token": statistics.median(steps), "ms_per_token_mean": statistics.fmean(steps),
           "ms_steps_min": steps[0], "timed_steps": len(steps), "load_s": statistics.median(r["load_s"] for r in runs),
           "peak_rss_mib": max(r["peak_rss_mib"] for r in runs), "cache_mib": runs[0]["cache_mib"],
           "tokens_equal_dynamic": runs[0]["tokens_equal_dynamic"]}
    if name == "DynamicCache":
        row["dynamic_runs_ms"] = [statistics.median(r["steps_ms"]) for r in runs]
    return row


class Holding:
    """A context manager that just hands out a cache (for caches that need no closing)."""

    def __init__(self, cache):
        self.cache = cache

    def __enter__(self):
        return self.cache

    def __exit__(self, *exc):
        self.cache = None


def makers(model, context, bundles: dict[str, Path], baselines: list[str], nbits: int, residual: int) -> list[tuple[str, object]]:
    """(name, make_cache) in the order measured within a cell: DynamicCache first and last."""
    from transformers import QuantizedCache

    from kvcal.bundle import load_bundle
    from kvcal.runtime import quantized_cache

    def dynamic():
        return Holding(copy.deepcopy(context.cache))

    def transformers_quantized(backend):
        def make():
            cache = QuantizedCache(backend=backend, config=model.config, nbits=nbits, residual_length=residual)
            for index, layer in enumerate(context.cache.layers):
                cache.update(layer.keys, layer.values, index)
            return Holding(cache)
        return make

    def kvcal_cache(bundle):
        def make():
            cache = quantized_cache(model, bundle)
            cache.load(context)
            return cache
        return make

    loaded = {recipe: load_bundle(path) for recipe, path in bundles.items()}
    return ([("DynamicCache", dynamic)] + [(f"QuantizedCache {b} int{nbits}", transformers_quantized(b)) for b in baselines]
            + [(f"kvcal {recipe}", kvcal_cache(bundle)) for recipe, bundle in loaded.items()] + [("DynamicCache", dynamic)])


def available_baselines(wanted: list[str]) -> tuple[list[str], dict[str, str]]:
    ok, missing = [], {}
    for backend in wanted:
        module, package = BACKEND_PACKAGES[backend]
        if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
            missing[backend] = f"not installed (pip install {package})"
        else:
            ok.append(backend)
    return ok, missing


def prompts(tokenizer, text_path: Path, length: int, batch: int) -> torch.Tensor:
    """batch prompts of `length` tokens: passages of the text spread over it (repeated if it is too short)."""
    from kvcal.data import builtin_text

    text = text_path.read_text() if text_path.is_file() else builtin_text()
    ids = tokenizer(text[: 8 * length * batch], return_tensors="pt").input_ids[0]
    if len(ids) < length * batch:
        ids = ids.repeat(length * batch // len(ids) + 1)
    stride = (len(ids) - length) // max(batch - 1, 1)
    return torch.stack([ids[b * stride : b * stride + length] for b in range(batch)])


# ---------------------------------------------------------------------------------------------------------


def prepare(args: argparse.Namespace) -> tuple[dict, list[str], dict[str, str], dict[str, Path]]:
    """A CPU mode's start: the run's provenance with the CPU and the kernel build (printed), the baselines that import
    (the others printed as left out, with why) and the recipes' bundles (made where missing)."""
    from kvcal.runtime import cpu_kernel

    started = {**provenance(), "cpu": cpu_name(), "kernel": cpu_kernel.describe()}
    print(f"{started['cpu']}; {started['kernel']}", flush=True)
    baselines, missing = available_baselines(args.baselines)
    for backend, why in missing.items():
        print(f"QuantizedCache {backend}: {why}; left out", flush=True)
    return started, baselines, missing, ensure_bundles(args.bundles, args.recipes, args.profile)


def cpu_name() -> str:
    """The CPU model and its vector extensions (from /proc/cpuinfo where there is one)."""
    import platform

    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), platform.machine())
    flags = set(next((line.split(":", 1)[1].split() for line in lines if line.startswith(("flags", "Features"))), []))
    vectors = [name for name in ("avx2", "fma", "avx512f", "avx512_bf16", "asimd", "sve") if name in flags]
    return f"{model} ({', '.join(vectors) or 'no AVX2'})"


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from kvcal.runtime import cpu_kernel

    os.environ[cpu_kernel.TARGET_VARIABLE] = args.march  # before anything builds the CPU kernels (at first use)

    started, baselines, missing, bundles = prepare(args)
    from kvcal.models import load_model
    from kvcal.runtime.fp_context import fp_context

    model, tokenizer, source = load_model(None)
    rows, began = [], time.perf_counter()
    for length in args.lengths:
        for batch in args.batches:
            prompt = prompts(tokenizer, args.text, length, batch)
            t0 = time.perf_counter()
            with torch.inference_mode():
                context = fp_context(model, prompt[:, :-1])
            prefill = time.perf_counter() - t0
            print(f"\n{length} tokens x {batch}: fp prefill {prefill:.1f} s", flush=True)
            runs: dict[str, list[dict]] = {}  # per cache, in the order measured (DynamicCache: first and last of each round)
            reference_tokens = None
            in_turn = makers(model, context, bundles, baselines, args.quantized_nbits, args.quantized_residual)
            for round_ in range(args.rounds):
                for name, make in in_turn:
                    result = run_cache(model, tokenizer, prompt, args.new_tokens, make)
                    tokens = result.pop("tokens")
                    if reference_tokens is None:
                        reference_tokens = tokens
                    result["tokens_equal_dynamic"] = float((tokens == reference_tokens).float().mean())
                    runs.setdefault(name, []).append(result)
                    print(f"  round {round_ + 1}/{args.rounds} {name:32s} {statistics.median(result['steps_ms']):9.1f} ms/token "
                          f"(median)  peak +{result['peak_rss_mib']:8.1f} MiB  load {result['load_s']:.1f} s", flush=True)
            cell = [{"length": length, "batch": batch, **summarize(name, measured)} for name, measured in runs.items()]
            for row in cell:
                row["ratio_to_dynamic"] = row["ms_per_token"] / cell[0]["ms_per_token"]
            rows += cell
            del context
            gc.collect()
    settings = {"lengths": args.lengths, "batches": args.batches, "recipes": args.recipes, "baselines": baselines, "march": args.march,
                "baselines_left_out": missing, "new_tokens": args.new_tokens, "timed_tokens_per_run": args.new_tokens - 1,
                "rounds": args.rounds,
                "quantized_cache": {"nbits": args.quantized_nbits, "residual_length": args.quantized_residual, "q_group_size": 64},
                "threads": torch.get_num_threads(), "model": source.spec, "dtype": str(model.dtype),
                "memory": "peak RSS (VmHWM) during cache load + decode above the RSS before it; "
                          "freed heap trimmed (malloc_trim) and high-water mark reset via /proc/self/clear_refs before each cache",
                "seconds": round(time.perf_counter() - began, 1)}
    write_result(args.out, {"settings": settings, "results": rows}, started)
    write_markdown(args.out, table(rows, args, baselines, missing, started))


def table(rows: list[dict], args, baselines: list[str], missing: dict[str, str], started: dict) -> list[str]:
    lines = [f"# generate() time per new token on CPU (SmolLM2-135M fp32, {torch.get_num_threads()} threads)", "",
             f"{started['cpu']}; {started['kernel']}. Commit {started['commit']}, {started['date']}.", "",
             f"{args.new_tokens - 1} decode steps timed per run after a shared fp prefill (see benchmarks/kernels/cpu_step.py), "
             f"{args.rounds} rounds of every cache in turn (DynamicCache first and last in each); ms/token: the median of "
             "every timed step of a cache's runs (DynamicCache: the median of each run in brackets); x Dyn: over "
             "DynamicCache's; peak MiB: peak RSS during cache load + decode above the RSS before it (VmHWM, "
             "high-water mark reset per cache); cache MiB: the cache's own storage; same tokens: greedy tokens "
             "of the first run equal to DynamicCache's.", ""]
    if missing:
        lines += [f"Left out: QuantizedCache {b}: {why}." for b, why in missing.items()] + [""]
    for length in args.lengths:
        for batch in args.batches:
            cell = [r for r in rows if r["length"] == length and r["batch"] == batch]
            if not cell:
                continue
            lines += [f"## {length} tokens, batch {batch}", "", "| cache | ms/token | x Dyn | peak MiB | cache MiB | same tokens |",
                      "|---|---|---|---|---|---|"]
            for r in cell:
                note = f" ({' / '.join(f'{t:.0f}' for t in r['dynamic_runs_ms'])})" if "dynamic_runs_ms" in r else ""
                stored = "-" if r["cache_mib"] is None else f"{r['cache_mib']:.1f}"
                lines.append(f"| {r['cache']} | {r['ms_per_token']:.0f}{note} | {r['ratio_to_dynamic']:.2f} | "
                             f"{r['peak_rss_mib']:.0f} | {stored} | {r['tokens_equal_dynamic']:.0%} |")
            lines.append("")
    return lines


if __name__ == "__main__":
    main()
