"""kvcal.runtime.memory: bits are bytes. For every recipe, the effective bits `kvcal eval ppl` reports,
the bytes formula and the live cache agree exactly at the same length."""

import pytest
import torch

from conftest import tiny_model
from helpers import decode_token_by_token
from kvcal import registry
from kvcal.adapters import adapt
from kvcal.bundle import load_bundle
from kvcal.evaluate import evaluate_ppl
from kvcal.methods import artifact_method
from kvcal.runtime.memory import cache_bytes

TOKENS = 45  # past the tiny bundles' KIVI residual (8), SKVQ window (8) and KVmix blocks (32)


@pytest.mark.parametrize("recipe", registry.recipes())
def test_eval_bits_the_formula_and_the_live_cache_agree(recipe_bundles, recipe):
    model = tiny_model("llama")
    bundle = load_bundle(recipe_bundles[recipe])
    ids = torch.randint(0, 512, (1, TOKENS), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        _, simulated = evaluate_ppl(model, adapt(model), ids, [artifact_method(str(bundle.path))])
        _, cache = decode_token_by_token(model, bundle, ids)
    width = 32
    formula = cache_bytes(bundle.layers, width, TOKENS, cache.outliers(), one_step=False)
    assert cache.used_bytes() == formula
    assert simulated.effective_bits == formula * 8 / (len(bundle.layers) * 2 * TOKENS * width)
    assert simulated.outlier_fraction * 2 * len(bundle.layers) * TOKENS * width == cache.outliers()
