"""kvcal.plan: which layers an engine leaves unquantized, chosen by the knapsack within a budget."""

import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from kvcal.adapters import kv_shapes
from kvcal.artifacts import read_artifact
from kvcal.errors import KvcalError
from kvcal.methods import baseline_method
from kvcal.methods.llama_cpp import CACHE_TYPES, IK_CACHE_TYPES, cache_type_codec
from kvcal.methods.vllm_dtypes import VLLM_DTYPES
from kvcal.models import resolve_model
from kvcal.plan import (ENGINE_DTYPES, FirstLastPlan, TensorSetting, choose_first_last, compare_dtypes, dtype_bits, key_cost,
                        layers_kept_wide, plan_cache_types, plan_first_last, plan_layers, value_cost)
from kvcal.rope import rotate_keys
from kvcal.vllm_codecs import TQ_PRESETS


def test_the_budget_buys_fp16_for_the_costliest_layers_first(tiny_profile):
    """The tiny Llama (2 layers, head_dim 16: int4_per_token_head stores 4 + 32/16 = 6 bits): at 6 bits nothing stays
    fp16, at 11 one layer may (the one whose quantization costs more), at 16 both."""
    _, profile = tiny_profile
    none = plan_layers(str(profile), "vllm", "int4_per_token_head", 6.0)
    one = plan_layers(str(profile), "vllm", "int4_per_token_head", 11.0)
    both = plan_layers(str(profile), "vllm", "int4_per_token_head", 16.0)
    assert none.skipped == [] and none.bits == none.dtype_bits == 6.0
    assert one.skipped == [max(range(2), key=lambda i: one.costs[i])] and one.bits == 11.0
    assert both.skipped == [0, 1] and both.bits == 16.0
    assert one.engine_arguments() == f"--kv-cache-dtype int4_per_token_head --kv-cache-dtype-skip-layers {one.skipped[0]}"
    assert one.baseline_spec() == f"int4_per_token_head;skip={one.skipped[0]}"
    assert none.engine_arguments() == "--kv-cache-dtype int4_per_token_head" and none.baseline_spec() == "int4_per_token_head"


def assert_the_fisher_cost_is_by_hand(profile: Path, first_position: int) -> None:
    """Layer 0's cost by hand: the codec's error on the post-RoPE key samples rotated back to their pre-RoPE frame (by
    each token's RoPE position: its index + first_position), weighted by the pre-RoPE Fisher, plus the values'
    Fisher-weighted error. The tiny models' costs are near 1e-14: compared with no absolute slack."""
    tensors, config = read_artifact(str(profile), "profile")
    heads, head_dim = kv_shapes(config["model"]["fingerprint"])[0]
    codec = baseline_method("int8_per_token_head", [head_dim]).layers[0].key_codec
    keys, values = tensors["layers.0.k_post.samples"].float(), tensors["layers.0.v.samples"].float()
    positions = tensors["samples.position"].long() + first_position
    pre = tensors["layers.0.k_pre.samples"].float()
    frame = rotate_keys(keys, -positions, heads, tensors["rope.inv_freq"])
    torch.testing.assert_close(frame, pre, rtol=0, atol=1e-4)
    back = rotate_keys(codec.quantize(keys).values - keys, -positions, heads, tensors["rope.inv_freq"])
    value_error = codec.quantize(values).values - values
    expected = (tensors["layers.0.k_pre.fisher"] * back**2).sum() + (tensors["layers.0.v.fisher"] * value_error**2).sum()
    got = plan_layers(str(profile), "vllm", "int8_per_token_head", 16.0).costs[0]
    assert got == pytest.approx(float(expected), rel=1e-6, abs=0)


def test_the_fisher_cost_weighs_the_error_before_rope_where_the_fisher_was_taken(tiny_profile):
    assert_the_fisher_cost_is_by_hand(tiny_profile[1], 0)


def test_the_fisher_cost_rotates_back_by_positions_counted_from_one_where_the_model_counts_so(tiny_model_dir, tiny_corpus,
                                                                                             tmp_path):
    """PaliGemma's RoPE positions count from 1: its profile's keys were rotated by each token's index + 1."""
    from helpers.tiny_bundles import profile_tiny_model

    profile = profile_tiny_model(tiny_model_dir("paligemma"), tiny_corpus, tmp_path / "profile.safetensors")
    assert_the_fisher_cost_is_by_hand(profile, 1)


def test_importance_and_context_change_the_choice_as_documented(tiny_profile, gemma3_profile):
    """By importance the costs are the profile's KVmix importance; on the tiny Gemma 3 at a 4096-token context its
    sliding layer (window 16) costs 15/4096 of a full one to keep, so a budget just above the dtype's keeps it."""
    _, profile = tiny_profile
    tensors, _ = read_artifact(str(profile), "profile")
    by_importance = plan_layers(str(profile), "vllm", "int4_per_token_head", 11.0, by="importance")
    assert by_importance.costs == pytest.approx((tensors["importance.k"] + tensors["importance.v"]).tolist())
    long = plan_layers(str(gemma3_profile), "vllm", "int4_per_token_head", 6.1, context=4096)
    assert long.skipped == [0] and long.bits < 6.1
    assert plan_layers(str(gemma3_profile), "vllm", "int4_per_token_head", 6.1).skipped == []


def test_a_turboquant_plan_prices_k_and_v_apart_and_never_names_the_layers_vllm_keeps(tiny_model_dir, tiny_corpus, tmp_path):
    """A 6-layer tiny Llama (head_dim 16) under turboquant_k3v4_nc: vLLM keeps layers 0, 1, 4 and 5 fp16 itself, so
    they cost nothing and are never named; layers 2 and 3 store (4 + 6) / 2 = 5 bits, so the least budget is
    (4 x 16 + 2 x 5) / 6, at which nothing more stays fp16, and at 16 both stay fp16."""
    from helpers.tiny_bundles import profile_tiny_model
    from kvcal.vllm_codecs import TurboQuantKeys, TurboQuantValues

    profile = str(profile_tiny_model(tiny_model_dir("llama", num_hidden_layers=6), tiny_corpus, tmp_path / "profile.safetensors"))
    least = plan_layers(profile, "vllm", "turboquant_k3v4_nc", (4 * 16 + 2 * 5) / 6)
    assert least.skipped == [] and least.dtype_bits == 5.0 and least.bits == pytest.approx((4 * 16 + 2 * 5) / 6)
    assert [cost == 0.0 for cost in least.costs] == [True, True, False, False, True, True]
    assert plan_layers(profile, "vllm", "turboquant_k3v4_nc", 16.0).skipped == [2, 3]
    tensors, _ = read_artifact(profile, "profile")
    values = tensors["layers.2.v.samples"].float()
    value_cost = float((tensors["layers.2.v.fisher"] * (TurboQuantValues(4, 16).quantize(values).values - values) ** 2).sum())
    keys = tensors["layers.2.k_post.samples"].float()
    key_error = rotate_keys(TurboQuantKeys(3, 16, True).quantize(keys).values - keys, -tensors["samples.position"].long(), 2,
                            tensors["rope.inv_freq"])
    assert least.costs[2] == pytest.approx(float((tensors["layers.2.k_pre.fisher"] * key_error**2).sum()) + value_cost, rel=1e-5, abs=0)
    with pytest.raises(KvcalError, match=r"outside \[12.3333, 16\] .* and it keeps some layers unquantized"):
        plan_layers(profile, "vllm", "turboquant_k3v4_nc", 6.0)


def test_a_budget_that_buys_exactly_n_unquantized_layers_keeps_n():
    """turboquant_k3v4_nc stores 3.59375 bits at head_dim 256 with one KV head (Gemma 3 270M): at the budget of n of 18
    layers fp16 the plan keeps the n costliest; with a sliding layer's price weighted by its 511 of 4096 tokens, the
    same budget keeps at least their cost (prices rounded up to a unit lost one layer there)."""
    quantized = dtype_bits("turboquant_k3v4_nc", [(1, 256)], "dense")
    assert quantized == 3.59375
    costs = [i + 1.0 for i in range(18)]
    for shares in (np.ones(18), np.array([1.0 if i % 6 == 5 else 511 / 4096 for i in range(18)])):
        extra = (16 - quantized) * shares
        for kept in (6, 8):
            wide = list(range(18 - kept, 18))
            got = layers_kept_wide(costs, extra, extra[wide].sum())
            assert got == wide if (shares == 1).all() else (extra[got].sum() <= extra[wide].sum()
                                                       and sum(costs[i] for i in got) >= sum(costs[i] for i in wide))


def test_the_layers_kept_wide_are_the_best_of_every_subset_within_the_budget():
    """Against every one of the 2^10 subsets of 10 layers in two price classes (full and sliding), at several
    budgets: the plan's cost kept is the largest within the budget; too many classes are refused."""
    generator = np.random.default_rng(3)
    costs = generator.random(10).tolist()
    extra = np.where(np.arange(10) % 3 == 0, 12.0, 12.0 * 511 / 4096)
    subsets = [[i for i in range(10) if mask >> i & 1] for mask in range(1024)]
    for slack in (0.0, 1.4, 12.0, 13.5, 30.0, 200.0):
        within = [subset for subset in subsets if extra[subset].sum() <= slack]
        best = max(sum(costs[i] for i in subset) for subset in within)
        got = layers_kept_wide(costs, extra, slack)
        assert extra[got].sum() <= slack and sum(costs[i] for i in got) == pytest.approx(best, rel=1e-12)
    with pytest.raises(KvcalError, match="store 40 different lengths"):
        layers_kept_wide([1.0] * 40, np.arange(1.0, 41.0), 10.0)


def test_llama_cpp_pairs_price_k_and_v_apart_and_the_cheapest_within_the_budget_wins(tiny_profile):
    """A -ctk/-ctv pair costs its key type's error plus its value type's (so swapping the value types of two pairs
    keeps their total), the plan takes the least-cost pair within the budget, and a tighter budget never costs less."""
    plan = plan_cache_types(str(tiny_profile[1]), 6.0)
    cost = {(pair["type_k"], pair["type_v"]): pair["cost"] for pair in plan.pairs}
    assert cost["q8_0", "q4_0"] + cost["q4_1", "q5_0"] == pytest.approx(cost["q8_0", "q5_0"] + cost["q4_1", "q4_0"], rel=1e-9, abs=0)
    assert ("f16", "f16") not in cost and len(cost) == 7 * 7 - 1
    within = [pair for pair in plan.pairs if pair["bits"] <= 6.0]
    assert plan.bits <= 6.0 and cost[plan.type_k, plan.type_v] == min(pair["cost"] for pair in within)
    tighter = plan_cache_types(str(tiny_profile[1]), 4.5)
    assert tighter.bits == 4.5 and cost[tighter.type_k, tighter.type_v] >= cost[plan.type_k, plan.type_v]
    assert plan.engine_arguments() == f"-ctk {plan.type_k} -ctv {plan.type_v}"


def test_llama_cpp_plans_an_mla_models_row_as_one_unrotated_type_keys_in_the_models_order(latent_profile):
    """DeepSeek-V3's MLA: llama.cpp's row holds the latent and the rotated key in one type, so each pair is one type;
    each is priced unrotated, the key in the model's channel order (RoPE pairs adjacent there, not in kvcal's order),
    here put in that order by indexing. vLLM's and ik_llama.cpp's plans are refused."""
    from dataclasses import replace

    profile_path = str(latent_profile[1])
    plan = plan_cache_types(profile_path, 6.0)
    assert [pair["type_k"] for pair in plan.pairs] == [pair["type_v"] for pair in plan.pairs] and len(plan.pairs) == 6
    assert plan.type_k == plan.type_v and plan.bits <= 6.0 and plan.baseline_spec() == plan.type_k
    profile, config = read_artifact(profile_path, "profile")
    order = config["model"]["fingerprint"].pop("rope_order")  # kvcal's channel i is the model's order[i]
    assert order != sorted(order)

    class InTheModelsOrder:
        def __init__(self, codec):
            self.codec = codec

        def quantize(self, rows):
            in_model = torch.empty_like(rows)
            in_model[:, order] = rows
            stored = self.codec.quantize(in_model)
            return replace(stored, values=stored.values[:, order])

    keys, values = (cache_type_codec("q4_0", width, tensor, None) for width, tensor in ((64, "k"), (96, "v")))
    layers = range(len(kv_shapes(config["model"]["fingerprint"])))
    key_costs = sum(key_cost(profile, config, i, InTheModelsOrder(keys), 1) for i in layers)
    in_kvcal_order = sum(key_cost(profile, config, i, keys, 1) for i in layers)
    cost = next(pair["cost"] for pair in plan.pairs if pair["type_k"] == "q4_0")
    assert cost == pytest.approx(key_costs + sum(value_cost(profile, i, values) for i in layers), rel=1e-6, abs=0)
    assert abs(key_costs - in_kvcal_order) > 0.01 * key_costs
    for engine, plan_it in (("vllm", lambda: plan_layers(profile_path, "vllm", "fp8_per_token_head", 8.0)),
                            ("ik_llama.cpp", lambda: plan_first_last(profile_path, 6.0))):
        with pytest.raises(KvcalError, match="multi-head latent attention"):
            plan_it()


def _settings_by_brute_force(costs: dict, num_layers: int, plain_costs: dict):
    """(types, cost) of every ik_llama.cpp setting of one tensor, summed layer by layer; under an f16 base every
    quantized layer is an end, priced plain (ik_llama.cpp turns the rotation off)."""
    for base in costs:
        table = plain_costs if base == "f16" else costs
        for first in costs:
            for last in costs:
                for n in range(num_layers + 1):
                    for m in range(num_layers + 1 - n):
                        types = [first] * n + [base] * (num_layers - n - m) + [last] * m
                        yield tuple(types), sum(table[t][i] for i, t in enumerate(types))


def _least_pair_cost(k_settings: np.ndarray, v_settings: np.ndarray, budget: float) -> float:
    """The least k cost + v cost over every pair of settings (rows of (mean bits, cost, all f16)) whose mean bits fit
    `budget`, not both all f16: for each K setting the cheapest V setting within what its bits leave (a prefix
    minimum over the V settings in order of bits)."""
    order = np.argsort(v_settings[:, 0], kind="stable")
    v_bits, v_cost, v_f16 = v_settings[order].T
    cheapest = np.minimum.accumulate(v_cost)
    cheapest_quantized = np.minimum.accumulate(np.where(v_f16 == 1, np.inf, v_cost))
    fitting = np.searchsorted(v_bits, 2 * budget - k_settings[:, 0] + 1e-9, side="right")
    within = fitting > 0
    v_best = np.where(k_settings[:, 2] == 1, cheapest_quantized, cheapest)[np.maximum(fitting, 1) - 1]
    return float(np.min(np.where(within, k_settings[:, 1] + v_best, np.inf)))


@pytest.mark.parametrize("widths", [None, [32, 64, 32]], ids=["alike", "a-wider-layer"])
def test_the_ik_llama_cpp_choice_is_the_least_cost_pair_of_settings_within_the_budget(widths):
    """On 3 layers with random per-layer costs (f16 free; the unrotated ones that an f16 base's ends take apart),
    choose_first_last's K and V settings cost the least of every pair of settings (first / last counts and types,
    summed layer by layer) whose mean bits fit the budget, the mean weighted by each layer's width where they differ
    (Gemma 4's)."""
    bits = {"f16": 16.0, "q8_0": 8.5, "q5_1": 6.0, "q5_0": 5.5, "q4_1": 5.0, "q4_0": 4.5, "iq4_nl": 4.5}
    weights = np.ones(3) if widths is None else np.array(widths, dtype=np.float64)
    rng = np.random.default_rng(0)
    costs, plain = ({tensor: {t: (np.zeros(3) if t == "f16" else rng.random(3) * (20 - b)) for t, b in bits.items()}
                     for tensor in "kv"} for _ in range(2))
    brute = {tensor: np.array([(sum(w * bits[t] for w, t in zip(weights, types)) / weights.sum(), cost,
                                set(types) == {"f16"})
                               for types, cost in _settings_by_brute_force(costs[tensor], 3, plain[tensor])])
             for tensor in "kv"}
    for budget in (4.5, 5.0, 6.2, 9.0, 12.0, 15.9):
        k, v = choose_first_last(costs, {"k": bits, "v": bits}, budget, plain, widths)
        best = _least_pair_cost(brute["k"], brute["v"], budget)
        assert k.cost + v.cost == pytest.approx(best, rel=1e-12, abs=0) and (k.bits + v.bits) / 2 <= budget + 1e-9


def test_an_ik_llama_cpp_plan_stores_its_bits_and_costs_no_more_than_one_type_each(tiny_profile):
    """On the tiny profile: the plan's baseline spec stores the plan's real bits, its error is at most the best -ctk/-ctv
    pair's within the budget, and the arguments name ik_llama.cpp's options."""
    plan = plan_first_last(str(tiny_profile[1]), 5.0)
    assert plan.bits <= 5.0 and plan.cost <= plan.pair["cost"]
    for budget in (4.5, 5.0, 6.0, 9.0):  # only types ik_llama.cpp's CPU flash attention reads, the pair's too
        chosen = plan_first_last(str(tiny_profile[1]), budget)
        used = {t for setting in (chosen.k, chosen.v) for t in (setting.base, setting.first, setting.last)}
        assert used | {chosen.pair["type_k"], chosen.pair["type_v"]} <= set(IK_CACHE_TYPES), budget
    fingerprint = read_artifact(str(tiny_profile[1]), "profile")[1]["model"]["fingerprint"]
    method = baseline_method(plan.baseline_spec(), [fingerprint["head_dim"]] * fingerprint["num_layers"])
    width = fingerprint["num_kv_heads"] * fingerprint["head_dim"]
    row_bits = [(layer.key_codec.row_bits(width) + layer.value_codec.row_bits(width)) / (2 * width) for layer in method.layers]
    assert sum(row_bits) / len(row_bits) == pytest.approx(plan.bits)
    assert plan.engine_arguments().startswith(f"-ctk {plan.k.base} -ctv {plan.v.base}")


def test_ik_llama_cpp_is_told_to_rotate_only_a_tensor_whose_base_type_is_quantized():
    """ik_llama.cpp turns -khad / -vhad off when the tensor's base type is f16 (src/llama.cpp, llama_init_from_model),
    so the plan asks for them only under a quantized base."""
    k = TensorSetting("f16", "q8_0", 2, "f16", 0, bits=0.0, cost=0.0)
    v = TensorSetting("q4_0", "q8_0", 1, "f16", 1, bits=0.0, cost=0.0)
    plan = FirstLastPlan(8.0, k, v, 0.0, 0.0, {})
    assert plan.engine_arguments() == "-ctk f16 -ctv q4_0 -ctk-first q8_0,2 -ctv-first q8_0,1 -ctv-last f16,1 -vhad"
    assert plan.baseline_spec() == "f16/q4_0;k_first=q8_0,2;v_first=q8_0,1;v_last=f16,1"


def test_an_ik_llama_cpp_setting_over_f16_bases_is_evaluated_and_run_as_planned():
    """A plan may keep f16 as both tensors' base with quantized first / last layers (the costliest layers of a high
    budget stay f16): its spec evaluates those layers at their types, unrotated, and its arguments ask for no -khad."""
    k = TensorSetting("f16", "f16", 0, "q8_0", 1, bits=0.0, cost=0.0)
    v = TensorSetting("f16", "q4_0", 2, "f16", 0, bits=0.0, cost=0.0)
    plan = FirstLastPlan(12.0, k, v, 0.0, 0.0, {})
    assert plan.baseline_spec() == "f16;k_last=q8_0,1;v_first=q4_0,2"
    assert plan.engine_arguments() == "-ctk f16 -ctv f16 -ctk-last q8_0,1 -ctv-first q4_0,2"
    layers = baseline_method(plan.baseline_spec(), [32] * 4).layers
    assert [layer.key_codec.row_bits(32) / 32 for layer in layers] == [16, 16, 16, 8.5]
    assert [layer.value_codec.row_bits(32) / 32 for layer in layers] == [4.5, 4.5, 16, 16]
    assert layers[3].key_codec.hadamard is None and layers[0].value_codec.hadamard is None  # ik_llama.cpp's, under f16


@pytest.fixture(scope="module")
def gemma4_profile(tiny_model_dir, tiny_corpus, tmp_path_factory) -> Path:
    """A profile of the tiny Gemma 4 with as many KV heads on its full layer as on its sliding one: the full layer
    (heads of 32 channels) stores twice the sliding one's (heads of 16) a token."""
    from helpers.tiny_bundles import profile_tiny_model

    model = tiny_model_dir("gemma4_text", num_global_key_value_heads=2)
    return profile_tiny_model(model, tiny_corpus, tmp_path_factory.mktemp("gemma4-plan") / "profile.safetensors")


def _stored_bits(spec: str, fingerprint: dict) -> float:
    """Real bits per element of an eval baseline spec on the profile's model: every layer's K and V rows at its own
    shape, over every element a token."""
    shapes = kv_shapes(fingerprint)
    method = baseline_method(spec, [head_dim for _, head_dim in shapes])
    stored = sum(layer.key_codec.row_bits(heads * dim) + layer.value_codec.row_bits(heads * dim)
                 for layer, (heads, dim) in zip(method.layers, shapes))
    return stored / (2 * sum(heads * dim for heads, dim in shapes))


def test_layers_of_two_shapes_are_priced_at_their_own_and_weighed_by_their_elements(gemma4_profile):
    """The tiny Gemma 4's sliding layer (2 heads of 16: int4_per_token_head stores 4 + 32/16 = 6 bits) and its full
    layer (2 heads of 32: 5 bits, twice the elements): the least budget is (6 + 2 x 5) / 3, keeping the sliding
    layer fp16 costs (16 + 10) / 3, the full one (6 + 32) / 3; each plan stores what its eval spec stores."""
    fingerprint = read_artifact(str(gemma4_profile), "profile")[1]["model"]["fingerprint"]
    assert kv_shapes(fingerprint) == [(2, 16), (2, 32)]
    assert dtype_bits("int4_per_token_head", kv_shapes(fingerprint), "dense") == pytest.approx(16 / 3)
    with pytest.raises(KvcalError, match=r"outside \[5.33333, 16\]"):
        plan_layers(str(gemma4_profile), "vllm", "int4_per_token_head", 5.3)
    sliding = plan_layers(str(gemma4_profile), "vllm", "int4_per_token_head", 26 / 3 + 1e-9)
    either = plan_layers(str(gemma4_profile), "vllm", "int4_per_token_head", 38 / 3 + 1e-9)
    assert sliding.skipped == [0] and sliding.bits == pytest.approx(26 / 3)
    assert either.skipped == [max(range(2), key=lambda i: either.costs[i])]
    for plan in (sliding, either, plan_layers(str(gemma4_profile), "vllm", "int4_per_token_head", 16.0)):
        assert plan.bits == pytest.approx(_stored_bits(plan.baseline_spec(), fingerprint), rel=1e-12)


def test_llama_cpp_plans_price_each_layer_at_its_own_head_dim(gemma4_profile):
    """On the tiny Gemma 4: a -ctk / -ctv pair's cost is every layer's Fisher-weighted error under the type's codec
    for that layer's head_dim, and the llama.cpp and ik_llama.cpp plans store what their eval specs store."""
    tensors, config = read_artifact(str(gemma4_profile), "profile")
    fingerprint = config["model"]["fingerprint"]
    pair = plan_cache_types(str(gemma4_profile), 6.0)
    by_hand = sum(key_cost(tensors, config, i, cache_type_codec(pair.type_k, dim, "k"), heads)
                  + value_cost(tensors, i, cache_type_codec(pair.type_v, dim, "v"))
                  for i, (heads, dim) in enumerate(kv_shapes(fingerprint)))
    chosen = next(p for p in pair.pairs if (p["type_k"], p["type_v"]) == (pair.type_k, pair.type_v))
    assert chosen["cost"] == pytest.approx(by_hand, rel=1e-9, abs=0)
    assert pair.bits == pytest.approx(_stored_bits(pair.baseline_spec(), fingerprint), rel=1e-12) and pair.bits <= 6.0
    for budget in (4.6, 6.0, 9.0):
        ik = plan_first_last(str(gemma4_profile), budget)
        assert ik.bits == pytest.approx(_stored_bits(ik.baseline_spec(), fingerprint), rel=1e-12) and ik.bits <= budget + 1e-9


def test_a_hybrid_models_plan_names_its_decoder_layers_to_vllm(tiny_model_dir, tiny_corpus, tmp_path):
    """The tiny LFM2's attention layers are decoder layers 1 and 3 (convolutions between): vLLM's option counts
    decoder layers, so the plan names 1 and 3 there and kvcal's 0 and 1 in the eval spec; the CLI shows both. Under a
    TurboQuant preset vLLM keeps no boundary layer of a hybrid fp16, so every layer is the plan's to weigh."""
    from typer.testing import CliRunner

    from helpers.tiny_bundles import profile_tiny_model
    from kvcal.cli import app

    profile = profile_tiny_model(tiny_model_dir("lfm2"), tiny_corpus, tmp_path / "profile.safetensors")
    plan = plan_layers(str(profile), "vllm", "int8_per_token_head", 16.0)
    assert plan.skipped == [0, 1] and plan.decoder_layers == [1, 3]
    assert plan.engine_arguments() == "--kv-cache-dtype int8_per_token_head --kv-cache-dtype-skip-layers 1 3"
    assert plan.baseline_spec() == "int8_per_token_head;skip=0+1"
    result = CliRunner().invoke(app, ["plan", str(profile), "--dtype", "int8_per_token_head", "--budget", "16"])
    assert result.exit_code == 0, result.output
    assert "decoder layer" in result.output and "--kv-cache-dtype-skip-layers 1 3" in result.output
    turboquant = plan_layers(str(profile), "vllm", "turboquant_k3v4_nc", 16.0)
    assert all(cost > 0 for cost in turboquant.costs) and turboquant.skipped == [0, 1]
    assert turboquant.engine_arguments() == "--kv-cache-dtype turboquant_k3v4_nc --kv-cache-dtype-skip-layers 1 3"


def test_a_turboquant_plan_is_refused_where_layers_read_anothers_cache(gemma4_profile):
    """The tiny Gemma 4's last decoder layers read its first two's caches: vLLM may count them among a TurboQuant
    preset's boundary layers, which kvcal does not model, so the plan is refused in one line."""
    with pytest.raises(KvcalError, match="read another's cache"):
        plan_layers(str(gemma4_profile), "vllm", "turboquant_k3v4_nc", 16.0)
    compared = compare_dtypes(str(gemma4_profile), "vllm", 16.0)  # the other dtypes planned, each preset named unfit
    assert set(compared.unfit) == set(TQ_PRESETS) and all("read another's cache" in why for why in compared.unfit.values())
    assert {plan.dtype for plan in compared.plans} == set(VLLM_DTYPES)


def test_every_vllm_dtype_is_planned_side_by_side_and_the_least_error_one_chosen(tiny_profile, tmp_path):
    """compare_dtypes plans each vLLM dtype within the budget exactly as plan_layers does, orders them by the error
    of the layers they quantize, and names why each other dtype has no plan; the CLI prints the table and the least
    error's arguments, and refuses a budget no dtype fits and --by importance (no error to compare) in one line."""
    from typer.testing import CliRunner

    from kvcal.cli import app

    profile = str(tiny_profile[1])
    compared = compare_dtypes(profile, "vllm", 6.0)
    assert {plan.dtype for plan in compared.plans} | set(compared.unfit) == set(ENGINE_DTYPES["vllm"])
    assert [plan.cost for plan in compared.plans] == sorted(plan.cost for plan in compared.plans)
    for plan in compared.plans:
        alone = plan_layers(profile, "vllm", plan.dtype, 6.0)
        assert (plan.skipped, plan.bits, plan.cost) == (alone.skipped, alone.bits, alone.cost) and plan.bits <= 6.0
    for dtype, reason in compared.unfit.items():
        assert reason.startswith("stores at least")
        with pytest.raises(KvcalError, match="is outside"):
            plan_layers(profile, "vllm", dtype, 6.0)
    result = CliRunner().invoke(app, ["plan", profile, "--dtype", "all", "--budget", "6", "--json", str(tmp_path / "plan.json")])
    assert result.exit_code == 0, result.output
    assert f"vllm arguments: {compared.best.engine_arguments()}" in result.output
    assert all(dtype in result.output for dtype in ENGINE_DTYPES["vllm"])
    written = json.loads((tmp_path / "plan.json").read_text())
    assert written["dtype"] == compared.best.dtype and [entry["dtype"] for entry in written["compared"]] == [p.dtype for p in compared.plans]
    for arguments, message in ((["--budget", "3"], "below what every vllm dtype stores: give at least 4.5"),
                               (["--budget", "6", "--by", "importance"], "--dtype all compares the dtypes by Fisher")):
        refused = CliRunner().invoke(app, ["plan", profile, "--dtype", "all", *arguments])
        assert refused.exit_code == 2 and message in refused.output


@pytest.mark.parametrize("arguments, message", [
    (("sglang", "int4_per_token_head", 8.0), "--engine 'sglang' is not one of vllm"),
    (("vllm", "q4_0", 8.0), "--dtype 'q4_0' is not one of vllm's"),
    (("vllm", "int4_per_token_head", 5.0), r"--budget 5.0 is outside \[6, 16\]"),
])
def test_bad_requests_are_refused_naming_the_option(tiny_profile, arguments, message):
    with pytest.raises(KvcalError, match=message):
        plan_layers(str(tiny_profile[1]), *arguments)


def test_vllms_own_argument_parser_reads_the_printed_arguments(tiny_profile):
    """Where vLLM imports (its wheel with --no-deps and the pure-Python imports it needs; VLLM_TARGET_DEVICE=cpu): its
    EngineArgs parser takes every dtype kvcal plans for and the skip layers as printed. Skipped where it does not."""
    arg_utils = pytest.importorskip("vllm.engine.arg_utils", reason="vLLM is not importable here")
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from kvcal.plan import ENGINE_DTYPES

    parser = arg_utils.EngineArgs.add_cli_args(FlexibleArgumentParser())
    plan = plan_layers(str(tiny_profile[1]), "vllm", "int4_per_token_head", 11.0)
    parsed = parser.parse_args(plan.engine_arguments().split())
    assert parsed.kv_cache_dtype == "int4_per_token_head" and parsed.kv_cache_dtype_skip_layers == [str(plan.skipped[0])]
    for dtype in ENGINE_DTYPES["vllm"]:
        assert parser.parse_args(["--kv-cache-dtype", dtype, "--kv-cache-dtype-skip-layers", "0", "5"]).kv_cache_dtype == dtype


def llama_perplexity(variable: str, wikitext_valid, arguments: list[str]) -> str | None:
    """The log of a llama-perplexity run (the build's bin folder in environment `variable`) over one 64-token chunk of the
    packaged SmolLM2 GGUF under `arguments`, or None where it failed."""
    source = resolve_model(None)
    command = [Path(os.environ[variable]).resolve() / "llama-perplexity", "-m", Path(source.path) / source.gguf_file,
               "-f", Path(wikitext_valid).resolve(), "-c", "64", "-b", "64", "--chunks", "1", "-fa", "on", "-t", "2", *arguments]
    with tempfile.TemporaryDirectory() as scratch:  # ik_llama.cpp writes llama.log where it runs
        run = subprocess.run([str(part) for part in command], capture_output=True, text=True, cwd=scratch)
    log = run.stdout + run.stderr
    return log if run.returncode == 0 and "Final estimate: PPL" in log else None


def test_llama_cpps_own_binary_runs_the_printed_arguments_and_every_cache_type(tiny_profile, wikitext_valid):
    """Where KVCAL_LLAMA_CPP names a llama.cpp build's bin folder: its llama-perplexity runs a chunk of the packaged
    SmolLM2 GGUF under the -ctk / -ctv kvcal plan prints and under every cache type kvcal plans for, on K and on V
    (a type it does not take exits non-zero, as the bogus one must). Skipped where it is unset."""
    if not os.environ.get("KVCAL_LLAMA_CPP"):
        pytest.skip("KVCAL_LLAMA_CPP (the bin folder of a llama.cpp build) is not set")

    def runs(arguments: list[str]) -> bool:
        return llama_perplexity("KVCAL_LLAMA_CPP", wikitext_valid, arguments) is not None

    assert runs(plan_cache_types(str(tiny_profile[1]), 6.0).engine_arguments().split())
    for cache_type in CACHE_TYPES:
        assert runs(["-ctk", cache_type]) and runs(["-ctv", cache_type]), cache_type
    assert not runs(["-ctk", "q4_bogus"])


def test_ik_llama_cpps_own_binary_sets_the_layers_the_printed_arguments_name(tiny_profile, wikitext_valid):
    """Where KVCAL_IK_LLAMA_CPP names an ik_llama.cpp build's bin folder: the arguments kvcal plan prints for it run,
    and under each cache type it plans with, as the first / last layers' type beside a quantized base (with -khad
    -vhad, as kvcal prices it), its log sets exactly the layers the option names to that type. q5_0, which it leaves
    out, aborts there. Skipped where it is unset."""
    if not os.environ.get("KVCAL_IK_LLAMA_CPP"):
        pytest.skip("KVCAL_IK_LLAMA_CPP (the bin folder of an ik_llama.cpp build) is not set")
    plan = plan_first_last(str(tiny_profile[1]), 5.0)
    assert llama_perplexity("KVCAL_IK_LLAMA_CPP", wikitext_valid, plan.engine_arguments().split()) is not None
    assert llama_perplexity("KVCAL_IK_LLAMA_CPP", wikitext_valid, ["-ctk", "q5_0", "-ctv", "q5_0"]) is None
    for cache_type in IK_CACHE_TYPES:
        base = "q4_0" if cache_type != "q4_0" else "q8_0"
        arguments = ["-ctk", base, "-ctv", base, "-ctk-first", f"{cache_type},2", "-ctv-last", f"{cache_type},3", "-khad", "-vhad"]
        log = llama_perplexity("KVCAL_IK_LLAMA_CPP", wikitext_valid, arguments)
        assert log is not None, cache_type
        layers = int(re.search(r"n_layer += (\d+)", log).group(1))
        assert [int(i) for i in re.findall(rf"Setting K-cache type in layer +(\d+) to {cache_type}\n", log)] == [0, 1]
        assert [int(i) for i in re.findall(rf"Setting V-cache type in layer +(\d+) to {cache_type}\n", log)] == \
            [layers - 3, layers - 2, layers - 1]
