import math

import torch

from kvcal.quantizers import (
    CodebookCodec,
    keep_fraction_quantiles,
    nearest_codes,
    normal_float_codebook,
    uniform_codebook,
    uniform_per_channel,
    uniform_per_token,
)


FP16_ROUNDING = 2e-3  # scale and zero are stored in fp16 (relative error 2^-11 each)


def data(tokens=64, channels=48, seed=0):
    return torch.randn(tokens, channels, generator=torch.Generator().manual_seed(seed)) * torch.linspace(0.1, 5, channels)


def test_uniform_per_token_error_is_within_half_a_step_and_groups_may_be_ragged():
    x = data()
    q = uniform_per_token(x, 4, 32)  # groups of 32 and 16 channels
    for start, end in ((0, 32), (32, 48)):
        block = x[:, start:end]
        step = (block.amax(1) - block.amin(1)) / 15
        assert torch.all((q.values[:, start:end] - block).abs() <= step[:, None] / 2 + FP16_ROUNDING * block.abs().amax(1, keepdim=True))
    assert torch.all(q.row_bits == 6 * 32 + 2 * 16 * 2)  # 48 four-bit codes in 6 int32 words, fp16 scale + zero per group
    whole = uniform_per_token(x, 4, 48).values  # one group: each token's minimum is its stored fp16 zero, exactly
    assert torch.equal(whole.amin(1), x.amin(1).half().float())


def test_uniform_per_channel_quantizes_whole_token_blocks_and_leaves_the_tail():
    x = data(tokens=70)
    q = uniform_per_channel(x, 2, 32)
    assert torch.equal(q.values[64:], x[64:])
    block = x[32:64]
    step = (block.amax(0) - block.amin(0)) / 3
    assert torch.all((q.values[32:64] - block).abs() <= step / 2 + FP16_ROUNDING * block.abs().amax(0))
    assert math.isclose(float(q.row_bits[0]), 3 * 32 + 32 * 48 / 32)  # 48 two-bit codes in 3 words


def test_nearest_codes_picks_the_closest_signpost():
    codebook = torch.tensor([-1.0, -0.2, 0.3, 1.0])
    x = torch.tensor([-5.0, -0.61, -0.59, 0.04, 0.06, 0.66, 0.64, 9.0])
    assert nearest_codes(x, codebook).tolist() == [0, 0, 1, 1, 2, 3, 2, 3]


def test_dense_and_sparse_keeps_outliers_exact_and_counts_their_storage():
    x = data()
    q = CodebookCodec(uniform_codebook(3), outlier_fraction=0.02).quantize(x)
    lo, hi = (t.half().float()[:, None] for t in keep_fraction_quantiles(x, 0.02, dim=1))  # stored in fp16
    outside = (x < lo) | (x > hi)
    assert torch.equal(q.row_outliers, outside.sum(1)) and int(outside.sum()) > 0
    assert torch.equal(q.values[outside], x[outside].half().float())
    expected_bits = 6 * 32 + 2 * 16 + outside.sum(1) * 32  # 48 three-bit codes in 2 planes3 units of 3 words, 4 bytes per outlier
    assert torch.equal(q.row_bits, expected_bits.float())
    clamped = CodebookCodec(uniform_codebook(3)).quantize(x)
    assert clamped.row_outliers is None and torch.all(clamped.values <= x.amax(1, keepdim=True) + 1e-2)


def test_quantiles_without_outliers_are_min_and_max():
    x = data()
    lo, hi = keep_fraction_quantiles(x, 0.0, dim=0)
    assert torch.equal(lo, x.amin(0)) and torch.equal(hi, x.amax(0))


def test_normal_float_codebooks_are_sorted_in_unit_range_with_an_exact_zero():
    for bits in (1, 2, 3, 4):
        codebook = normal_float_codebook(bits)
        assert codebook.numel() == 2**bits and torch.all(codebook[1:] > codebook[:-1])
        assert codebook.abs().max() == 1.0 and (codebook == 0).any()
