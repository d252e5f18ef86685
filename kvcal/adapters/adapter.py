"""adapt(): a loaded model read into a ModelAdapter, what the rest of kvcal holds of it: per layer of its cache the
handles of its attention (kvcal.adapters.handles), its heads and widths, its RoPE (kvcal.adapters.rotary), its window
or chunk; the decoder layers keeping a state or reading another layer's cache instead; the score scale and soft-cap.
Whatever it cannot read is refused in one line naming what is missing, never guessed."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import GenerationMixin
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from kvcal.adapters.fingerprint import decoder_kind, first_position, index_key_bytes
from kvcal.adapters.handles import (LayerHandles, latent_handles, latent_rope, layer_handles,
                                   pick_key_blocks, pick_tokens_in_mask, take_returned_pick)
from kvcal.adapters.model_types import (ATTENTION_AND_STATE_TYPES, ATTENTION_LAYER_TYPES, ATTENTION_NAMES,
                                        ATTENTION_SUBLAYERS, CROSS_ATTENTION, ENCODERS_INSIDE, FLAT_NORMS_BEFORE_ROPE,
                                        HALVES_SWAPPED_ROPE, HEADS_FIRST_NORMS, IMAGE_BLOCKS, IMAGES_AS_TOKENS,
                                        INDEXED_ATTENTION, INTERLEAVED_ROPE, LATENT_ATTENTION_TYPES, LATENT_DECODERS,
                                        LAYER_TYPE_NAMES, NARROW_VALUES, NOPE_WITHOUT_ROTARY, NORMED_AFTER_ROPE,
                                        NOT_TAKEN_YET, PARITY_SPLIT_ROPE, PICK_IN_MASK, PICK_RETURNED, PREFIX_LM,
                                        ROTARY_PER_BASE, ROTARY_SCALED_BY_LAYER, SCALED_NORMS_AFTER_ROPE, SERVED_FROM,
                                        SERVED_ONES, SHARED_NORM_BEFORE_ROPE, SINKS, SINUSOID_TABLE_ROPE,
                                        SLIDING_KV_HEADS_DOUBLED, STATE_LAYER_TYPES, SUPPORTED_MODEL_TYPES,
                                        served_by_installed_transformers)
from kvcal.adapters.rotary import (LongRope, channel_orders, find_long_rope, find_rotary, rope_free_types,
                                   rotaries_per_base, rotaries_scaled_by_layer, rotary_inv_freq, rotary_layer_types,
                                   rotary_name, rotated_layers)
from kvcal.errors import KvcalError
from kvcal.rope import in_order, padded_inv_freq, parity_merged, rows_in_order, stored_inv_freq, stored_rope_scaling
from kvcal.spans import AttentionSpan, attention_span


@dataclass
class ReaderLayer:
    """A decoder layer that attends over another layer's keys and values, keeping none of its own (KV sharing: Gemma
    3n's last layers read those of the last earlier layer of their type)."""

    decoder_index: int
    attention: nn.Module
    source: int  # the adapter layer (an index into ModelAdapter.layers) whose cache it reads


@dataclass
class ModelAdapter:
    architecture: str
    model_type: str
    layers: list[LayerHandles]
    query_heads: list[int]  # per layer, its query heads (Laguna: more on its sliding-window layers)
    kv_heads: list[int]  # per layer, its KV heads (Gemma 4: fewer on its full-attention layers)
    head_dims: list[int]  # per layer, the channels of each of its heads, query and KV (Gemma 4: twice as many on full ones)
    # per layer, the channels of each of its KV heads' values: head_dims but where the latent is the value (MLA)
    value_dims: list[int]
    max_positions: int
    rotary: nn.Module | None  # None: no layer applies RoPE (NOPE_WITHOUT_ROTARY)
    config_dict: dict
    layer_types: list[str | None]  # per layer, the rotary's name for its frequencies (None: its one `inv_freq`)
    windows: list[int | None]  # per layer, its sliding window (transformers' cache keeps its last window - 1 tokens), or None
    chunks: list[int | None]  # per layer, its attention chunk (Llama 4's chunked layers), or None
    rotated: list[bool]  # per layer, whether it applies RoPE (not SmolLM3's NoPE layers, EXAONE 4's full ones)
    score_scales: list[float]  # per layer, what its attention multiplies q . k by (alike but in dots.note3's MLA)
    softcap: float | None = None  # scaled scores soft-capped to (-softcap, softcap) (Gemma 2), or None
    # the decoder layer of each of `layers` (its layer_idx); a hybrid model's others hold a recurrent state instead
    model_layers: tuple[int, ...] = ()
    num_model_layers: int = 0
    # per layer, whether a recurrent mixer beside its attention keeps a state in the same cache layer (Falcon-H1)
    keeps_state: list[bool] = field(default_factory=list)
    readers: tuple[ReaderLayer, ...] = ()  # the decoder layers reading the cache of one of `layers` (KV sharing)
    images_as_tokens: bool = False  # a composite whose decoder reads image tokens as text (IMAGES_AS_TOKENS)
    image_blocks: bool = False  # a composite whose decoder attends to an image's tokens both ways (IMAGE_BLOCKS)
    encoders_inside: bool = False  # image and audio encoders inside the decoder's module (ENCODERS_INSIDE)
    # per layer, the module holding its frequencies where the model keeps several (ROTARY_PER_BASE: one per RoPE base,
    # None for a layer without RoPE; ROTARY_SCALED_BY_LAYER); empty: `rotary` holds every layer's
    layer_rotaries: tuple[nn.Module | None, ...] = ()
    long_rope: LongRope | None = None  # LongRoPE's long frequencies and where they take over, None for other RoPE
    # the first frequencies the rotary keeps split by parity (kvcal.rope.parity_merged: ERNIE 4.5 VL's height and width
    # sections), 0: none
    parity_split: int = 0
    # decoder layer -> attention module of the layers attending over another sequence (CROSS_ATTENTION), which run the
    # model's own attention over transformers' cache layer
    cross_attention: dict[int, nn.Module] = field(default_factory=dict)

    @property
    def hybrid(self) -> bool:
        """Whether some decoder layers keep no keys and values of their own (a recurrent state, transformers' to keep;
        or another layer's cache, which they read)."""
        return len(self.model_layers) != self.num_model_layers

    @property
    def spans(self) -> list[AttentionSpan | None]:
        """Per layer, the earlier tokens its queries see where not all: its sliding window or attention chunk."""
        return [attention_span(window, chunk) for window, chunk in zip(self.windows, self.chunks)]

    @property
    def prefix_lm(self) -> bool:
        """Whether the decoder attends its prompt both ways, told by token types (PREFIX_LM: PaliGemma)."""
        return self.model_type in PREFIX_LM

    @property
    def score_scale(self) -> float:
        """What the attention multiplies q . k by: every layer's, but in an MLA model whose layers differ (dots.note3's)
        its first layer's, which its fits do not read (they read no MLA scores)."""
        return self.score_scales[0]

    @property
    def first_position(self) -> int:
        """The RoPE position of a sequence's first token (first_position of its fingerprint)."""
        return first_position({"model_type": self.model_type})

    @property
    def decoder_kind(self) -> str:
        """What the decoder holds besides its layers' KV caches (decoder_kind of its fingerprint)."""
        return decoder_kind(self.fingerprint())

    def refuse_latent(self, what: str) -> None:
        """Refuse `what` (Cocktail's cache, an export) for an MLA model, which kvcal calibrates, evaluates in simulation
        and serves in its quantized cache so far."""
        if self.latent:
            raise KvcalError(f"{self.model_type}: kvcal serves its multi-head latent attention (MLA) in calibration, "
                             f"`kvcal eval ppl` and its quantized cache so far; {what} does not take it yet")

    def readers_of(self, layer: int) -> list[ReaderLayer]:
        return [reader for reader in self.readers if reader.source == layer]

    @property
    def kv_widths(self) -> list[int]:
        """Per layer, the channels of one token's keys (and values, but of MLA): its KV heads side by side."""
        return [kv_heads * head_dim for kv_heads, head_dim in zip(self.kv_heads, self.head_dims)]

    @property
    def value_widths(self) -> list[int]:
        """Per layer, the channels of one token's values: its KV heads side by side."""
        return [kv_heads * value_dim for kv_heads, value_dim in zip(self.kv_heads, self.value_dims)]

    @property
    def picks_key_blocks(self) -> bool:
        """Whether a layer attends to the key blocks an indexer picks by cache column (MiniMax-M3's, beside GQA)."""
        return any(handles.sparse and handles.latent is None and not handles.pick_in_mask for handles in self.layers)

    @property
    def index_widths(self) -> list[int]:
        """Per layer, the channels of one token's indexer key (a sparse layer's), 0 where it has no indexer."""
        return [handles.index_width for handles in self.layers]

    def index_bytes(self, dtype: torch.dtype) -> list[int]:
        """Per layer, the bytes of one token's indexer key as a model in `dtype` computes it (index_key_bytes)."""
        return [width * index_key_bytes(self.model_type, dtype.itemsize) for width in self.index_widths]

    @property
    def latent(self) -> bool:
        """Whether the model's attention is multi-head latent attention (LatentAttention), its values the latent."""
        return self.layers[0].latent is not None

    @property
    def rope_orders(self) -> list[tuple[int, ...] | None]:
        """Per layer, the model's channel at each of kvcal's in each head (kvcal.rope); None: the same."""
        return [handles.rope_order for handles in self.layers]

    def in_rope_order(self, heads: torch.Tensor, layer: int) -> torch.Tensor:
        """Layer `layer`'s queries or keys (..., head_dim) of the model in kvcal's channel order
        (kvcal.rope.rotate_half_order)."""
        return in_order(heads, self.layers[layer].rope_order)

    def grouped_heads(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        """(query, key, value) (batch, heads, tokens, head_dim) of layer `layer`'s attention call as kvcal's attention
        reads them, each KV head's query heads together: where the layer's query heads are tiles of its KV heads
        (LayerHandles.query_tiles), its queries regrouped and its keys and values unrepeated."""
        tiles = self.layers[layer].query_tiles
        if tiles == 1:
            return query, key, value
        kv_heads = key.shape[1] // tiles
        grouped = query.unflatten(1, (tiles, kv_heads)).transpose(1, 2).flatten(1, 2)
        return grouped, key[:, :kv_heads], value[:, :kv_heads]

    def tiled_heads(self, layer: int, output: torch.Tensor) -> torch.Tensor:
        """Layer `layer`'s attention output (batch, tokens, heads, head_dim) from kvcal's head order back to the
        model's (grouped_heads' inverse)."""
        tiles = self.layers[layer].query_tiles
        if tiles == 1:
            return output
        return output.unflatten(2, (-1, tiles)).transpose(2, 3).flatten(2, 3)

    def rows_in_rope_order(self, rows: torch.Tensor, layer: int) -> torch.Tensor:
        """Layer `layer`'s queries or keys (..., heads * head_dim), the heads side by side, in kvcal's channel order."""
        return rows_in_order(rows, self.layers[layer].rope_order)

    def layer_inv_freq(self, layer: int, tokens: int = 0) -> torch.Tensor:
        """Layer `layer`'s RoPE frequencies (head_dim/2,) in kvcal's channel order, float32 on the CPU, in a forward
        whose last position is below `tokens`: LongRoPE's long set past its switch, else its short set, which its
        rotary keeps as `original_inv_freq` (its `inv_freq` holds the last forward's)."""
        if not self.rotated[layer]:
            return torch.zeros(self.head_dims[layer] // 2)
        rotary = self._layer_rotary(layer)
        if self.long_rope is None:
            inv_freq = rotary_inv_freq(rotary, self.layer_types[layer])
        else:
            inv_freq = self.long_rope.long_inv_freq if tokens > self.long_rope.switch else rotary.original_inv_freq
        inv_freq = inv_freq.detach().float().cpu()
        if self.parity_split:
            inv_freq = parity_merged(inv_freq, self.parity_split)
        return padded_inv_freq(inv_freq, self.head_dims[layer])

    @property
    def inv_freq(self) -> torch.Tensor:
        """The frequencies of a forward within LongRoPE's switch (of any forward, for other RoPE), as artifacts store
        them: (head_dim/2,) shared by every layer, else (layers, largest head_dim/2) (kvcal.rope.stored_inv_freq)."""
        return stored_inv_freq([self.layer_inv_freq(i) for i in range(len(self.layers))])

    def layer_rope_scaling(self, layer: int) -> float:
        """Layer `layer`'s cos/sin scaling (YaRN's, for one; PhiMoE's mscale; 1 where the layer applies no RoPE)."""
        if not self.rotated[layer]:
            return 1.0
        if self.long_rope is not None and self.long_rope.scaling is not None:
            return self.long_rope.scaling
        return float(getattr(self._layer_rotary(layer), rotary_name(self.layer_types[layer], "attention_scaling"), 1.0))

    def _layer_rotary(self, layer: int) -> nn.Module | None:
        return self.layer_rotaries[layer] if self.layer_rotaries else self.rotary

    @property
    def rope_scaling(self) -> float | list[float]:
        """The cos/sin scaling artifacts record: one number shared by every layer, else one a layer."""
        return stored_rope_scaling([self.layer_rope_scaling(i) for i in range(len(self.layers))])

    def check_seqlen(self, seqlen: int) -> None:
        if self.max_positions and seqlen > self.max_positions:
            raise KvcalError(f"--seqlen {seqlen} is above the model's maximum of {self.max_positions} positions")

    def fingerprint(self) -> dict:
        """What an artifact records to refuse being used with another model."""
        digest = hashlib.sha256(json.dumps(_canonical(self.config_dict), sort_keys=True, default=str).encode()).hexdigest()
        rope = self.config_dict.get("rope_parameters") or {
            "rope_theta": self.config_dict.get("rope_theta"),
            "rope_scaling": self.config_dict.get("rope_scaling"),
        }
        fingerprint = {
            "architecture": self.architecture,
            "model_type": self.model_type,
            "num_layers": len(self.layers),
            "num_heads": self.query_heads[0],
            "num_kv_heads": self.kv_heads[0],
            "head_dim": next((dim for dim in self.head_dims if dim), 0),  # (the first layer's, but an MLA key of none)
            "max_positions": self.max_positions,
            "rope": rope,
            "config_sha256": digest[:16],
        }
        orders = self.rope_orders
        if len(set(orders)) > 1:  # the channel order of each layer's keys and queries an artifact holds (rope_orders)
            fingerprint["layer_rope_orders"] = [list(order) if order is not None else None for order in orders]
        elif orders[0] is not None:  # ... of every layer's
            fingerprint["rope_order"] = list(orders[0])
        if self.hybrid:  # which decoder layers an artifact's layers are
            fingerprint["attention_layers"] = list(self.model_layers)
        if len(set(zip(self.kv_heads, self.head_dims))) > 1:  # each layer's, where they differ (kv_shapes reads either)
            fingerprint.update(layer_kv_heads=list(self.kv_heads), layer_head_dims=list(self.head_dims))
        if len(set(self.query_heads)) > 1:  # ... and query_heads
            fingerprint["layer_num_heads"] = list(self.query_heads)
        if self.latent:  # MLA: its values (the latent) are as wide as no head; each layer's where they differ
            fingerprint["value_dim"] = self.value_dims[0]
        if self.latent and len(set(self.value_dims)) > 1 or not self.latent and self.value_dims != self.head_dims:
            fingerprint["layer_value_dims"] = list(self.value_dims)  # (values narrower than keys: MiMo-V2-Flash's)
        if any(self.index_widths):  # DeepSeek Sparse Attention: the indexer keys the cache keeps beside K and V
            fingerprint["layer_index_dims"] = self.index_widths
        return fingerprint


def adapt(model: nn.Module) -> ModelAdapter:
    """Build the adapter for a loaded causal LM, or refuse it naming what is missing. A model whose text decoder is
    one part of it (Gemma 3 4B-27B: Gemma3ForConditionalGeneration, model_type gemma3) is read by that decoder and its
    text config, and served for text."""
    model_type = getattr(model.config, "model_type", "?")
    where = f"unsupported architecture {type(model).__name__} (model_type '{model_type}')"
    config = model.config.get_text_config(decoder=True)
    text_type = getattr(config, "model_type", model_type)  # what the decoder's attention is
    unserved = next((kind for kind in (model_type, text_type) if not served_by_installed_transformers(kind)), None)
    if unserved is not None:
        major, minor = SERVED_FROM[unserved]
        raise KvcalError(f"{where}: kvcal serves it from transformers {major}.{minor}, whose classes it follows; "
                         f"upgrade transformers (pip install 'transformers>={major}.{minor}')")
    not_yet = next((NOT_TAKEN_YET[kind] for kind in (model_type, text_type) if kind in NOT_TAKEN_YET), None)
    if not_yet is not None:
        raise KvcalError(f"{where}: {not_yet}; {SERVED_ONES}")
    num_layers = getattr(config, "num_hidden_layers", None)
    if num_layers is None:
        raise KvcalError(f"{where}: its config has no num_hidden_layers")
    query_heads, kv_heads, head_dims = _layer_geometry(config, num_layers, where)
    latent = text_type in LATENT_ATTENTION_TYPES + LATENT_DECODERS
    per_layer = _per_layer_configs(config, num_layers)
    if latent:  # one KV head: the rotated key every head shares, beside the latent (LatentAttention); none on a layer
        # without RoPE where its attention has no rotated channels (Mistral Large 4's no_rope_layers, 0 there)
        roped = getattr(config, "no_rope_layers", None) or [1] * num_layers
        kv_heads, head_dims = [1] * num_layers, [layer.qk_rope_head_dim if flag else 0 for layer, flag in zip(per_layer, roped)]
    if text_type in SLIDING_KV_HEADS_DOUBLED:
        kv_heads = [2 * heads if kind == "sliding_attention" else heads
                    for heads, kind in zip(kv_heads, _decoder_layer_types(config, num_layers))]
    value_dims = ([layer.kv_lora_rank for layer in per_layer] if latent else [config.v_head_dim] * num_layers
                  if text_type in NARROW_VALUES else head_dims)
    decoder = decoder_of(model)  # not a vision tower's layers, whatever their number
    sublayers = ATTENTION_SUBLAYERS.get(text_type, 1)
    layers = _find_decoder_layers(decoder, num_layers // sublayers)
    heads_first = text_type in HEADS_FIRST_NORMS
    sinks = text_type in SINKS
    decoder_types = _decoder_layer_types(config, num_layers)
    sharing = _kv_sharing_modes(config, num_layers)
    if latent and any(sharing):
        raise KvcalError(f"{where}: its layers read other layers' latent caches (kv_source_layers: KV sharing), which "
                         f"kvcal does not serve for multi-head latent attention yet; {SERVED_ONES}")
    attending = [m for m in _attention_layers(decoder_types, where) if sharing[m] != "reuse"]
    located = [_cache_layer_attention(layers, m, sublayers, where) for m in attending]
    handles = [latent_handles(attention, i, at, per_layer[m], decoder_types[m] == INDEXED_ATTENTION) if latent else
               layer_handles(attention, i, at, heads_first, query_heads[m] * head_dims[m], kv_heads[m] * head_dims[m],
                             head_dims[m], sinks, "after" if text_type in NORMED_AFTER_ROPE else
                             "before" if text_type in (*SHARED_NORM_BEFORE_ROPE, *FLAT_NORMS_BEFORE_ROPE) else None)
               for i, (m, (attention, at)) in enumerate(zip(attending, located))]
    for handle, m, (_, at) in zip(handles, attending, located):
        if decoder_types[m] == INDEXED_ATTENTION and text_type in PICK_RETURNED:
            take_returned_pick(handle, at)
        if decoder_types[m] != INDEXED_ATTENTION or latent:  # (MLA's pick: latent_handles)
            continue
        if text_type in PICK_IN_MASK:
            pick_tokens_in_mask(handle, at)
        else:
            pick_key_blocks(handle, query_heads[m], at)
    if getattr(config, "alibi", False) or getattr(getattr(config, "attn_config", None), "alibi", False):  # MPT's, Falcon's
        raise KvcalError(f"{where}: its positions are ALiBi biases on the scores, which kvcal's attention does not "
                         "add; kvcal serves RoPE models and ones with learned or no positions")
    if model_type not in SUPPORTED_MODEL_TYPES + LATENT_ATTENTION_TYPES:
        raise KvcalError(f"{where}: kvcal does not serve its model type; {SERVED_ONES}")
    attending_only = lambda per_layer: [per_layer[m] for m in attending]  # noqa: E731
    kinds, query_heads, kv_heads, head_dims, value_dims = map(attending_only, (rotary_layer_types(config, num_layers),
                                                                               query_heads, kv_heads, head_dims,
                                                                               value_dims))
    layer_rotaries = (tuple(attending_only(rotaries_per_base(decoder, config, num_layers))) if text_type in ROTARY_PER_BASE
                      else tuple(attending_only(rotaries_scaled_by_layer(decoder, config, num_layers)))
                      if text_type in ROTARY_SCALED_BY_LAYER else ())
    rope_free = rope_free_types(config)
    rotating_kinds = [kind for kind in kinds if kind not in rope_free]
    rotary = (next((module for module in layer_rotaries if module is not None), None) if layer_rotaries else
              None if text_type in SCALED_NORMS_AFTER_ROPE else
              find_rotary(decoder, rotating_kinds, where, optional=text_type in NOPE_WITHOUT_ROTARY,
                          table=text_type in SINUSOID_TABLE_ROPE))
    interleaved = text_type in INTERLEAVED_ROPE or latent and latent_rope(config) != "halves"
    orders = (channel_orders(rotary, kinds, head_dims, rope_free, interleaved, text_type in HALVES_SWAPPED_ROPE, where)
              if rotary is not None else [None] * len(handles))
    for handle, order in zip(handles, orders):
        handle.rope_order = order
    rotated = (attending_only(rotated_layers(config, text_type, num_layers, rope_free)) if rotary is not None
               else [False] * len(handles))
    readers = _reader_layers(layers, sharing, decoder_types, attending, where)
    if model_type not in PREFIX_LM and any(getattr(layer.attention, "is_causal", True) is False
                                           for layer in [*handles, *readers]):  # bidirectional attention
        raise KvcalError(f"{where}: its attention is bidirectional (is_causal False), and kvcal's cache serves causal "
                         "decoders")
    layer_scales = [float(attention.scaling if hasattr(attention, "scaling") else head_dims[layer] ** -0.5)
                    for attention, layer in [*((h.attention, h.index) for h in handles),
                                             *((r.attention, r.source) for r in readers)]]
    scales = sorted(set(layer_scales))
    if len(scales) > 1 and not latent:  # (MLA's fits read no scores: capture keeps no MLA queries)
        raise KvcalError(f"{where}: its layers scale attention scores differently ({scales}); kvcal's fits take one scale")
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None and config._attn_implementation == "sdpa":
        raise KvcalError(f"{where}: it soft-caps its attention scores, which transformers' SDPA attention leaves out "
                         "(transformers before 5.21 chose it by default); load the model with attn_implementation='eager'")
    architecture, served_type = _served_name(model, config)
    adapter = ModelAdapter(
        architecture=architecture,
        model_type=served_type,
        layers=handles,
        query_heads=query_heads,
        kv_heads=kv_heads,
        head_dims=head_dims,
        value_dims=value_dims,
        max_positions=int(getattr(config, "max_position_embeddings", 0) or 0),
        rotary=rotary,
        config_dict=config.to_dict(),
        layer_types=kinds,
        windows=attending_only(_sliding_windows(config, num_layers)),
        chunks=attending_only(_attention_chunks(config, decoder_types)),
        rotated=rotated,
        score_scales=layer_scales[: len(handles)],
        softcap=softcap,
        model_layers=tuple(attending),
        num_model_layers=num_layers,
        keeps_state=[kind in ATTENTION_AND_STATE_TYPES for kind in attending_only(decoder_types)],
        readers=tuple(readers),
        images_as_tokens=model_type in IMAGES_AS_TOKENS,
        image_blocks=model_type in IMAGE_BLOCKS,
        encoders_inside=model_type in ENCODERS_INSIDE,
        layer_rotaries=layer_rotaries,
        long_rope=find_long_rope(rotary) if rotary is not None else None,
        parity_split=sum(rotary.mrope_section[:2]) if text_type in PARITY_SPLIT_ROPE else 0,
        cross_attention={m: _find_attention(layers[m], f"{where}: decoder layer {m}")
                         for m, kind in enumerate(decoder_types) if kind == CROSS_ATTENTION},
    )
    for handle in handles:
        handle.unrotated_scale = _unrotated_scale(adapter, handle.index)
    scaled = sorted({adapter.layer_rope_scaling(h.index) for h in handles
                     if h.rope_norms is not None and not h.norms_before_rope} - {1.0})
    if scaled:  # the norm takes cos/sin's scaling out of the keys it makes, where kvcal's rotation would put it back
        raise KvcalError(f"{where}: it norms q and k after a RoPE that scales cos/sin by {scaled[0]:.4g}; kvcal serves q "
                         "and k normed after RoPE where cos/sin are unscaled (rope_type default, linear, llama3)")
    return adapter


def prefix_lm(model: nn.Module) -> bool:
    """Whether `model` attends its prompt both ways, told which tokens are the prompt's by token types (PREFIX_LM)."""
    return getattr(model.config, "model_type", None) in PREFIX_LM


def text_inputs(model: nn.Module, ids: torch.Tensor) -> dict:
    """What a forward of `model` over text alone (ids) takes besides them: a prefix LM's token_type_ids of 1, its text
    read causally as it writes it, nothing for others."""
    return {"token_type_ids": torch.ones_like(ids)} if prefix_lm(model) else {}


def decoder_of(model: nn.Module) -> nn.Module:
    """The model's text decoder, without its head (and a composite's vision tower): get_decoder(), but where that is
    a causal LM, its decoder (Llama4ForCausalLM's get_decoder() finds none under its base_model_prefix and returns the
    model, which Llama4ForConditionalGeneration's returns)."""
    decoder = model.get_decoder()
    if isinstance(decoder, nn.Linear):  # (ModernBERT decoder's LM head is named `decoder`, which get_decoder() takes)
        decoder = model.base_model
    return decoder.model if isinstance(decoder, GenerationMixin) else decoder


def chunk_positions(start: int, ids: torch.Tensor) -> torch.Tensor:
    """The position ids of a chunk `ids` (batch, tokens) of prompts from their token `start` on, which a prefill in
    chunks gives the decoder as generate() gives them: a model may count from 0 in every call given none (Bamba)."""
    return torch.arange(start, start + ids.shape[1], device=ids.device).expand(ids.shape[0], -1)


def _served_name(model: nn.Module, text_config) -> tuple[str, str]:
    """(architecture, model_type) that artifacts name the model by: its own, or where AutoModelForCausalLM loads a
    composite's checkpoints as a causal LM of their text decoder alone (Llama 4's Llama4ForCausalLM, Qwen3.5's
    Qwen3_5ForCausalLM), that LM's, so that one bundle serves both."""
    causal_lm = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model.config.model_type, type(model).__name__)
    if causal_lm != type(model).__name__ and text_config is not model.config:
        return causal_lm, text_config.model_type
    return type(model).__name__, model.config.model_type


def _per_layer_configs(config, num_layers: int) -> list:
    """Per decoder layer, its config: transformers' per-layer config where the config is heterogeneous (Gemma 4's,
    dots.note3's), else the config."""
    return (config.per_layer_config if getattr(config, "is_heterogeneous", False) else [config] * num_layers)[:num_layers]


def _layer_geometry(config, num_layers: int, where: str) -> tuple[list[int], list[int], list[int]]:
    """Per decoder layer, its query heads, KV heads and head_dim: its per-layer config's (_per_layer_configs: Gemma 4's
    full-attention layers have fewer KV heads, twice the head_dim), the query heads of num_attention_heads_per_layer
    where the config has it (Laguna)."""
    per_layer = _per_layer_configs(config, num_layers)
    query_heads = list(getattr(config, "num_attention_heads_per_layer", None) or
                       [getattr(layer, "num_attention_heads", None) for layer in per_layer])[:num_layers]
    if None in query_heads:  # (RWKV's, Mamba's: no attention)
        raise KvcalError(f"{where}: its config has no num_attention_heads, the attention heads kvcal reads; {SERVED_ONES}")
    if len(query_heads) < num_layers:
        raise KvcalError(f"{where}: its config gives {len(query_heads)} query-head counts (num_attention_heads_per_layer) "
                         f"for {num_layers} layers; give one a layer")
    # (GPT-BigCode: one KV head where multi_query)
    kv_heads = [getattr(layer, "num_key_value_heads", None) or (1 if getattr(layer, "multi_query", False) else heads)
                for layer, heads in zip(per_layer, query_heads)]
    head_dims = [getattr(layer, "head_dim", None) or layer.hidden_size // heads for layer, heads in zip(per_layer, query_heads)]
    return query_heads, kv_heads, head_dims


def _find_decoder_layers(model: nn.Module, num_layers: int) -> nn.ModuleList:
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == num_layers:
            return module
    raise KvcalError(f"{type(model).__name__}: could not find a list of {num_layers} decoder layers")


def _decoder_layer_types(config, num_layers: int) -> list[str]:
    """Each decoder layer's type: the config's layer_types (by kvcal's name, LAYER_TYPE_NAMES), full_attention where it
    has none."""
    types = getattr(config, "layer_types", None) or ["full_attention"] * num_layers
    crossing = getattr(config, "cross_attention_layers", None) or ()
    types = [CROSS_ATTENTION if i in crossing else kind for i, kind in enumerate(types)]
    return [LAYER_TYPE_NAMES.get(kind, kind) for kind in types][:num_layers]


def _kv_sharing_modes(config, num_layers: int) -> list[str | None]:
    """Each decoder layer's KV sharing mode, "reuse" for the last num_kv_shared_layers (the layers reading an earlier
    layer's cache): transformers' kv_sharing_modes from 5.23, the same count read from the config before it."""
    modes = getattr(config, "kv_sharing_modes", None)
    if modes is None:
        shared = getattr(config, "num_kv_shared_layers", 0) or 0
        modes = [None] * (num_layers - shared) + ["reuse"] * shared
    return list(modes)[:num_layers]


def _attention_layers(types: list[str], where: str) -> list[int]:
    """The decoder layers that attend, by each one's type (_decoder_layer_types): all, or a hybrid model's layers whose
    type is not one of STATE_LAYER_TYPES; refuses layer types that are neither."""
    other = sorted(set(types) - set(ATTENTION_LAYER_TYPES) - {*STATE_LAYER_TYPES, CROSS_ATTENTION})
    if other:
        raise KvcalError(f"{where}: its layer types {other} are not ones kvcal serves ({', '.join(ATTENTION_LAYER_TYPES)}, "
                         f"beside {', '.join(STATE_LAYER_TYPES)} layers, whose state transformers keeps)")
    attending = [i for i, kind in enumerate(types) if kind in ATTENTION_LAYER_TYPES]
    if not attending:
        raise KvcalError(f"{where}: none of its layers attends (layer types {sorted(set(types))}): it keeps no KV cache")
    return attending


def _cache_layer_attention(layers: nn.ModuleList, m: int, sublayers: int, where: str) -> tuple[nn.Module, str]:
    """The attention of the cache's layer `m` and where it is, for messages: decoder layer m's, or where each decoder
    layer holds `sublayers` attentions (ATTENTION_SUBLAYERS), the (m % sublayers)-th of decoder layer m // sublayers."""
    if sublayers == 1:
        return _find_attention(layers[m], f"{where}: decoder layer {m}"), f"{where}: decoder layer {m}"
    where = f"{where}: decoder layer {m // sublayers}"
    attentions = _find_attention(layers[m // sublayers], where)
    if not isinstance(attentions, nn.ModuleList) or len(attentions) != sublayers:
        raise KvcalError(f"{where}: its attention is not a list of {sublayers} attention sublayers")
    return attentions[m % sublayers], f"{where}'s attention {m % sublayers}"


def _find_attention(layer: nn.Module, where: str) -> nn.Module:
    block = getattr(layer, "norm_attn_norm", layer)  # DBRX's: a norm, its attention and a norm in one module
    for name in ATTENTION_NAMES:
        attention = getattr(block, name, None)
        if attention is not None:
            return attention
    children = ", ".join(name for name, _ in layer.named_children())
    raise KvcalError(f"{where} has no attention module ({'/'.join(ATTENTION_NAMES)}); found {children}; {SERVED_ONES}")


def _reader_layers(layers: nn.ModuleList, sharing: list[str | None], types: list[str], attending: list[int],
                   where: str) -> list[ReaderLayer]:
    """The decoder layers whose KV sharing mode is "reuse" (the last ones), each reading the cache of the last earlier
    layer of its type (as transformers' kv_sharing_modes picks it, which checks that there is one)."""
    first = next((m for m, mode in enumerate(sharing) if mode == "reuse"), len(sharing))
    return [ReaderLayer(m, _find_attention(layers[m], f"{where}: decoder layer {m}"),
                        max(i for i, a in enumerate(attending) if a < first and types[a] == types[m]))
            for m, mode in enumerate(sharing) if mode == "reuse"]


def _sliding_windows(config, num_layers: int) -> list[int | None]:
    """Per layer, the sliding window transformers' cache keeps for it, or None: the config's sliding_window on its
    sliding layers, on every layer where it names a window but no layer_types (Mistral), as transformers reads it.
    Read from the config, not transformers' get_layer_types_and_kwargs, whose return shape changed (one dict up to
    5.17, a dict per layer since)."""
    text = config.get_text_config(decoder=True)
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None) or ["sliding_attention" if window is not None else "full_attention"] * num_layers
    return [window if kind == "sliding_attention" else None for kind in types][:num_layers]


def _attention_chunks(config, decoder_types: list[str]) -> list[int | None]:
    """Per decoder layer (of these types), its attention chunk (config.attention_chunk_size on Llama 4's
    chunked_attention layers), or None."""
    chunk = getattr(config, "attention_chunk_size", None)
    return [chunk if kind == "chunked_attention" else None for kind in decoder_types]


def _unrotated_scale(adapter: ModelAdapter, layer: int) -> torch.Tensor | None:
    """LayerHandles.unrotated_scale of the adapter's layer `layer`."""
    scaling, half = adapter.layer_rope_scaling(layer), adapter.head_dims[layer] // 2
    if scaling == 1.0:
        return None
    pairs = rotary_inv_freq(adapter._layer_rotary(layer), adapter.layer_types[layer]).numel()
    if pairs == half:
        return None
    one_half = torch.cat((torch.ones(pairs), torch.full((half - pairs,), 1.0 / scaling)))
    return torch.cat((one_half, one_half))


# Keys of config.to_dict() that change with how a model was saved or loaded, not with what it computes
# (`architectures` is filled in by save_pretrained; the class name is in the fingerprint already).
_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "use_cache", "architectures"}


def _canonical(config: dict) -> dict:
    """A config's dict without what loading it changes (_VOLATILE_CONFIG_KEYS), in its sub-configs too (DBRX's
    attn_config: its dtype None as made, the weights' once loaded)."""
    return {k: _canonical(v) if isinstance(v, dict) else v for k, v in config.items() if k not in _VOLATILE_CONFIG_KEYS}
