"""Shared fixtures: a tiny byte-level BPE tokenizer trained on Python's own docs, tiny models saved as a user's model
folder, their profiles and bundles of every recipe (made once a session), the shared data; and the marks that make a
test slow. The tiny models and bundles themselves are built by tests/helpers (tiny_models, tiny_bundles)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from helpers import WIKITEXT_VALID
from helpers.tiny_bundles import bundles_of_every_recipe, every_recipe, fit_tiny_artifacts, kvquant_bundle, profile_tiny_model
from helpers.tiny_models import HEAD_DIM_256, LATENT, PHI4_MINI, TINY_VOCAB, longrope, tiny_model

SLOW_KINDS = ("model", "emulation", "nvrtc")  # marks that make a test slow as well (pyproject.toml's markers)


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # `-n auto`: as many workers as cores, so each computes on one thread
        torch.set_num_threads(1)


def pytest_collection_modifyitems(items):
    for item in items:
        if any(item.get_closest_marker(kind) for kind in SLOW_KINDS):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(params=["cpu-kernel", "torch-reference"])
def decode_path(request, monkeypatch):
    """Runs a test on each CPU decode path of the runtime cache: the compiled kernel (kvcal.runtime.cpu_kernel),
    and the torch reference that serves where the kernel cannot be built."""
    from kvcal.runtime import cpu_kernel

    if request.param == "torch-reference":
        monkeypatch.setattr(cpu_kernel, "library", lambda: None)
    else:
        assert cpu_kernel.library() is not None, "the CPU kernel did not compile (see the warning)"
    return request.param


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from kvcal.data import builtin_text

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator([builtin_text()[:200_000]], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer):
    """Save a tiny model plus tokenizer to disk, as a user's local model directory would be."""

    def make(model_type: str, max_positions: int = 256, **overrides) -> Path:
        path = tmp_path_factory.mktemp(f"tiny-{model_type}")
        # (a causal LM that transformers cannot load back from its own checkpoint: its composite's, as released)
        saved = {"mllama_text_model": "mllama", "emu3_text_model": "emu3"}.get(model_type, model_type)
        tiny_model(saved, max_positions=max_positions, **overrides).save_pretrained(path)
        tiny_tokenizer.save_pretrained(path)
        return path

    return make


@pytest.fixture
def hub_endpoint(monkeypatch):
    """point_at(url): huggingface_hub's and datasets' endpoint set to `url`, their offline mode off."""
    import datasets
    from huggingface_hub import constants

    def point_at(url: str) -> None:
        monkeypatch.setattr(constants, "ENDPOINT", url)
        monkeypatch.setattr(datasets.config, "HF_ENDPOINT", url)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)

    return point_at


@pytest.fixture
def wikitext_valid() -> Path:
    if not WIKITEXT_VALID.is_file():
        pytest.fail(f"shared data missing: {WIKITEXT_VALID} (tests expect ../shared beside the checkout)")
    return WIKITEXT_VALID


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    from kvcal.data import builtin_text

    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text(builtin_text()[:60_000])
    return path


@pytest.fixture(scope="session")
def tiny_profile(tmp_path_factory, tiny_model_dir, tiny_corpus):
    """(model directory, profile path) of a tiny Llama profiled on a slice of the builtin corpus."""
    model = tiny_model_dir("llama")
    return model, profile_tiny_model(model, tiny_corpus, tmp_path_factory.mktemp("profile") / "profile.safetensors")


@pytest.fixture(scope="session")
def fitted(tiny_profile, tmp_path_factory):
    """Fitted nuq and SKVQ artifacts of the tiny Llama's profile (fit_tiny_artifacts)."""
    return fit_tiny_artifacts(tiny_profile[1], tmp_path_factory.mktemp("fitted"))


@pytest.fixture(scope="session")
def recipe_bundles(tiny_profile, fitted, tmp_path_factory):
    """A bundle of every recipe for the tiny Llama."""
    return bundles_of_every_recipe(tiny_profile[1], fitted, tmp_path_factory.mktemp("bundles"))


@pytest.fixture(scope="session")
def gemma3_profile(tmp_path_factory, tiny_model_dir, tiny_corpus) -> Path:
    """A profile of the tiny Gemma 3 (a sliding-window layer and a full one, each with its own RoPE frequencies)."""
    model = tiny_model_dir("gemma3_text")
    return profile_tiny_model(model, tiny_corpus, tmp_path_factory.mktemp("gemma3-profile") / "profile.safetensors")


@pytest.fixture(scope="session")
def gemma3_bundles(tmp_path_factory, gemma3_profile):
    """A bundle of every recipe for the tiny Gemma 3, from its own profile."""
    profile = gemma3_profile
    fitted = fit_tiny_artifacts(profile, tmp_path_factory.mktemp("gemma3-fitted"))
    return bundles_of_every_recipe(profile, fitted, tmp_path_factory.mktemp("gemma3-bundles"))


@pytest.fixture(scope="session")
def architecture_bundles(tmp_path_factory, tiny_model_dir, tiny_corpus):
    """bundles(model_type): a bundle of every recipe for the tiny model of that architecture, from its own profile
    (made on first use, once per session)."""
    made = {}

    def bundles(model_type: str) -> dict[str, Path]:
        if model_type not in made:
            folder = tmp_path_factory.mktemp(f"{model_type}-bundles")
            made[model_type] = every_recipe(tiny_model_dir(model_type), tiny_corpus, folder, model_type in LATENT)[1]
        return made[model_type]

    return bundles


@pytest.fixture(scope="session")
def longrope_bundles(tmp_path_factory, tiny_model_dir, tiny_corpus):
    """bundles(partial, model_type): a bundle of every recipe for the tiny Phi-3 (or PhiMoE) with LongRoPE switching
    at 16 tokens over `partial` of each head (longrope(16, partial, model_type=...)), from its own profile (64-token
    windows: rotated by its long frequencies; made on first use, once per session)."""
    made = {}

    def bundles(partial: float, model_type: str = "phi3") -> dict[str, Path]:
        if (model_type, partial) not in made:
            folder = tmp_path_factory.mktemp(f"longrope-{model_type}-bundles")
            model = tiny_model_dir(model_type, **longrope(16, partial, model_type=model_type))
            profile = profile_tiny_model(model, tiny_corpus, folder / "profile.safetensors")
            made[model_type, partial] = bundles_of_every_recipe(profile, fit_tiny_artifacts(profile, folder), folder)
        return made[model_type, partial]

    return bundles


@pytest.fixture(scope="session")
def wide_nuq_bundles(tiny_profile, tmp_path_factory):
    """kvquant bundles of the tiny Llama with 5-8-bit codes (planes5-7 and 8-bit lsb words), by code width."""
    _, profile = tiny_profile
    folder = tmp_path_factory.mktemp("wide-nuq")
    return {bits: kvquant_bundle(profile, folder, f"kvquant{bits}", bits=bits) for bits in (5, 6, 7, 8)}


@pytest.fixture(scope="session")
def windowed_kvquant_bundle(tiny_profile, tmp_path_factory):
    """A kvquant bundle of the tiny Llama (nuq3, 1% outliers) keeping its 8 most recent tokens fp16."""
    _, profile = tiny_profile
    return kvquant_bundle(profile, tmp_path_factory.mktemp("windowed-nuq"), "kvquant-w8", window=8)


@pytest.fixture(scope="session")
def latent_profile(tmp_path_factory, tiny_model_dir, tiny_corpus):
    """(model folder, profile) of the tiny DeepSeek-V3: MLA, a rotated key of 64 channels beside a latent of 96."""
    model = tiny_model_dir("deepseek_v3")
    return model, profile_tiny_model(model, tiny_corpus, tmp_path_factory.mktemp("latent-profile") / "profile.safetensors")


@pytest.fixture(scope="session")
def head_dim_128_kvquant_bundle(tmp_path_factory, tiny_model_dir, tiny_corpus):
    """The default kvquant recipe (nuq3, 1% outliers, pre-RoPE keys) for a tiny Llama with head_dim 128: planes3 codes
    the tensor-core kernel serves at that head_dim."""
    folder = tmp_path_factory.mktemp("head-dim-128")
    profile = profile_tiny_model(tiny_model_dir("llama", head_dim=128), tiny_corpus, folder / "profile.safetensors")
    return kvquant_bundle(profile, folder)


@pytest.fixture(scope="session")
def qwen3_kvquant_bundle(tmp_path_factory, tiny_model_dir, tiny_corpus):
    """The default kvquant recipe for a tiny Qwen3 at Qwen3's head_dim 128 (keys normalised per head before RoPE)."""
    folder = tmp_path_factory.mktemp("qwen3")
    profile = profile_tiny_model(tiny_model_dir("qwen3", head_dim=128), tiny_corpus, folder / "profile.safetensors")
    return kvquant_bundle(profile, folder)


@pytest.fixture(scope="session")
def phi4_mini_kvquant_bundle(tmp_path_factory, tiny_model_dir, tiny_corpus):
    """The default kvquant recipe for the tiny Phi-4-mini (PHI4_MINI), profiled past its switch."""
    folder = tmp_path_factory.mktemp("phi4-mini")
    profile = profile_tiny_model(tiny_model_dir("phi3", **PHI4_MINI), tiny_corpus, folder / "profile.safetensors")
    return kvquant_bundle(profile, folder)


@pytest.fixture(scope="session")
def head_dim_256_gemma3_bundles(tmp_path_factory, tiny_model_dir, tiny_corpus):
    """Bundles of the tiny Gemma 3 at head_dim 256 (HEAD_DIM_256): the default kvquant recipe (nuq3, 1% outliers,
    pre-RoPE keys), kvquant at 4 bits (nuq4-1%: the tensor-core kernel's 2-stage variant there) and kivi4-g32
    (post-RoPE int4 bodies the tensor-core kernel serves at that head_dim)."""
    from kvcal.bundle import write_bundle
    from kvcal.calibration import build_bundle
    from kvcal.methods.kivi import KiviSettings

    folder = tmp_path_factory.mktemp("head-dim-256")
    profile = profile_tiny_model(tiny_model_dir("gemma3_text", **HEAD_DIM_256), tiny_corpus, folder / "profile.safetensors")
    return {"kvquant": kvquant_bundle(profile, folder), "nuq4-1%": kvquant_bundle(profile, folder, "nuq4-1%", bits=4),
            "kivi4-g32": write_bundle(folder / "kivi4-g32.safetensors",
                                      *build_bundle(str(profile), "kivi", None, KiviSettings(4, 32, 32)))}


@pytest.fixture(scope="session")
def head_dim_64_bundles(tmp_path_factory, tiny_model_dir, tiny_corpus):
    """Bundles of the kernel-backed recipes for a tiny Llama with head_dim 64 (the conftest one has 16); nuq4-0%,
    nuq4-1%, kivi4-g32, kivi2-g32 (KIVI's own 2 bits), kivi3-g32, skvq-k3v1 (3-bit keys, 1-bit values) and
    kvmix-two-widths are bodies the tensor-core kernel serves; kvquant-w8 keeps its 8 newest tokens fp16;
    kvquant-post-rope quantizes post-RoPE keys (KVQuant's ablation) with 1% outliers."""
    from kvcal.bundle import write_bundle
    from kvcal.calibration import build_bundle
    from kvcal.methods.kivi import KiviSettings
    from kvcal.fit.nuq import NuqSettings, fit_nuq, write_nuq
    from kvcal.fit.skvq import SkvqSettings, fit_skvq, write_skvq

    folder = tmp_path_factory.mktemp("head-dim-64")
    profile = profile_tiny_model(tiny_model_dir("llama", head_dim=64), tiny_corpus, folder / "profile.safetensors")
    codebooks = {"kvquant": {}, "kvquant-w8": dict(window=8), "kvquant-post-rope": dict(key_rope="post"),
                 "nuq4-0%": dict(bits=4, outliers=0.0), "nuq4-1%": dict(bits=4)}
    bundles = {name: kvquant_bundle(profile, folder, name, **settings) for name, settings in codebooks.items()}
    mixed = write_nuq(folder / "mixed.safetensors", *fit_nuq(str(profile), NuqSettings(target_bits=3.4)))
    skvq = write_skvq(folder / "skvq.safetensors", *fit_skvq(str(profile), SkvqSettings(group_size=16, window=8, sink=2)))
    skvq31 = write_skvq(folder / "skvq-k3v1.safetensors", *fit_skvq(str(profile), SkvqSettings(3, 1, group_size=16, window=8, sink=2)))
    artifacts = {"skvq": ("skvq", str(skvq), None), "skvq-k3v1": ("skvq", str(skvq31), None),
                 "mixed": ("mixed", str(mixed), None), "kivi": ("kivi", None, KiviSettings(group=4, residual=8)),
                 "kvmix": ("kvmix", None, None),
                 "kivi4-g32": ("kivi", None, KiviSettings(4, 32, 32)), "kivi2-g32": ("kivi", None, KiviSettings(2, 32, 32)),
                 "kivi3-g32": ("kivi", None, KiviSettings(3, 32, 32))}
    bundles.update({name: write_bundle(folder / f"{name}.safetensors", *build_bundle(str(profile), recipe, *extra))
                    for name, (recipe, *extra) in artifacts.items()})
    # kvmix-two-widths: KVmix's layers with keys and values of two widths, 3-bit keys with 2-bit values, then 2-bit keys
    # with 4-bit values (KVmix's default widths; the tiny profile's allocation gives both layers 2 / 2)
    tensors, config = build_bundle(str(profile), "kvmix")
    for layer, (k_bits, v_bits) in zip(config["recipe"]["layers"], ((3, 2), (2, 4))):
        layer["k_bits"], layer["v_bits"] = k_bits, v_bits
    bundles["kvmix-two-widths"] = write_bundle(folder / "kvmix-two-widths.safetensors", tensors, config)
    return bundles
