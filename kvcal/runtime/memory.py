"""Cache bytes of a recipe by formula, to check against the live cache (WiredCache.used_bytes).

For one sequence after a prefill of n tokens in one step, per layer and per K/V: fp16 sinks and recent
tokens (2 B per element), and the quantized body: packed codes (int32 words per token, kvcal.packing),
per-token parameters (uniform values: fp16 scale + zero per group of G channels; nuq per-token
thresholds: fp16 lo + hi; SKVQ: scale + zero per group in fp16 or fp8), per-block parameters (uniform
keys: fp16 scale + zero per channel per G tokens) and outliers (8 B each: int32 token, int16 channel,
fp16 value; their number depends on the data, so it is an input). Calibrated constants (codebooks,
per-channel thresholds, permutations) belong to the bundle, not to the cache, and are not counted.
"""

from __future__ import annotations

import math

from kvcal.bundle import LayerRecipe, layer_policy
from kvcal.packing import layout_for, packed_words
from kvcal.runtime.store import OUTLIER_BYTES

FP16_BYTES = 2


def segment_lengths(recipe: LayerRecipe, tokens: int, keys: bool) -> tuple[int, int, int]:
    """(fp16 sink, quantized body, fp16 recent) tokens after a prefill of `tokens` in one step."""
    policy = layer_policy(recipe)
    sink = min(policy.sink, tokens)
    rest = tokens - sink
    recent = max(int(policy.fp16_recent(tokens, keys)), math.floor((recipe.rpc_k if keys else recipe.rpc_v) * rest))
    body = max(0, rest - recent)
    if recipe.method == "uniform" and keys:
        body -= body % recipe.group_size  # per-channel key blocks
    return sink, body, rest - body


def body_bytes(recipe: LayerRecipe, width: int, body: int, keys: bool) -> int:
    bits = recipe.k_bits if keys else recipe.v_bits
    codes = packed_words(width, bits, layout_for(bits)) * 4
    if recipe.method == "uniform":
        if keys:
            return body * codes + (body // recipe.group_size) * width * 2 * FP16_BYTES
        return body * (codes + math.ceil(width / recipe.group_size) * 2 * FP16_BYTES)
    if recipe.method == "skvq":
        return body * (codes + math.ceil(width / recipe.group_size) * 2 * (1 if recipe.fp8 else FP16_BYTES))
    per_token_thresholds = not keys or recipe.key_granularity == "token"
    return body * (codes + (2 * FP16_BYTES if per_token_thresholds else 0))


def cache_bytes(layers: list[LayerRecipe], width: int, tokens: int, outliers: int = 0) -> int:
    """Bytes of one sequence's cache after a prefill of `tokens`, with `outliers` outliers in all."""
    total = outliers * OUTLIER_BYTES
    for recipe in layers:
        for keys in (True, False):
            sink, body, recent = segment_lengths(recipe, tokens, keys)
            total += (sink + recent) * width * FP16_BYTES + body_bytes(recipe, width, body, keys)
    return total


def fp16_bytes(num_layers: int, width: int, tokens: int) -> int:
    return num_layers * 2 * tokens * width * FP16_BYTES
