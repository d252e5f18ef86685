"""What the simulation, the calibration objectives and the runtime cache agree on about a KV cache:
it holds fp16, each KV head serves its group of query heads (GQA), how attention sinks (gpt-oss) join the softmax,
and which tokens it keeps fp16 (sinks, a recent window, a KIVI residual, keys waiting for a whole per-channel block),
and which of them a windowed layer has dropped (kvcal.spans).

Tensors are (tokens, kv_heads * head_dim): the channels of all KV heads of one token side by side."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcal.spans import AttentionSpan


def as_cached(x: torch.Tensor) -> torch.Tensor:
    """x as an fp16 KV cache holds it, in float32 for arithmetic."""
    return x.to(torch.float16).float()


def per_query_head(x: torch.Tensor, kv_heads: int, heads: int) -> torch.Tensor:
    """(tokens, kv_heads * head_dim) -> (heads, tokens, head_dim): each KV head repeated for its query heads (GQA)."""
    tokens, width = x.shape
    return x.view(tokens, kv_heads, width // kv_heads).transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)


def per_query_head_pick(chosen: torch.Tensor, heads: int, dim: int = 0) -> torch.Tensor:
    """An indexer's pick (kvcal.wiring.chosen_columns) with one entry along `dim` for every head alike or one per group
    of query heads in order -> one for every head alike or one per query head."""
    groups = chosen.shape[dim]
    return chosen if groups in (1, heads) else chosen.repeat_interleave(heads // groups, dim)


def softcapped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Scaled scores soft-capped into (-softcap, softcap), tanh(scores / softcap) * softcap, as Gemma 2's attention
    caps them before its mask and softmax; None: as they are."""
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim; with sinks (each row's, broadcasting to scores[..., :1]: a learned logit per query
    head), each row takes its sink as one more score, which reads no value, as gpt-oss's attention does. A row of no
    finite score (a query an indexer picked nothing for: GLM-5 Next's) gives zeros, as SDPA does."""
    if sinks is None:
        return torch.softmax(scores, dim=-1).masked_fill(scores.amax(-1, keepdim=True) == float("-inf"), 0.0)
    sink = sinks.to(scores).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat((scores, sink), -1), dim=-1)[..., :-1]


@dataclass(frozen=True)
class SegmentPolicy:
    """Which tokens are stored quantized when n tokens are in the cache.
    sink: the first tokens stay fp16. window: the most recent tokens stay fp16 (SKVQ).
    residual: KIVI, keys are flushed to quantized storage in whole blocks of `residual` tokens, values
    leave a FIFO of `residual` fp16 tokens one at a time."""

    sink: int = 0
    window: int = 0
    residual: int = 0
    key_block: int = 0  # keys quantized per channel over blocks of this many tokens wait in fp16 for a whole block

    def fp16_recent(self, n, keys: bool):
        """How many of the latest tokens are fp16 when n tokens (a tensor, or an int: in Python, the runtime's
        per-step count) are in the cache."""
        if isinstance(n, int):
            recent = self.window
            if self.residual:
                recent = max(recent, n % self.residual if keys else self.residual)
            if keys and self.key_block:
                recent = max(recent, max(n - self.sink, 0) % self.key_block)
            return recent
        n = torch.as_tensor(n)
        recent = torch.full_like(n, self.window)
        if self.residual:
            recent = torch.maximum(recent, n % self.residual if keys else torch.full_like(n, self.residual))
        if keys and self.key_block:
            recent = torch.maximum(recent, (n - self.sink).clamp(min=0) % self.key_block)
        return recent

    def quantized_masks(self, tokens: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(key, value) boolean masks (query t, token j): token j is read quantized by query t."""
        n = torch.arange(1, tokens + 1, device=device)[:, None]
        j = torch.arange(tokens, device=device)[None, :]
        past_sink = j >= self.sink
        return tuple(past_sink & (j < n - self.fp16_recent(n, keys)) for keys in (True, False))


def window_dropped(tokens: int, sinks: int, body_end: int, block: int, span: AttentionSpan) -> int:
    """How many of a sequence's first tokens a windowed layer's cache has dropped once `tokens` are in it:
    as many as fall before the first the next query (position `tokens`) sees (a sliding window's: the last
    size - 1, which transformers keeps; a chunk's: its chunk's first),
    taken as a prefix of sinks | body | recent that drops the `sinks` fp16 sinks all at once, body rows (positions
    sinks .. body_end - 1) in whole blocks of `block`, and never fp16 recent tokens (they leave into the body first).
    A function of the layout at `tokens`, so the runtime (trimming after every step), the simulation and the bytes
    formula agree whatever the steps were."""
    limit = min(span.first_seen(tokens), body_end)
    if limit <= 0 or limit < sinks:
        return 0
    return sinks + (limit - sinks) // block * block
