"""vLLM's KV cache dtypes (`vllm`, the `eval ppl` baselines int8_per_token_head, fp8_per_token_head,
int4_per_token_head, nvfp4, nvfp4_4over6 and the TurboQuant presets turboquant_k8v4, turboquant_4bit_nc, turboquant_k3v4_nc,
turboquant_3bit_nc; no calibration): every token quantized when stored, keys after RoPE, nothing kept fp16 (but a
TurboQuant preset's first and last two layers where every decoder layer attends, which vLLM leaves unquantized), to
vLLM's kernels (kvcal.vllm_codecs). On a multi-head latent attention model, fp8_ds_mla: vLLM's cache of DeepSeek-V3.2
(its latent in FP8 tiles, its rotated key 16-bit, its indexer keys FP8), where the others are refused.
With `;skip=L+L+...` (kvcal.methods.baseline_method) the named layers stay unquantized too, as vLLM's
--kv-cache-dtype-skip-layers keeps them."""

from __future__ import annotations

from kvcal import registry
from kvcal.kv import SegmentPolicy
from kvcal.quantizers import FP16_LAYER, Fp16Codec, LayerCodecs
from kvcal.registry import MethodSpec
from kvcal.simulate import Method, engine_dtype_method
from kvcal.vllm_codecs import (DS_MLA_TILE, TQ_PRESETS, DsMlaLatent, Int4PerTokenHead, Nvfp4, PerTokenHead, TurboQuantKeys,
                               TurboQuantValues, tq_boundary_layers)

VLLM_DTYPES = {
    "int8_per_token_head": lambda head_dim: PerTokenHead("int8", head_dim),
    "fp8_per_token_head": lambda head_dim: PerTokenHead("fp8", head_dim),
    "int4_per_token_head": Int4PerTokenHead,
    "nvfp4": Nvfp4,
    "nvfp4_4over6": lambda head_dim: Nvfp4(head_dim, four_over_six=True),
}


# vLLM's cache of DeepSeek-V3.2's sparse MLA (its default there): the latent in FP8 tiles, the rotated key kept 16-bit,
# the indexer's keys in FP8 (kvcal.vllm_codecs.DsMlaLatent)
DS_MLA = "fp8_ds_mla"
DS_MLA_ROTATED = 64  # the rotated key's channels vLLM's fp8_ds_mla stores (its pe_dim)


def ds_mla_refusal(latent: bool, indexed: bool, key_widths: list[int], latent_widths: list[int]) -> str | None:
    """Why fp8_ds_mla is not what vLLM would store for a model, or None where it is: vLLM takes it for sparse MLA only
    (its dense MLA backends cache fp8 or 16-bit), a latent of 512 and a rotated key of 64 (kvcal takes any whole tiles
    of a latent, for small models)."""
    if not latent:
        return "it is vLLM's cache of multi-head latent attention (DeepSeek-V3.2's), and this model's attention is not MLA"
    if not indexed:
        return ("vLLM stores it for sparse MLA (DeepSeek Sparse Attention's, an indexer's pick) only, and this model's "
                "layers keep no indexer: evaluate fp8")
    if any(width != DS_MLA_ROTATED for width in key_widths):
        return (f"its rotated key is {DS_MLA_ROTATED} channels (DeepSeek-V3.2's), and this model's are "
                f"{sorted(set(key_widths))} wide")
    if any(width % DS_MLA_TILE for width in latent_widths):
        return (f"its latent is stored in tiles of {DS_MLA_TILE} channels (512 in DeepSeek-V3.2), and this model's "
                f"latents are {sorted(set(latent_widths))} wide")
    return None


def turboquant_method(preset: str, num_layers: int, head_dim: int, boundary: bool = True) -> Method:
    """A TurboQuant preset on every layer but, where `boundary`, the first and last two, which vLLM keeps fp16 in a
    model whose every decoder layer attends (none in a hybrid: kvcal.methods.baseline_method)."""
    key_bits, value_bits, norm_correction = TQ_PRESETS[preset]
    layer = LayerCodecs(TurboQuantKeys(key_bits, head_dim, norm_correction), TurboQuantValues(value_bits, head_dim), key_pre_rope=False)
    fp16_layers = tq_boundary_layers(num_layers) if boundary else set()
    layers = [FP16_LAYER if i in fp16_layers else layer for i in range(num_layers)]
    return Method(preset, (key_bits + value_bits) / 2, layers, SegmentPolicy())


class VllmDtypeSpec(MethodSpec):
    name = "vllm"
    description = ("vLLM's KV cache dtypes: per-token-head int8, fp8, int4 (with its Hadamard rotation), nvfp4 (and its "
                   "4over6 scale choice), the TurboQuant presets and DeepSeek-V3.2's fp8_ds_mla, to its kernels "
                   "(baseline)")

    def baseline_syntax(self):
        return " | ".join([*VLLM_DTYPES, *TQ_PRESETS, DS_MLA])

    def baseline(self, text, num_layers, head_dim):
        if text == DS_MLA:  # (an MLA layer's key codec is its rotated key's, its value codec its latent's)
            return Method(DS_MLA, 8, [LayerCodecs(Fp16Codec(), DsMlaLatent(), key_pre_rope=False)] * num_layers,
                          SegmentPolicy(), indexer_keys="fp8")
        if text in TQ_PRESETS:
            return turboquant_method(text, num_layers, head_dim)
        make = VLLM_DTYPES.get(text)
        if make is None:
            return None
        return engine_dtype_method(text, make(head_dim), num_layers)


registry.register_method(VllmDtypeSpec())
