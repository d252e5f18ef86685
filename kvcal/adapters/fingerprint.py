"""What an artifact's record of its model says without the model: per layer its heads, widths and channel order
(the fingerprint, which ModelAdapter.fingerprint writes), what its decoder holds besides KV caches, and the score scale,
soft-cap and sinks its model config records for the fits."""

from __future__ import annotations

import torch

from kvcal.adapters.model_types import (CROSS_ATTENDING_TYPES, INDEXER_KEYS_FP32, KV_SHARING_TYPES,
                                        POSITIONS_FROM_ONE, STATE_BESIDE_ATTENTION_TYPES)


def query_heads(fingerprint: dict) -> list[int]:
    """Per layer of an artifact's model, its query heads: the fingerprint's layer_num_heads where its layers differ
    (Laguna), its one num_heads else."""
    return fingerprint.get("layer_num_heads", [fingerprint["num_heads"]] * fingerprint["num_layers"])


def rope_orders(fingerprint: dict) -> list[tuple[int, ...] | None]:
    """Per layer of an artifact's model, the model's channel at each of kvcal's in each head of its keys and queries
    (kvcal.rope; None: the same): the fingerprint's layer_rope_orders where its layers differ (Laguna's rotate their
    own share of channels), its one rope_order else."""
    if "layer_rope_orders" in fingerprint:
        return [tuple(order) if order is not None else None for order in fingerprint["layer_rope_orders"]]
    order = fingerprint.get("rope_order")
    return [tuple(order) if order is not None else None] * fingerprint["num_layers"]


def kv_shapes(fingerprint: dict, kind: str = "k") -> list[tuple[int, int]]:
    """Per layer of an artifact's model, (KV heads, channels of each head's keys (kind "k") or values ("v")): the
    fingerprint's per-layer lists where its layers differ (Gemma 4), its one num_kv_heads and head_dim else; values
    layer_value_dims wide where the fingerprint has them (values narrower than keys: MiMo-V2-Flash's; MLA latents of
    widths that differ by layer: dots.note3's), else MLA's its latent, value_dim wide."""
    layers = fingerprint["num_layers"]
    kv_heads = fingerprint.get("layer_kv_heads", [fingerprint["num_kv_heads"]] * layers)
    head_dims = fingerprint.get("layer_head_dims", [fingerprint["head_dim"]] * layers)
    if kind == "v" and "layer_value_dims" in fingerprint:
        head_dims = fingerprint["layer_value_dims"]
    elif kind == "v" and latent_attention(fingerprint):
        head_dims = [fingerprint["value_dim"]] * layers
    return list(zip(kv_heads, head_dims))


def first_position(fingerprint: dict) -> int:
    """The RoPE position of a sequence's first token in an artifact's model (POSITIONS_FROM_ONE: 1; others 0)."""
    return 1 if fingerprint["model_type"] in POSITIONS_FROM_ONE else 0


def decoder_kind(fingerprint: dict) -> str:
    """What an artifact's model's decoder holds besides its layers' KV caches, as engines tell models apart (vLLM's
    TurboQuant boundary layers): "dense" (nothing), "recurrent" (a Mamba, DeltaNet or convolution state: hybrids,
    Falcon-H1), "shared" (layers reading another's cache: Gemma 3n, Gemma 4 E2B / E4B) or "cross" (layers attending
    across to an image, their cache transformers' to keep: Mllama)."""
    if "attention_layers" in fingerprint and fingerprint["model_type"] in KV_SHARING_TYPES:
        return "shared"
    if fingerprint["model_type"] in CROSS_ATTENDING_TYPES:
        return "cross"
    if "attention_layers" in fingerprint or fingerprint["model_type"] in STATE_BESIDE_ATTENTION_TYPES:
        return "recurrent"
    return "dense"


def latent_attention(fingerprint: dict) -> bool:
    """Whether an artifact's model's attention is MLA (LatentAttention): its fingerprint gives its latent's width."""
    return "value_dim" in fingerprint


def kv_widths(fingerprint: dict, kind: str = "k") -> list[int]:
    """Per layer of an artifact's model, the channels of one token's keys (kind "k") or values ("v")."""
    return [kv_heads * head_dim for kv_heads, head_dim in kv_shapes(fingerprint, kind)]


def index_key_bytes(model_type: str, model_bytes: int) -> int:
    """Bytes of one channel of the indexer keys a model of `model_type` whose dtype takes `model_bytes` hands its cache:
    fp32's where its indexers compute them so (INDEXER_KEYS_FP32), else its dtype's."""
    return 4 if model_type in INDEXER_KEYS_FP32 else model_bytes


def index_widths(fingerprint: dict) -> list[int]:
    """Per layer of an artifact's model, the channels of one token's indexer key (DeepSeek Sparse Attention's; 0: none)."""
    return fingerprint.get("layer_index_dims", [0] * fingerprint["num_layers"])


def attention_sinks(model_config: dict, layer: int) -> torch.Tensor | None:
    """Layer `layer`'s attention sinks' logits (heads,) from an artifact's `model` config (profiles record them for the
    fits' attention outputs), None for a model without sinks."""
    sinks = model_config.get("attention_sinks")
    return torch.tensor(sinks[layer], dtype=torch.float32) if sinks is not None else None


def attention_softcap(model_config: dict) -> float | None:
    """The profiled model's score soft-cap (Gemma 2's attn_logit_softcapping), from an artifact's `model` config, or
    None for a model that does not cap its scores."""
    return model_config.get("attention_softcap")


def score_scale(model_config: dict) -> float:
    """The profiled model's attention score scale, from an artifact's `model` config. Artifacts written before it was
    recorded came from models that kvcal only accepted when they scaled by head_dim ** -0.5."""
    if "score_scale" in model_config:
        return float(model_config["score_scale"])
    return float(model_config["fingerprint"]["head_dim"] ** -0.5)
