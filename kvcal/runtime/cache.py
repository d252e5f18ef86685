"""The quantized KV cache for Hugging Face models: `model.generate(..., cache=cache)` (`past_key_values=cache` before
transformers 5.24, kvcal.model_caches.CACHE_ARGUMENT).

`quantized_cache(model, bundle)` returns a `WiredCache`, a transformers `Cache` of one `RuntimeLayer`
(kvcal.runtime.layer) per attention layer, each with a store for K and one for V built from the bundle's recipe
(kvcal.runtime.segments); it refuses a bundle made for another model. A hybrid model's other layers (Qwen3.5's gated
DeltaNet) keep their recurrent state in transformers' own cache layers, in place among them; an attention layer with a
recurrent mixer beside it (Falcon-H1's Mamba 2) keeps that state in its RuntimeLayer (StatefulRuntimeLayer). While
open (until `close()` or the end of its `with` block) the model is wired through kvcal.wiring: attention
implementation `kvcal_runtime` (registered with transformers' AttentionInterface, switched with
`model.set_attn_implementation`), which appends to the stores and attends over them (a decode step with the backend
kvcal.runtime.backends chooses for the layer: the CUDA kernels, the compiled CPU kernel, or the torch reference), and
hooks that hand it the pre-RoPE keys and position ids. The wiring is shared and reference-counted: several caches may
be open on one model (each call is served by the cache passed to it), and the model's own attention implementation
comes back when the last one closes. Storage is allocated at the first forward, when the batch is known.

Refused with a KvcalError, so that no misuse returns tokens: a cache used after it was closed, handed to
another model (instance) than its own, or made from a bundle for another model; a wired model called
without its cache (none, or another cache); a step of another batch than the cache holds; a `crop`
that cannot take its tokens back exactly (WiredCache.crop); a simulation opened while a cache is (see kvcal.simulate).

Beam search and batch edits (`reorder_cache`, `batch_select_indices`, `batch_repeat_interleave`: WiredCache.
take_sequences) move every sequence's storage with it, as if the batch had been fed so. Speculative decoding's `crop`
takes the rejected candidates of the last step back, leaving what a step without them would have
(kvcal.runtime.segments.SegmentedStore.take_back).

Semantics (the same as the simulation of `kvcal eval ppl`, which a test checks logit by logit):
- the cache holds fp16; padding (from the attention mask) is never stored, each sequence has its own length;
- a one-token step (decode) appends its token first, then attends over the cache as stored;
- a multi-token step (prefill) attends over what was cached before it plus its own tokens in fp16
  (causal; an image's tokens in Gemma 3 and 4 see each other both ways, as each layer's mask says), then appends
  them, quantizing what leaves the fp16 segments; with later_steps="decode" a sequence's steps after its first are
  read as that many decode steps instead (quantized_cache; kvcal.runtime.layer);
- keys stored before RoPE are rotated by the frequencies of the first forward after the cache was empty; a LongRoPE
  model's (Phi-3.5, Phi-4-mini) steps must all reach past its switch or none (WiredCache.rope_era): where generate
  drops the cache to compute the sequence again past it, kvcal's is emptied and filled again instead (`reset`);
- a layer with a sliding window (Gemma 3's sliding layers, Mistral's `sliding_window`: the adapter's `windows`,
  as transformers' own cache reads them) attends, per sequence, over its last `window` tokens as transformers
  does; a chunked one (Llama 4's: the adapter's `chunks`) over its chunk's tokens (kvcal.spans.AttentionSpan); after
  every step each drops the tokens no later query sees (kvcal.kv.window_dropped: at most its last size - 1 are
  kept, as in transformers' cache); the body drops rows in place and its storage is compacted now and then
  (kvcal.runtime.store.PackedRows.drop_front), never copied per step; every decode backend reads spans.

One plan per step (kvcal.runtime.step_plan.StepPlan): what does not change between layers (which tokens are real,
tokens stored per sequence, RoPE positions and tables, the decode mask, gather indices and kernel launch data of
layers that share a layout) is made by the first layer of a forward and reused by the others. A decode step appends the batch's
tokens with one store operation per segment (one encode of the codec, or one launch of the append kernels) per
layer and per K/V, then attends over the whole batch at once (the batched reference, or one fused kernel
launch); its torch operations do not grow with the batch size (a test counts them: the same for 2 and 8
sequences; a single sequence's fp16 rows move as slices, fewer still). The kernel path never
waits for the device within a step: the one host read of a step is which tokens are padding, made only when
the step has an attention mask (transformers' own mask building reads it then too) and skipped when it has none.
"""

from __future__ import annotations

import functools

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, LinearAttentionCacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvcal import wiring
from kvcal.adapters import ModelAdapter, adapt, decoder_of
from kvcal.bundle import Bundle, load_bundle
from kvcal.errors import KvcalError
from kvcal.indexer_keys import StoredRows
from kvcal.model_caches import CACHE_ARGUMENT, taking
from kvcal.runtime import backends, cpu_kernel, heap, reference
from kvcal.runtime.fp_context import FpContext
from kvcal.runtime.layer import RuntimeLayer, StatefulRuntimeLayer, runtime_layer, take_state
from kvcal.runtime.segments import SegmentedStore
from kvcal.runtime.step_plan import StepPlan
from kvcal.runtime.store import STORE_LAYOUTS, upload

ATTENTION_NAME = "kvcal_runtime"
LOAD_CHUNK_BYTES = 256 * 2**20  # fp16 rows per append of WiredCache.load on a GPU
# on CPU, where glibc keeps much of what a larger append's temporaries free (kvcal.runtime.heap)
CPU_LOAD_CHUNK_BYTES = 4 * 2**20
LATER_STEPS = ("prefill", "decode")  # how a step of several tokens after a sequence's first reads them (quantized_cache)


def _runtime_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None, **kwargs):
    slot = wiring.slot(module)
    if slot is None and wiring.left_to_the_model(module):  # (SDPA: a wired model builds SDPA's masks)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    wiring.check_call(module, slot, attention_mask, query.shape[2], kwargs)
    layer: RuntimeLayer | None = slot.take_serving() if slot is not None else None
    if layer is None:
        raise KvcalError("the model is wired for a kvcal quantized cache (open) but was called without one: pass "
                         f"{CACHE_ARGUMENT}=cache, the cache of `with quantized_cache(model, bundle) as cache` (not None, "
                         "not another kind of cache), or call the model after that block")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    adapter = slot.wiring.adapter
    if slot.reader:  # the step's plan, made by the layers that store (a reader's queries may be the step's last only)
        plan = layer.cache.running_plan()
        ahead = plan.ahead_of(attention_mask)
        return layer.attend_as_reader(adapter.in_rope_order(query, slot.index), plan, scale, sliding_window, ahead), None
    attention_mask, chosen = wiring.step_mask_and_pick(slot, attention_mask, kwargs, layer.padded_length + query.shape[2])
    plan = layer.cache.plan_for(attention_mask, query, slot.wiring.positions)
    layer.pending_pre_rope = slot.pre_rope_keys
    latent = layer.latent
    if latent is not None:  # the step's latent and rotated key, as transformers handed the cache them
        (latents, rotated_keys), layer.latent_step = layer.latent_step, None
        rotated = query[..., latent.nope_dim :]
        if not latent.rope_in_order:
            rotated, rotated_keys = adapter.in_rope_order(rotated, slot.index), adapter.in_rope_order(rotated_keys, slot.index)
        out = layer.attend(rotated, rotated_keys, latents, plan, scale, sliding_window, None,
                           latent.latent_query(query[..., : latent.nope_dim]), chosen)
        return latent.head_outputs(out.transpose(1, 2)).transpose(1, 2).to(query.dtype), None
    query, key, value = adapter.grouped_heads(slot.index, query, key, value)
    output = layer.attend(adapter.in_rope_order(query, slot.index), adapter.in_rope_order(key, slot.index), value, plan,
                          scale, sliding_window, plan.ahead_of(attention_mask), chosen=chosen)
    return adapter.tiled_heads(slot.index, output), None


def _register_attention() -> None:
    wiring.register(ATTENTION_NAME, _runtime_attention, "a kvcal quantized cache (kvcal.runtime.quantized_cache)")


class WiredCache(Cache):
    """A transformers Cache of RuntimeLayers for one model (its attention layers, `attention_layers`; a hybrid model's
    other layers are transformers' own), which it wires (kvcal.wiring) while open; serves only that model, only while
    open (see the module docstring)."""

    def __init__(self, model, adapter: ModelAdapter, layers: list[RuntimeLayer], indexer_keys: str = "model"):
        every = DynamicCache(config=model.config).layers if adapter.hybrid or any(adapter.keeps_state) else list(layers)
        for decoder_index, layer in zip(adapter.model_layers, layers):
            if isinstance(layer, StatefulRuntimeLayer):
                take_state(layer, every[decoder_index])  # transformers' empty states, as many as its layer holds
            every[decoder_index] = layer
        Cache.__init__(self, layers=every)  # (by name: kvcal.model_caches.taking puts a model's cache class next)
        self.attention_layers = layers
        self._attention_index = {decoder_index: i for i, decoder_index in enumerate(adapter.model_layers)}
        self.model, self.adapter = model, adapter
        self.indexer_keys = indexer_keys  # how sparse layers keep their indexer keys (kvcal.indexer_keys.FORMATS)
        self.closed = False
        for layer in layers:
            layer.cache = self
        self.lengths: list[int] | None = None  # tokens stored per sequence (every layer stores the same)
        self.position_offset: list[int | None] | None = None  # RoPE position of each sequence's first stored token
        self._plan: StepPlan | None = None  # the running step's (made at its first layer)
        self._inv_freq: dict[tuple, torch.Tensor] = {}
        self._rope_rows: dict = {}  # see rope_rows
        self.long_era: bool | None = None  # LongRoPE: whether the stored keys' forwards reached past its switch
        self.refillable = True  # a prefill of its tokens makes it again (not after Cocktail's compress)
        _register_attention()
        self._wiring = wiring.wire(model, adapter, ATTENTION_NAME, owner=self)
        self._regenerate_hook = (model.register_forward_pre_hook(self._take_back_when_dropped, with_kwargs=True)
                                 if adapter.long_rope is not None else None)
        # a step at multimodal positions is refused at the rotary, before any layer runs, where the decoder was handed
        # this cache (its hook after the wiring's on the same rotary, which tells such a step); update() refuses it too
        self._serving_decoder = False
        self._refusal_hooks = []
        if adapter.rotary is not None and any(layer.pre_rope for layer in layers):
            decoder = decoder_of(model)
            self._refusal_hooks = [decoder.register_forward_pre_hook(self._note_decoder_call, with_kwargs=True),
                                   decoder.register_forward_hook(self._note_decoder_return, always_call=True),
                                   adapter.rotary.register_forward_pre_hook(self._refuse_at_the_rotary)]

    def _note_decoder_call(self, module, args, kwargs):
        self._serving_decoder = any(kwargs.get(name) is self for name in ("cache", "past_key_values"))

    def _note_decoder_return(self, module, args, output):
        self._serving_decoder = False

    def _refuse_at_the_rotary(self, module, args):
        if self._serving_decoder:
            self._refuse_multimodal_step()

    def _refuse_multimodal_step(self) -> None:
        """Refuse a step at multimodal RoPE positions (an image's, Qwen-VL's) where layers store keys before RoPE
        (wiring.multimodal_refusal): at the rotary where it can (a hybrid model's recurrent layers before the first
        attention layer would otherwise take the refused step into their states), else at the first attention layer."""
        if not self._wiring.multimodal:  # (every step asks: the list below only for one at multimodal positions)
            return
        pre_rope = [i for i, layer in enumerate(self.attention_layers) if layer.pre_rope]
        if pre_rope:
            raise KvcalError(wiring.multimodal_refusal(pre_rope))

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Called by the model's attention before its attention implementation: hand this cache's layer to it,
        or refuse a call that is not from the open, wired model this cache was made for."""
        self._check_open()
        if layer_idx in self.adapter.cross_attention:  # (an image's keys and values, in transformers' own cache layer)
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        index = self._attention_index.get(layer_idx)
        slot = wiring.slot(self.adapter.layers[index].attention) if index is not None else None
        if slot is None or slot.wiring is not self._wiring or not slot.running:
            raise KvcalError(f"this quantized cache serves only the model instance it was made for ({self._describe_model()}) "
                             f"and was handed to another one; make a cache for each model with quantized_cache(model, bundle)")
        if index == 0:  # a new step: its first attention layer checks the wiring and makes the plan the others reuse
            self._wiring.check_active()
            self._plan = None
            heap.release_if_grown(key_states.device)  # (what the last step freed after its last attention)
            self._refuse_multimodal_step()
        self._wiring.serve(index, self.attention_layers[index])
        if self.adapter.latent:  # MLA's: its latent and rotated key (LatentAttention), which its attention reads
            self.attention_layers[index].latent_step = (key_states, value_states)
        return key_states, value_states

    def update_indexer(self, indexer_keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Called by a DeepSeek Sparse Attention layer's indexer (and by RuntimeLayer.update_index): keep the step's
        indexer keys (batch, tokens, channels) in the cache's indexer_keys format -> the layer's every token's so far,
        as stored."""
        self._check_open()
        index = self._attention_index.get(layer_idx)
        if index is None or self.adapter.layers[index].indexer is None:
            raise KvcalError(f"decoder layer {layer_idx} has no sparse attention indexer whose keys this cache keeps")
        return self.attention_layers[index].keep_index_keys(indexer_keys)

    def plan_for(self, attention_mask, query: torch.Tensor, positions: torch.Tensor | None) -> StepPlan:
        """The running step's StepPlan, made by its first layer from that layer's attention mask and position ids."""
        batch, _, m, _ = query.shape
        if self._plan is None or (self._plan.batch, self._plan.m) != (batch, m):
            # (Qwen4-Exp's rotary is handed every token's positions so far, for its indexers: the step's are the last)
            positions = positions[..., -m:] if positions is not None else None
            self._plan = StepPlan(self, attention_mask, batch, m, query.device, positions)
        return self._plan

    def rope_era(self, tokens: int) -> None:
        """Refuse a forward over `tokens` tokens of a LongRoPE model that rotates by the other set of frequencies than
        the stored keys' forwards did: the model's keys and hidden states would differ from theirs."""
        long_rope = self.adapter.long_rope
        if long_rope is None:
            return
        long = tokens > long_rope.switch
        if self.long_era is not None and long != self.long_era:
            raise KvcalError(f"this step's positions end at {tokens - 1}, on the other side of LongRoPE's switch "
                             f"{long_rope.switch} (original_max_position_embeddings) than the cached tokens' forwards, "
                             "which rotated by the other frequencies; as Phi-3's generate does, empty the cache "
                             "(cache.reset()) and prefill the whole sequence again")
        self.long_era = long

    def _take_back_when_dropped(self, module, args, kwargs):
        """Phi-3's generate (its prepare_inputs_for_generation) drops a LongRoPE model's cache when the sequence first
        reaches past the switch, to compute it again with the long frequencies: it calls the model with the whole
        sequence, no cache and use_cache True, and would go on with a DynamicCache. This cache, the only one open on the
        model, holding a prefix of that sequence and no forward past the switch, is emptied and passed instead, so the
        call prefills it and generate goes on with it. Phi-4-multimodal's generate (transformers 5.23; Phi-3's before 5.20)
        drops it so but goes on with the tokens it had not cached alone (their positions from past 0 on), which no cache
        can serve: refused in one line. Other calls without a cache are left to be refused."""
        ids = kwargs.get("input_ids", args[0] if args else None)
        rows = ids if ids is not None else kwargs.get("inputs_embeds")
        if kwargs.get(CACHE_ARGUMENT) is not None or kwargs.get("use_cache") is not True or rows is None or self.long_era:
            return None
        switch, positions = self.adapter.long_rope.switch, kwargs.get("position_ids")
        first = int(positions[:, 0].min()) if positions is not None and positions.dim() == 2 else 0
        if first > 0 and int(positions.max()) >= switch:
            raise KvcalError(f"the model was called without a cache on {rows.shape[1]} token(s) from position {first} "
                             f"on, which reach past LongRoPE's switch {switch}: "
                             f"{self.adapter.architecture}'s generate drops the cache there and goes on without the tokens "
                             f"before, which no cache can serve; keep the prompt and the new tokens within {switch} tokens, "
                             "or start past them (a longer prompt)")
        if not self.attention_layers[0].padded_length < rows.shape[1] or rows.shape[1] <= switch:
            return None
        if len(self._wiring.users) > 1 or not self.refillable:
            why = ("other kvcal caches are open on the model, and which one it dropped is not known" if self.refillable
                   else "this cache was compressed after its prefill (Cocktail), which a prefill does not make again")
            raise KvcalError(f"generate dropped the cache at LongRoPE's switch {self.adapter.long_rope.switch}, to "
                             f"compute the sequence again with the long frequencies, and {why}; keep the sequence on one "
                             "side of the switch, or open one cache at a time")
        self.reset()
        return args, {**kwargs, CACHE_ARGUMENT: self}

    def reset(self) -> None:
        """Empty the cache (transformers' Cache.reset), to be filled again from the next step on."""
        super().reset()
        self.lengths = self.position_offset = self._plan = self.long_era = None
        self._rope_rows, self.refillable = {}, True

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search's step: sequence i goes on from beam beam_idx[i] (transformers' Cache.reorder_cache)."""
        self.take_sequences(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.take_sequences(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.take_sequences(torch.arange(len(self.lengths or [])).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' Cache.crop(-n): take back the last n tokens (up to UNDO_TOKENS) of each sequence of the last
        step (assisted generation's and prompt lookup's rejected candidates), which must have brought several tokens a
        sequence (its appends logged: SegmentedStore.take_back); the cache is then what it would be had that step
        brought the others only. Refused, with nothing changed, where it cannot be: after a decode step, where a
        sliding window let go of tokens in that step, on Cocktail's caches and on layers keeping recurrent states."""
        self._check_open()
        if tokens_to_remove > 0:
            raise KvcalError(f"crop({tokens_to_remove}): give the number of tokens to take back as a negative count "
                             "(transformers' convention)")
        tokens = -int(tokens_to_remove)  # transformers before 5.18 passes a 0-dim tensor: counts stay ints
        if not tokens:
            return
        refusal = self._take_back_refusal(tokens)
        if refusal is not None:
            raise KvcalError(f"crop({tokens_to_remove}): {refusal}; generate without assistant_model or "
                             "prompt_lookup_num_tokens here")
        stepped = [layer.take_back(tokens) for layer in self.attention_layers if layer.keys_store is not None][0]
        self.lengths = [n - tokens if b in stepped else n for b, n in enumerate(self.lengths)]
        self._plan = None

    def _take_back_refusal(self, tokens: int) -> str | None:
        """Why crop cannot take back `tokens` tokens exactly, or None (every store checked before any changes)."""
        stateful = [i for i, layer in enumerate(self.layers) if isinstance(layer, LinearAttentionCacheLayerMixin)]
        if stateful:
            return f"layers {stateful} keep recurrent states, which take no tokens back"
        if self.lengths is None:
            return "the cache is empty"
        stores = [store for layer in self.attention_layers for store in (layer.keys_store, layer.values_store)
                  if store is not None]
        if not all(isinstance(store, SegmentedStore) for store in stores):
            return "Cocktail's chunks take no tokens back"
        return next(filter(None, (store.take_back_refusal(tokens) for store in stores)), None)

    def take_sequences(self, index) -> None:
        """Keep sequences index[0], index[1], ... (a 1-D integer tensor or list; repeats allowed) as the cache's
        sequences 0, 1, ...: every layer's stores (codes, parameters, outliers, fp16 rows), indexer keys and recurrent
        states, and the tokens and RoPE offset of each, as if the batch had been fed so. One host read of the index
        (beam search's reordering comes every step: its cost is a copy of the cache, as transformers' own caches
        copy theirs)."""
        self._check_open()
        seqs = [int(b) for b in (index.tolist() if isinstance(index, torch.Tensor) else index)]
        batch = len(self.lengths or [])
        if any(not 0 <= b < batch for b in seqs):
            raise KvcalError(f"sequences {seqs} asked of a cache holding {batch}: give indices from 0 to {batch - 1}")
        self._plan = None
        if not batch or seqs == list(range(batch)):  # empty (the next forward allocates for its batch), or as it is
            return
        on_device = {}  # the index uploaded once per device
        host_index = torch.tensor(seqs, dtype=torch.long)
        for layer in self.layers:
            if isinstance(layer, RuntimeLayer):
                if layer.inv_freq is not None:  # (allocated: the layer attended)
                    device = str(layer.inv_freq.device)
                    if device not in on_device:
                        on_device[device] = upload(seqs, device)
                    layer.take_sequences(seqs, on_device[device])
            else:  # a hybrid model's own layers (transformers' index_select takes any index)
                layer.reorder_cache(host_index)
        self.lengths = [self.lengths[b] for b in seqs]
        self.position_offset[:] = [self.position_offset[b] for b in seqs]

    def running_plan(self) -> StepPlan:
        """The running step's StepPlan, for a layer reading another's cache (which made it)."""
        if self._plan is None:
            raise KvcalError("a layer reading another's keys and values attended before any layer stored this step's")
        return self._plan

    def inv_freq_on(self, frequencies: torch.Tensor, device) -> torch.Tensor:
        """A layer's RoPE frequencies on `device`, one tensor shared by the layers of equal ones (rope_rows keeps a
        table per tensor): a layer type's (Gemma 3), NoPE layers' zeros (SmolLM3), a RoPE base's (Granite SWA)."""
        key = (str(device), frequencies.detach().cpu().numpy().tobytes())
        if key not in self._inv_freq:
            self._inv_freq[key] = frequencies.to(device)
        return self._inv_freq[key]

    def rope_rows(self, offsets: list[int], tokens: int, inv_freq: torch.Tensor, rope_scaling: float,
                  windowed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (1 or batch, >= tokens, head_dim / 2) at each sequence's positions offset .. offset + tokens - 1 for
        the CPU kernel (cpu_kernel.half_rope_tables): one row set for the batch when every sequence starts at the same
        position, kept between steps and grown by doubling (a decode step adds one token: the tables are made again
        only every so often; for the layers dropping tokens out of their span, `windowed`, whenever their first stored
        token moves)."""
        starts = tuple(offsets) if len(set(offsets)) > 1 else (offsets[0],)
        key = (inv_freq.data_ptr(), rope_scaling, windowed)  # one entry per set of frequencies (models may have two)
        held_starts, held = self._rope_rows.get(key, (None, None))
        if held_starts != starts or held[0].shape[1] < tokens:
            capacity = max(tokens, 2 * held[0].shape[1] if held_starts == starts else 0, 256)
            positions = torch.arange(capacity, device=inv_freq.device)[None, :] + torch.tensor(starts, device=inv_freq.device)[:, None]
            held = cpu_kernel.half_rope_tables(*reference.rope_tables(positions, inv_freq, rope_scaling))
            self._rope_rows[key] = (starts, held)
        return held

    def _describe_model(self) -> str:
        return f"{type(self.model).__name__} at {id(self.model):#x}"

    def _check_open(self) -> None:
        if self.closed:
            raise KvcalError("this quantized cache is closed (its `with quantized_cache(...)` block ended or close() was "
                             "called); open a new one with quantized_cache(model, bundle)")

    def close(self) -> None:
        """Stop serving and unwire the model (idempotent); the last open cache restores its attention implementation."""
        if not self.closed:
            self.closed = True
            wiring.unwire(self._wiring, self)
            for hook in [self._regenerate_hook, *self._refusal_hooks]:
                if hook is not None:
                    hook.remove()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def stores(self):
        """(store, sequence) for every allocated K and V store of every layer."""
        for layer in self.attention_layers:
            for store in (layer.keys_store, layer.values_store):
                if store is not None:
                    yield from ((store, b) for b in range(len(layer.position_offset)))

    def used_bytes(self) -> int:
        """Bytes the cache holds now: codes, parameters, outliers, fp16 segments, indexer keys (not capacity)."""
        return sum(store.used_bytes(b) for store, b in self.stores()) + sum(layer.index_bytes()
                                                                           for layer in self.attention_layers)

    def outliers(self) -> int:
        return sum(store.outliers(b) for store, b in self.stores())

    def load(self, context: FpContext, chunk_bytes: int | None = None) -> None:
        """Fill the empty cache with a context's keys and values (see FpContext), a layer at a time and within a
        layer a few whole sequences at a time: besides the cache, the load holds at most chunk_bytes of fp16 rows (or
        one sequence's; None: LOAD_CHUNK_BYTES, on CPU CPU_LOAD_CHUNK_BYTES) and what the encoders make of them,
        whatever the batch (a context's rows may be views of one sequence's, expanded). Layers that keep a recurrent
        state get a copy of the context's."""
        self._check_open()
        rows = [layer.context_rows(keys, values)  # first: every layer's widths checked before anything is stored
                for layer, keys, values in zip(self.attention_layers, context.keys, context.values)]
        batch, tokens = context.values[0].shape[:2]
        chunk_bytes = chunk_bytes or (CPU_LOAD_CHUNK_BYTES if context.values[0].device.type == "cpu" else LOAD_CHUNK_BYTES)
        indexed = [i for i, handles in enumerate(self.adapter.layers) if handles.indexer is not None]
        if indexed and (context.index_keys is None or any(context.index_keys[i] is None or
                                                          context.index_keys[i].shape[:2] != (batch, tokens) for i in indexed)):
            raise KvcalError(f"this context holds no indexer keys of layers {indexed} (their sparse attention's) for its "
                             f"{batch} x {tokens} tokens; load a context that fp_context made for this model")
        context.copy_states_into(self)  # (it refuses a context without the states this model keeps)
        self.rope_era(tokens)
        self.lengths, self.position_offset, self._plan = [tokens] * batch, [0] * batch, None
        for layer, (keys, values), pre_rope_keys in zip(self.attention_layers, rows, context.pre_rope_keys):
            layer.load(keys, pre_rope_keys, values, self.position_offset, chunk_bytes)
        for i in indexed:
            self.attention_layers[i].index_keys = StoredRows.encoded(self.indexer_keys, context.index_keys[i])

    def tokens(self) -> list[int]:
        """Tokens each sequence has had (its sliding-window layers hold fewer)."""
        layer = self.attention_layers[0]
        return [layer.keys_store.total(b) for b in range(len(layer.position_offset))] if layer.keys_store else []


def quantized_cache(model, bundle, cuda_layout: str = "rows", later_steps: str = "prefill") -> WiredCache:
    """A quantized cache for `model` following `bundle` (a path or a loaded Bundle); refuses a bundle made
    for another model. Use it as `with quantized_cache(model, bundle) as cache: model.generate(...,
    cache=cache)`; the model is wired for the cache until it is closed. cuda_layout: how the CUDA append
    kernels lay out a packed body, each token's row whole ("rows") or each KV head's rows together ("heads"); the
    kernels read either, to the same bits (kvcal.runtime.kernels.AppendKernels). CPU stores keep each KV head's rows
    together whatever it says. later_steps: how a step of several tokens after a sequence's first (speculative
    decoding's checks, a chat's next turn) reads its own tokens: "prefill" in fp16, appended after (the decode
    kernels read the stored tokens), or "decode" each query as the decode step of its token would (the tokens the
    step moves to the quantized body read quantized from that step on; KVmix's RPC count decaying a token at a time),
    so that speculative decoding gives greedy's logits up to float rounding (RuntimeLayer._short_step re-reads the
    tokens a step moved, kvcal.runtime.reference.reread; or the torch reference reads the step)."""
    if cuda_layout not in STORE_LAYOUTS:
        raise KvcalError(f"cuda_layout {cuda_layout!r}: give one of {', '.join(map(repr, STORE_LAYOUTS))}")
    if later_steps not in LATER_STEPS:
        raise KvcalError(f"later_steps {later_steps!r}: give one of {', '.join(map(repr, LATER_STEPS))}")
    encoder_for = functools.partial(backends.append_encoder, cuda_rows_together=STORE_LAYOUTS[cuda_layout])
    adapter = adapt(model)
    if not isinstance(bundle, Bundle):
        bundle = load_bundle(bundle)
    bundle.check_model(adapter)
    layers = []
    for i, recipe in enumerate(bundle.layers):
        codecs, policy = bundle.layer_codecs(i), recipe.format.policy(recipe)

        def make_store(kind, batch, width, device, codecs=codecs, policy=policy, recipe=recipe,
                       head_dims=(adapter.head_dims[i], adapter.value_dims[i])):
            codec = codecs.key_codec if kind == "k" else codecs.value_codec
            rpc = recipe.rpc_k if kind == "k" else recipe.rpc_v
            return SegmentedStore(codec, policy, kind == "k", rpc, batch, width, device, encoder_for=encoder_for,
                                  head_dim=head_dims[kind == "v"], decode_later_steps=later_steps == "decode")
        layers.append(runtime_layer(make_store, codecs.key_pre_rope, adapter, i))
    return taking(WiredCache, model.config.model_type)(model, adapter, layers, bundle.indexer_keys)
