"""A step of several tokens over a stored cache (speculative decoding's check of its candidates, a chat turn's
prompt): ms of one forward of m new tokens after a context of n, the attention over the stored tokens read two ways,
side by side: by the decode kernel, the step's queries as more query heads, merged with the step's own tokens'
attention by log-sum-exp (kvcal.runtime.layer.RuntimeLayer._short_step), and by the torch reference (each sequence's
cache dequantized, one attention over it and the step), and on the kernel's way with later_steps="decode" (each
query then re-reading the tokens the step moved to the body as its decode step would: what that costs). The runtime
takes the kernel's way up to a step length
(kvcal.runtime.backends.CPU_SHORT_STEP_TOKENS on the CPU, CUDA_SHORT_STEP_PASSES on a GPU): the `runtime` column says
which way it takes at each m. DynamicCache's step gives the scale. --shape runs a random model of a
`benchmarks.end_to_end gpu` shape instead (Llama-3.1-8B's on a GPU: what the GPU campaign's short-steps stage runs).

Each measurement loads the context, made once per length by the fp model (kvcal.runtime.fp_context), into a fresh
cache, runs one decode step (the decoders bound, tables made), then times the step of m tokens; the median of --rounds.

Usage: python -m benchmarks.end_to_end short-steps [--model SPEC | --shape NAME] [--bundles PATH,...] [--contexts 300,2000]
       [--steps 4,16,64,128,256] [--rounds 3] [--device cpu] [--out NAME]      (see --help)
Writes benchmarks/results/short_steps_<device>.{json,md} (--out).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from benchmarks.common import device_slug, kivi2_bundle, provenance, write_markdown, write_result
from benchmarks.end_to_end import gpu

WAYS = ("kernel", "reference")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="A model spec as kvcal takes it (default: the packaged SmolLM2).")
    parser.add_argument("--shape", choices=sorted(gpu.SHAPES), default=None,
                        help="A random Llama of this shape instead of --model (seeded; bf16 on CUDA).")
    parser.add_argument("--bundles", default="", help="Comma-separated bundle paths for this model, beside KIVI-2.")
    parser.add_argument("--contexts", default="300,2000", help="Comma-separated tokens stored before the step.")
    parser.add_argument("--steps", default="4,16,64,128,256", help="Comma-separated tokens of the step.")
    parser.add_argument("--rounds", type=int, default=3, help="Timed steps per configuration (the median kept).")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="Where the model and cache run.")
    parser.add_argument("--out", default=None, help="Result name (default short_steps_<device>).")
    args = parser.parse_args(argv)
    for name in ("contexts", "steps"):
        try:
            values = [int(v) for v in getattr(args, name).split(",")]
        except ValueError:
            parser.error(f"--{name}: comma-separated whole numbers, not {getattr(args, name)!r}")
        if min(values) < 1:
            parser.error(f"--{name}: every value at least 1")
        setattr(args, name, values)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.shape and args.model:
        parser.error("--shape and --model: give one model")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    missing = [path for path in filter(None, args.bundles.split(",")) if not Path(path).is_file()]
    if missing:
        parser.error(f"--bundles: no bundle at {', '.join(missing)}; make one with kvcal calibrate")
    return args


@contextmanager
def way(name: str):
    """Within the block a step of several tokens reads the stored cache the `name` way at any length."""
    from kvcal.runtime import backends

    held = backends.CPU_SHORT_STEP_TOKENS, backends.CUDA_SHORT_STEP_PASSES
    backends.CPU_SHORT_STEP_TOKENS, backends.CUDA_SHORT_STEP_PASSES = (2**31, 2**31) if name == "kernel" else (0, 0)
    try:
        yield
    finally:
        backends.CPU_SHORT_STEP_TOKENS, backends.CUDA_SHORT_STEP_PASSES = held


def runtime_way(model, device: str, step: int) -> str:
    """The way the runtime takes for a step of `step` tokens by default (on the layers of most query heads a KV
    head, where layers differ)."""
    from kvcal.adapters import adapt
    from kvcal.runtime import backends

    adapter = adapt(model)
    group = max(heads // kv_heads for heads, kv_heads in zip(adapter.query_heads, adapter.kv_heads))
    return WAYS[step > backends.short_step_tokens("cpu-kernel" if device == "cpu" else "tensor-core", group)]


def step_ms(model, bundle, context, ids: torch.Tensor, later_steps: str = "prefill") -> float:
    """ms of the forward of ids (1, m) after `context` (an FpContext) loaded into a fresh cache of `bundle` (None:
    a copy of the context's DynamicCache; later_steps: quantized_cache's) and one decode step."""
    from kvcal.model_caches import cache_argument
    from kvcal.runtime import quantized_cache

    stored = context.cache.get_seq_length()
    positions = torch.arange(stored, stored + 1 + ids.shape[1], device=ids.device)[None]
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)

    def timed(cache) -> float:
        model(ids[:, :1], **cache_argument(cache), use_cache=True, position_ids=positions[:, :1])
        sync()
        began = time.perf_counter()
        model(ids, **cache_argument(cache), use_cache=True, position_ids=positions[:, 1:])
        sync()
        return (time.perf_counter() - began) * 1e3

    if bundle is None:
        return timed(copy.deepcopy(context.cache))
    with quantized_cache(model, bundle, later_steps=later_steps) as cache:
        cache.load(context)
        return timed(cache)


def main(argv=None) -> None:
    args = parse_args(argv)
    from kvcal.bundle import load_bundle
    from kvcal.models import load_model
    from kvcal.runtime.fp_context import fp_context

    started = provenance()
    if args.shape:
        model, model_name = gpu.random_model(args.shape, args.device, seed=0), f"random {args.shape}"
    else:
        model, _, source = load_model(args.model)
        model, model_name = model.to(args.device), source.name
    bundles = {"kvcal kivi2-g32": kivi2_bundle(model),
               **{f"kvcal {Path(path).stem}": load_bundle(path, model=model) for path in filter(None, args.bundles.split(","))}}
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (1, max(args.contexts) + 1 + max(args.steps)), generator=torch.Generator().manual_seed(0))
    ids = ids.to(args.device)
    rows = []
    with torch.inference_mode():
        for n in args.contexts:
            context = fp_context(model, ids[:, :n])
            for m in args.steps:
                step = ids[:, n + 1 : n + 1 + m]
                dynamic = statistics.median(step_ms(model, None, context, step) for _ in range(args.rounds))
                for name, bundle in bundles.items():
                    ms = {}
                    for taken, later_steps in (*((taken, "prefill") for taken in WAYS), ("kernel", "decode")):
                        with way(taken):
                            ms[taken, later_steps] = statistics.median(step_ms(model, bundle, context, step, later_steps)
                                                                       for _ in range(args.rounds))
                    kernel, reference = ms["kernel", "prefill"], ms["reference", "prefill"]
                    decode_steps = ms["kernel", "decode"]
                    rows.append({"cache": name, "context": n, "step": m, "ms_dynamic_cache": round(dynamic, 2),
                                 "ms_kernel": round(kernel, 2), "ms_reference": round(reference, 2),
                                 "kernel_vs_reference": round(kernel / reference, 3),
                                 "ms_decode_steps": round(decode_steps, 2),
                                 "decode_steps_vs_kernel": round(decode_steps / kernel, 3),
                                 "runtime": runtime_way(model, args.device, m)})
                    print(f"{name}, context {n}, step {m}: kernel {kernel:.1f} ms, reference {reference:.1f} ms, "
                          f"as decode steps {decode_steps:.1f} ms, DynamicCache {dynamic:.1f} ms", flush=True)
    out = args.out or f"short_steps_{device_slug(started['device'])}"
    write_result(out, {"model": model_name, "rounds": args.rounds, "results": rows}, started)
    lines = [f"# A step of several tokens over a stored cache ({model_name}, {started['device']}, {started['commit']})", "",
             f"ms of one forward of the step's tokens after the context (one sequence), median of {args.rounds}; "
             "`kernel`: the stored tokens read by the decode kernel, the step's queries as more query heads; "
             "`reference`: each sequence's cache dequantized; `as decode steps`: the kernel's way with "
             "later_steps=\"decode\" (the moved tokens re-read); `runtime`: the way kvcal takes at that step length.", "",
             "| cache | context | step | DynamicCache ms | kernel ms | reference ms | kernel / reference | "
             "as decode steps ms | as decode steps / kernel | runtime |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['cache']} | {r['context']} | {r['step']} | {r['ms_dynamic_cache']:.1f} | {r['ms_kernel']:.1f} | "
              f"{r['ms_reference']:.1f} | {r['kernel_vs_reference']:.2f}x | {r['ms_decode_steps']:.1f} | "
              f"{r['decode_steps_vs_kernel']:.2f}x | {r['runtime']} |" for r in rows]
    write_markdown(out, lines)


if __name__ == "__main__":
    main()
