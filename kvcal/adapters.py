"""Architecture adapter: finds, per decoder layer, the projections kvcal hooks, by structure.

Llama, Mistral, Qwen2 (k/v bias) and Qwen3 (q/k RMSNorm before RoPE) are all "q/k/v/o projections +
RoPE"; nothing here forks a modeling file. The pre-RoPE key is the tensor RoPE consumes: the
k_norm output where the model has one, else the k_proj output.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch
from torch import nn

from kvcal.errors import KvcalError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_ATTENTION_NAMES = ("self_attn", "attention", "attn")
# Keys of config.to_dict() that change with how a model was saved or loaded, not with what it computes
# (`architectures` is filled in by save_pretrained; the class name is in the fingerprint already).
_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache", "architectures"}


@dataclass
class LayerHandles:
    index: int
    attention: nn.Module
    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    q_norm: nn.Module | None
    k_norm: nn.Module | None

    @property
    def query_source(self) -> nn.Module:
        """The module whose output is the pre-RoPE query."""
        return self.q_norm if self.q_norm is not None else self.q_proj

    @property
    def key_source(self) -> nn.Module:
        """The module whose output is the pre-RoPE key."""
        return self.k_norm if self.k_norm is not None else self.k_proj


@dataclass
class ModelAdapter:
    architecture: str
    model_type: str
    layers: list[LayerHandles]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    rotary: nn.Module
    config_dict: dict

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def inv_freq(self) -> torch.Tensor:
        return self.rotary.inv_freq.detach().float().cpu()

    @property
    def rope_attention_scaling(self) -> float:
        return float(getattr(self.rotary, "attention_scaling", 1.0))

    def check_seqlen(self, seqlen: int) -> None:
        if self.max_positions and seqlen > self.max_positions:
            raise KvcalError(f"--seqlen {seqlen} is above the model's maximum of {self.max_positions} positions")

    def fingerprint(self) -> dict:
        """What an artifact records to refuse being used with another model."""
        canonical = {k: v for k, v in self.config_dict.items() if k not in _VOLATILE_CONFIG_KEYS}
        digest = hashlib.sha256(json.dumps(canonical, sort_keys=True, default=str).encode()).hexdigest()
        rope = self.config_dict.get("rope_parameters") or {
            "rope_theta": self.config_dict.get("rope_theta"),
            "rope_scaling": self.config_dict.get("rope_scaling"),
        }
        return {
            "architecture": self.architecture,
            "model_type": self.model_type,
            "num_layers": len(self.layers),
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_positions": self.max_positions,
            "rope": rope,
            "config_sha256": digest[:16],
        }


def _find_decoder_layers(model: nn.Module, num_layers: int) -> nn.ModuleList:
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == num_layers:
            return module
    raise KvcalError(f"{type(model).__name__}: could not find a list of {num_layers} decoder layers")


def _find_attention(layer: nn.Module, index: int, where: str) -> nn.Module:
    for name in _ATTENTION_NAMES:
        attention = getattr(layer, name, None)
        if attention is not None:
            return attention
    children = ", ".join(name for name, _ in layer.named_children())
    raise KvcalError(f"{where}: decoder layer {index} has no attention module ({'/'.join(_ATTENTION_NAMES)}); found {children}")


def _layer_handles(layer: nn.Module, index: int, where: str) -> LayerHandles:
    attention = _find_attention(layer, index, where)
    projections = {}
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        module = getattr(attention, name, None)
        if not isinstance(module, nn.Linear):
            children = ", ".join(n for n, _ in attention.named_children())
            raise KvcalError(
                f"{where}: could not find a separate {name} linear layer in the attention of decoder layer "
                f"{index} (found: {children}); kvcal supports {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        projections[name] = module
    return LayerHandles(
        index=index,
        attention=attention,
        q_proj=projections["q_proj"],
        k_proj=projections["k_proj"],
        v_proj=projections["v_proj"],
        q_norm=getattr(attention, "q_norm", None),
        k_norm=getattr(attention, "k_norm", None),
    )


def _find_rotary(model: nn.Module, where: str) -> nn.Module:
    for module in model.modules():
        if isinstance(getattr(module, "inv_freq", None), torch.Tensor):
            return module
    raise KvcalError(f"{where}: could not find a rotary position embedding (a module with inv_freq)")


def adapt(model: nn.Module) -> ModelAdapter:
    """Build the adapter for a loaded causal LM, or refuse it naming what is missing."""
    config = model.config
    model_type = getattr(config, "model_type", "?")
    where = f"unsupported architecture {type(model).__name__} (model_type '{model_type}')"
    num_layers = getattr(config, "num_hidden_layers", None)
    if num_layers is None:
        raise KvcalError(f"{where}: its config has no num_hidden_layers")
    layers = _find_decoder_layers(model, num_layers)
    handles = [_layer_handles(layer, i, where) for i, layer in enumerate(layers)]
    rotary = _find_rotary(model, where)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise KvcalError(f"{where}: kvcal supports {', '.join(SUPPORTED_MODEL_TYPES)}")
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    k_out = handles[0].k_proj.out_features
    if k_out != num_kv_heads * head_dim:
        raise KvcalError(f"{where}: k_proj has {k_out} outputs, expected {num_kv_heads} KV heads x head_dim {head_dim}")
    return ModelAdapter(
        architecture=type(model).__name__,
        model_type=model_type,
        layers=handles,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_positions=int(getattr(config, "max_position_embeddings", 0) or 0),
        rotary=rotary,
        config_dict=config.to_dict(),
    )
