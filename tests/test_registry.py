"""kvcal.registry: a method registered from outside kvcal (here, in the test) is a first-class recipe: it
exports, validates, loads, simulates, runs in the cache and is counted by the bytes formula, with no
change to the bundle, runtime, CLI or summary code; typed settings round-trip through the bundle."""

from dataclasses import dataclass

import pytest
import torch

from helpers.tiny_models import tiny_model
from kvcal import registry
from kvcal.bundle import LayerRecipe, load_bundle, write_bundle
from kvcal.calibration import build_bundle
from kvcal.errors import KvcalError
from kvcal.kv import SegmentPolicy
from kvcal.methods import artifact_method
from kvcal.model_caches import cache_argument
from kvcal.quantizers import LayerCodecs, TokenUniform
from kvcal.runtime import quantized_cache
from kvcal.runtime.memory import cache_bytes
from kvcal.summary import summarize


@dataclass(frozen=True)
class ToySettings:
    bits: int = 4

    def validate(self) -> None:
        if self.bits not in (2, 4):
            raise KvcalError(f"toy bits {self.bits} is not 2 or 4")


class ToyFormat(registry.LayerFormat):
    """Per-token int over each head's channels, group given by a bundle tensor (to exercise the schema)."""

    name = "toy"

    def tensor_schema(self, layer, kind, width):
        return {"group": ((1,), "int32")}

    def codecs(self, layer, tensors):
        return LayerCodecs(TokenUniform(int(layer.k_bits), int(tensors["k.group"])), TokenUniform(int(layer.v_bits), int(tensors["v.group"])),
                           False)

    def policy(self, layer):
        return SegmentPolicy(sink=layer.sink)

    def body_bytes(self, layer, width, body, keys):
        return body * (width * int(layer.k_bits if keys else layer.v_bits) // 8 + (width // 16) * 4)


class ToySpec(registry.MethodSpec):
    name = "toy"
    description = "a per-token int recipe registered by a test"
    settings_type = ToySettings
    bundle_format = "toy"

    def bundle_layers(self, profile, profile_config, fitted, settings):
        layers = profile_config["model"]["fingerprint"]["num_layers"]
        tensors = {f"layers.{i}.{kind}.group": torch.tensor([16], dtype=torch.int32) for i in range(layers) for kind in "kv"}
        return [LayerRecipe("toy", settings.bits, settings.bits, False, sink=1) for _ in range(layers)], tensors


@pytest.fixture
def toy(monkeypatch):
    """Register the toy format and method for one test (the registry's tables restored after it)."""
    monkeypatch.setattr(registry, "_FORMATS", dict(registry._FORMATS))
    monkeypatch.setattr(registry, "_METHODS", dict(registry._METHODS))
    registry.register_format(ToyFormat())
    return registry.register_method(ToySpec())


def test_a_registered_method_is_a_recipe_end_to_end(toy, tiny_profile, tmp_path):
    _, profile = tiny_profile
    assert "toy" in registry.recipes()
    path = write_bundle(tmp_path / "toy.safetensors", *build_bundle(str(profile), "toy", settings=ToySettings(bits=2)))
    model = tiny_model("llama")
    bundle = load_bundle(path, model=model)
    assert bundle.settings == ToySettings(bits=2) and bundle.layers[0].format.name == "toy"
    assert artifact_method(str(path)).layers[0] == LayerCodecs(TokenUniform(2, 16), TokenUniform(2, 16), False)
    assert summarize(path).kind == "bundle"
    ids = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode(), quantized_cache(model, bundle) as cache:
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **cache_argument(cache), max_new_tokens=4, do_sample=False)
        live = cache.used_bytes()
    assert live == cache_bytes(bundle.layers, 32, 23, kv_heads=2)  # 24 tokens fed, the last one not yet stored


def test_a_bundle_tensor_that_breaks_the_format_schema_is_refused(toy, tiny_profile, tmp_path):
    _, profile = tiny_profile
    tensors, config = build_bundle(str(profile), "toy", settings=ToySettings())
    tensors["layers.1.v.group"] = torch.tensor([16.0])
    with pytest.raises(KvcalError, match=r"tensor layers.1.v.group is torch.float32 \(1,\), expected int32 \(1,\)"):
        load_bundle(write_bundle(tmp_path / "toy.safetensors", tensors, config))


@pytest.mark.parametrize("settings, message", [
    ({"method": "toy", "version": 2, "values": {"bits": 4}}, "version 2; this kvcal reads version 1"),
    ({"method": "toy", "version": 1, "values": {"bits": 3}}, "toy bits 3 is not 2 or 4"),
    ({"method": "toy", "version": 1, "values": {"bits": 4, "extra": 1}}, "malformed"),
    ({"method": "nosuch", "version": 1, "values": {}}, "unknown method"),
    ("toy", "malformed"),
])
def test_recorded_settings_are_checked_like_any_input(toy, tiny_profile, tmp_path, settings, message):
    _, profile = tiny_profile
    tensors, config = build_bundle(str(profile), "toy", settings=ToySettings())
    config["recipe"]["settings"] = settings
    with pytest.raises(KvcalError, match=message):
        load_bundle(write_bundle(tmp_path / "toy.safetensors", tensors, config))


def test_every_builtin_recipe_records_settings_that_round_trip(recipe_bundles):
    for recipe, path in recipe_bundles.items():
        bundle = load_bundle(path)
        spec = registry.recipe(recipe)
        assert isinstance(bundle.settings, spec.settings_type), recipe
        assert registry.settings_from_metadata(registry.settings_metadata(spec, bundle.settings)) == bundle.settings


def test_unknown_names_list_what_exists():
    with pytest.raises(KvcalError, match="unknown recipe 'gptq'; choose one of kvquant, mixed, skvq, kivi, kvmix"):
        registry.recipe("gptq")
    with pytest.raises(KvcalError, match="unknown method"):
        registry.method(["kvquant"])
