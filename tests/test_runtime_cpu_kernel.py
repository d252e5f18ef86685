"""The CPU decode-attention kernel (kvcal/runtime/cpu_kernel.py, kernels/decode_attention_cpu.cpp) against the
torch reference on the same packed stores: every codec and layout the kernels serve plus SKVQ's permuted
groups, fp16 sinks, windows and residuals, outliers, pre-RoPE keys at positions far from 0, ragged batches with
empty sequences, GQA groups and Cocktail's width groups. The whole cache path on CPU runs through it in
tests/test_runtime_cache.py (the `decode_path` fixture runs those tests on both paths)."""

import shutil
import warnings

import pytest
import torch

from helpers.kernel_cases import (BATCHES, CPU_APPEND_CODECS, CPU_CASES, assert_append_matches_torch, cocktail_stores, compare,
                                  cpu_kernel_decode, filled)
from kvcal.quantizers import CodebookCodec, TokenUniform, normal_float_codebook
from kvcal.runtime import cpu_kernel

SHORT = [1, 31, 33, 129, 300]
ON_CPU = dict(device="cpu", decode=cpu_kernel_decode, atol=1e-5, rtol=1e-5)  # float32 rounding of two summation orders


@pytest.fixture(scope="module", autouse=True)
def compiled():
    assert cpu_kernel.library() is not None, "the CPU kernel did not compile (see the warning)"


@pytest.mark.parametrize("lengths", ("3", "short", "17"))
@pytest.mark.parametrize("case", CPU_CASES)
def test_cpu_decode_attention_matches_the_reference(case, lengths):
    lengths = SHORT if lengths == "short" else BATCHES[lengths]
    (key_store, value_store), pre_rope = filled(case, lengths, device="cpu")
    assert cpu_kernel.decode_supported(key_store.body.codec, value_store.body.codec)
    compare(key_store, value_store, len(lengths), group=4, pre_rope=pre_rope, **ON_CPU)


@pytest.mark.parametrize("group", (1, 3, 8, 12))
def test_cpu_decode_attention_serves_any_gqa_group(group):
    (key_store, value_store), pre_rope = filled("nuq4-prerope-crowded-outliers", BATCHES["3"], device="cpu")
    compare(key_store, value_store, 3, group=group, pre_rope=pre_rope, **ON_CPU)


def test_cpu_cocktail_width_groups_chain_into_one_softmax():
    stores, batch = cocktail_stores(device="cpu")
    compare(*stores, batch, group=2, pre_rope=False, **ON_CPU)


@pytest.mark.parametrize("name", CPU_APPEND_CODECS)
def test_the_cpu_append_writes_what_the_torch_encoder_writes(name):
    assert cpu_kernel.append_library() is not None
    assert_append_matches_torch(name, device="cpu", encoder=cpu_kernel.CpuAppend)


def test_what_the_cpu_kernel_does_not_serve_is_left_to_the_reference():
    from kvcal.skvq import SkvqTensor

    skvq = dict(permutation=torch.arange(8, dtype=torch.int32), starts=torch.tensor([0, 8], dtype=torch.int32), clip=torch.ones(1))
    codebook = CodebookCodec(normal_float_codebook(3), None, None, outlier_fraction=0.01)
    assert cpu_kernel.decode_supported(TokenUniform(2, 32), codebook)
    assert cpu_kernel.decode_supported(SkvqTensor(**skvq, bits=2, fp8=False), SkvqTensor(**skvq, bits=4, fp8=False))
    assert not cpu_kernel.decode_supported(SkvqTensor(**skvq, bits=2, fp8=True), codebook)  # fp8 parameters
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
