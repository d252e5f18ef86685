"""The torch reference of decode attention over the quantized cache: the specification the CUDA kernels
(kernels/) are tested against.

For one sequence: read each store (unpack the int32 words, decode with the codec's stored parameters,
add the sparse fp16 outliers, fp16 segments as they are), rotate pre-RoPE keys with each token's own
position, then softmax attention of the query heads, each KV head serving its group of query heads (GQA).
Query i of a step of m queries over n tokens sees tokens 0 .. n - m + i (causal within the step).
"""

from __future__ import annotations

import torch

from kvcal.rope import rotate_keys
from kvcal.simulate import per_query_head


def attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float) -> torch.Tensor:
    """query (heads, m, head_dim); keys, values (n, kv_heads * head_dim) float32 -> (heads, m, head_dim)."""
    heads, m, head_dim = query.shape
    n = keys.shape[0]
    kv_heads = keys.shape[1] // head_dim
    # SDPA computes the same softmax attention without materializing the (heads, m, n) scores; batched 4-D
    # inputs with is_causal or no mask take its fused path, the explicit mask covers a step over earlier tokens.
    query, keys, values = query.float()[None], per_query_head(keys, kv_heads, heads)[None], per_query_head(values, kv_heads, heads)[None]
    if m == n or m == 1:
        out = torch.nn.functional.scaled_dot_product_attention(query, keys, values, is_causal=m > 1, scale=scaling)
    else:
        visible = torch.arange(n, device=query.device)[None, :] <= (n - m + torch.arange(m, device=query.device))[:, None]
        out = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=visible, scale=scaling)
    return out[0]


def stored_keys(store, b: int, pre_rope: bool, position_offset: int, inv_freq: torch.Tensor, rope_scaling: float,
                kv_heads: int) -> torch.Tensor:
    """Sequence b's keys as attention reads them: dequantized, and rotated when stored pre-RoPE."""
    keys = store.read(b)
    if pre_rope:
        keys = rotate_keys(keys, store.positions(b) + position_offset, kv_heads, inv_freq, rope_scaling)
    return keys
