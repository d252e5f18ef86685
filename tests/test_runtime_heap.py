"""kvcal.runtime.heap: an append of many rows on CPU (a prefill, WiredCache.load) hands the heap it freed back to
the system after each layer; a smaller one and a decode step do not pay for it."""

import platform

import torch

from helpers.tiny_bundles import kivi_bundle
from helpers.tiny_models import tiny_model
from kvcal.model_caches import cache_argument
from kvcal.runtime import heap, quantized_cache
from kvcal.runtime.fp_context import fp_context


def test_malloc_trim_is_found_where_the_c_library_is_glibc():
    assert (heap.MALLOC_TRIM is not None) == (platform.libc_ver()[0] == "glibc")


def test_an_append_of_a_layers_threshold_of_rows_trims_the_heap_after_each_layer(monkeypatch):
    model = tiny_model("llama")
    layers, width = model.config.num_hidden_layers, model.config.num_key_value_heads * model.config.head_dim
    trims = []
    trim = heap.MALLOC_TRIM or (lambda pad: 0)
    monkeypatch.setattr(heap, "MALLOC_TRIM", lambda pad: trims.append(pad) or trim(pad))
    monkeypatch.setattr(heap, "RELEASE_AFTER_BYTES", 2 * 2 * 100 * 2 * width)  # 2 sequences of 100 tokens, K and V
    ids = torch.randint(0, 512, (2, 101), generator=torch.Generator().manual_seed(0))
    bundle = kivi_bundle(model, 2, 16, 8)
    with torch.inference_mode():
        with quantized_cache(model, bundle) as cache:
            model(ids[:, :99], **cache_argument(cache), use_cache=True)  # under the threshold
            assert trims == []
        with quantized_cache(model, bundle) as cache:
            model(ids[:, :100], **cache_argument(cache), use_cache=True)
            assert trims == [0] * layers
            model(ids[:, 100:], **cache_argument(cache), use_cache=True)  # a decode step
            assert trims == [0] * layers
        with quantized_cache(model, bundle) as cache:
            cache.load(fp_context(model, ids[:, :100]))
    assert trims == [0] * 2 * layers
