"""kvcal.methods: every artifact, bundle and baseline spec becomes a simulation Method through the registry."""

import re

import pytest
import torch

from kvcal.errors import KvcalError
from kvcal.kv import SegmentPolicy
from kvcal.methods import artifact_method, baseline_method, check_baseline
from kvcal.methods.kivi import kivi_layer
from kvcal.quantizers import LayerCodecs, TokenUniform


def test_a_profile_is_not_an_evaluable_method(tiny_profile):
    with pytest.raises(KvcalError, match="is a kvcal profile; --quant takes a nuq or skvq or bundle artifact"):
        artifact_method(str(tiny_profile[1]))


def test_specs_and_defaults():
    method = baseline_method("int4", [64] * 3)
    assert method.name == "int4-g64" and method.layers[0] == LayerCodecs(TokenUniform(4, 64), TokenUniform(4, 64), False) and len(method.layers) == 3
    kivi = baseline_method("kivi2", [64] * 2)
    assert kivi.name == "kivi2-g32-r128" and kivi.layers[0] == kivi_layer(2, 32) and kivi.policy.residual == 128
    assert baseline_method("kivi3-g64-r64", [64]).policy.residual == 64


@pytest.mark.parametrize("spec, message", [("int5", "bits must be 1-4"), ("fp4", "unknown baseline"), ("kivi0", "not one of 1, 2, 3, 4"),
                                           ("kivi2-g32-r100", "multiple of the group"), ("int2-g64-r128", "no residual"),
                                           ("kivi2-g0", "group size must be at least 1"), ("int2-g0", "group size at least 1")])
def test_bad_specs(spec, message):
    with pytest.raises(KvcalError, match=message):
        baseline_method(spec, [64] * 2)


@pytest.mark.parametrize("spec, bits", [("hadamard-int4", 4.5), ("hadamard-int2", 2.5), ("turbo3", 3.25), ("q4_0", 4.5),
                                        ("q8_0", 8.5), ("q5_1", 6.0), ("iq4_nl", 4.5)])
def test_rotation_and_llama_cpp_baselines_store_their_real_bits(spec, bits):
    method = baseline_method(spec, [64] * 2)
    assert method.name == spec and len(method.layers) == 2 and not method.layers[0].key_pre_rope
    x = torch.randn(7, 128, generator=torch.Generator().manual_seed(0))
    for codec in (method.layers[0].key_codec, method.layers[0].value_codec):
        stored = codec.quantize(x)
        assert torch.all(stored.row_bits == bits * 128)
        assert (stored.values - x).abs().max() < 0.6 * x.abs().max()


def test_a_llama_cpp_k_v_pair_gives_each_tensor_its_own_type_rotating_only_a_quantized_one():
    """`q8_0/q4_0` is -ctk q8_0 -ctv q4_0; with `f16` on one side that tensor is stored unquantized and unrotated."""
    pair = baseline_method("q8_0/q4_0", [64] * 2).layers[0]
    assert (pair.key_codec.qtype, pair.value_codec.qtype) == ("q8_0", "q4_0")
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    assert torch.all(pair.key_codec.quantize(x).row_bits == 8.5 * 128) and torch.all(pair.value_codec.quantize(x).row_bits == 4.5 * 128)
    half = baseline_method("f16/q4_0", [64] * 2).layers[0]
    assert torch.equal(half.key_codec.quantize(x).values, x.half().float()) and half.value_codec.rotation is not None
    for spec in ("f16", "f16/f16", "q4_0/", "q4_0/q9_0"):
        with pytest.raises(KvcalError, match="unknown baseline"):
            baseline_method(spec, [64] * 2)


def test_an_mla_model_takes_one_unrotated_llama_cpp_type_and_no_format_engines_lack():
    """MLA (latent=True): llama.cpp stores a token's latent and rotated key as one row of one type, never rotated; two
    types, ik_llama.cpp's first / last layers, vLLM's dtypes but fp8 and its skipped layers are refused with why."""
    mla = dict(value_dims=[96] * 2, latent=True)
    layer = baseline_method("q4_0", [64] * 2, **mla).layers[0]
    assert (layer.key_codec.qtype, layer.value_codec.qtype) == ("q4_0", "q4_0")
    assert layer.key_codec.rotation is None and layer.value_codec.rotation is None
    assert baseline_method("q4_0", [64] * 2, value_dims=[96] * 2).layers[0].key_codec.rotation is not None  # unless MLA
    for spec in ("fp8", "int4-g32", "kivi2-g32-r128"):
        baseline_method(spec, [64] * 2, **mla)
    for spec, reason in (("q8_0/q4_0", "one row of one type"), ("q4_0;k_first=q8_0,1", "ik_llama.cpp's MLA cache"),
                         ("int4_per_token_head", "fp8 or 16-bit only"), ("turboquant_k8v4", "fp8 or 16-bit only"),
                         ("fp8;skip=0", "--kv-cache-dtype-skip-layers")):
        with pytest.raises(KvcalError, match=re.escape(reason)):
            baseline_method(spec, [64] * 2, **mla)


def test_ik_llama_cpp_layers_rotate_as_under_khad_and_vhad_unless_the_base_is_f16():
    """With a quantized base every quantized layer of the tensor is rotated on ik_llama.cpp's blocks (a whole head of
    256 for V too, where llama.cpp takes 64); with an f16 base ik_llama.cpp rotates nothing, so the ends are plain."""
    method = baseline_method("f16/q4_0;k_first=q8_0,1;v_last=q8_0,1", [256] * 2)
    keys, values = [layer.key_codec for layer in method.layers], [layer.value_codec for layer in method.layers]
    assert keys[0].bits == 8 and keys[0].rotation is None and keys[1].bits == 16
    assert [codec.rotation.block for codec in values] == [256, 256] and [codec.bits for codec in values] == [4, 8]
    assert baseline_method("q4_0", [256] * 2).layers[0].value_codec.rotation.block == 64  # llama.cpp's own


def test_ik_llama_cpp_first_and_last_layers_take_their_own_types():
    """`q4_0;k_first=q8_0,2;v_last=f16,1` on 5 layers is -ctk q4_0 -ctv q4_0 -ctk-first q8_0,2 -ctv-last f16,1: keys of
    layers 0-1 at q8_0, values of layer 4 unquantized, every other tensor q4_0; overlapping ends and other bases are
    refused."""
    method = baseline_method("q4_0;v_last=f16,1;k_first=q8_0,2", [64] * 5)
    assert method.name == "q4_0;k_first=q8_0,2;v_last=f16,1"
    assert [layer.key_codec.bits for layer in method.layers] == [8, 8, 4, 4, 4]
    assert [layer.value_codec.bits for layer in method.layers] == [4, 4, 4, 4, 16]
    for spec, message in (("q4_0;k_first=q8_0,3;k_last=q8_0,3", "they overlap"), ("int4-g64;k_first=q8_0,1", "not 'int4-g64'"),
                          ("q4_0;k_first=q8_0", "k_first=TYPE,N"), ("q4_0;k_first=q9_0,1", "'q9_0' is not one of f16"),
                          ("q4_0;k_first=q8_0,0", "give a number of layers, 1 or more"),
                          ("q4_0;k_last=q8_0,6", "the model has 5 layers")):
        with pytest.raises(KvcalError, match=message):
            baseline_method(spec, [64] * 5)


def test_a_spec_is_checked_before_a_model_as_with_one():
    """check_baseline takes what baseline_method takes on some model (an f16 base where first / last options follow)
    and refuses, in baseline_method's words, what it refuses on any (first / last options after a TurboQuant preset,
    whatever the decoder)."""
    for spec in ("f16;k_first=q8_0,2;k_last=q8_0,2", "q4_0;v_last=f16,3", "kivi2-g32-r128", "turboquant_k8v4;skip=0"):
        check_baseline(spec)
    for spec, message in (("f16", "unknown baseline"), ("q4_0;k_first=q8_0", "k_first=TYPE,N"),
                          ("turboquant_k8v4;k_first=q8_0,1", "not 'turboquant_k8v4'")):
        with pytest.raises(KvcalError, match=message):
            check_baseline(spec)
    for decoder in ("dense", "recurrent"):
        with pytest.raises(KvcalError, match="not 'turboquant_k8v4'"):
            baseline_method("turboquant_k8v4;k_first=q8_0,1", [64] * 6, decoder=decoder)


def test_a_turboquant_preset_is_refused_where_layers_attend_across_to_an_image():
    """Where vLLM counts a cross-attention layer among a TurboQuant preset's fp16 boundary layers is not modelled."""
    with pytest.raises(KvcalError, match=r"attend across to an image \(cross-attention\); evaluate another vLLM dtype"):
        baseline_method("turboquant_k3v4_nc", [16] * 2, decoder="cross")
    assert baseline_method("int4-g64", [16] * 2, decoder="cross").nominal_bits == 4


def test_a_baseline_that_needs_power_of_two_heads_says_so():
    with pytest.raises(KvcalError, match="power of two"):
        baseline_method("hadamard-int4", [48] * 2)


def test_the_fp8_baseline_is_vllms_default_scale():
    """`fp8`: every layer's keys (post-RoPE) and values as fp8_e4m3(x / 1.0) * 1.0, 8 bits per element, no fp16 tokens."""
    method = baseline_method("fp8", [64] * 3)
    assert method.name == "fp8 scale 1.0" and method.nominal_bits == 8 and len(method.layers) == 3
    assert not method.layers[0].key_pre_rope and method.policy == SegmentPolicy() and method.fingerprint is None
    x = torch.tensor([[0.3, -1000.0, 500.0, 17.0]])
    for codec in (method.layers[2].key_codec, method.layers[2].value_codec):
        stored = codec.quantize(x)
        assert stored.values.tolist() == [[0.3125, -448.0, 448.0, 16.0]]  # e4m3 rounding, saturated at +-448
        assert stored.row_bits.tolist() == [8 * 4] and stored.row_outliers is None


def test_vllms_cache_of_sparse_mla_is_refused_where_vllm_would_not_store_it():
    """fp8_ds_mla is vLLM's cache of sparse multi-head latent attention, a rotated key of 64 beside a latent in tiles of
    128 channels: a model without MLA, without an indexer (dense MLA, which vLLM caches fp8 or 16-bit), with another
    rotated key (GLM-5 Next's, none) or a latent not of whole tiles is refused in one line; the spec itself passes the
    check made before a model is loaded, and a sparse model's is made."""
    check_baseline("fp8_ds_mla")
    for head_dims, value_dims, latent, indexed, refusal in (
            ([16, 16], None, False, False, "this model's attention is not MLA"),
            ([64, 64], [128, 128], True, False, "this model's layers keep no indexer: evaluate fp8"),
            ([0, 0], [128, 128], True, True, r"rotated key is 64 channels .* this model's are \[0\] wide"),
            ([64, 64], [96, 96], True, True, r"tiles of 128 channels .* latents are \[96\] wide")):
        with pytest.raises(KvcalError, match=refusal):
            baseline_method("fp8_ds_mla", head_dims, value_dims=value_dims, latent=latent, indexed=indexed)
    assert baseline_method("fp8_ds_mla", [64, 64], value_dims=[512, 512], latent=True, indexed=True).indexer_keys == "fp8"


def test_plain_fp8_on_sparse_mla_is_refused_for_fp8_ds_mla():
    """vLLM turns fp8 on sparse MLA into fp8_ds_mla (and SGLang stores that layout), so plain fp8 at scale 1.0 there is
    no engine's cache and refused, naming the one that is; dense MLA keeps it."""
    with pytest.raises(KvcalError, match="sparse MLA's fp8 cache .* evaluate fp8_ds_mla"):
        baseline_method("fp8", [64, 64], value_dims=[512, 512], latent=True, indexed=True)
    with pytest.raises(KvcalError, match="caches fp8 or 16-bit only, not int4_per_token_head: evaluate fp8_ds_mla"):
        baseline_method("int4_per_token_head", [64, 64], value_dims=[512, 512], latent=True, indexed=True)
    assert baseline_method("fp8", [64, 64], value_dims=[512, 512], latent=True).name == "fp8 scale 1.0"
