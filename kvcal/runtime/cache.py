"""The quantized KV cache for Hugging Face models: `model.generate(..., past_key_values=cache)`.

`QuantizedCache(model, bundle)` builds one store per layer for K and one for V from the bundle's recipe
(kvcal.runtime.segments) and wires the model: an attention implementation that appends to the stores
and attends over them (kvcal.runtime.reference), a hook that hands pre-RoPE keys to the cache (the model
only passes rotated keys to its cache), and a hook that records each token's RoPE position. `close()` (or
leaving `with`) unwires the model. Storage is allocated at the first forward, when the batch is known.

Semantics (the same as the simulation of `kvcal eval ppl`, which a test checks logit by logit):
- the cache holds fp16; padding (from the attention mask) is never stored, each sequence has its own length;
- a one-token step (decode) appends its token first, then attends over the cache as stored;
- a multi-token step (prefill) attends over what was cached before it plus its own tokens in fp16
  (causal), then appends them, quantizing what leaves the fp16 segments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvcal.adapters import ModelAdapter, adapt
from kvcal.rope import rotate_keys
from kvcal.runtime import reference
from kvcal.simulate import as_cached

ATTENTION_NAME = "kvcal_runtime"


class RuntimeLayer(CacheLayerMixin):
    """One model layer's cache: K and V stores, made by `make_store(kind, batch, width, device)`."""

    def __init__(self, make_store, pre_rope: bool, adapter: ModelAdapter):
        super().__init__()
        self.make_store, self.pre_rope = make_store, pre_rope
        self.inv_freq, self.rope_scaling = adapter.inv_freq, adapter.rope_attention_scaling
        self.keys_store = self.values_store = None
        self.position_offset: list[int | None] = []
        self.padded_length = 0  # tokens fed, padding included: what transformers counts
        self.pending_pre_rope: torch.Tensor | None = None
        self.pending_positions: torch.Tensor | None = None
        self.use_kernels: bool | None = None  # CUDA decode kernels, decided at the first decode step

    # transformers' cache-layer interface: the attention implementation does the appending
    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.padded_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.padded_length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def _allocate(self, batch: int, width: int, device) -> None:
        self.keys_store = self.make_store("k", batch, width, device)
        self.values_store = self.make_store("v", batch, width, device)
        self.position_offset = [None] * batch
        self.inv_freq = self.inv_freq.to(device)

    def _rotated(self, keys: torch.Tensor, positions: torch.Tensor, kv_heads: int) -> torch.Tensor:
        return rotate_keys(keys, positions, kv_heads, self.inv_freq, self.rope_scaling) if self.pre_rope else keys

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor, scaling: float):
        """query (B, H, m, d), key/value (B, kv_heads, m, d) of the new tokens (keys post-RoPE), valid (B, m)."""
        batch, heads, m, head_dim = query.shape
        kv_heads = key.shape[1]
        width = kv_heads * head_dim
        if self.keys_store is None:
            self._allocate(batch, width, query.device)
        new_keys = self.pending_pre_rope if self.pre_rope else key.transpose(1, 2).reshape(batch, m, width)
        new_values = value.transpose(1, 2).reshape(batch, m, width)
        if m == 1 and self._kernel_decode(heads, kv_heads, head_dim):
            return self._decode_with_kernels(query, new_keys, new_values, valid, scaling, kv_heads)
        output = torch.zeros(batch, m, heads, head_dim, dtype=query.dtype, device=query.device)
        for b in range(batch):
            rows = torch.nonzero(valid[b]).flatten()
            if not len(rows):
                continue
            self._note_position(b, batch, m, int(rows[0]))
            keys_b, values_b = as_cached(new_keys[b, rows]).half(), as_cached(new_values[b, rows]).half()
            if len(rows) == 1:  # decode: append, then read the cache as stored
                self._append(b, keys_b, values_b)
                keys, values = self._read(b, kv_heads)
            else:  # prefill: the cache so far plus the step's own tokens in fp16, then append
                before_keys, before_values = self._read(b, kv_heads)
                count = self.keys_store.count(b)
                own_positions = torch.arange(count, count + len(rows), device=query.device) + self.position_offset[b]
                keys = torch.cat([before_keys, self._rotated(keys_b.float(), own_positions, kv_heads)])
                values = torch.cat([before_values, values_b.float()])
                self._append(b, keys_b, values_b)
            out = reference.attention(query[b, :, rows], keys, values, scaling)
            output[b, rows] = out.transpose(0, 1).to(query.dtype)
        self.padded_length += m
        return output

    def load(self, keys: torch.Tensor, pre_rope_keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store a context computed elsewhere, rows (batch, tokens, width) unpadded at positions 0.., as if it
        had been prefilled into this cache (keys post-RoPE, pre_rope_keys before RoPE)."""
        batch, tokens, width = values.shape
        self._allocate(batch, width, values.device)
        self.position_offset = [0] * batch
        stored_keys = pre_rope_keys if self.pre_rope else keys
        for b in range(batch):
            self._append(b, as_cached(stored_keys[b]).half(), as_cached(values[b]).half())
        self.padded_length = tokens

    def _note_position(self, b: int, batch: int, m: int, column: int) -> None:
        """Record the RoPE position of sequence b's first stored token: this step's position id at `column`."""
        if self.position_offset[b] is None:
            self.position_offset[b] = int(self.pending_positions.expand(batch, m)[b, column]) if self.pending_positions is not None else 0

    def _kernel_decode(self, heads: int, kv_heads: int, head_dim: int) -> bool:
        """Whether this layer's decode steps run the CUDA kernels (decided once)."""
        if self.use_kernels is None:
            from kvcal.runtime import kernels

            pairs = zip(self.keys_store.packed_codecs(), self.values_store.packed_codecs())
            self.use_kernels = kernels.cuda_ready(self.inv_freq.device) and all(
                kernels.decode_supported(k, v, heads, kv_heads, head_dim) for k, v in pairs)
        return self.use_kernels

    def _decode_with_kernels(self, query, new_keys, new_values, valid, scaling: float, kv_heads: int):
        """One token per sequence: append it, then one fused attention over every sequence's cache."""
        from kvcal.runtime import kernels

        batch = query.shape[0]
        for b in torch.nonzero(valid[:, 0]).flatten().tolist():
            self._note_position(b, batch, 1, 0)
            self._append(b, as_cached(new_keys[b]).half(), as_cached(new_values[b]).half())
        launches = [kernels.Segments(k, v) for k, v in zip(self.keys_store.kernel_segments(), self.values_store.kernel_segments())]
        out = kernels.decode_attention(query[:, :, 0], launches, kv_heads, scaling, [o or 0 for o in self.position_offset],
                                       self.inv_freq if self.pre_rope else None, self.rope_scaling)
        out = out * valid[:, :1, None].to(out.dtype)  # a sequence with no token this step gets zeros, as in the reference
        self.padded_length += 1
        return out[:, None].to(query.dtype)

    def _append(self, b: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys_store.append(b, keys)
        self.values_store.append(b, values)

    def _read(self, b: int, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys = reference.stored_keys(self.keys_store, b, self.pre_rope, self.position_offset[b], self.inv_freq,
                                     self.rope_scaling, kv_heads)
        return keys, self.values_store.read(b)


def _valid_tokens(attention_mask, batch: int, m: int, device) -> torch.Tensor:
    """(batch, m): which new tokens are real (not padding): those a query may attend to itself."""
    if attention_mask is None:
        return torch.ones(batch, m, dtype=torch.bool, device=device)
    mask = attention_mask[:, 0] if attention_mask.dim() == 4 else attention_mask
    diagonal = mask[:, torch.arange(m), mask.shape[-1] - m + torch.arange(m)]
    return (diagonal if diagonal.dtype == torch.bool else diagonal == 0).expand(batch, m)


def _runtime_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    layer: RuntimeLayer | None = getattr(module, "_kvcal_layer", None)
    if layer is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    valid = _valid_tokens(attention_mask, query.shape[0], query.shape[2], query.device)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return layer.attend(query, key, value, valid, scale), None


def _register_attention() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, _runtime_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


class WiredCache(Cache):
    """A Cache of RuntimeLayers that wires the model while open."""

    def __init__(self, model, adapter: ModelAdapter, layers: list[RuntimeLayer]):
        super().__init__(layers=layers)
        self.model, self.adapter = model, adapter
        self._hooks = []
        self._previous_attention = model.config._attn_implementation
        _register_attention()
        for handles, layer in zip(adapter.layers, layers):
            handles.attention._kvcal_layer = layer
            if layer.pre_rope:
                def keep_keys(module, inputs, output, layer=layer):
                    layer.pending_pre_rope = output.detach().flatten(2)
                self._hooks.append(handles.key_source.register_forward_hook(keep_keys))

        def keep_positions(module, args, kwargs):
            position_ids = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
            for layer in layers:
                layer.pending_positions = position_ids
        self._hooks.append(adapter.rotary.register_forward_pre_hook(keep_positions, with_kwargs=True))
        model.config._attn_implementation = ATTENTION_NAME

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for handles in self.adapter.layers:
            if getattr(handles.attention, "_kvcal_layer", None) in self.layers:
                del handles.attention._kvcal_layer
        self.model.config._attn_implementation = self._previous_attention

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def stores(self):
        """(store, sequence) for every allocated K and V store of every layer."""
        for layer in self.layers:
            for store in (layer.keys_store, layer.values_store):
                if store is not None:
                    yield from ((store, b) for b in range(len(layer.position_offset)))

    def used_bytes(self) -> int:
        """Bytes the cache holds now: codes, parameters, outliers, fp16 segments (not capacity)."""
        return sum(store.used_bytes(b) for store, b in self.stores())

    def outliers(self) -> int:
        return sum(store.outliers(b) for store, b in self.stores())

    def load(self, context: FpContext) -> None:
        """Fill the empty cache with a context's keys and values (see FpContext)."""
        for layer, keys, pre_rope_keys, values in zip(self.layers, context.keys, context.pre_rope_keys, context.values):
            layer.load(keys, pre_rope_keys, values)

    def tokens(self) -> list[int]:
        """Tokens stored per sequence."""
        layer = self.layers[0]
        return [layer.keys_store.count(b) for b in range(len(layer.position_offset))] if layer.keys_store else []


@dataclass
class FpContext:
    """The KV cache of a context from one fp prefill, per layer (batch, tokens, width) rows: keys after RoPE,
    keys before RoPE, values; `cache` is the model's own (DynamicCache) copy. Loading it into several
    quantized caches (WiredCache.load) shares one prefill between methods."""

    keys: list[torch.Tensor]
    pre_rope_keys: list[torch.Tensor]
    values: list[torch.Tensor]
    cache: Cache


def fp_context(model, ids: torch.Tensor) -> FpContext:
    """Prefill ids (batch, tokens), unpadded, with the fp model and keep its KV cache."""
    from transformers import DynamicCache

    adapter = adapt(model)
    pre_rope: list[torch.Tensor] = []
    hooks = [handles.key_source.register_forward_hook(lambda module, inputs, output: pre_rope.append(output.detach().flatten(2)))
             for handles in adapter.layers]
    try:
        cache = DynamicCache(config=model.config)
        model(ids, past_key_values=cache, use_cache=True)
    finally:
        for hook in hooks:
            hook.remove()
    rows = lambda x: x.transpose(1, 2).flatten(2)  # (batch, kv_heads, tokens, head_dim) -> (batch, tokens, width)
    return FpContext([rows(layer.keys) for layer in cache.layers], pre_rope, [rows(layer.values) for layer in cache.layers], cache)


def quantized_cache(model, bundle) -> WiredCache:
    """A quantized cache for `model` following `bundle` (a path or a loaded Bundle); refuses a bundle made
    for another model. Use it as `with quantized_cache(model, bundle) as cache: model.generate(...,
    past_key_values=cache)`; the model is wired for the cache until it is closed."""
    from kvcal.bundle import Bundle, layer_codecs, layer_policy, load_bundle
    from kvcal.runtime.segments import SegmentedStore

    adapter = adapt(model)
    if not isinstance(bundle, Bundle):
        bundle = load_bundle(bundle)
    bundle.check_model(adapter)
    layers = []
    for i, recipe in enumerate(bundle.layers):
        codecs, policy = layer_codecs(bundle, i), layer_policy(recipe)

        def make_store(kind, batch, width, device, codecs=codecs, policy=policy, recipe=recipe):
            codec = codecs.key_codec if kind == "k" else codecs.value_codec
            rpc = recipe.rpc_k if kind == "k" else recipe.rpc_v
            return SegmentedStore(codec, policy, kind == "k", rpc, batch, width, device)
        layers.append(RuntimeLayer(make_store, codecs.key_pre_rope, adapter))
    return WiredCache(model, adapter, layers)
