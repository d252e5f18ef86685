import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from conftest import tiny_model
from kvcal.adapters import adapt
from kvcal.rope import apply_rope, layer_rope_scaling, stored_rope_scaling


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
