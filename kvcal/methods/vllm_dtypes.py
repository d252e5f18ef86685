"""vLLM's KV cache dtypes (`vllm`, the `eval ppl` baselines int8_per_token_head, fp8_per_token_head,
int4_per_token_head, nvfp4, nvfp4_4over6 and the TurboQuant presets turboquant_k8v4, turboquant_4bit_nc, turboquant_k3v4_nc,
turboquant_3bit_nc; no calibration): every token quantized when stored, keys after RoPE, nothing kept fp16 (but a
TurboQuant preset's first and last two layers where every decoder layer attends, which vLLM leaves unquantized), to
vLLM's kernels (kvcal.vllm_codecs).
With `;skip=L+L+...` (kvcal.methods.baseline_method) the named layers stay unquantized too, as vLLM's
--kv-cache-dtype-skip-layers keeps them."""

from __future__ import annotations

from kvcal import registry
from kvcal.kv import SegmentPolicy
from kvcal.quantizers import FP16_LAYER, LayerCodecs
from kvcal.registry import MethodSpec
from kvcal.simulate import Method, engine_dtype_method
from kvcal.vllm_codecs import (TQ_PRESETS, Int4PerTokenHead, Nvfp4, PerTokenHead, TurboQuantKeys, TurboQuantValues,
                               tq_boundary_layers)

VLLM_DTYPES = {
    "int8_per_token_head": lambda head_dim: PerTokenHead("int8", head_dim),
    "fp8_per_token_head": lambda head_dim: PerTokenHead("fp8", head_dim),
    "int4_per_token_head": Int4PerTokenHead,
    "nvfp4": Nvfp4,
    "nvfp4_4over6": lambda head_dim: Nvfp4(head_dim, four_over_six=True),
}


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
                   "4over6 scale choice) and the TurboQuant presets, to its kernels (baseline)")

    def baseline_syntax(self):
        return " | ".join([*VLLM_DTYPES, *TQ_PRESETS])

    def baseline(self, text, num_layers, head_dim):
        if text in TQ_PRESETS:
            return turboquant_method(text, num_layers, head_dim)
        make = VLLM_DTYPES.get(text)
        if make is None:
            return None
        return engine_dtype_method(text, make(head_dim), num_layers)


registry.register_method(VllmDtypeSpec())
