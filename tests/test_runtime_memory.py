"""kvcal.runtime.memory: bits are bytes. For every recipe, the effective bits `kvcal eval ppl` reports,
the bytes formula and the live cache agree exactly at the same length."""

import pytest
import torch

from helpers import decode_token_by_token
from helpers.tiny_models import MISTRAL_LARGE4, SPARSE_LATENTS, TINY_WINDOW, tiny_model
from kvcal import registry
from kvcal.adapters import adapt
from kvcal.bundle import LayerRecipe, load_bundle
from kvcal.evaluate import evaluate_ppl
from kvcal.methods import artifact_method
from kvcal.packing import OUTLIER_TILE_TOKENS
from kvcal.runtime.memory import cache_bytes
from kvcal.spans import AttentionSpan

TOKENS = 45  # past the tiny bundles' KIVI residual (8), SKVQ window (8) and KVmix blocks (32)
TILED_TOKENS = 2 * OUTLIER_TILE_TOKENS + 5  # three outlier tiles per KV head: offset tables of several entries
OUTLIER_RECIPES = ("kvquant", "mixed")


def assert_bits_are_bytes(bundle_path, tokens: int, keeps_outliers: bool, model_type: str = "llama", **overrides) -> None:
    model = tiny_model(model_type, **overrides)
    bundle = load_bundle(bundle_path)
    ids = torch.randint(0, 512, (1, tokens), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        _, simulated = evaluate_ppl(model, adapt(model), ids, [artifact_method(str(bundle.path))])
        _, cache = decode_token_by_token(model, bundle, ids)
    adapter = adapt(model)
    formula = cache_bytes(bundle.layers, adapter.kv_widths, tokens, cache.outliers(), step=1, kv_heads=adapter.kv_heads,
                          spans=adapter.spans, value_width=adapter.value_widths, index_bytes=adapter.index_bytes(model.dtype))
    # of K and V together (MLA's values are wider than its keys), and DeepSeek Sparse Attention's indexer keys
    tokens_stored = [layer.keys_store.count(0) for layer in cache.layers]
    kv_elements = sum(n * (key + value) for n, key, value in zip(tokens_stored, adapter.kv_widths, adapter.value_widths))
    index_elements = sum(n * index for n, index in zip(tokens_stored, adapter.index_widths))
    assert cache.used_bytes() == formula
    assert simulated.effective_bits == formula * 8 / (kv_elements + index_elements)
    assert simulated.outlier_fraction * kv_elements == cache.outliers()
    assert (cache.outliers() > 0) == keeps_outliers


@pytest.mark.parametrize("model_type", ["deepseek_v3", pytest.param("deepseek_v32", marks=SPARSE_LATENTS),
                                        pytest.param("mistral_large4", marks=MISTRAL_LARGE4)])
@pytest.mark.parametrize("recipe", registry.recipes())
def test_bits_are_bytes_for_latent_attention(architecture_bundles, recipe, model_type):
    """MLA's cache stores a rotated key of 64 channels and a latent of 96: the simulation's bits, the formula and the
    live cache count each at its own width; DeepSeek Sparse Attention's also its indexer's keys of 80 channels, as
    the model computes them (float32 here); Mistral Large 4's layer 1, without RoPE, no byte for its key."""
    assert_bits_are_bytes(architecture_bundles(model_type)[recipe], TOKENS, recipe in OUTLIER_RECIPES, model_type)


@MISTRAL_LARGE4
def test_bits_are_bytes_where_the_first_layer_stores_no_key(tiny_model_dir, tiny_corpus, tmp_path):
    """Mistral Large 4 with its first layer without RoPE (its fingerprint's head_dim then the next layer's): every
    recipe profiles, fits and counts what the cache stores; the nuq artifact evaluated alone counts the bits its
    kvquant bundle counts, none for that key."""
    from helpers.tiny_bundles import every_recipe

    first_without_rope = dict(no_rope_layers=[0, 1])
    fitted, bundles = every_recipe(tiny_model_dir("mistral_large4", **first_without_rope), tiny_corpus, tmp_path, latent=True)
    for recipe, path in bundles.items():
        assert_bits_are_bytes(path, TOKENS, recipe in OUTLIER_RECIPES, "mistral_large4", **first_without_rope)
    model = tiny_model("mistral_large4", **first_without_rope)
    ids = torch.randint(0, 512, (1, TOKENS), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        _, alone, bundled = evaluate_ppl(model, adapt(model), ids, [artifact_method(str(fitted["nuq"])),
                                                                     artifact_method(str(bundles["kvquant"]))])
    assert alone.effective_bits == bundled.effective_bits


@pytest.mark.parametrize("recipe", registry.recipes())
def test_eval_bits_the_formula_and_the_live_cache_agree(recipe_bundles, recipe):
    assert_bits_are_bytes(recipe_bundles[recipe], TOKENS, recipe in OUTLIER_RECIPES)


@pytest.mark.parametrize("recipe", OUTLIER_RECIPES)
def test_bits_are_bytes_over_several_outlier_tiles(recipe_bundles, recipe):
    assert_bits_are_bytes(recipe_bundles[recipe], TILED_TOKENS, True)


@pytest.mark.parametrize("bits", [5, 6, 7, 8])
def test_bits_are_bytes_for_5_to_8_bit_codes(wide_nuq_bundles, bits):
    assert_bits_are_bytes(wide_nuq_bundles[bits], TOKENS, True)
    layer = load_bundle(wide_nuq_bundles[bits]).layers[0]
    assert (layer.k_bits, layer.v_bits) == (bits, bits)


@pytest.mark.parametrize("recipe", registry.recipes())
@pytest.mark.parametrize("tokens", [TOKENS, TILED_TOKENS])
def test_bits_are_bytes_where_a_sliding_window_layer_drops_tokens(gemma3_bundles, recipe, tokens):
    """The tiny Gemma 3's sliding layer (a window of 16) holds only what its window needs, across outlier tiles: the
    simulation's bits, the formula and the live cache count the same bytes, at length TILED_TOKENS fewer than
    without the window (KVmix's 32-token key blocks leave whole, so at 45 tokens its layer has nothing to drop yet)."""
    assert_bits_are_bytes(gemma3_bundles[recipe], tokens, recipe in OUTLIER_RECIPES, "gemma3_text")
    layers = load_bundle(gemma3_bundles[recipe]).layers
    unwindowed = cache_bytes(layers, 32, TILED_TOKENS, step=1, kv_heads=2)
    assert cache_bytes(layers, 32, TILED_TOKENS, step=1, kv_heads=2, spans=[AttentionSpan(TINY_WINDOW), None]) < unwindowed


def test_bits_are_bytes_with_a_recent_fp16_window(windowed_kvquant_bundle):
    assert_bits_are_bytes(windowed_kvquant_bundle, TOKENS, True)
    assert load_bundle(windowed_kvquant_bundle).layers[0].window == 8


def test_the_formula_counts_every_outlier_byte_and_offset_entry():
    """A nuq layer keeping outliers: 4 bytes per outlier and per (KV head, started tile of body rows) entry."""
    layer = LayerRecipe("nuq", 3, 3, True, sink=1, outliers=0.01)
    without = cache_bytes([layer], 128, TILED_TOKENS, outliers=0, kv_heads=2)
    assert cache_bytes([layer], 128, TILED_TOKENS, outliers=10, kv_heads=2) == without + 10 * 4
    body, codes = TILED_TOKENS - 1, 128 * 3 // 8  # the sink token stays fp16; 3-bit codes in exactly 3 bits
    tables = 2 * 3 * 4  # per K/V: 2 KV heads x 3 started tiles x int32
    assert without == body * (codes + codes + 2 * 2) + 2 * tables + 2 * 128 * 2  # values add fp16 lo/hi per token


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ("kivi", "kvquant"))
def test_bits_are_bytes_where_a_chunked_layer_drops_its_chunks(architecture_bundles, recipe):
    """The tiny Llama 4's chunked layer (chunks of 16) lets each chunk go once the next begins: the simulation's bits,
    the formula and the live cache count the same bytes at TILED_TOKENS, where its first chunks are gone."""
    assert_bits_are_bytes(architecture_bundles("llama4_text")[recipe], TILED_TOKENS, recipe in OUTLIER_RECIPES, "llama4_text")
