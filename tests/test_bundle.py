"""Bundles: every recipe exports and loads; corrupt, foreign or mismatched bundles are refused."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from conftest import tiny_model
from kvcal.bundle import build_bundle, bundle_method, load_bundle, tensors_checksum, write_bundle
from kvcal.errors import KvcalError
from kvcal.nuq import nuq_method


@pytest.fixture(scope="module")
def bundle_path(tiny_profile, fitted, tmp_path_factory):
    _, profile = tiny_profile
    return write_bundle(tmp_path_factory.mktemp("bundle") / "bundle.safetensors", *build_bundle(str(profile), "kvquant", str(fitted["nuq"])))


@pytest.mark.parametrize("recipe", ["kvquant", "mixed", "skvq", "kivi", "kvmix"])
def test_every_recipe_exports_and_loads(recipe_bundles, recipe):
    path = recipe_bundles[recipe]
    bundle = load_bundle(path, model=tiny_model("llama"))
    assert bundle.recipe_name == recipe and len(bundle.layers) == 2
    assert bundle.layers[0].method == {"kvquant": "nuq", "mixed": "nuq", "skvq": "skvq", "kivi": "uniform", "kvmix": "uniform"}[recipe]
    assert bundle_method(str(path)).name == f"bundle:{recipe}"
    if recipe == "kvmix":
        assert {layer.rpc_k for layer in bundle.layers} <= {0.1, 0.2} and all(layer.group_size == 32 for layer in bundle.layers)


def test_bundle_simulates_exactly_like_its_nuq_artifact(bundle_path, fitted):
    model = tiny_model("llama")
    from kvcal.adapters import adapt
    from kvcal.evaluate import evaluate_ppl

    windows = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    _, from_artifact, from_bundle = evaluate_ppl(model, adapt(model), windows, [nuq_method(str(fitted["nuq"])), bundle_method(str(bundle_path))])
    assert from_artifact.ppl == from_bundle.ppl and from_artifact.effective_bits == from_bundle.effective_bits


def test_recipe_needs_its_artifact(tiny_profile, fitted):
    _, profile = tiny_profile
    with pytest.raises(KvcalError, match="needs --nuq"):
        build_bundle(str(profile), "kvquant")
    with pytest.raises(KvcalError, match="without --bits-from-profile"):
        build_bundle(str(profile), "kvquant", str(fitted["nuq-kvmix"]))
    with pytest.raises(KvcalError, match="unknown recipe"):
        build_bundle(str(profile), "gptq")


def rewrite(path, out, tensors_fn=None, metadata_fn=None):
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        metadata = dict(handle.metadata())
    tensors = load_file(str(path))
    tensors = tensors_fn(tensors) if tensors_fn else tensors
    metadata = metadata_fn(metadata) if metadata_fn else metadata
    save_file(tensors, str(out), metadata=metadata)
    return out


def test_truncated_flipped_wrong_schema_missing_tensor_and_other_model_are_refused(bundle_path, tmp_path):
    data = bundle_path.read_bytes()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[: len(data) - 64])
    with pytest.raises(KvcalError, match="is truncated"):
        load_bundle(truncated)
    flipped = tmp_path / "flipped.safetensors"
    flipped.write_bytes(data[:-10] + bytes([data[-10] ^ 0xFF]) + data[-9:])
    with pytest.raises(KvcalError, match="fails its checksum"):
        load_bundle(flipped)
    schema = rewrite(bundle_path, tmp_path / "schema.safetensors", metadata_fn=lambda m: {**m, "kvcal.schema": "2"})
    with pytest.raises(KvcalError, match="schema '2'"):
        load_bundle(schema)

    def drop_codebook(tensors):
        del tensors["layers.1.v.codebook"]
        return tensors

    missing = rewrite(bundle_path, tmp_path / "missing.safetensors", tensors_fn=drop_codebook,
                      metadata_fn=lambda m: {**m, "kvcal.sha256": tensors_checksum(drop_codebook(load_file(str(bundle_path))))})
    with pytest.raises(KvcalError, match="lacks tensor layers.1.v.codebook"):
        load_bundle(missing)
    with pytest.raises(KvcalError, match="was made for LlamaForCausalLM.*not for this model \\(Qwen2ForCausalLM"):
        load_bundle(bundle_path, model=tiny_model("qwen2"))


def _mutations():
    values = st.one_of(st.none(), st.booleans(), st.integers(-3, 10**6), st.floats(allow_nan=True), st.text(max_size=5),
                       st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
    paths = st.lists(st.sampled_from(["model", "fingerprint", "recipe", "layers", 0, 1, "num_layers", "head_dim", "num_kv_heads",
                                      "method", "k_bits", "group_size", "window", "packing", "name", "outliers"]), min_size=1, max_size=4)
    return st.tuples(paths, values, st.booleans())


def _apply(config, path, value, delete):
    node = config
    for key in path[:-1]:
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and isinstance(key, int) and key < len(node):
            node = node[key]
        else:
            return
    key = path[-1]
    if isinstance(node, dict) or (isinstance(node, list) and isinstance(key, int) and key < len(node)):
        if delete and isinstance(node, dict):
            node.pop(key, None)
        else:
            node[key] = value


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=st.lists(_mutations(), min_size=1, max_size=3))
def test_fuzzed_metadata_is_refused_cleanly_or_loads_unchanged(bundle_path, tmp_path, mutations):
    def mutate(metadata):
        config = json.loads(metadata["kvcal.config"])
        for path, value, delete in mutations:
            _apply(config, path, value, delete)
        return {**metadata, "kvcal.config": json.dumps(config)}

    fuzzed = rewrite(bundle_path, tmp_path / "fuzzed.safetensors", metadata_fn=mutate)
    try:
        bundle = load_bundle(fuzzed)
    except KvcalError as error:
        assert str(error) and "\n" not in str(error)
        return
    # whatever loads must be a complete, consistent bundle
    assert len(bundle.layers) == bundle.fingerprint["num_layers"]
    assert all(f"layers.{i}.importance.k" in bundle.tensors for i in range(len(bundle.layers)))


def test_a_write_killed_midway_leaves_no_loadable_bundle(tiny_profile, fitted, tmp_path):
    _, profile = tiny_profile
    target = tmp_path / "killed.safetensors"
    script = f"""
import torch
from kvcal.bundle import build_bundle, write_bundle
tensors, config = build_bundle({str(profile)!r}, "kvquant", {str(fitted['nuq'])!r})
tensors["padding"] = torch.zeros(400_000_000, dtype=torch.uint8)  # a large file, so the kill lands mid-write
write_bundle({str(target)!r}, tensors, config)
"""
    process = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.time() + 60
    while time.time() < deadline and not any(p.name.endswith(".tmp") for p in tmp_path.iterdir()):
        time.sleep(0.01)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert any(p.name.endswith(".tmp") for p in tmp_path.iterdir()), "the write had not started"
    assert not target.exists()
    with pytest.raises(KvcalError):
        load_bundle(target)
