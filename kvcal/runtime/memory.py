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
from kvcal.packing import OUTLIER_BYTES, outlier_table_bytes

FP16_BYTES = 2


def segment_lengths(recipe: LayerRecipe, tokens: int, keys: bool, one_step: bool = True) -> tuple[int, int, int]:
    """(fp16 sink, quantized body, fp16 recent) tokens after a prefill of `tokens` in one step, or after
    `tokens` one-token steps (one_step False: KVmix's recent pivotal context has decayed to none then)."""
    policy = recipe.format.policy(recipe)
    sink = min(policy.sink, tokens)
    rest = tokens - sink
    rpc = math.floor((recipe.rpc_k if keys else recipe.rpc_v) * rest) if one_step else 0
    recent = max(int(policy.fp16_recent(tokens, keys)), rpc)
    body = max(0, rest - recent)
    if keys and policy.key_block:
        body -= body % policy.key_block  # per-channel key blocks leave the fp16 segment whole
    return sink, body, rest - body


def cache_bytes(layers: list[LayerRecipe], width: int, tokens: int, outliers: int = 0, one_step: bool = True, *,
                kv_heads: int) -> int:
    """Bytes of one sequence's cache of `width` channels in `kv_heads` KV heads after a prefill of `tokens` (or
    `tokens` one-token steps: one_step False), with `outliers` outliers in all."""
    total = outliers * OUTLIER_BYTES
    for recipe in layers:
        for keys in (True, False):
            sink, body, recent = segment_lengths(recipe, tokens, keys, one_step)
            total += (sink + recent) * width * FP16_BYTES + recipe.format.body_bytes(recipe, width, body, keys)
            if recipe.outliers:
                total += outlier_table_bytes(body, kv_heads)
    return total


def fp16_bytes(num_layers: int, width: int, tokens: int) -> int:
    return num_layers * 2 * tokens * width * FP16_BYTES
