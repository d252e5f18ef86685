"""Per-layer widths on SmolLM2-135M: the Fisher knapsack of `kvcal fit-nuq --target-bits` against the KVmix
allocation (`--bits-from-profile`) and one width for every layer (nuq2, nuq3), all with KVQuant codebooks and
1% outliers, at the real bits the runtime stores. Calibrated on wikitext-2 valid (16 x 512, the default
profile), perplexity on wikitext-2 test (seqlen 512, 40 windows) in one `kvcal eval ppl` run.

Usage: python benchmarks/bench_mixed_widths.py [--targets 2.6 3.3] [--windows 40]
Writes benchmarks/results/mixed_widths.{json,md}; the profile and artifacts go to artifacts/bench/mixed/.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, SHARED, provenance, write_markdown, write_result  # noqa: E402

WORK = REPO / "artifacts" / "bench" / "mixed"


def kvcal(*args) -> None:
    subprocess.run([sys.executable, "-m", "kvcal", *map(str, args)], cwd=REPO, check=True, stdout=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", type=float, nargs="+", default=[2.6, 3.3], help="--target-bits of the knapsack fits")
    parser.add_argument("--windows", type=int, default=40, help="wikitext-2 test windows of 512 tokens")
    args = parser.parse_args()
    started = provenance()
    WORK.mkdir(parents=True, exist_ok=True)
    profile = WORK / "profile.safetensors"
    if not profile.exists():
        kvcal("profile-gradients", "--dataset", SHARED / "data/wikitext-2/valid.txt", "--out", profile)
    fits = {"nuq2": ["--bits", 2], "nuq3": ["--bits", 3], "kvmix widths": ["--bits-from-profile"]}
    fits |= {f"knapsack {target:g}": ["--target-bits", target] for target in args.targets}
    seconds = {}
    for label, options in fits.items():
        began = time.perf_counter()
        kvcal("fit-nuq", profile, *options, "--out", WORK / f"{label.replace(' ', '-')}.safetensors")
        seconds[label] = round(time.perf_counter() - began, 1)
    report = WORK / "ppl.json"
    quants = [item for label in fits for item in ("--quant", WORK / f"{label.replace(' ', '-')}.safetensors")]
    kvcal("eval", "ppl", "--dataset", SHARED / "data/wikitext-2/test.txt", "--windows", args.windows, *quants, "--json", report)
    rows = json.loads(report.read_text())["results"]
    for row, label in zip(rows[1:], fits):
        row["widths"] = label
    lines = [f"# Per-layer widths on KVQuant codebooks (commit {started['commit']}, {started['date']})", "",
             f"SmolLM2-135M-Instruct, profile on wikitext-2 valid (16 x 512), perplexity on wikitext-2 test ({args.windows} x 512); "
             "effective bits = what the runtime stores per element (kvcal.runtime.memory), fp16 sink included.", "",
             "| widths | artifact | effective bits | K bits | V bits | ppl | vs fp | fit s |", "|---|---|---|---|---|---|---|---|"]
    lines.append(f"| fp16 | - | 16 | 16 | 16 | {rows[0]['ppl']:.4f} | - | - |")
    for row in rows[1:]:
        lines.append(f"| {row['widths']} | {row['method']} | {row['effective_bits']:.3f} | {row['key_bits']:.3f} | {row['value_bits']:.3f} "
                     f"| {row['ppl']:.4f} | {row['delta_pct']:+.2f}% | {seconds[row['widths']]} |")
    write_result("mixed_widths", {"windows": args.windows, "targets": args.targets, "fit_seconds": seconds, "results": rows}, started)
    write_markdown("mixed_widths", lines)


if __name__ == "__main__":
    main()
