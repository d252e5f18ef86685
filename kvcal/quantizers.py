"""Reference quantizers (torch, any device). Each returns the dequantized tensor and what storing it
costs, so that evaluation reports effective bits from what would really be stored.

- uniform asymmetric min-max quantization, per token (groups of G channels) or per channel (groups
  of G tokens);
- non-uniform (codebook) quantization of values normalized to [-1, 1];
- dense-and-sparse: per-vector thresholds, elements outside them kept exactly (fp16) as outliers.
Tensors are (tokens, channels): the channels of all KV heads of one token side by side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FP16_BITS = 16


@dataclass
class Quantized:
    """A quantized (tokens, channels) tensor: dequantized values, storage per token row (codes,
    per-row parameters, outliers) and per-tensor storage (thresholds, codebooks)."""

    values: torch.Tensor
    row_bits: torch.Tensor  # (tokens,)
    fixed_bits: float = 0.0
    outliers: int = 0


def _min_max_dequant(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int) -> torch.Tensor:
    levels = 2**bits - 1
    scale = ((hi - lo) / levels).clamp(min=1e-8)
    codes = torch.round((x - lo) / scale).clamp(0, levels)
    return codes * scale + lo


def uniform_per_token(x: torch.Tensor, bits: int, group: int) -> Quantized:
    """Asymmetric min-max per token over groups of `group` channels (the last group may be shorter).
    Each group stores an fp16 scale and zero."""
    tokens, channels = x.shape
    out = torch.empty_like(x)
    for start in range(0, channels, group):
        block = x[:, start : start + group]
        out[:, start : start + group] = _min_max_dequant(block, block.amin(1, keepdim=True), block.amax(1, keepdim=True), bits)
    groups = math.ceil(channels / group)
    return Quantized(out, torch.full((tokens,), float(bits * channels + 2 * FP16_BITS * groups)))


def uniform_per_channel(x: torch.Tensor, bits: int, group: int) -> Quantized:
    """Asymmetric min-max per channel over blocks of `group` consecutive tokens (KIVI keys). A trailing
    block of fewer than `group` tokens is not quantized (it stays in the fp16 residual) and is
    returned unchanged. Each block stores an fp16 scale and zero per channel."""
    tokens, channels = x.shape
    full = tokens - tokens % group
    out = x.clone()
    if full:
        blocks = x[:full].view(-1, group, channels)
        out[:full] = _min_max_dequant(blocks, blocks.amin(1, keepdim=True), blocks.amax(1, keepdim=True), bits).view(full, channels)
    per_row = bits * channels + 2 * FP16_BITS * channels / group
    return Quantized(out, torch.full((tokens,), float(per_row)))


def keep_fraction_quantiles(x: torch.Tensor, outlier_fraction: float, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Lower and upper thresholds along `dim`: percentiles 1-t and t with t = 1 - outlier_fraction/2
    (KVQuant); min and max when no outliers are kept."""
    if outlier_fraction == 0:
        return x.amin(dim), x.amax(dim)
    t = 1.0 - outlier_fraction / 2
    bounds = torch.quantile(x.float(), torch.tensor([1.0 - t, t], device=x.device), dim=dim)
    return bounds[0].to(x.dtype), bounds[1].to(x.dtype)


def normalize(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """x^ = (x - (hi+lo)/2) / ((hi-lo)/2): inliers land in [-1, 1]."""
    return (x - (hi + lo) / 2) / ((hi - lo) / 2).clamp(min=1e-8)


def denormalize(xhat: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    return xhat * ((hi - lo) / 2).clamp(min=1e-8) + (hi + lo) / 2


def nearest_codes(xhat: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Index of the nearest entry of a sorted codebook, by bucketing at the midpoints."""
    midpoints = (codebook[1:] + codebook[:-1]) / 2
    return torch.bucketize(xhat.contiguous(), midpoints.to(xhat.dtype))


def outlier_index_bits(channels: int) -> int:
    return max(1, math.ceil(math.log2(channels)))


def dense_and_sparse(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, codebook: torch.Tensor,
                     keep_outliers: bool) -> Quantized:
    """Codebook quantization of x normalized by (lo, hi). With keep_outliers, elements outside
    [lo, hi] are stored exactly (fp16 value + channel index, a per-token count); otherwise they are
    clamped to the nearest end of the codebook. lo/hi broadcast against x (per channel or per token)."""
    tokens, channels = x.shape
    bits = int(math.log2(codebook.numel()))
    xhat = normalize(x, lo, hi)
    dequant = denormalize(codebook[nearest_codes(xhat.clamp(-1, 1), codebook)], lo, hi)
    row_bits = torch.full((tokens,), float(bits * channels), device=x.device)
    if not keep_outliers:
        return Quantized(dequant, row_bits)
    outlier = xhat.abs() > 1
    per_row = outlier.sum(1)
    count_bits = math.ceil(math.log2(channels + 1))
    row_bits += per_row * (FP16_BITS + outlier_index_bits(channels)) + count_bits
    return Quantized(torch.where(outlier, x, dequant), row_bits, outliers=int(per_row.sum()))


def uniform_codebook(bits: int) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, 2**bits)


def normal_float_codebook(bits: int, offset: float = 0.9677) -> torch.Tensor:
    """NormalFloat (QLoRA): quantiles of N(0, 1), an exact zero, scaled to [-1, 1]."""
    half = 2 ** (bits - 1)
    positive = torch.special.ndtri(torch.linspace(offset, 0.5, half + 1, dtype=torch.float64)[:-1])
    negative = -torch.special.ndtri(torch.linspace(offset, 0.5, half, dtype=torch.float64)[:-1])
    values = torch.cat([positive, torch.zeros(1, dtype=torch.float64), negative]).sort().values
    return (values / values.abs().max()).float()
