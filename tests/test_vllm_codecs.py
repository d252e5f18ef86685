"""kvcal.vllm_codecs against the arithmetic of vLLM's kernels, read from vllm-project/vllm:
- int8 / fp8_per_token_head: vllm/v1/attention/ops/triton_reshape_and_cache_flash.py @ 055e47c28003156421365af985d676fc921cb075,
  _reshape_cache_per_token_head: k_scale = max(max|k| / QUANT_MAX, 1e-6); k_q = k * (1.0 / k_scale); int8:
  where(k_q >= 0, k_q + 0.5, k_q - 0.5), clamp(-128, 127), a truncating int8 store; fp8: clamp(+-448), e4m3 cast.
- int4_per_token_head: vllm/v1/attention/ops/int4_per_token_head.py @ 055e47c28003156421365af985d676fc921cb075:
  key = single_rht(key.float()).to(key.dtype); scale = max((max - min) / 15, 1e-6); zp = clamp(rhaz(-min / scale),
  0, 15); q = clamp(rhaz(k * (1 / scale) + zp), 0, 15); the scale word keeps zp in its low 4 bits
  ((bits & -16) | zp); read: single_rht(out, inverse=True) / head_size. _get_rht_signs: a CPU generator seeded
  0x9E3779B9, 2 * bernoulli(0.5) - 1; fast_hadamard_transform's CPU tier: stages of stack([a + b, a - b]).
- TurboQuant presets: turboquant/config.py TQ_PRESETS and centroids.py solve_lloyd_max, backends/turboquant_attn.py
  _build_hadamard (Sylvester, / sqrt(d)) and midpoints (sorted centroids' means), ops/triton_turboquant_store.py
  (norms = ||k||; y = (k / (norms + 1e-8)) @ PiT; binary-search bucketize: lo = where(y >= mid, mid + 1, lo); fp16
  norm; values: scale = (max - min) / (2^b - 1), floored at 1e-8, q = clamp(int((v - min) / scale + 0.5)), fp16
  scale and min) @ 0135d081c30fa476130ae77a152539ce317ab8b1; ops/triton_turboquant_decode.py _tq_full_dequant_kv
  (c = centroids[idx]; NORM_CORRECTION: c * 1 / sqrt(sum c^2 + 1e-16); k = fp16 norm * c, scored against q @ PiT)
  @ 055e47c28003156421365af985d676fc921cb075.
- nvfp4 / nvfp4_4over6: the vLLM 0.33.0 release (commit 4ba787ec9), csrc/nvfp4_kv_cache_kernels.cu:
  round_to_nearest_e2m1 (ax <= 0.25 -> 0, < 0.75 -> 0.5, <= 1.25 -> 1, < 1.75 -> 1.5, <= 2.5 -> 2, < 3.5 -> 3,
  <= 5 -> 4, else 6; copysign), nvfp4_candidate_scale (SFValue = SFScaleVal * (vecMax * rcp(denominator)); e4m3 cast;
  outputScale = SF != 0 ? rcp(SF * rcp(SFScaleVal)) : 0), nvfp4_reconstruction_error (dx = q * rcp(outputScale) - x,
  error += dx0^2 + dx1^2), use4 = err4 < err6; SFScaleVal = 1 / *k_scale_ptr (k_scale 1.0 without checkpoint scales:
  model_executor/layers/attention/attention.py set_default_quant_scales)."""

import json

import numpy as np
import pytest
import torch

from helpers.tiny_models import tiny_model
from kvcal.adapters import adapt
from kvcal.errors import KvcalError
from kvcal.evaluate import evaluate_ppl
from kvcal.methods import baseline_method
from kvcal.vllm_codecs import (DsMlaLatent, Int4PerTokenHead, Nvfp4, PerTokenHead, TurboQuantKeys, TurboQuantValues, e2m1_nearest_even,
                               hadamard_butterfly, lloyd_max_centroids, rht_signs, sylvester_hadamard)


def test_int8_per_token_head_rounds_half_away_from_zero_with_an_fp32_scale_per_token_and_head():
    """absmax 127 gives scale 1.0: 2.5 -> 3, -2.5 -> -3, 0.5 -> 1 (torch.round would give 2, -2, 0; vLLM before
    PR #45361 truncated: 2, -2, 0); a second head has its own scale; 8 bits a code and 32 a head's scale."""
    x = torch.tensor([[127.0, 2.5, -2.5, 0.5, 1.0, 0.25, -0.5, 0.0]])
    got = PerTokenHead("int8", 4).quantize(x)
    assert got.values[0, :4].tolist() == [127.0, 3.0, -3.0, 1.0]
    scale = torch.tensor(1.0 / 127, dtype=torch.float32)  # the second head: absmax 1.0
    q = torch.tensor([1.0, 0.25, -0.5, 0.0]) * (1.0 / scale)
    expected = torch.where(q >= 0, q + 0.5, q - 0.5).clamp(-128, 127).to(torch.int8).float() * scale
    assert torch.equal(got.values[0, 4:], expected)
    assert got.row_bits.tolist() == [8 * 8 + 2 * 32]


def test_fp8_per_token_head_casts_to_e4m3_rounding_to_nearest_even():
    """absmax 896 gives scale 2.0: 2.125 / 2 = 1.0625 lies halfway between e4m3's 1.0 and 1.125 and goes to the even
    1.0; 2.375 / 2 = 1.1875 halfway between 1.125 and 1.25 goes to 1.25."""
    x = torch.tensor([[896.0, 2.125, 2.375, -2.125]])
    assert PerTokenHead("fp8", 4).quantize(x).values[0].tolist() == [896.0, 2.0, 2.5, -2.0]


def test_fp8_ds_mla_scales_each_128_latent_channels_by_their_own_max_over_448():
    """vLLM's fp8_ds_mla latent: a tile of absmax 896 gets scale 2.0 (2.125 / 2 halfway between e4m3's 1.0 and 1.125
    goes to the even 1.0), the next tile its own (absmax 448: scale 1.0), a tile of zeros FLT_MIN's, saturating; 8
    bits a channel and an fp32 scale a tile."""
    x = torch.zeros(1, 384)
    x[0, :3] = torch.tensor([896.0, 2.125, -2.375])
    x[0, 128:130] = torch.tensor([448.0, 3.3])
    got = DsMlaLatent().quantize(x)
    assert got.values[0, :3].tolist() == [896.0, 2.0, -2.5]
    assert got.values[0, 128:130].tolist() == [448.0, 3.25] and not bool(got.values[0, 256:].any())
    assert got.row_bits.tolist() == [8 * 384 + 3 * 32]
    x[0, 129] = float("nan")  # (fmaxf passes a NaN over: that channel alone comes back NaN)
    assert DsMlaLatent().quantize(x).values[0].isnan().nonzero().flatten().tolist() == [129]
    with pytest.raises(KvcalError, match="96 channels are not whole KV heads of 128"):
        DsMlaLatent().quantize(torch.ones(1, 96))


def test_int4_per_token_head_rotation_is_vllms():
    """The signs are vLLM's (seeded CPU bernoulli), and the butterfly is the unnormalized Sylvester Hadamard."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(0x9E3779B9 + 0 * 0x517CC1B7)
    assert torch.equal(rht_signs(64), 2.0 * torch.bernoulli(torch.full((64,), 0.5), generator=generator) - 1.0)
    rows = torch.arange(8)
    sylvester = torch.tensor([[(-1.0) ** bin(int(i & j)).count("1") for j in rows] for i in rows])
    x = torch.randint(-50, 50, (3, 8)).float()
    assert torch.equal(hadamard_butterfly(x), x @ sylvester.T)


def test_int4_per_token_head_codes_an_asymmetric_scale_whose_low_mantissa_bits_hold_the_zero_point():
    """A head whose rotation is known exactly (x = signs * H(r) / 8 for small integers r): r spans 16 (min -4), so
    scale = 16/15, zp = 4 / (16/15) = 3.75 -> 4, q = rhaz(r * 15/16 + 4); the read multiplies (q - zp) by the scale
    with its low 4 mantissa bits cleared and rotates back; 4 bits a code and 32 a head's scale word."""
    r = torch.tensor([-4.0, 12.0, 0.0, 1.0, 3.0, -2.0, 7.0, 5.0])
    signs = rht_signs(8)
    x = (signs * hadamard_butterfly(r) / 8)[None]
    got = Int4PerTokenHead(8).quantize(x)
    scale = np.float32(16.0) / np.float32(15.0)
    q = np.clip(np.trunc(r.numpy() * (np.float32(1.0) / scale) + 4 + 0.5), 0, 15)  # all >= 0 here
    cleared = np.array([scale]).view(np.int32) & -16
    restored = torch.from_numpy(((q - 4) * cleared.view(np.float32)).astype(np.float32))
    assert cleared.view(np.float32)[0] < scale
    assert torch.equal(got.values[0], hadamard_butterfly(restored) * signs / 8)
    assert got.row_bits.tolist() == [4 * 8 + 32]
    with pytest.raises(KvcalError, match="power of two"):
        Int4PerTokenHead(96)


def test_a_skip_map_keeps_the_named_layers_fp16_and_counts_their_bits():
    """`int4_per_token_head;skip=0` on the tiny Llama: layer 0 at 16 bits, layer 1 at 4 + 32/16 bits (head_dim 16),
    evaluated by eval ppl's simulation; a bad map is refused naming it."""
    model = tiny_model("llama")
    windows = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(0))
    method = baseline_method("int4_per_token_head;skip=0", [16] * 2)
    fp, result = evaluate_ppl(model, adapt(model), windows, [method])
    assert result.method == "int4_per_token_head;skip=0" and result.effective_bits == (16 + 4 + 2) / 2
    assert result.ppl != fp.ppl
    for bad, message in (("int4_per_token_head;skip=2", "'2' is not a layer index below 2"),
                         ("int4_per_token_head;first=1", "give skip=L"),
                         ("int4_per_token_head;skip=sliding_window", "needs the model's layers")):
        with pytest.raises(KvcalError, match=message):
            baseline_method(bad, [16] * 2)
    assert baseline_method("fp8_per_token_head;skip=sliding_window", [16] * 2, [16, None]).name == "fp8_per_token_head;skip=0"
    with pytest.raises(KvcalError, match="the model has no sliding-window layers for skip=sliding_window"):
        baseline_method("fp8_per_token_head;skip=sliding_window", [16] * 2, [None, None])


def test_e2m1_rounds_ties_to_the_even_code_and_saturates_at_six():
    x = torch.tensor([0.25, 0.26, 0.75, 1.25, 1.3, 1.75, 2.5, 3.5, 5.0, 5.01, 9.0, -0.75, -2.6])
    assert e2m1_nearest_even(x).tolist() == [0.0, 0.5, 1.0, 1.0, 1.5, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -1.0, -3.0]


def test_nvfp4_scales_each_16_channels_by_max_over_6_stored_in_e4m3():
    """max 6 gives SF = fp32(6 * fp32(1/6)) = 1: codes are the e2m1 of x itself. max 5 gives SF = 0.8333 stored as the
    e4m3 0.8125 (nearest of 0.8125 / 0.875), os = 1 / 0.8125: 5 * os = 6.15 saturates to 6 (4.875), 1 * os = 1.23 -> 1."""
    codec = Nvfp4(16)
    exact = torch.tensor([[6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, 0.3, 0, 0, 0, 0, 0, 0]])
    assert codec.quantize(exact).values.tolist() == [[6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -1.0, 0.5, 0, 0, 0, 0, 0, 0]]
    rounded = torch.tensor([[5.0] + [1.0] * 15 + [6.0] * 16])
    assert codec.quantize(rounded).values.tolist() == [[4.875] + [0.8125] * 15 + [6.0] * 16]
    assert codec.row_bits(256) == 4 * 256 + 8 * 16
    with pytest.raises(KvcalError, match="blocks of 16 channels"):
        Nvfp4(40)


def _round_to_nearest_e2m1(x: np.float32) -> float:
    """vLLM's round_to_nearest_e2m1, line by line."""
    ax = abs(x)
    q = 0.0 if ax <= 0.25 else 0.5 if ax < 0.75 else 1.0 if ax <= 1.25 else 1.5 if ax < 1.75 else 2.0 if ax <= 2.5 else \
        3.0 if ax < 3.5 else 4.0 if ax <= 5.0 else 6.0
    return float(np.copysign(q, x))


def _nvfp4_scalar(x: np.ndarray, k_scale: float = 1.0) -> list[float]:
    """One row through vLLM's nvfp4 writer element by element in numpy float32: global scale gs = 1 / k_scale,
    SF = gs * (vecMax * rcp(6)), its e4m3 byte, outputScale = rcp(SF_e4m3 * rcp(gs)), e2m1 of x * outputScale; read
    e2m1 * SF_e4m3 * k_scale."""
    out = []
    k = np.float32(k_scale)
    gs = np.float32(1.0) / k
    for block in x.reshape(-1, 16):
        vec_max = np.float32(np.abs(block).max())
        scale = np.float32(gs * np.float32(vec_max * np.float32(1.0 / 6.0)))
        stored = np.float32(torch.tensor(min(scale, np.float32(448.0))).to(torch.float8_e4m3fn).float().item())
        output_scale = np.float32(1.0) / np.float32(stored * (np.float32(1.0) / gs)) if stored != 0.0 else np.float32(0.0)
        out += [float(np.float32(np.float32(_round_to_nearest_e2m1(np.float32(element * output_scale))) * stored) * k)
                for element in block]
    return out


@pytest.mark.parametrize("k_scale", [1.0, 0.0123, 3.7])
def test_nvfp4_matches_vllms_writer_element_by_element_on_random_rows(k_scale):
    x = (torch.randn(6, 64, generator=torch.Generator().manual_seed(3)) * torch.logspace(-3, 2, 6)[:, None]).half().float()
    expected = [_nvfp4_scalar(row.numpy(), k_scale) for row in x]
    assert Nvfp4(32, k_scale=k_scale).quantize(x).values.tolist() == expected


def test_nvfp4_4over6_takes_max_over_4_where_its_block_error_is_smaller():
    """16 ones: max/6 stores SF 0.171875 (e4m3 of 1/6), 1 * os = 5.8 codes 6 and reads 1.03125; max/4 stores 0.25 and
    reads 1 exactly, so 4over6 takes it. [1, 0.1 x 15]: max/4 reads each 0.1 as 0.125 (error 15 * 0.025^2), max/6 as
    0.0859 (error 0.004 in all), so it keeps max/6; an all-zero block (equal errors) keeps max/6 too."""
    plain, four_over_six = Nvfp4(16), Nvfp4(16, four_over_six=True)
    ones = torch.ones(1, 16)
    assert plain.quantize(ones).values.unique().tolist() == [1.03125]
    assert four_over_six.quantize(ones).values.unique().tolist() == [1.0]
    mostly_small = torch.tensor([[1.0] + [0.1] * 15])
    assert torch.equal(four_over_six.quantize(mostly_small).values, plain.quantize(mostly_small).values)
    assert plain.quantize(mostly_small).values[0, 1].item() == 0.5 * 0.171875
    assert four_over_six.quantize(torch.zeros(1, 16)).values.abs().sum() == 0


def test_turboquant_centroids_are_lloyd_max_of_the_rotated_coordinate_law():
    """The 1-bit Lloyd-Max quantizer of N(0, s^2) is +-s sqrt(2 / pi); 3 bits: +-0.2451, 0.7560, 1.3440, 2.1520 s
    (Max, 1960). vLLM's solver (200-step trapezoids) lands within 3e-4 s and 2e-3 s of them (here 0.79771 s for
    sqrt(2 / pi) = 0.79788, 2.15035 s for 2.1520): its own codebook, not the exact one, is what its cache uses."""
    sigma = 64**-0.5
    one_bit = lloyd_max_centroids(64, 1)
    assert torch.allclose(one_bit, torch.tensor([-1.0, 1.0]) * sigma * (2 / np.pi) ** 0.5, rtol=0, atol=3e-4 * sigma)
    assert not torch.allclose(one_bit, torch.tensor([-1.0, 1.0]) * sigma * (2 / np.pi) ** 0.5, rtol=0, atol=1e-5 * sigma)
    table = torch.tensor([0.2451, 0.7560, 1.3440, 2.1520])
    assert torch.allclose(lloyd_max_centroids(64, 3), torch.cat([-table.flip(0), table]) * sigma, rtol=0, atol=2e-3 * sigma)
    h = sylvester_hadamard(8)
    assert torch.allclose(h @ h, torch.eye(8), atol=1e-6) and torch.equal(h, h.T)


def test_turboquant_keys_code_the_rotated_unit_vector_and_restore_the_fp16_norm():
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(3)) * 4
    got = TurboQuantKeys(4, 64, norm_correction=True).quantize(x)
    norms = x.view(6, 2, 64).norm(dim=-1)
    # norm correction: every reconstructed head has exactly its stored (fp16) norm
    torch.testing.assert_close(got.values.view(6, 2, 64).norm(dim=-1), norms.half().float(), rtol=2e-6, atol=0)
    # the codes: midpoints counted per rotated coordinate; a key along the first axis rotates to all-equal coordinates
    axis = torch.zeros(1, 64)
    axis[0, 0] = 3.0
    centroids = lloyd_max_centroids(64, 4)
    code = int(((centroids[:-1] + centroids[1:]) / 2 <= 64**-0.5).sum())
    plain = TurboQuantKeys(4, 64, norm_correction=False).quantize(axis).values
    torch.testing.assert_close(plain, 3.0 * centroids[code] * sylvester_hadamard(64).sum(0, keepdim=True), rtol=1e-6, atol=1e-6)
    assert got.row_bits[0] == 2 * (32 * 8 + 16) and TurboQuantKeys(3, 64, True).row_bits(128) == 2 * (24 * 8 + 16)
    fp8 = TurboQuantKeys(8, 64, norm_correction=False).quantize(torch.tensor([[500.0, -0.3] + [0.0] * 62]))
    assert fp8.values[0, :2].tolist() == [448.0, -0.3125] and fp8.row_bits[0] == 8 * 64


def test_turboquant_values_code_with_the_fp32_scale_and_decode_with_the_fp16_one():
    """v = 0, 0.1, ..., 1.5: scale 0.1 codes each v to 10 v (the +0.5 then truncation rounds up), read back with
    fp16(0.1) = 0.0999755859375; a constant head keeps scale 1e-8 (0 in fp16) and decodes to its fp16 minimum."""
    x = torch.cat([torch.arange(16.0) / 10, torch.full((48,), 0.7)])[None]
    got = TurboQuantValues(4, 64).quantize(torch.cat([x, torch.full((1, 64), 1 / 3)]))
    codes = torch.tensor([round(v * 10) for v in (torch.arange(16.0) / 10).tolist()] + [7] * 48, dtype=torch.float32)
    assert torch.equal(got.values[0], codes * torch.tensor(0.1).half().float())
    assert torch.equal(got.values[1], torch.full((64,), 1 / 3).half().float())
    assert got.row_bits[0] == 32 * 8 + 32 and TurboQuantValues(3, 64).row_bits(64) == 24 * 8 + 32


def test_a_turboquant_preset_leaves_the_first_and_last_two_layers_unquantized():
    method = baseline_method("turboquant_k3v4_nc;skip=5", [64] * 30)
    fp16 = [i for i, layer in enumerate(method.layers) if layer.key_codec.kind.value == "fp16"]
    assert fp16 == [0, 1, 5, 28, 29] and method.nominal_bits == 3.5
    assert [type(c).__name__ for c in (method.layers[2].key_codec, method.layers[2].value_codec)] == ["TurboQuantKeys", "TurboQuantValues"]
    assert len([i for i, layer in enumerate(baseline_method("turboquant_k8v4", [64] * 3).layers) if layer.key_codec.kind.value == "fp16"]) == 2


def test_eval_ppl_counts_a_turboquant_presets_real_bits_with_its_unquantized_boundary_layers():
    """turboquant_k3v4_nc on a 6-layer tiny Llama (head_dim 16): layers 0, 1, 4, 5 at 16 bits, layers 2 and 3 at
    (3 x 16 + 16) / 16 = 4 bits for keys and (4 x 16 + 32) / 16 = 6 for values."""
    model = tiny_model("llama", num_hidden_layers=6)
    windows = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(0))
    fp, result = evaluate_ppl(model, adapt(model), windows, [baseline_method("turboquant_k3v4_nc", [16] * 6)])
    assert result.effective_bits == pytest.approx((4 * 16 + 2 * (4 + 6) / 2) / 6)
    assert result.ppl != fp.ppl


def test_a_turboquant_preset_keeps_no_boundary_layer_in_a_hybrid_and_is_refused_where_layers_share_kv(tiny_model_dir,
                                                                                                       tiny_corpus):
    """vLLM keeps a TurboQuant preset's first and last two layers fp16 in a model whose every decoder layer attends,
    none in a hybrid (its is_hybrid): eval ppl on the tiny Qwen3.5 (DeltaNet layers between its two attention layers)
    stores both attention layers as turboquant_k3v4_nc, (3 x 16 + 16) / 16 = 4 bits for keys and (4 x 16 + 32) / 16 =
    6 for values, where the dense rule would keep both fp16. On the tiny Gemma 3n, whose layers read others' caches
    (which vLLM may count among the boundary), the preset is refused in one line."""
    from typer.testing import CliRunner

    from kvcal.cli import app

    arguments = ["eval", "ppl", "--dataset", str(tiny_corpus), "--seqlen", "16", "--windows", "1", "--baseline",
                 "turboquant_k3v4_nc", "--json"]
    hybrid = CliRunner().invoke(app, [*arguments, str(tiny_corpus.parent / "hybrid.json"), "--model", str(tiny_model_dir("qwen3_5_text"))])
    assert hybrid.exit_code == 0, hybrid.output
    results = json.loads((tiny_corpus.parent / "hybrid.json").read_text())["results"]
    assert next(r for r in results if r["method"] == "turboquant_k3v4_nc")["effective_bits"] == pytest.approx(5.0)
    assert baseline_method("turboquant_k3v4_nc", [16] * 2).layers[0].key_codec.kind.value == "fp16"  # the dense rule
    shared = CliRunner().invoke(app, [*arguments, str(tiny_corpus.parent / "shared.json"), "--model", str(tiny_model_dir("gemma3n_text"))])
    assert shared.exit_code == 2 and "read another's cache (KV sharing)" in shared.output
    assert len(shared.output.strip().splitlines()) == 1 and not (tiny_corpus.parent / "shared.json").exists()


@pytest.mark.parametrize("dtype", ["nvfp4", "nvfp4_4over6"])
def test_eval_ppl_counts_nvfp4_as_4_bit_codes_and_an_e4m3_byte_per_16_channels(dtype):
    model = tiny_model("llama")
    windows = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(0))
    fp, result = evaluate_ppl(model, adapt(model), windows, [baseline_method(dtype, [16] * 2)])
    assert result.effective_bits == 4.5 and result.ppl != fp.ppl
