"""vLLM's FP8 (e4m3) KV-cache quantizer: each token's key and value stored once as fp8_e4m3(x / scale), saturated at
+-448, and read back as fp8 * scale, with one scale per layer or per KV head. Keys are post-RoPE: that is what vLLM
writes to the cache. Bit-identical to compressed-tensors' own `fake_quantize` for these schemes
(tests/test_export_fp8.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvcal.errors import KvcalError
from kvcal.quantizers import store_as

if TYPE_CHECKING:
    from kvcal.export.scales import ScaleFit

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


def fp8_fake_quantize(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """What vLLM's FP8 (e4m3) KV cache stores and reads back for x of shape (tokens, kv_heads * head_dim):
    fp8_e4m3(x / scale) * scale, saturated at +-448, computed in float32 and returned as float32.

    `scale` is a number or a tensor of 1 element (per tensor) or of num_kv_heads elements (per KV head,
    in head order; the exported [num_kv_heads, 1, 1] shape is accepted). Keys must be post-RoPE: that is
    what vLLM writes to the cache."""
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device).flatten()
    if x.dim() != 2:
        raise KvcalError(f"fp8_fake_quantize takes a (tokens, width) tensor, got shape {tuple(x.shape)}")
    tokens, width = x.shape
    heads = scale.numel()
    if heads == 0 or width % heads:
        raise KvcalError(f"{heads} scales do not divide a K/V width of {width} into heads")
    if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
        raise KvcalError(f"FP8 scales must be finite and positive, got {scale.tolist()}")
    per_head = scale[:, None]
    y = x.float().reshape(tokens, heads, width // heads) / per_head
    return (store_as(y, FP8_DTYPE).float() * per_head).reshape(tokens, width)


@dataclass(frozen=True)
class Fp8KvScales:
    """Per-layer FP8 K and V scales (1 element per layer, or one per KV head): the vLLM quantizer for
    simulation. `unit` is vLLM's default (scale 1.0); `of_fit` takes a fit's (or an export's) scales."""

    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor, ...]

    @classmethod
    def unit(cls, num_layers: int) -> Fp8KvScales:
        ones = tuple(torch.ones(1) for _ in range(num_layers))
        return cls(ones, ones)

    @classmethod
    def of_fit(cls, fit: ScaleFit) -> Fp8KvScales:
        return cls(tuple(layer.k for layer in fit.layers), tuple(layer.v for layer in fit.layers))

    def keys(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Fake-quantize post-RoPE keys (tokens, width) of `layer`."""
        return fp8_fake_quantize(x, self.k[layer])

    def values(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return fp8_fake_quantize(x, self.v[layer])
