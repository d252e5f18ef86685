"""kvcal.sglang_codecs against the arithmetic of SGLang's FP4 KV cache, read from sgl-project/sglang
python/sglang/srt/layers/quantization/kvfp4_tensor.py @ 0dae407b3cee5c310cdeeae348b6d42c025788b2
(FP4MXBlock16KVQuantizeUtil, which MHATokenToKVPoolFP4.set_kv_buffer calls on (tokens, heads, head_dim)):
- batched_quantize: blocks = x.view(b, m * n // 16, 16); scale_exp = ceil(log2(clamp(blocks.abs().max(-1) / 6.0,
  min=1e-10))); scale byte (scale_exp + 127).to(uint8); scaled = blocks / exp2(scale_exp); code = (scaled < 0) << 3
  + sum(|scaled| >= (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5)); two codes a byte.
- batched_dequantize: E2M1_VALUES[code] (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives) * exp2(byte - 127) in fp32,
  cast to the model dtype."""

import pytest
import torch

from helpers.tiny_models import tiny_model
from kvcal.adapters import adapt
from kvcal.errors import KvcalError
from kvcal.evaluate import evaluate_ppl
from kvcal.methods import baseline_method
from kvcal.sglang_codecs import BlockFp4

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def sglang_round_trip(x: torch.Tensor) -> torch.Tensor:
    """SGLang's batched_quantize then batched_dequantize, as written there (torch.compile aside), on (b, m, n)."""
    b, m, n = x.shape
    reshaped = x.view(b, m * n // 16, 16)
    block_max = reshaped.abs().max(dim=-1, keepdim=True).values
    scale_exp = torch.ceil(torch.log2(torch.clamp(block_max / 6.0, min=1e-10)))
    scale_factors = (scale_exp + 127).squeeze(-1).to(torch.uint8)
    scaled = reshaped / torch.exp2(scale_exp)
    sign_bits = (scaled < 0).to(torch.uint8) << 3
    magnitude_bits = torch.sum(scaled.abs().unsqueeze(-1) >= x.new_tensor((0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0), dtype=torch.float32), dim=-1)
    fp4 = (sign_bits + magnitude_bits.to(torch.uint8)).view(b, m, n)
    packed = (fp4[..., 1::2] << 4) + fp4[..., 0::2]
    unpacked = torch.empty(b, m, n, dtype=torch.uint8)
    unpacked[..., 0::2] = packed & 0x0F
    unpacked[..., 1::2] = (packed >> 4) & 0x0F
    values = x.new_tensor(E2M1_VALUES, dtype=torch.float32)[unpacked.long()].view(b, m * n // 16, 16)
    return (values * torch.exp2(scale_factors.float() - 127).unsqueeze(-1)).view(b, m, n).to(x.dtype)


def test_fp4_e2m1_equals_sglangs_write_and_read_bit_for_bit():
    """Random fp16 K/V at several magnitudes (blocks whose max sits just past a power of two included), two KV heads
    of 64 channels: kvcal's values are SGLang's round trip, element for element."""
    generator = torch.Generator().manual_seed(7)
    x = torch.cat([torch.randn(64, 128, generator=generator) * scale for scale in (0.02, 1.0, 37.0)])
    x[:, ::16] = 6.0 * 2.0 ** torch.randint(-6, 6, (x.shape[0], 8), generator=generator) * 1.001
    x = x.half()
    got = BlockFp4(64).quantize(x.float())
    assert torch.equal(got.values, sglang_round_trip(x.view(-1, 2, 64)).view_as(x).float())


def test_fp4_e2m1_rounds_ties_up_and_saturates_at_six_times_the_block_scale():
    """A block whose max is 6 has scale 2^0: 0.25 -> 0.5, 0.75 -> 1, 2.5 -> 3, 5 -> 6, -0.25 -> -0.5, 0.24 -> 0; a
    block whose max is 6.5 takes scale 2^1 (6.5 / 2 = 3.25 -> 3 and 2.6 / 2 = 1.3 -> 1.5: 6 and 3); an all-zero block
    decodes to zeros."""
    block = [6.0, 0.25, 0.75, 2.5, 5.0, -0.25, 0.24, 1.3, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    x = torch.tensor([block + [6.5, 2.6] + [0.0] * 14 + [0.0] * 16 + [1.0] * 16])
    got = BlockFp4(64).quantize(x).values[0]
    assert got[:8].tolist() == [6.0, 0.5, 1.0, 3.0, 6.0, -0.5, 0.0, 1.5]
    assert got[16:18].tolist() == [6.0, 3.0] and not got[32:48].any()


def test_fp4_e2m1_stores_four_bits_a_code_and_a_byte_per_sixteen_channels():
    """eval ppl on the tiny Llama (head_dim 16) counts 4 + 8 / 16 bits; a head of 24 channels is refused."""
    model = tiny_model("llama")
    windows = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(0))
    method = baseline_method("fp4_e2m1", [16] * 2)
    fp, result = evaluate_ppl(model, adapt(model), windows, [method])
    assert result.effective_bits == 4.5 and result.ppl != fp.ppl
    assert BlockFp4(64).row_bits(128) == 4 * 128 + 8 * 8
    assert baseline_method("fp4_mx_block16", [16] * 2).layers == method.layers  # SGLang's later name of the same recipe
    with pytest.raises(KvcalError, match="head_dim 24 is not a multiple of"):
        baseline_method("fp4_e2m1", [24] * 2)
