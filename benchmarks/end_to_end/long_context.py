"""Long context through the runtime cache: cache memory at 8K-32K tokens against transformers' own fp16 cache for
the model (hybrid-aware: Gemma 3's sliding layers keep their window), and passkey / multi-key retrieval at 4K-32K
tokens for fp, every recipe's bundle and the engines' cache types (each token quantized as it is written).

Bundles: <bundles>/{kvquant,mixed,skvq,kivi,kvmix}.safetensors; missing ones are fit there from --profile, or else
from a profile of the model on kvcal's built-in text (what `kvcal calibrate` does), written there as profile.safetensors.
Usage: python -m benchmarks.end_to_end long-context [--model gemma3-270m] [--bundles artifacts/runtime-gemma3] [--profile P]
       [--lengths 4096,8192,16384,32760] [--samples 20] [--keys 1,4] [--recipes kvquant,...] [--baselines fp8,q4_0,q8_0]
       [--memory-contexts 8192,32768] [--only memory,passkey]
The memory table also holds transformers' QuantizedCache (quanto int4/int2 where optimum-quanto imports, fp8).
Writes benchmarks/results/long_context_{memory,passkey}_<model>.{json,md} and long_context_passkey_<model>.png. A run
replaces the points it measures and keeps the others (each point names its commit), so the long lengths can be run
apart: on 2 CPU cores one 32K prompt takes minutes (its fp prefill, shared by the methods).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.common import REPO, RESULTS, SHARED, ensure_bundles, provenance, write_markdown, write_result

RECIPES = ("kvquant", "mixed", "skvq", "kivi", "kvmix")
QUANTIZED_CACHES = (("quanto", 4), ("quanto", 2), ("fp8", None))  # transformers' QuantizedCache (backend, nbits)
DEFAULT_BUNDLES = {"gemma3-270m": "artifacts/runtime-gemma3", "smollm2-135m": "artifacts/runtime"}
MIB = 2**20
BITS_LIMIT = 3.6  # the bound on real bits for "the recipe closest to fp"


def _merged(name: str, key, new_rows: list[dict]) -> list[dict]:
    """The rows of result `name` with those of the same key(row) replaced by new_rows."""
    path = RESULTS / f"{name}.json"
    old = json.loads(path.read_text())["results"] if path.is_file() else []
    replaced = {key(row) for row in new_rows}
    return [row for row in old if key(row) not in replaced] + new_rows


def _held_bytes(x) -> int:
    """Bytes of the tensors in x: a tensor, a tensor subclass holding others (quanto's codes, scales and shifts, its
    packed codes), or a tuple of them."""
    if isinstance(x, (tuple, list)):
        return sum(map(_held_bytes, x))
    if not isinstance(x, torch.Tensor):
        return 0
    if type(x) is torch.Tensor or not hasattr(x, "__tensor_flatten__"):
        return x.numel() * x.element_size()
    names, _ = x.__tensor_flatten__()
    return sum(_held_bytes(getattr(x, name)) for name in names)


def quantized_cache_memory(model, context_ids, backend: str, nbits: int | None, chunk: int) -> dict:
    """transformers' QuantizedCache (its defaults besides nbits: groups of 64, 128 fp residual tokens) after a prefill
    of context_ids (1-D) in steps of `chunk`: the bytes of every tensor its layers hold (codes, scales, residual), or
    transformers' reason for refusing it on this model."""
    from transformers import QuantizedCache

    from kvcal.adapters import decoder_of
    from kvcal.model_caches import cache_argument

    try:
        cache = QuantizedCache(backend=backend, config=model.config, **({"nbits": nbits} if nbits else {}))
    except ValueError as exc:
        return {"refused": str(exc).split(". ")[0]}
    ids = context_ids[None].to(model.get_input_embeddings().weight.device)
    for start in range(0, len(context_ids), chunk):
        decoder_of(model)(ids[:, start : start + chunk], **cache_argument(cache), use_cache=True)
    held = ("keys", "values", "_quantized_keys", "_quantized_values")
    return {"live_bytes": sum(_held_bytes(getattr(layer, name, None)) for layer in cache.layers for name in held)}


def _quantized_caches() -> list[tuple[str, int | None]]:
    """The QUANTIZED_CACHES whose backend imports here (quanto is optional: pip install optimum-quanto)."""
    import importlib.util

    return [(backend, nbits) for backend, nbits in QUANTIZED_CACHES
            if backend != "quanto" or importlib.util.find_spec("optimum.quanto") is not None]


def memory(model, model_name: str, bundles: dict, ids, contexts: list[int], chunk: int, started: dict) -> None:
    from kvcal.adapters import adapt
    from kvcal.generation import measure_memory
    from kvcal.runtime.memory import fp16_bytes

    adapter = adapt(model)
    rows = []
    for context in contexts:
        for name, path in bundles.items():
            began = time.perf_counter()
            row = measure_memory(model, path, ids[:context], chunk)
            rows.append({"method": name, "context": context, "commit": started["commit"],
                         "seconds": round(time.perf_counter() - began, 1), **row})
            print(f"memory {name} {context}: {row['live_bytes'] / row['fp16_bytes']:.1%} of fp16", flush=True)
        for backend, nbits in _quantized_caches():
            began = time.perf_counter()
            row = quantized_cache_memory(model, ids[:context], backend, nbits, chunk)
            name = f"QuantizedCache {backend}" + (f" int{nbits}" if nbits else "")
            rows.append({"method": name, "context": context, "commit": started["commit"], "seconds": round(time.perf_counter() - began, 1),
                         "fp16_bytes": fp16_bytes(len(adapter.layers), adapter.kv_widths, context, adapter.spans), **row})
            print(f"memory {name} {context}: {row}", flush=True)
    name = f"long_context_memory_{model_name}"
    rows = sorted(_merged(name, lambda r: (r["method"], r["context"]), rows), key=lambda r: (r["context"], r["method"]))
    dtype = str(model.dtype).removeprefix("torch.")
    write_result(name, {"model": model_name, "dtype": dtype, "prefill_chunk": chunk, "results": rows}, started)
    lines = [f"# KV cache memory at long context ({model_name}, one sequence, prefill in steps of {chunk} tokens)", "",
             "transformers fp16: the model's own DynamicCache (a sliding-window layer keeps its last window - 1 tokens).",
             "QuantizedCache: transformers' own quantized cache (its defaults: groups of 64 channels, 128 fp residual tokens,",
             f"scales in the model's dtype, {dtype}), every tensor it holds after the prefill; transformers refuses it for hybrid",
             "models.", "",
             "| context | method | live MiB | formula MiB | transformers fp16 MiB | vs fp16 | outliers | commit |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "refused" in r:
            lines.append(f"| {r['context']} | {r['method']} | refused: {r['refused']} | - | {r['fp16_bytes'] / MIB:.3f} | - | - | {r['commit']} |")
        else:
            lines.append(f"| {r['context']} | {r['method']} | {r['live_bytes'] / MIB:.3f} | "
                         + (f"{r['formula_bytes'] / MIB:.3f}" if "formula_bytes" in r else "-")
                         + f" | {r['fp16_bytes'] / MIB:.3f} | {r['live_bytes'] / r['fp16_bytes']:.1%} | {r.get('outliers', '-')} | {r['commit']} |")
    write_markdown(name, lines)


def passkey(model, model_name: str, tokenizer, bundles: dict, baselines: list[str], ids, lengths: list[int], samples: int,
            variants: list[int], asked: int, chunk: int, started: dict) -> None:
    from kvcal.adapters import adapt
    from kvcal.bundle import load_bundle
    from kvcal.generation import ANSWER_TOKENS, passkey_accuracy
    from kvcal.methods import baseline_method

    adapter = adapt(model)
    too_long = [length for length in lengths if adapter.max_positions and length + ANSWER_TOKENS > adapter.max_positions]
    if too_long:
        raise SystemExit(f"--lengths {too_long[0]} + the {ANSWER_TOKENS}-token answer is above the model's {adapter.max_positions} "
                         f"positions; use at most {adapter.max_positions - ANSWER_TOKENS}")
    methods = {name: load_bundle(path, model=model) for name, path in bundles.items()}
    bits = {}
    for spec in baselines:
        method = baseline_method(spec, adapter.head_dims, adapter.windows, adapter.decoder_kind)
        methods[method.name] = method
        bits[method.name] = _stored_bits(method, adapter.kv_widths)
    rows = []
    for keys in variants:
        for length in lengths:
            began = time.perf_counter()
            progress = _progress(f"passkey keys={keys} {length}", samples, (1 if keys == 1 else asked) * (len(methods) + 1), began)
            results = passkey_accuracy(model, tokenizer, methods, ids, [length], samples, seed=0, on_step=progress, keys=keys,
                                       asked=asked, chunk=chunk)
            seconds = round(time.perf_counter() - began, 1)
            rows += [{**r.as_dict(), "prompts": samples, "commit": started["commit"], "seconds": seconds,
                      **({"bits": bits[r.method]} if r.method in bits else {})} for r in results]
            print(f"passkey keys={keys} {length}: " + ", ".join(f"{r.method} {r.correct}/{r.samples}" for r in results), flush=True)
    name = f"long_context_passkey_{model_name}"
    rows = _merged(name, lambda r: (r["method"], r["length"], r["keys"]), rows)
    write_result(name, {"model": model_name, "filler": "wikitext-2 test", "asked": asked, "prefill_chunk": chunk,
                        "results": rows}, started)
    passkey_report(model_name)


def _stored_bits(method, widths: list[int]) -> float:
    """A per-token method's real bits per element over layers `widths` channels wide: what its codecs store for one
    token, K and V, over as many elements (Quantized.row_bits, which every codec gives; not every codec has a
    row_bits method)."""
    stored = [float(codec.quantize(torch.zeros(1, width)).row_bits[0])
              for layer, width in zip(method.layers, widths) for codec in (layer.key_codec, layer.value_codec)]
    return sum(stored) / (2 * sum(widths))


def _progress(what: str, prompts: int, steps_per_prompt: int, began: float):
    """An on_step callback printing a line after each prompt (its steps: questions x methods)."""
    steps = iter(range(1, prompts * steps_per_prompt + 1))

    def step() -> None:
        done = next(steps)
        if done % steps_per_prompt == 0:
            print(f"{what}: {done // steps_per_prompt}/{prompts} prompts, {time.perf_counter() - began:.0f} s", flush=True)
    return step


def real_bits(model_name: str, passkey_rows: list[dict]) -> dict[str, float]:
    """Per method, real bits per element: a recipe's the most its live cache stored at the contexts of the memory table
    (16 x live bytes / transformers' fp16 bytes: both keep the same tokens), an engine type's as its codec stores a
    token (the passkey rows' `bits`)."""
    path = RESULTS / f"long_context_memory_{model_name}.json"
    bits = {row["method"]: row["bits"] for row in passkey_rows if "bits" in row}
    for row in json.loads(path.read_text())["results"] if path.is_file() else []:
        if row["method"] in RECIPES:
            bits[row["method"]] = max(bits.get(row["method"], 0.0), 16 * row["live_bytes"] / row["fp16_bytes"])
    return bits


def closest_to_fp(rows: list[dict], bits: dict[str, float], keys: int, length: int) -> str:
    """The recipe at <= BITS_LIMIT real bits with the most retrieved at (keys, length), and its gap to fp."""
    at = {r["method"]: r for r in rows if r["keys"] == keys and r["length"] == length}
    eligible = [m for m in at if m != "fp" and bits.get(m, BITS_LIMIT + 1) <= BITS_LIMIT]
    if "fp" not in at or not eligible:
        return "-"
    best = max(eligible, key=lambda m: (at[m]["correct"], -bits[m]))
    fewer = at["fp"]["correct"] - at[best]["correct"]
    return f"{best} ({bits[best]:.2f} bits): " + ("as many as fp" if fewer == 0 else f"{fewer} fewer than fp" if fewer > 0 else f"{-fewer} more than fp")


def passkey_report(model_name: str) -> None:
    """The passkey result's markdown (a table per variant, and per length the recipe at <= BITS_LIMIT real bits
    closest to fp) and plot, from its JSON: fp, the recipes, then the engine types."""
    name = f"long_context_passkey_{model_name}"
    payload = json.loads((RESULTS / f"{name}.json").read_text())
    rows, asked = payload["results"], payload["asked"]
    bits = real_bits(model_name, rows)
    methods = ["fp", *RECIPES]
    methods += sorted({r["method"] for r in rows} - set(methods))
    lines = [f"# Passkey and multi-key retrieval at long context ({model_name}, wikitext-2 test filler)", "",
             "One fp prefill of each prompt's context is loaded into every method's cache; the question and the 8 answer",
             "tokens are decoded by each method. Passkey: one 5-digit key at a random depth. Multi-key: that many keys of",
             f"named doors at random depths, {asked} of them asked. Correct = the asked key appears in the answer.", "",
             "The engines' cache types (vLLM fp8 at its default scale 1.0, llama.cpp q4_0 / q8_0) quantize each token as it",
             "is written (kvcal.simulate.QuantizedOnWrite, keys after RoPE) in transformers' own cache for the model.", "",
             "Real bits per element: " + ", ".join(f"{m} {b:.2f}" for m, b in sorted(bits.items())) + " (a recipe's: the most its",
             f"live cache stored at the contexts of long_context_memory). Closest at <= {BITS_LIMIT} bits: of the methods at most",
             f"{BITS_LIMIT} real bits, the one retrieving most, against fp.", ""]
    for keys in sorted({r["keys"] for r in rows}):
        present = sorted({r["length"] for r in rows if r["keys"] == keys})
        lines += [f"## {'passkey' if keys == 1 else f'{keys} keys, {asked} asked'}", "",
                  "| method | " + " | ".join(map(str, present)) + " |", "|---" * (len(present) + 1) + "|"]
        for method in methods:
            cells = [next((f"{r['correct']}/{r['samples']}" for r in rows
                           if r["method"] == method and r["keys"] == keys and r["length"] == length), "-") for length in present]
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        lines.append(f"| closest at <= {BITS_LIMIT} bits | " + " | ".join(closest_to_fp(rows, bits, keys, length) for length in present) + " |")
        lines.append("")
    lines += ["Commits: " + ", ".join(sorted({r["commit"] for r in rows})) + ". The filler reads wikitext's `<unk>` markers as",
              "text from b9a3fc8 on (kvcal.data.tokenize); points at earlier commits read them as the tokenizer's own unknown",
              "token where it spells one so (Gemma 3's)."]
    write_markdown(name, lines)
    plot(name, rows, methods)


def plot(name: str, rows: list[dict], methods: list[str]) -> None:
    from matplotlib.figure import Figure

    variants = sorted({r["keys"] for r in rows})
    figure = Figure(figsize=(5 * len(variants), 4))
    for i, keys in enumerate(variants):
        axes = figure.add_subplot(1, len(variants), i + 1)
        for method in methods:
            points = sorted((r["length"], r["correct"] / r["samples"]) for r in rows if r["method"] == method and r["keys"] == keys)
            if points:
                axes.plot(*zip(*points), marker="o", label=method, linestyle="--" if method == "fp" else "-")
        axes.set_xscale("log", base=2)
        axes.set_xlabel("context tokens")
        axes.set_ylabel("retrieved")
        axes.set_ylim(-0.05, 1.05)
        axes.set_title("passkey" if keys == 1 else f"{keys} keys")
        axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(RESULTS / f"{name}.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma3-270m", help="A packaged model (gemma3-270m, smollm2-135m).")
    parser.add_argument("--bundles", default=None, help="Folder of the recipes' bundles (default: per model, see DEFAULT_BUNDLES).")
    parser.add_argument("--profile", type=Path, default=None, help="A kvcal profile of the model to fit missing bundles from.")
    parser.add_argument("--lengths", default="4096,8192,16384,32760",
                        help="Passkey prompt lengths in tokens (each plus the 8-token answer at most the model's positions).")
    parser.add_argument("--samples", type=int, default=20, help="Prompts per length and variant.")
    parser.add_argument("--keys", default="1,4", help="Variants: keys per prompt (1: passkey; more: multi-key).")
    parser.add_argument("--asked", type=int, default=2, help="Multi-key: keys asked per prompt.")
    parser.add_argument("--recipes", default=",".join(RECIPES), help="The recipes' bundles to measure; '' for none.")
    parser.add_argument("--baselines", default="fp8,q4_0,q8_0",
                        help="Engine cache types beside the recipes (eval ppl --baseline specs that quantize each token on its own); '' for none.")
    parser.add_argument("--memory-contexts", default="8192,32768", help="Context lengths of the memory table.")
    parser.add_argument("--prefill-chunk", type=int, default=2048, help="Prefill steps in tokens.")
    parser.add_argument("--only", default="memory,passkey",
                        help="Which parts to run: memory, passkey, report (only rewrite the passkey markdown and plot from its JSON).")
    args = parser.parse_args()
    if args.only == "report":
        passkey_report(args.model)
        return
    from kvcal.data import tokenize
    from kvcal.methods import split_baselines
    from kvcal.models import load_model

    started = provenance()
    folder = REPO / (args.bundles or DEFAULT_BUNDLES[args.model])
    bundles = ensure_bundles(folder, [name for name in args.recipes.split(",") if name], args.profile, args.model)
    model, tokenizer, _ = load_model(args.model, "auto", "cuda" if torch.cuda.is_available() else "cpu")
    ids = tokenize((SHARED / "data" / "wikitext-2" / "test.txt").read_text(), tokenizer)
    only = args.only.split(",")
    with torch.inference_mode():
        if "memory" in only:
            memory(model, args.model, bundles, ids, [int(x) for x in args.memory_contexts.split(",")], args.prefill_chunk, started)
        if "passkey" in only:
            passkey(model, args.model, tokenizer, bundles, split_baselines(args.baselines), ids,
                    [int(x) for x in args.lengths.split(",")], args.samples, [int(x) for x in args.keys.split(",")],
                    args.asked, args.prefill_chunk, started)


if __name__ == "__main__":
    main()
