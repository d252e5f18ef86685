"""The torch reference of decode attention over the quantized cache: the specification the CUDA kernels
(kernels/) are tested against.

For one sequence: read each store (unpack the int32 words, decode with the codec's stored parameters,
add the sparse fp16 outliers, fp16 segments as they are), rotate pre-RoPE keys with each token's own
position, then softmax attention of the query heads, each KV head serving its group of query heads (GQA).
Query i of a step of m queries over n tokens sees tokens 0 .. n - m + i (causal within the step), or with a
sliding window of W tokens (Mistral, Qwen2) only n - m + i - W + 1 .. n - m + i, with attention chunks (Llama 4)
only those of its chunk (kvcal.spans.AttentionSpan), as transformers' mask does; with DeepSeek Sparse Attention only
those of them its indexer picked (`attention`'s `chosen`).

A decode step (one query per sequence) runs batched: `decode_attention` attends over every sequence's tokens
padded to the longest (the stores' `read_batch`) with a mask of each sequence's own tokens, keys rotated by
`rotate` with RoPE tables made once per step (`rope_tables`); it equals `attention` per sequence up to float
rounding of the softmax sums.

A step of several tokens over a stored cache whose decoder reads the stored tokens itself (kvcal.runtime.cache's
short steps) merges that attention with `own_attention` over the step's own tokens by their log-sum-exps
(`merge_attention`), which `attention` over both at once equals up to float rounding.

Attention sinks (gpt-oss: a learned logit per query head) join each row's softmax as one more score that reads no
value, and soft-capped scores (Gemma 2) are capped before the mask, as the models' own attention does
(`explicit_attention`); without either SDPA computes the softmax.
"""

from __future__ import annotations

import torch

from kvcal.kv import per_query_head, softcapped, softmax_with_sinks
from kvcal.rope import rope_cos_sin, rotate_keys
from kvcal.spans import AttentionSpan


# scores a step attending explicitly holds at once (float32): its queries are taken this many (heads x tokens) at a time
EXPLICIT_SCORES_PER_CHUNK = 2**24


def explicit_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, scaling: float,
                       sinks: torch.Tensor | None, softcap: float | None) -> torch.Tensor:
    """Softmax attention from its scores: soft-capped at `softcap` (None: not capped), then each row taking its head's
    sink logit as one more score, which reads no value (sinks (heads,), or None): query (..., heads, m, d), keys and
    values (..., heads, n, d), visible broadcasting to (..., heads, m, n)."""
    scores = softcapped(query @ keys.transpose(-1, -2) * scaling, softcap).masked_fill(~visible, float("-inf"))
    return softmax_with_sinks(scores, None if sinks is None else sinks.view(-1, 1, 1)) @ values


def attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
              span: AttentionSpan | None = None, sinks: torch.Tensor | None = None, softcap: float | None = None,
              ahead: torch.Tensor | None = None, first_position: int = 0,
              chosen: torch.Tensor | None = None) -> torch.Tensor:
    """query (heads, m, head_dim); keys, values (n, kv_heads * head_dim) float32 -> (heads, m, head_dim);
    span: the earlier tokens each query sees (a sliding window's, a chunk's), None: all before it; sinks: (heads,)
    attention sinks' logits; softcap: the scores' soft-cap. With either, the queries are taken a chunk at a time
    (EXPLICIT_SCORES_PER_CHUNK scores). ahead: (m, m), the step's tokens each query sees after itself as well (an
    image's, which Gemma 3 attends to both ways), None: none. first_position: the first key's position in its
    sequence (the tokens a span let go before it), which places chunks. chosen: (m, n), the tokens each query attends
    among those it sees (DeepSeek Sparse Attention's indexer's pick), None: all."""
    heads, m, head_dim = query.shape
    if span is not None and m == 1:  # decode: the span's tokens are the last ones
        first = max(span.first_seen(first_position + keys.shape[0] - 1) - first_position, 0)
        keys, values = keys[first:], values[first:]
        chosen = chosen[:, first:] if chosen is not None else None
        first_position += first
    n = keys.shape[0]
    banded = span is not None and m > 1 and span.first_seen(first_position + n - 1) > first_position
    kv_heads = keys.shape[1] // head_dim
    # SDPA computes the same softmax attention without materializing the (heads, m, n) scores; batched 4-D
    # inputs with is_causal or no mask take its fused path, the explicit mask covers a step over earlier tokens.
    query, keys, values = query.float()[None], per_query_head(keys, kv_heads, heads)[None], per_query_head(values, kv_heads, heads)[None]

    def visible(first: int, stop: int) -> torch.Tensor:
        """(stop - first, n): the tokens queries first .. stop - 1 of the step see."""
        tokens, last = torch.arange(n, device=query.device), (n - m + torch.arange(first, stop, device=query.device))[:, None]
        seen = span.sees(last[:, 0] + first_position, tokens + first_position) if banded else tokens <= last
        seen = seen if ahead is None else seen | torch.nn.functional.pad(ahead[first:stop], (n - m, 0))
        return seen if chosen is None else seen & chosen[first:stop]

    if sinks is not None or softcap is not None:
        chunk = max(1, EXPLICIT_SCORES_PER_CHUNK // (heads * n))
        outs = [explicit_attention(query[:, :, first : first + chunk], keys, values, visible(first, min(first + chunk, m)),
                                   scaling, sinks, softcap) for first in range(0, m, chunk)]
        return torch.cat(outs, 2)[0]
    if (m == n or m == 1) and not banded and ahead is None and chosen is None:
        out = torch.nn.functional.scaled_dot_product_attention(query, keys, values, is_causal=m > 1, scale=scaling)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=visible(0, m), scale=scaling)
    return out[0]


def own_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
                  softcap: float | None, seen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a step's m queries over the step's own m tokens alone, without sinks, per sequence: query (B,
    heads, m, d); keys (B, m, kv_heads * d), values (B, m, kv_heads * d_v) float32; seen (B, m, m): the tokens each
    query sees -> (out (B, heads, m, d_v), log-sum-exp of each row's scores (B, heads, m); a row that sees nothing:
    NaN and -inf), for `merge_attention`."""
    batch, heads, m, head_dim = query.shape
    kv_heads = keys.shape[-1] // head_dim
    keys = keys.view(batch, m, kv_heads, head_dim).transpose(1, 2).repeat_interleave(heads // kv_heads, 1)
    values = values.view(batch, m, kv_heads, -1).transpose(1, 2).repeat_interleave(heads // kv_heads, 1)
    scores = softcapped(query.float() @ keys.transpose(-1, -2) * scaling, softcap)
    scores = scores.masked_fill(~seen[:, None], float("-inf"))
    lse = torch.logsumexp(scores, -1)
    return torch.exp(scores - lse[..., None]) @ values, lse


def merge_attention(out: torch.Tensor, lse: torch.Tensor, other_out: torch.Tensor, other_lse: torch.Tensor,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention over two disjoint sets of tokens from each set's: outputs (..., d_v) and their rows'
    log-sum-exps (...), -inf where a set holds no token (its output finite: weighed 0); sinks: attention sinks' logits
    broadcasting against the last dim of lse (heads), one more score each row that reads no value."""
    top = torch.maximum(lse, other_lse)
    if sinks is not None:
        sinks = sinks.float()
        top = torch.maximum(top, sinks)
    weight, other_weight = torch.exp(lse - top), torch.exp(other_lse - top)
    total = weight + other_weight + (torch.exp(sinks - top) if sinks is not None else 0)
    return out * (weight / total)[..., None] + other_out * (other_weight / total)[..., None]


def stored_keys(store, b: int, pre_rope: bool, position_offset: int, inv_freq: torch.Tensor, rope_scaling: float,
                kv_heads: int) -> torch.Tensor:
    """Sequence b's keys as attention reads them: dequantized, and rotated when stored pre-RoPE."""
    keys = store.read(b)
    if pre_rope:
        keys = rotate_keys(keys, store.positions(b) + position_offset, kv_heads, inv_freq, rope_scaling)
    return keys


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, rope_scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (..., head_dim) of kvcal.rope at `positions`, for `rotate`."""
    return rope_cos_sin(positions, inv_freq, rope_scaling)


def rotate(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """kvcal.rope.apply_rope of float32 keys (..., head_dim) with cos/sin that broadcast against them, bit for bit
    (x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1)), without materializing rotate_half."""
    half = keys.shape[-1] // 2
    out = keys * cos
    out[..., :half] -= keys[..., half:] * sin[..., :half]  # + (-x2) sin, exactly
    out[..., half:] += keys[..., :half] * sin[..., half:]
    return out


def decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
                     scaling: float, sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """query (B, heads, 1, head_dim); keys, values (B, kv_heads, n, head_dim) float32, every sequence's tokens padded
    to n; visible (B, n): the tokens each sequence's query sees; sinks: (heads,) attention sinks' logits; softcap: the
    scores' soft-cap -> (B, heads, 1, head_dim) float32 (a sequence that sees nothing gets NaN, or 0 with sinks: the
    caller zeroes it)."""
    batch, heads, _, _ = query.shape
    kv_heads = keys.shape[1]
    if sinks is not None or softcap is not None:
        keys, values = keys.repeat_interleave(heads // kv_heads, 1), values.repeat_interleave(heads // kv_heads, 1)
        return explicit_attention(query.float(), keys, values, visible[:, None, None, :], scaling, sinks, softcap)
    # each KV head's query heads as rows of one query (one query position each): no copy of the keys per query head
    # (SDPA's enable_gqa repeats them on the CPU, MLA's 576 channels 16 or 128 times)
    grouped = query.float().reshape(batch, kv_heads, heads // kv_heads, query.shape[-1])
    out = torch.nn.functional.scaled_dot_product_attention(grouped, keys, values, attn_mask=visible[:, None, None, :],
                                                           scale=scaling)
    return out.view(batch, heads, 1, values.shape[-1])
