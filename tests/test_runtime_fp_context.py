"""The fp context (kvcal.runtime.fp_context): one fp prefill kept as rows that several quantized caches load
(WiredCache.load), each storing what its own prefill would store."""

import pytest
import torch

from helpers.tiny_bundles import fp16_kivi_bundle
from helpers.tiny_models import SPARSE_LATENTS, known, longrope, tiny_model
from kvcal import registry
from kvcal.errors import KvcalError
from kvcal.model_caches import cache_argument
from kvcal.runtime import quantized_cache
from kvcal.runtime.fp_context import FpContext, fp_context

RECIPES = registry.recipes()


@pytest.mark.parametrize("model_type, recipe", [("llama", recipe) for recipe in RECIPES] +
                         [pytest.param(kind, recipe, marks=pytest.mark.slow) for kind in ("glm4", "qwen3_5_text", "falcon_h1")
                          for recipe in RECIPES] +
                         [(kind, recipe) for kind in known(("deepseek_v2", "deepseek_v3", "minimax", "minimax_m3_vl_text",
                                                            "qwen4_exp_text", "glm5_next"))
                          for recipe in ("kivi", "kvquant")] +
                         [pytest.param("deepseek_v32", recipe, marks=SPARSE_LATENTS) for recipe in ("kivi", "kvquant")])
def test_a_loaded_fp_context_is_stored_as_its_prefill_would_be(recipe_bundles, architecture_bundles, model_type, recipe):
    """WiredCache.load (one fp prefill shared by several methods) stores what a prefill through the cache
    stores: the first attention layer's K/V come from the embeddings (on Qwen3.5 through a DeltaNet layer, which
    nothing quantized reaches), so its stores are identical, and the next token's logits
    agree with the cache's own prefill to 2e-3 (that prefill's attention reads its own K/V rounded to fp16,
    fp's does not, so deeper layers' K/V differ by float noise and a 2-4 bit code near a rounding boundary
    can flip: up to 1e-3 here). fp_context is the fp model's prefill also while a cache is open on the model
    (before the wiring was shared, it was silently the open cache's own prefill there). GLM-4 also: keys the model
    caches in its channel order are stored in kvcal's. Qwen3.5 also: the loaded cache's DeltaNet layers continue from the
    context's recurrent states (a copy: the context serves other caches after it); Falcon-H1 also, its attention layers
    keeping them; MiniMax also, its lightning attention layers' states in a cache of its decoder's own class; MiniMax-M3
    also, its block-sparse layer's indexer keys; Qwen4-Exp also, its QSA layers' indexer keys and every token's
    positions, which its first one keeps for them; GLM-5 Next also, its first MLA layer's indexer states."""
    model = tiny_model(model_type)
    bundle = (recipe_bundles if model_type == "llama" else architecture_bundles(model_type))[recipe]
    ids = torch.randint(0, 512, (1, 150), generator=torch.Generator().manual_seed(8))
    with torch.inference_mode():
        with quantized_cache(model, bundle) as prefilled:
            model(ids[:, :-1], **cache_argument(prefilled), use_cache=True)
            stored = [getattr(prefilled.attention_layers[0], store).read(0) for store in ("keys_store", "values_store")]
            own = model(ids[:, -1:], **cache_argument(prefilled), use_cache=True).logits
        context = fp_context(model, ids[:, :-1])
        with quantized_cache(model, bundle) as loaded:
            inside = fp_context(model, ids[:, :-1])
            for ours, theirs in zip(inside.keys + inside.values, context.keys + context.values):
                assert torch.equal(ours, theirs)
            loaded.load(context)
            assert loaded.tokens() == [149] and loaded.get_seq_length() == 149
            for store, expected in zip(("keys_store", "values_store"), stored):
                assert torch.equal(getattr(loaded.attention_layers[0], store).read(0), expected)
            shared = model(ids[:, -1:], **cache_argument(loaded), use_cache=True).logits
        # the fp model continues from the context as from its own prefill: the loaded cache's steps left it as it was
        continued = model(ids[:, -1:], **cache_argument(context.cache), use_cache=True).logits
        torch.testing.assert_close(continued, model(ids).logits[:, -1:], rtol=0, atol=1e-5)
    torch.testing.assert_close(shared, own, rtol=0, atol=2e-3)


@SPARSE_LATENTS
def test_a_context_without_indexer_keys_is_refused_by_sparse_attention():
    """DeepSeek Sparse Attention's indexer scores every token's indexer key: a context of rows only (or of another
    batch) is refused before anything is stored."""
    model = tiny_model("deepseek_v32")
    context = fp_context(model, torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(2)))
    with torch.inference_mode(), quantized_cache(model, fp16_kivi_bundle(model)) as cache:
        for refused in (FpContext(context.keys, context.pre_rope_keys, context.values, context.cache),
                        FpContext(context.keys, context.pre_rope_keys, context.values, context.cache,
                                  [keys.expand(2, -1, -1) for keys in context.index_keys])):
            with pytest.raises(KvcalError, match=r"holds no indexer keys of layers \[0, 1\] .* for its 1 x 20 tokens"):
                cache.load(refused)
            assert cache.tokens() == [] and cache.used_bytes() == 0


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_context_loaded_a_sequence_at_a_time_is_stored_as_in_one_append(recipe_bundles, recipe):
    """WiredCache.load's chunks (whole sequences, chunk_bytes of fp16 rows at most) change nothing it stores: three
    sequences loaded one per append read back exactly as loaded in one append, every layer, and the next step's
    logits are equal."""
    model = tiny_model("llama")
    ids = torch.randint(0, 512, (3, 150), generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        context = fp_context(model, ids[:, :-1])
        stored, logits = [], []
        for chunk_bytes in (2**30, 1):
            with quantized_cache(model, recipe_bundles[recipe]) as cache:
                cache.load(context, chunk_bytes=chunk_bytes)
                stored.append([store.read(b) for store, b in cache.stores()])
                logits.append(model(ids[:, -1:], **cache_argument(cache), use_cache=True).logits)
    assert len(stored[0]) == 3 * 2 * model.config.num_hidden_layers
    assert all(torch.equal(whole, chunked) for whole, chunked in zip(*stored))
    assert torch.equal(*logits)


def test_a_prefill_in_steps_gives_each_step_its_positions():
    """Bamba counts positions from 0 in a call given none: fp_context in steps of 7 tokens gives each step its own, so
    that its keys are rotated where one step rotates them."""
    model = tiny_model("bamba")
    ids = torch.randint(0, 512, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        whole, stepped = fp_context(model, ids), fp_context(model, ids, chunk=7)
    for ours, theirs in zip(stepped.keys + stepped.values, whole.keys + whole.values):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_an_fp_context_prefilled_in_steps_holds_every_token_of_a_sliding_layer(gemma3_bundles):
    """fp_context in steps of 7 tokens on the tiny Gemma 3 (a 16-token window): every layer holds all 49 tokens, as
    one step gives them, its cache continues with the model's own next-token logits, and a bundle's cache loading it
    drops what its sliding layer's window no longer needs."""
    model = tiny_model("gemma3_text")
    ids = torch.randint(0, 512, (1, 50), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        whole, stepped = fp_context(model, ids[:, :-1]), fp_context(model, ids[:, :-1], chunk=7)
        for ours, theirs in zip(stepped.keys + stepped.pre_rope_keys + stepped.values, whole.keys + whole.pre_rope_keys + whole.values):
            assert ours.shape == (1, 49, 32)
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
        next_token = model(ids[:, -1:], **cache_argument(stepped.cache), use_cache=True).logits[0, -1]
        torch.testing.assert_close(next_token, model(ids).logits[0, -1], rtol=0, atol=1e-5)
        with quantized_cache(model, gemma3_bundles["kvquant"]) as loaded:
            loaded.load(stepped)
            assert loaded.tokens() == [49] and loaded.layers[0].keys_store.count(0) == 15  # window - 1 kept


def test_a_context_without_the_recurrent_states_a_hybrid_model_keeps_is_refused():
    """A context of rows only (a benchmark's batched views) cannot continue Qwen3.5's DeltaNet layers: refused before
    anything is stored."""
    model = tiny_model("qwen3_5_text")
    with torch.inference_mode():
        context = fp_context(model, torch.randint(3, 512, (1, 12), generator=torch.Generator().manual_seed(0)))
        with quantized_cache(model, fp16_kivi_bundle(model)) as cache:
            with pytest.raises(KvcalError, match=r"holds rows only \(no cache\), none of the recurrent states of the "
                                                 r"model's layers \[0, 2\]; load a context made by fp_context"):
                cache.load(FpContext(context.keys, context.pre_rope_keys, context.values, None))
            assert cache.tokens() == [] and cache.lengths is None


def test_an_fp_context_prefilled_in_steps_across_longropes_switch_is_refused():
    """Its first steps would rotate by the short frequencies, the later ones by the long ones; the refusal leaves no
    hook on the model."""
    model = tiny_model("phi3", **longrope(16))
    ids = torch.randint(3, 512, (1, 24), generator=torch.Generator().manual_seed(0))
    with pytest.raises(KvcalError, match="give a prefill chunk of more than 16 tokens"):
        fp_context(model, ids, chunk=8)
    assert not any(module._forward_hooks for module in model.modules())
    assert len(fp_context(model, ids, chunk=17).values[0][0]) == 24


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "qwen3_5_text", "falcon_h1", "nemotron_h", "gemma3n_text",
                                        *known(("qwen4_exp_text",))])
def test_the_fp_model_goes_on_from_its_context_and_back_to_it(model_type):
    """FpContext.continued (passkey's fp answers): the fp model's greedy tokens after a context are those it gives the
    whole prompt, for two prompts in a row that end differently: after each block every layer of its cache holds the
    context again (Gemma 3's sliding layers, which fp_context left recording their past, put back as they were:
    transformers 5.17 decodes from none that records; Qwen3.5's DeltaNet states, which transformers' layers take back
    only while recording, put back as they were, its full layers taken back by their own length, which a recurrent
    first layer does not tell; Falcon-H1's Mamba 2 states, beside its attention layers' keys and values; Qwen4-Exp's
    indexer keys and positions; Nemotron-H's and Gemma 3n's caches with placeholder layers)."""
    model = tiny_model(model_type)
    ids = torch.randint(3, 500, (2, 40), generator=torch.Generator().manual_seed(2))
    ids[1, :-1] = ids[0, :-1]  # (one context, two last tokens)
    settings = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        context = fp_context(model, ids[:1, :-1])
        lengths = lambda: [int(layer.get_seq_length()) for layer in context.cache.layers  # noqa: E731
                           if hasattr(layer, "get_seq_length")]  # (placeholder layers hold nothing)
        held = lengths()
        for prompt in (ids[:1], ids[1:]):
            own = model.generate(input_ids=prompt, **settings)
            with context.continued() as cache:
                assert torch.equal(model.generate(input_ids=prompt, **cache_argument(cache), **settings), own)
            assert lengths() == held
