"""The main job as a library call: profile -> fit -> bundle (`kvcal calibrate`), and a bundle from a profile
and a fitted artifact (`kvcal export bundle`). Methods come from the registry (kvcal.registry)."""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Protocol

from kvcal import registry
from kvcal.adapters import adapt, index_widths, kv_widths
from kvcal.artifacts import check_same_model, check_writable, read_artifact, read_header, write_artifact
from kvcal.bundle import PACKING, write_bundle
from kvcal.capture import CaptureSettings
from kvcal.errors import KvcalError
from kvcal.indexer_keys import FORMATS as INDEXER_KEY_FORMATS
from kvcal.models import load_model_structure, resolve_model
from kvcal.profile import PROFILE_KIND, KvmixSettings, ProfileRequest, run_profile


class Progress(Protocol):
    """Where long work reports itself: a stage begins (with its number of steps, or None), a step ends."""

    def stage(self, label: str, total: int | None) -> None: ...

    def advance(self) -> None: ...


class _Silent:
    def stage(self, label: str, total: int | None) -> None:
        pass

    def advance(self) -> None:
        pass


def build_bundle(profile_path: str, recipe: str, fitted_path: str | None = None, settings=None,
                 indexer_keys: str = "model") -> tuple[dict, dict]:
    """(tensors, config) of a bundle for `recipe` from a profile, the fitted artifact the recipe needs (if
    any) and the recipe's settings (if it has any that are not in the artifact); indexer_keys: how its cache keeps a
    sparse model's indexer keys (kvcal.indexer_keys.FORMATS)."""
    spec = registry.recipe(recipe)
    check_indexer_keys(indexer_keys)
    profile, profile_config = read_artifact(profile_path, PROFILE_KIND)
    if indexer_keys != "model" and not any(index_widths(profile_config["model"]["fingerprint"])):
        raise KvcalError(f"--indexer-keys {indexer_keys}: the profile's model keeps no indexer keys (no sparse attention "
                         "layer); leave the option out")
    fitted = None
    if spec.artifact_kind is not None:
        if fitted_path is None:
            raise KvcalError(f"recipe {recipe} needs --{spec.artifact_kind} (from {spec.fit_command})")
        fitted = read_artifact(fitted_path, spec.artifact_kind)
        check_same_model(fitted[1]["model"]["fingerprint"], profile_config["model"]["fingerprint"], f"'{fitted_path}'",
                         "the profile's model", "fit it from this profile")
        fitted_from = fitted[1].get("calibration", profile_config["calibration"])  # (its profile's, as that was made)
        if fitted_from != profile_config["calibration"]:
            raise KvcalError(f"'{fitted_path}' was fitted from another profile than '{profile_path}' (calibration "
                             f"{_differences(fitted_from, profile_config['calibration'])}); fit it from this profile")
    layers, source = spec.bundle_layers(profile, profile_config, fitted, settings)
    recorded = spec.bundle_settings(profile_config, fitted, settings)
    widths = {kind: kv_widths(profile_config["model"]["fingerprint"], kind) for kind in "kv"}
    tensors = {"rope.inv_freq": profile["rope.inv_freq"]}
    for i, layer in enumerate(layers):
        for kind in ("k", "v"):
            tensors[f"layers.{i}.importance.{kind}"] = profile[f"importance.{kind}"][i : i + 1].clone()
            for field in layer.format.tensor_schema(layer, kind, widths[kind][i]):
                tensors[f"layers.{i}.{kind}.{field}"] = source[f"layers.{i}.{kind}.{field}"]
    config = {"model": profile_config["model"], "rope": profile_config["rope"], "calibration": profile_config["calibration"],
              "recipe": {"name": recipe, "packing": PACKING, "layers": [asdict(layer) for layer in layers]}}
    if recorded is not None:
        config["recipe"]["settings"] = registry.settings_metadata(spec, recorded)
    if indexer_keys != "model":  # (absent: as computed, which bundles before the option keep)
        config["recipe"]["indexer_keys"] = indexer_keys
    return tensors, config


def check_indexer_keys(indexer_keys: str) -> None:
    if indexer_keys not in INDEXER_KEY_FORMATS:
        raise KvcalError(f"--indexer-keys '{indexer_keys}' is not one of {', '.join(INDEXER_KEY_FORMATS)}")


# the settings a profile is made with (ProfileRequest's), before the counts that follow from them and the text
_CALIBRATION_SETTINGS = ("dataset", "nsamples", "seqlen", "seed", "sink", "max_tokens_per_layer", "store_windows")


def _differences(fitted: dict, profile: dict) -> str:
    """Where two profiles' calibration records differ: "seqlen 64, not 128" (the fitted artifact's first), its settings
    where they differ, else what differs (the text they read)."""
    differ = [key for key in sorted({*fitted, *profile}) if fitted.get(key) != profile.get(key)]
    named = [key for key in _CALIBRATION_SETTINGS if key in differ] or differ
    return ", ".join(f"{key} {fitted.get(key)!r}, not {profile.get(key)!r}" for key in named)


def _calibrate_settings(spec: registry.MethodSpec, bits):
    """The recipe's validated settings for `--bits` (None: its default), refused before anything runs; a refusal
    caused by --bits says so, whatever option name the recipe's own settings use."""
    if isinstance(bits, float) and bits.is_integer():
        bits = int(bits)  # a code width; recipes that take a budget of real bits accept an int too
    try:
        settings = spec.calibrate_settings(bits)
        if settings is not None:
            settings.validate()
    except KvcalError as exc:
        if bits is None or "--bits" in str(exc):
            raise
        raise KvcalError(f"--bits {bits} does not fit recipe {spec.name}: {exc}") from None
    return settings


def profile(request: ProfileRequest, out: str | Path | None, progress: Progress, label: str = "profile") -> tuple[Path, dict, dict]:
    """run_profile reporting two stages: loading the model and text, then one step per window."""
    progress.stage(f"{label}: loading model and text", None)
    return run_profile(request, out, on_start=lambda total: progress.stage(f"{label}: window", total),
                       on_window=lambda window: progress.advance())


def artifacts_beside(out: Path, recipe: str) -> dict[str, Path]:
    """What `calibrate` writes beside the bundle `out`, by kind: the profile, and the recipe's fitted artifact."""
    kind = registry.recipe(recipe).artifact_kind
    return {"profile": out.with_name("profile.safetensors"), **({kind: out.with_name(f"{kind}.safetensors")} if kind else {})}


def calibrate(model: str | None = None, *, dataset: str = "builtin", recipe: str = "kvquant", out: str | Path | None = None,
              bits: float | None = None, nsamples: int = 16, seqlen: int = 512, seed: int = 0, dtype: str = "auto",
              device: str = "cpu", indexer_keys: str = "model", progress: Progress | None = None) -> Path:
    """Profile `model` (a hub id, local directory or .gguf; None = the packaged SmolLM2) on `dataset`, fit
    `recipe` and write its bundle to `out` (default artifacts/<model>/bundle.safetensors), the profile and
    the fitted artifact beside it. `bits`: the code width for recipes that take one (kvquant, skvq, kivi), or
    mixed's budget of real bits per element; indexer_keys: as build_bundle's.
    Every setting and output path is checked before the model is loaded. Returns the bundle's path."""
    spec = registry.recipe(recipe)
    _calibrate_settings(spec, bits)  # refused before the model is loaded
    check_indexer_keys(indexer_keys)
    if indexer_keys != "model" and not any(adapt(load_model_structure(model)[0]).index_widths):
        raise KvcalError(f"--indexer-keys {indexer_keys}: {resolve_model(model).spec} keeps no indexer keys (no sparse "
                         "attention layer); leave the option out")
    progress = progress or _Silent()
    inputs = [dataset, model]  # a text file or .gguf given as --dataset / --model must not be written over
    out = check_writable(out or Path("artifacts") / resolve_model(model).name / "bundle.safetensors", inputs=inputs)
    beside = artifacts_beside(out, recipe)
    # over an earlier run's artifacts, the profile waits beside them until the fit succeeds: a fit refused after
    # profiling (a budget below what the model's widths store, known only then) leaves them as they were
    earlier = any(path.exists() for path in (out, *beside.values()))
    staged = beside["profile"].with_name("profile.new.safetensors") if earlier else beside["profile"]
    for kind, path in {**beside, "new profile": staged}.items():
        if path.name == out.name:
            raise KvcalError(f"--out '{out}' is where the {kind} is written beside the bundle; name the bundle otherwise "
                             "(e.g. bundle.safetensors)")
        check_writable(path, inputs=inputs)
    request = ProfileRequest(model=model, dataset=dataset, nsamples=nsamples, seqlen=seqlen, seed=seed, dtype=dtype, device=device,
                             capture=CaptureSettings(sink=1, seed=seed), kvmix=KvmixSettings())
    request.validate()
    profile_path, _, _ = profile(request, staged, progress, "1/3 profile")
    try:
        bundle = fit_bundle(profile_path, recipe, out, bits, progress, ("2/3", "3/3"), indexer_keys)
    except KvcalError as exc:  # (a fit's refusal names its command's options, which calibrate does not take)
        kept = f"the profile is kept: {profile_path}" + ("; the earlier artifacts beside it are as they were" if earlier else "")
        how = f"; fit it with kvcal fit-{spec.artifact_kind} and that option, then kvcal export bundle" if spec.artifact_kind else ""
        raise KvcalError(f"{exc} ({kept}{how})") from None
    if earlier:
        os.replace(staged, beside["profile"])
    return bundle


def fit_bundle(profile_path: str | Path, recipe: str, out: str | Path, bits: float | None = None,
               progress: Progress | None = None, steps: tuple[str, str] = ("1/2", "2/2"), indexer_keys: str = "model") -> Path:
    """Fit `recipe` from a profile (if it is calibrated) and write its bundle to `out`, the fitted artifact beside it
    as <kind>.safetensors (what `kvcal calibrate` does after profiling). Returns the bundle's path."""
    spec = registry.recipe(recipe)
    settings = _calibrate_settings(spec, bits)
    progress = progress or _Silent()
    out = Path(out)
    if spec.artifact_kind is not None:
        layers = read_header(profile_path)[1]["model"]["fingerprint"]["num_layers"]
        progress.stage(f"{steps[0]} fit {spec.artifact_kind}", layers)
        tensors, config = spec.fit(str(profile_path), settings, on_layer=lambda layer: progress.advance())
        write_artifact(artifacts_beside(out, recipe)[spec.artifact_kind], tensors, spec.artifact_kind, config)
    progress.stage(f"{steps[1]} export bundle", None)
    return _export(profile_path, recipe, out, settings, indexer_keys)


def export_fitted(profile_path: str | Path, recipe: str, out: str | Path, indexer_keys: str = "model") -> Path:
    """Write `recipe`'s bundle to `out` from a profile and the fitted artifact fit_bundle wrote into out's folder,
    without fitting again: one fit serves bundles that differ in their indexer keys alone. The bundle takes that fit's
    settings, which it records (a recipe that fits nothing: its defaults, as fit_bundle's without `bits`)."""
    return _export(profile_path, recipe, out, _calibrate_settings(registry.recipe(recipe), None), indexer_keys)


def _export(profile_path: str | Path, recipe: str, out: str | Path, settings, indexer_keys: str) -> Path:
    kind = registry.recipe(recipe).artifact_kind
    fitted = str(artifacts_beside(Path(out), recipe)[kind]) if kind is not None else None
    return write_bundle(out, *build_bundle(str(profile_path), recipe, fitted, settings, indexer_keys))
