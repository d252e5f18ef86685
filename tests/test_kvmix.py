import pytest
import torch

from kvcal.errors import KvcalError
from kvcal.fit.kvmix import WidthChoice, allocate, allocate_to_target, allocate_top_fraction, rpc_ratio

KEYS, VALUES = WidthChoice(high=3, low=2), WidthChoice(high=4, low=2)


def test_paper_configuration_on_32_layers_gives_k219_v2375():
    importance = torch.rand(32, generator=torch.Generator().manual_seed(0))
    bits_k = allocate_top_fraction(importance, KEYS, 0.2)
    bits_v = allocate_top_fraction(importance, VALUES, 0.2)
    assert sum(bits_k) / 32 == 2.1875 and sum(bits_v) / 32 == 2.375


def test_most_important_layers_get_the_high_width_ties_by_layer_order():
    importance = torch.tensor([0.1, 0.9, 0.5, 0.9, 0.2])
    assert allocate_top_fraction(importance, VALUES, 0.4) == [2, 4, 2, 4, 2]
    assert allocate_top_fraction(torch.ones(5), KEYS, 0.2) == [3, 2, 2, 2, 2]


def test_target_bits_keeps_the_mean_at_most_the_target_and_closest():
    importance = torch.arange(10.0)
    bits = allocate_to_target(importance, VALUES, 2.5)
    assert sum(bits) / 10 <= 2.5 and sum(bits) / 10 > 2.5 - 2 / 10
    assert bits[-2:] == [4, 4] and bits[0] == 2
    assert allocate(importance, KEYS, 0.2, 3.0) == [3] * 10
    with pytest.raises(KvcalError, match="outside"):
        allocate_to_target(importance, KEYS, 3.5)


def test_rpc_ratio_and_width_validation():
    assert [rpc_ratio(b) for b in (1, 2, 3, 4)] == [0.1, 0.1, 0.2, 0.2]
    with pytest.raises(KvcalError, match="outside 1-4"):
        WidthChoice(high=5, low=2).validate("key")
    with pytest.raises(KvcalError, match="below"):
        WidthChoice(high=2, low=3).validate("value")


def test_layers_storing_no_channel_take_the_low_width_and_are_not_ranked():
    """Mistral Large 4's keys on its layers without RoPE have no channel: the fraction and the mean are over the others."""
    importance = torch.tensor([0.1, 0.0, 0.9, 0.5, 0.0])
    channels = [64, 0, 64, 64, 0]
    assert allocate(importance, KEYS, 1 / 3, None, channels) == [2, 2, 3, 2, 2]
    assert allocate(importance, KEYS, 0.0, 2 + 2 / 3, channels) == [2, 2, 3, 3, 2]
    # (counted over all 5, the two keys storing nothing would buy a third high width: a mean of 3 over those stored)
    assert allocate(importance, KEYS, 0.0, 2 + 2 / 3) == [3, 2, 3, 3, 2]
