"""kvcal.runtime.reference's reads of a step of several tokens as decode steps, against attention written out query
by query: each query's keys and values chosen token by token, its scores soft-capped, masked and softmaxed (with an
attention sink as one more score)."""

import pytest
import torch

from kvcal.kv import per_query_head, softcapped
from kvcal.runtime import reference
from kvcal.runtime.segments import DecodeStepReads

HEADS, KV_HEADS, DIM, TOKENS, STEP = 4, 2, 8, 12, 5


def written_out(query, keys, values, key_fp16, value_fp16, seen, scaling, softcap=None, sinks=None, latent=False):
    """(out (heads, m, d_v), lse (heads, m), without the sink) of each query i over keys and values given as
    (quantized, fp16) rows (tokens, C), reading token j's fp16 row where key_fp16[i, j] (value_fp16[i, j])."""
    heads, m, _ = query.shape
    kv_heads = 1 if latent else KV_HEADS
    outs, lses = [], []
    for i in range(m):
        k = per_query_head(torch.where(key_fp16[i][:, None], keys[1], keys[0]), kv_heads, heads)
        v = per_query_head(torch.where(value_fp16[i][:, None], values[1], values[0]), kv_heads, heads)
        scores = torch.einsum("hd,hnd->hn", query[:, i, : k.shape[-1]], k)
        if latent:
            scores = scores + torch.einsum("hd,hnd->hn", query[:, i, k.shape[-1] :], v)
        scores = softcapped(scores * scaling, softcap).masked_fill(~seen[i], float("-inf"))
        lse = torch.logsumexp(scores, -1)
        total = lse if sinks is None else torch.logaddexp(lse, sinks)
        outs.append(torch.einsum("hn,hnd->hd", torch.exp(scores - total[:, None]), v))
        lses.append(lse)
    return torch.stack(outs, 1), torch.stack(lses, 1)


def sides(generator, width: int, tokens: int = TOKENS):
    """(quantized rows, fp16 rows) of `tokens` tokens: the fp16 ones near the quantized ones, as a code's error is."""
    quantized = torch.randn(tokens, width, generator=generator)
    return quantized, quantized + 0.1 * torch.randn(tokens, width, generator=generator)


@pytest.mark.parametrize("softcap, latent", [(None, False), (5.0, False), (None, True)])
def test_a_reread_equals_attention_over_the_tokens_read_the_other_way(softcap, latent):
    """reread turns attention whose queries read some tokens one way (the same way for every query) into attention
    where each query reads them its own way: equal, to 1e-5, to attention written out over the tokens read so; with
    soft-capped scores, and MLA's latent query scoring the values too."""
    generator = torch.Generator().manual_seed(0)
    kv_heads, key_width, value_width = (1, DIM, 2 * DIM) if latent else (KV_HEADS, KV_HEADS * DIM, KV_HEADS * DIM)
    query = torch.randn(HEADS, STEP, DIM + (value_width if latent else 0), generator=generator)
    keys, values = sides(generator, key_width), sides(generator, value_width)
    read_fp16 = torch.arange(TOKENS) >= 6  # (read before: fp16 from token 6 on)
    ends = torch.tensor([7, 7, 9, 10, 12])  # each query reads fp16 from its end on
    reads_fp16 = torch.arange(TOKENS)[None, :] >= ends[:, None]
    seen = torch.arange(TOKENS)[None, :] <= torch.arange(TOKENS - STEP, TOKENS)[:, None]
    before = read_fp16.expand(STEP, -1)
    out, lse = written_out(query, keys, values, before, before, seen, 0.3, softcap, latent=latent)
    want_out, want_lse = written_out(query, keys, values, reads_fp16, reads_fp16, seen, 0.3, softcap, latent=latent)
    got_out, got_lse = reference.reread(out, lse, query, (*keys, read_fp16, reads_fp16), (*values, read_fp16, reads_fp16),
                                        seen, 0.3, kv_heads, softcap, latent)
    torch.testing.assert_close(got_out, want_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(got_lse, want_lse, rtol=0, atol=1e-5)


def test_decode_steps_attention_reads_each_moved_token_fp16_up_to_each_querys_end():
    """decode_steps_attention over a store's read after a step (quantized up to the body's end, fp16 after) and the
    moved tokens' fp16 rows: query i reads token j >= start fp16 where j >= ends[i], keys and values each by their own
    ends (a KIVI residual's values leave a token a step, its keys a block at a time); with attention sinks. Equal, to
    1e-5, to attention written out so."""
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(HEADS, STEP, DIM, generator=generator)
    keys, values = sides(generator, KV_HEADS * DIM), sides(generator, KV_HEADS * DIM)
    key_reads = DecodeStepReads(8, keys[1][8:], [8, 8, 8, 12, 12])
    value_reads = DecodeStepReads(4, values[1][4:], [5, 6, 7, 8, 9])
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    tokens = torch.arange(TOKENS)[None, :]
    key_fp16 = (tokens >= 8) & (tokens >= torch.tensor(key_reads.ends)[:, None])
    value_fp16 = (tokens >= 4) & (tokens >= torch.tensor(value_reads.ends)[:, None])
    seen = tokens <= torch.arange(TOKENS - STEP, TOKENS)[:, None]
    want, _ = written_out(query, keys, values, key_fp16, value_fp16, seen, 0.3, sinks=sinks)
    read_after = [torch.cat([quantized[: max(reads.ends)], fp16[max(reads.ends) :]])
                  for (quantized, fp16), reads in ((keys, key_reads), (values, value_reads))]
    got = reference.decode_steps_attention(query, *read_after, 0.3, key_reads, value_reads, KV_HEADS, sinks=sinks)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
