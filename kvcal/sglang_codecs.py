"""SGLang's FP4 KV cache (`--kv-cache-dtype fp4_e2m1`, named `fp4_mx_block16` in later releases) as a kvcal codec,
with the arithmetic of SGLang's own write and read path, for `eval ppl`. SGLang caches keys after RoPE and quantizes
(tokens, heads, head_dim) in the model's dtype, which is fp16 here, as kvcal's cache holds fp16 (the vLLM codecs take
the same convention).

- BlockFp4: blocks of 16 consecutive channels of a (token, KV head), each with an exponent-only scale:
  e = ceil(log2(clamp(max|x| / 6, min=1e-10))) and 2^-e x coded as E2M1 (sign, then the count of the magnitude
  bounds 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 it reaches: ties round up, 6 saturates), all in the model dtype;
  stored e + 127 as a byte. Read: E2M1 value * 2^(byte - 127) in fp32, cast to the model dtype. 4 bits a code and 8
  a block: 4.5 bits. SGLang calls it MXFP4 with a block of 16 (the OCP MX format's block is 32).
  Source: sgl-project/sglang python/sglang/srt/layers/quantization/kvfp4_tensor.py
  @ 0dae407b3cee5c310cdeeae348b6d42c025788b2 (FP4MXBlock16KVQuantizeUtil.batched_quantize / batched_dequantize),
  used by MHATokenToKVPoolFP4.set_kv_buffer in python/sglang/srt/mem_cache/memory_pool.py.

SGLang takes one --kv-cache-dtype for every layer: its per-layer dtype pull requests (#15420, #17530) were closed
unmerged, as were those for int4 / int8 caches (#2864, #3034, #15285), so there is no per-layer plan to write for it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvcal.errors import KvcalError
from kvcal.quantizers import E2M1_MAGNITUDES, CodecKind, Quantized

MODEL_DTYPE = torch.float16
BLOCK = 16  # channels per exponent scale
E2M1_MAX = 6.0
E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # a magnitude reaching bound i codes as i + 1
SCALE_FLOOR = 1e-10  # clamps max|x| / 6 before the log (0 in fp16: an all-zero block decodes to zeros all the same)
EXPONENT_BIAS = 127
SCALE_BITS = 8


@dataclass(frozen=True)
class BlockFp4:
    kind: ClassVar[CodecKind] = CodecKind.SIMULATED
    head_dim: int
    block_tokens = 1
    bits = 4 + SCALE_BITS / BLOCK

    def __post_init__(self):
        if self.head_dim % BLOCK:
            raise KvcalError(f"SGLang's fp4_e2m1 scales blocks of {BLOCK} channels: head_dim {self.head_dim} is not a multiple of it")

    def row_bits(self, channels: int) -> float:
        return float(4 * channels + SCALE_BITS * (channels // BLOCK))

    def quantize(self, x: torch.Tensor) -> Quantized:
        tokens, channels = x.shape
        if channels % self.head_dim:
            raise KvcalError(f"{channels} channels are not whole KV heads of {self.head_dim}")
        blocks = x.to(MODEL_DTYPE).view(tokens, channels // BLOCK, BLOCK)
        exponent = torch.ceil(torch.log2(torch.clamp(blocks.abs().amax(-1, keepdim=True) / E2M1_MAX, min=SCALE_FLOOR)))
        stored_exponent = (exponent + EXPONENT_BIAS).to(torch.uint8)
        scaled = blocks / torch.exp2(exponent)
        magnitude = (scaled.abs().unsqueeze(-1) >= scaled.new_tensor(E2M1_BOUNDS, dtype=torch.float32)).sum(-1)
        coded = x.new_tensor(E2M1_MAGNITUDES, dtype=torch.float32)[magnitude]
        coded = torch.where(scaled < 0, -coded, coded)
        values = (coded * torch.exp2(stored_exponent.float() - EXPONENT_BIAS)).to(MODEL_DTYPE).float()
        return Quantized(values.view(tokens, channels), torch.full((tokens,), self.row_bits(channels), device=x.device))
