"""A context's KV cache from one fp prefill (fp_context), kept as rows that several quantized caches load
(WiredCache.load), so that methods compared on one context share its prefill."""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, LinearAttentionCacheLayerMixin

from kvcal import wiring
from kvcal.adapters import adapt, chunk_positions, decoder_of, prefix_lm
from kvcal.errors import KvcalError
from kvcal.model_caches import cache_argument, model_cache
from kvcal.runtime.layer import take_state


@dataclass
class FpContext:
    """The KV cache of a context from one fp prefill, per layer (batch, tokens, width) rows: keys after RoPE (as the
    model caches them), keys before RoPE (as kvcal reads them: in its channel order, kvcal.adapters), values; `cache`
    is the model's own (DynamicCache) copy, None in a context of rows only (of a model without recurrent states).
    Loading it into several quantized caches (WiredCache.load) shares one prefill between methods."""

    keys: list[torch.Tensor]
    pre_rope_keys: list[torch.Tensor]
    values: list[torch.Tensor]
    cache: Cache | None
    # per layer, its sparse attention's indexer keys (batch, tokens, channels), None where it has none
    index_keys: list[torch.Tensor | None] | None = None

    def copy_states_into(self, cache: Cache) -> None:
        """Give each layer of `cache` (laid out as the model's) that keeps a recurrent state a copy of the context's
        (a hybrid model's DeltaNet, Mamba or convolution layers; Falcon-H1's attention layers), and each that keeps
        its indexers' position ids (Qwen4-Exp's first indexed layer) the context's."""
        stateful = [i for i, layer in enumerate(cache.layers) if isinstance(layer, LinearAttentionCacheLayerMixin)]
        if stateful and self.cache is None:
            raise KvcalError(f"this context holds rows only (no cache), none of the recurrent states of the model's layers "
                             f"{stateful}; load a context made by fp_context")
        for i in stateful:
            take_state(cache.layers[i], self.cache.layers[i])
        for layer, theirs in zip(cache.layers, self.cache.layers if self.cache is not None else []):
            if getattr(theirs, "indexer_position_ids", None) is not None:
                layer.indexer_position_ids = theirs.indexer_position_ids.clone()

    @contextmanager
    def continued(self):
        """Within the block, the context's own cache (`cache`, the fp model's) to go on from; after it, the context
        again: the tokens past the context's taken back from its full-attention layers; its recurrent states (which
        transformers' layers take back only while recording the past) and its sliding-window layers (whose recording,
        which fp_context turned on, transformers before 5.18 does not decode with) put back from a copy made before.
        Memory: that copy, of the states and the windows (of Falcon-H1's layers, which keep a state beside their keys
        and values, the whole layer)."""
        if self.cache is None:
            raise KvcalError("this context holds rows only (no cache) for the fp model to go on from; use a context made "
                             "by fp_context")
        # (KV sharing's and MLP layers' placeholders hold nothing: no length, no is_sliding; a recurrent layer's length is
        # a tensor it grows in place: each full layer's own, as a number)
        kept = {i: copy.deepcopy(layer) for i, layer in enumerate(self.cache.layers)
                if isinstance(layer, LinearAttentionCacheLayerMixin) or getattr(layer, "is_sliding", False)}
        lengths = {i: int(layer.get_seq_length()) for i, layer in enumerate(self.cache.layers)
                   if i not in kept and hasattr(layer, "get_seq_length")}
        for i in kept:  # (activate_past_recording's flag: the copy keeps it)
            self.cache.layers[i].record_past = False
        try:
            yield self.cache
        finally:
            for i, layer in enumerate(self.cache.layers):
                if i in kept:
                    self.cache.layers[i] = kept[i]
                elif i in lengths:  # (< 0: as many tokens, as Cache.crop takes them)
                    layer.crop(lengths[i] - int(layer.get_seq_length()))


def fp_context(model, ids: torch.Tensor, chunk: int | None = None) -> FpContext:
    """Prefill ids (batch, tokens), unpadded, with the fp model and keep its KV cache (with the model's own
    attention implementation, also while a quantized cache is open on it), in steps of `chunk` tokens (None: one
    step; a long context needs steps to keep the prefill's attention within memory). The rows keep every token of
    every layer, so that a quantized cache loading them holds what it would after its own prefill; `cache` is the
    model's own DynamicCache, whose sliding-window layers hold their window only (trimmed to it after each step)."""
    if prefix_lm(model):  # (the decoder alone, handed no token types, would read the context both ways)
        raise KvcalError(f"{type(model).__name__} reads a prompt both ways where its token types say so, which a prefill "
                         "of its decoder alone cannot be told; evaluate it with kvcal eval ppl or agreement")
    adapter = adapt(model)
    step = chunk or ids.shape[1]
    if adapter.long_rope is not None:
        adapter.long_rope.check_prefill_steps(ids.shape[1], step)
    pre_rope: list[list[torch.Tensor]] = [[] for _ in adapter.layers]
    hooks = [handles.key_source.register_forward_hook(
        lambda module, inputs, output, h=handles, i=i: pre_rope[i].append(h.source_rows("k", output.detach())))
        for i, handles in enumerate(adapter.layers)]
    try:
        cache = model_cache(model)
        attending = [cache.layers[i] for i in adapter.model_layers]  # (a hybrid model's others keep a state)
        sliding = {i: {"keys": [], "values": []} for i, layer in enumerate(attending) if layer.is_sliding}
        for i in sliding:
            attending[i].activate_past_recording()
        with wiring.suspended(adapter):  # the decoder alone: the logits of every prompt token are never needed
            for start in range(0, ids.shape[1], step):
                piece = ids[:, start : start + step]
                decoder_of(model)(piece, **cache_argument(cache), use_cache=True, position_ids=chunk_positions(start, piece))
                for i, kept in sliding.items():
                    for kind, parts in kept.items():
                        parts.append(getattr(attending[i], kind)[:, :, -piece.shape[1] :].clone())
                    # back to its window: the next step reads what its mask covers (transformers before 5.18 hands
                    # a recording layer every token it holds)
                    attending[i].crop(0)
    finally:
        for hook in hooks:
            hook.remove()

    def rows(i: int, kind: str) -> torch.Tensor:
        """Layer i's keys or values of every token (batch, tokens, width): a sliding layer's as kept per step."""
        x = torch.cat(sliding[i][kind], 2) if i in sliding else getattr(attending[i], kind)
        return x.transpose(1, 2).flatten(2)  # (batch, kv_heads, tokens, head_dim) -> (batch, tokens, width)

    layers = range(len(attending))
    return FpContext([rows(i, "keys") for i in layers], [torch.cat(parts, 1) for parts in pre_rope],
                     [rows(i, "values") for i in layers], cache, [_indexer_keys(layer) for layer in attending])


def _indexer_keys(layer) -> torch.Tensor | None:
    """A transformers cache layer's indexer keys (batch, tokens, channels): DeepSeek Sparse Attention's
    (indexer_keys), MiniMax-M3's (idx_keys, of one head); None where it keeps none."""
    keys = getattr(layer, "indexer_keys", None)
    if keys is None and getattr(layer, "idx_keys", None) is not None:
        keys = layer.idx_keys[:, 0]
    return keys
