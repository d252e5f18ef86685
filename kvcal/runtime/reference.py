"""The torch reference of decode attention over the quantized cache: the specification the CUDA kernels
(kernels/) are tested against.

For one sequence: read each store (unpack the int32 words, decode with the codec's stored parameters,
add the sparse fp16 outliers, fp16 segments as they are), rotate pre-RoPE keys with each token's own
position, then softmax attention of the query heads, each KV head serving its group of query heads (GQA).
Query i of a step of m queries over n tokens sees tokens 0 .. n - m + i (causal within the step), or with a
sliding window of W tokens (Mistral, Qwen2) only n - m + i - W + 1 .. n - m + i, with attention chunks (Llama 4)
only those of its chunk (kvcal.spans.AttentionSpan), as transformers' mask does; with DeepSeek Sparse Attention only
those of them its indexer picked (`attention`'s `chosen`), with MiniMax-M3's block-sparse attention those of the key
blocks the indexer picked for its head's group.

A decode step (one query per sequence) runs batched: `decode_attention` attends over every sequence's tokens
padded to the longest (the stores' `read_batch`) with a mask of each sequence's own tokens, keys rotated by
`rotate` with RoPE tables made once per step (`rope_tables`); it equals `attention` per sequence up to float
rounding of the softmax sums.

A step of several tokens over a stored cache whose decoder reads the stored tokens itself (kvcal.runtime.cache's
short steps) merges that attention with `own_attention` over the step's own tokens by their log-sum-exps
(`merge_attention`), which `attention` over both at once equals up to float rounding.

A step of several tokens read as decode steps (a cache's later_steps="decode") reads the tokens it moved to the
quantized body fp16 up to each query's own decode step and quantized after: `decode_steps_attention` over the stores
read after the step, or a short step's attention corrected over those tokens alone (`reread`).

Attention sinks (gpt-oss: a learned logit per query head) join each row's softmax as one more score that reads no
value, and soft-capped scores (Gemma 2) are capped before the mask, as the models' own attention does
(`explicit_attention`); without either SDPA computes the softmax.
"""

from __future__ import annotations

import torch

from kvcal.kv import per_query_head, per_query_head_pick, softcapped, softmax_with_sinks
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
    attention sinks' logits; softcap: the scores' soft-cap. With either, or a pick per group of heads, the queries
    are taken a chunk at a time (EXPLICIT_SCORES_PER_CHUNK scores). ahead: (m, m), the step's tokens each query sees
    after itself as well (an image's, which Gemma 3 attends to both ways), None: none. first_position: the first key's position in its
    sequence (the tokens a span let go before it), which places chunks. chosen: (groups, m, n), the tokens each query
    attends among those it sees, per group of query heads (an indexer's pick, kvcal.wiring.chosen_columns), None: all."""
    heads, m, head_dim = query.shape
    if span is not None and m == 1:  # decode: the span's tokens are the last ones
        first = max(span.first_seen(first_position + keys.shape[0] - 1) - first_position, 0)
        keys, values = keys[first:], values[first:]
        chosen = chosen[..., first:] if chosen is not None else None
        first_position += first
    n = keys.shape[0]
    banded = _banded(span, m, n, first_position)
    kv_heads = keys.shape[1] // head_dim
    # SDPA computes the same softmax attention without materializing the (heads, m, n) scores; batched 4-D
    # inputs with is_causal or no mask take its fused path, the explicit mask covers a step over earlier tokens.
    query, keys, values = query.float()[None], per_query_head(keys, kv_heads, heads)[None], per_query_head(values, kv_heads, heads)[None]
    visible = visibility(n, m, span, ahead, chosen, first_position, query.device, heads)
    if sinks is not None or softcap is not None or chosen is not None and len(chosen) > 1:
        chunk = max(1, EXPLICIT_SCORES_PER_CHUNK // (heads * n))
        outs = [explicit_attention(query[:, :, first : first + chunk], keys, values, visible(first, min(first + chunk, m)),
                                   scaling, sinks, softcap) for first in range(0, m, chunk)]
        return torch.cat(outs, 2)[0]
    if (m == n or m == 1) and not banded and ahead is None and chosen is None:
        out = torch.nn.functional.scaled_dot_product_attention(query, keys, values, is_causal=m > 1, scale=scaling)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=visible(0, m), scale=scaling)
    return out[0]


def _banded(span: AttentionSpan | None, m: int, n: int, first_position: int) -> bool:
    """Whether a span hides some of n tokens from a step of m > 1 queries (the first token is out of the last's)."""
    return span is not None and m > 1 and span.first_seen(first_position + n - 1) > first_position


def visibility(n: int, m: int, span: AttentionSpan | None, ahead: torch.Tensor | None, chosen: torch.Tensor | None,
               first_position: int, device, heads: int = 1):
    """visible(first, stop) -> (stop - first, n), or (heads, stop - first, n) with a pick per group of the `heads`
    query heads: the tokens queries first .. stop - 1 of a step of m over n tokens (the step's own the last m) see:
    causal, within `span` where it hides some (_banded), and as `attention` takes ahead, chosen and first_position."""
    span = span if _banded(span, m, n, first_position) else None

    def visible(first: int, stop: int) -> torch.Tensor:
        tokens, last = torch.arange(n, device=device), (n - m + torch.arange(first, stop, device=device))[:, None]
        seen = span.sees(last[:, 0] + first_position, tokens + first_position) if span is not None else tokens <= last
        seen = seen if ahead is None else seen | torch.nn.functional.pad(ahead[first:stop], (n - m, 0))
        return seen if chosen is None else seen & per_query_head_pick(chosen[..., first:stop, :], heads)

    return visible


def decode_steps_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
                           key_reads, value_reads, kv_heads: int, span: AttentionSpan | None = None,
                           sinks: torch.Tensor | None = None, softcap: float | None = None,
                           ahead: torch.Tensor | None = None, first_position: int = 0, chosen: torch.Tensor | None = None,
                           latent: bool = False) -> torch.Tensor:
    """`attention` of a step of m queries read as m decode steps (a cache's later_steps="decode"): keys, values (n, C)
    float32, the stores' read after the step (its own tokens the last m); key_reads, value_reads: how each query reads
    the tokens the step moved to the quantized body (kvcal.runtime.segments.DecodeStepReads, its rows float32 and keys
    rotated; None: none moved): query i reads stored token j >= start fp16, from rows, where j >= ends[i] (as its
    decode step would, before the token left the fp16 segment), else as keys / values. So the scores gain
    q . (k_fp16 - k) and the outputs p (v_fp16 - v) over those tokens where a query reads fp16. latent: MLA's query, its
    rotated part beside its latent one, which scores the values too. -> (heads, m, d_v)."""
    heads, m, _ = query.shape
    n = keys.shape[0]
    key_dim = keys.shape[1] // kv_heads
    query = query.float()
    keys, values = per_query_head(keys, kv_heads, heads), per_query_head(values, kv_heads, heads)
    visible = visibility(n, m, span, ahead, chosen, first_position, query.device, heads)
    key_fix, value_fix = (_fp16_differences(reads, read, kv_heads, heads, m)
                          for reads, read in ((key_reads, keys), (value_reads, values)))
    chunk = max(1, EXPLICIT_SCORES_PER_CHUNK // (heads * n))
    outs = []
    for first in range(0, m, chunk):
        stop = min(first + chunk, m)
        scoring, latent_scoring = query[:, first:stop, :key_dim], query[:, first:stop, key_dim:]
        scores = scoring @ keys.transpose(-1, -2)
        if latent:
            scores += latent_scoring @ values.transpose(-1, -2)
        for fix, part in ((key_fix, scoring), (value_fix if latent else None, latent_scoring)):
            if fix is not None:
                moved, difference, fp16 = fix
                scores[..., moved] += (part @ difference.transpose(-1, -2)) * fp16[first:stop]
        scores = softcapped(scores * scaling, softcap).masked_fill(~visible(first, stop), float("-inf"))
        probs = softmax_with_sinks(scores, None if sinks is None else sinks.view(-1, 1, 1))
        out = probs @ values
        if value_fix is not None:
            moved, difference, fp16 = value_fix
            out += (probs[..., moved] * fp16[first:stop]) @ difference
        outs.append(out)
    return torch.cat(outs, 1)


def _fp16_differences(reads, read: torch.Tensor, kv_heads: int, heads: int, m: int):
    """(the stored tokens a step moved to the body, their fp16 rows minus `read`'s (heads, tokens, d), (m, tokens):
    where each query reads them fp16) of decode_steps_attention's `reads`; None where it moved none."""
    if reads is None or max(reads.ends) <= reads.start:
        return None
    moved = slice(reads.start, max(reads.ends))
    tokens = moved.stop - moved.start
    difference = per_query_head(reads.rows[:tokens], kv_heads, heads) - read[:, moved]
    ends = torch.as_tensor(reads.ends[-m:], device=read.device)
    fp16 = torch.arange(moved.start, moved.stop, device=read.device)[None, :] >= ends[:, None]
    return moved, difference, fp16


def reread(out: torch.Tensor, lse: torch.Tensor, query: torch.Tensor, keys, values, seen: torch.Tensor, scaling: float,
           kv_heads: int, softcap: float | None = None, latent: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """An attention's output out (heads, m, d_v) and its rows' log-sum-exps lse (heads, m) (no sinks) of queries query
    (heads, m, d), which read u of its tokens one way, as if each query read them another: keys and values, per side
    (quantized rows (u, C) float32, fp16 rows (u, C) float32, read_fp16 (u,): the tokens the attention read fp16,
    reads_fp16 (m, u): those each query reads fp16 instead); seen (m, u): the tokens each query sees. Each token's
    weight exp(score - lse) and value as read is taken out of the sums and its weight and value as re-read put in:
    the sums change by about what the replaced tokens weigh (no cancellation: the same tokens read two close ways).
    latent: MLA's query, its rotated part beside its latent one, which scores the values too. -> (out, lse)."""
    heads = query.shape[0]
    key_dim = keys[0].shape[1] // kv_heads
    query = query.float()
    key_side, value_side = ((per_query_head(quantized, kv_heads, heads), per_query_head(fp16_rows, kv_heads, heads),
                             read_fp16, reads_fp16) for quantized, fp16_rows, read_fp16, reads_fp16 in (keys, values))
    scored = [(query[..., :key_dim], key_side)] + ([(query[..., key_dim:], value_side)] if latent else [])
    before = after = 0
    for part, (quantized, fp16_rows, read_fp16, reads_fp16) in scored:
        fp16_scores, quantized_scores = part @ fp16_rows.transpose(-1, -2), part @ quantized.transpose(-1, -2)
        before = before + torch.where(read_fp16, fp16_scores, quantized_scores)
        after = after + torch.where(reads_fp16, fp16_scores, quantized_scores)
    weight_before, weight_after = (torch.exp((softcapped(scores * scaling, softcap) - lse[..., None])
                                             .masked_fill(~seen, float("-inf"))) for scores in (before, after))
    quantized, fp16_rows, read_fp16, reads_fp16 = value_side
    sums = (weight_after * reads_fp16) @ fp16_rows + (weight_after * ~reads_fp16) @ quantized
    sums -= (weight_before * read_fp16) @ fp16_rows + (weight_before * ~read_fp16) @ quantized
    grown = (weight_after - weight_before).sum(-1)
    return (out + sums) / (1 + grown[..., None]), lse + torch.log1p(grown)


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


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax attention's output out (..., d_v) over tokens whose scores' log-sum-exps are lse (...), with one more
    score each row, its attention sink's logit (broadcasting against lse's last dim, heads), that reads no value."""
    return out if sinks is None else out * torch.sigmoid(lse - sinks.float())[..., None]


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
    to n; visible (B, n), or (B, groups, n) per group of query heads (an indexer's pick): the tokens each sequence's
    query sees; sinks: (heads,) attention sinks' logits; softcap: the scores' soft-cap -> (B, heads, 1, head_dim)
    float32 (a sequence that sees nothing gets NaN, or 0 with sinks: the caller zeroes it)."""
    batch, heads, _, _ = query.shape
    kv_heads, n = keys.shape[1], keys.shape[2]
    visible = per_query_head_pick(visible if visible.dim() == 3 else visible[:, None], heads, 1)  # (B, 1 or heads, n)
    if sinks is not None or softcap is not None:
        keys, values = keys.repeat_interleave(heads // kv_heads, 1), values.repeat_interleave(heads // kv_heads, 1)
        return explicit_attention(query.float(), keys, values, visible[:, :, None, :], scaling, sinks, softcap)
    # each KV head's query heads as rows of one query (one query position each): no copy of the keys per query head
    # (SDPA's enable_gqa repeats them on the CPU, MLA's 576 channels 16 or 128 times)
    grouped = query.float().reshape(batch, kv_heads, heads // kv_heads, query.shape[-1])
    mask = visible[:, :, None, :] if visible.shape[1] == 1 else visible.view(batch, kv_heads, heads // kv_heads, n)
    out = torch.nn.functional.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=scaling)
    return out.view(batch, heads, 1, values.shape[-1])
