"""Per-layer precision for a serving engine's own KV cache dtype: which layers stay unquantized (vLLM's
--kv-cache-dtype-skip-layers), chosen exactly from a kvcal profile within a budget of real bits per element.

Every layer either takes the engine's dtype (K and V alike, as vLLM's option does) or stays fp16; under a TurboQuant
preset vLLM keeps its first and last two layers fp16 whatever it is told, so those stay fp16 at no cost and are not
named (none in a hybrid; in a model whose layers read another's cache the presets are refused). What quantizing a
layer costs, by `fisher`: the Fisher-weighted squared error of the dtype's key codec on the profile's sampled keys,
cached after RoPE as the engine caches them, the error rotated back before RoPE where the Fisher information was
taken (RoPE rotates channel pairs, so this is exact), plus its value codec's on the values; by `importance`: KVmix's
gradient importance of its K and V. Staying fp16 costs nothing. Prices: the dtype's real bits per element (its K and
V row_bits, scales included) and 16; the budget bounds their mean over the elements the cache stores: each layer
weighs its KV heads x head_dim (layers differ in Gemma 4) times the tokens it stores at `context` (a sliding-window
layer keeps its window; 0: every layer alike). The choice is exact, prices unrounded (`layers_kept_wide`): layers
that store alike cost alike to keep fp16, so a plan is how many of each such class stay fp16, the costliest first.
The plan names the engine's arguments and the `eval ppl --baseline` spec that evaluates the same cache: vLLM counts
the model's decoder layers, `skip=` kvcal's (the attention layers that keep a cache), which differ in hybrid models.
compare_dtypes plans each of the engine's dtypes within one budget by Fisher cost and orders them by it.

llama.cpp takes one cache type per tensor for the whole model (`-ctk`, `-ctv`): plan_cache_types picks the pair with
the least Fisher cost summed over the layers, K and V priced apart, within the budget (every pair of f16 and the
ggml types but f16 for both is tried; they are few); bits are a mean over the layers weighted by their KV heads x
head_dim (per token: these plans take no context). ik_llama.cpp also sets the first N and last M layers of each
tensor to other types (`-ctk-first T,N`, `-ctk-last T,M`, `-ctv-first`, `-ctv-last`; its PR #1599): plan_first_last
weighs every such setting of K and of V (a base type, and a type and count for each end, of the types ik_llama.cpp's
CPU flash attention reads: no q5_0 / q5_1), keeps each tensor's
settings that no other beats on both bits and cost, and takes the K and V pair of least summed cost within the
budget, exactly. Each setting is priced as ik_llama.cpp stores it with -khad / -vhad: rotated on its own blocks when
the tensor's base type is quantized, plain when it is f16 (kvcal.methods.llama_cpp).

Keys are priced as the engines store them, in the model's channel order (kvcal.simulate.InModelOrder), which blocks
of channels and rotations mix. MLA models (multi-head latent attention) are planned for llama.cpp alone, where their
cache is one row a token of one type, the latent and the rotated key unrotated (kvcal.methods.latent_refusal): the
plan is that type (LLAMA_CPP_LATENT_TYPES: the models llama.cpp caches so). vLLM's MLA attention caches one dtype in
every layer (fp8 or 16-bit), so a vLLM plan has nothing to choose there; ik_llama.cpp's MLA cache is not modelled.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import asdict, dataclass

import numpy as np
import torch

from kvcal.adapters import decoder_kind, first_position, kv_shapes, latent_attention, rope_orders
from kvcal.artifacts import read_artifact, read_header
from kvcal.errors import KvcalError
from kvcal.fit.nuq import stored_shares
from kvcal.methods import baseline_method, decoder_refusal
from kvcal.methods.llama_cpp import CACHE_TYPES, IK_CACHE_TYPES, cache_type_codec, ik_llama_cpp_arguments
from kvcal.methods.vllm_dtypes import VLLM_DTYPES
from kvcal.quantizers import FP16_BITS, CodecKind
from kvcal.rope import layer_inv_freq, layer_rope_scaling, rotate_keys
from kvcal.rotation_codecs import GGML_BLOCK, GGML_BLOCK_BYTES
from kvcal.simulate import in_model_order
from kvcal.spans import recorded_spans
from kvcal.vllm_codecs import TQ_PRESETS

ENGINE_DTYPES = {"vllm": (*VLLM_DTYPES, *TQ_PRESETS)}  # the dtypes whose layers an engine can leave unquantized
ENGINES = (*ENGINE_DTYPES, "llama.cpp", "ik_llama.cpp")
CRITERIA = ("fisher", "importance")
# MLA models whose latent llama.cpp caches as one row a token (src/models/deepseek2.cpp, kimi-linear.cpp; GLM-4.7-Flash
# converts as deepseek2); MiniCPM3's it caches as per-head keys and values, not modelled
LLAMA_CPP_LATENT_TYPES = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite", "kimi_linear")
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
    skipped: list[int]  # layers left unquantized, as kvcal counts them (the attention layers that keep a cache)
    bits: float  # real bits per element of the plan (weighted by the elements each layer stores at `context`)
    costs: list[float]  # per layer, what quantizing it costs (Fisher-weighted error or importance)
    dtype_bits: float  # the dtype's real bits per element on the layers it quantizes (weighted alike)
    decoder_layers: list[int]  # each layer's index among the model's decoder layers, which vLLM's option counts

    @property
    def cost(self) -> float:
        """What quantizing the layers it quantizes costs (the engine's own fp16 layers cost nothing)."""
        return float(sum(cost for i, cost in enumerate(self.costs) if i not in self.skipped))

    def engine_arguments(self) -> str:
        arguments = f"--kv-cache-dtype {self.dtype}"
        skipped = [self.decoder_layers[i] for i in self.skipped]
        return arguments + (f" --kv-cache-dtype-skip-layers {' '.join(map(str, skipped))}" if skipped else "")

    def baseline_spec(self) -> str:
        return self.dtype + (f";skip={'+'.join(map(str, self.skipped))}" if self.skipped else "")

    def as_dict(self) -> dict:
        return {**asdict(self), "cost": self.cost, "engine_arguments": self.engine_arguments(),
                "baseline_spec": self.baseline_spec()}


def layer_bits(layers: list, shapes: list[tuple[int, int]]) -> np.ndarray:
    """Per layer of these codecs (a method's layers) and (KV heads, head_dim), its real bits per element, K and V."""
    return np.array([(codecs.key_codec.row_bits(heads * dim) + codecs.value_codec.row_bits(heads * dim)) / (2 * heads * dim)
                     for codecs, (heads, dim) in zip(layers, shapes)])


def dtype_bits(dtype: str, shapes: list[tuple[int, int]], decoder: str) -> float:
    """An engine dtype's real bits per element (codes and scales, K and V) over layers of these (KV heads, head_dim)
    in a decoder of this kvcal.adapters.decoder_kind, the mean weighted by their elements (a spec whose layers differ,
    such as ik_llama.cpp's first/last ones or TurboQuant's fp16 boundary, needs them all)."""
    widths = np.array([heads * dim for heads, dim in shapes])
    layers = baseline_method(dtype, [dim for _, dim in shapes], decoder=decoder).layers
    return float((layer_bits(layers, shapes) * widths).sum() / widths.sum())


def _fixed_fp16(codecs) -> bool:
    """A layer the engine keeps fp16 under this dtype whatever the plan says (TurboQuant's boundary layers)."""
    return codecs.key_codec.kind is CodecKind.FP16


def fixed_fp16_layers(dtype: str, head_dims: list[int], decoder: str) -> set[int]:
    """The layers (of these head_dims, in a decoder of this kvcal.adapters.decoder_kind) the engine keeps fp16 under
    `dtype` whatever it is told (TurboQuant's boundary layers)."""
    layers = baseline_method(dtype, head_dims, decoder=decoder).layers
    return {i for i, codecs in enumerate(layers) if _fixed_fp16(codecs)}


def key_cost(profile: dict, config: dict, layer: int, codec, kv_heads: int) -> float:
    """Fisher-weighted squared error of `codec` on the layer's sampled keys, cached after RoPE as the engines cache
    them, the error rotated back before RoPE where the Fisher information was taken."""
    positions = profile["samples.position"].long() + first_position(config["model"]["fingerprint"])  # (token -> RoPE's)
    keys = profile[f"layers.{layer}.k_post.samples"].float()
    inv_freq = layer_inv_freq(profile["rope.inv_freq"], layer, keys.shape[1] // kv_heads)
    stored = in_model_order(codec, rope_orders(config["model"]["fingerprint"])[layer]).quantize(keys).values
    error = stored - keys
    error_pre = rotate_keys(error, -positions, kv_heads, inv_freq, 1.0 / layer_rope_scaling(config["rope"], layer))  # scalings undone
    return float((profile[f"layers.{layer}.k_pre.fisher"] * error_pre**2).sum())


def value_cost(profile: dict, layer: int, codec) -> float:
    values = profile[f"layers.{layer}.v.samples"].float()
    return float((profile[f"layers.{layer}.v.fisher"] * (codec.quantize(values).values - values) ** 2).sum())


def _fisher_costs(profile: dict, config: dict, layers: list, kv_heads: list[int]) -> list[float]:
    return [0.0 if _fixed_fp16(codecs) else
            key_cost(profile, config, layer, codecs.key_codec, kv_heads[layer]) + value_cost(profile, layer, codecs.value_codec)
            for layer, codecs in enumerate(layers)]


@dataclass
class _PricedLayers:
    """A dtype's layers on a profile's model: what each stores and weighs (see plan_layers)."""

    layers: list  # the dtype's codecs per layer
    fixed: np.ndarray  # per layer, whether the engine keeps it fp16 itself
    prices: np.ndarray  # per layer, its real bits per element (fp16's where fixed)
    weights: np.ndarray  # per layer, its elements a token times the share of the context it keeps

    @property
    def least_bits(self) -> float:
        return float((self.prices * self.weights).sum() / self.weights.sum())

    @property
    def quantized_bits(self) -> float:
        """The dtype's real bits per element on the layers it quantizes."""
        quantized = ~self.fixed
        if not quantized.any():
            return FP16_BITS
        return float((self.prices * self.weights)[quantized].sum() / self.weights[quantized].sum())


def _priced_layers(config: dict, dtype: str, context: int) -> _PricedLayers:
    fingerprint = config["model"]["fingerprint"]
    shapes = kv_shapes(fingerprint)
    layers = baseline_method(dtype, [dim for _, dim in shapes], decoder=decoder_kind(fingerprint)).layers
    shares = stored_shares(recorded_spans(config["model"], len(shapes)), context)
    return _PricedLayers(layers, np.array([_fixed_fp16(codecs) for codecs in layers]), layer_bits(layers, shapes),
                         np.array(shares) * [heads * dim for heads, dim in shapes])


def check_plannable(profile_path, engine: str) -> None:
    """Refuse, from its header alone, a profile of a model whose cache kvcal plan does not model for `engine`: MLA's,
    but where llama.cpp caches its latent as one row a token (LLAMA_CPP_LATENT_TYPES)."""
    kind, config = read_header(profile_path)
    fingerprint = config.get("model", {}).get("fingerprint", {}) if kind == "profile" else {}
    if not latent_attention(fingerprint):  # (another kind of artifact: read_artifact refuses it)
        return
    refusal = {"vllm": "vLLM's MLA attention caches one fp8 or 16-bit dtype in every layer (it reads no "
                       "--kv-cache-dtype-skip-layers), so there is nothing to plan; --engine llama.cpp plans its type",
               "ik_llama.cpp": "ik_llama.cpp's MLA cache is not modelled; --engine llama.cpp plans llama.cpp's"}.get(engine)
    if refusal is None and fingerprint["model_type"] not in LLAMA_CPP_LATENT_TYPES:
        refusal = (f"llama.cpp's cache of {fingerprint['model_type']} is not modelled (kvcal plans the one-row MLA cache "
                   f"llama.cpp keeps for {', '.join(LLAMA_CPP_LATENT_TYPES)})")
    if refusal is not None:
        raise KvcalError(f"'{profile_path}' profiles a multi-head latent attention (MLA) model: {refusal}")


def _read_profile(profile_path, engine: str) -> tuple[dict, dict]:
    """A profile's (tensors, config) to plan `engine`'s cache (check_plannable)."""
    check_plannable(profile_path, engine)
    return read_artifact(profile_path, "profile")


def _check_request(engine: str, dtypes: list[str], by: str, context: int) -> None:
    if engine not in ENGINE_DTYPES:
        raise KvcalError(f"--engine '{engine}' is not one of {', '.join(ENGINE_DTYPES)}")
    for dtype in dtypes:
        if dtype not in ENGINE_DTYPES[engine]:
            raise KvcalError(f"--dtype '{dtype}' is not one of {engine}'s: {', '.join(ENGINE_DTYPES[engine])}")
    if by not in CRITERIA:
        raise KvcalError(f"--by '{by}' is not one of {', '.join(CRITERIA)}")
    if context < 0:
        raise KvcalError(f"--context must be 0 or a number of tokens (got {context})")


def plan_layers(profile_path: str, engine: str, dtype: str, budget: float, by: str = "fisher", context: int = 0) -> Plan:
    """The layers to leave unquantized so that `dtype` on the rest stores at most `budget` real bits per element
    with the least total cost (see the module docstring)."""
    _check_request(engine, [dtype], by, context)
    profile, config = _read_profile(profile_path, engine)
    priced = _priced_layers(config, dtype, context)
    if not priced.least_bits - 1e-9 <= budget <= FP16_BITS:
        raise KvcalError(f"--budget {budget} is outside [{priced.least_bits:g}, {FP16_BITS}] real bits per element: {dtype} "
                         f"stores {priced.quantized_bits:g}, an unquantized layer {FP16_BITS}"
                         + (", and it keeps some layers unquantized" if priced.fixed.any() else ""))
    return _plan(profile, config, engine, dtype, budget, by, context, priced)


def _plan(profile: dict, config: dict, engine: str, dtype: str, budget: float, by: str, context: int,
          priced: _PricedLayers) -> Plan:
    """plan_layers on a profile read, the dtype priced and the budget within its range."""
    fingerprint = config["model"]["fingerprint"]
    fixed, prices, weights = priced.fixed, priced.prices, priced.weights
    kv_heads = [heads for heads, _ in kv_shapes(fingerprint)]
    with torch.inference_mode():
        costs = (_fisher_costs(profile, config, priced.layers, kv_heads) if by == "fisher" else
                 np.where(fixed, 0.0, (profile["importance.k"] + profile["importance.v"]).numpy()).tolist())
    extra = (FP16_BITS - prices) * weights  # what keeping each layer fp16 adds to the weighted sum of prices
    slack = max(budget * weights.sum() - (prices * weights).sum(), 0.0)  # the range check allows 1e-9 under
    skipped = layers_kept_wide(costs, extra, slack)
    kept = np.where(np.isin(np.arange(len(prices)), skipped), FP16_BITS, prices)
    bits = float((kept * weights).sum() / weights.sum())
    decoder_layers = fingerprint.get("attention_layers", list(range(len(prices))))
    return Plan(engine, dtype, budget, by, context, skipped, bits, costs, priced.quantized_bits, decoder_layers)


@dataclass
class DtypeComparison:
    """Every dtype of an engine planned within one budget by Fisher cost: the plan of least cost, the others beside it."""

    plans: list[Plan]  # the dtypes that fit the budget, least cost first
    unfit: dict[str, str]  # dtype -> why it has no plan within the budget

    @property
    def best(self) -> Plan:
        return self.plans[0]

    def engine_arguments(self) -> str:
        return self.best.engine_arguments()

    def baseline_spec(self) -> str:
        return self.best.baseline_spec()

    def as_dict(self) -> dict:
        return {**self.best.as_dict(), "compared": [{"dtype": plan.dtype, "bits": plan.bits, "skipped": plan.skipped,
                                                     "cost": plan.cost} for plan in self.plans], "unfit": self.unfit}


def compare_dtypes(profile_path: str, engine: str, budget: float, context: int = 0) -> DtypeComparison:
    """Each of the engine's dtypes planned within `budget` (plan_layers, by Fisher cost, which is comparable between
    dtypes: the same samples' weighted error), the least total cost first; refuses a budget no dtype fits."""
    _check_request(engine, [], "fisher", context)
    if not 0 < budget <= FP16_BITS:
        raise KvcalError(f"--budget {budget} is outside (0, {FP16_BITS}] real bits per element")
    profile, config = _read_profile(profile_path, engine)  # read and checksummed once for every dtype
    decoder = decoder_kind(config["model"]["fingerprint"])
    plans, unfit, leasts = [], {}, []
    for dtype in ENGINE_DTYPES[engine]:
        refusal = decoder_refusal(dtype, decoder)  # (baseline_method refuses it)
        if refusal is not None:
            unfit[dtype] = refusal
            continue
        priced = _priced_layers(config, dtype, context)
        leasts.append(priced.least_bits)
        if priced.least_bits > budget + 1e-9:
            unfit[dtype] = f"stores at least {priced.least_bits:.4g} real bits per element"
        else:
            plans.append(_plan(profile, config, engine, dtype, budget, "fisher", context, priced))
    if not plans:
        raise KvcalError(f"--budget {budget} is below what every {engine} dtype stores: give at least {min(leasts):g} real "
                         "bits per element")
    return DtypeComparison(sorted(plans, key=lambda plan: (plan.cost, plan.bits, plan.dtype)), unfit)


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


@dataclass
class CacheTypePrices:
    """What each llama.cpp cache type costs and stores, per tensor ("k", "v") and type, per layer."""

    costs: dict[str, dict[str, np.ndarray]]  # Fisher-weighted error of each layer under the type
    bits: dict[str, dict[str, np.ndarray]]  # each layer's real bits per element under the type
    widths: np.ndarray  # each layer's elements a token (KV heads x head_dim): the weights of a mean over the layers

    def mean_bits(self, tensor: str, cache_type: str) -> float:
        return float((self.bits[tensor][cache_type] * self.widths).sum() / self.widths.sum())


def cache_type_prices(profile: dict, config: dict, hadamard: str | None, types: tuple[str, ...] = CACHE_TYPES) -> CacheTypePrices:
    """`types` priced on a profile read (its tensors and config), rotated as `hadamard` says (LlamaCppKV), each
    layer by the codec of its head_dim (MLA's latent: its width)."""
    fingerprint = config["model"]["fingerprint"]
    shapes = kv_shapes(fingerprint)
    codecs = {tensor: {t: [cache_type_codec(t, dim, tensor, hadamard) for _, dim in kv_shapes(fingerprint, tensor)]
                       for t in types} for tensor in "kv"}
    with torch.inference_mode():
        costs = {"k": {t: np.array([key_cost(profile, config, i, codec, shapes[i][0]) for i, codec in enumerate(by_layer)])
                       for t, by_layer in codecs["k"].items()},
                 "v": {t: np.array([value_cost(profile, i, codec) for i, codec in enumerate(by_layer)])
                       for t, by_layer in codecs["v"].items()}}
    widths = np.array([heads * dim for heads, dim in shapes])
    bits = {tensor: {t: np.array([codec.row_bits(int(w)) / w for codec, w in zip(by_layer, widths)])
                     for t, by_layer in by_type.items()} for tensor, by_type in codecs.items()}
    return CacheTypePrices(costs, bits, widths)


def cache_type_pairs(prices: CacheTypePrices, one_type: bool = False) -> list[dict]:
    """Every -ctk / -ctv pair of the types priced but f16 for both (type_k, type_v, bits, cost summed over the layers),
    cheapest first; one_type: only a type for both (MLA's one row a token)."""
    pairs = [{"type_k": k, "type_v": v, "bits": (prices.mean_bits("k", k) + prices.mean_bits("v", v)) / 2,
              "cost": float(prices.costs["k"][k].sum() + prices.costs["v"][v].sum())}
             for k in prices.costs["k"] for v in prices.costs["v"]
             if (k, v) != ("f16", "f16") and (k == v or not one_type)]
    return sorted(pairs, key=lambda pair: (pair["cost"], pair["bits"]))


def plan_cache_types(profile_path: str, budget: float) -> CacheTypePlan:
    """The -ctk / -ctv pair of least Fisher-weighted error that stores at most `budget` real bits per element (MLA's:
    one type, unrotated)."""
    check_cache_type_budget(budget)
    profile, config = _read_profile(profile_path, "llama.cpp")
    latent = latent_attention(config["model"]["fingerprint"])
    pairs = cache_type_pairs(cache_type_prices(profile, config, None if latent else "llama.cpp"), one_type=latent)
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


def _running_sums(per_layer: dict) -> dict[str, np.ndarray]:
    """Per type, the sums of its first 0, 1, ..., all layers' values."""
    return {t: np.concatenate([[0.0], np.cumsum(values)]) for t, values in per_layer.items()}


def tensor_settings(costs: dict[str, np.ndarray], bits: dict[str, float | np.ndarray], plain_costs: dict | None = None,
                    widths: np.ndarray | None = None) -> list[TensorSetting]:
    """The settings of one tensor (every base type priced, and for each end no layers or 1.. of another type) that no other
    setting beats on both bits and cost, fewest bits first; among equals the one with fewer ends set apart. The ends
    of an f16 base are priced by plain_costs (unrotated: ik_llama.cpp rotates nothing then), default costs. bits: a
    type's real bits per element, one number or one a layer; a setting's bits are their mean over the layers weighted
    by `widths` (each layer's elements a token; default alike)."""
    num_layers = len(next(iter(costs.values())))
    sums = _running_sums(costs)
    plain_sums = sums if plain_costs is None else _running_sums(plain_costs)
    weights = np.ones(num_layers) if widths is None else np.asarray(widths, dtype=np.float64)
    bit_sums = _running_sums({t: weights * b for t, b in bits.items()})  # sums of bits x elements
    first_n, last_n = np.meshgrid(np.arange(num_layers + 1), np.arange(num_layers + 1), indexing="ij")
    candidates = []
    for base, first, last in itertools.product(costs, repeat=3):
        allowed = ((first_n + last_n <= num_layers) & ((first_n == 0) == (first == base)) & ((last_n == 0) == (last == base)))
        ends = plain_sums if base == "f16" else sums
        cost = (ends[first][first_n] + sums[base][num_layers - last_n] - sums[base][first_n]
                + ends[last][num_layers] - ends[last][num_layers - last_n])
        mean_bits = (bit_sums[first][first_n] + bit_sums[base][num_layers - last_n] - bit_sums[base][first_n]
                     + bit_sums[last][num_layers] - bit_sums[last][num_layers - last_n]) / weights.sum()
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


def choose_first_last(costs: dict, bits: dict, budget: float, plain_costs: dict | None = None,
                      widths: np.ndarray | None = None) -> tuple[TensorSetting, TensorSetting]:
    """The K and V settings (see tensor_settings) of least summed cost whose mean bits are at most `budget`, not both
    all f16; costs[tensor][type] per layer (plain_costs likewise, unrotated), bits[tensor][type], widths as there."""
    fronts = {tensor: tensor_settings(costs[tensor], bits[tensor], None if plain_costs is None else plain_costs[tensor], widths)
              for tensor in "kv"}
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
    profile, config = _read_profile(profile_path, "ik_llama.cpp")  # read and checksummed once for both pricings
    prices = cache_type_prices(profile, config, "ik_llama.cpp", IK_CACHE_TYPES)
    plain = cache_type_prices(profile, config, None, IK_CACHE_TYPES)
    k, v = choose_first_last(prices.costs, prices.bits, budget, plain.costs, prices.widths)
    pair = next(pair for pair in cache_type_pairs(prices) if pair["bits"] <= budget + 1e-9)
    return FirstLastPlan(budget, k, v, (k.bits + v.bits) / 2, k.cost + v.cost, pair)
