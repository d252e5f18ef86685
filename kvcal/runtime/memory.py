"""Cache bytes of a recipe by formula, to check against the live cache (WiredCache.used_bytes).

For one sequence after a prefill of n tokens in one step, per layer and per K/V: fp16 sinks and recent
tokens (2 B per element), the quantized body as its storage format counts it (kvcal.registry.LayerFormat
.body_bytes: packed codes in kvcal.packing.layout_for's layout, so 3-bit codes take exactly 3 bits, per-token
and per-block parameters), and for layers that keep outliers the layout of kvcal.packing: OUTLIER_BYTES (4 B:
uint16 position in its tile, fp16 value) per outlier (their number depends on the data, so it is an input) and
an int32 offset-table entry per KV head and started tile of OUTLIER_TILE_TOKENS body rows. Calibrated constants
(codebooks, per-channel thresholds, permutations) belong to the bundle, not to the cache, and are not counted.
"""

from __future__ import annotations

import math

from kvcal.bundle import LayerRecipe
from kvcal.kv import window_dropped
from kvcal.packing import OUTLIER_BYTES, outlier_table_bytes
from kvcal.spans import AttentionSpan

FP16_BYTES = 2


def segment_lengths(recipe: LayerRecipe, tokens: int, keys: bool, step: int | None = None) -> tuple[int, int, int]:
    """(fp16 sink, quantized body, fp16 recent) tokens after `tokens` came in steps of `step` (None: a prefill in
    one step; 1: one token at a time, when KVmix's recent pivotal context has decayed to none)."""
    policy = recipe.format.policy(recipe)
    sink = min(policy.sink, tokens)
    rest = tokens - sink
    ratio, rpc = recipe.rpc_k if keys else recipe.rpc_v, 0
    if ratio:  # as kvcal.runtime.segments.SegmentedStore.append_rows: after each step of m tokens past the sinks
        step = step or tokens
        for start in range(0, tokens, step):
            count = min(step, tokens - start)
            rpc = math.floor(ratio * (count - max(min(policy.sink - start, count), 0) + rpc))
    recent = max(int(policy.fp16_recent(tokens, keys)), rpc)
    body = max(0, rest - recent)
    if keys and policy.key_block:
        body -= body % policy.key_block  # per-channel key blocks leave the fp16 segment whole
    return sink, body, rest - body


def cache_bytes(layers: list[LayerRecipe], width: int | list[int], tokens: int, outliers: int = 0, step: int | None = None,
                *, kv_heads: int | list[int], spans: list[AttentionSpan | None] | None = None,
                value_width: int | list[int] | None = None, index_bytes: int | list[int] = 0) -> int:
    """Bytes of one sequence's cache of `width` channels of keys in `kv_heads` KV heads (each one number for every
    layer, or one a layer), its values `value_width` wide (None: as the keys; MLA's latent is wider) after `tokens`
    came in steps of `step` (see segment_lengths), with `outliers` outliers in all (as the cache counts them); spans:
    per layer its sliding window or attention chunk, or None (kvcal.adapters.ModelAdapter.spans), whose layers hold
    only the tokens kvcal.kv.window_dropped leaves; index_bytes: the bytes of one token's indexer key per layer (DeepSeek
    Sparse Attention's, kept as the model computes them; 0: none), one number for every layer or one a layer."""
    total = outliers * OUTLIER_BYTES + tokens * sum(_per_layer(index_bytes, len(layers)))
    widths, kv_heads = _per_layer(width, len(layers)), _per_layer(kv_heads, len(layers))
    value_widths = widths if value_width is None else _per_layer(value_width, len(layers))
    for recipe, span, key_width, value_width, heads in zip(layers, spans or [None] * len(layers), widths, value_widths,
                                                           kv_heads):
        segments = {keys: segment_lengths(recipe, tokens, keys, step) for keys in (True, False)}
        dropped = 0
        if span is not None:
            block = math.lcm(*(recipe.format.body_block(recipe, keys) for keys in (True, False)))
            sinks = segments[True][0]
            dropped = window_dropped(tokens, sinks, sinks + min(segments[True][1], segments[False][1]), block, span)
        for keys, (sink, body, recent) in segments.items():
            width = key_width if keys else value_width
            if not width:  # (an MLA key of no channel, stored by no codec's bytes: LayerCodecs.for_key_width)
                continue
            first = max(dropped - sink, 0)  # body rows dropped
            if dropped:
                sink, body = 0, body - first
            total += (sink + recent) * width * FP16_BYTES + recipe.format.body_bytes(recipe, width, body, keys)
            if recipe.outliers:
                total += outlier_table_bytes(body, heads, first)
    return total


def fp16_bytes(num_layers: int, width: int | list[int], tokens: int, spans: list[AttentionSpan | None] | None = None,
               value_width: int | list[int] | None = None, index_bytes: int | list[int] = 0) -> int:
    """Bytes of transformers' own fp16 cache (DynamicCache) of one sequence of layers whose keys are `width` channels
    wide, their values `value_width` (None: as the keys; MLA's latent is wider than its rotated key; each one number
    for every layer, or one a layer): a layer with a sliding window or attention chunks keeps its last size - 1
    tokens; index_bytes: as cache_bytes'."""
    spans, widths = spans or [None] * num_layers, _per_layer(width, num_layers)
    value_widths = widths if value_width is None else _per_layer(value_width, num_layers)
    return tokens * sum(_per_layer(index_bytes, num_layers)) + sum(
        (tokens if span is None else min(tokens, span.size - 1)) * (key + value) * FP16_BYTES
        for span, key, value in zip(spans, widths, value_widths))


def _per_layer(number: int | list[int], num_layers: int) -> list[int]:
    """One number a layer, from one for every layer or one a layer."""
    return [number] * num_layers if isinstance(number, int) else list(number)
