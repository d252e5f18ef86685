"""Bundles of the tiny models (helpers.tiny_models) for tests: in-memory KIVI bundles, which need no calibration, and
the command line's profile, the fits and bundles of every recipe, written into a test's folder."""

from __future__ import annotations

from pathlib import Path

import torch

from helpers.tiny_models import tiny_model


def kivi_bundle(model, bits: int, group: int, residual: int, indexer_keys: str = "model"):
    """An in-memory KIVI bundle for `model` (no calibration): bits-bit codes, key blocks of `group` tokens and value
    groups of `group` channels, an fp16 residual of `residual` tokens, in every layer; sparse layers' indexer keys kept
    in format `indexer_keys` (kvcal.indexer_keys)."""
    from kvcal.adapters import adapt
    from kvcal.bundle import Bundle, LayerRecipe

    adapter = adapt(model)
    layers = [LayerRecipe("uniform", bits, bits, False, group_size=group, residual=residual) for _ in adapter.layers]
    return Bundle(Path(f"kivi-{adapter.model_type}"), "kivi", layers, {}, {"model": {"fingerprint": adapter.fingerprint()},
                                                                          "recipe": {"indexer_keys": indexer_keys}})


def fp16_kivi_bundle(model, residual: int = 256, indexer_keys: str = "model"):
    """An in-memory bundle for `model` that stores every token fp16: 4-bit KIVI (G = 16) whose fp16 residual
    of `residual` tokens is longer than anything a test feeds. KIVI moves keys to the quantized body in whole
    blocks of the residual and values out of an fp16 FIFO of the residual, so below `residual` tokens nothing
    is quantized: the cache is an identity quantizer up to fp16 rounding of K/V, and the runtime must give the
    fp model's tokens."""
    return kivi_bundle(model, 4, 16, residual, indexer_keys)


def windowed_short_steps(model_type: str, window: int):
    """(model, bundle, ids, mask, steps) of the tests of short steps past a window: a tiny model at head_dim 64 whose
    first layer slides over `window` tokens (Llama 4: chunks of them), KIVI's int4 in blocks of 32 with an fp16
    residual of 32, two 114-token prompts (the second left-padded by 17 columns) fed as a 100-token prefill, then steps
    of 1, 4, 1, 7 and 1 tokens."""
    span = "attention_chunk_size" if model_type == "llama4_text" else "sliding_window"
    model = tiny_model(model_type, head_dim=64, **{span: window})
    ids = torch.randint(3, 512, (2, 114), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :17] = 0
    return model, kivi_bundle(model, 4, 32, 32), ids, mask, [100, 1, 4, 1, 7, 1]


def profile_tiny_model(model_dir: Path, corpus: Path, out: Path) -> Path:
    """`kvcal profile-gradients` of a tiny model on a slice of the builtin corpus (4 x 64 tokens), written to `out`."""
    from typer.testing import CliRunner

    from kvcal.cli import app

    result = CliRunner().invoke(app, ["profile-gradients", "--model", str(model_dir), "--dataset", str(corpus),
                                      "--nsamples", "4", "--seqlen", "64", "--max-tokens-per-layer", "200", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


def fit_tiny_artifacts(profile: Path, folder: Path, latent: bool = False) -> dict[str, Path]:
    """Fitted nuq (fixed 3 bits, Fisher-knapsack widths, KVmix widths) and SKVQ artifacts of a tiny profile (of an MLA
    model, `latent`: SKVQ's without its clip search, which takes no MLA profile)."""
    from kvcal.fit.nuq import NuqSettings, fit_nuq, write_nuq
    from kvcal.fit.skvq import SkvqSettings, fit_skvq, write_skvq

    return {
        "nuq": write_nuq(folder / "nuq.safetensors", *fit_nuq(str(profile), NuqSettings(bits=3))),
        # the tiny model's 32-channel rows pay ~1.6 bits of per-token thresholds and outliers on top of the codes
        "nuq-fisher": write_nuq(folder / "mixed.safetensors", *fit_nuq(str(profile), NuqSettings(target_bits=4.6))),
        "nuq-kvmix": write_nuq(folder / "kvmix-widths.safetensors", *fit_nuq(str(profile), NuqSettings(bits_from_profile=True))),
        "skvq": write_skvq(folder / "skvq.safetensors", *fit_skvq(str(profile), SkvqSettings(
            group_size=16, window=8, sink=2, **({"clip": "none"} if latent else {})))),
    }


def bundles_of_every_recipe(profile: Path, fitted: dict[str, Path], folder: Path) -> dict[str, Path]:
    """A bundle of every recipe from a tiny profile and its fitted artifacts (KIVI with G = 4, R = 8 so short tests
    cross blocks)."""
    from kvcal import registry
    from kvcal.bundle import write_bundle
    from kvcal.calibration import build_bundle
    from kvcal.methods.kivi import KiviSettings

    artifacts = {"kvquant": (str(fitted["nuq"]), None), "mixed": (str(fitted["nuq-fisher"]), None), "skvq": (str(fitted["skvq"]), None),
                 "kivi": (None, KiviSettings(group=4, residual=8)), "kvmix": (None, None)}
    return {recipe: write_bundle(folder / f"{recipe}.safetensors", *build_bundle(str(profile), recipe, *artifacts[recipe]))
            for recipe in registry.recipes()}


def every_recipe(model_dir: Path, corpus: Path, folder: Path, latent: bool = False) -> tuple[dict[str, Path], dict[str, Path]]:
    """(fitted artifacts, a bundle of every recipe) of the tiny model saved at `model_dir`, from its own profile, all
    written into `folder` (`latent`: fit_tiny_artifacts')."""
    profile = profile_tiny_model(model_dir, corpus, folder / "profile.safetensors")
    fitted = fit_tiny_artifacts(profile, folder, latent)
    return fitted, bundles_of_every_recipe(profile, fitted, folder)


def kvquant_bundle(profile: Path, folder: Path, name: str = "kvquant", **nuq_settings) -> Path:
    """A kvquant bundle `name` of a tiny profile, its codebooks fitted with these NuqSettings (the default recipe's:
    nuq3, 1% outliers, pre-RoPE keys), both written into `folder`."""
    from kvcal.bundle import write_bundle
    from kvcal.calibration import build_bundle
    from kvcal.fit.nuq import NuqSettings, fit_nuq, write_nuq

    nuq = write_nuq(folder / f"{name}-nuq.safetensors", *fit_nuq(str(profile), NuqSettings(**nuq_settings)))
    return write_bundle(folder / f"{name}.safetensors", *build_bundle(str(profile), "kvquant", str(nuq), None))
