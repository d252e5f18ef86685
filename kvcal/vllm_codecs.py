"""vLLM's per-token-head KV cache dtypes (`--kv-cache-dtype`) as kvcal codecs, with the arithmetic of vLLM's own
kernels, for `eval ppl` (vLLM caches keys after RoPE; the model's dtype, what the kernels read and the rotation is
cast back to, is fp16 here, as kvcal's cache holds fp16). Tensors are (tokens, kv_heads * head_dim), quantized per
(token, KV head); every codec gives `quantize` -> kvcal.quantizers.Quantized and `row_bits(channels)`.

- PerTokenHead("int8" | "fp8"): scale s = max(absmax / qmax, 1e-6) in fp32 per (token, KV head), q = x * (1 / s),
  int8: rounded half away from zero (+-0.5, then the int8 store truncates), clamped to [-128, 127]; fp8: clamped to
  +-448 and cast to e4m3 (round to nearest even); x^ = q * s. Codes and an fp32 scale per (token, KV head).
  Source: vllm/v1/attention/ops/triton_reshape_and_cache_flash.py @ 055e47c28003156421365af985d676fc921cb075
  (_reshape_cache_per_token_head; the +-0.5 since vLLM PR #45361: before it int8 truncated toward zero).
- Int4PerTokenHead: x rotated by vLLM's randomized Hadamard transform (fixed signs from a CPU generator seeded
  0x9E3779B9, the unnormalized Walsh-Hadamard butterfly in fp32) and cast to the model dtype; then per (token, KV
  head) s = max((max - min) / 15, 1e-6), zp = clamp(round(-min / s), 0, 15), q = clamp(round(x / s + zp), 0, 15)
  (round half away from zero); the stored fp32 scale carries zp in its low 4 mantissa bits, so the read uses s with
  them cleared: x^_rot = (q - zp) * s', x^ = signs * H(x^_rot) / head_dim. Two codes a byte and the fp32 word.
  Source: vllm/v1/attention/ops/int4_per_token_head.py @ 055e47c28003156421365af985d676fc921cb075.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvcal.errors import KvcalError
from kvcal.quantizers import CodecKind, Quantized

SCALE_FLOOR = 1e-6  # vLLM's floor of every per-token-head scale
FP32_BITS = 32
FP8_MAX = 448.0  # float8_e4m3fn (CUDA)
RHT_SEED = 0x9E3779B9  # vLLM's _get_rht_signs(d, round_idx=0)


def _per_head(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    tokens, channels = x.shape
    if channels % head_dim:
        raise KvcalError(f"{channels} channels are not whole KV heads of {head_dim}")
    return x.float().view(tokens, channels // head_dim, head_dim)


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """Triton's where(x >= 0, x + 0.5, x - 0.5) then a float -> int cast (truncation toward zero), in fp32."""
    return torch.where(x >= 0, x + 0.5, x - 0.5).trunc()


@dataclass(frozen=True)
class PerTokenHead:
    kind: ClassVar[CodecKind] = CodecKind.SIMULATED
    dtype: str  # "int8" or "fp8"
    head_dim: int
    block_tokens = 1
    bits = 8

    def row_bits(self, channels: int) -> float:
        return float(8 * channels + FP32_BITS * (channels // self.head_dim))

    def quantize(self, x: torch.Tensor) -> Quantized:
        heads = _per_head(x, self.head_dim)
        qmax = 127.0 if self.dtype == "int8" else FP8_MAX
        scale = torch.clamp(heads.abs().amax(-1, keepdim=True) / qmax, min=SCALE_FLOOR)
        q = heads * (1.0 / scale)
        if self.dtype == "int8":
            q = round_half_away(q).clamp(-128.0, 127.0)
        else:
            q = q.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
        values = (q * scale).view(x.shape)
        return Quantized(values, torch.full((x.shape[0],), self.row_bits(x.shape[1]), device=x.device))


def hadamard_butterfly(x: torch.Tensor) -> torch.Tensor:
    """vLLM's unnormalized Walsh-Hadamard transform over the last dimension (a power of two), its CPU tier: stages of
    (a + b, a - b) in the input's dtype."""
    d = x.shape[-1]
    h = 1
    while h < d:
        pairs = x.reshape(*x.shape[:-1], d // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack([a + b, a - b], dim=-2).reshape(*x.shape[:-1], d)
        h <<= 1
    return x


@functools.lru_cache(maxsize=None)
def rht_signs(head_dim: int) -> torch.Tensor:
    """vLLM's randomized Hadamard signs: +-1 from bernoulli(0.5) of a CPU generator seeded RHT_SEED."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(RHT_SEED)
    return 2.0 * torch.bernoulli(torch.full((head_dim,), 0.5), generator=generator) - 1.0


def without_low_mantissa(scale: torch.Tensor) -> torch.Tensor:
    """An fp32 scale with its low 4 mantissa bits cleared (where vLLM's int4 cache keeps the zero point)."""
    return (scale.view(torch.int32) & -16).view(torch.float32)


@dataclass(frozen=True)
class Int4PerTokenHead:
    head_dim: int
    kind: ClassVar[CodecKind] = CodecKind.SIMULATED
    block_tokens = 1
    bits = 4

    def __post_init__(self):
        if self.head_dim & (self.head_dim - 1):
            raise KvcalError(f"vLLM's int4_per_token_head rotates heads with a Hadamard transform: head_dim {self.head_dim} "
                             "is not a power of two")

    def row_bits(self, channels: int) -> float:
        return float(4 * channels + FP32_BITS * (channels // self.head_dim))

    def quantize(self, x: torch.Tensor) -> Quantized:
        signs = rht_signs(self.head_dim).to(x.device)
        rotated = hadamard_butterfly(_per_head(x, self.head_dim) * signs).to(torch.float16).float()
        low, high = rotated.amin(-1, keepdim=True), rotated.amax(-1, keepdim=True)
        scale = torch.clamp((high - low) / 15.0, min=SCALE_FLOOR)
        zero = round_half_away(-low / scale).clamp(0.0, 15.0)
        q = round_half_away(rotated * (1.0 / scale) + zero).clamp(0.0, 15.0)
        restored = (q - zero) * without_low_mantissa(scale)
        values = (hadamard_butterfly(restored) * signs / self.head_dim).view(x.shape)
        return Quantized(values, torch.full((x.shape[0],), self.row_bits(x.shape[1]), device=x.device))
