"""llama.cpp's KV cache types (`llama.cpp`, the `eval ppl` baselines q8_0, q5_0, q5_1, q4_0, q4_1, iq4_nl,
no calibration): blocks of 32 channels with ggml's reference rounding, after the Hadamard rotation llama.cpp
applies to a quantized K and V cache; each token is quantized once, when stored. `K/V` (`q8_0/q4_0`, `f16/q4_0`)
is `-ctk K -ctv V`: each tensor takes its own type, and llama.cpp rotates only a quantized one (attn_rot_k and
attn_rot_v in src/llama-kv-cache.cpp each test their own type). Codecs: kvcal.rotation_codecs.LlamaCppKV."""

from __future__ import annotations

from kvcal import registry
from kvcal.kv import SegmentPolicy
from kvcal.quantizers import Fp16Codec, LayerCodecs
from kvcal.registry import MethodSpec
from kvcal.rotation_codecs import LLAMA_CPP_TYPES, LlamaCppKV
from kvcal.simulate import Method

CACHE_TYPES = ("f16", *LLAMA_CPP_TYPES)  # what -ctk / -ctv take here (f32 and bf16 store no fewer bytes than f16)


def cache_type_codec(cache_type: str, head_dim: int, tensor: str):
    """The codec of one tensor ("k" or "v") under a llama.cpp cache type."""
    return Fp16Codec() if cache_type == "f16" else LlamaCppKV(cache_type, head_dim, tensor)


def llama_cpp_method(type_k: str, type_v: str, num_layers: int, head_dim: int) -> Method:
    """`-ctk type_k -ctv type_v` on every layer (llama.cpp has one type per tensor for the whole model)."""
    keys, values = cache_type_codec(type_k, head_dim, "k"), cache_type_codec(type_v, head_dim, "v")
    name = type_k if type_k == type_v else f"{type_k}/{type_v}"
    return Method(name, (keys.bits + values.bits) / 2, [LayerCodecs(keys, values, key_pre_rope=False)] * num_layers,
                  SegmentPolicy())


class LlamaCppSpec(MethodSpec):
    name = "llama.cpp"
    description = "llama.cpp KV cache types with its Hadamard rotation, exact to ggml's reference rounding (baseline)"

    def baseline_syntax(self):
        return " | ".join(LLAMA_CPP_TYPES) + " | K/V (-ctk K -ctv V, each of these or f16)"

    def baseline(self, text, num_layers, head_dim):
        type_k, type_v = text.split("/", 1) if "/" in text else (text, text)
        if type_k not in CACHE_TYPES or type_v not in CACHE_TYPES or type_k == type_v == "f16":
            return None
        return llama_cpp_method(type_k, type_v, num_layers, head_dim)


registry.register_method(LlamaCppSpec())
