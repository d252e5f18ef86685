"""vLLM's per-token-head KV cache dtypes (`vllm`, the `eval ppl` baselines int8_per_token_head,
fp8_per_token_head and int4_per_token_head, no calibration): every token quantized when stored, keys after RoPE,
nothing kept fp16, exact to vLLM's kernels (kvcal.vllm_codecs). With `;skip=L+L+...` (kvcal.methods.baseline_method)
the named layers stay unquantized, as vLLM's --kv-cache-dtype-skip-layers keeps them."""

from __future__ import annotations

from kvcal import registry
from kvcal.kv import SegmentPolicy
from kvcal.quantizers import LayerCodecs
from kvcal.registry import MethodSpec
from kvcal.simulate import Method
from kvcal.vllm_codecs import Int4PerTokenHead, PerTokenHead

VLLM_DTYPES = {
    "int8_per_token_head": lambda head_dim: PerTokenHead("int8", head_dim),
    "fp8_per_token_head": lambda head_dim: PerTokenHead("fp8", head_dim),
    "int4_per_token_head": Int4PerTokenHead,
}


class VllmDtypeSpec(MethodSpec):
    name = "vllm"
    description = "vLLM's per-token-head KV cache dtypes (int8, fp8, int4 with its Hadamard rotation), exact to its kernels (baseline)"

    def baseline_syntax(self):
        return " | ".join(VLLM_DTYPES)

    def baseline(self, text, num_layers, head_dim):
        make = VLLM_DTYPES.get(text)
        if make is None:
            return None
        codec = make(head_dim)
        return Method(text, codec.bits, [LayerCodecs(codec, codec, key_pre_rope=False)] * num_layers, SegmentPolicy())


registry.register_method(VllmDtypeSpec())
