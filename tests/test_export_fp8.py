"""vLLM's FP8 KV-cache quantizer: bit for bit what compressed-tensors stores and reads back."""

from __future__ import annotations

import pytest
import torch

from kvcal.errors import KvcalError
from kvcal.export.compressed_tensors import kv_cache_scheme
from kvcal.export.fp8 import Fp8KvScales, fp8_fake_quantize


def test_fake_quantize_matches_compressed_tensors():
    """fp8_fake_quantize is compressed-tensors' own FP8 quantize-dequantize, per tensor and per KV head."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    torch.manual_seed(0)
    tokens, heads, head_dim = 37, 3, 16
    x = torch.randn(tokens, heads * head_dim) * torch.tensor([0.5, 3.0, 20.0]).repeat_interleave(head_dim)
    x[5, 3] = 1e4  # saturates
    for strategy, scale in (("tensor", torch.tensor([0.02])), ("attn_head", torch.tensor([0.001, 0.01, 0.05]))):
        args = QuantizationArgs.model_validate(kv_cache_scheme(strategy))
        per_head = x.view(tokens, heads, head_dim).transpose(0, 1)[None]  # (batch, heads, tokens, head_dim)
        shaped = scale.view(-1, 1, 1) if strategy == "attn_head" else scale
        expected = fake_quantize(per_head, shaped, torch.zeros_like(shaped), args)[0].transpose(0, 1).reshape(tokens, -1)
        assert torch.equal(fp8_fake_quantize(x, scale), expected)
        assert torch.equal(fp8_fake_quantize(x, shaped), expected)  # the exported [heads, 1, 1] shape works too


def test_fake_quantize_semantics():
    x = torch.tensor([[1.0, -3.0, 1000.0, 0.0], [0.3, 2.0, -1000.0, 5.0]])
    out = fp8_fake_quantize(x, 1.0)
    assert out[0, 2] == 448 and out[1, 2] == -448  # saturates at +-448 x scale
    assert out[0, 0] == 1 and out[0, 1] == -3 and out[0, 3] == 0
    assert fp8_fake_quantize(x, 4.0)[0, 2] == 1024  # 1000 / 4 = 250 rounds to the e4m3 value 256 (step 16 there)
    halves = fp8_fake_quantize(x, torch.tensor([1.0, 4.0]))  # head 0 = channels 0-1, head 1 = channels 2-3
    assert torch.equal(halves[:, :2], fp8_fake_quantize(x[:, :2], 1.0)) and torch.equal(halves[:, 2:], fp8_fake_quantize(x[:, 2:], 4.0))
    for bad in (torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.0]), torch.tensor([float("nan")])):
        with pytest.raises(KvcalError):
            fp8_fake_quantize(x, bad)
    unit = Fp8KvScales.unit(2)
    assert torch.equal(unit.keys(1, x), out) and torch.equal(unit.values(0, x), out)
