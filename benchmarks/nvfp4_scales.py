"""What a calibrated global scale would buy vLLM's nvfp4 KV cache: per layer, the Fisher-weighted error of nvfp4 keys
and values (kvcal plan's cost: kvcal.plan.key_cost / value_cost on the profile's sampled tokens, keys after RoPE) at
vLLM's default k_scale / v_scale 1.0, at ModelOpt's absmax / (6 * 448) (absmax over every token the profile saw), and
at the best multiple 0.5-2.0 of that on the same samples (in-sample: an upper bound on what a search would keep).

nvfp4's e4m3 block scales carry each 16-channel block's own magnitude, so the global scale only moves them on the e4m3
grid and out of its subnormal range; this measures how much that is worth before kvcal ships such scales.

Usage: python -m benchmarks.nvfp4_scales --profile P [--profile P ...] [--dtype nvfp4|nvfp4_4over6]
Writes benchmarks/results/nvfp4_scales.{json,md}.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.common import provenance, write_markdown, write_result

MULTIPLES = (1.0, *(round(0.5 + 0.05 * i, 2) for i in range(31) if i != 10))  # 1.0 first: ties keep absmax / 2688


def layer_costs(profile: dict, config: dict, layer: int, four_over_six: bool) -> dict:
    """{"k"|"v": {"unit", "absmax", "best": costs; "best_multiple"; "absmax_scale": absmax / 2688}} for one layer."""
    from kvcal.plan import key_cost, value_cost
    from kvcal.quantizers import E2M1_MAGNITUDES
    from kvcal.vllm_codecs import FP8_MAX, Nvfp4

    fingerprint = config["model"]["fingerprint"]
    head_dim, kv_heads = fingerprint["head_dim"], fingerprint["num_kv_heads"]
    out = {}
    for side, absmax_name in (("k", "k_post.absmax"), ("v", "v.absmax")):
        def cost(k_scale: float) -> float:
            codec = Nvfp4(head_dim, four_over_six, k_scale)
            return key_cost(profile, config, layer, codec, kv_heads) if side == "k" else value_cost(profile, layer, codec)
        absmax_scale = float(profile[f"layers.{layer}.{absmax_name}"].max()) / (E2M1_MAGNITUDES[-1] * FP8_MAX)
        searched = [(cost(absmax_scale * m), m) for m in MULTIPLES]
        best, multiple = min(searched, key=lambda pair: pair[0])  # the first of equal costs: 1.0 where it ties
        out[side] = {"unit": cost(1.0), "absmax": searched[0][0], "best": best, "best_multiple": multiple,
                     "absmax_scale": absmax_scale}
    return out


def measure(path: Path, dtype: str) -> dict:
    from kvcal.artifacts import read_artifact

    profile, config = read_artifact(str(path), "profile")
    layers = config["model"]["fingerprint"]["num_layers"]
    rows = []
    with torch.inference_mode():
        for layer in range(layers):
            rows.append({"layer": layer, **layer_costs(profile, config, layer, dtype == "nvfp4_4over6")})
            print(f"{path.name} layer {layer + 1}/{layers}", flush=True)
    return {"profile": str(path), "model": config["model"]["spec"], "rows": rows}


def _change(new: float, old: float) -> str:
    return f"{100 * (new / old - 1):+.1f}%" if old else "-"


def markdown(result: dict) -> list[str]:
    lines = [f"# A calibrated global scale for vLLM's {result['dtype']} KV cache", "",
             f"`python -m benchmarks.nvfp4_scales` at commit {result['commit']}, {result['date']}. Per layer, the "
             "Fisher-weighted error of nvfp4 keys (after RoPE) and values on the profile's sampled tokens (kvcal plan's "
             "cost) at k_scale / v_scale 1.0 (vLLM's default), at absmax / (6 x 448) (ModelOpt's), and at the best "
             "multiple 0.5-2.0 of it on the same samples (in-sample: the most a search could keep); changes against 1.0.", ""]
    for model in result["models"]:
        rows = model["rows"]
        total = {side: {kind: sum(r[side][kind] for r in rows) for kind in ("unit", "absmax", "best")} for side in ("k", "v")}
        lines += [f"## {model['model']} ({Path(model['profile']).name})", "",
                  "| layer | K at 1.0 | K absmax | K best (x) | V at 1.0 | V absmax | V best (x) |", "|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['layer']} | " + " | ".join(
                f"{r[s]['unit']:.4g} | {_change(r[s]['absmax'], r[s]['unit'])} | {_change(r[s]['best'], r[s]['unit'])} "
                f"({r[s]['best_multiple']:g})" for s in ("k", "v")) + " |")
        lines.append("| all layers | " + " | ".join(
            f"{total[s]['unit']:.4g} | {_change(total[s]['absmax'], total[s]['unit'])} | {_change(total[s]['best'], total[s]['unit'])}"
            for s in ("k", "v")) + " |")
        lines.append("")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.nvfp4_scales", description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", type=Path, action="append", required=True,
                        help="a kvcal profile (kvcal profile-gradients); repeat for several models")
    parser.add_argument("--dtype", default="nvfp4", choices=("nvfp4", "nvfp4_4over6"), help="vLLM's cache dtype (default: %(default)s)")
    parser.add_argument("--name", default="nvfp4_scales", help="result file name in benchmarks/results (default: %(default)s)")
    args = parser.parse_args(argv)
    for path in args.profile:
        if not path.is_file():
            parser.error(f"--profile {path}: no such file; make one with kvcal profile-gradients")
    started = provenance()
    result = {"dtype": args.dtype, "models": [measure(path, args.dtype) for path in args.profile]}
    write_result(args.name, result, started)
    write_markdown(args.name, markdown({**started, **result}))


if __name__ == "__main__":
    main()
