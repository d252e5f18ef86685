"""The host side of kvcal's decode step on the CUDA path, per layer, measured on the CPU: what the cache does in Python
and torch around its kernels (the appends' bookkeeping and launches; the decode's lengths, uploads and launch
arguments), with the kernel launches skipped.

Why: at batch 1 a GPU decode step waits on the host (benchmarks/results/generate_nvidia-h200.md: at 32K tokens and
batch 1 every kvcal cache was slower than StaticCache, at batch 8 faster), and what the cache adds per layer is host
work that a CPU shows as well as a GPU machine does. The model is a random Llama with Llama-3.1-8B's attention (32
query and 8 KV heads, head_dim 128; `benchmarks.end_to_end.gpu`'s llama-8b-attention shape: small hidden size and
vocabulary) on the CPU. The cache runs the decoder and appends it runs on a GPU (kvcal.runtime.backends.CudaDecoder:
tensor-core launch arguments, meta, splits; kvcal.runtime.kernels.encode_rows) on CPU tensors, with
kvcal.runtime.kernels.launch replaced by a function that counts the launch and returns: no kernel runs, so the
outputs are not checked (tests/test_kernel_emulation.py runs the same path with the kernels emulated). The bundles
are fitted for this model from a short profile of random token ids (`gpu.make_bundles`).

Per (batch, recipe), each cache decoding --new-tokens steps after a --length-token prompt (the fp prefill loaded into
it, as `gpu` does), --rounds runs in turn: the time of kvcal's attention call per layer and step (both appends and
the decode; the fastest tenth of the timed calls of every run, and their median: the work is the same at every
step, and a machine shared with other work only adds to it; `32 layers`: that times an 8B's 32 layers), the kernel
launches per layer and step, and the torch operations per layer of a step (torch.profiler's top-level CPU events
of the whole forward, divided by the layers; the median of 3 steps) beside DynamicCache's (its cache update and
SDPA; on a GPU each operation is a launch of its own). DynamicCache's time is not a row: its attention computes here.
Also the load of the prompt's context into each kvcal cache (B x --length tokens a layer: the bulk append a prefill
makes), per layer: its time, and its time outside torch operations (what stays on the host on a GPU, where the
operations' own work runs on the device), the median of the runs.

A/B (--baseline-tree DIR, another commit's tree, e.g. `git worktree add /tmp/base <commit>`): one run of each tree's
kvcal package in turn (this tree, then the baseline), --rounds times, each a subprocess of this script; a row gives
both sides' medians over the rounds of a run's fastest tenth, and the median of the rounds' ratios.

Usage: python -m benchmarks.end_to_end host [--batches 1,8] [--recipes all] [--length 1024] [--new-tokens 24]
       [--rounds 3] [--layers 8] [--baseline-tree DIR]      (see --help)
Writes benchmarks/results/host_step_<cpu>.{json,md}, with a baseline host_step_ab_<cpu>.{json,md} (--out).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from benchmarks.common import REPO, device_slug, provenance, write_markdown, write_result
from benchmarks.end_to_end import gpu

SHAPE = "llama-8b-attention"
WARM_STEPS = 2  # decode steps of each run not timed (the first binds the decoders)
SMS = 132  # the multiprocessors the split plans are made for: an H100 SXM's (two resident blocks each)


def parse_args(argv=None) -> argparse.Namespace:
    from kvcal import registry
    from kvcal.errors import KvcalError

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8", help="batch sizes, comma-separated (default: %(default)s)")
    parser.add_argument("--recipes", default="all", help=f"kvcal recipes, comma-separated, or 'all' ({', '.join(registry.recipes())}) "
                                                         "(default: %(default)s)")
    parser.add_argument("--length", type=int, default=1024, help="prompt tokens (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=24, help=f"decode steps per run; the first {WARM_STEPS} are not timed "
                                                                   "(default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of every cache per batch, in turn (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers of the model (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, prompt and profile (default: %(default)s)")
    parser.add_argument("--baseline-tree", type=Path, default=None, metavar="DIR",
                        help="another checkout to compare with (e.g. `git worktree add /tmp/base <commit>`): one run of "
                             "each tree in turn, --rounds times, and the ratio of their fastest tenths")
    parser.add_argument("--out", default=None, help="result name under benchmarks/results (default: host_step_<cpu>, "
                                                    "host_step_ab_<cpu> with a baseline)")
    args = parser.parse_args(argv)
    if args.baseline_tree is not None and not (args.baseline_tree / "kvcal" / "__init__.py").is_file():
        parser.error(f"--baseline-tree {args.baseline_tree}: no kvcal package there; give a checkout of this repository")
    try:
        args.batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        parser.error("--batches are whole numbers, comma-separated")
    args.recipes = registry.recipes() if args.recipes == "all" else [r.strip() for r in args.recipes.split(",")]
    for recipe in args.recipes:
        try:
            registry.recipe(recipe)
        except KvcalError as exc:  # an unknown name, with the list
            parser.error(f"--recipes: {exc}")
    if min(args.batches) < 1 or args.length < 2 or args.layers < 1 or args.rounds < 1 or args.threads < 1:
        parser.error("--batches, --layers, --rounds and --threads are at least 1 and --length at least 2")
    if args.new_tokens <= WARM_STEPS:
        parser.error(f"--new-tokens must be more than {WARM_STEPS} (the first {WARM_STEPS} steps are not timed)")
    return args


@contextmanager
def launches_skipped(counts: collections.Counter):
    """Within the block the runtime takes the CPU for a CUDA device with CuPy and its kernel launches return at once,
    each counted in `counts` by kernel name (its template arguments left out)."""
    from kvcal.runtime import kernels, tensor_core

    patches = [(kernels, "cuda_ready", lambda device: True), (kernels, "_function", lambda module, name: name),
               (kernels, "launch", lambda function, *args, **kwargs: counts.update([function.split("<")[0]])),
               (tensor_core, "_function", lambda name, shared=0: name),
               (tensor_core, "resident_blocks", lambda name, shared, device: 2 * SMS)]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    try:
        for module, name, replacement in patches:
            setattr(module, name, replacement)
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


@contextmanager
def attention_timed(spent: list[float]):
    """Within the block every call of kvcal's attention (appends and decode of one layer) appends its seconds to spent."""
    from kvcal.runtime import cache

    original = cache._runtime_attention

    def timed(*args, **kwargs):
        began = time.perf_counter()
        out = original(*args, **kwargs)
        spent.append(time.perf_counter() - began)
        return out

    cache._runtime_attention = timed  # (the cache registers it with transformers when it opens)
    try:
        yield
    finally:
        cache._runtime_attention = original


def timed_load(make) -> tuple:
    """(the cache make() returns, (its seconds, its seconds outside torch operations)): make() builds a kvcal cache and
    loads the prompt's context into it."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as trace:
        began = time.perf_counter()
        cache, _ = make()
        wall = time.perf_counter() - began
    inside = sum(event.cpu_time_total for event in trace.events() if event.cpu_parent is None) / 1e6  # us -> s
    return cache, (wall, max(wall - inside, 0.0))


def operations_per_layer(model, prompt: torch.Tensor, make, steps: int = 3) -> float:
    """Torch operations (top-level CPU events) of a decode step of the cache make() returns, per layer: the median of
    `steps` steps (one may be a step whose store grows its buffers)."""
    from kvcal.model_caches import cache_argument

    cache, _ = make()
    gpu.generate_steps(model, prompt, cache, WARM_STEPS)
    counts = []
    with torch.inference_mode():
        for _ in range(steps):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as trace:
                model(prompt[:, -1:], **cache_argument(cache), use_cache=True)
            counts.append(sum(event.cpu_parent is None for event in trace.events()))
    gpu.closed(cache)
    return statistics.median(counts) / model.config.num_hidden_layers


def measure(args) -> dict:
    from kvcal.runtime.fp_context import fp_context

    torch.set_num_threads(args.threads)
    model = gpu.random_model(SHAPE, "cpu", args.seed, args.layers)
    layers = model.config.num_hidden_layers
    ids = torch.randint(model.config.vocab_size, (1, args.length), generator=torch.Generator().manual_seed(args.seed))
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        fitting = argparse.Namespace(recipes=args.recipes, profile_windows=1, profile_seqlen=256, seed=args.seed,
                                     shape=SHAPE, device="cpu")  # gpu.make_bundles' settings: one profile window
        bundles, _ = gpu.make_bundles(model, fitting, Path(folder), gpu.Clock("cpu"))
        with torch.inference_mode():
            context = fp_context(model, ids[:, :-1])
        for batch in args.batches:
            prompt = ids.expand(batch, args.length)
            chosen = gpu.makers(model, context, batch, args.length, args.new_tokens + WARM_STEPS + 4, bundles, ["dynamic"])
            kvcal_caches = [(name, make) for name, make in chosen if name.startswith("kvcal")]
            spent = {name: [] for name, _ in kvcal_caches}
            launches = {name: collections.Counter() for name, _ in kvcal_caches}
            loads = {name: [] for name, _ in kvcal_caches}
            for _ in range(args.rounds):
                for name, make in kvcal_caches:
                    calls, launched = [], collections.Counter()
                    with launches_skipped(launched), attention_timed(calls):
                        cache, loaded = timed_load(make)
                        loads[name].append(loaded)
                        launched.clear()  # (the prefill's appends)
                        gpu.generate_steps(model, prompt, cache, args.new_tokens)
                        gpu.closed(cache)
                    spent[name] += calls[WARM_STEPS * layers:]
                    launches[name] += launched
            for name, make in chosen[:2] + kvcal_caches:  # StaticCache, DynamicCache (makers' order), kvcal's
                with launches_skipped(collections.Counter()):
                    operations = operations_per_layer(model, prompt, make)
                row = {"cache": name, "batch": batch, "torch_ops_per_layer": round(operations, 2)}
                if name in spent:
                    per_layer_us = round(1e6 * sorted(spent[name])[len(spent[name]) // 10], 1)  # the fastest tenth
                    # the 32-layer column from the per-layer one as printed, so that the row's two agree
                    row.update(host_us_per_layer=per_layer_us, host_ms_32_layers=round(32 * per_layer_us / 1000, 2),
                               host_us_median=round(1e6 * statistics.median(spent[name]), 1),
                               launches_per_layer=round(sum(launches[name].values()) / (args.rounds * args.new_tokens * layers), 2),
                               launched=sorted(launches[name]),
                               load_ms_per_layer=round(1e3 * statistics.median(w for w, _ in loads[name]) / layers, 2),
                               load_host_ms_per_layer=round(1e3 * statistics.median(h for _, h in loads[name]) / layers, 2))
                rows.append(row)
                print(f"B={batch:<2d} {name:24s} " + "  ".join(f"{k} {v}" for k, v in row.items() if k not in ("cache", "batch")),
                      flush=True)
    settings = {"shape": SHAPE, "layers": layers, "length": args.length, "new_tokens": args.new_tokens,
                "timed_steps": args.new_tokens - WARM_STEPS, "rounds": args.rounds, "threads": args.threads, "seed": args.seed,
                "recipes": args.recipes, "batches": args.batches}
    return {"settings": settings, "results": rows}


def table(result: dict, started: dict) -> list[str]:
    settings = result["settings"]
    lines = [f"# Host side of a CUDA decode step, per layer, on {started['device']}", "",
             f"Commit {started['commit']}, {started['date']}. `python -m benchmarks.end_to_end host`: a random Llama with "
             f"Llama-3.1-8B's attention ({settings['layers']} layers) on the CPU, each cache decoding "
             f"{settings['new_tokens']} steps after a {settings['length']}-token prompt, {settings['rounds']} runs in turn, "
             f"{settings['threads']} thread(s); kvcal's CUDA decoder and appends with the kernel launches skipped (no kernel "
             "runs). host us: kvcal's attention call per layer and step (both appends and the decode), the fastest tenth "
             f"of the {settings['timed_steps']} timed steps of every run, and their median; 32 layers: the fastest tenth times "
             "32 (an 8B model's step); torch ops: "
             "top-level operations of a decode step per layer (median of 3 steps), the model's own included (StaticCache and DynamicCache "
             "for comparison: their cache update and SDPA); load ms: the prompt's context loaded, per layer (B x "
             f"{settings['length']} tokens), and of that outside torch operations (the host's share on a GPU).", "",
             "| B | cache | host us per layer | median | 32 layers ms | launches per layer | torch ops per layer | "
             "load ms per layer | outside torch ops |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["results"]:
        lines.append(f"| {r['batch']} | {r['cache']} | {r.get('host_us_per_layer', '-')} | {r.get('host_us_median', '-')} | "
                     f"{r.get('host_ms_32_layers', '-')} | {r.get('launches_per_layer', '-')} | {r['torch_ops_per_layer']} | "
                     f"{r.get('load_ms_per_layer', '-')} | {r.get('load_host_ms_per_layer', '-')} |")
    return lines


def one_run(argv: list[str], tree: Path | None, folder: Path, name: str) -> dict:
    """This script's result for argv at one round, in a subprocess with `tree`'s kvcal package (None: this tree's):
    a path entry holding a link to that package comes first, this tree's benchmarks after it (kvcal finds its kernels
    from its resolved path: the tree's own)."""
    path = [str(REPO)]
    if tree is not None:
        shim = folder / "baseline-package"
        if not shim.exists():
            shim.mkdir()
            (shim / "kvcal").symlink_to(tree.resolve() / "kvcal")
        path.insert(0, str(shim))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    if tree is not None:  # (provenance reads this tree's git)
        env["KVCAL_COMMIT"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True,
                                             text=True).stdout.strip() or str(tree)
    out = folder / name
    # run from the temporary folder: `python -m` puts its working directory first on the path
    done = subprocess.run([sys.executable, "-m", "benchmarks.end_to_end", "host", *argv, "--rounds", "1", "--out", str(out)],
                          cwd=folder, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"a run in {tree or REPO} failed:\n{done.stderr[-3000:]}")
    return json.loads(out.with_suffix(".json").read_text())


def compared(argv: list[str], args) -> dict:
    """--rounds rounds of one run per tree (this tree first): per (batch, cache) both sides' per-run rows."""
    runs = {"this": [], "baseline": []}
    with tempfile.TemporaryDirectory() as folder:
        for round_ in range(args.rounds):
            for side, tree in (("this", None), ("baseline", args.baseline_tree)):
                runs[side].append(one_run(argv, tree, Path(folder), f"{side}-{round_}"))
                print(f"round {round_ + 1}: {side} tree at {runs[side][-1]['commit']} done", flush=True)
    rows = []
    for i, row in enumerate(runs["this"][0]["results"]):
        per_run = {side: [run["results"][i] for run in side_runs] for side, side_runs in runs.items()}
        entry = {"cache": row["cache"], "batch": row["batch"]}
        for side, rounds in per_run.items():
            entry[f"{side}_torch_ops_per_layer"] = rounds[0]["torch_ops_per_layer"]
            if "host_us_per_layer" in row:
                entry[f"{side}_host_us_per_layer"] = round(statistics.median(r["host_us_per_layer"] for r in rounds), 1)
                entry[f"{side}_launches_per_layer"] = rounds[0]["launches_per_layer"]
                entry[f"{side}_load_host_ms_per_layer"] = round(statistics.median(r["load_host_ms_per_layer"] for r in rounds), 2)
        if "host_us_per_layer" in row:
            entry["ratio"] = round(statistics.median(a["host_us_per_layer"] / b["host_us_per_layer"]
                                                     for a, b in zip(per_run["this"], per_run["baseline"])), 3)
        rows.append(entry)
    return {"settings": {**runs["this"][0]["settings"], "rounds": args.rounds}, "baseline_commit": runs["baseline"][0]["commit"],
            "this_commit": runs["this"][0]["commit"], "results": rows}


def ab_table(result: dict, started: dict) -> list[str]:
    settings = result["settings"]
    lines = [f"# Host side of a CUDA decode step, per layer: {result['this_commit']} against {result['baseline_commit']}, on "
             f"{started['device']}", "",
             f"{started['date']}. `python -m benchmarks.end_to_end host --baseline-tree DIR`: {settings['rounds']} rounds of one "
             f"run per tree, this tree first (each run: {settings['layers']} layers, {settings['new_tokens']} steps after a "
             f"{settings['length']}-token prompt, kernel launches skipped; host us: the median over the rounds of a run's "
             "fastest tenth per layer and step); ratio: this tree's over the baseline's, the median of the rounds' ratios "
             "(below 1: this tree spends less); load: the prompt's context loaded, ms per layer outside torch operations, "
             "the median over the rounds.", "",
             "| B | cache | host us per layer (this / baseline) | ratio | launches per layer | torch ops per layer | "
             "load host ms per layer |",
             "|---|---|---|---|---|---|---|"]
    for r in result["results"]:
        if "ratio" not in r:
            continue
        lines.append(f"| {r['batch']} | {r['cache']} | {r['this_host_us_per_layer']} / {r['baseline_host_us_per_layer']} | "
                     f"{r['ratio']} | {r['this_launches_per_layer']} / {r['baseline_launches_per_layer']} | "
                     f"{r['this_torch_ops_per_layer']} / {r['baseline_torch_ops_per_layer']} | "
                     f"{r['this_load_host_ms_per_layer']} / {r['baseline_load_host_ms_per_layer']} |")
    return lines


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    started = provenance()
    cpu = device_slug(started["device"])
    if args.baseline_tree is not None:
        forwarded = [a for i, a in enumerate(argv) if not a.startswith("--baseline-tree")
                     and (i == 0 or argv[i - 1] != "--baseline-tree")]
        result = compared(forwarded, args)
        name = args.out or f"host_step_ab_{cpu}"
        write_result(name, result, started)
        write_markdown(name, ab_table(result, started))
        return
    name = args.out or f"host_step_{cpu}"
    result = measure(args)
    write_result(name, result, started)
    write_markdown(name, table(result, started))


if __name__ == "__main__":
    main()
