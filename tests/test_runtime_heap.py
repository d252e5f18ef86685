"""kvcal.runtime.heap: an append of many rows on CPU (a prefill, WiredCache.load) hands the heap it freed back to
the system after each layer's part of the step; a smaller one and a decode step do not pay for it."""

import platform

import pytest
import torch

from helpers.tiny_bundles import kivi_bundle
from helpers.tiny_models import tiny_model
from kvcal.model_caches import cache_argument
from kvcal.runtime import heap, quantized_cache
from kvcal.runtime.fp_context import fp_context
from kvcal.runtime.layer import RuntimeLayer


def test_malloc_trim_is_found_where_the_c_library_is_glibc():
    assert (heap.MALLOC_TRIM is not None) == (platform.libc_ver()[0] == "glibc")


@pytest.fixture
def trims(monkeypatch) -> list:
    """The trims made (each still made where there is glibc)."""
    made, trim = [], heap.MALLOC_TRIM or (lambda pad: 0)
    monkeypatch.setattr(heap, "MALLOC_TRIM", lambda pad: made.append(pad) or trim(pad))
    return made


def test_an_append_of_a_layers_threshold_of_rows_trims_the_heap_after_each_layer(trims, monkeypatch):
    model = tiny_model("llama")
    layers, width = model.config.num_hidden_layers, model.config.num_key_value_heads * model.config.head_dim
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
            monkeypatch.setattr(heap, "RELEASE_AFTER_BYTES", 1)
            model(ids[:, 100:], **cache_argument(cache), use_cache=True)  # a decode step: none, whatever its rows
            assert trims == [0] * layers
        with quantized_cache(model, bundle) as cache:
            cache.load(fp_context(model, ids[:, :100]))
    assert trims == [0] * 2 * layers


def test_a_layer_whose_cache_others_read_trims_once_its_last_reader_has_read(trims, monkeypatch):
    """Gemma 4's KV sharing: a layer read by later ones keeps the step's reads until the last of them; its trim
    follows that reader, once per storing layer and step."""
    events = []
    for name, event in (("attend_as_reader", "read"), ("_release_after_step", "release")):
        def recorded(layer, *args, original=getattr(RuntimeLayer, name), event=event, **kwargs):
            events.append((event, layer.index))
            return original(layer, *args, **kwargs)
        monkeypatch.setattr(RuntimeLayer, name, recorded)
    monkeypatch.setattr(heap, "RELEASE_AFTER_BYTES", 1)
    model = tiny_model("gemma4_text")
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode(), quantized_cache(model, kivi_bundle(model, 2, 16, 8)) as cache:
        model(ids, **cache_argument(cache), use_cache=True)
    read = {index for event, index in events if event == "read"}
    assert read  # (the tiny model shares some layers' caches)
    released = [index for event, index in events if event == "release"]
    assert sorted(released) == [layer.index for layer in cache.attention_layers] and len(trims) == len(released)
    for index in read:
        assert events.index(("release", index)) > max(i for i, e in enumerate(events) if e == ("read", index))
