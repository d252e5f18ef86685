import pytest

from helpers.tiny_models import DOTS3_NOTE, GLM5_NEXT, MISTRAL_LARGE4, SPARSE_LATENTS, tiny_model
from kvcal.errors import KvcalError
from kvcal.fit.nuq import NuqSettings, fit_nuq, write_nuq
from kvcal.fit.skvq import SkvqSettings, fit_skvq, write_skvq
from kvcal.summary import _kv_heads_text, model_summary, plot_profile, summarize


def test_every_artifact_kind_has_a_per_layer_summary(tiny_profile, tmp_path):
    _, profile = tiny_profile
    nuq = write_nuq(tmp_path / "n.safetensors", *fit_nuq(str(profile), NuqSettings(bits=2)))
    skvq = write_skvq(tmp_path / "s.safetensors", *fit_skvq(str(profile), SkvqSettings(group_size=16, window=8, sink=2)))
    for path, kind, column in ((profile, "profile", "s_k"), (nuq, "nuq", "K codebook"), (skvq, "skvq", "K group sizes")):
        summary = summarize(path)
        assert summary.kind == kind and column in summary.columns and len(summary.rows) == 2
        assert dict(summary.provenance)["model"]
    with pytest.raises(KvcalError, match="--plot draws a profile's importance; .* is a kvcal nuq"):
        plot_profile(nuq, tmp_path / "x.png")


def test_a_profile_shows_how_kvcal_read_each_layers_attention(tiny_model_dir, tiny_corpus, tmp_path):
    """Sliding windows and RoPE per layer: OLMo 3's sliding layer 0 (plain RoPE) and full layer 1 (YaRN's cos/sin
    scaling), SmolLM3's layer 1 without RoPE, GLM-4's RoPE over half of each head in interleaved pairs; the scores'
    scale, and Gemma 2's soft-cap."""
    from helpers.tiny_bundles import profile_tiny_model

    olmo3 = summarize(profile_tiny_model(tiny_model_dir("olmo3"), tiny_corpus, tmp_path / "olmo3.safetensors"))
    window, rope = olmo3.columns.index("window / chunk"), olmo3.columns.index("RoPE")
    assert [(row[window], row[rope]) for row in olmo3.rows] == [("16", "x1"), ("-", "x1.139")]
    assert dict(olmo3.provenance)["attention"].startswith("scores x 0.25;")
    smollm3 = summarize(profile_tiny_model(tiny_model_dir("smollm3"), tiny_corpus, tmp_path / "smollm3.safetensors"))
    assert [row[rope] for row in smollm3.rows] == ["x1", "none"]
    glm4 = summarize(profile_tiny_model(tiny_model_dir("glm4"), tiny_corpus, tmp_path / "glm4.safetensors"))
    assert [row[rope] for row in glm4.rows] == ["x1 over 8 of 16 channels"] * 2
    assert dict(glm4.provenance)["attention"].endswith("; q/k channels in RoPE pair order (fingerprint rope_order)")
    gemma2 = summarize(profile_tiny_model(tiny_model_dir("gemma2"), tiny_corpus, tmp_path / "gemma2.safetensors"))
    assert dict(gemma2.provenance)["attention"].endswith("; scores soft-capped at 0.05")
    qwen = summarize(profile_tiny_model(tiny_model_dir("qwen3_5_text"), tiny_corpus, tmp_path / "qwen3_5.safetensors"))
    assert len(qwen.rows) == 2  # its attention layers: DeltaNet layers hold no KV cache
    assert dict(qwen.provenance)["architecture"].endswith("; attention in decoder layers 1, 3, the others keep a recurrent state")


def test_a_bundle_is_summarized_once_validated_and_missing_provenance_shows_as_a_dash(recipe_bundles, tmp_path):
    from helpers.artifact_files import rewrite

    def drop_provenance(config):
        del config["calibration"], config["kvcal_version"]
        return config

    bare = rewrite(recipe_bundles["kvmix"], tmp_path / "bare.safetensors", config_fn=drop_provenance)
    provenance = dict(summarize(bare).provenance)
    assert provenance["calibration"] == "-, - x -, seed -" and provenance["kvcal version"] == "-"
    edited = rewrite(recipe_bundles["kvmix"], tmp_path / "edited.safetensors", config_fn=drop_provenance, reseal=False)
    with pytest.raises(KvcalError, match="fails its checksum"):
        summarize(edited)


def test_plot_destinations_are_checked_before_drawing(tiny_profile, fitted, tmp_path):
    from kvcal.summary import check_plot

    _, profile = tiny_profile
    with pytest.raises(KvcalError, match="does not end in an image format's extension"):
        check_plot(tmp_path / "importance.txt", profile)
    with pytest.raises(KvcalError, match="--plot draws a profile's importance; .* is a kvcal nuq"):
        check_plot(tmp_path / "importance.png", fitted["nuq"])
    assert plot_profile(profile, tmp_path / "importance.pdf").read_bytes().startswith(b"%PDF")


def test_inspect_names_each_layer_shape_where_the_layers_differ():
    """Gemma 4's fingerprint records each layer's KV heads and head_dim; the summary names each shape and its layers."""
    uniform = {"num_layers": 3, "num_kv_heads": 2, "head_dim": 16}
    assert _kv_heads_text(uniform) == "2 kv heads, head_dim 16"
    mixed = {**uniform, "layer_kv_heads": [2, 1, 2], "layer_head_dims": [16, 32, 16]}
    assert _kv_heads_text(mixed) == "2 kv heads, head_dim 16 in layers 0, 2; 1 kv heads, head_dim 32 in layer 1"


@SPARSE_LATENTS
def test_a_sparse_attention_bundles_effective_bits_count_its_indexer_keys_as_kept(architecture_bundles):
    """DeepSeek-V3.2's fingerprint names its indexer-key widths (80 a layer): the summary's effective bits are the
    K/V bits of the same bundle without them, with 16-bit indexer keys among the elements, or FP8 ones (8 bits and a
    32-bit scale a token of 80)."""
    from kvcal.bundle import load_bundle
    from kvcal.summary import effective_bits

    bundle = load_bundle(architecture_bundles("deepseek_v32")["kvquant"])
    plain = {key: value for key, value in bundle.fingerprint.items() if key != "layer_index_dims"}
    kv, index = 2 * (64 + 96), 2 * 80
    for tokens in (512, 4096):
        for indexer_keys, index_bits in (("model", 16), ("fp8", 8 + 32 / 80)):
            expected = (effective_bits(bundle.layers, plain, tokens) * kv + index_bits * index) / (kv + index)
            assert effective_bits(bundle.layers, bundle.fingerprint, tokens, indexer_keys) == pytest.approx(expected, rel=1e-12)


@MISTRAL_LARGE4
def test_a_layer_storing_no_key_shows_no_key_bits(architecture_bundles):
    """Mistral Large 4's layer 1, without RoPE, caches its latent alone: its bundle row names no key width ("-")
    where layer 0 names the recipe's."""
    summary = summarize(architecture_bundles("mistral_large4")["kvquant"])
    bits_k = summary.columns.index("bits K")
    assert [row[bits_k] for row in summary.rows] == ["3", "-"]


@pytest.mark.parametrize("model_type", ("deepseek_v3", *GLM5_NEXT, *DOTS3_NOTE[:1]))
def test_an_mla_models_summary_names_a_rotated_key_where_a_layer_has_one(model_type):
    """DeepSeek-V3's MLA caches its latent beside a rotated key; GLM-5 Next's, without RoPE, its latent alone;
    dots.note3's sliding layers a latent of their own width, their scores scaled by their own head width."""
    from kvcal.adapters import adapt

    attention = dict(model_summary(adapt(tiny_model(model_type)), model_type).provenance)["attention"]
    key = "alone (no layer rotates a key)" if model_type in GLM5_NEXT else "beside the rotated key"
    latents = "96 or 64" if model_type in DOTS3_NOTE else "96"
    assert attention.endswith(f"multi-head latent attention: the value is a latent of {latents} channels {key}")
    assert ("scores x 0.1118 or 0.1443" in attention) == (model_type in DOTS3_NOTE)  # (80 ** -0.5, 48 ** -0.5)
