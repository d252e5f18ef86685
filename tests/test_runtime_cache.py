"""The runtime cache against the simulation of `kvcal eval ppl`, through transformers' own forward and generate()."""

import pytest
import torch

from conftest import tiny_model
from kvcal.adapters import adapt
from kvcal.bundle import RECIPES, bundle_method
from kvcal.runtime import generate, quantized_cache
from kvcal.simulate import StorageTally, simulated

TOKENS = 40


def decode_token_by_token(model, bundle, ids):
    """Logits of feeding `ids` one token at a time through the runtime cache."""
    logits = []
    with quantized_cache(model, bundle) as cache:
        for t in range(ids.shape[1]):
            logits.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[:, 0])
    return torch.stack(logits, dim=1), cache


@pytest.mark.parametrize("recipe", RECIPES)
def test_token_by_token_runtime_logits_match_the_simulation(recipe_bundles, recipe):
    model = tiny_model("llama")
    ids = torch.randint(0, 512, (2, TOKENS), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        with simulated(model, adapt(model), bundle_method(str(recipe_bundles[recipe])), StorageTally()):
            simulated_logits = model(ids).logits
        runtime_logits, cache = decode_token_by_token(model, recipe_bundles[recipe], ids)
    torch.testing.assert_close(runtime_logits, simulated_logits, rtol=0, atol=1e-4)
    assert model.config._attn_implementation == "sdpa" and cache.tokens() == [TOKENS, TOKENS]


@pytest.mark.parametrize("recipe", RECIPES)
def test_left_padded_batch_generates_what_each_prompt_generates_alone(recipe_bundles, recipe):
    """Padding is never stored and positions are each sequence's own: a left-padded batch of prompts of
    different lengths (prefill, then decode) gives each prompt the logits it gets alone."""
    model = tiny_model("llama")
    lengths = (21, 9, 14)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 512, (n,), generator=g) for n in lengths]
    ids = torch.zeros(len(prompts), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, -len(prompt):], mask[row, -len(prompt):] = prompt, 1
    settings = dict(max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.inference_mode():
        batch = generate(model, recipe_bundles[recipe], input_ids=ids, attention_mask=mask, **settings)
        for row, prompt in enumerate(prompts):
            alone = generate(model, recipe_bundles[recipe], input_ids=prompt[None], **settings)
            torch.testing.assert_close(torch.stack(batch.logits)[:, row], torch.stack(alone.logits)[:, 0], rtol=0, atol=1e-4)
            assert torch.equal(batch.sequences[row, max(lengths):], alone.sequences[0, len(prompt):])
    assert model.config._attn_implementation == "sdpa"


def test_a_bundle_for_another_model_is_refused(recipe_bundles):
    from kvcal.errors import KvcalError

    with pytest.raises(KvcalError, match="made for"):
        quantized_cache(tiny_model("qwen2"), recipe_bundles["kivi"])


@pytest.mark.parametrize("recipe", RECIPES)
def test_live_cache_bytes_equal_the_formula(recipe_bundles, recipe):
    from kvcal.bundle import load_bundle
    from kvcal.runtime.memory import cache_bytes, fp16_bytes

    model = tiny_model("llama")
    bundle = load_bundle(recipe_bundles[recipe])
    width = model.config.num_key_value_heads * model.config.head_dim
    ids = torch.randint(0, 512, (1, 150), generator=torch.Generator().manual_seed(7))
    with torch.inference_mode(), quantized_cache(model, bundle) as cache:
        model(ids, past_key_values=cache, use_cache=True)
    expected = cache_bytes(bundle.layers, width, 150, outliers=cache.outliers())
    assert cache.used_bytes() == expected < fp16_bytes(2, width, 150)
    assert (cache.outliers() > 0) == (recipe in ("kvquant", "mixed"))


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_loaded_fp_context_is_stored_as_its_prefill_would_be(recipe_bundles, recipe):
    """WiredCache.load (one fp prefill shared by several methods) stores what a prefill through the cache
    stores: layer 0's K/V come from the embeddings, so its stores are identical, and the next token's logits
    agree with the cache's own prefill (whose attention reads its own K/V rounded to fp16, fp's does not)."""
    from kvcal.runtime.cache import fp_context

    model = tiny_model("llama")
    ids = torch.randint(0, 512, (1, 150), generator=torch.Generator().manual_seed(8))
    with torch.inference_mode():
        with quantized_cache(model, recipe_bundles[recipe]) as prefilled:
            model(ids[:, :-1], past_key_values=prefilled, use_cache=True)
            stored = [getattr(prefilled.layers[0], store).read(0) for store in ("keys_store", "values_store")]
            own = model(ids[:, -1:], past_key_values=prefilled, use_cache=True).logits
        with quantized_cache(model, recipe_bundles[recipe]) as loaded:
            loaded.load(fp_context(model, ids[:, :-1]))
            assert loaded.tokens() == [149] and loaded.get_seq_length() == 149
            for store, expected in zip(("keys_store", "values_store"), stored):
                assert torch.equal(getattr(loaded.layers[0], store).read(0), expected)
            shared = model(ids[:, -1:], past_key_values=loaded, use_cache=True).logits
    torch.testing.assert_close(shared, own, rtol=0, atol=1e-4)
