"""Helpers shared by the benchmark scripts: provenance of a result, writing it as JSON, the recipes' bundles, and
calls timed in turn."""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
# KVCAL_RESULTS_DIR moves the results elsewhere (the GPU campaign writes into its own output folder)
RESULTS = Path(os.environ.get("KVCAL_RESULTS_DIR") or REPO / "benchmarks" / "results")


def provenance() -> dict:
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", "kvcal"], cwd=REPO, capture_output=True, text=True).stdout.strip())
    # a copy without .git (e.g. `git archive` on a GPU machine) names its commit in KVCAL_COMMIT
    return {
        "commit": os.environ.get("KVCAL_COMMIT") or commit + ("+dirty" if dirty else ""),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def device_slug(device: str) -> str:
    """A device name as a file-name part: 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^A-Za-z0-9]+", "-", device).strip("-").lower()


def write_result(name: str, result: dict, started_with: dict | None = None) -> Path:
    """Write a result with the provenance taken when the run started (code can change while it runs)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({**(started_with or provenance()), **result}, indent=2) + "\n")
    return path


def write_markdown(name: str, lines: list[str]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.md"
    path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return path


def ensure_bundles(folder: Path, recipes: list[str], profile: Path | None, model: str | None = None) -> dict[str, Path]:
    """{recipe: folder/<recipe>.safetensors}, making the missing ones: fit from `profile` (whose model they serve), or
    else calibrated on `model` (None: the packaged SmolLM2) and its built-in text, the profile written to
    folder/profile.safetensors and fit from thereafter."""
    from kvcal.calibration import calibrate, fit_bundle

    folder.mkdir(parents=True, exist_ok=True)
    profile = profile or folder / "profile.safetensors"
    paths = {}
    for recipe in recipes:
        out = folder / f"{recipe}.safetensors"
        if not out.exists():
            began = time.perf_counter()
            if not profile.exists():
                calibrate(model, recipe=recipe, out=out)
            else:
                fit_bundle(profile, recipe, out)
            print(f"made {out} in {time.perf_counter() - began:.0f} s", flush=True)
        paths[recipe] = out
    return paths


def kivi2_bundle(model):
    """An in-memory 2-bit KIVI bundle for `model` (G = 32, an fp16 residual of 128: no calibration), named kivi2-g32."""
    from kvcal.adapters import adapt
    from kvcal.bundle import Bundle, LayerRecipe

    adapter = adapt(model)
    return Bundle(Path("kivi2-g32"), "kivi", [LayerRecipe("uniform", 2, 2, False, group_size=32, residual=128)
                                             for _ in adapter.layers], {}, {"model": {"fingerprint": adapter.fingerprint()}})


def timed_in_turn(calls: dict[str, Callable[[], object]], rounds: int) -> tuple[dict, dict[str, float]]:
    """Each call once, untimed (a build made, pages touched), then all of them in turn `rounds` times, so that a slow
    spell of the machine falls on each alike: (each call's output, its median ms)."""
    outputs = {name: call() for name, call in calls.items()}
    seconds = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            began = time.perf_counter()
            call()
            seconds[name].append(time.perf_counter() - began)
    return outputs, {name: statistics.median(spent) * 1e3 for name, spent in seconds.items()}
