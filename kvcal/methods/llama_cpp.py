"""llama.cpp's KV cache types (`llama.cpp`, the `eval ppl` baselines q8_0, q5_0, q5_1, q4_0, q4_1, iq4_nl,
no calibration): blocks of 32 channels with ggml's reference rounding, after the Hadamard rotation llama.cpp
applies to a quantized K and V cache; each token is quantized once, when stored. Codecs:
kvcal.rotation_codecs.LlamaCppKV."""

from __future__ import annotations

from kvcal import registry
from kvcal.kv import SegmentPolicy
from kvcal.quantizers import LayerCodecs
from kvcal.registry import MethodSpec
from kvcal.rotation_codecs import LLAMA_CPP_TYPES, llama_cpp_codecs
from kvcal.simulate import Method


class LlamaCppSpec(MethodSpec):
    name = "llama.cpp"
    description = "llama.cpp KV cache types with its Hadamard rotation, exact to ggml's reference rounding (baseline)"

    def baseline_syntax(self):
        return " | ".join(LLAMA_CPP_TYPES)

    def baseline(self, text, num_layers, head_dim):
        if text not in LLAMA_CPP_TYPES:
            return None
        keys, values = llama_cpp_codecs(text, head_dim)
        return Method(text, keys.bits, [LayerCodecs(keys, values, key_pre_rope=False)] * num_layers, SegmentPolicy())


registry.register_method(LlamaCppSpec())
