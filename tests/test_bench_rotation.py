"""The pure parts of benchmarks/bench_rotation.py: the rotated codec and the pre-RoPE error of post-RoPE keys. No
model is loaded."""

from __future__ import annotations

import pytest
import torch

from helpers import benchmark_script
from kvcal.quantizers import CodebookCodec, uniform_codebook
from kvcal.rope import rotate_keys
from kvcal.rotation_codecs import HadamardRotation

HEAD_DIM, HEADS = 16, 2


@pytest.fixture(scope="module")
def bench():
    with benchmark_script("bench_rotation") as module:
        yield module


def samples(rows: int = 200) -> torch.Tensor:
    return torch.randn(rows, HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.2, 3.0, HEADS * HEAD_DIM)


def test_the_rotated_codec_stores_what_its_inner_codec_stores_and_rotates_back(bench):
    x, rotation = samples(), HadamardRotation(HEAD_DIM, 0)
    inner = CodebookCodec(uniform_codebook(4), None, None, 0.01)
    got, want = bench.RotatedCodec(rotation, inner).quantize(x), inner.quantize(rotation.rotate(x))
    assert torch.equal(got.row_bits, want.row_bits) and torch.equal(got.row_outliers, want.row_outliers)
    torch.testing.assert_close(rotation.rotate(got.values), want.values, rtol=0, atol=1e-5)
    assert (got.values - x).abs().mean() < 0.2 * x.abs().mean()  # decoded in the original coordinates


def test_fit_rotated_beats_no_rotation_where_channels_differ_in_scale(bench):
    """Per-token thresholds waste codes on the small channels; the rotation evens them out."""
    x, rotation = samples(2000), HadamardRotation(HEAD_DIM, 0)
    codec = bench.fit_rotated(x, torch.ones_like(x), rotation, HEAD_DIM, False, 3)
    q = codec.quantize(x)
    plain = CodebookCodec(codec.inner.codebook, None, None, 0.01).quantize(x)
    assert ((q.values - x) ** 2).sum() < ((plain.values - x) ** 2).sum()


def test_the_pre_rope_error_of_post_rope_keys_is_their_error_rotated_back(bench):
    """RoPE rotates channel pairs, so with a uniform Fisher the pre-RoPE error equals the post-RoPE one; an exact
    codec has none."""
    k = samples()
    positions, inv_freq = torch.arange(k.shape[0]) * 37, 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    rope = (positions, HEADS, inv_freq, 1.0)
    codec = CodebookCodec(uniform_codebook(2), None, None, 0.0)
    post = rotate_keys(k, positions, HEADS, inv_freq)
    direct = float(((post - codec.quantize(post).values) ** 2).sum())
    assert bench.pre_rope_error(codec, k, torch.ones_like(k), rope) == pytest.approx(direct, rel=1e-4)
    exact = bench.RotatedCodec(HadamardRotation(HEAD_DIM, 0), CodebookCodec(uniform_codebook(8), None, None, 0.0))
    assert bench.pre_rope_error(exact, k, torch.ones_like(k), rope) < 1e-3 * direct
