import pytest

from conftest import TINY_ARCHITECTURES, tiny_model
from kvcal.adapters import adapt
from kvcal.errors import KvcalError


@pytest.mark.parametrize("model_type", TINY_ARCHITECTURES)
def test_adapter_finds_projections_heads_and_rope(model_type):
    model = tiny_model(model_type)
    adapter = adapt(model)
    assert adapter.model_type == model_type and len(adapter.layers) == 2
    assert (adapter.num_heads, adapter.num_kv_heads, adapter.head_dim, adapter.kv_width) == (4, 2, 16, 32)
    assert adapter.layers[1].k_proj is model.model.layers[1].self_attn.k_proj
    has_norm = model_type == "qwen3"
    assert (adapter.layers[0].k_norm is not None) == has_norm
    assert adapter.layers[0].key_source is (model.model.layers[0].self_attn.k_norm if has_norm else model.model.layers[0].self_attn.k_proj)
    assert adapter.inv_freq.shape == (8,) and adapter.max_positions == 256
    assert adapter.fingerprint()["num_kv_heads"] == 2


def test_fingerprint_changes_with_the_config_not_with_the_weights():
    one, two = adapt(tiny_model("llama", seed=0)), adapt(tiny_model("llama", seed=1))
    assert one.fingerprint() == two.fingerprint()
    assert adapt(tiny_model("llama", max_positions=128)).fingerprint() != one.fingerprint()


def test_unsupported_architecture_names_what_is_missing():
    with pytest.raises(KvcalError, match=r"GPT2LMHeadModel.*could not find a separate q_proj.*found: c_attn"):
        adapt(tiny_model("gpt2"))
