import pytest
import torch

from kvcal.errors import KvcalError
from kvcal.methods import artifact_method
import itertools

import numpy as np

from kvcal.fit.nuq import KNAPSACK_WIDTHS, NuqSettings, choose_widths, fit_codebook, fit_nuq, write_nuq
from kvcal.quantizers import nearest_codes


def test_weighted_kmeans_follows_the_weights():
    points = torch.cat([torch.linspace(-1, -0.5, 500), torch.linspace(0.5, 1, 500)])
    weights = torch.cat([torch.full((500,), 100.0), torch.full((500,), 0.01)])
    weighted = fit_codebook(points, weights, 2, "nuq", qnorm=False, seed=0)
    plain = fit_codebook(points, None, 2, "nuq", qnorm=False, seed=0)
    assert torch.all(weighted[1:] > weighted[:-1])
    assert int((weighted < 0).sum()) > int((plain < 0).sum())  # more signposts where the weight is


def test_qnorm_restores_mean_and_std_of_the_inliers():
    points = torch.randn(5000, generator=torch.Generator().manual_seed(0)).clamp(-1, 1) * 0.5 + 0.1
    raw = fit_codebook(points, None, 2, "uniform", qnorm=False, seed=0)
    normed = fit_codebook(points, None, 2, "uniform", qnorm=True, seed=0)
    codes = nearest_codes(points, raw)
    torch.testing.assert_close(normed[codes].mean(), points.mean(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(normed[codes].std(), points.std(), rtol=1e-4, atol=1e-5)


def stored_rows(codec, x):
    """Token row of every outlier the codec keeps aside."""
    return codec.encode(x).outliers[0]


def test_fit_from_a_profile_is_deterministic_and_complete(tiny_profile, tmp_path):
    _, profile = tiny_profile
    settings = NuqSettings(bits=3, outliers=0.01, sink=1)
    tensors, config = fit_nuq(str(profile), settings)
    again, _ = fit_nuq(str(profile), settings)
    assert all(torch.equal(tensors[name], again[name]) for name in tensors)
    for layer in range(2):
        codebook = tensors[f"layers.{layer}.k.codebook"]
        assert codebook.shape == (8,) and torch.all(codebook[1:] > codebook[:-1])
        assert tensors[f"layers.{layer}.k.lo"].shape == (32,)
        assert torch.all(tensors[f"layers.{layer}.k.lo"] < tensors[f"layers.{layer}.k.hi"])
    assert config["nuq"]["bits_k"] == [3, 3] and config["model"]["fingerprint"]["model_type"] == "llama"
    path = write_nuq(tmp_path / "nuq.safetensors", tensors, config)
    method = artifact_method(str(path))
    layers = method.layers
    keys = torch.randn(20, 32)
    stored = layers[0].key_codec.quantize(keys)
    assert stored.values.shape == keys.shape
    # 32 three-bit codes in one planes3 unit of 3 words; per-channel thresholds are in the bundle, 4 bytes per outlier
    assert torch.equal(stored.row_bits, 3 * 32 + torch.bincount(stored_rows(layers[0].key_codec, keys), minlength=20) * 32.0)
    assert method.name == "nuq3-1%"


def test_bits_from_profile_and_ablation_names(tiny_profile, tmp_path):
    _, profile = tiny_profile
    tensors, config = fit_nuq(str(profile), NuqSettings(bits_from_profile=True, outliers=0.0, key_granularity="token",
                                                        codebook="nf", qnorm="on"))
    from kvcal.artifacts import read_artifact

    profiled, _ = read_artifact(profile, "profile")
    assert config["nuq"]["bits_k"] == profiled["kvmix.bits.k"].tolist()
    assert config["nuq"]["bits_v"] == profiled["kvmix.bits.v"].tolist()
    assert tensors["layers.0.v.codebook"].numel() == 2 ** config["nuq"]["bits_v"][0]
    assert "layers.0.k.lo" not in tensors  # per-token keys: thresholds online
    method = artifact_method(str(write_nuq(tmp_path / "n.safetensors", tensors, config)))
    assert method.name.startswith("nf") and "K per-token" in method.name and "Q-Norm on" in method.name


@pytest.mark.parametrize("settings, message", [
    (NuqSettings(bits=9), "not a code width in 1-8"), (NuqSettings(bits=0), "not a code width in 1-8"),
    (NuqSettings(bits=2.5), "not a code width in 1-8"), (NuqSettings(bits=True), "not a code width in 1-8"),
    (NuqSettings(outliers=0.2), r"outside \[0, 0.1\]"), (NuqSettings(outliers=-0.01), r"outside \[0, 0.1\]"),
    (NuqSettings(sink=0), "below the profile's sink"), (NuqSettings(window=-1), "--window must be 0 or more"),
    (NuqSettings(codebook="lloyd"), "not one of"),
    (NuqSettings(seed=-1), r"--seed must be in 0 to 2\^32 - 1"), (NuqSettings(seed=2**32), r"--seed must be in 0 to 2\^32 - 1"),
    (NuqSettings(target_bits=3.0, bits_from_profile=True), "give one of them"), (NuqSettings(target_bits=1.5), "outside"),
    (NuqSettings(target_bits=2.2), r"outside \[2.32, 8\] real bits"),  # below codes + outliers of 2-bit codes
    (NuqSettings(target_bits=2.5), "the real bits of the narrowest widths"),  # the tiny model's thresholds cost more
])
def test_bad_settings_are_clear_errors(tiny_profile, settings, message):
    with pytest.raises(KvcalError, match=message):
        fit_nuq(str(tiny_profile[1]), settings)


def test_knapsack_is_exact_against_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(20):
        costs = rng.random((5, 3)) * np.array([4.0, 2.0, 1.0])
        prices = np.sort(rng.random((5, 3)) + np.array([2.0, 3.0, 4.0]), axis=1)
        target = float(rng.uniform(prices[:, 0].mean() + 1e-3, prices[:, 2].mean()))
        chosen = choose_widths(costs, prices, target)
        step_prices = np.ceil(prices / 1e-4 - 1e-6) * 1e-4  # the knapsack's own rounding
        feasible = [c for c in itertools.product(range(3), repeat=5)
                    if step_prices[range(5), c].mean() <= target + 1e-9]
        best = min(feasible, key=lambda c: costs[range(5), c].sum())
        assert prices[range(5), chosen].mean() <= target + 1e-4
        assert costs[range(5), chosen].sum() == pytest.approx(costs[range(5), best].sum())


def test_knapsack_with_shares_is_exact_against_brute_force():
    """Tensors that store fewer elements (shares < 1: sliding-window layers at a long context) weigh less in the budget."""
    rng = np.random.default_rng(1)
    for _ in range(20):
        costs = rng.random((5, 3)) * np.array([4.0, 2.0, 1.0])
        prices = np.sort(rng.random((5, 3)) + np.array([2.0, 3.0, 4.0]), axis=1)
        shares = rng.choice([1.0, 0.25, 0.01], size=5)
        weighted = lambda c: (prices[range(5), c] * shares).sum() / shares.sum()
        target = float(rng.uniform(weighted([0] * 5) + 1e-3, weighted([2] * 5)))
        chosen = choose_widths(costs, prices, target, shares)
        step_prices = np.ceil(prices * shares[:, None] / 1e-4 - 1e-6) * 1e-4  # the knapsack's own rounding
        feasible = [c for c in itertools.product(range(3), repeat=5) if step_prices[range(5), c].sum() <= target * shares.sum() + 1e-9]
        best = min(feasible, key=lambda c: costs[range(5), c].sum())
        assert weighted(chosen) <= target + 1e-4
        assert costs[range(5), chosen].sum() == pytest.approx(costs[range(5), best].sum())


def test_target_context_weighs_a_sliding_layer_by_the_tokens_it_keeps(gemma3_profile):
    """The tiny Gemma 3's layer 0 slides over 16 tokens: at a budget set for 4096 tokens it stores 15/4096 of what
    layer 1 does, so the knapsack can give it the widest codes where the budget alone (every layer alike) cannot."""
    table = fit_nuq(str(gemma3_profile), NuqSettings(target_bits=8.0))[1]["nuq"]["knapsack"]
    shares = {name: 15 / 4096 if name.startswith("0.") else 1.0 for name in table}
    # at 4096 tokens: layer 0 at 4 bits and layer 1 at 2 bits fit; every layer alike at 2 bits leaves under 1 bit to spare
    target = sum(shares[name] * table[name]["4" if name.startswith("0.") else "2"][1] for name in table) / sum(shares.values()) + 0.005
    alike = fit_nuq(str(gemma3_profile), NuqSettings(target_bits=target))[1]["nuq"]
    long = fit_nuq(str(gemma3_profile), NuqSettings(target_bits=target, target_context=4096))[1]["nuq"]
    assert alike["bits_k"] == alike["bits_v"] == [2, 2]
    assert long["bits_k"][0] == long["bits_v"][0] == 4 and long["bits_k"][1] == long["bits_v"][1] == 2
    with pytest.raises(KvcalError, match="give --target-bits too"):
        fit_nuq(str(gemma3_profile), NuqSettings(target_context=4096))


def test_target_bits_is_a_budget_of_real_bits_over_every_element_of_keys_and_latents(latent_profile):
    """MLA's latent (96 channels) is wider than its rotated key (64): the budget is the mean over the elements the
    cache stores, each tensor weighed by its width, not a mean over tensors."""
    table = fit_nuq(str(latent_profile[1]), NuqSettings(target_bits=8.0))[1]["nuq"]["knapsack"]
    width = {"k": 64, "v": 96}

    def real_bits(bits: dict) -> float:
        return sum(width[name[-1]] * table[name][str(bits[name])][1] for name in table) / (2 * (64 + 96))

    target = real_bits({name: 4 if name.endswith("k") else 2 for name in table}) + 0.005
    nuq = fit_nuq(str(latent_profile[1]), NuqSettings(target_bits=target))[1]["nuq"]
    chosen = {f"{layer}.{kind}": bits for kind in "kv" for layer, bits in enumerate(nuq[f"bits_{kind}"])}
    assert real_bits(chosen) <= target + 1e-4 and len(set(chosen.values())) > 1


def test_target_bits_chooses_widths_within_the_budget(tiny_profile):
    _, profile = tiny_profile
    widest = fit_nuq(str(profile), NuqSettings(target_bits=8.0))[1]["nuq"]
    assert widest["bits_k"] == widest["bits_v"] == [4, 4]  # room for the widest everywhere
    table = widest["knapsack"]  # (Fisher-weighted error, real bits) of every tensor at every width
    middle = sum(table[name][str(b)][1] for name in table for b in (2, 4)) / (2 * len(table))
    tensors, config = fit_nuq(str(profile), NuqSettings(target_bits=middle))
    nuq = config["nuq"]
    chosen = [(f"{layer}.{kind}", bits) for kind in ("k", "v") for layer, bits in enumerate(nuq[f"bits_{kind}"])]
    prices = [nuq["knapsack"][name][str(bits)][1] for name, bits in chosen]
    assert sum(prices) / len(prices) <= middle + 1e-4
    assert {bits for _, bits in chosen} <= set(KNAPSACK_WIDTHS) and len({bits for _, bits in chosen}) > 1
    for name, bits in chosen:  # the stored codebook is the chosen width's; a wider code costs less error
        layer, kind = name.split(".")
        assert tensors[f"layers.{layer}.{kind}.codebook"].numel() == 2**bits
        errors = [nuq["knapsack"][name][str(b)][0] for b in KNAPSACK_WIDTHS]
        assert errors[0] > errors[-1]
