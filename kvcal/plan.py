"""Per-layer precision for a serving engine's own KV cache dtype: which layers stay unquantized (vLLM's
--kv-cache-dtype-skip-layers), chosen exactly from a kvcal profile within a budget of real bits per element.

Every layer either takes the engine's dtype (K and V alike, as vLLM's option does) or stays fp16; under a TurboQuant
preset vLLM keeps its first and last two layers fp16 whatever it is told, so those stay fp16 at no cost and are not
named. What quantizing a layer costs, by `fisher`: the Fisher-weighted squared error of the dtype's key codec on the
profile's sampled keys, cached after RoPE as the engine caches them, the error rotated back before RoPE where the
Fisher information was taken (RoPE rotates channel pairs, so this is exact), plus its value codec's on the values; by
`importance`: KVmix's gradient importance of its K and V. Staying fp16 costs nothing. Prices: the dtype's real bits
per element (its K and V row_bits, scales included) and 16;
the budget bounds their mean over the layers, each weighted by the tokens it stores at `context` (a sliding-window
layer keeps its window; 0: every layer alike). The choice is exact, prices unrounded (`layers_kept_wide`): layers
that store alike cost alike to keep fp16, so a plan is how many of each such class stay fp16, the costliest first.
The plan names the engine's arguments and the `eval ppl --baseline` spec that evaluates the same cache.

llama.cpp takes one cache type per tensor for the whole model (`-ctk`, `-ctv`): plan_cache_types picks the pair with
the least Fisher cost summed over the layers, K and V priced apart, within the budget (every pair of f16 and the
ggml types but f16 for both is tried; they are few).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass

import numpy as np
import torch

from kvcal.artifacts import read_artifact
from kvcal.errors import KvcalError
from kvcal.fit.nuq import stored_shares
from kvcal.methods import baseline_method
from kvcal.methods.llama_cpp import CACHE_TYPES, cache_type_codec
from kvcal.methods.vllm_dtypes import VLLM_DTYPES
from kvcal.quantizers import FP16_BITS, CodecKind
from kvcal.rope import layer_inv_freq, rotate_keys
from kvcal.rotation_codecs import GGML_BLOCK, GGML_BLOCK_BYTES
from kvcal.vllm_codecs import TQ_PRESETS

ENGINE_DTYPES = {"vllm": (*VLLM_DTYPES, *TQ_PRESETS)}  # the dtypes whose layers an engine can leave unquantized
ENGINES = (*ENGINE_DTYPES, "llama.cpp")
CRITERIA = ("fisher", "importance")
# the most count combinations layers_kept_wide weighs: (n + 1)^k for k classes of n layers (k is 1 + the distinct
# sliding windows: one or two in the models there are)
MOST_COMBINATIONS = 10**6


@dataclass
class Plan:
    engine: str
    dtype: str
    budget: float  # real bits per element, the most the plan may store
    by: str
    context: int
    skipped: list[int]  # layers left unquantized
    bits: float  # real bits per element of the plan (weighted by the tokens each layer stores at `context`)
    costs: list[float]  # per layer, what quantizing it costs (Fisher-weighted error or importance)
    dtype_bits: float  # the dtype's real bits per element

    def engine_arguments(self) -> str:
        arguments = f"--kv-cache-dtype {self.dtype}"
        return arguments + (f" --kv-cache-dtype-skip-layers {' '.join(map(str, self.skipped))}" if self.skipped else "")

    def baseline_spec(self) -> str:
        return self.dtype + (f";skip={'+'.join(map(str, self.skipped))}" if self.skipped else "")

    def as_dict(self) -> dict:
        return {**asdict(self), "engine_arguments": self.engine_arguments(), "baseline_spec": self.baseline_spec()}


def dtype_bits(dtype: str, head_dim: int, kv_heads: int) -> float:
    """An engine dtype's real bits per element (codes and scales, K and V) for heads of `head_dim` channels."""
    width = kv_heads * head_dim
    codecs = baseline_method(dtype, 1, head_dim).layers[0]
    return (codecs.key_codec.row_bits(width) + codecs.value_codec.row_bits(width)) / (2 * width)


def _fixed_fp16(codecs) -> bool:
    """A layer the engine keeps fp16 under this dtype whatever the plan says (TurboQuant's boundary layers)."""
    return codecs.key_codec.kind is CodecKind.FP16


def fixed_fp16_layers(dtype: str, num_layers: int, head_dim: int) -> set[int]:
    """The layers the engine keeps fp16 under `dtype` whatever it is told (TurboQuant's first and last two)."""
    return {i for i, codecs in enumerate(baseline_method(dtype, num_layers, head_dim).layers) if _fixed_fp16(codecs)}


def _key_cost(profile: dict, config: dict, layer: int, codec, kv_heads: int) -> float:
    """Fisher-weighted squared error of `codec` on the layer's sampled keys, cached after RoPE as the engines cache
    them, the error rotated back before RoPE where the Fisher information was taken."""
    positions = profile["samples.position"].long()
    inv_freq = layer_inv_freq(profile["rope.inv_freq"], layer)
    keys = profile[f"layers.{layer}.k_post.samples"].float()
    error = codec.quantize(keys).values - keys
    error_pre = rotate_keys(error, -positions, kv_heads, inv_freq, 1.0 / config["rope"]["attention_scaling"])  # scalings undone
    return float((profile[f"layers.{layer}.k_pre.fisher"] * error_pre**2).sum())


def _value_cost(profile: dict, layer: int, codec) -> float:
    values = profile[f"layers.{layer}.v.samples"].float()
    return float((profile[f"layers.{layer}.v.fisher"] * (codec.quantize(values).values - values) ** 2).sum())


def _fisher_costs(profile: dict, config: dict, layers: list, kv_heads: int) -> list[float]:
    return [0.0 if _fixed_fp16(codecs) else
            _key_cost(profile, config, layer, codecs.key_codec, kv_heads) + _value_cost(profile, layer, codecs.value_codec)
            for layer, codecs in enumerate(layers)]


def plan_layers(profile_path: str, engine: str, dtype: str, budget: float, by: str = "fisher", context: int = 0) -> Plan:
    """The layers to leave unquantized so that `dtype` on the rest stores at most `budget` real bits per element
    with the least total cost (see the module docstring)."""
    if engine not in ENGINE_DTYPES:
        raise KvcalError(f"--engine '{engine}' is not one of {', '.join(ENGINE_DTYPES)}")
    if dtype not in ENGINE_DTYPES[engine]:
        raise KvcalError(f"--dtype '{dtype}' is not one of {engine}'s: {', '.join(ENGINE_DTYPES[engine])}")
    if by not in CRITERIA:
        raise KvcalError(f"--by '{by}' is not one of {', '.join(CRITERIA)}")
    if context < 0:
        raise KvcalError(f"--context must be 0 or a number of tokens (got {context})")
    profile, config = read_artifact(profile_path, "profile")
    fingerprint = config["model"]["fingerprint"]
    num_layers, head_dim, kv_heads = fingerprint["num_layers"], fingerprint["head_dim"], fingerprint["num_kv_heads"]
    layers = baseline_method(dtype, num_layers, head_dim).layers
    fixed = np.array([_fixed_fp16(codecs) for codecs in layers])
    quantized_bits = dtype_bits(dtype, head_dim, kv_heads)
    shares = np.array(stored_shares(config["model"].get("windows"), context, num_layers))
    least = float((np.where(fixed, FP16_BITS, quantized_bits) * shares).sum() / shares.sum())
    if not least - 1e-9 <= budget <= FP16_BITS:
        raise KvcalError(f"--budget {budget} is outside [{least:g}, {FP16_BITS}] real bits per element: {dtype} stores "
                         f"{quantized_bits:g}, an unquantized layer {FP16_BITS}" + (", and it keeps some layers unquantized"
                                                                                 if fixed.any() else ""))
    with torch.inference_mode():
        costs = (_fisher_costs(profile, config, layers, kv_heads) if by == "fisher" else
                 np.where(fixed, 0.0, (profile["importance.k"] + profile["importance.v"]).numpy()).tolist())
    quantized_price = np.where(fixed, float(FP16_BITS), quantized_bits)  # a fixed layer is fp16 either way
    extra = (FP16_BITS - quantized_price) * shares  # what keeping each layer fp16 adds to the weighted sum of prices
    slack = max(budget * shares.sum() - (quantized_price * shares).sum(), 0.0)  # the check above allows 1e-9 under
    skipped = layers_kept_wide(costs, extra, slack)
    prices = np.where(np.isin(np.arange(num_layers), skipped), FP16_BITS, quantized_price)
    bits = float((prices * shares).sum() / shares.sum())
    return Plan(engine, dtype, budget, by, context, skipped, bits, costs, quantized_bits)


def layers_kept_wide(costs: list[float], extra: np.ndarray, slack: float) -> list[int]:
    """The layers to keep fp16 with the largest total cost (what quantizing them would cost) whose extra prices sum
    to at most `slack`, exactly. Layers of equal extra price form a class and, within one, the costliest are kept
    first; every count per class is weighed (layers of no extra price, the engine's own fp16 ones, are never
    named)."""
    classes: dict[float, list[int]] = {}
    for layer in sorted((i for i in range(len(costs)) if extra[i] > 0), key=lambda i: (-costs[i], i)):
        classes.setdefault(float(extra[layer]), []).append(layer)
    prices, members = list(classes), list(classes.values())
    combinations = math.prod(len(m) + 1 for m in members)
    if combinations > MOST_COMBINATIONS:
        raise KvcalError(f"the model's layers store {len(prices)} different lengths at this context: weighing all "
                         f"{combinations} plans is too many; give --context 0 (every layer alike)")
    gains = [np.concatenate([[0.0], np.cumsum([costs[i] for i in m])]) for m in members]
    tolerance = 1e-9 * max(abs(slack), 1.0)  # the budget is a mean of the same prices, summed in another order
    best, best_counts = -1.0, None
    for counts in itertools.product(*(range(len(m) + 1) for m in members)):
        if sum(n * p for n, p in zip(counts, prices)) <= slack + tolerance:
            gain = sum(g[n] for g, n in zip(gains, counts))
            if gain > best:
                best, best_counts = gain, counts
    return sorted(i for m, n in zip(members, best_counts) for i in m[:n])


@dataclass
class CacheTypePlan:
    """llama.cpp's -ctk / -ctv within a budget, and every pair it weighed."""

    budget: float
    type_k: str
    type_v: str
    bits: float  # real bits per element of the pair (K and V rows, block scales included)
    pairs: list[dict]  # every pair: type_k, type_v, bits, cost (Fisher-weighted error over all layers), cheapest first

    def engine_arguments(self) -> str:
        return f"-ctk {self.type_k} -ctv {self.type_v}"

    def baseline_spec(self) -> str:
        return self.type_k if self.type_k == self.type_v else f"{self.type_k}/{self.type_v}"

    def as_dict(self) -> dict:
        return {"engine": "llama.cpp", **asdict(self), "engine_arguments": self.engine_arguments(),
                "baseline_spec": self.baseline_spec()}


def check_cache_type_budget(budget: float) -> None:
    """Refuse a budget no -ctk / -ctv pair fits (ggml's types store the same bits per element at any width)."""
    least = min(8 * block_bytes / GGML_BLOCK for block_bytes in GGML_BLOCK_BYTES.values())
    if not least - 1e-9 <= budget <= FP16_BITS:
        raise KvcalError(f"--budget {budget} is outside [{least:g}, {FP16_BITS}] real bits per element: llama.cpp's "
                         f"smallest -ctk/-ctv pair stores {least:g}")


def plan_cache_types(profile_path: str, budget: float) -> CacheTypePlan:
    """The -ctk / -ctv pair of least Fisher-weighted error that stores at most `budget` real bits per element."""
    check_cache_type_budget(budget)
    profile, config = read_artifact(profile_path, "profile")
    fingerprint = config["model"]["fingerprint"]
    num_layers, head_dim, kv_heads = fingerprint["num_layers"], fingerprint["head_dim"], fingerprint["num_kv_heads"]
    width = kv_heads * head_dim
    keys = {t: cache_type_codec(t, head_dim, "k") for t in CACHE_TYPES}
    values = {t: cache_type_codec(t, head_dim, "v") for t in CACHE_TYPES}
    with torch.inference_mode():
        key_costs = {t: sum(_key_cost(profile, config, i, codec, kv_heads) for i in range(num_layers)) for t, codec in keys.items()}
        value_costs = {t: sum(_value_cost(profile, i, codec) for i in range(num_layers)) for t, codec in values.items()}
    pairs = sorted(({"type_k": k, "type_v": v, "bits": (keys[k].row_bits(width) + values[v].row_bits(width)) / (2 * width),
                     "cost": key_costs[k] + value_costs[v]} for k in CACHE_TYPES for v in CACHE_TYPES if (k, v) != ("f16", "f16")),
                   key=lambda pair: (pair["cost"], pair["bits"]))
    best = next(pair for pair in pairs if pair["bits"] <= budget + 1e-9)
    return CacheTypePlan(budget, best["type_k"], best["type_v"], best["bits"], pairs)
