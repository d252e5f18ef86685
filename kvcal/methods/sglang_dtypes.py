"""SGLang's FP4 KV cache dtype (`sglang`, the `eval ppl` baseline fp4_e2m1, or fp4_mx_block16 as later SGLang names
it; no calibration): every token quantized when stored, keys after RoPE, in blocks of 16 channels with an exponent
scale each, to SGLang's own arithmetic (kvcal.sglang_codecs). SGLang's fp8_e4m3 and fp8_e5m2 casts are not modelled
(the `fp8` baseline is vLLM's e4m3)."""

from __future__ import annotations

from kvcal import registry
from kvcal.registry import MethodSpec
from kvcal.sglang_codecs import BlockFp4
from kvcal.simulate import engine_dtype_method

SGLANG_DTYPES = {"fp4_e2m1": BlockFp4, "fp4_mx_block16": BlockFp4}  # one recipe, SGLang's earlier and later name


class SglangDtypeSpec(MethodSpec):
    name = "sglang"
    description = "SGLang's fp4_e2m1 KV cache: E2M1 codes, an exponent scale per 16 channels, to its arithmetic (baseline)"

    def baseline_syntax(self):
        return " | ".join(SGLANG_DTYPES)

    def baseline(self, text, num_layers, head_dim):
        make = SGLANG_DTYPES.get(text)
        if make is None:
            return None
        return engine_dtype_method(text, make(head_dim), num_layers)


registry.register_method(SglangDtypeSpec())
