"""Simulated KV quantization inside a Hugging Face forward pass, with decode-time semantics.

A quantization method gives, per layer, how keys and values are stored (a LayerScheme) and which
tokens are held quantized at each step (a SegmentPolicy: fp16 sinks, an fp16 recent window, a KIVI
residual). Quantization of a token is fixed once it is stored, so every token is quantized once and
each query position t sees, for every earlier token j, either its stored (dequantized) or its fp16 key
and value, exactly as the cache would hold them when token t is decoded. Pre-RoPE keys are captured
before RoPE, quantized, and rotated with their own positions.

Windows must be unpadded (evaluation windows are); the runtime cache handles padding.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvcal.adapters import ModelAdapter
from kvcal.quantizers import FP16_BITS, Quantized
from kvcal.rope import rotate_keys

ATTENTION_NAME = "kvcal_simulated"


class Codec(Protocol):
    """A quantizer (kvcal.quantizers): encode/decode what is stored, quantize = decode(encode) + its cost."""

    block_tokens: int

    def encode(self, x: torch.Tensor): ...

    def decode(self, encoded) -> torch.Tensor: ...

    def quantize(self, x: torch.Tensor) -> Quantized: ...


@dataclass(frozen=True, eq=True)
class LayerCodecs:
    """How one layer stores keys and values; pre-RoPE keys are rotated after dequantization."""

    key_codec: Codec
    value_codec: Codec
    key_pre_rope: bool


@dataclass(frozen=True)
class SegmentPolicy:
    """Which tokens are stored quantized when n tokens are in the cache.
    sink: the first tokens stay fp16. window: the most recent tokens stay fp16 (SKVQ).
    residual: KIVI, keys are flushed to quantized storage in whole blocks of `residual` tokens, values
    leave a FIFO of `residual` fp16 tokens one at a time."""

    sink: int = 0
    window: int = 0
    residual: int = 0
    key_block: int = 0  # keys quantized per channel over blocks of this many tokens wait in fp16 for a whole block

    def fp16_recent(self, n, keys: bool):
        """How many of the latest tokens are fp16 when n tokens (a tensor or an int) are in the cache."""
        n = torch.as_tensor(n)
        recent = torch.full_like(n, self.window)
        if self.residual:
            recent = torch.maximum(recent, n % self.residual if keys else torch.full_like(n, self.residual))
        if keys and self.key_block:
            recent = torch.maximum(recent, (n - self.sink).clamp(min=0) % self.key_block)
        return recent

    def quantized_masks(self, tokens: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(key, value) boolean masks (query t, token j): token j is read quantized by query t."""
        n = torch.arange(1, tokens + 1, device=device)[:, None]
        j = torch.arange(tokens, device=device)[None, :]
        past_sink = j >= self.sink
        return tuple(past_sink & (j < n - self.fp16_recent(n, keys)) for keys in (True, False))


@dataclass
class Method:
    """A named quantization method: one scheme per layer and a segment policy."""

    name: str
    nominal_bits: float
    layers: list
    policy: SegmentPolicy
    fingerprint: dict | None = None  # of the model it was calibrated for; None for baselines


@dataclass
class StorageTally:
    """Bits stored for the cache at the end of each evaluated window, over all layers."""

    key_bits: float = 0.0
    value_bits: float = 0.0
    elements: int = 0  # per tensor kind (K and V each)
    outliers: int = 0

    @property
    def effective_bits(self) -> float:
        return (self.key_bits + self.value_bits) / (2 * self.elements) if self.elements else float("nan")

    def add(self, quantized: Quantized, stored: torch.Tensor, tensor: str) -> None:
        """Count a (tokens, channels) tensor whose rows in `stored` are quantized, the rest fp16."""
        tokens, channels = quantized.values.shape
        bits = float(quantized.row_bits[stored].sum()) + FP16_BITS * channels * int((~stored).sum()) + quantized.fixed_bits
        if tensor == "k":
            self.key_bits += bits
            self.elements += tokens * channels
        else:
            self.value_bits += bits
        self.outliers += quantized.outliers


@dataclass
class _LayerState:
    scheme: LayerCodecs
    policy: SegmentPolicy
    inv_freq: torch.Tensor
    rope_scaling: float
    tally: StorageTally
    pre_rope_keys: torch.Tensor | None = None
    masks: dict = field(default_factory=dict)

    def masks_for(self, tokens: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        if tokens not in self.masks:
            self.masks[tokens] = self.policy.quantized_masks(tokens, device)
        return self.masks[tokens]

    def attend(self, query, key, value, scaling: float) -> torch.Tensor:
        batch, heads, tokens, head_dim = query.shape
        kv_heads = key.shape[1]
        width = kv_heads * head_dim
        key_mask, value_mask = self.masks_for(tokens, query.device)
        positions = torch.arange(tokens, device=query.device)
        outputs = []
        for b in range(batch):
            # The cache holds fp16: what is not quantized is read back as fp16, what is, is quantized from it.
            keys_post = as_cached(key[b].transpose(0, 1).reshape(tokens, width))
            values = as_cached(value[b].transpose(0, 1).reshape(tokens, width))
            if self.scheme.key_pre_rope:
                keys_pre = as_cached(self.pre_rope_keys[b])
                keys_post = rotate_keys(keys_pre, positions, kv_heads, self.inv_freq, self.rope_scaling)
                stored_keys = self.scheme.key_codec.quantize(keys_pre)
                keys_hat = rotate_keys(stored_keys.values, positions, kv_heads, self.inv_freq, self.rope_scaling)
            else:
                stored_keys = self.scheme.key_codec.quantize(keys_post)
                keys_hat = stored_keys.values
            stored_values = self.scheme.value_codec.quantize(values)
            self.tally.add(stored_keys, key_mask[-1], "k")
            self.tally.add(stored_values, value_mask[-1], "v")
            out = mixed_attention(query[b].float(), keys_post, keys_hat, values, stored_values.values,
                                  key_mask, value_mask, scaling)
            outputs.append(out.transpose(0, 1).to(query.dtype))
        return torch.stack(outputs)


def as_cached(x: torch.Tensor) -> torch.Tensor:
    """x as an fp16 KV cache holds it, in float32 for arithmetic."""
    return x.to(torch.float16).float()


def per_query_head(x: torch.Tensor, kv_heads: int, heads: int) -> torch.Tensor:
    """(tokens, kv_heads * head_dim) -> (heads, tokens, head_dim): each KV head repeated for its query heads (GQA)."""
    tokens, width = x.shape
    return x.view(tokens, kv_heads, width // kv_heads).transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)


def mixed_attention(query, keys_fp, keys_hat, values_fp, values_hat, key_mask, value_mask, scaling: float):
    """Causal attention of query (heads, tokens, head_dim) where token j is read from the stored
    (dequantized) keys/values where key_mask/value_mask[t, j] is set and from fp16 elsewhere.
    Keys and values are (tokens, kv_heads * head_dim); GQA shares each KV head across its query heads."""
    heads, tokens, head_dim = query.shape
    kv_heads = keys_fp.shape[1] // head_dim

    def per_head(x):
        return per_query_head(x, kv_heads, heads)

    causal = torch.ones(tokens, tokens, dtype=torch.bool, device=query.device).tril()
    scores = torch.where(key_mask, query @ per_head(keys_hat).transpose(1, 2), query @ per_head(keys_fp).transpose(1, 2)) * scaling
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    return (probs * value_mask) @ per_head(values_hat) + (probs * ~value_mask) @ per_head(values_fp)


def _simulated_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    state: _LayerState = module._kvcal_state
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return state.attend(query, key, value, scale), None


def _register_attention() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, _simulated_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


@contextmanager
def simulated(model: torch.nn.Module, adapter: ModelAdapter, method: Method, tally: StorageTally):
    """Within the block, the model's attention reads K/V as `method` stores them; bits go to `tally`."""
    if len(method.layers) != len(adapter.layers):
        raise ValueError(f"{method.name} has {len(method.layers)} layers, the model {len(adapter.layers)}")
    _register_attention()
    previous = model.config._attn_implementation
    hooks = []
    for handles, scheme in zip(adapter.layers, method.layers):
        state = _LayerState(scheme, method.policy, adapter.inv_freq, adapter.rope_attention_scaling, tally)
        handles.attention._kvcal_state = state
        if scheme.key_pre_rope:
            def keep_keys(module, inputs, output, state=state):
                state.pre_rope_keys = output.detach().flatten(2)
            hooks.append(handles.key_source.register_forward_hook(keep_keys))
    model.config._attn_implementation = ATTENTION_NAME
    try:
        yield tally
    finally:
        model.config._attn_implementation = previous
        for hook in hooks:
            hook.remove()
        for handles in adapter.layers:
            del handles.attention._kvcal_state
