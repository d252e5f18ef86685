"""Rotary position embedding, rotate-half convention (the one Llama/Mistral/Qwen use in transformers).

Everything a consumer needs is `inv_freq` (head_dim/2 frequencies, scaling already folded in) and the
attention scaling factor of cos/sin, both stored in artifacts, so fitters and the runtime never need the model. Models
whose layers rotate with different frequencies (Gemma 3: local and global layers) store one row per layer: `inv_freq`
is (head_dim/2,) when every layer shares it, else (layers, head_dim/2); `layer_inv_freq` reads either. The scaling
likewise (OLMo 3: YaRN's on its full-attention layers only), read by `layer_rope_scaling`.
"""

from __future__ import annotations

import torch


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0):
    """cos, sin of shape positions.shape + (head_dim,), float32."""
    angles = positions.to(torch.float32)[..., None] * inv_freq.to(device=positions.device, dtype=torch.float32)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos() * attention_scaling, angles.sin() * attention_scaling


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0):
    """Rotate x of shape (..., tokens, heads, head_dim) by the positions (..., tokens)."""
    cos, sin = rope_cos_sin(positions, inv_freq, attention_scaling)
    cos, sin = cos[..., None, :], sin[..., None, :]
    return (x.float() * cos + rotate_half(x.float()) * sin).to(x.dtype)


def rotate_keys(x: torch.Tensor, positions: torch.Tensor, heads: int, inv_freq: torch.Tensor, attention_scaling: float = 1.0):
    """apply_rope on (tokens, heads * head_dim) rows, the heads side by side, each token at its position."""
    tokens, width = x.shape
    return apply_rope(x.view(tokens, heads, width // heads), positions, inv_freq, attention_scaling).reshape(tokens, width)


def layer_inv_freq(inv_freq: torch.Tensor, layer: int) -> torch.Tensor:
    """Layer `layer`'s frequencies from (head_dim/2,) shared by every layer or (layers, head_dim/2)."""
    return inv_freq if inv_freq.dim() == 1 else inv_freq[layer]


def stored_inv_freq(per_layer: list[torch.Tensor]) -> torch.Tensor:
    """What artifacts store for these per-layer frequencies: one row when every layer has the same, else all rows."""
    first = per_layer[0]
    return first if all(torch.equal(first, other) for other in per_layer[1:]) else torch.stack(per_layer)


def layer_rope_scaling(rope_config: dict, layer: int) -> float:
    """Layer `layer`'s cos/sin scaling from an artifact's `rope` config: one number for every layer, or one a layer."""
    scaling = rope_config["attention_scaling"]
    return float(scaling[layer] if isinstance(scaling, list) else scaling)


def stored_rope_scaling(per_layer: list[float]) -> float | list[float]:
    """What artifacts record for these per-layer cos/sin scalings: one number when every layer has the same, else all."""
    return per_layer[0] if len(set(per_layer)) == 1 else per_layer
