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
ggml types but f16 for both is tried; they are few). ik_llama.cpp also sets the first N and last M layers of each
tensor to other types (`-ctk-first T,N`, `-ctk-last T,M`, `-ctv-first`, `-ctv-last`; its PR #1599): plan_first_last
weighs every such setting of K and of V (a base type, and a type and count for each end, of the types ik_llama.cpp's
CPU flash attention reads: no q5_0 / q5_1), keeps each tensor's
settings that no other beats on both bits and cost, and takes the K and V pair of least summed cost within the
budget, exactly. Each setting is priced as ik_llama.cpp stores it with -khad / -vhad: rotated on its own blocks when
the tensor's base type is quantized, plain when it is f16 (kvcal.methods.llama_cpp).
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import asdict, dataclass

import numpy as np
import torch

from kvcal.adapters import kv_shapes
from kvcal.artifacts import read_artifact
from kvcal.errors import KvcalError
from kvcal.fit.nuq import stored_shares
from kvcal.methods import baseline_method
from kvcal.methods.llama_cpp import CACHE_TYPES, IK_CACHE_TYPES, cache_type_codec, ik_llama_cpp_arguments
from kvcal.methods.vllm_dtypes import VLLM_DTYPES
from kvcal.quantizers import FP16_BITS, CodecKind
from kvcal.rope import layer_inv_freq, layer_rope_scaling, rotate_keys
from kvcal.rotation_codecs import GGML_BLOCK, GGML_BLOCK_BYTES
from kvcal.vllm_codecs import TQ_PRESETS

ENGINE_DTYPES = {"vllm": (*VLLM_DTYPES, *TQ_PRESETS)}  # the dtypes whose layers an engine can leave unquantized
ENGINES = (*ENGINE_DTYPES, "llama.cpp", "ik_llama.cpp")
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


def dtype_bits(dtype: str, head_dim: int, kv_heads: int, num_layers: int = 1) -> float:
    """An engine dtype's real bits per element (codes and scales, K and V) for heads of `head_dim` channels, the mean
    over `num_layers` layers (a spec whose layers differ, such as ik_llama.cpp's first/last ones, needs them all)."""
    width = kv_heads * head_dim
    layers = baseline_method(dtype, [head_dim] * num_layers).layers
    return sum(codecs.key_codec.row_bits(width) + codecs.value_codec.row_bits(width) for codecs in layers) / (2 * width * num_layers)


def _one_shape(fingerprint: dict, where: str) -> tuple[int, int, int]:
    """(layers, head_dim, KV heads) of a model whose layers share one, as the engines' plans price them; refuses one
    whose layers differ (Gemma 4), whose per-layer prices these plans do not weigh yet."""
    shapes = kv_shapes(fingerprint)
    if len(set(shapes)) > 1:
        raise KvcalError(f"{where}: its model's layers differ in KV heads x head_dim ({', '.join(sorted({f'{h} x {d}' for h, d in shapes}))}); "
                         "engine plans price one shape for every layer: run kvcal eval ppl with the dtype and skip=L+L+... instead")
    return fingerprint["num_layers"], shapes[0][1], shapes[0][0]


def _fixed_fp16(codecs) -> bool:
    """A layer the engine keeps fp16 under this dtype whatever the plan says (TurboQuant's boundary layers)."""
    return codecs.key_codec.kind is CodecKind.FP16


def fixed_fp16_layers(dtype: str, num_layers: int, head_dim: int) -> set[int]:
    """The layers the engine keeps fp16 under `dtype` whatever it is told (TurboQuant's first and last two)."""
    return {i for i, codecs in enumerate(baseline_method(dtype, [head_dim] * num_layers).layers) if _fixed_fp16(codecs)}


def key_cost(profile: dict, config: dict, layer: int, codec, kv_heads: int) -> float:
    """Fisher-weighted squared error of `codec` on the layer's sampled keys, cached after RoPE as the engines cache
    them, the error rotated back before RoPE where the Fisher information was taken."""
    positions = profile["samples.position"].long()
    keys = profile[f"layers.{layer}.k_post.samples"].float()
    inv_freq = layer_inv_freq(profile["rope.inv_freq"], layer, keys.shape[1] // kv_heads)
    error = codec.quantize(keys).values - keys
    error_pre = rotate_keys(error, -positions, kv_heads, inv_freq, 1.0 / layer_rope_scaling(config["rope"], layer))  # scalings undone
    return float((profile[f"layers.{layer}.k_pre.fisher"] * error_pre**2).sum())


def value_cost(profile: dict, layer: int, codec) -> float:
    values = profile[f"layers.{layer}.v.samples"].float()
    return float((profile[f"layers.{layer}.v.fisher"] * (codec.quantize(values).values - values) ** 2).sum())


def _fisher_costs(profile: dict, config: dict, layers: list, kv_heads: int) -> list[float]:
    return [0.0 if _fixed_fp16(codecs) else
            key_cost(profile, config, layer, codecs.key_codec, kv_heads) + value_cost(profile, layer, codecs.value_codec)
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
    num_layers, head_dim, kv_heads = _one_shape(config["model"]["fingerprint"], profile_path)
    layers = baseline_method(dtype, [head_dim] * num_layers).layers
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


def cache_type_costs(profile_path: str, hadamard: str | None = "llama.cpp") -> tuple[dict[str, dict[str, np.ndarray]], dict[str, dict[str, float]]]:
    """Per tensor ("k", "v") and llama.cpp cache type, rotated as `hadamard` says (LlamaCppKV): the Fisher-weighted
    error of each layer under it, and its real bits per element."""
    return _priced_cache_types(*read_artifact(profile_path, "profile"), hadamard)


def _priced_cache_types(profile: dict, config: dict, hadamard: str | None, types: tuple[str, ...] = CACHE_TYPES):
    """cache_type_costs on a profile already read (its tensors and config), of `types`."""
    num_layers, head_dim, kv_heads = _one_shape(config["model"]["fingerprint"], "the profile")
    width = kv_heads * head_dim
    codecs = {tensor: {t: cache_type_codec(t, head_dim, tensor, hadamard) for t in types} for tensor in "kv"}
    with torch.inference_mode():
        costs = {"k": {t: np.array([key_cost(profile, config, i, codec, kv_heads) for i in range(num_layers)])
                       for t, codec in codecs["k"].items()},
                 "v": {t: np.array([value_cost(profile, i, codec) for i in range(num_layers)]) for t, codec in codecs["v"].items()}}
    bits = {tensor: {t: codec.row_bits(width) / width for t, codec in by_type.items()} for tensor, by_type in codecs.items()}
    return costs, bits


def cache_type_pairs(costs: dict, bits: dict) -> list[dict]:
    """Every -ctk / -ctv pair of the types priced but f16 for both (type_k, type_v, bits, cost summed over the layers),
    cheapest first."""
    pairs = [{"type_k": k, "type_v": v, "bits": (bits["k"][k] + bits["v"][v]) / 2, "cost": float(costs["k"][k].sum() + costs["v"][v].sum())}
             for k in costs["k"] for v in costs["v"] if (k, v) != ("f16", "f16")]
    return sorted(pairs, key=lambda pair: (pair["cost"], pair["bits"]))


def plan_cache_types(profile_path: str, budget: float) -> CacheTypePlan:
    """The -ctk / -ctv pair of least Fisher-weighted error that stores at most `budget` real bits per element."""
    check_cache_type_budget(budget)
    pairs = cache_type_pairs(*cache_type_costs(profile_path))
    best = next(pair for pair in pairs if pair["bits"] <= budget + 1e-9)
    return CacheTypePlan(budget, best["type_k"], best["type_v"], best["bits"], pairs)


@dataclass
class TensorSetting:
    """One tensor's ik_llama.cpp cache types: `base` on every layer but the first `first_count` (at `first`) and the
    last `last_count` (at `last`)."""

    base: str
    first: str
    first_count: int
    last: str
    last_count: int
    bits: float  # real bits per element, the mean over the layers
    cost: float  # Fisher-weighted error summed over the layers

    def ends(self) -> list[tuple[str, str, int]]:
        """("first" | "last", type, count) of each end set apart."""
        return [(end, t, n) for end, t, n in (("first", self.first, self.first_count), ("last", self.last, self.last_count)) if n]


def tensor_settings(costs: dict[str, np.ndarray], bits: dict[str, float], plain_costs: dict | None = None) -> list[TensorSetting]:
    """The settings of one tensor (every base type priced, and for each end no layers or 1.. of another type) that no other
    setting beats on both bits and cost, fewest bits first; among equals the one with fewer ends set apart. The ends
    of an f16 base are priced by plain_costs (unrotated: ik_llama.cpp rotates nothing then), default costs."""
    num_layers = len(next(iter(costs.values())))
    sums = {t: np.concatenate([[0.0], np.cumsum(c)]) for t, c in costs.items()}
    plain_sums = sums if plain_costs is None else {t: np.concatenate([[0.0], np.cumsum(c)]) for t, c in plain_costs.items()}
    first_n, last_n = np.meshgrid(np.arange(num_layers + 1), np.arange(num_layers + 1), indexing="ij")
    candidates = []
    for base, first, last in itertools.product(costs, repeat=3):
        allowed = ((first_n + last_n <= num_layers) & ((first_n == 0) == (first == base)) & ((last_n == 0) == (last == base)))
        ends = plain_sums if base == "f16" else sums
        cost = (ends[first][first_n] + sums[base][num_layers - last_n] - sums[base][first_n]
                + ends[last][num_layers] - ends[last][num_layers - last_n])
        mean_bits = (first_n * bits[first] + (num_layers - first_n - last_n) * bits[base] + last_n * bits[last]) / num_layers
        for n, m in zip(*np.nonzero(allowed)):
            candidates.append(TensorSetting(base, first, int(n), last, int(m), float(mean_bits[n, m]), float(cost[n, m])))
    candidates.sort(key=lambda c: (round(c.bits, 9), c.cost, len(c.ends()), c.first_count + c.last_count))
    front, least = [], math.inf
    for candidate in candidates:
        if candidate.cost < least:
            front.append(candidate)
            least = candidate.cost
    return front


@dataclass
class FirstLastPlan:
    """ik_llama.cpp's K and V settings within a budget, against the best one-type-per-tensor pair."""

    budget: float
    k: TensorSetting
    v: TensorSetting
    bits: float
    cost: float
    pair: dict  # the best -ctk / -ctv pair within the budget (CacheTypePlan's), for comparison

    def engine_arguments(self) -> str:
        return ik_llama_cpp_arguments(self.baseline_spec())

    def baseline_spec(self) -> str:
        base = self.k.base if self.k.base == self.v.base else f"{self.k.base}/{self.v.base}"
        return base + "".join(f";{tensor}_{end}={t},{n}" for tensor, setting in (("k", self.k), ("v", self.v))
                              for end, t, n in setting.ends())

    def as_dict(self) -> dict:
        return {"engine": "ik_llama.cpp", **asdict(self), "engine_arguments": self.engine_arguments(),
                "baseline_spec": self.baseline_spec()}


def choose_first_last(costs: dict, bits: dict, budget: float, plain_costs: dict | None = None) -> tuple[TensorSetting, TensorSetting]:
    """The K and V settings (see tensor_settings) of least summed cost whose mean bits are at most `budget`, not both
    all f16; costs[tensor][type] per layer (plain_costs likewise, unrotated), bits[tensor][type]."""
    fronts = {tensor: tensor_settings(costs[tensor], bits[tensor], None if plain_costs is None else plain_costs[tensor]) for tensor in "kv"}
    value_bits = [v.bits for v in fronts["v"]]
    best = None
    for k in fronts["k"]:
        fitting = bisect.bisect_right(value_bits, 2 * budget - k.bits + 1e-9)  # along a front cost falls as bits rise
        if fitting and fronts["v"][fitting - 1].bits == k.bits == FP16_BITS:
            fitting -= 1  # f16 for both is no quantized cache
        if fitting and (best is None or k.cost + fronts["v"][fitting - 1].cost < best[0].cost + best[1].cost):
            best = (k, fronts["v"][fitting - 1])
    return best


def plan_first_last(profile_path: str, budget: float) -> FirstLastPlan:
    """ik_llama.cpp's -ctk / -ctv with -ctk-first/-last and -ctv-first/-last of least Fisher-weighted error that
    store at most `budget` real bits per element (K and V rows alike), exactly, of IK_CACHE_TYPES."""
    check_cache_type_budget(budget)
    profile, config = read_artifact(profile_path, "profile")  # read and checksummed once for both pricings
    costs, bits = _priced_cache_types(profile, config, "ik_llama.cpp", IK_CACHE_TYPES)
    plain_costs, _ = _priced_cache_types(profile, config, None, IK_CACHE_TYPES)
    k, v = choose_first_last(costs, bits, budget, plain_costs)
    pair = next(pair for pair in cache_type_pairs(costs, bits) if pair["bits"] <= budget + 1e-9)
    return FirstLastPlan(budget, k, v, (k.bits + v.bits) / 2, k.cost + v.cost, pair)
