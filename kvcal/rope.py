"""Rotary position embedding, rotate-half convention (the one Llama/Mistral/Qwen use in transformers).

Everything a consumer needs is `inv_freq` (head_dim/2 frequencies, scaling already folded in) and the
attention scaling factor of cos/sin, both stored in artifacts, so fitters and the runtime never need the model. Models
whose layers rotate with different frequencies (Gemma 3: local and global layers) store one row per layer: `inv_freq`
is (head_dim/2,) when every layer shares it, else (layers, head_dim/2), each row padded with zeros to the largest
where the layers' head_dim differ (Gemma 4); `layer_inv_freq` reads any. The scaling
likewise (OLMo 3: YaRN's on its full-attention layers only), read by `layer_rope_scaling`.

kvcal rotates channel j of a head with channel j + head_dim/2 by frequency j. Models that pair channels otherwise
(interleaved pairs 2i, 2i+1: Cohere, GLM; RoPE over the first channels of each head only: StableLM, Nemotron) are
read in that order: `rotate_half_order` gives, per head, the model's channel at each of kvcal's, the channels RoPE
leaves alone paired with a frequency of zero (the identity), and `in_order` / `rows_in_order` apply it. Scores are
unchanged when queries and keys are both reordered, so kvcal reorders both where they enter (kvcal.adapters), and the
model never sees the order.
"""

from __future__ import annotations

import functools

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


def rotate_half_order(head_dim: int, rotary_dims: int, interleaved: bool, swapped: bool = False) -> list[int] | None:
    """Per head, the model's channel at each of kvcal's positions, for a model that rotates its first `rotary_dims`
    channels in pairs (2i, 2i+1) (interleaved) or (i, i + rotary_dims/2) by frequency i and leaves the others alone; its
    frequencies padded with zeros to head_dim/2 (`padded_inv_freq`) then rotate as it does. `swapped`: the model
    rotates each pair by minus the angle (NanoChat's rotate_half), which is kvcal's rotation of the pair taken in the
    other order. None: the same order."""
    half, rest = rotary_dims // 2, (head_dim - rotary_dims) // 2
    if interleaved:
        first, second = range(0, rotary_dims, 2), range(1, rotary_dims, 2)
    else:
        first, second = range(half), range(half, rotary_dims)
    if swapped:
        first, second = second, first
    order = [*first, *range(rotary_dims, rotary_dims + rest), *second, *range(rotary_dims + rest, head_dim)]
    return None if order == list(range(head_dim)) else order


@functools.lru_cache(maxsize=64)
def _order_index(order: tuple[int, ...], device: str) -> torch.Tensor:
    return torch.tensor(order, device=device)


def in_order(heads: torch.Tensor, order: tuple[int, ...] | None) -> torch.Tensor:
    """heads (..., head_dim) with each head's channels taken in `order` (None: as they are). The index is made once per
    order and device: queries and keys are reordered at every decode step."""
    return heads if order is None else heads[..., _order_index(order, str(heads.device))]


def rows_in_order(rows: torch.Tensor, order: tuple[int, ...] | None) -> torch.Tensor:
    """in_order for (..., heads * head_dim) rows, the heads side by side."""
    return rows if order is None else in_order(rows.unflatten(-1, (-1, len(order))), order).flatten(-2)


def padded_inv_freq(inv_freq: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The rotate_half_order frequencies: inv_freq's over the rotated channels, zero over the ones RoPE leaves alone."""
    return torch.cat((inv_freq, inv_freq.new_zeros(head_dim // 2 - inv_freq.numel())))


def parity_merged(inv_freq: torch.Tensor, count: int) -> torch.Tensor:
    """inv_freq whose first `count` hold a run's even frequencies, then its odd ones (ERNIE 4.5 VL's rotary keeps its
    height and width sections so, its forward interleaving them back) -> that run in order, as the forward rotates."""
    merged = inv_freq.clone()
    merged[:count] = inv_freq[:count].view(2, count // 2).t().flatten()
    return merged


def layer_inv_freq(inv_freq: torch.Tensor, layer: int, head_dim: int) -> torch.Tensor:
    """Layer `layer`'s frequencies (head_dim/2,) from (head_dim/2,) shared by every layer or (layers, >= head_dim/2)."""
    return (inv_freq if inv_freq.dim() == 1 else inv_freq[layer])[: head_dim // 2]


def stored_inv_freq(per_layer: list[torch.Tensor]) -> torch.Tensor:
    """What artifacts store for these per-layer frequencies: one row when every layer has the same, else all rows,
    padded with zeros to the longest."""
    first = per_layer[0]
    if all(torch.equal(first, other) for other in per_layer[1:]):
        return first
    widest = 2 * max(row.numel() for row in per_layer)
    return torch.stack([padded_inv_freq(row, widest) for row in per_layer])


def layer_rope_scaling(rope_config: dict, layer: int) -> float:
    """Layer `layer`'s cos/sin scaling from an artifact's `rope` config: one number for every layer, or one a layer."""
    scaling = rope_config["attention_scaling"]
    return float(scaling[layer] if isinstance(scaling, list) else scaling)


def stored_rope_scaling(per_layer: list[float]) -> float | list[float]:
    """What artifacts record for these per-layer cos/sin scalings: one number when every layer has the same, else all."""
    return per_layer[0] if len(set(per_layer)) == 1 else per_layer
