"""generate() decode throughput end to end on a GPU: a Llama-3.1-8B-shaped model with random bf16 weights (32 layers,
32 query / 8 KV heads, head_dim 128; nothing is downloaded), decoding after a prefill of --lengths tokens at --batches,
with transformers' StaticCache (preallocated: the fair fp baseline) and DynamicCache on SDPA, transformers'
QuantizedCache where its backend imports, and kvcal's cache for every recipe.

Bundles are made for this random model: it is profiled on the GPU (`kvcal profile-gradients`' capture pass on
--profile-windows windows of random token ids; seconds and peak GPU memory per window are reported), the calibrated
recipes are fitted from that profile and every bundle is exported (kvcal.calibration.fit_bundle).

Per (prompt length L, batch B): one sequence of L random token ids (seeded) but its last token is prefilled once with
the fp model (kvcal.runtime.fp_context), and that context is loaded B times into every cache (the B sequences of
a batch hold the same tokens: the decode step reads every sequence's bytes all the same). Then model.generate() runs
greedily from the whole prompt: its first step feeds the last prompt token, and the --new-tokens steps after it are
timed one by one (the device synchronized at each), never the prefill. Every cache runs the same eager model:
generate()'s automatic torch.compile for static caches on CUDA is turned off (disable_compile). StaticCache is measured
first and last in each cell; ratios are to the mean of the two.

A cache that runs out of device memory in a cell (an fp16 cache at a batch only the quantized ones hold) gets a row
that says so, without step times or ratios, and the run goes on.

Memory: the cache's own bytes (kvcal: WiredCache.used_bytes; StaticCache / DynamicCache: their tensors) and the peak
GPU memory above what was allocated before the cache was made (torch.cuda.max_memory_allocated: the cache, its
loading and the decode steps). The largest batch at L is predicted: (device memory - model weights) / that peak per
sequence, rounded down. With --largest-batch TRIES it is also tried, at the longest length, for StaticCache and every
kvcal recipe: from the prediction up by 10% while a batch loads and decodes, down once one runs out of device memory,
then halving the gap (largest_batch), TRIES tries at most per cache; each try loads the context and times
LARGEST_STEPS - 1 decode steps, so that the table gives tokens/s at the largest batch that ran (memory turned into
throughput). On a CPU nothing runs out: the tries only climb.

Where the Python side of a step dominates: with two lengths the step time is fitted as a + b L per cache (a: the
part that does not grow with the context: weights read, launches and Python; b: reading the cache); the weights' read
time at copy bandwidth is printed beside a.

Usage: python -m benchmarks.end_to_end gpu [--lengths 8192,32768] [--batches 1,8] [--recipes all]
       [--new-tokens 16] [--profile-windows 2] [--largest-batch TRIES] [--shape llama-8b|tiny] [--device cuda|cpu]
       [--cuda-layout heads] (see --help)
CPU dry run at a tiny size: python -m benchmarks.end_to_end gpu --shape tiny --device cpu --lengths 64,128 --batches 1,2
Writes benchmarks/results/generate_<device>.{json,md} (generate_<device>_heads with --cuda-layout heads: kvcal's CUDA
stores keeping each KV head's rows together) after each finished (L, B) cell, so a run stopped part way keeps the
cells it finished (--out; KVCAL_RESULTS_DIR moves benchmarks/results).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import math
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import device_slug, provenance, write_markdown, write_result

MIB = 2**20
SHAPES = {  # LlamaConfig fields: Llama-3.1-8B's shape, and a tiny one for CPU dry runs
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                     rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # Llama-3.1-8B's attention with a small hidden size and vocabulary: the cache's host side at the 8B's head shapes
    "llama-8b-attention": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=32, num_attention_heads=32,
                               num_key_value_heads=8, head_dim=128, vocab_size=1024, max_position_embeddings=131072,
                               rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                 head_dim=128, vocab_size=1024, max_position_embeddings=4096,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}
BASELINE = "StaticCache"
OUT_OF_MEMORY = {"ms_per_step": None, "ms_per_step_min": None, "load_s": None, "cache_gib": None, "peak_gib": None,
                 "out_of_memory": True}  # a cell's row for a cache that ran out of device memory
LARGEST_STEPS = 4  # new tokens per largest-batch try (the first step is not timed)
LARGEST_GROWTH = 1.1  # a largest-batch try after one that ran asks for this much more, after one that did not this much less
QUANTIZED_BACKENDS = {"quanto": "optimum.quanto", "hqq": "hqq"}  # transformers' QuantizedCache backends


def parse_args(argv=None) -> argparse.Namespace:
    from kvcal import registry
    from kvcal.errors import KvcalError
    from kvcal.runtime.store import STORE_LAYOUTS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-8b", help="model shape (default: %(default)s)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where the model runs (default: %(default)s)")
    parser.add_argument("--lengths", default="8192,32768", help="prompt lengths in tokens, comma-separated (default: %(default)s)")
    parser.add_argument("--batches", default="1,8", help="batch sizes, comma-separated (default: %(default)s)")
    parser.add_argument("--recipes", default="all", help=f"kvcal recipes, comma-separated, 'all' ({', '.join(registry.recipes())}) "
                                                         "or 'none' (default: %(default)s)")
    parser.add_argument("--baselines", default="static,dynamic,quanto,hqq",
                        help="transformers caches: static, dynamic, and QuantizedCache backends quanto, hqq "
                             "(left out with a line where they do not import); static is always measured (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=16, help="new tokens per generate(); the first (the last prompt "
                                                                   "token's step) is not timed (default: %(default)s)")
    parser.add_argument("--profile-windows", type=int, default=2, help="windows of the profile the bundles are fitted from "
                                                                      "(default: %(default)s)")
    parser.add_argument("--profile-seqlen", type=int, default=512, help="tokens per profile window (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's; fewer for a quick look)")
    parser.add_argument("--torch-profile", type=int, default=0, metavar="STEPS",
                        help="also trace STEPS decode steps of each cache of the first cell with torch.profiler; the "
                             "tables go into the Markdown (default: none)")
    parser.add_argument("--largest-batch", type=int, default=0, metavar="TRIES",
                        help="at the longest length, try up to TRIES batches per cache (StaticCache, kvcal's) for the "
                             "largest that loads and decodes, from the predicted one (default: 0, predicted only)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, prompts and profile (default: %(default)s)")
    parser.add_argument("--cuda-layout", choices=STORE_LAYOUTS, default="rows",
                        help="how the CUDA append kernels lay out kvcal's packed bodies: each token's row whole, or each KV "
                             "head's rows together (quantized_cache's cuda_layout; default: %(default)s)")
    parser.add_argument("--out", default=None,
                        help="result name under benchmarks/results (default: generate_<device>, _heads with --cuda-layout heads)")
    args = parser.parse_args(argv)
    try:
        args.lengths = [int(n) for n in args.lengths.split(",")]
        args.batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        parser.error("--lengths and --batches are whole numbers, comma-separated")
    if min(args.lengths) < 2 or min(args.batches) < 1:
        parser.error("--lengths are at least 2 tokens and --batches at least 1")
    args.recipes = (registry.recipes() if args.recipes == "all" else [] if args.recipes == "none"
                    else [r.strip() for r in args.recipes.split(",")])
    for recipe in args.recipes:
        try:
            registry.recipe(recipe)
        except KvcalError as exc:  # an unknown name, with the list
            parser.error(f"--recipes: {exc}")
    args.baselines = [b.strip() for b in args.baselines.split(",") if b.strip()]
    unknown = set(args.baselines) - {"static", "dynamic", *QUANTIZED_BACKENDS}
    if unknown:
        parser.error(f"unknown baseline(s) {', '.join(sorted(unknown))}; choose from static, dynamic, quanto, hqq")
    if args.new_tokens < 3:
        parser.error("--new-tokens must be at least 3 (the first step is not timed)")
    if args.layers is not None and args.layers < 1 or args.torch_profile < 0 or args.largest_batch < 0:
        parser.error("--layers is at least 1, --torch-profile 0 or more steps and --largest-batch 0 or more tries")
    if args.profile_windows < 1 or args.profile_seqlen < 2:
        parser.error("--profile-windows is at least 1 and --profile-seqlen at least 2")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU here (a CPU dry run: --shape tiny --device cpu)")
    return args


def random_model(shape: str, device: str, seed: int, layers: int | None = None):
    """A LlamaForCausalLM of `shape` (with `layers` decoder layers, if given) with random weights (transformers' own
    initialisation, seeded), bf16 on CUDA and fp32 on CPU, built on `device` directly."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = {**SHAPES[shape], **({"num_hidden_layers": layers} if layers else {})}
    config = LlamaConfig(**fields, attn_implementation="sdpa")
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    return model.eval()


class Clock:
    """Device-synchronized wall clock."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


# ---------------------------------------------------------------------------------------------------------
# bundles


def make_bundles(model, args, folder: Path, clock: Clock, indexer_keys: tuple[str, ...] = ("model",)) -> tuple[dict[str, Path], dict]:
    """Profile the model on random token ids, fit every recipe once and export its bundle once for each way of keeping
    a sparse model's indexer keys (kvcal.indexer_keys): (its label -> path, timings), labelled by recipe ("kvquant";
    with indexer keys kept otherwise than as computed, "kvquant, indexer fp8")."""
    from kvcal.artifacts import write_artifact
    from kvcal.calibration import export_fitted, fit_bundle
    from kvcal.capture import CaptureSettings
    from kvcal.profile import PROFILE_KIND, KvmixSettings, ProfileRequest, profile_model

    timing = {"profile_windows": args.profile_windows, "profile_seqlen": args.profile_seqlen}
    if not args.recipes:
        return {}, timing
    generator = torch.Generator().manual_seed(args.seed + 1)
    vocabulary = model.config.get_text_config().vocab_size  # (a composite's is its text config's)
    ids = torch.randint(vocabulary, (args.profile_windows * args.profile_seqlen,), generator=generator)
    request = ProfileRequest(model=f"random {args.shape}", dataset="random token ids", nsamples=args.profile_windows,
                             seqlen=args.profile_seqlen, seed=args.seed, capture=CaptureSettings(sink=1, seed=args.seed),
                             kvmix=KvmixSettings(), device=args.device)
    stamps = []
    reset_peak(args.device)
    base = allocated(args.device)
    began = clock()
    tensors, config = profile_model(model, ids, request, request.model, on_window=lambda w: stamps.append(clock()))
    windows = [b - a for a, b in zip([began, *stamps], stamps)]
    timing.update(profile_window_s=[round(s, 3) for s in windows], profile_peak_gib=gib(peak(args.device) - base))
    print(f"profile: {len(windows)} windows of {args.profile_seqlen} tokens, "
          f"{' / '.join(f'{s:.2f}' for s in windows)} s each; peak {timing['profile_peak_gib']} GiB above the model", flush=True)
    profile = write_artifact(folder / "profile.safetensors", tensors, PROFILE_KIND, config)
    del tensors
    paths = {}
    for recipe in args.recipes:
        for keys in indexer_keys:  # (fitted once, for the first; the others exported from that fit)
            label = recipe if keys == "model" else f"{recipe}, indexer {keys}"
            began = time.perf_counter()
            make = fit_bundle if keys == indexer_keys[0] else export_fitted
            paths[label] = make(profile, recipe, folder / recipe / f"bundle-{keys}.safetensors", indexer_keys=keys)
            timing[f"fit_{label}_s"] = round(time.perf_counter() - began, 1)
            print(f"bundle {label}: {'fitted and ' if make is fit_bundle else ''}exported in "
                  f"{timing[f'fit_{label}_s']} s", flush=True)
    return paths, timing


# ---------------------------------------------------------------------------------------------------------
# memory


def reset_peak(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def allocated(device: str) -> int:
    return torch.cuda.memory_allocated() if device == "cuda" else 0


def peak(device: str) -> int:
    return torch.cuda.max_memory_allocated() if device == "cuda" else 0


def gib(n: int) -> float:
    return round(n / 2**30, 3)


# ---------------------------------------------------------------------------------------------------------
# caches


def batched(context, batch: int):
    """The context's rows repeated for `batch` sequences, as views (each cache copies what it stores)."""
    from kvcal.runtime.fp_context import FpContext

    rows = lambda tensors: [t if t is None else t.expand(batch, *t.shape[1:]) for t in tensors]  # noqa: E731
    return FpContext(rows(context.keys), rows(context.pre_rope_keys), rows(context.values), None,
                     None if context.index_keys is None else rows(context.index_keys))


def filled_transformers_cache(cache, context, batch: int):
    """A transformers cache holding the context's keys and values for `batch` sequences, through its own update()."""
    tokens = context.values[0].shape[1]
    positions = torch.arange(tokens, device=context.values[0].device)
    for index, layer in enumerate(context.cache.layers):
        keys = layer.keys.expand(batch, *layer.keys.shape[1:]).contiguous()
        values = layer.values.expand(batch, *layer.values.shape[1:]).contiguous()
        cache.update(keys, values, index, {"cache_position": positions})
        if getattr(layer, "indexer_keys", None) is not None:  # (DeepSeek Sparse Attention's)
            cache.update_indexer(layer.indexer_keys.expand(batch, -1, -1).contiguous(), index)
        del keys, values
    return cache


def transformers_cache_bytes(cache) -> int:
    """What a transformers cache holds: keys, values and DeepSeek Sparse Attention's indexer keys."""
    return sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values, getattr(layer, "indexer_keys", None))
               if isinstance(t, torch.Tensor))


def makers(model, context, batch: int, length: int, new_tokens: int, bundles: dict, baselines: list[str],
           cuda_layout: str = "rows"):
    """(name, make) in the order measured in a cell (StaticCache first and last); make() -> (cache, bytes_of(cache));
    kvcal's caches with quantized_cache's cuda_layout."""
    from transformers import DynamicCache, QuantizedCache, StaticCache

    from kvcal.bundle import load_bundle
    from kvcal.runtime import quantized_cache

    def static():
        cache = StaticCache(config=model.config, max_cache_len=length + new_tokens)
        return filled_transformers_cache(cache, context, batch), transformers_cache_bytes

    def dynamic():
        return filled_transformers_cache(DynamicCache(config=model.config), context, batch), transformers_cache_bytes

    def transformers_quantized(backend):
        def make():
            cache = QuantizedCache(backend=backend, config=model.config, nbits=4, residual_length=128)
            return filled_transformers_cache(cache, context, batch), lambda cache: None
        return make

    def kvcal_cache(bundle):
        def make():
            cache = quantized_cache(model, bundle, cuda_layout)
            try:
                cache.load(batched(context, batch))
            except BaseException:  # (out of device memory in a largest-batch try: the model is unwired again)
                cache.close()
                raise
            return cache, lambda cache: cache.used_bytes()
        return make

    chosen = [("DynamicCache", dynamic)] if "dynamic" in baselines else []
    chosen += [(f"QuantizedCache {b} int4", transformers_quantized(b)) for b in baselines if b in QUANTIZED_BACKENDS]
    chosen += [(f"kvcal {recipe}", kvcal_cache(load_bundle(path))) for recipe, path in bundles.items()]
    return [(BASELINE, static), *chosen, (BASELINE, static)]


class Stamps:
    """A StoppingCriteria that never stops and records when each generated token is done (device synchronized)."""

    def __init__(self, clock: Clock):
        self.clock, self.times = clock, []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(self.clock())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def generate_steps(model, prompt: torch.Tensor, cache, new_tokens: int, on_token=None) -> None:
    """Greedy generate() of `new_tokens` from the whole prompt into `cache` (which holds all but its last token)."""
    from transformers import StoppingCriteriaList

    from kvcal.model_caches import cache_argument

    criteria = StoppingCriteriaList([on_token] if on_token is not None else [])
    with torch.inference_mode():
        model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), **cache_argument(cache),
                       max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                       stopping_criteria=criteria, disable_compile=True)


def closed(cache) -> None:
    if hasattr(cache, "close"):
        cache.close()


def run_cache(model, prompt: torch.Tensor, new_tokens: int, make, device: str, clock: Clock) -> dict:
    """generate() with the cache make() returns: ms per step (the first new token's step excluded), the cache's bytes,
    the peak memory above what was allocated before the cache."""
    reset_peak(device)
    base = allocated(device)
    began = clock()
    cache, bytes_of = make()
    loaded = clock() - began
    stamps = Stamps(clock)
    try:
        generate_steps(model, prompt, cache, new_tokens, stamps)
        stored = bytes_of(cache)
    finally:
        closed(cache)
    del cache
    steps = sorted(b - a for a, b in zip(stamps.times, stamps.times[1:]))
    return {"ms_per_step": round(1000 * steps[len(steps) // 2], 3), "ms_per_step_min": round(1000 * steps[0], 3),
            "load_s": round(loaded, 2), "cache_gib": None if stored is None else gib(stored),
            "peak_gib": gib(peak(device) - base) if device == "cuda" else None, "out_of_memory": False}


def profiled(model, prompt: torch.Tensor, steps: int, make, device: str) -> str:
    """Where `steps` decode steps of generate() with the cache make() returns spend their time (after one warm-up
    step): the device's busy time per step (torch.profiler's kernel times) against the wall time, and the Python
    functions by cumulative host time (cProfile, its own overhead included)."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    cache, _ = make()
    generate_steps(model, prompt, cache, 1)  # the last prompt token's step, outside the profile
    longer = torch.cat([prompt, prompt[:, -1:]], dim=1)
    clock = Clock(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    began = clock()
    with profile(activities=activities) as trace:
        generate_steps(model, longer, cache, steps)
    wall = clock() - began
    busy = sum(getattr(e, "self_device_time_total", 0) for e in trace.key_averages()) / 1e3  # us -> ms
    host = cProfile.Profile()
    host.enable()
    generate_steps(model, torch.cat([longer, longer[:, -1:].expand(-1, steps)], dim=1), cache, steps)
    host.disable()
    closed(cache)
    text = io.StringIO()
    pstats.Stats(host, stream=text).strip_dirs().sort_stats("cumulative").print_stats(40)
    listing = text.getvalue()[text.getvalue().index("ncalls"):]
    return (f"wall {1000 * wall / steps:.2f} ms per step under torch.profiler, device busy {busy / steps:.2f} ms per step\n\n"
            + listing)


def available(baselines: list[str]) -> tuple[list[str], dict[str, str]]:
    ok, missing = [], {}
    for name in baselines:
        module = QUANTIZED_BACKENDS.get(name)
        if module is not None and (importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None):
            missing[name] = f"QuantizedCache {name}: {module} is not installed; left out"
        else:
            ok.append(name)
    return ok, missing


# ---------------------------------------------------------------------------------------------------------
# the largest batch


def largest_batch(run, start: int, tries: int) -> tuple[int | None, int | None, list]:
    """The largest batch run(batch) completes (returns a result; None: it ran out of memory), in `tries` tries at
    most: from `start` up by LARGEST_GROWTH while it completes, down by it until one does, then halving the gap
    between the largest that completed and the smallest that did not. Returns (that largest or None, that smallest
    or None, [(batch, result), ...] in the order tried)."""
    done, failed, tried, batch = None, None, [], start
    while len(tried) < tries and batch >= 1:
        result = run(batch)
        tried.append((batch, result))
        if result is None:
            failed = batch
        else:
            done = batch
        if done is not None and failed is not None:
            batch = (done + failed) // 2
            if batch == done:  # nothing left between them
                break
        elif result is None:
            batch = min(batch - 1, math.floor(batch / LARGEST_GROWTH))
        else:
            batch = max(batch + 1, math.ceil(batch * LARGEST_GROWTH))
    return done, failed, tried


def largest_batches(model, context, ids: torch.Tensor, rows: list[dict], bundles: dict, args, clock: Clock):
    """For StaticCache, then each kvcal recipe at this length (rows: its cells), the largest batch that loads and
    decodes, args.largest_batch tries each from its predicted largest batch (or, where none is predicted, twice the
    cells' largest), with tokens/s there: a row per cache as each is done."""
    length = ids.shape[1]
    static = None
    for name in [BASELINE, *(f"kvcal {recipe}" for recipe in bundles)]:
        cells = [r for r in rows if r["cache"] == name and r["length"] == length and not r["out_of_memory"]]
        if not cells:  # (it ran out of memory at every batch of the cells)
            continue
        widest = max(cells, key=lambda r: r["batch"])
        start = widest["max_batch_predicted"] or 2 * widest["batch"]

        def run(batch: int, name=name):
            make = dict(makers(model, context, batch, length, LARGEST_STEPS, bundles, [], args.cuda_layout))[name]
            try:
                result = run_cache(model, ids.expand(batch, length), LARGEST_STEPS, make, args.device, clock)
            except torch.OutOfMemoryError:
                result = None
            reset_peak(args.device)
            print(f"  largest batch, {name}: B={batch} " + ("out of memory" if result is None else
                  f"ran, {result['ms_per_step']:.2f} ms/step, peak {result['peak_gib']} GiB"), flush=True)
            return result

        done, failed, tried = largest_batch(run, start, args.largest_batch)
        best = dict(tried)[done] if done is not None else {}
        row = {"cache": name, "length": length, "predicted": widest["max_batch_predicted"], "largest_batch": done,
               "first_failed": failed, "tries": [[b, r is not None] for b, r in tried],
               "ms_per_step": best.get("ms_per_step"), "peak_gib": best.get("peak_gib"),
               "tokens_per_s": round(1000 * done / best["ms_per_step"], 1) if best else None}
        if name == BASELINE:
            static = row
        both = static is not None and static["largest_batch"] and row["largest_batch"]
        row["batch_vs_static"] = round(row["largest_batch"] / static["largest_batch"], 2) if both else None
        row["tokens_per_s_vs_static"] = round(row["tokens_per_s"] / static["tokens_per_s"], 2) if both else None
        yield row


# ---------------------------------------------------------------------------------------------------------


def measure(args, save) -> dict:
    """Every cell of the run (see the module docstring): settings, profile timings and one row per (cell, cache).
    `save(result)` gets the result so far after each finished cell, so a run stopped part way keeps its whole cells."""
    from kvcal.runtime.fp_context import fp_context

    device, clock = args.device, Clock(args.device)
    baselines, missing = available(args.baselines)
    for line in missing.values():
        print(line, flush=True)
    model = random_model(args.shape, device, args.seed, args.layers)
    weights = sum(p.nbytes for p in model.parameters())
    print(f"model: random {args.shape}, {weights / 2**30:.1f} GiB of {model.dtype} weights on {device}", flush=True)
    rows, traces = [], {}
    settings = {"shape": args.shape, "config": model.config.to_diff_dict(), "dtype": str(model.dtype),
                "lengths": args.lengths, "batches": args.batches, "recipes": args.recipes, "baselines": baselines,
                "left_out": missing, "new_tokens": args.new_tokens, "timed_steps": args.new_tokens - 1,
                "seed": args.seed, "weights_gib": gib(weights), "largest_batch_tries": args.largest_batch,
                "cuda_layout": args.cuda_layout,
                "device_memory_gib": gib(torch.cuda.get_device_properties(0).total_memory) if device == "cuda" else None}
    with tempfile.TemporaryDirectory() as folder:
        bundles, profile = make_bundles(model, args, Path(folder), clock)
        record = {"settings": settings, "profile": profile, "results": rows, "fits": [], "torch_profiles": traces, "largest": []}
        generator = torch.Generator().manual_seed(args.seed)
        for length in args.lengths:
            ids = torch.randint(model.config.vocab_size, (1, length), generator=generator).to(device)
            began = clock()
            with torch.inference_mode():
                context = fp_context(model, ids[:, :-1])
            print(f"\n{length} tokens: fp prefill of one sequence {clock() - began:.1f} s", flush=True)
            for batch in args.batches:
                prompt = ids.expand(batch, length)
                cell = []
                room = args.new_tokens + 2 * args.torch_profile + 1  # StaticCache's tokens past the prompt
                chosen = makers(model, context, batch, length, room, bundles, baselines, args.cuda_layout)
                for name, make in chosen:
                    try:
                        result = run_cache(model, prompt, args.new_tokens, make, device, clock)
                    except torch.OutOfMemoryError:  # (fp16 caches at a batch only the quantized ones hold)
                        reset_peak(device)
                        cell.append({"cache": name, "length": length, "batch": batch, **OUT_OF_MEMORY})
                        print(f"  B={batch:<3d} {name:28s} out of device memory", flush=True)
                        continue
                    cell.append({"cache": name, "length": length, "batch": batch, **result})
                    print(f"  B={batch:<3d} {name:28s} {result['ms_per_step']:9.2f} ms/step  load {result['load_s']:6.2f} s  "
                          f"cache {result['cache_gib']} GiB  peak {result['peak_gib']} GiB", flush=True)
                rows += summarized(cell, weights, device)
                if args.torch_profile and not traces:
                    traces.update({f"{name}, L={length}, B={batch}": profiled(model, prompt, args.torch_profile, make, device)
                                   for name, make in chosen[:-1]})
                record["fits"] = fitted_steps(rows)
                save(record)
            if args.largest_batch and length == max(args.lengths):
                print(f"\n{length} tokens: the largest batch, {args.largest_batch} tries per cache", flush=True)
                with torch.inference_mode():
                    for row in largest_batches(model, context, ids, rows, bundles, args, clock):
                        record["largest"].append(row)
                        save(record)
            del context
            reset_peak(device)
    return record


def summarized(cell: list[dict], weights: int, device: str) -> list[dict]:
    """The cell's rows with tokens/s, the ratios to StaticCache (the mean of its two runs, kept as one row) and to the
    faster of the unquantized caches, and the predicted largest batch; a cache that ran out of memory has none of
    them (and where StaticCache or both unquantized caches did, no cache has that ratio)."""
    static = [r["ms_per_step"] for r in cell if r["cache"] == BASELINE and not r["out_of_memory"]]
    reference = sum(static) / len(static) if static else None
    first, last = cell[0], cell.pop()  # StaticCache's two runs, kept as one row
    if first["out_of_memory"]:
        first.update(last)  # (the run that ran, if either did)
    if static:
        first.update(ms_per_step=round(reference, 3), static_runs_ms=static,
                     peak_gib=max((r["peak_gib"] for r in (first, last) if r["peak_gib"] is not None), default=None))
    ran_fp = [r["ms_per_step"] for r in cell if r["cache"] in (BASELINE, "DynamicCache") and not r["out_of_memory"]]
    fastest_fp = min(ran_fp, default=None)
    total = torch.cuda.get_device_properties(0).total_memory if device == "cuda" else None
    for row in cell:
        ms = row["ms_per_step"]
        row["tokens_per_s"] = None if ms is None else round(1000 * row["batch"] / ms, 1)
        row["speedup_vs_static"] = None if ms is None or reference is None else round(reference / ms, 3)
        row["speedup_vs_fastest_fp"] = None if ms is None or fastest_fp is None else round(fastest_fp / ms, 3)
        per_sequence = None if row["peak_gib"] is None else row["peak_gib"] * 2**30 / row["batch"]
        row["max_batch_predicted"] = (math.floor((total - weights) / per_sequence) if total and per_sequence else None)
    return cell


def fitted_steps(rows: list[dict]) -> list[dict]:
    """Per (cache, batch) measured at two lengths or more: step time = a + b L by least squares."""
    fits = []
    for cache, batch in dict.fromkeys((r["cache"], r["batch"]) for r in rows):
        points = [(r["length"], r["ms_per_step"]) for r in rows if r["cache"] == cache and r["batch"] == batch
                  and r["ms_per_step"] is not None]
        if len(points) < 2:
            continue
        n, sx, sy = len(points), sum(p[0] for p in points), sum(p[1] for p in points)
        sxx, sxy = sum(p[0] ** 2 for p in points), sum(p[0] * p[1] for p in points)
        slope = (n * sxy - sx * sy) / (n * sxx - sx * sx)
        fits.append({"cache": cache, "batch": batch, "fixed_ms": round((sy - slope * sx) / n, 3),
                     "ms_per_1k_tokens": round(1000 * slope, 4)})
    return fits


def ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(result: dict, started: dict) -> list[str]:
    settings = result["settings"]
    layers = settings["config"].get("num_hidden_layers", SHAPES[settings["shape"]]["num_hidden_layers"])
    lines = [f"# generate() decode on {started['device']}: random {settings['shape']}, {layers} layers ({settings['dtype']})", "",
             f"Commit {started['commit']}, {started['date']}. `python -m benchmarks.end_to_end gpu`: {settings['timed_steps']} "
             "decode steps timed per run (median), after one shared fp prefill loaded into every cache (a batch's sequences hold "
             "the same tokens; every cache on the same eager model); x Static: StaticCache's step time (the mean of its runs "
             "first and last in the cell) over the cache's; x fastest fp: the same with the faster of StaticCache and "
             "DynamicCache; peak: GPU memory above what was allocated before the cache; max batch: (device memory - weights) / "
             "peak per sequence, predicted.", ""]
    lines += [f"Left out: {why}" for why in settings["left_out"].values()]
    if settings.get("cuda_layout") == "heads":
        lines += ["kvcal's CUDA stores keep each KV head's rows together (--cuda-layout heads)."]
    profile = result["profile"]
    if "profile_window_s" in profile:
        lines += ["", f"Profile ({profile['profile_windows']} windows of {profile['profile_seqlen']} tokens): "
                  f"{' / '.join(map(str, profile['profile_window_s']))} s per window, peak {profile['profile_peak_gib']} GiB "
                  "above the model; fit and export: " + ", ".join(f"{k[4:-2]} {v} s" for k, v in profile.items() if k.startswith("fit_"))]
    lines += ["", "| L | B | cache | ms/step | tokens/s | x Static | x fastest fp | cache GiB | peak GiB | max batch (predicted) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["results"]:
        runs = f" ({' / '.join(f'{t:.1f}' for t in r['static_runs_ms'])})" if "static_runs_ms" in r else ""
        if r["out_of_memory"]:
            lines.append(f"| {r['length']} | {r['batch']} | {r['cache']} | out of memory | - | - | - | - | - | - |")
            continue
        lines.append(f"| {r['length']} | {r['batch']} | {r['cache']} | {r['ms_per_step']:.2f}{runs} | {r['tokens_per_s']} | "
                     f"{ratio(r['speedup_vs_static'])} | {ratio(r['speedup_vs_fastest_fp'])} | {r['cache_gib']} | {r['peak_gib']} | "
                     f"{r['max_batch_predicted']} |")
    if result["fits"]:
        lines += ["", "Step time fitted as a + b L (a: what does not grow with the context: weights, launches, Python; "
                  f"weights alone: {settings['weights_gib']} GiB):", "", "| cache | B | a ms | b ms per 1K tokens |", "|---|---|---|---|"]
        lines += [f"| {f['cache']} | {f['batch']} | {f['fixed_ms']} | {f['ms_per_1k_tokens']} |" for f in result["fits"]]
    if result.get("largest"):
        length = result["largest"][0]["length"]
        lines += ["", f"The largest batch at L={length}, tried ({settings['largest_batch_tries']} tries per cache from the predicted "
                  f"one; each loads the context and times {LARGEST_STEPS - 1} decode steps; ran: loaded and decoded, failed: "
                  "ran out of device memory):", "",
                  "| cache | predicted | largest that ran | smallest that failed | ms/step there | tokens/s there | peak GiB | "
                  "batch x Static | tokens/s x Static | tries |", "|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['cache']} | {r['predicted']} | {r['largest_batch']} | {r['first_failed']} | {r['ms_per_step']} | "
                  f"{r['tokens_per_s']} | {r['peak_gib']} | {r['batch_vs_static']} | {r['tokens_per_s_vs_static']} | "
                  + ", ".join(f"{b} {'ran' if ok else 'failed'}" for b, ok in r["tries"]) + " |" for r in result["largest"]]
    for title, trace in result["torch_profiles"].items():
        lines += ["", f"torch.profiler, {title} (its own overhead included):", "", "```", trace.rstrip(), "```"]
    return lines


def main(argv=None) -> None:
    args = parse_args(argv)
    started = provenance()
    name = args.out or f"generate_{device_slug(started['device'])}" + ("_heads" if args.cuda_layout == "heads" else "")
    measure(args, lambda result: (write_result(name, result, started), write_markdown(name, table(result, started))))


if __name__ == "__main__":
    main()
