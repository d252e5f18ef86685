"""kvcal.runtime.heap: on CPU the cache hands the heap back to the system where the resident set grew since the last
trim, checked after each layer's part of a step of several tokens (a prefill, WiredCache.load) and at every step's
start (what the last step freed after its last attention); a heap that does not grow is not trimmed."""

import functools
import itertools
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
    """The trims made (each still made where there is glibc), from a base of none trimmed."""
    made, trim = [], heap.MALLOC_TRIM or (lambda pad: 0)
    monkeypatch.setattr(heap, "MALLOC_TRIM", lambda pad: made.append(pad) or trim(pad))
    monkeypatch.setattr(heap, "_resident_after_trim", 0)
    return made


@pytest.fixture
def growing(monkeypatch):
    """A resident set that grows past the threshold between any two reads: every check trims."""
    monkeypatch.setattr(heap, "resident_bytes", functools.partial(next, itertools.count(2**40, 2**40)))


def test_a_check_trims_once_the_resident_set_grew_by_the_threshold_since_the_last_trim(trims, monkeypatch):
    mib = 2**20
    reads = iter([100 * mib, 100 * mib,  # grown from none trimmed: trims; the resident set after it
                  131 * mib, 132 * mib, 90 * mib,  # 31 MiB grown: none; 32: trims
                  95 * mib, 80 * mib,  # none; a smaller one lowers the base
                  112 * mib, 50 * mib,  # 32 MiB over the lowered base: trims
                  None, "not read"])  # unreadable: none
    monkeypatch.setattr(heap, "resident_bytes", lambda: next(reads))
    monkeypatch.setattr(heap, "RELEASE_AFTER_GROWTH", 32 * mib)
    trimmed_after = []
    for _ in range(7):
        heap.release_if_grown(torch.device("cpu"))
        trimmed_after.append(len(trims))
    assert trimmed_after == [1, 1, 2, 2, 2, 3, 3]
    heap.release_if_grown(torch.device("meta"))  # not host memory: not even read
    assert next(reads) == "not read"


def test_a_prefill_checks_after_each_layer_a_decode_step_at_its_start_a_load_after_each_layer(trims, growing,
                                                                                              monkeypatch):
    model = tiny_model("llama")
    layers = model.config.num_hidden_layers
    ids = torch.randint(0, 512, (2, 101), generator=torch.Generator().manual_seed(0))
    bundle = kivi_bundle(model, 2, 16, 8)
    with torch.inference_mode():
        with quantized_cache(model, bundle) as cache:
            model(ids[:, :100], **cache_argument(cache), use_cache=True)
            assert len(trims) == 1 + layers  # the step's start, then each layer's part
            model(ids[:, 100:], **cache_argument(cache), use_cache=True)
            assert len(trims) == 2 + layers  # a decode step: at its start alone
        with quantized_cache(model, bundle) as cache:
            cache.load(fp_context(model, ids[:, :100]))
        assert len(trims) == 2 + 2 * layers
        monkeypatch.setattr(heap, "resident_bytes", lambda: 2**20)  # a heap that does not grow: no trim
        with quantized_cache(model, bundle) as cache:
            model(ids[:, :100], **cache_argument(cache), use_cache=True)
            model(ids[:, 100:], **cache_argument(cache), use_cache=True)
    assert len(trims) == 2 + 2 * layers


def test_a_layer_whose_cache_others_read_trims_once_its_last_reader_has_read(trims, growing, monkeypatch):
    """Gemma 4's KV sharing: a layer read by later ones keeps the step's reads until the last of them; its trim
    follows that reader, once per storing layer and step."""
    events = []
    for name, event in (("attend_as_reader", "read"), ("_release_after_step", "release")):
        def recorded(layer, *args, original=getattr(RuntimeLayer, name), event=event, **kwargs):
            events.append((event, layer.index))
            return original(layer, *args, **kwargs)
        monkeypatch.setattr(RuntimeLayer, name, recorded)
    model = tiny_model("gemma4_text")
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode(), quantized_cache(model, kivi_bundle(model, 2, 16, 8)) as cache:
        model(ids, **cache_argument(cache), use_cache=True)
    read = {index for event, index in events if event == "read"}
    assert read  # (the tiny model shares some layers' caches)
    released = [index for event, index in events if event == "release"]
    assert sorted(released) == [layer.index for layer in cache.attention_layers]
    assert len(trims) == 1 + len(released)  # (and the step's start)
    for index in read:
        assert events.index(("release", index)) > max(i for i, e in enumerate(events) if e == ("read", index))
