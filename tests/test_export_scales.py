"""FP8 scales searched on a profile's stored windows."""

from __future__ import annotations

import pytest
import torch

from kvcal.export.scales import WindowAttention


def test_objective_is_per_kv_head(tiny_profile):
    """A head's error depends only on its own scales: the attn_head search chooses heads independently."""
    from kvcal.artifacts import read_artifact

    _, profile = tiny_profile
    tensors, config = read_artifact(profile, "profile")
    objective = WindowAttention(tensors, 0, config)
    base = torch.full((2,), 0.01)
    changed = base.clone()
    changed[1] = 1e-5  # saturates head 1 only (its largest representable value becomes 0.00448)
    a, b = objective.errors(base, base), objective.errors(changed, changed)
    assert a[0] == b[0] and b[1] > a[1]
    assert objective.errors(None, None).abs().max() == 0


def test_the_queries_carry_the_profiled_models_score_scale(tiny_profile):
    """Scores are q . k times what the model's attention multiplies them by, as the profile recorded it (Gemma 3
    27B's and Granite's are not head_dim ** -0.5)."""
    from kvcal.artifacts import read_artifact

    tensors, config = read_artifact(tiny_profile[1], "profile")
    assert config["model"]["score_scale"] == 16**-0.5
    doubled = {**config, "model": {**config["model"], "score_scale": 2 * 16**-0.5}}
    torch.testing.assert_close(WindowAttention(tensors, 0, doubled).queries[0], 2 * WindowAttention(tensors, 0, config).queries[0])


@pytest.mark.parametrize("model_type", ["gpt_oss", "gemma2"])
def test_the_searched_attention_is_the_models_own_with_its_sinks_or_soft_cap(model_type, tiny_model_dir, tiny_corpus, tmp_path):
    """gpt-oss, Gemma 2: the profile records each layer's attention sinks, or the scores' soft-cap, and the attention
    the search reads on a stored window is the model's own there, up to the fp16 the windows are kept in."""
    from helpers.tiny_bundles import profile_tiny_model
    from helpers.tiny_models import tiny_model
    from kvcal.artifacts import read_artifact

    model = tiny_model(model_type)  # the weights tiny_model_dir saves
    profile = profile_tiny_model(tiny_model_dir(model_type), tiny_corpus, tmp_path / "p.safetensors")
    tensors, config = read_artifact(profile, "profile")
    attention = model.model.layers[1].self_attn  # the full-attention layer (the search reads no sliding window)
    if model_type == "gpt_oss":
        assert config["model"]["attention_sinks"][1] == attention.sinks.tolist()
    else:
        assert config["model"]["attention_softcap"] == attention.attn_logit_softcapping
    seen = []
    attention.o_proj.register_forward_pre_hook(lambda module, args: seen.append(args[0][0]))
    with torch.no_grad():
        model(tensors["windows.input_ids"][:1].long())
    objective = WindowAttention(tensors, 1, config)
    heads = seen[0].view(seen[0].shape[0], 2, 2, 16).permute(1, 2, 0, 3)  # (kv_heads, group, tokens, head_dim)
    torch.testing.assert_close(objective.reference[0], heads, rtol=0, atol=2e-3)


def test_the_searched_attention_reads_each_layers_own_query_heads(tiny_model_dir, tiny_corpus, tmp_path):
    """Laguna: its sliding layer has twice the query heads of its full one. The search scores each layer's own, and
    its attention on the full layer is the model's (the model's output gate, softplus of g_proj per head, taken
    out), up to the fp16 the windows are kept in."""
    from helpers.tiny_bundles import profile_tiny_model
    from helpers.tiny_models import tiny_model
    from kvcal.artifacts import read_artifact

    model = tiny_model("laguna")  # the weights tiny_model_dir saves
    profile = profile_tiny_model(tiny_model_dir("laguna"), tiny_corpus, tmp_path / "p.safetensors")
    tensors, config = read_artifact(profile, "profile")
    attention = model.model.layers[1].self_attn
    seen = {}
    attention.o_proj.register_forward_pre_hook(lambda module, args: seen.__setitem__("gated", args[0][0]))
    attention.g_proj.register_forward_hook(lambda module, args, out: seen.__setitem__("gate", out[0]))
    with torch.no_grad():
        model(tensors["windows.input_ids"][:1].long())
    tokens = seen["gated"].shape[0]
    out = seen["gated"].view(tokens, 4, 16) / torch.nn.functional.softplus(seen["gate"].float())[..., None]
    objective = WindowAttention(tensors, 1, config)
    torch.testing.assert_close(objective.reference[0], out.view(tokens, 2, 2, 16).permute(1, 2, 0, 3), rtol=0, atol=2e-3)
    assert WindowAttention(tensors, 0, config).queries[0].shape == (2, 4, tokens, 16)  # 8 query heads over 2 KV heads
