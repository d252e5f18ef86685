import pytest
import torch

from kvcal.errors import KvcalError
from kvcal.methods import artifact_method
from kvcal.quantizers import uniform_per_token
from kvcal.fit.skvq import (
    SkvqSettings,
    SkvqTensor,
    channel_groups,
    clipped_dynamic,
    fit_skvq,
    write_skvq,
)


def channels(width=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(width, generator=g) * 4 + 0.1
    return torch.randn(200, width, generator=g) * scale


def test_same_seed_same_permutation_and_groups_cover_every_channel_once():
    x = channels()
    first = channel_groups(x.amin(0), x.amax(0), 3, reorder=True, seed=0)
    second = channel_groups(x.amin(0), x.amax(0), 3, reorder=True, seed=0)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    permutation, starts = first
    assert permutation.dtype == starts.dtype == torch.int32
    assert sorted(permutation.tolist()) == list(range(48))
    assert starts[0] == 0 and starts[-1] == 48 and torch.all(starts[1:] > starts[:-1])
    plain, plain_starts = channel_groups(x.amin(0), x.amax(0), 3, reorder=False, seed=0)
    assert torch.equal(plain, torch.arange(48, dtype=torch.int32)) and plain_starts.tolist() == [0, 16, 32, 48]


def test_channels_fewer_distinct_than_groups_fill_every_group():
    """Keys a model clamps (DBRX's clip_qkv) leave many channels the same range: fewer distinct (min, max) pairs than
    groups get equal groups of the channels ordered by their max (KMeans would leave one empty)."""
    x = channels().clamp(-0.5, 0.5)
    x[:, :24] = x[:, :24].clamp(-0.1, 0.1)  # two distinct ranges: the clamped channels reach both bounds
    permutation, starts = channel_groups(x.amin(0), x.amax(0), 3, reorder=True, seed=0)
    assert starts.tolist() == [0, 16, 32, 48] and sorted(permutation.tolist()) == list(range(48))
    assert set(permutation[:16].tolist()) < set(range(24))  # the narrow channels first


def test_permuted_quantized_unpermuted_equals_quantizing_each_group_directly():
    x = channels()
    permutation, starts = channel_groups(x.amin(0), x.amax(0), 3, reorder=True, seed=0)
    clip = torch.tensor([1.0, 0.8, 0.55])
    got = SkvqTensor(permutation, starts, clip, 2, fp8=True).quantize(x).values
    expected = torch.empty_like(x)
    for g, (start, end) in enumerate(zip(starts[:-1].tolist(), starts[1:].tolist())):
        members = permutation[start:end].long()
        expected[:, members] = clipped_dynamic(x[:, members], clip[g], 2, fp8=True)
    assert torch.equal(got, expected)
    # without clipping it is plain asymmetric min-max quantization of each group
    unclipped = SkvqTensor(permutation, starts, torch.ones(3), 2, fp8=False).quantize(x).values
    for start, end in zip(starts[:-1].tolist(), starts[1:].tolist()):
        members = permutation[start:end].long()
        # equal up to fp16 storage (SKVQ stores its zero as a code offset, min-max as a value), which
        # may move an element that sits on a rounding boundary by one step
        differs = (unclipped[:, members] - uniform_per_token(x[:, members], 2, end - start).values).abs() > 5e-3
        assert differs.float().mean() < 0.01


def test_clipping_ternary_and_fp8():
    x = channels()
    permutation, starts = torch.arange(48, dtype=torch.int32), torch.tensor([0, 48], dtype=torch.int32)
    clipped = SkvqTensor(permutation, starts, torch.tensor([0.5]), 2, fp8=False).quantize(x).values
    assert torch.all(clipped <= 0.5 * x.amax(1, keepdim=True) * (1 + 2e-3) + 1e-5)  # fp16 scale and zero
    ternary = SkvqTensor(permutation, starts, torch.ones(1), 1.5, fp8=False).quantize(x).values
    assert all(len(row.unique()) <= 3 for row in ternary)
    stored = SkvqTensor(permutation, starts, torch.ones(1), 1.5, fp8=True).quantize(x)
    assert stored.row_bits[0] == 3 * 32 + 2 * 8  # 48 ternary codes in 3 words of 20, fp8 scale and zero


@pytest.mark.parametrize("fp8", (False, True))
def test_a_group_of_one_channel_keeps_its_value(fp8):
    # KMeans gives a model's largest channels groups of their own (Gemma 3's keys): a group's range is then zero,
    # and its zero, low / scale, must still fit the storage dtype rather than saturate and lose the value
    x = channels()
    x[:, 0] = torch.linspace(-60, 70, len(x))
    permutation = torch.arange(48, dtype=torch.int32)
    starts = torch.tensor([0, 1, 48], dtype=torch.int32)
    got = SkvqTensor(permutation, starts, torch.ones(2), 2, fp8=fp8).quantize(x).values
    # the zero's own rounding (3 mantissa bits in e4m3, 10 in fp16), and near 0 the dtype's smallest scale
    rtol, atol = (0.07, 0.5) if fp8 else (1e-3, 2e-3)
    assert torch.allclose(got[:, 0], x[:, 0], rtol=rtol, atol=atol)


def test_fit_is_deterministic_and_searches_clipping(tiny_profile, tmp_path):
    _, profile = tiny_profile
    settings = SkvqSettings(kbits=2, vbits=2, group_size=16, window=8, sink=2, clip="group")
    tensors, config = fit_skvq(str(profile), settings)
    again, _ = fit_skvq(str(profile), settings)
    assert all(torch.equal(tensors[n], again[n]) for n in tensors)
    assert tensors["layers.1.k.perm"].shape == (32,) and tensors["layers.1.v.group_start"].shape == (3,)
    assert torch.all((tensors["layers.0.k.clip"] >= 0.3) & (tensors["layers.0.k.clip"] <= 1.0))
    method = artifact_method(str(write_skvq(tmp_path / "s.safetensors", tensors, config)))
    assert method.name == "skvq-K2V2-g16-w8-s2" and method.policy.window == 8 and method.policy.sink == 2


def test_the_clipping_search_scores_with_the_profiled_models_score_scale(tiny_profile):
    """The clipping search's attention multiplies q . k as the model does (the profile's score_scale)."""
    from kvcal.artifacts import read_artifact
    from kvcal.fit.skvq import _ClipObjective

    tensors, config = read_artifact(tiny_profile[1], "profile")
    doubled = {**config, "model": {**config["model"], "score_scale": 2 * config["model"]["score_scale"]}}
    policy = SkvqSettings(group_size=16, window=8, sink=2).policy
    one, two = _ClipObjective(tensors, 0, config, policy), _ClipObjective(tensors, 0, doubled, policy)
    torch.testing.assert_close(two.fp_scores[0], 2 * one.fp_scores[0])


@pytest.mark.parametrize("model_type", ["gpt_oss", "gemma2"])
def test_the_clipping_search_attends_as_the_model_with_its_sinks_or_soft_cap(model_type, tiny_model_dir, tiny_corpus, tmp_path):
    """gpt-oss, Gemma 2: the clipping search's fp attention output on a stored window's rows is the model's own (its
    attention sinks in each row's softmax, its capped scores) on its full-attention layer, up to the fp16 the windows
    are kept in."""
    from helpers.tiny_bundles import profile_tiny_model
    from helpers.tiny_models import tiny_model
    from kvcal.artifacts import read_artifact
    from kvcal.fit.skvq import _ClipObjective

    model = tiny_model(model_type)  # the weights tiny_model_dir saves
    profile = profile_tiny_model(tiny_model_dir(model_type), tiny_corpus, tmp_path / "p.safetensors")
    tensors, config = read_artifact(profile, "profile")
    seen = []
    model.model.layers[1].self_attn.o_proj.register_forward_pre_hook(lambda module, args: seen.append(args[0][0]))
    with torch.no_grad():
        model(tensors["windows.input_ids"][:1].long())
    objective = _ClipObjective(tensors, 1, config, SkvqSettings(group_size=16, window=8, sink=2).policy)
    assert len(objective.rows) > 40  # the rows past the fp16 sink and window
    heads = seen[0].view(seen[0].shape[0], 4, 16).transpose(0, 1)[:, objective.rows]  # (heads, rows, head_dim)
    torch.testing.assert_close(objective.reference[0], heads, rtol=0, atol=5e-4)


@pytest.mark.parametrize("settings, message", [
    (SkvqSettings(group_size=64), "groups of 64 channels .* wider than the KV width 32 .* --group-size 32 or less"),
    (SkvqSettings(group_size=16, window=-1), "--window must be 0 or more"),
    (SkvqSettings(vbits=2.5), "1.5 \\(ternary\\)"),
    (SkvqSettings(group_size=16, seed=-1), r"--seed must be in 0 to 2\^32 - 1"),
])
def test_bad_settings(tiny_profile, settings, message):
    with pytest.raises(KvcalError, match=message):
        fit_skvq(str(tiny_profile[1]), settings)


def test_clip_search_needs_stored_windows(tiny_model_dir, tiny_corpus, tmp_path):
    from typer.testing import CliRunner

    from kvcal.cli import app

    profile = tmp_path / "nowindows.safetensors"
    result = CliRunner().invoke(app, ["profile-gradients", "--model", str(tiny_model_dir("qwen2")), "--dataset", str(tiny_corpus),
                                      "--nsamples", "2", "--seqlen", "32", "--store-windows", "0", "--out", str(profile)])
    assert result.exit_code == 0, result.output
    with pytest.raises(KvcalError, match="no stored Q/K/V windows.*--store-windows 2, or pass --clip none"):
        fit_skvq(str(profile), SkvqSettings(group_size=16))
    tensors, _ = fit_skvq(str(profile), SkvqSettings(group_size=16, clip="none"))
    assert torch.equal(tensors["layers.0.k.clip"], torch.ones(2))
