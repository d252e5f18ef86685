"""Simulated KV quantization inside a Hugging Face forward pass, with decode-time semantics.

A quantization method gives, per layer, how keys and values are stored (LayerCodecs) and which
tokens are held quantized at each step (a SegmentPolicy: fp16 sinks, an fp16 recent window, a KIVI
residual). Quantization of a token is fixed once it is stored, so every token is quantized once and
each query position t sees, for every earlier token j, either its stored (dequantized) or its fp16 key
and value, exactly as the cache would hold them when token t is decoded. Pre-RoPE keys are captured
before RoPE, quantized, and rotated with their own positions.

A sliding-window layer (the adapter's `windows`) lets each query see its last `window` tokens, a chunked one (its
`chunks`) its chunk's (kvcal.spans.AttentionSpan), and either stores at the end of an evaluated window only what the
runtime cache keeps (kvcal.kv.window_dropped).

Windows must be unpadded (evaluation windows are); the runtime cache handles padding.

QuantizedOnWrite is the decoding counterpart for an engine's cache type (a baseline whose codecs quantize each
token on its own, keys after RoPE, nothing kept fp16): transformers' own cache for the model with every token
quantized as it is written, so that generate() reads what the engine's cache would hold.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace

import torch
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvcal import wiring
from kvcal.adapters import LatentAttention, ModelAdapter, adapt, index_key_bytes
from kvcal.errors import KvcalError
from kvcal.indexer_keys import round_trip, token_bytes
from kvcal.kv import (SegmentPolicy, as_cached, per_query_head, per_query_head_pick, softcapped, softmax_with_sinks,
                      window_dropped)
from kvcal.model_caches import taking
from kvcal.packing import OUTLIER_BYTES, OUTLIER_TILE_TOKENS, outlier_table_bytes
from kvcal.quantizers import FP16_BITS, LayerCodecs, Quantized
from kvcal.rope import rotate_keys, rows_in_order
from kvcal.spans import AttentionSpan, call_mismatch

ATTENTION_NAME = "kvcal_simulated"


@dataclass
class Method:
    """A named quantization method: one scheme per layer and a segment policy."""

    name: str
    nominal_bits: float
    layers: list
    policy: SegmentPolicy
    fingerprint: dict | None = None  # of the model it was calibrated for; None for baselines
    indexer_keys: str = "model"  # how sparse layers keep their indexer keys (kvcal.indexer_keys.FORMATS)


def engine_dtype_method(name: str, codec, num_layers: int) -> Method:
    """A serving engine's one cache dtype: every layer stores K and V with `codec` as tokens arrive, keys after RoPE,
    nothing kept fp16."""
    return Method(name, codec.bits, [LayerCodecs(codec, codec, key_pre_rope=False)] * num_layers, SegmentPolicy())


@dataclass(frozen=True)
class InModelOrder:
    """A baseline's codec of post-RoPE keys, which kvcal reads in RoPE pair order (kvcal.rope.rotate_half_order), applied
    to them in the model's own channel order, as the engine the baseline stands for stores them: its blocks of
    channels and its rotations mix the channels they mix there."""

    codec: object
    rope_order: tuple[int, ...]  # per head, the model's channel at each of kvcal's
    model_order: tuple[int, ...]  # per head, kvcal's channel at each of the model's: rope_order's inverse

    @property
    def block_tokens(self) -> int:
        return getattr(self.codec, "block_tokens", 1)

    def quantize(self, rows: torch.Tensor) -> Quantized:
        quantized = self.codec.quantize(rows_in_order(rows, self.model_order))
        return replace(quantized, values=rows_in_order(quantized.values, self.rope_order))


def in_model_order(key_codec, rope_order: tuple[int, ...] | None):
    """A baseline's codec of post-RoPE keys applied in the model's channel order (InModelOrder), where kvcal reads them
    in another (rope_order: the adapter's, or an artifact fingerprint's; None: the same order)."""
    if rope_order is None:
        return key_codec
    return InModelOrder(key_codec, tuple(rope_order), tuple(sorted(range(len(rope_order)), key=rope_order.__getitem__)))


def _in_model_order(layer: LayerCodecs, rope_order: tuple[int, ...] | None) -> LayerCodecs:
    if layer.key_pre_rope:
        return layer
    return replace(layer, key_codec=in_model_order(layer.key_codec, rope_order))


@dataclass
class StorageTally:
    """Bits the cache stores at the end of each evaluated window, over all layers, as the runtime stores them
    (whole int32 words of codes in kvcal.packing.layout_for's layout, parameters in their storage dtype, 4-byte
    outliers and their offset table per KV head and tile, fp16 sinks and recent tokens); calibrated per-model
    constants (codebooks, fixed thresholds, permutations) live in the bundle and are not counted, as
    kvcal.runtime.memory does not count them."""

    key_bits: float = 0.0
    value_bits: float = 0.0
    key_elements: int = 0  # stored: a sliding-window layer's kept tokens only
    value_elements: int = 0  # (as many as the keys' but in MLA, whose latent is wider than its key)
    outliers: int = 0
    # sparse layers' indexer keys, which the cache keeps beside K and V (kvcal.indexer_keys)
    index_bits: float = 0.0
    index_elements: int = 0

    @property
    def elements(self) -> int:
        """The K and V elements stored (what outlier fractions are of)."""
        return self.key_elements + self.value_elements

    @property
    def effective_bits(self) -> float:
        """Bits per element of everything the cache stores: K, V and indexer keys."""
        elements = self.elements + self.index_elements
        return (self.key_bits + self.value_bits + self.index_bits) / elements if elements else float("nan")

    def add_index_keys(self, tokens: int, width: int, format_name: str, key_bytes: int) -> None:
        """Count the indexer keys of `tokens` tokens, `width` channels each, kept in format `format_name` by a model
        computing them in `key_bytes` a channel (kvcal.adapters.index_key_bytes)."""
        self.index_bits += tokens * token_bytes(format_name, width, key_bytes) * 8
        self.index_elements += tokens * width

    def add(self, quantized: Quantized, stored: torch.Tensor, tensor: str, kv_heads: int, dropped: int = 0) -> None:
        """Count a (tokens, channels) tensor of `kv_heads` KV heads whose rows in `stored` (the body: a run after the
        sinks) are quantized, the rest fp16, but for its first `dropped` rows, which a sliding-window layer no longer
        holds; a codec that keeps outliers adds their offset table over the quantized rows, and the outliers of a
        dropped row stay counted while its tile holds a kept one (kvcal.runtime.store.PackedRows.drop_front)."""
        tokens, channels = quantized.values.shape
        kept = torch.arange(tokens, device=stored.device) >= dropped
        body_rows = stored.nonzero().flatten()
        sinks = int(body_rows[0]) if len(body_rows) else 0
        first = max(dropped - sinks, 0)  # the first kept body row
        body = int((stored & kept).sum())
        bits = float(quantized.row_bits[stored & kept].sum()) + FP16_BITS * channels * (int(kept.sum()) - body)
        outliers = 0
        if quantized.row_outliers is not None and body:
            tile_start = sinks + first - first % OUTLIER_TILE_TOKENS
            outliers = int(quantized.row_outliers[tile_start:][stored[tile_start:]].sum())
            dead = int(quantized.row_outliers[tile_start : sinks + first].sum())  # dropped rows of the first kept tile
            bits += 8 * (outlier_table_bytes(body, kv_heads, first) + OUTLIER_BYTES * dead)
        if tensor == "k":
            self.key_bits += bits
            self.key_elements += int(kept.sum()) * channels
        else:
            self.value_bits += bits
            self.value_elements += int(kept.sum()) * channels
        self.outliers += outliers


@dataclass
class SimulatedLayer:
    """One layer's simulated cache: its codecs and segment policy, and the storage it tallies."""

    scheme: LayerCodecs
    policy: SegmentPolicy
    frequencies: Callable[[int], torch.Tensor]  # its RoPE's for a forward over so many tokens (ModelAdapter.layer_inv_freq)
    rope_scaling: float
    tally: StorageTally
    span: AttentionSpan | None = None  # the earlier tokens its queries see: its sliding window's or chunk's (None: all)
    sinks: torch.Tensor | None = None  # (heads,) its attention sinks' logits (gpt-oss)
    softcap: float | None = None  # its scores' soft-cap (Gemma 2)
    first_position: int = 0  # the RoPE position of a window's first token (ModelAdapter.first_position)
    pre_rope_keys: torch.Tensor | None = None
    masks: dict = field(default_factory=dict)
    keep_reads: bool = False  # other layers read this one's keys and values (KV sharing): keep what attend read
    reads: list | None = None  # per sequence, the keys and values (fp and as stored) the last attend read
    indexer_keys: str = "model"  # how its indexer's keys are kept (kvcal.indexer_keys.FORMATS), if it has one

    def masks_for(self, tokens: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        if tokens not in self.masks:
            self.masks[tokens] = self.policy.quantized_masks(tokens, device)
        return self.masks[tokens]

    def dropped(self, tokens: int, key_stored: torch.Tensor, value_stored: torch.Tensor) -> int:
        """The first tokens the runtime cache no longer holds after `tokens` (kvcal.kv.window_dropped, K and V alike);
        *_stored: which tokens are in each body."""
        if self.span is None:
            return 0
        sinks = min(self.policy.sink, tokens)
        body_end = min(sinks + int(stored.sum()) for stored in (key_stored, value_stored))
        block = math.lcm(*(getattr(codec, "block_tokens", 1) for codec in (self.scheme.key_codec, self.scheme.value_codec)))
        return window_dropped(tokens, sinks, body_end, block, self.span)

    def attend(self, query, key, value, scaling: float, chosen: torch.Tensor | None = None) -> torch.Tensor:
        """query (batch, heads, tokens, head_dim) over key and value (batch, kv_heads, tokens, channels), the keys
        post-RoPE (and pre_rope_keys), as the cache stores them -> (batch, tokens, heads, value channels); chosen:
        as attend_latent's."""
        batch, heads, tokens, head_dim = query.shape
        kv_heads = key.shape[1]
        width, value_width = kv_heads * head_dim, kv_heads * value.shape[-1]  # (values may be narrower: MiMo-V2-Flash's)
        outputs, reads = [], []
        for b in range(batch):
            # The cache holds fp16: what is not quantized is read back as fp16, what is, is quantized from it.
            read = self._read(b, as_cached(key[b].transpose(0, 1).reshape(tokens, width)),
                              as_cached(value[b].transpose(0, 1).reshape(tokens, value_width)), kv_heads)
            reads += [read] if self.keep_reads else []  # (held past the loop only for readers)
            outputs.append(self._attend_read(query[b], read, scaling, None if chosen is None else chosen[b]))
        self.reads = reads if self.keep_reads else None
        return torch.stack(outputs)

    def attend_latent(self, query, latent_query, latents, latent: LatentAttention, scaling: float,
                      chosen: torch.Tensor | None = None) -> torch.Tensor:
        """MLA's attention (LatentAttention) of query (batch, heads, tokens, rotated channels) and latent_query (batch,
        heads, tokens, latent channels) over its keys (pre_rope_keys, rotated as the cache holds them) and `latents`
        (batch, tokens, latent channels), its values -> (batch, tokens, heads, value_dim); chosen (batch, groups, tokens,
        tokens): the tokens each query attends (an indexer's pick, kvcal.wiring.chosen_columns), None: all it sees."""
        tokens = query.shape[2]
        key_mask, value_mask = self.masks_for(tokens, query.device)
        positions, inv_freq = torch.arange(tokens, device=query.device) + self.first_position, self.frequencies(tokens)
        outputs = []
        for b in range(query.shape[0]):
            keys_post = as_cached(rotate_keys(self.pre_rope_keys[b], positions, 1, inv_freq, self.rope_scaling))
            read = self._read(b, keys_post, as_cached(latents[b]), 1)
            out = mixed_attention(query[b].float(), *read, key_mask, value_mask, scaling, self.span, self.sinks,
                                  self.softcap, latent_query[b], None if chosen is None else chosen[b])
            outputs.append(latent.head_outputs(out).transpose(0, 1))
        return torch.stack(outputs).to(query.dtype)

    def _read(self, b: int, keys_post, values, kv_heads: int) -> tuple:
        """Sequence b's keys (post-RoPE rows, as the cache holds them) and values as its attention reads them, fp and as
        stored: (keys_post, keys_hat, values, values_hat); their bits go to the tally."""
        tokens = keys_post.shape[0]
        key_mask, value_mask = self.masks_for(tokens, keys_post.device)
        if self.scheme.key_pre_rope:
            positions = torch.arange(tokens, device=keys_post.device) + self.first_position
            inv_freq = self.frequencies(tokens)
            keys_pre = as_cached(self.pre_rope_keys[b])
            keys_post = rotate_keys(keys_pre, positions, kv_heads, inv_freq, self.rope_scaling)
            stored_keys = self.scheme.key_codec.quantize(keys_pre)
            keys_hat = rotate_keys(stored_keys.values, positions, kv_heads, inv_freq, self.rope_scaling)
        else:
            stored_keys = self.scheme.key_codec.quantize(keys_post)
            keys_hat = stored_keys.values
        stored_values = self.scheme.value_codec.quantize(values)
        dropped = self.dropped(tokens, key_mask[-1], value_mask[-1])
        self.tally.add(stored_keys, key_mask[-1], "k", kv_heads, dropped)
        self.tally.add(stored_values, value_mask[-1], "v", kv_heads, dropped)
        return keys_post, keys_hat, values, stored_values.values

    def attend_as_reader(self, query, scaling: float) -> torch.Tensor:
        """The attention of a layer reading this one's keys and values (KV sharing) over what its last attend read."""
        if self.reads is None or len(self.reads) != query.shape[0]:
            raise KvcalError("a layer reading another's keys and values attended before that layer in this forward")
        return torch.stack([self._attend_read(query[b], read, scaling) for b, read in enumerate(self.reads)])

    def _attend_read(self, query, read, scaling: float, chosen: torch.Tensor | None = None) -> torch.Tensor:
        """One sequence's query (heads, tokens, head_dim) over what attend read -> (tokens, heads, head_dim); chosen:
        mixed_attention's."""
        key_mask, value_mask = self.masks_for(query.shape[1], query.device)
        out = mixed_attention(query.float(), *read, key_mask, value_mask, scaling, self.span, self.sinks, self.softcap,
                              chosen=chosen)
        return out.transpose(0, 1).to(query.dtype)


def mixed_attention(query, keys_fp, keys_hat, values_fp, values_hat, key_mask, value_mask, scaling: float,
                    span: AttentionSpan | None = None, sinks: torch.Tensor | None = None, softcap: float | None = None,
                    latent_query: torch.Tensor | None = None, chosen: torch.Tensor | None = None):
    """Causal attention of query (heads, tokens, head_dim) where token j is read from the stored
    (dequantized) keys/values where key_mask/value_mask[t, j] is set and from fp16 elsewhere; with a span, query t
    sees only the tokens of its sliding window or chunk (positions from 0); with sinks (heads,), each head's row of
    scores takes its sink logit as one more, which reads no value; with a softcap, scores are capped first
    (kvcal.kv.softcapped). Keys are (tokens, kv_heads * head_dim), values (tokens, kv_heads * value channels); GQA
    shares each KV head across its query heads. With a latent_query (heads, tokens, value channels) the values take
    part in the scores as well, by their dot product with it (MLA: kvcal.adapters.LatentAttention). chosen (groups,
    tokens, tokens): the tokens each query attends among those it sees, per group of query heads (an indexer's pick,
    kvcal.wiring.chosen_columns), None: all."""
    heads, tokens, head_dim = query.shape
    kv_heads = 1 if latent_query is not None else keys_fp.shape[1] // head_dim  # (MLA's key may have no channel)

    def per_head(x):
        return per_query_head(x, kv_heads, heads)

    positions = torch.arange(tokens, device=query.device)
    causal = span.sees(positions, positions) if span is not None else positions[None, :] <= positions[:, None]
    if chosen is not None:
        causal = causal & per_query_head_pick(chosen, heads)
    scores = torch.where(key_mask, query @ per_head(keys_hat).transpose(1, 2), query @ per_head(keys_fp).transpose(1, 2))
    if latent_query is not None:
        scores = scores + torch.where(value_mask, latent_query @ per_head(values_hat).transpose(1, 2),
                                      latent_query @ per_head(values_fp).transpose(1, 2))
    scores = scores * scaling
    probs = softmax_with_sinks(softcapped(scores, softcap).masked_fill(~causal, float("-inf")),
                               None if sinks is None else sinks.view(-1, 1, 1))
    return (probs * value_mask) @ per_head(values_hat) + (probs * ~value_mask) @ per_head(values_fp)


def _simulated_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None, **kwargs):
    slot = wiring.slot(module)
    if slot is None and wiring.left_to_the_model(module):  # (SDPA: a wired model builds SDPA's masks)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    wiring.check_call(module, slot, attention_mask, query.shape[2], kwargs)
    state: SimulatedLayer | None = slot.attached if slot is not None else None
    if state is None:
        raise KvcalError(f"attention implementation '{ATTENTION_NAME}' serves only inside kvcal.simulate.simulated(...)")
    tokens = query.shape[2]
    if key.shape[2] != tokens:
        raise KvcalError(f"the simulation evaluates whole windows in one forward, without a cache holding earlier tokens "
                         f"(got {tokens} queries over {key.shape[2]} keys); call the model with use_cache=False (and, Gemma 4, "
                         "logits_to_keep=0: it runs its layers reading another's cache on the kept logits' tokens alone)")
    mismatch = call_mismatch(sliding_window, state.span)
    if mismatch is not None:
        raise KvcalError(f"layer {slot.index} {mismatch}; kvcal follows the config (transformers' own cache does)")
    if slot.wiring.multimodal and state.scheme.key_pre_rope:
        raise KvcalError(wiring.multimodal_refusal([slot.index]))
    if slot.wiring.adapter.image_blocks and wiring.own_tokens_ahead(
            attention_mask, wiring.real_tokens(attention_mask, query.shape[0], tokens, query.device)) is not None:
        raise KvcalError("the simulation scores text with causal attention, and this step's image tokens attend to each "
                         "other both ways: evaluate without images (kvcal's quantized cache serves them)")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    adapter = slot.wiring.adapter
    if slot.reader:
        return state.attend_as_reader(adapter.in_rope_order(query, slot.index), scale), None
    state.pre_rope_keys = slot.pre_rope_keys
    handles = adapter.layers[slot.index]
    # a sparse layer's: the tokens its indexer picked (from its keys as kept: indexer_keys_kept_as), its indexer keys
    chosen = wiring.step_mask_and_pick(slot, attention_mask, kwargs, tokens)[1]
    state.tally.add_index_keys(query.shape[0] * tokens, adapter.index_widths[slot.index], state.indexer_keys,
                               index_key_bytes(adapter.model_type, query.dtype.itemsize))
    latent = handles.latent
    if latent is not None:
        rotated = query[..., latent.nope_dim:]
        rotated = rotated if latent.rope_in_order else adapter.in_rope_order(rotated, slot.index)
        return state.attend_latent(rotated, latent.latent_query(query[..., :latent.nope_dim]), slot.latents, latent,
                                   scale, chosen), None
    query, key, value = adapter.grouped_heads(slot.index, query, key, value)
    output = state.attend(adapter.in_rope_order(query, slot.index), adapter.in_rope_order(key, slot.index), value, scale,
                          chosen)
    return adapter.tiled_heads(slot.index, output), None


def _register_attention() -> None:
    wiring.register(ATTENTION_NAME, _simulated_attention, "a kvcal simulation (kvcal.simulate.simulated)")


@contextmanager
def simulated(model: torch.nn.Module, adapter: ModelAdapter, method: Method, tally: StorageTally):
    """Within the block, the model's attention reads K/V as `method` stores them; bits go to `tally`. The model
    is wired through kvcal.wiring (refused while a quantized cache or another simulation is open on it) and
    left with its own attention implementation after the block."""
    if len(method.layers) != len(adapter.layers):
        raise ValueError(f"{method.name} has {len(method.layers)} layers, the model {len(adapter.layers)}")
    _register_attention()
    baseline = method.fingerprint is None  # what an engine stores, not fitted to kvcal's channel order
    # each layer's frequencies kept for the last two window lengths: reading them copies from the model's device
    states = [SimulatedLayer(_in_model_order(scheme, adapter.rope_orders[i]) if baseline else scheme, method.policy,
                             functools.lru_cache(maxsize=2)(functools.partial(adapter.layer_inv_freq, i)),
                             adapter.layer_rope_scaling(i), tally, adapter.spans[i], adapter.layers[i].sinks,
                             adapter.softcap, adapter.first_position, keep_reads=bool(adapter.readers_of(i)),
                             indexer_keys=method.indexer_keys)
              for i, scheme in enumerate(method.layers)]
    owner = object()
    wired = wiring.wire(model, adapter, ATTENTION_NAME, owner, exclusive=True, attached=states)
    try:
        with nullcontext() if method.indexer_keys == "model" else indexer_keys_kept_as(adapter, method.indexer_keys):
            yield tally
    finally:
        wiring.unwire(wired, owner)


@contextmanager
def indexer_keys_kept_as(adapter: ModelAdapter, format_name: str):
    """Within the block, the model's indexers read their keys back as a cache keeping them in `format_name` hands them
    back (kvcal.indexer_keys): the cache they are handed (transformers' own) stores each step's keys rounded so, and
    without one (a simulated window, one forward) the window's come back rounded so. Its hooks run before the wiring's
    own on an indexer, which then see the cache as at run time."""
    hooks = [handles.indexer.register_forward_pre_hook(
        lambda module, args, kwargs: wiring.with_cache(module, args, kwargs, lambda cache: _KeptAs(cache, format_name)),
        with_kwargs=True, prepend=True) for handles in adapter.layers if handles.indexer is not None]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


class _KeptAs:
    """A cache as an indexer reads it where its keys are kept in `format_name`: the keys it hands over through
    update_indexer (DeepSeek Sparse Attention's) or its layer's update_index (MiniMax-M3's) are rounded so, then kept by
    `kept` (transformers' own cache, or its layer) or, where there is none, handed back; without one, its layer (itself)
    counts the keys handed back (`keys`: a length, no channels; get_seq_length), as GLM-5 Next's indexer reads it."""

    def __init__(self, kept, format_name: str):
        self.kept, self.format, self.handed = kept, format_name, None

    def __getattr__(self, name):
        return getattr(self.kept, name)

    @property
    def layers(self):
        return defaultdict(lambda: self) if self.kept is None else [_KeptAs(layer, self.format) for layer in self.kept.layers]

    @property
    def keys(self) -> torch.Tensor:
        if self.kept is not None:
            return self.kept.keys
        return self.handed.new_empty(self.handed.shape[0], 1, self.handed.shape[1], 0)

    def get_seq_length(self) -> int:
        return self.kept.get_seq_length() if self.kept is not None else self.handed.shape[1]

    def update_indexer(self, keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
        self.handed = round_trip(self.format, keys)
        return self.handed if self.kept is None else self.kept.update_indexer(self.handed, layer_idx)

    def update_index(self, keys: torch.Tensor) -> torch.Tensor:
        keys = round_trip(self.format, keys)
        return keys if self.kept is None else self.kept.update_index(keys)


class QuantizedOnWrite(DynamicCache):
    """transformers' own cache for `model` (sliding-window layers keep their window) holding every key and value as
    `method` stores it: each token quantized once, when it is written, from its fp16 value. Exact for a method
    that quantizes tokens independently with post-RoPE keys and keeps nothing fp16 (the engines' cache types);
    others are refused."""

    def __init__(self, model: torch.nn.Module, method: Method):
        per_token = all(not layer.key_pre_rope and getattr(codec, "block_tokens", 1) == 1
                        for layer in method.layers for codec in (layer.key_codec, layer.value_codec))
        if not per_token or method.policy != SegmentPolicy():
            raise KvcalError(f"{method.name} keeps tokens fp16, groups tokens or quantizes keys before RoPE; only a cache "
                             "type that quantizes each post-RoPE token on its own is written this way (use its bundle)")
        DynamicCache.__init__(self, config=model.config)  # (by name: kvcal.model_caches.taking)
        adapter = adapt(model)
        attending = adapter.model_layers  # (a hybrid model's other layers keep a state, not keys and values)
        if len(method.layers) != len(attending):
            raise KvcalError(f"{method.name} has {len(method.layers)} layers, the model {len(attending)}")
        self.method = method
        # by layer_idx, the codecs of what transformers' cache holds as keys and as values: MLA's (LatentAttention) are
        # its latent and its rotated key, which the engine stores in the model's channel order
        self.codecs = {}
        for decoder_index, layer, handles in zip(attending, method.layers, adapter.layers):
            latent = handles.latent
            if latent is not None and latent.rope_in_order:
                layer = _in_model_order(layer, handles.rope_order)
            self.codecs[decoder_index] = ((layer.key_codec, layer.value_codec) if latent is None else
                                          (layer.value_codec, layer.key_codec))
        self.kv_heads = dict(zip(attending, adapter.kv_heads))  # by layer_idx

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        key_codec, value_codec = self.codecs[layer_idx]
        return super().update(_stored(key_codec, key_states), _stored(value_codec, value_states), layer_idx, *args, **kwargs)

    def update_indexer(self, indexer_keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """A sparse layer's indexer keys, kept as the method keeps them (Method.indexer_keys)."""
        return super().update_indexer(round_trip(self.method.indexer_keys, indexer_keys), layer_idx)

    def load(self, context) -> None:
        """Write a context's rows (a kvcal.runtime.fp_context.FpContext: per layer (batch, tokens, width) keys after RoPE
        and values), as its prefill through this cache would; a sliding-window layer quantizes only the tokens it
        keeps (it drops the others as they are written); layers that keep a recurrent state get a copy of the
        context's, sparse layers its indexer keys."""
        context.copy_states_into(self)
        for index, index_keys in zip(self.codecs, context.index_keys or []):
            if index_keys is not None:  # (MiniMax-M3's cache layer keeps one head's, through update_index)
                layer = self.layers[index]
                index_keys = round_trip(self.method.indexer_keys, index_keys)
                if hasattr(layer, "update_index"):
                    layer.update_index(index_keys[:, None])
                else:
                    layer.update_indexer(index_keys)
        for index, keys, values in zip(self.codecs, context.keys, context.values):
            layer, (key_codec, value_codec) = self.layers[index], self.codecs[index]
            # -> (batch, kv_heads, tokens, head_dim)
            heads = lambda rows, kv_heads=self.kv_heads[index]: rows.unflatten(2, (kv_heads, -1)).transpose(1, 2)
            kept = layer.sliding_window - 1 if layer.is_sliding else keys.shape[1]
            written = lambda codec, rows: torch.cat([heads(rows[:, :-kept]), _stored(codec, heads(rows[:, -kept:]))], 2)
            super().update(written(key_codec, keys), written(value_codec, values), index)


def quantized_on_write(model: torch.nn.Module, method: Method) -> QuantizedOnWrite:
    """A QuantizedOnWrite of `method` that `model`'s decoder takes (kvcal.model_caches.taking)."""
    return taking(QuantizedOnWrite, model.config.model_type)(model, method)


def _stored(codec, states: torch.Tensor) -> torch.Tensor:
    """(batch, kv_heads, tokens, head_dim) states as `codec` stores them, each token from its fp16 value."""
    batch, kv_heads, tokens, head_dim = states.shape
    rows = as_cached(states.transpose(1, 2).reshape(batch * tokens, kv_heads * head_dim))
    return codec.quantize(rows).values.view(batch, tokens, kv_heads, head_dim).transpose(1, 2).to(states.dtype)
