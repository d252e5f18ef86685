"""The CPU decode-attention kernel (kvcal/runtime/cpu_kernel.py, kernels/decode_attention_cpu.cpp) against the
torch reference on the same packed stores: every codec and layout the kernels serve plus SKVQ's permuted
groups, fp16 sinks, windows and residuals, outliers, pre-RoPE keys at positions far from 0, ragged batches with
empty sequences, GQA groups, Cocktail's width groups and MLA's latent (values the query scores too), in every build
this machine runs and the x86-64 baseline. The whole cache path on CPU runs through it in
tests/test_runtime_cache.py (the `decode_path` fixture runs those tests on both paths)."""

import math
import platform
import shutil
import tracemalloc
import warnings

import pytest
import torch

from helpers import runnable_cpu_targets
from helpers.kernel_cases import (APPEND_CODECS, BATCHES, DECODE_CASES, G, HEAD_DIM, KV_HEADS, NARROW_CODECS, NARROW_ROWS, WIDTH,
                                  assert_append_matches_torch, cocktail_stores, compare, cpu_kernel_decode, equal_skvq_groups,
                                  filled, narrow_rows, seeded_tokens)
from kvcal.kv import SegmentPolicy
from kvcal.quantizers import ChannelBlockUniform, CodebookCodec, TokenUniform, normal_float_codebook
from kvcal.runtime import cpu_kernel, kernels, reference
from kvcal.runtime.segments import SegmentedStore, out_of_window
from kvcal.runtime.store import PackedRows
from kvcal.spans import AttentionSpan

SHORT = [1, 31, 33, 129, 300]
ON_CPU = dict(device="cpu", decode=cpu_kernel_decode, atol=1e-5, rtol=1e-5)  # float32 rounding of two summation orders


LONG = [1100, 513, 0, 64]  # several splits of a (sequence, KV head), a split's edge, an empty sequence


@pytest.fixture(scope="module", autouse=True, params=[pytest.param(t, marks=[] if t == "native" else pytest.mark.slow)
                                                      for t in runnable_cpu_targets()])
def build(request):
    """Every test of this module against each build of the kernels this machine runs (-march=native, and the AVX2
    build's 8-lane vectors too on an AVX-512 machine)."""
    patch = pytest.MonkeyPatch()
    patch.setenv(cpu_kernel.TARGET_VARIABLE, request.param)
    cpu_kernel.library.cache_clear()
    cpu_kernel.append_library.cache_clear()
    assert cpu_kernel.library() is not None, "the CPU kernel did not compile (see the warning)"
    yield request.param
    patch.undo()
    cpu_kernel.library.cache_clear()
    cpu_kernel.append_library.cache_clear()


@pytest.mark.parametrize("lengths", ("3", "short", "17", "long"))
@pytest.mark.parametrize("case", DECODE_CASES)
def test_cpu_decode_attention_matches_the_reference(case, lengths):
    lengths = {"short": SHORT, "long": LONG}.get(lengths) or BATCHES[lengths]
    (key_store, value_store), pre_rope = filled(case, lengths, device="cpu")
    assert cpu_kernel.decode_supported(key_store.body.codec, value_store.body.codec)
    compare(key_store, value_store, len(lengths), group=4, pre_rope=pre_rope, **ON_CPU)


@pytest.mark.parametrize("softcap", [0.3, 2.0, 50.0])
@pytest.mark.parametrize("case", ["kivi4-sink4", "nuq3-prerope-sink4-window", "skvq2-prerope-sink5-window"])
def test_cpu_decode_attention_soft_caps_scores_as_the_reference(case, softcap):
    """Gemma 2's capped scores (softcap tanh(score / softcap)): below, near and far above the scores' size here."""
    (key_store, value_store), pre_rope = filled(case, SHORT, device="cpu")
    capped = compare(key_store, value_store, len(SHORT), group=4, pre_rope=pre_rope, softcap=softcap, **ON_CPU)
    plain = compare(key_store, value_store, len(SHORT), group=4, pre_rope=pre_rope, **ON_CPU)
    assert (capped - plain).abs().max() > (1e-3 if softcap < 50 else 0)


@pytest.mark.parametrize("case", ["nuq3-prerope-sink4-window", "nuq4-prerope-crowded-outliers", "kivi4-sink4", "skvq2-prerope-sink5-window"])
def test_cpu_decode_attention_reads_stores_that_dropped_their_first_tokens(case):
    """Three sequences past a 64-token sliding window: their sinks and the body rows before it dropped (whole blocks),
    the storage compacted and given back (the tiles that left took their outliers along); the kernel reads each body
    from its first live row, with RoPE from the first kept position, as the reference reads the stores."""
    (key_store, value_store), pre_rope = filled(case, [600, 300, 70], device="cpu")
    block = math.lcm(key_store.body.block, value_store.body.block)
    dropped = out_of_window(key_store, value_store, AttentionSpan(64))
    for store in (key_store, value_store):
        capacity = store.body.words.shape[1]
        store.drop(dropped)
        assert store.body.words.shape[1] < capacity and store.body.head[0] < store.body.dropped[0]  # compacted, given back
    assert all(key_store.count(b) <= min(n, 64 + block + 128) for b, n in enumerate([600, 300, 70]))  # window, block, fp16 recent
    compare(key_store, value_store, 3, group=4, pre_rope=pre_rope, **ON_CPU)


@pytest.mark.parametrize("group", (1, 3, 8, 12))
def test_cpu_decode_attention_serves_any_gqa_group(group):
    (key_store, value_store), pre_rope = filled("nuq4-prerope-crowded-outliers", BATCHES["3"], device="cpu")
    compare(key_store, value_store, 3, group=group, pre_rope=pre_rope, **ON_CPU)


@pytest.mark.parametrize("case", ("nuq3-prerope-sink4-window", "kivi2"))
def test_cpu_decode_attention_gives_the_same_bits_on_any_number_of_threads(case):
    """Work is split by tokens, not by threads, and folded in a fixed order: 1, 2 and 3 threads give the same output."""
    (key_store, value_store), pre_rope = filled(case, LONG, device="cpu")
    query = torch.randn(len(LONG), 2 * KV_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(3))
    launches = [kernels.Segments(k, v) for k, v in zip(key_store.kernel_segments(), value_store.kernel_segments())]
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)) if pre_rope else None
    threads = torch.get_num_threads()
    outputs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outputs.append(cpu_kernel_decode(query, launches, KV_HEADS, HEAD_DIM**-0.5, [5] * len(LONG), inv_freq))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outputs[0], outputs[1]) and torch.equal(outputs[0], outputs[2])


# MLA's cache (kvcal.adapters.LatentAttention) at DeepSeek-V3's widths: one KV head, a rotated key of 64 channels, a
# latent of 512 that the query's latent part scores beside the key's scores and that the heads' outputs average
ROPE_DIM, LATENT_DIM = 64, 512
LATENT_CASES = {
    "kivi2": lambda: (ChannelBlockUniform(2, 32), TokenUniform(2, 32), SegmentPolicy(residual=128, key_block=32), False),
    "nuq3-prerope-outliers-sink4-window": lambda: (
        CodebookCodec(normal_float_codebook(3), -2.5 * torch.ones(ROPE_DIM), 2.5 * torch.ones(ROPE_DIM), outlier_fraction=0.01),
        CodebookCodec(normal_float_codebook(3), None, None, outlier_fraction=0.01), SegmentPolicy(sink=4, window=64), True),
    "skvq2-prerope-sink5-window": lambda: (equal_skvq_groups(ROPE_DIM, 2, 2), equal_skvq_groups(LATENT_DIM, 8, 2, seed=1),
                                           SegmentPolicy(sink=5, window=64), True),
}


def latent_stores(case: str, lengths: list[int]):
    """The rotated keys' and the latents' stores of `case` holding len(lengths) sequences (a prefill, then 3 decode
    appends each), and whether the keys are stored before RoPE."""
    key_codec, latent_codec, policy, pre_rope = LATENT_CASES[case]()
    stores = [SegmentedStore(codec, policy, keys, 0.0, len(lengths), width, "cpu", None, cpu_kernel.append_encoder, width)
              for codec, keys, width in ((key_codec, True, ROPE_DIM), (latent_codec, False, LATENT_DIM))]
    for b, n in enumerate(lengths):
        for store, seed in zip(stores, (2 * b, 2 * b + 1)):
            x = torch.randn(n, store.body.width, generator=torch.Generator().manual_seed(seed)).half()
            if n > 3:
                store.append(b, x[: n - 3])
            for t in range(max(0, n - 3), n):
                store.append(b, x[t : t + 1])
    return stores, pre_rope


@pytest.mark.parametrize("heads", (1, 16, 20))
@pytest.mark.parametrize("lengths", ("short", "long"))
@pytest.mark.parametrize("case", LATENT_CASES)
def test_cpu_decode_attention_scores_mla_latents_as_the_reference(case, lengths, heads):
    """The query's rotated part scores the keys and its latent part the latents (the values), summed: the reference's
    one attention over keys and latents side by side; every head's output a (512,) average of latents."""
    assert_latent_decode_matches_the_reference(case, {"short": SHORT, "long": LONG}[lengths], heads)


def assert_latent_decode_matches_the_reference(case: str, lengths: list[int], heads: int) -> None:
    (key_store, latent_store), pre_rope = latent_stores(case, lengths)
    batch, scaling = len(lengths), 192**-0.5
    query = torch.randn(batch, heads, ROPE_DIM + LATENT_DIM, generator=torch.Generator().manual_seed(4))
    offsets = [(37_000 * b) % 100_003 for b in range(batch)]
    inv_freq = 1.0 / 10000 ** (torch.arange(0, ROPE_DIM, 2, dtype=torch.float32) / ROPE_DIM)
    rope = None
    if pre_rope:
        positions = torch.arange(max(lengths))[None, :] + torch.tensor(offsets)[:, None]
        rope = cpu_kernel.half_rope_tables(*reference.rope_tables(positions, inv_freq, 1.0))
    launches = [kernels.Segments(k, v) for k, v in zip(key_store.kernel_segments(), latent_store.kernel_segments())]
    got = cpu_kernel.decode_attention(query, launches, 1, scaling, rope, value_dim=LATENT_DIM, values_scored=True)
    assert got.shape == (batch, heads, LATENT_DIM)
    for b in range(batch):
        keys = reference.stored_keys(key_store, b, pre_rope, offsets[b], inv_freq, 1.0, 1)
        latents = latent_store.read(b)
        expected = (reference.attention(query[b][:, None], torch.cat([keys, latents], -1), latents, scaling)[:, 0]
                    if len(keys) else torch.zeros(heads, LATENT_DIM))
        torch.testing.assert_close(got[b], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # (two more builds of the kernels on a cold build cache)
def test_the_kernels_build_for_the_x86_64_baseline_and_decode_as_the_reference(build, monkeypatch):
    """-march=x86-64 (SSE2: no register holds a vector of 8 floats, so the source keeps to what compiles without one)
    builds both kernels, and the decode kernel so built gives the reference's output, MLA's latent scored too."""
    if build != "native" or platform.machine() != "x86_64":
        pytest.skip("one build of the baseline, on x86-64")
    monkeypatch.setenv(cpu_kernel.TARGET_VARIABLE, "x86-64")
    cpu_kernel.library.cache_clear()
    cpu_kernel.append_library.cache_clear()
    try:
        assert cpu_kernel.library() is not None and cpu_kernel.append_library() is not None
        (key_store, value_store), pre_rope = filled("nuq3-prerope-sink4-window", SHORT, device="cpu")
        compare(key_store, value_store, len(SHORT), group=4, pre_rope=pre_rope, **ON_CPU)
        assert_latent_decode_matches_the_reference("nuq3-prerope-outliers-sink4-window", SHORT, 16)
    finally:
        cpu_kernel.library.cache_clear()
        cpu_kernel.append_library.cache_clear()


def test_cpu_cocktail_width_groups_chain_into_one_softmax():
    stores, batch = cocktail_stores(device="cpu")
    compare(*stores, batch, group=2, pre_rope=False, **ON_CPU)


@pytest.mark.parametrize("name", APPEND_CODECS)
def test_the_cpu_append_writes_what_the_torch_encoder_writes(name):
    assert cpu_kernel.append_library() is not None
    assert_append_matches_torch(name, device="cpu", encoder_for=cpu_kernel.append_encoder)


@pytest.mark.parametrize("name", ["codebook-token-3", "codebook-token-4-fifth-outliers", "codebook-channel-3"])
def test_the_cpu_append_writes_rows_with_a_nan_or_infinities_as_the_torch_encoder(name):
    """A NaN makes a row's thresholds NaN and its codes the last (torch's quantile and bucketize), and infinities on one
    side make its quantile NaN (inf - inf): not thresholds saturated to -65504 that turn every element into an
    outlier."""
    x = seeded_tokens(12 * G, 7)
    x[3, 5] = float("nan")  # in the bulk append
    x[100, [7, 9]] = float("inf")
    x[101, [2, 11]] = -float("inf")
    x[9 * G, 0] = float("nan")  # in a one-token append
    assert_append_matches_torch(name, device="cpu", encoder_for=cpu_kernel.append_encoder, x=x)


@pytest.mark.parametrize(("width", "head_dim"), NARROW_ROWS.values(), ids=NARROW_ROWS)
@pytest.mark.parametrize("name", NARROW_CODECS)
def test_the_cpu_codebook_append_writes_what_the_torch_encoder_writes_at_narrow_widths(name, width, head_dim):
    """Also where a quantile's two order statistics are far apart: ATen's lerp between them is one fused
    multiply-add."""
    assert_append_matches_torch(name, device="cpu", encoder_for=cpu_kernel.append_encoder, x=narrow_rows(width),
                                head_dim=head_dim)


@pytest.mark.parametrize("name", ["token-uniform-2", "codebook-channel-3"])
def test_a_bulk_append_lets_go_of_its_row_index(name):
    """A prefill's row index (12 bytes per row and KV head) is not kept beside the codes after it (numpy's allocations
    are the ones tracemalloc sees, torch's are not)."""
    codec = APPEND_CODECS[name]()
    store = PackedRows(codec, 2, WIDTH, "cpu", cpu_kernel.append_encoder, None, HEAD_DIM)
    tokens, tracing = seeded_tokens(4096, 0), tracemalloc.is_tracing()
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        store.append(1, tokens)
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        if not tracing:
            tracemalloc.stop()
    assert store.length[1] == 4096 and kept < 4096 * KV_HEADS * 12 / 8


def test_what_the_cpu_kernel_does_not_serve_is_left_to_the_reference():
    from kvcal.fit.skvq import SkvqTensor

    skvq = dict(permutation=torch.arange(8, dtype=torch.int32), starts=torch.tensor([0, 8], dtype=torch.int32), clip=torch.ones(1))
    codebook = CodebookCodec(normal_float_codebook(3), None, None, outlier_fraction=0.01)
    assert cpu_kernel.decode_supported(TokenUniform(2, 32), codebook)
    assert cpu_kernel.decode_supported(SkvqTensor(**skvq, bits=2, fp8=False), SkvqTensor(**skvq, bits=4, fp8=True))
    assert not cpu_kernel.decode_supported(codebook, SkvqTensor(**skvq, bits=1.5, fp8=False))  # ternary values


def test_the_library_is_built_once_per_source_and_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCAL_CACHE_DIR", str(tmp_path))
    first = cpu_kernel.library.__wrapped__()
    built = list(tmp_path.iterdir())
    assert first is not None and len(built) == 1 and built[0].name.startswith("decode_attention_cpu-")
    stamp = built[0].stat().st_mtime_ns
    assert cpu_kernel.library.__wrapped__() is not None
    assert list(tmp_path.iterdir()) == built and built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt


def test_without_a_compiler_or_when_switched_off_the_reference_serves(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCAL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KVCAL_CPU_KERNEL", "0")
    assert cpu_kernel.library.__wrapped__() is None
    monkeypatch.setenv("KVCAL_CPU_KERNEL", "1")
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cpu_kernel.library.__wrapped__() is None
    assert any("no C++ compiler" in str(w.message) for w in caught)
    assert not list(tmp_path.iterdir())
