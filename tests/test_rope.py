import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from helpers.tiny_models import tiny_model
from kvcal.adapters import adapt
from kvcal.rope import apply_rope, layer_rope_scaling, padded_inv_freq, rotate_half_order, stored_rope_scaling


def test_rope_preserves_norms_and_position_zero_is_identity():
    x = torch.randn(5, 3, 16)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    rotated = apply_rope(x, torch.arange(5), inv_freq)
    torch.testing.assert_close(rotated[0], x[0])
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))


def test_rope_matches_transformers_at_large_positions():
    model = tiny_model("llama")
    adapter = adapt(model)
    positions = torch.tensor([0, 7, 255, 40_000])
    x = torch.randn(1, 2, 4, 16)  # (batch, heads, tokens, head_dim) as transformers lays it out
    cos, sin = model.model.rotary_emb(x, positions[None])
    _, expected = apply_rotary_pos_emb(x, x, cos, sin)
    got = apply_rope(x[0].transpose(0, 1), positions, adapter.inv_freq, adapter.layer_rope_scaling(0))
    torch.testing.assert_close(got, expected[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_a_cos_sin_scaling_is_recorded_per_layer_only_where_layers_differ():
    assert stored_rope_scaling([1.25, 1.25]) == 1.25 and layer_rope_scaling({"attention_scaling": 1.25}, 1) == 1.25
    assert stored_rope_scaling([1.0, 1.25]) == [1.0, 1.25] and layer_rope_scaling({"attention_scaling": [1.0, 1.25]}, 1) == 1.25


def pairwise_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, pairs: list[tuple[int, int]]):
    """RoPE written out pair by pair: channels (a, b) of pair i turn by positions x inv_freq[i]; the others stay."""
    out = x.clone()
    for i, (a, b) in enumerate(pairs):
        angle = positions[:, None] * inv_freq[i]
        cos, sin = angle.cos(), angle.sin()
        out[..., a], out[..., b] = x[..., a] * cos - x[..., b] * sin, x[..., b] * cos + x[..., a] * sin
    return out


def test_rotate_half_order_turns_any_pairing_into_kvcals():
    """Interleaved pairs (2i, 2i+1) or halves of the first rotary_dims channels, the rest untouched: kvcal's rotation of
    the reordered channels, by the frequencies padded with zeros, is the model's rotation reordered."""
    head_dim, rotary_dims = 16, 12
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dims, 2).float() / rotary_dims))
    x, positions = torch.randn(5, 3, head_dim), torch.arange(5) * 7
    for interleaved, pairs in ((True, [(2 * i, 2 * i + 1) for i in range(6)]), (False, [(i, i + 6) for i in range(6)])):
        order = rotate_half_order(head_dim, rotary_dims, interleaved)
        got = apply_rope(x[..., order], positions, padded_inv_freq(inv_freq, head_dim))
        torch.testing.assert_close(got, pairwise_rope(x, positions, inv_freq, pairs)[..., order], rtol=1e-5, atol=1e-5)
    assert rotate_half_order(8, 4, True) == [0, 2, 4, 5, 1, 3, 6, 7]
    assert rotate_half_order(16, 16, False) is None  # Llama's own order


def test_a_rope_by_minus_the_angle_is_kvcals_with_each_pairs_halves_swapped():
    """NanoChat rotates each pair (i, i + head_dim/2) by minus Llama's angle: kvcal's rotation of the pair taken as
    (i + head_dim/2, i) is it, reordered."""
    head_dim = 16
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    x, positions = torch.randn(5, 3, head_dim), torch.arange(5) * 7
    order = rotate_half_order(head_dim, head_dim, False, swapped=True)
    assert order == [*range(8, 16), *range(8)]
    model_rotated = pairwise_rope(x, -positions, inv_freq, [(i, i + 8) for i in range(8)])
    torch.testing.assert_close(apply_rope(x[..., order], positions, inv_freq), model_rotated[..., order], rtol=1e-5, atol=1e-5)
