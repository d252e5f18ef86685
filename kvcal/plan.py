"""Per-layer precision for a serving engine's own KV cache dtype: which layers stay unquantized (vLLM's
--kv-cache-dtype-skip-layers), chosen from a kvcal profile by the exact multiple-choice knapsack of kvcal.fit.nuq
within a budget of real bits per element.

Every layer either takes the engine's dtype (K and V alike, as vLLM's option does) or stays fp16. What quantizing
it costs, by `fisher`: the Fisher-weighted squared error of the dtype's codec on the profile's sampled keys, cached
after RoPE as the engine caches them, the error rotated back before RoPE where the Fisher information was taken (RoPE
rotates channel pairs, so this is exact), plus its values'; by `importance`: KVmix's gradient importance of its K
and V. Staying fp16 costs nothing. Prices: the dtype's real bits per element (its row_bits, scales included) and 16;
the budget bounds their mean over the layers, each weighted by the tokens it stores at `context` (a sliding-window
layer keeps its window; 0: every layer alike). The plan names the engine's arguments and the `eval ppl --baseline`
spec that evaluates the same cache.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from kvcal.artifacts import read_artifact
from kvcal.errors import KvcalError
from kvcal.fit.nuq import choose_widths, stored_shares
from kvcal.methods import baseline_method
from kvcal.methods.vllm_dtypes import VLLM_DTYPES
from kvcal.quantizers import FP16_BITS
from kvcal.rope import layer_inv_freq, rotate_keys

ENGINE_DTYPES = {"vllm": tuple(VLLM_DTYPES)}  # the dtypes whose layers an engine can leave unquantized
CRITERIA = ("fisher", "importance")


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
    """An engine dtype's real bits per element (codes and scales) for heads of `head_dim` channels."""
    width = kv_heads * head_dim
    return baseline_method(dtype, 1, head_dim).layers[0].key_codec.row_bits(width) / width


def _fisher_costs(profile: dict, config: dict, codec, num_layers: int, kv_heads: int) -> list[float]:
    positions = profile["samples.position"].long()
    scaling = config["rope"]["attention_scaling"]
    costs = []
    for layer in range(num_layers):
        inv_freq = layer_inv_freq(profile["rope.inv_freq"], layer)
        keys = profile[f"layers.{layer}.k_post.samples"].float()
        error = codec.quantize(keys).values - keys
        error_pre = rotate_keys(error, -positions, kv_heads, inv_freq, 1.0 / scaling)  # R(p)^-1, scalings undone
        values = profile[f"layers.{layer}.v.samples"].float()
        cost = (profile[f"layers.{layer}.k_pre.fisher"] * error_pre**2).sum() + \
            (profile[f"layers.{layer}.v.fisher"] * (codec.quantize(values).values - values) ** 2).sum()
        costs.append(float(cost))
    return costs


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
    codec = baseline_method(dtype, 1, head_dim).layers[0].key_codec
    quantized_bits = dtype_bits(dtype, head_dim, kv_heads)
    if not quantized_bits <= budget <= FP16_BITS:
        raise KvcalError(f"--budget {budget} is outside [{quantized_bits:g}, {FP16_BITS}] real bits per element: {dtype} stores "
                         f"{quantized_bits:g} and an unquantized layer {FP16_BITS}")
    with torch.inference_mode():
        costs = (_fisher_costs(profile, config, codec, num_layers, kv_heads) if by == "fisher" else
                 (profile["importance.k"] + profile["importance.v"]).tolist())
    shares = np.array(stored_shares(config["model"].get("windows"), context, num_layers))
    choices = choose_widths(np.array([[cost, 0.0] for cost in costs]), np.array([[quantized_bits, float(FP16_BITS)]] * num_layers),
                            budget, shares)
    skipped = [layer for layer, choice in enumerate(choices) if choice == 1]
    prices = np.where(np.array(choices) == 1, FP16_BITS, quantized_bits)
    bits = float((prices * shares).sum() / shares.sum())
    return Plan(engine, dtype, budget, by, context, skipped, bits, costs, quantized_bits)
