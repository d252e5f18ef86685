"""The compressed-tensors description of an FP8 KV cache with static scales, as vLLM and LLM-Compressor read it:
the `quantization_config` of config.json and the `k_scale` / `v_scale` checkpoint tensors (field names and shapes
cited in kvcal.export.vllm)."""

from __future__ import annotations

import torch

from kvcal.export.scales import ScaleFit, check_strategy

SCALE_NAMES = ("k_scale", "v_scale")


def kv_cache_scheme(strategy: str) -> dict:
    """compressed-tensors QuantizationArgs of an FP8 e4m3 KV cache with static symmetric scales."""
    check_strategy(strategy)
    return {"num_bits": 8, "type": "float", "strategy": strategy, "dynamic": False, "symmetric": True, "group_size": None}


def quantization_config(strategy: str) -> dict:
    """`quantization_config` of config.json: a compressed-tensors config that quantizes only the KV cache
    (no config groups, dense weights), as LLM-Compressor writes for a KV-cache-only recipe."""
    return {
        "quant_method": "compressed-tensors",
        "format": "dense",
        "quantization_status": "frozen",
        "config_groups": {},
        "ignore": [],
        "global_compression_ratio": None,
        "kv_cache_scheme": kv_cache_scheme(strategy),
    }


def scale_tensors(fit: ScaleFit, attention_names: list[str]) -> dict[str, torch.Tensor]:
    """The checkpoint tensors vLLM loads: `{attention}.k_scale` / `.v_scale`, float32, shape [1] (tensor)
    or [num_kv_heads, 1, 1] (attn_head)."""
    tensors = {}
    for name, layer in zip(attention_names, fit.layers, strict=True):
        for suffix, scale in zip(SCALE_NAMES, (layer.k, layer.v)):
            scale = scale.float().reshape(1) if fit.strategy == "tensor" else scale.float().reshape(-1, 1, 1)
            tensors[f"{name}.{suffix}"] = scale.contiguous()
    return tensors
