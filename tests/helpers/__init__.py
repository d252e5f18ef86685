"""Helpers shared by several test modules (test modules never import each other)."""

import collections
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from kvcal.adapters import adapt, decoder_of
from kvcal.model_caches import cache_argument
from kvcal.runtime import kernels, quantized_cache
from tools import kernel_emulation


BENCHMARK_RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
WIKITEXT_VALID = Path(__file__).resolve().parents[3] / "shared" / "data" / "wikitext-2" / "valid.txt"


def refused(main, arguments: list[str], monkeypatch, capsys) -> str:
    """The last stderr line of a benchmark's `main` run with these arguments, which must exit 2 and leave every file
    under benchmarks/results as it was."""
    before = {p.name: p.stat().st_mtime_ns for p in BENCHMARK_RESULTS.iterdir()}
    monkeypatch.setattr(sys, "argv", ["benchmark", *arguments])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2
    assert {p.name: p.stat().st_mtime_ns for p in BENCHMARK_RESULTS.iterdir()} == before
    return capsys.readouterr().err.strip().splitlines()[-1]


def skip_without_gxx() -> None:
    """Skips the calling test where no g++ builds the kernel emulation (tools.kernel_emulation)."""
    if kernel_emulation.compiler_missing():
        pytest.skip("the kernel emulation needs g++")


def emulator_library(driver: str, include_dirs: list[Path], name: str) -> Path:
    """tools.kernel_emulation.emulator_library (the C++ `driver` built with g++, cached by content), skipped where no
    g++ is."""
    skip_without_gxx()
    return kernel_emulation.emulator_library(driver, include_dirs, name)


AVX2_LEVEL = ("x86-64-v3", {"avx2", "fma", "bmi2", "f16c", "movbe"})  # the 8-lane build


def runnable_cpu_targets() -> list[str]:
    """The -march targets of the CPU kernels to test on this machine: native, and the AVX2 build where the CPU runs it
    and native is wider (AVX-512: 16 lanes; the AVX2 build has 8). No other width exists, so no other build."""
    try:
        flags = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split())
    except (OSError, StopIteration):
        flags = set()
    level, needs = AVX2_LEVEL
    return ["native", level] if needs <= flags and "avx512f" in flags else ["native"]


def requires_gpu(test):
    """Marks a test `gpu` (the GPU suite is `pytest -m gpu`) and skips it where there is no CUDA GPU or no CuPy."""
    ready = torch.cuda.is_available() and kernels.cuda_ready("cuda")
    return pytest.mark.gpu(pytest.mark.skipif(not ready, reason="needs a CUDA GPU and CuPy (pip install -e '.[gpu]')")(test))


def decoder_layers(model):
    """A model's decoder layers: its decoder's `layers` on most, `h` on GPT-2, `blocks` on DBRX."""
    decoder = decoder_of(model)
    return getattr(decoder, "layers", None) or getattr(decoder, "blocks", None) or decoder.h


def attention_module(decoder_layer):
    """A decoder layer's attention: self_attn on most models, self_attention on Falcon, attention on GPT-NeoX, attn on
    GPT-2 and (in its norm_attn_norm) DBRX, mixer on Nemotron-H."""
    block = getattr(decoder_layer, "norm_attn_norm", decoder_layer)
    return next(getattr(block, name) for name in ("self_attn", "self_attention", "attention", "attn", "mixer")
                if hasattr(block, name))


def attention_at(model, layer: int):
    """The attention of the cache's layer `layer`: decoder layer `layer`'s, or on LongCat-Flash, whose decoder layers
    each hold two (self_attn a list), the (layer % 2)-th of decoder layer layer // 2."""
    if model.config.get_text_config(decoder=True).model_type == "longcat_flash":
        return attention_module(decoder_layers(model)[layer // 2])[layer % 2]
    return attention_module(decoder_layers(model)[layer])


def decode_token_by_token(model, bundle, ids, cuda_layout: str = "rows"):
    """Logits of feeding `ids` one token at a time through the runtime cache (its CUDA stores in `cuda_layout`), each
    at its position (as generate() gives it: Bamba counts from 0 in a call given none, PaliGemma from 1)."""
    logits, first = [], adapt(model).first_position
    with quantized_cache(model, bundle, cuda_layout) as cache:
        for t in range(ids.shape[1]):
            position = torch.full((ids.shape[0], 1), first + t, device=ids.device)
            logits.append(model(ids[:, t : t + 1], **cache_argument(cache), use_cache=True, position_ids=position).logits[:, 0])
    return torch.stack(logits, dim=1), cache


def assert_a_pick_generates_the_models_tokens(model, dense, ids, mask=None, check=None, beams: bool = False) -> None:
    """generate() of 12 new tokens through a cache holding every token in fp16 gives `model`'s own tokens and logits
    (greedy; with `beams`, beam search too, which reorders the cache's sequences); check(cache, fp), inside the cache's
    block, asserts what it kept beside transformers' own output; `dense`, the same weights picking more tokens, gives
    other logits: the pick matters here."""
    from helpers.tiny_bundles import fp16_kivi_bundle

    masked = {} if mask is None else dict(attention_mask=mask)
    settings = dict(max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.inference_mode():
        fp = model.generate(input_ids=ids, **masked, **settings)
        with quantized_cache(model, fp16_kivi_bundle(model)) as cache:
            ours = model.generate(input_ids=ids, **masked, **cache_argument(cache), **settings)
            if check is not None:
                check(cache, fp)
        if beams:
            searched = dict(num_beams=2, max_new_tokens=8, do_sample=False, pad_token_id=0)
            fp_beams = model.generate(input_ids=ids, **masked, **searched)
            with quantized_cache(model, fp16_kivi_bundle(model)) as cache:
                assert torch.equal(model.generate(input_ids=ids, **masked, **cache_argument(cache), **searched), fp_beams)
        dense = dense.generate(input_ids=ids, **masked, **settings)
    assert torch.equal(ours.sequences, fp.sequences)
    torch.testing.assert_close(torch.stack(ours.logits), torch.stack(fp.logits), rtol=0, atol=1e-3)
    assert (torch.stack(dense.logits) - torch.stack(fp.logits)).abs().max() > 0.1


@contextmanager
def fed_in_steps(model, bundle, ids, mask, steps: list[int], cuda_layout: str = "rows", later_steps: str = "prefill"):
    """Within the block, (the logits of each step, the open cache) of feeding the left-padded (ids, mask) through a
    quantized cache (cuda_layout, later_steps: quantized_cache's) in steps of `steps` tokens, each token at its
    sequence's own position (as generate() gives them)."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits, first = [], 0
    with torch.inference_mode(), quantized_cache(model, bundle, cuda_layout, later_steps) as cache:
        for step in steps:
            part = slice(first, first + step)
            logits.append(model(ids[:, part], attention_mask=mask[:, : first + step], position_ids=positions[:, part],
                                **cache_argument(cache), use_cache=True).logits)
            first += step
        yield logits, cache


def logits_in_steps(model, bundle, ids, mask, steps: list[int], cuda_layout: str = "rows",
                    later_steps: str = "prefill") -> list[torch.Tensor]:
    """The logits of fed_in_steps."""
    with fed_in_steps(model, bundle, ids, mask, steps, cuda_layout, later_steps) as (logits, _):
        return logits


def assert_later_steps_read_as_decode_steps_like_one_token_steps(model, bundle, ids, mask, steps: list[int],
                                                                   atol: float = 1e-4, stored_atol: float = 1e-3) -> None:
    """On caches with later_steps="decode", feeding the left-padded (ids, mask) in `steps` gives the logits of a
    first step of steps[0] and then one-token steps (within atol: the decode path's float sums beside the torch
    reference's) and leaves the cache they leave (stored_state: segment lengths, RPC counts and outliers equal, tokens
    read back within stored_atol, as in assert_taking_back_leaves_a_shorter_steps_cache); with "prefill" the later
    steps' logits differ by more than 10 atol (their own tokens read fp16: the steps here move tokens to the body)."""
    results = []
    for later_steps, fed in (("decode", steps), ("decode", [steps[0]] + [1] * sum(steps[1:])), ("prefill", steps)):
        with fed_in_steps(model, bundle, ids, mask, fed, later_steps=later_steps) as (logits, cache):
            results.append((torch.cat(logits, 1)[:, steps[0]:], stored_state(cache)))
    (logits, state), (one_token_logits, one_token_state), (prefill_logits, _) = results
    torch.testing.assert_close(logits, one_token_logits, rtol=0, atol=atol)
    assert (prefill_logits - one_token_logits).abs().max() > 10 * atol
    assert len(state) == len(one_token_state)
    for got, want in zip(state, one_token_state):
        if isinstance(got, list) or got is None:
            assert got == want
        else:
            torch.testing.assert_close(got, want, rtol=0, atol=stored_atol)


def ways_of_decode_steps(monkeypatch) -> list:
    """A list that, while the patch lasts, gets True for each sequence's step read as decode steps on the kernels' way
    (reference.reread: a short step re-read) and False for each on the torch reference's
    (reference.decode_steps_attention)."""
    from kvcal.runtime import reference

    ways = []
    for name, kernels in (("reread", True), ("decode_steps_attention", False)):
        monkeypatch.setattr(reference, name, lambda *args, original=getattr(reference, name), kernels=kernels, **kwargs: (
            ways.append(kernels), original(*args, **kwargs))[1])
    return ways


def generate_taking_sequences(model, bundle, ids, mask, taken: list[int], cuda_layout: str = "rows") -> list[tuple]:
    """Two runs of generate() on the left-padded prompts (ids, mask) through a quantized cache, 4 new tokens then 8:
    one on a cache whose sequences `taken` are kept by batch_select_indices between the two calls (after decode
    steps), one on a cache fed those sequences from the start. Each run's (second generate's output, used_bytes,
    outliers, tokens): a cache whose sequences were taken holds what the fed one holds."""
    settings = dict(do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    grown = torch.cat([mask[taken], torch.ones(len(taken), 4, dtype=mask.dtype, device=mask.device)], 1)
    results = []
    with torch.inference_mode():
        for fed, edit in ((list(range(len(ids))), True), (taken, False)):
            with quantized_cache(model, bundle, cuda_layout) as cache:
                before = model.generate(input_ids=ids[fed], attention_mask=mask[fed], **cache_argument(cache),
                                        max_new_tokens=4, min_new_tokens=4, **settings)
                sequences = before.sequences
                if edit:
                    cache.batch_select_indices(torch.tensor(taken))  # (transformers' name: MiniMax's class has one too)
                    sequences = sequences[taken]
                after = model.generate(input_ids=sequences, attention_mask=grown, **cache_argument(cache),
                                       max_new_tokens=8, min_new_tokens=8, **settings)
                results.append((after, cache.used_bytes(), cache.outliers(), cache.tokens()))
    return results


def stored_state(cache) -> list:
    """Every store's segment lengths, RPC counts and outliers, each sequence's tokens as read back, every layer's indexer
    keys (a layer's as one tensor on the CPU)."""
    state = []
    for layer in cache.attention_layers:
        for store in (layer.keys_store, layer.values_store):
            if store is not None:
                state.append([list(counts) for counts in (store.rpc, store.sink.length, store.body.length, store.recent.length,
                                                          store.body.outliers)])
                state.extend(store.read(b).cpu() for b in range(len(store.rpc)))
        state.append(None if layer.index_keys is None else layer.index_keys.decoded().cpu())
    return state


def assert_taking_back_leaves_a_shorter_steps_cache(model, bundle, ids, prompt: int, cuda_layout: str = "rows",
                                                    step: int = 7) -> None:
    """crop(-3) after a prompt of `prompt` tokens of ids (none: the step is the first) and a step of `step` leaves the
    cache a step of step - 3 leaves (the count given as a tensor): every store's state (stored_state), then the logits and bytes of 8 decode steps.
    The tokens read back within 1e-3: the model's keys and values of a forward over 70 tokens and over 67 can differ
    in their last bit (BLAS blocking), one fp16 step of a stored token here."""
    results = []
    with torch.inference_mode():
        for fed, taken_back in ((step, 3), (step - 3, 0)):
            with quantized_cache(model, bundle, cuda_layout) as cache:
                if prompt:
                    model(ids[:, :prompt], **cache_argument(cache), use_cache=True)
                model(ids[:, prompt : prompt + fed], **cache_argument(cache), use_cache=True)
                cache.crop(torch.tensor(-taken_back))  # (a 0-dim tensor, as transformers before 5.18 passes it)
                state = stored_state(cache)
                logits = [model(ids[:, t : t + 1], **cache_argument(cache), use_cache=True).logits
                          for t in range(prompt + step - 3, prompt + step + 5)]
                results.append((state, torch.cat(logits, 1), cache.used_bytes(), cache.tokens()))
    (state, logits, *held), (shorter_state, shorter_logits, *shorter_held) = results
    assert held == shorter_held and len(state) == len(shorter_state)
    for got, want in zip(state, shorter_state):
        if isinstance(got, list) or got is None:
            assert got == want
        else:
            torch.testing.assert_close(got, want, rtol=0, atol=1e-3)
    torch.testing.assert_close(logits, shorter_logits, rtol=0, atol=1e-4)


def decode_step_operations(model, bundle, batch: int, prompt_tokens: int = 30) -> collections.Counter:
    """The torch operations called in one decode step after a prefill of `batch` sequences (torch.profiler on CPU:
    the top-level events; the events nested in them are ATen's own decomposition of an operation, which follows
    shapes and strides, e.g. a reshape is a view for one sequence and a copy for eight)."""
    ids = torch.randint(3, 512, (batch, prompt_tokens + 2), generator=torch.Generator().manual_seed(batch))
    with torch.inference_mode(), quantized_cache(model, bundle) as cache:
        model(ids[:, :prompt_tokens], **cache_argument(cache), use_cache=True)
        model(ids[:, prompt_tokens : prompt_tokens + 1], **cache_argument(cache), use_cache=True)  # the first decode step
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            model(ids[:, prompt_tokens + 1 :], **cache_argument(cache), use_cache=True)
    return collections.Counter(event.name for event in profile.events() if event.cpu_parent is None)


READS = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")


@contextmanager
def host_reads(monkeypatch):
    """Within the block, record every read of a tensor's values by the host (what waits for a GPU): the name of
    the function that made it, in a list."""
    callers = []
    for name in READS:
        original = getattr(torch.Tensor, name)

        def read(self, *args, original=original, **kwargs):
            callers.append(sys._getframe(1).f_code.co_name)
            return original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, read)
    try:
        yield callers
    finally:
        monkeypatch.undo()
