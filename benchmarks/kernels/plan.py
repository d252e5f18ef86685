"""What serves every part of a decode step, per bundle recipe, on CUDA and on this machine's CPU: the planner of
kvcal.runtime.backends over one bundle per recipe (`kvcal inspect BUNDLE --device ...` per layer), summed up as
layers per server. No kernel runs: it reads the bundles and the kernels' own rules, so it runs anywhere.

    python -m benchmarks.kernels plan --bundles /tmp/kvcal-bench-bundles --name decode_plan_smollm2
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from benchmarks.common import ensure_bundles, provenance, write_markdown, write_result

PARTS = (("bodies", "bodies"), ("fp16_segments", "fp16 segments"), ("key_append", "K append"), ("value_append", "V append"))


def summarize(plans) -> dict[str, dict[str, int]]:
    """Per part of a decode step, layers per server ('-': the layer has no such part)."""
    return {field: dict(Counter(getattr(p, field) for p in plans)) for field, _ in PARTS}


def reasons(plans) -> list[str]:
    """The distinct reasons why not something faster, with the layers they hold for."""
    held: dict[str, list[int]] = {}
    for p in plans:
        if p.why:
            held.setdefault(p.why, []).append(p.layer)
    return [f"layers {_ranges(layers)}: {why}" for why, layers in held.items()]


def _ranges(layers: list[int]) -> str:
    runs, start = [], layers[0]
    for previous, current in zip(layers, layers[1:] + [None]):
        if current != previous + 1:
            runs.append(f"{start}" if start == previous else f"{start}-{previous}")
            start = current
    return ",".join(runs)


def _cell(counts: dict[str, int], layers: int) -> str:
    return ", ".join(server if n == layers else f"{server} x{n}" for server, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundles", type=Path, default=Path("/tmp/kvcal-bench-bundles"),
                        help="folder of <recipe>.safetensors bundles; missing ones are made there for SmolLM2 (default: %(default)s)")
    parser.add_argument("--recipes", default="kvquant,mixed,skvq,kivi,kvmix", help="recipes, comma-separated (default: %(default)s)")
    parser.add_argument("--profile", type=Path, help="an existing kvcal profile to fit missing bundles from")
    parser.add_argument("--name", default="decode_plan", help="result file name in benchmarks/results (default: %(default)s)")
    args = parser.parse_args()

    from kvcal.adapters import query_heads
    from kvcal.bundle import load_bundle
    from kvcal.runtime.backends import bundle_plan

    started = provenance()
    bundles = ensure_bundles(args.bundles, args.recipes.split(","), args.profile)
    result, lines = {}, []
    for device in ("cuda", "cpu"):
        where = "a CUDA GPU with CuPy" if device == "cuda" else "this machine's CPU"
        lines += [f"## On {where}", "", "| recipe | " + " | ".join(title for _, title in PARTS) + " |",
                  "|---|" + "---|" * len(PARTS)]
        notes = []
        for recipe, path in bundles.items():
            bundle = load_bundle(path)
            plans = bundle_plan(bundle, device)
            summary = summarize(plans)
            result.setdefault(recipe, {})[device] = {"parts": summary, "why": reasons(plans)}
            lines.append(f"| {recipe} | " + " | ".join(_cell(summary[field], len(plans)) for field, _ in PARTS) + " |")
            notes += [f"- {recipe}, {note}" for note in reasons(plans)]
        lines += ["", *notes, ""]
    model = load_bundle(next(iter(bundles.values()))).fingerprint
    header = [f"# What serves a decode step, per recipe ({model['architecture']}: {model['num_layers']} layers, "
              f"{' or '.join(map(str, sorted(set(query_heads(model)))))} heads over {model['num_kv_heads']} KV heads of "
              f"{model['head_dim']})", "",
              f"Commit {started['commit']}, {started['date']}. From `python -m benchmarks.kernels plan` (kvcal.runtime.backends: "
              "the planner the runtime binds at a layer's first decode step; no kernel ran). Servers: tensor-core (one "
              "launch of the tensor-core kernel per layer and step), cpu-kernel, reference (the torch reference: every token "
              "dequantized every step); "
              "appends: cuda-append, cpu-append, torch codec; '-': the layer has no fp16 segment. 'x N': N layers of the "
              "model's.", ""]
    write_result(args.name, {"model": model, "recipes": result}, started)
    write_markdown(args.name, header + lines)
