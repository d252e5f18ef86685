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
from transformers import AutoModelForCausalLM

from helpers.artifact_files import read_metadata, rewrite
from helpers.tiny_models import MISTRAL_LARGE4, SPARSE_LATENTS, tiny_model
from kvcal import registry
from kvcal.bundle import PACKING_UP_TO_4_BITS, load_bundle, write_bundle
from kvcal.calibration import build_bundle
from kvcal.errors import KvcalError
from kvcal.methods import artifact_method


@pytest.fixture(scope="module")
def bundle_path(tiny_profile, fitted, tmp_path_factory):
    _, profile = tiny_profile
    return write_bundle(tmp_path_factory.mktemp("bundle") / "bundle.safetensors", *build_bundle(str(profile), "kvquant", str(fitted["nuq"])))


@pytest.mark.parametrize("recipe", registry.recipes())
def test_every_recipe_exports_and_loads(recipe_bundles, recipe):
    path = recipe_bundles[recipe]
    bundle = load_bundle(path, model=tiny_model("llama"))
    assert bundle.recipe_name == recipe and len(bundle.layers) == 2
    assert bundle.layers[0].method == {"kvquant": "nuq", "mixed": "nuq", "skvq": "skvq", "kivi": "uniform", "kvmix": "uniform"}[recipe]
    assert artifact_method(str(path)).name == f"bundle:{recipe}"
    if recipe == "kvmix":
        assert {layer.rpc_k for layer in bundle.layers} <= {0.1, 0.2} and all(layer.group_size == 32 for layer in bundle.layers)


def test_bundle_simulates_exactly_like_its_nuq_artifact(bundle_path, fitted):
    model = tiny_model("llama")
    from kvcal.adapters import adapt
    from kvcal.evaluate import evaluate_ppl

    windows = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    _, from_artifact, from_bundle = evaluate_ppl(model, adapt(model), windows, [artifact_method(str(fitted["nuq"])), artifact_method(str(bundle_path))])
    assert from_artifact.ppl == from_bundle.ppl and from_artifact.effective_bits == from_bundle.effective_bits


def test_recipe_needs_its_artifact(tiny_profile, fitted):
    _, profile = tiny_profile
    with pytest.raises(KvcalError, match="needs --nuq"):
        build_bundle(str(profile), "kvquant")
    with pytest.raises(KvcalError, match="without per-layer widths"):
        build_bundle(str(profile), "kvquant", str(fitted["nuq-kvmix"]))
    with pytest.raises(KvcalError, match="unknown recipe"):
        build_bundle(str(profile), "gptq")


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
    schema = rewrite(bundle_path, tmp_path / "schema.safetensors", metadata_fn=lambda m: {**m, "kvcal.schema": "4"})
    with pytest.raises(KvcalError, match="schema '4', written by a newer kvcal; this kvcal reads schemas 2 and 3"):
        load_bundle(schema)

    def drop_codebook(tensors):
        del tensors["layers.1.v.codebook"]
        return tensors

    missing = rewrite(bundle_path, tmp_path / "missing.safetensors", tensors_fn=drop_codebook)
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

    fuzzed = rewrite(bundle_path, tmp_path / "fuzzed.safetensors", metadata_fn=mutate)  # resealed: validation must catch it
    try:
        bundle = load_bundle(fuzzed)
    except KvcalError as error:
        assert str(error) and "\n" not in str(error)
        return
    # whatever loads must be a complete, consistent bundle
    assert len(bundle.layers) == bundle.fingerprint["num_layers"]
    assert all(f"layers.{i}.importance.k" in bundle.tensors for i in range(len(bundle.layers)))


@pytest.mark.slow
def test_a_write_killed_midway_leaves_no_loadable_bundle(tiny_profile, fitted, tmp_path):
    _, profile = tiny_profile
    target = tmp_path / "killed.safetensors"
    script = f"""
import torch
from kvcal.bundle import write_bundle
from kvcal.calibration import build_bundle
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


def test_a_schema_1_bundle_is_refused_with_a_message_to_re_export_it(bundle_path, tmp_path):
    """Schema 1 bundles' checksum covered tensors only; schema 2's covers kvcal.config too, so old files are refused."""
    old = rewrite(bundle_path, tmp_path / "v1.safetensors", metadata_fn=lambda m: {**m, "kvcal.schema": "1"})
    with pytest.raises(KvcalError, match=r"schema 1, written by an older kvcal .* re-export it \(kvcal export bundle"):
        load_bundle(old)


@pytest.mark.parametrize("change", ["config", "version", "kind-extra"])
def test_any_change_of_the_metadata_fails_the_checksum(bundle_path, tmp_path, change):
    """Misuse 4: kvcal.config (and every other metadata entry) is under the checksum."""
    def config_fn(config):
        config["recipe"]["layers"][0]["window"] = 4  # a valid value: only the checksum can tell
        return config

    edits = {"config": dict(config_fn=config_fn), "version": dict(metadata_fn=lambda m: {**m, "kvcal.version": "9.9"}),
             "kind-extra": dict(metadata_fn=lambda m: {**m, "note": "edited"})}[change]
    edited = rewrite(bundle_path, tmp_path / "edited.safetensors", reseal=False, **edits)
    with pytest.raises(KvcalError, match="fails its checksum"):
        load_bundle(edited)
    assert load_bundle(rewrite(bundle_path, tmp_path / "resealed.safetensors", **edits)).layers  # the same edit, resealed, is valid


@pytest.mark.parametrize("head_dim", ["16", [16], 16.0, None, 0, -16, True, 2**63])
def test_a_fingerprint_head_dim_of_the_wrong_type_is_refused(bundle_path, tmp_path, head_dim):
    """Misuse 3: a string or list head_dim was a TypeError."""
    def config_fn(config):
        config["model"]["fingerprint"]["head_dim"] = head_dim
        return config

    with pytest.raises(KvcalError, match="not positive integers"):
        load_bundle(rewrite(bundle_path, tmp_path / "fingerprint.safetensors", config_fn=config_fn), model=tiny_model("llama"))


@pytest.mark.parametrize("field", ["architecture", "config_sha256"])
def test_a_fingerprint_missing_a_name_is_refused_for_another_model(bundle_path, tmp_path, field):
    def config_fn(config):
        del config["model"]["fingerprint"][field]
        return config

    with pytest.raises(KvcalError, match="was made for"):
        load_bundle(rewrite(bundle_path, tmp_path / "fingerprint.safetensors", config_fn=config_fn), model=tiny_model("llama"))


BAD_FIELDS = [
    ("outliers", -1), ("outliers", float("nan")), ("outliers", float("inf")), ("outliers", "x"), ("outliers", None), ("outliers", 2.0),
    ("outliers", 0.11), ("window", 2**63), ("window", -1), ("window", 30.0), ("sink", 10**12), ("sink", 30.0), ("sink", "30"),
    ("pre_rope", 0), ("pre_rope", None), ("pre_rope", "yes"), ("pre_rope", 1), ("key_granularity", "x"), ("key_granularity", None),
    ("key_granularity", ["channel"]), ("fp8", "x"), ("fp8", 0), ("fp8", None), ("k_bits", 9), ("k_bits", 2.5), ("k_bits", True),
    ("k_bits", "3"), ("v_bits", None), ("rpc_k", 1.0), ("rpc_v", -0.1), ("group_size", 30.0), ("residual", -1), ("packing", "msb"),
    ("method", "x"), ("method", None), ("method", ["nuq"]),
]


@pytest.mark.parametrize("field, value", BAD_FIELDS, ids=[f"{f}={v!r}" for f, v in BAD_FIELDS])
def test_every_recipe_field_is_validated_by_type_and_range(bundle_path, tmp_path, field, value):
    """Misuse 4: each of these loaded before (or crashed the runtime or the CLI later); the bundle is resealed, so
    only the recipe validation can refuse it."""
    def config_fn(config):
        config["recipe"]["layers"][1][field] = value
        return config

    with pytest.raises(KvcalError, match=r"the recipe of layer 1 is invalid \(" + field):
        load_bundle(rewrite(bundle_path, tmp_path / "field.safetensors", config_fn=config_fn))


@pytest.mark.parametrize("edit, message", [
    (lambda recipe: recipe.update(name=["kvquant"]), "names recipe"),
    (lambda recipe: recipe.update(name=None), "names recipe"),
    (lambda recipe: recipe.update(name="gptq"), "names recipe 'gptq'"),
    (lambda recipe: recipe.update(packing={"layout": "msb"}), "packs codes as"),
    (lambda recipe: recipe["layers"][0].update(extra=1), "recipe of layer 0 is malformed"),
    (lambda recipe: recipe["layers"][0].pop("sink"), "recipe of layer 0 is malformed"),
    (lambda recipe: recipe["layers"].pop(), "recipe for 1 layers, the model 2"),
    (lambda recipe: recipe.update(layers={"0": {}}), "recipe for no layers"),
    (lambda recipe: recipe.update(indexer_keys="int4"), "keeps indexer keys as 'int4', which this kvcal does not know"),
    (lambda recipe: recipe.update(indexer_keys="fp8"), "keeps indexer keys as fp8 for a model whose layers keep none"),
])
def test_malformed_recipes_are_refused(bundle_path, tmp_path, edit, message):
    def config_fn(config):
        edit(config["recipe"])
        return config

    with pytest.raises(KvcalError, match=message):
        load_bundle(rewrite(bundle_path, tmp_path / "recipe.safetensors", config_fn=config_fn))


def test_the_packing_declared_before_5_bit_codes_holds_only_for_bundles_without_them(bundle_path, wide_nuq_bundles, tmp_path):
    def up_to_4_bits(config):
        config["recipe"]["packing"] = dict(PACKING_UP_TO_4_BITS)
        return config

    assert load_bundle(rewrite(bundle_path, tmp_path / "old.safetensors", config_fn=up_to_4_bits)).layers
    assert load_bundle(rewrite(wide_nuq_bundles[8], tmp_path / "old8.safetensors", config_fn=up_to_4_bits)).layers  # "lsb" words
    with pytest.raises(KvcalError, match="no layout for its 5-7-bit codes; re-export"):
        load_bundle(rewrite(wide_nuq_bundles[6], tmp_path / "old6.safetensors", config_fn=up_to_4_bits))


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.update({"layers.0.k.extra": torch.zeros(2)}), "tensors its recipe does not use \\(layers.0.k.extra"),
    (lambda t: t.update({"rope.inv_freq": t["rope.inv_freq"].double()}), "rope.inv_freq is torch.float64"),
    (lambda t: t.update({"layers.1.k.renamed": t.pop("layers.1.k.codebook")}), "lacks tensor layers.1.k.codebook"),
    (lambda t: t["layers.0.v.codebook"].__setitem__(0, float("nan")), "layers.0.v.codebook has values that are not finite"),
    (lambda t: t["layers.0.importance.k"].__setitem__(0, float("inf")), "layers.0.importance.k has values that are not finite"),
])
def test_extra_renamed_retyped_and_non_finite_tensors_are_refused(bundle_path, tmp_path, edit, message):
    def tensors_fn(tensors):
        edit(tensors)
        return tensors

    with pytest.raises(KvcalError, match=message):
        load_bundle(rewrite(bundle_path, tmp_path / "tensors.safetensors", tensors_fn=tensors_fn))


def _edited(tensor_edit):
    def tensors_fn(tensors):
        tensor_edit(tensors)
        return tensors
    return tensors_fn


@pytest.mark.parametrize("edit, message", [
    (lambda t: t["layers.1.k.codebook"].copy_(t["layers.1.k.codebook"].flip(0)), "layer 1 k: its codebook is not in ascending order"),
    (lambda t: t["layers.0.v.codebook"].__setitem__([2, 3], t["layers.0.v.codebook"][[3, 2]]), "layer 0 v: its codebook is not in ascending"),
    (lambda t: t["layers.0.k.lo"].__setitem__(5, t["layers.0.k.hi"][5] + 0.5), "layer 0 k: a channel's lower threshold lo is above"),
    (lambda t: t["layers.1.importance.v"].fill_(-0.25), "layers.1.importance.v is negative"),
    (lambda t: t["rope.inv_freq"].__setitem__(0, 0.0), "rope.inv_freq has a layer whose frequencies are not positive then zero"),
    (lambda t: t["rope.inv_freq"].__setitem__(0, -1.0), "rope.inv_freq has a layer whose frequencies are not positive then zero"),
])
def test_a_resealed_bundle_with_values_the_kernels_would_misread_is_refused(bundle_path, tmp_path, edit, message):
    """Each edit keeps shapes, dtypes and finiteness and the checksum is recomputed: only the invariants the encoders
    and kernels rely on stand between such a bundle and wrong tokens."""
    with pytest.raises(KvcalError, match=message):
        load_bundle(rewrite(bundle_path, tmp_path / "edited.safetensors", tensors_fn=_edited(edit)))


def test_equal_thresholds_and_equal_signposts_which_kvcal_itself_writes_are_accepted(bundle_path, tmp_path):
    """A channel that was constant in calibration gets lo == hi, and k-means can give two equal signposts."""
    def degenerate(t):
        t["layers.0.k.lo"][3] = t["layers.0.k.hi"][3]
        t["layers.0.v.codebook"][1] = t["layers.0.v.codebook"][0]

    assert load_bundle(rewrite(bundle_path, tmp_path / "degenerate.safetensors", tensors_fn=_edited(degenerate))).layers


def test_skvq_channel_orders_and_clipping_scales_are_checked(recipe_bundles, tmp_path):
    for edit, message in ((lambda t: t["layers.0.k.perm"].__setitem__(0, t["layers.0.k.perm"][1]), "permutation or group bounds"),
                          (lambda t: t["layers.1.v.clip"].__setitem__(0, -1.0), "clipping scales are not positive")):
        with pytest.raises(KvcalError, match=message):
            load_bundle(rewrite(recipe_bundles["skvq"], tmp_path / "skvq.safetensors", tensors_fn=_edited(edit)))


def test_checksum_covers_metadata_and_is_recorded(bundle_path):
    metadata = read_metadata(bundle_path)
    assert metadata["kvcal.schema"] == "2" and len(metadata["kvcal.sha256"]) == 64


@pytest.mark.parametrize("recipe, field, value, message", [
    ("kvquant", "fp8", True, "nuq layers store fp16 parameters"),
    ("skvq", "pre_rope", False, "skvq layers keep no outliers and store keys pre-RoPE"),
    ("skvq", "outliers", 0.01, "skvq layers keep no outliers"),
    ("kivi", "outliers", 0.01, "uniform layers keep no outliers"),
    ("kvmix", "pre_rope", True, "uniform layers keep no outliers, store fp16 parameters and post-RoPE keys"),
])
def test_a_field_the_layer_format_would_ignore_is_refused(recipe_bundles, tmp_path, recipe, field, value, message):
    """A value that is valid in general but means nothing to the layer's storage format would be silently ignored."""
    def config_fn(config):
        config["recipe"]["layers"][0][field] = value
        return config

    with pytest.raises(KvcalError, match=message):
        load_bundle(rewrite(recipe_bundles[recipe], tmp_path / "ignored.safetensors", config_fn=config_fn))


@pytest.fixture(scope="module")
def gemma4_bundle(tiny_model_dir, tiny_corpus, tmp_path_factory):
    """(model directory, a KIVI bundle) of the tiny Gemma 4: a sliding layer of heads of 16 channels, a full one of 32."""
    from helpers.tiny_bundles import profile_tiny_model
    from kvcal.methods.kivi import KiviSettings

    model = tiny_model_dir("gemma4_text")
    folder = tmp_path_factory.mktemp("gemma4-bundle")
    profile = profile_tiny_model(model, tiny_corpus, folder / "profile.safetensors")
    return model, write_bundle(folder / "kivi.safetensors", *build_bundle(str(profile), "kivi", None, KiviSettings(group=4, residual=8)))


# per-layer widths a fingerprint names: DeepSeek Sparse Attention's indexer keys (what the summary's bits count),
# MiMo-V2-Flash's values (narrower than its keys), Laguna's query heads (more on its sliding layer), Mistral Large 4's
# rotated keys (none on its layer without RoPE)
PER_LAYER_WIDTHS = {"layer_index_dims": ("deepseek_v32", [80, 80], "indexer widths .* are not non-negative integers"),
                    "layer_value_dims": ("mimo_v2_flash", [16, 16], "layer/head counts .* are not positive integers"),
                    "layer_num_heads": ("laguna", [8, 4], "layer/head counts .* are not positive integers"),
                    "layer_head_dims": ("mistral_large4", [64, 0], "layer/head counts .* are not positive integers")}


@pytest.mark.parametrize("key, edited", [pytest.param("layer_index_dims", edit, marks=SPARSE_LATENTS)
                                          for edit in ([80], [80, -1], [80, "80"], 80)] +
                         [("layer_value_dims", edit) for edit in ([16], [16, 0], [16, "16"])] +
                         [("layer_num_heads", edit) for edit in ([8], [8, 0], [8, 4.0])] +
                         [pytest.param("layer_head_dims", edit, marks=MISTRAL_LARGE4) for edit in ([64], [64, -1], [64, "0"])])
def test_a_resealed_bundle_whose_per_layer_widths_were_edited_is_refused(architecture_bundles, tmp_path, key, edited):
    """Edited and resealed (so the checksum passes) into anything but one integer a layer, positive (values) or not
    negative (indexer keys: 0 where a layer keeps none; MLA's rotated keys: 0 where a layer caches none), the bundle is
    refused in one line."""
    model_type, kept, refusal = PER_LAYER_WIDTHS[key]
    path = architecture_bundles(model_type)["kivi"]
    assert load_bundle(path).fingerprint[key] == kept

    def config_fn(config):
        config["model"]["fingerprint"][key] = edited
        return config

    with pytest.raises(KvcalError, match=f"{refusal}, one a layer; re-export"):
        load_bundle(rewrite(path, tmp_path / "edited.safetensors", config_fn=config_fn))


@pytest.mark.parametrize("layer_head_dims, message", [
    ([16], "not positive integers, one a layer"), ([16, "32"], "not positive integers"), ([16, 0], "not positive integers"),
    ([16, 16], r"rope.inv_freq is torch.float32 \(2, 16\), expected float32 \(2, 8\)"), ([32, 16], None),
])
def test_a_resealed_bundle_whose_per_layer_head_dims_were_edited_is_refused(gemma4_bundle, tmp_path, layer_head_dims, message):
    """Gemma 4's fingerprint names each layer's head_dim: edited (and resealed, so the checksum passes), the bundle is
    refused in one line where it no longer holds together, and for the model whatever the edit (swapped, a KIVI
    bundle, which stores no tensor a layer's width sizes, still reads as one for another model)."""
    model, path = gemma4_bundle

    def config_fn(config):
        config["model"]["fingerprint"]["layer_head_dims"] = layer_head_dims
        return config

    edited = rewrite(path, tmp_path / "edited.safetensors", config_fn=config_fn)
    if message is None:
        assert load_bundle(edited).fingerprint["layer_head_dims"] == [32, 16]
    else:
        with pytest.raises(KvcalError, match=message):
            load_bundle(edited)
    with pytest.raises(KvcalError, match=message or "was made for .* not for this model"):
        load_bundle(edited, model=AutoModelForCausalLM.from_pretrained(model))
    assert load_bundle(path, model=AutoModelForCausalLM.from_pretrained(model)).layers
