"""The quantized KV cache for Hugging Face models: `model.generate(..., cache=cache)` (`past_key_values=cache` before
transformers 5.24, kvcal.model_caches.CACHE_ARGUMENT).

`quantized_cache(model, bundle)` returns a `WiredCache`, a transformers `Cache` of one `RuntimeLayer` per attention
layer, each with a store for K and one for V built from the bundle's recipe (kvcal.runtime.segments); it refuses a
bundle made for another model. A hybrid model's other layers (Qwen3.5's gated DeltaNet) keep their recurrent state
in transformers' own cache layers, in place among them; an attention layer with a recurrent mixer beside it
(Falcon-H1's Mamba 2) keeps that state in its RuntimeLayer (StatefulRuntimeLayer). While open (until `close()` or
the end of its `with` block) the model is wired through kvcal.wiring: attention implementation `kvcal_runtime`
(registered with transformers' AttentionInterface, switched with `model.set_attn_implementation`), which appends to
the stores and attends over them (a decode step with the backend kvcal.runtime.backends chooses for the layer: the
CUDA kernels, the compiled CPU kernel, or the torch reference), and hooks that hand it the pre-RoPE keys and position
ids. The wiring is shared and reference-counted: several caches may be open on one model (each call is served by
the cache passed to it), and the model's own attention implementation comes back when the last one
closes. Storage is allocated at the first forward, when the batch is known.

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
  read as that many decode steps instead (quantized_cache; RuntimeLayer._prefill);
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

import copy
import functools
from dataclasses import dataclass, replace

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin, LinearAttentionCacheLayerMixin, LinearAttentionLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvcal import wiring
from kvcal.adapters import ModelAdapter, adapt, chunk_positions, decoder_of, prefix_lm
from kvcal.bundle import Bundle, load_bundle
from kvcal.errors import KvcalError
from kvcal.model_caches import CACHE_ARGUMENT, cache_argument, model_cache, taking
from kvcal.rope import rotate_keys
from kvcal.runtime import backends, cpu_kernel, reference
from kvcal.runtime.segments import SegmentedStore, out_of_window
from kvcal.runtime.step_plan import StepPlan
from kvcal.runtime.store import STORE_LAYOUTS, upload
from kvcal.spans import AttentionSpan, attention_span, call_mismatch

ATTENTION_NAME = "kvcal_runtime"
LOAD_CHUNK_BYTES = 256 * 2**20  # fp16 rows per append of WiredCache.load
LATER_STEPS = ("prefill", "decode")  # how a step of several tokens after a sequence's first reads them (quantized_cache)
# what a transformers cache layer's recurrent state is made of (conv and recurrent states, their flags and sizes)
_STATE_ATTRIBUTES = tuple(vars(LinearAttentionLayer()))


class RuntimeLayer(CacheLayerMixin):
    """The adapter's attention layer `index`'s cache: K and V stores, made by `make_store(kind, batch, width, device)`;
    with drop_out_of_window (SegmentedStores) a windowed layer holds only what its span needs, else all tokens."""

    def __init__(self, make_store, pre_rope: bool, adapter: ModelAdapter, index: int, drop_out_of_window: bool = True):
        super().__init__()
        self.make_store, self.pre_rope, self.index = make_store, pre_rope, index
        self.span = adapter.spans[index]  # the earlier tokens its queries see (None: all)
        self.drops = drop_out_of_window and self.span is not None  # lets go of the tokens out of every later span
        # its RoPE frequencies for a forward over so many tokens (LongRoPE's two sets), chosen when storage is allocated
        self.frequencies = functools.partial(adapter.layer_inv_freq, index)
        self.inv_freq: torch.Tensor | None = None
        self.rope_scaling = adapter.layer_rope_scaling(index)
        sinks = adapter.layers[index].sinks
        self.sinks = sinks.detach() if sinks is not None else None  # (heads,) attention sinks' logits, or None
        self.softcap = adapter.softcap  # the scores' soft-cap (Gemma 2), or None
        self.keys_store = self.values_store = None
        self.position_offset: list[int | None] = []  # the cache's, shared by its layers (WiredCache.position_offset)
        self.padded_length = 0  # tokens fed, padding included: what transformers counts
        self.pending_pre_rope: torch.Tensor | None = None
        self.cache: WiredCache | None = None  # set by the WiredCache that holds this layer
        self.choice: backends.Choice | None = None  # the decode backend and why, chosen at the first decode step
        self.decoder: backends.LayerDecoder | None = None  # that backend bound to this layer's stores
        self.readers = len(adapter.readers_of(index))  # layers reading this one's cache (KV sharing)
        self.step: ReadStep | None = None  # what this step's attend read, while readers have yet to read it
        # MLA's (kvcal.adapters.LatentAttention): its keys are the rotated key, its values the latent, and its queries'
        # latent part scores the values too; the latent and rotated key transformers handed the cache this step
        self.latent = adapter.layers[index].latent
        self.latent_step: tuple[torch.Tensor, torch.Tensor] | None = None
        self.widths = (adapter.kv_widths[index], adapter.value_widths[index])  # of one token's keys and values
        # a sparse layer's indexer keys (batch, padded_length, channels), as the model computes them and as
        # transformers' cache keeps them (padding too: the indexer scores every column of the mask); None: none yet
        self.index_keys: torch.Tensor | None = None
        # what decodes a step attending to an indexer's pick (the torch reference: the other decoders read every token)
        self.picking: backends.ReferenceDecoder | None = None

    # transformers' cache-layer interface: the attention implementation does the appending. Croppable: its stores take
    # back a multi-token step's last tokens (transformers 5.24's assisted generation asks before its first crop; what a
    # crop cannot take back, WiredCache.crop refuses in one line)
    is_croppable = True

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

    @property
    def decode_path(self) -> str | None:
        """What decodes this layer's steps, known from its first decode step on (None before): "tensor-core" (one
        launch of the tensor-core kernel per cache launch), "cpu-kernel" or "reference" (also once a DeepSeek Sparse
        Attention layer attends to its indexer's pick: past its top-k tokens)."""
        if self.picking is not None:
            return self.picking.path
        return self.decoder.path if self.decoder is not None else None

    def reset(self) -> None:
        """Empty the layer (transformers' Cache.reset): its storage, frequencies and backend are made again at the
        next step."""
        self.keys_store = self.values_store = self.inv_freq = self.pending_pre_rope = self.latent_step = None
        self.choice = self.decoder = self.step = self.index_keys = self.picking = None
        self.position_offset, self.padded_length = [], 0
        self.is_initialized = False

    def take_sequences(self, seqs: list[int], index: torch.Tensor) -> None:
        """Keep sequences seqs[0], seqs[1], ... (repeats allowed; `index` the same on the device) as sequences 0, 1,
        ... (WiredCache.take_sequences; the layer has attended)."""
        self.keys_store.take_sequences(seqs, index)
        self.values_store.take_sequences(seqs, index)
        if self.index_keys is not None:
            self.index_keys = self.index_keys.index_select(0, index)

    def take_back(self, tokens: int) -> list[int]:
        """Take back the last `tokens` tokens of each sequence of the last step (WiredCache.crop, which checked that
        every store can: SegmentedStore.take_back_refusal) -> those sequences."""
        stepped = self.keys_store.take_back(tokens)
        self.values_store.take_back(tokens)
        self.padded_length -= tokens
        if self.index_keys is not None:
            self.index_keys = self.index_keys[:, :-tokens]
        return stepped

    def keep_index_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """Append a step's indexer keys (batch, tokens, channels) -> every token's so far (transformers'
        update_indexer)."""
        self.index_keys = keys if self.index_keys is None else torch.cat([self.index_keys, keys], 1)
        return self.index_keys

    def update_index(self, indexer_keys: torch.Tensor) -> torch.Tensor:
        """Called by a MiniMax-M3 sparse layer's indexer on its cache layer (transformers' MiniMaxM3VLSparseCacheLayer):
        keep the step's indexer keys (batch, 1, tokens, channels) -> every token's so far, (batch, 1, tokens,
        channels)."""
        return self.cache.update_indexer(indexer_keys[:, 0], self.cache.adapter.model_layers[self.index])[:, None]

    def index_bytes(self) -> int:
        return 0 if self.index_keys is None else self.index_keys.numel() * self.index_keys.element_size()

    def _allocate(self, batch: int, device, tokens: int) -> None:
        """Storage for `batch` sequences of the layer's keys and values (`widths`), and the RoPE frequencies of a
        forward over `tokens` tokens, which rotate its keys until it is emptied (WiredCache.rope_era keeps a LongRoPE
        model's forwards to one set)."""
        self.keys_store = self.make_store("k", batch, self.widths[0], device)
        self.values_store = self.make_store("v", batch, self.widths[1], device)
        inv_freq = self.frequencies(tokens)
        self.inv_freq = self.cache.inv_freq_on(inv_freq, device) if self.cache is not None else inv_freq.to(device)

    def _rotated(self, keys: torch.Tensor, positions: torch.Tensor, kv_heads: int) -> torch.Tensor:
        return rotate_keys(keys, positions, kv_heads, self.inv_freq, self.rope_scaling) if self.pre_rope else keys

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: StepPlan, scaling: float,
               window: int | None = None, ahead: torch.Tensor | None = None, latent_query: torch.Tensor | None = None,
               chosen: torch.Tensor | None = None):
        """query (B, H, m, d), key (B, kv_heads, m, d) and value (B, kv_heads, m, d_v) of the new tokens (keys
        post-RoPE) -> (B, m, H, d_v); plan: the step's (which tokens are real, see StepPlan); window: the attention
        call's sliding window (see _span_for); ahead: (B, m, m), the step's tokens each sees after itself under this
        layer's mask (StepPlan.ahead_of), None: none; latent_query: MLA's (B, H, m, d_v), which scores the values too;
        chosen: (B, groups, m, columns of the mask), the tokens each query attends among those it sees, per group of
        query heads (a sparse layer's indexer's pick, wiring.chosen_columns), None: all. A decode step with a pick is
        read by the torch reference (the other decoders read every token)."""
        batch, heads, m, head_dim = query.shape
        kv_heads = key.shape[1]
        width, value_width = self.widths
        span = self._span_for(window, f"layer {self.index}")
        if self.keys_store is None:
            self._allocate(batch, query.device, plan.rope_tokens)
        self.position_offset = plan.offsets
        new_keys = self.pending_pre_rope if self.pre_rope else key.transpose(1, 2).reshape(batch, m, width)
        new_values = value.transpose(1, 2).reshape(batch, m, value_width)
        span = span if span is not None and self.padded_length + m > span.size else None  # some sequence may exceed it
        reads = {} if self.readers and m > 1 else None
        pending = None  # a short step's rows, where layers reading this one's cache attend before they are appended
        if m == 1:  # decode: append every sequence's token, then attend over the cache as stored
            self.keys_store.append_rows(plan.rows, plan.ones, plan.step_rows(new_keys))
            self.values_store.append_rows(plan.rows, plan.ones, plan.step_rows(new_values))
            if latent_query is not None:  # MLA's query parts side by side, as the decoders take them
                query = torch.cat([query.float(), latent_query], -1)
            if chosen is None:
                output = self._decoder(heads, kv_heads, head_dim).decode(query, plan, scaling, kv_heads, span)
            else:
                self.picking = self.picking or backends.ReferenceDecoder(self)
                output = self.picking.decode(query, plan, scaling, kv_heads, span, plan.chosen_rows(chosen))
        else:
            output = (self._short_step(query, new_keys, new_values, plan, scaling, kv_heads, span, ahead, latent_query,
                                       not self.readers) if chosen is None else None)
            if output is None:
                output = self._prefill(query, new_keys, new_values, plan, scaling, kv_heads, span, reads, ahead,
                                       latent_query, chosen)
            elif self.readers:  # appended after them: they read the cache before the step as this layer did
                pending, reads = (new_keys, new_values), None
        self.padded_length += m
        if self.readers:  # they read what this step read, the last of them drops what the window no longer needs
            self.step = ReadStep(kv_heads, span, reads, self.readers, pending)
        else:
            self._drop_out_of_window()
        return output

    def _span_for(self, window: int | None, who: str) -> AttentionSpan | None:
        """The span a step's queries see: the layer's, which the attention call's sliding window must name
        (spans.call_mismatch); where the layer has none, the call's window."""
        if self.span is None:
            return attention_span(window, None)
        mismatch = call_mismatch(window, self.span)
        if mismatch is not None:
            raise KvcalError(f"{who} {mismatch} (layer {self.index}), which its cache drops tokens for; kvcal follows the "
                             "config (transformers' own cache does)")
        return self.span

    def attend_as_reader(self, query: torch.Tensor, plan: StepPlan, scaling: float, window: int | None,
                         ahead: torch.Tensor | None = None) -> torch.Tensor:
        """The attention of a layer reading this one's keys and values (KV sharing), after this layer's attend of the
        step, over what that read: after a decode step the cache as stored, after a prefill each sequence's cache
        before the step and its tokens in fp16. Its queries are the step's last ones (all of them, or as many as
        the logits kept: Gemma 4 runs its reading layers on those alone). The step's last reader lets go of what the
        window no longer needs."""
        step = self.step
        if step is None:
            raise KvcalError(f"a layer reading layer {self.index}'s keys and values attended before layer {self.index} in "
                             "this step; kvcal serves KV sharing where the layer read comes first, as transformers runs it")
        self._span_for(window, f"a layer reading layer {self.index}'s keys and values")
        batch, heads, m, head_dim = query.shape
        output = None
        if step.pending is not None and m == plan.m:  # a short step's every query: through the decoder, as attend read
            output = self._short_step(query, *step.pending, plan, scaling, step.kv_heads, step.span, ahead, None, False)
        if step.reads is None and step.pending is None:
            output = self._decoder(heads, step.kv_heads, head_dim).decode(query, plan, scaling, step.kv_heads, step.span)
        elif output is None:
            reads = step.reads if step.reads is not None else {
                b: (*self._read_with_step(b, *step.pending, plan, step.kv_heads), None) for b in plan.rows}
            output = torch.zeros(batch, m, heads, head_dim, dtype=query.dtype, device=query.device)
            for b, (keys, values, step_reads) in reads.items():
                # (the later tokens each query sees, an image's, are among the queries' own, the step's last)
                self._attend_sequence(output, b, query, None, keys, values, step_reads, plan, scaling, step.kv_heads,
                                      step.span, ahead, None)
        step.readers_left -= 1
        if not step.readers_left:
            self.step = None
            if step.pending is not None:
                self._append_columns(plan.rows, *step.pending, plan)
            self._drop_out_of_window()
        return output

    def _drop_out_of_window(self) -> None:
        """A windowed layer lets go of the tokens no later query sees (kvcal.kv.window_dropped: K and V alike, at the
        body boundary and block size both allow)."""
        if not self.drops:
            return
        dropped = out_of_window(self.keys_store, self.values_store, self.span)
        for store in (self.keys_store, self.values_store):
            store.drop(dropped)

    def _prefill(self, query, new_keys, new_values, plan: StepPlan, scaling: float, kv_heads: int,
                 span: AttentionSpan | None, reads: dict | None, ahead: torch.Tensor | None,
                 latent_query: torch.Tensor | None = None, chosen: torch.Tensor | None = None):
        """Per sequence: the cache so far plus the step's own tokens in fp16 (then appended). A sequence with a
        single real token in the step is decoded: appended first, then the cache is read as stored. `reads` (a
        dict, or None) keeps each sequence's keys and values read, for the layers reading this one's cache. MLA's
        latent_query scores the values beside the query the keys: one attention over keys and values side by side.
        chosen: as attend's."""
        batch, heads, m, _ = query.shape
        output = torch.zeros(batch, m, heads, new_values.shape[-1] // kv_heads, dtype=query.dtype, device=query.device)
        single = [b for b in plan.rows if plan.counts[b] == 1]
        several = [b for b in plan.rows if plan.counts[b] > 1]
        as_decodes = {b: self._decode_step_reads(b, new_keys, new_values, plan, kv_heads)
                      for b in several if plan.before[b] and self.keys_store.decode_later_steps}
        if single:
            self._append_columns(single, new_keys, new_values, plan)
        for b in plan.rows:
            if b in as_decodes:
                continue  # read once the step is appended
            if plan.counts[b] == 1:
                keys, values = self._read(b, kv_heads)
            else:
                keys, values = self._read_with_step(b, new_keys, new_values, plan, kv_heads)
            self._attend_sequence(output, b, query, latent_query, keys, values, None, plan, scaling, kv_heads, span,
                                  ahead, chosen)
            if reads is not None:
                reads[b] = (keys, values, None)
        if several:
            self._append_columns(several, new_keys, new_values, plan)
        for b, step_reads in as_decodes.items():
            keys, values = self._read(b, kv_heads)
            self._attend_sequence(output, b, query, latent_query, keys, values, step_reads, plan, scaling, kv_heads,
                                  span, ahead, chosen)
            if reads is not None:
                reads[b] = (keys, values, step_reads)
        return output

    def _attend_sequence(self, output, b: int, query, latent_query, keys, values, step_reads, plan: StepPlan,
                         scaling: float, kv_heads: int, span: AttentionSpan | None, ahead: torch.Tensor | None,
                         chosen: torch.Tensor | None) -> None:
        """output[b]'s rows of the step's real tokens: sequence b's queries over its keys and values read
        (step_reads: as _decode_step_reads gives them where the step is read as decode steps, else None); the queries
        may be the step's last ones alone (a layer reading this one's cache)."""
        first = plan.m - query.shape[2]  # the step's column of the first query
        real = plan.columns(b)
        rows = real[real >= first] - first
        if not len(rows):
            return
        seen = ahead[b][rows][:, rows] if ahead is not None and len(rows) > 1 else None
        queries = query[b, :, rows]
        if latent_query is not None:  # (one KV head: the scores of the keys and of the values summed)
            queries = torch.cat([queries.float(), latent_query[b, :, rows]], -1)
        picked = plan.chosen_tokens(chosen, b) if chosen is not None else None
        dropped = self.keys_store.dropped[b]
        if step_reads is None:
            scored = keys if latent_query is None else torch.cat([keys, values], -1)
            out = reference.attention(queries, scored, values, scaling, span, self.sinks, self.softcap, seen, dropped,
                                      picked)
        else:
            out = reference.decode_steps_attention(queries, keys, values, scaling, *step_reads, kv_heads,
                                                   span, self.sinks, self.softcap, seen, dropped, picked,
                                                   latent_query is not None)
        output[b, rows] = out.transpose(0, 1).to(output.dtype)

    def _decode_step_reads(self, b: int, new_keys, new_values, plan: StepPlan, kv_heads: int):
        """(keys', values') kvcal.runtime.segments.DecodeStepReads of sequence b's tokens in this step, about to be
        appended, with float32 rows (keys rotated at their positions): how its queries read
        the tokens the step moves to the body when the step is read as decode steps."""
        rows = plan.columns(b)
        keys = self.keys_store.decode_step_reads(b, new_keys[b, rows])
        values = self.values_store.decode_step_reads(b, new_values[b, rows])
        positions = torch.arange(keys.start, keys.start + len(keys.rows), device=new_keys.device)
        positions = positions + self.keys_store.dropped[b] + self.position_offset[b]
        keys = replace(keys, rows=self._rotated(keys.rows.float(), positions, kv_heads))
        return keys, replace(values, rows=values.rows.float())

    def _read_with_step(self, b: int, new_keys, new_values, plan: StepPlan,
                        kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence b's keys and values as a step of several tokens attends over them: those stored before it, read,
        then the step's own in fp16 (keys rotated at their positions)."""
        before_keys, before_values = self._read(b, kv_heads)
        rows = plan.columns(b)
        positions = torch.arange(plan.before[b], plan.before[b] + len(rows), device=new_keys.device) + plan.offsets[b]
        keys = torch.cat([before_keys, self._rotated(new_keys[b, rows].half().float(), positions, kv_heads)])
        return keys, torch.cat([before_values, new_values[b, rows].half().float()])

    def _short_step(self, query, new_keys, new_values, plan: StepPlan, scaling: float, kv_heads: int,
                    span: AttentionSpan | None, ahead: torch.Tensor | None, latent_query: torch.Tensor | None,
                    append: bool) -> torch.Tensor | None:
        """A step of several tokens a sequence over a stored cache (speculative decoding's candidates, a chat turn):
        the decoder's attention over each sequence's stored tokens (LayerDecoder.stored_attention: a decode kernel
        reads them as at a decode step, the cache not dequantized; under a span each query from its own first token),
        merged by log-sum-exp with attention over the step's own tokens in fp16; _prefill's attention up to float
        rounding. The step's rows are appended here where `append` (else by the caller, after the layers reading this
        one's cache). With later steps read as decode steps (decode_later_steps) each query then re-reads the tokens
        the step moved to the body as its decode step would (_reread_as_decode_steps). None where _prefill serves it:
        a sequence of one token (a decode, read as stored), nothing stored yet, a decoder that does not serve it or
        not a step this long (the torch reference: _prefill is its way), or a step read as decode steps whose rows
        layers reading this one's cache wait for."""
        batch, heads, m, head_dim = query.shape
        as_decodes = self.keys_store.decode_later_steps
        if (any(plan.counts[b] == 1 for b in plan.rows) or not any(plan.before[b] for b in plan.rows)
                or (as_decodes and not append)):
            return None
        queries = query if latent_query is None else torch.cat([query.float(), latent_query], -1)
        stored = self._decoder(heads, kv_heads, head_dim).stored_attention(queries, plan, scaling, kv_heads, span)
        if stored is None:
            return None
        stored_out, stored_lse = stored
        # the step's own tokens, every sequence at once (padding sees and is seen by none)
        valid, in_sequence = plan.valid, plan.in_sequence()
        offsets = torch.tensor([o or 0 for o in plan.offsets], device=query.device)[:, None]
        keys = self._rotated(new_keys.half().float().reshape(batch * m, -1), (offsets + in_sequence).reshape(-1),
                             kv_heads).view(batch, m, -1)
        values = new_values.half().float()
        scored = keys if latent_query is None else torch.cat([keys, values], -1)
        seen = torch.ones(m, m, dtype=torch.bool, device=query.device).tril() & valid[:, None, :]
        if span is not None:  # (B, query, key): the key in the query's window or chunk
            seen = seen & (in_sequence[:, None, :] >= span.first_seen(in_sequence)[:, :, None])
        seen = seen if ahead is None else seen | ahead
        own_out, own_lse = reference.own_attention(queries, scored, values, scaling, self.softcap, seen)
        own_out, own_lse = own_out.transpose(1, 2), own_lse.transpose(1, 2)
        step_reads = ({b: self._decode_step_reads(b, new_keys, new_values, plan, kv_heads)
                       for b in plan.rows if plan.before[b]} if as_decodes else None)  # (before the step is appended)
        if append:
            self._append_columns(plan.rows, new_keys, new_values, plan)
        if as_decodes:
            out = reference.merge_attention(stored_out, stored_lse, own_out, own_lse)
            lse = torch.logaddexp(stored_lse, own_lse)
            self._reread_as_decode_steps(out, lse, queries, step_reads, plan, scaling, kv_heads, span, ahead,
                                         latent_query is not None)
            merged = reference.with_sinks(out, lse, self.sinks)
        else:
            merged = reference.merge_attention(stored_out, stored_lse, own_out, own_lse, self.sinks)
        return merged.masked_fill(~valid[:, :, None, None], 0.0).to(query.dtype)

    def _reread_as_decode_steps(self, out, lse, queries, step_reads: dict, plan: StepPlan, scaling: float,
                                kv_heads: int, span: AttentionSpan | None, ahead: torch.Tensor | None,
                                latent: bool) -> None:
        """Correct, in place, a short step's out (B, m, H, d_v) and lse (B, m, H) (no sinks), which read its
        sequences' tokens as the cache held them before it and its own in fp16, to each query reading the tokens the
        step moved to the body as its decode step would (step_reads: _decode_step_reads' of each sequence with tokens
        stored before; the step appended): reference.reread over those tokens alone, their quantized rows read from
        the body (from the block holding the first) and their fp16 rows from step_reads."""
        for b, (key_reads, value_reads) in step_reads.items():
            moved = [(reads.start, reads.ends[-1]) for reads in (key_reads, value_reads) if reads.ends[-1] > reads.start]
            if not moved:
                continue
            # the tokens some query reads otherwise on some side (a side that moved none reads them alike throughout)
            first, stop = min(start for start, _ in moved), max(end for _, end in moved)
            dropped = self.keys_store.dropped[b]
            tokens = torch.arange(first, stop, device=out.device)
            quantized = (self._rotated(self.keys_store.read_from(b, first)[: stop - first],
                                       tokens + dropped + self.position_offset[b], kv_heads),
                         self.values_store.read_from(b, first)[: stop - first])
            sides = []
            for reads, rows in zip((key_reads, value_reads), quantized):
                before = min(max(reads.start - first, 0), stop - first)  # tokens read quantized by every query
                fp16 = torch.cat([rows[:before], reads.rows[max(first - reads.start, 0) : max(stop - reads.start, 0)]])
                ends = upload(reads.ends, out.device)
                sides.append((rows, fp16, tokens >= reads.start, tokens[None, :] >= ends[:, None]))
            columns = plan.columns(b)
            seen = ahead[b][columns][:, columns] if ahead is not None else None
            # (over the stored tokens from `first` on: the step's queries are their last, as over all of them)
            seen = reference.visibility(self.keys_store.count(b) - first, len(columns), span, seen, None, dropped + first,
                                        out.device)(0, len(columns))[:, : stop - first]
            reread_out, reread_lse = reference.reread(out[b, columns].transpose(0, 1), lse[b, columns].T,
                                                      queries[b, :, columns], *sides, seen, scaling, kv_heads,
                                                      self.softcap, latent)
            out[b, columns], lse[b, columns] = reread_out.transpose(0, 1), reread_lse.T

    def _append_columns(self, seqs: list[int], new_keys, new_values, plan: StepPlan) -> None:
        """Append the real tokens of sequences `seqs` (one store operation per segment for all of them)."""
        counts = [plan.counts[b] for b in seqs]
        for store, new in ((self.keys_store, new_keys), (self.values_store, new_values)):
            store.append_rows(seqs, counts, plan.real_rows(new, seqs))

    def context_rows(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A context's rows of this layer as transformers' cache holds them (MLA's latent as its keys, its rotated key
        as its values) -> its keys and values; refused where their widths are not the model's."""
        if self.latent is not None:
            keys, values = values, keys
        if (keys.shape[-1], values.shape[-1]) != self.widths:
            raise KvcalError(f"the context's keys and values of layer {self.index} are {keys.shape[-1]} and "
                             f"{values.shape[-1]} channels wide, the model's {self.widths[0]} and {self.widths[1]}: load "
                             "a context that fp_context made for this model")
        return keys, values

    def load(self, keys: torch.Tensor, pre_rope_keys: torch.Tensor, values: torch.Tensor, offsets: list[int],
             chunk_bytes: int) -> None:
        """Store a context computed elsewhere, rows (batch, tokens, width) unpadded at positions 0.. (context_rows'),
        as if it had been prefilled into this cache (keys post-RoPE, pre_rope_keys before RoPE), a few whole sequences
        at a time: at most chunk_bytes of fp16 rows per append, or one sequence."""
        # post-RoPE keys in kvcal's channel order, as the model's are not (pre_rope_keys are), but MLA's where RoPE
        # leaves them so
        in_order = self.latent is not None and self.latent.rope_in_order
        batch, tokens = keys.shape[:2]
        width, value_width = self.widths
        self._allocate(batch, values.device, tokens)
        self.position_offset = offsets
        step = max(1, chunk_bytes // max(tokens * (width + value_width), 1))
        for first in range(0, batch, step):
            seqs = list(range(first, min(first + step, batch)))
            chunk = lambda rows: rows[seqs[0] : seqs[-1] + 1].reshape(len(seqs) * tokens, rows.shape[-1]).half()
            stored_keys = (chunk(pre_rope_keys) if self.pre_rope else chunk(keys) if in_order
                           else self.cache.adapter.rows_in_rope_order(chunk(keys), self.index))
            self.keys_store.append_rows(seqs, [tokens] * len(seqs), stored_keys)
            self.values_store.append_rows(seqs, [tokens] * len(seqs), chunk(values))
        self.padded_length = tokens
        self._drop_out_of_window()

    def _decoder(self, heads: int, kv_heads: int, head_dim: int) -> backends.LayerDecoder:
        """The decoder of this step: the backend chosen at the first decode step (kvcal.runtime.backends.choose),
        bound to this layer's stores."""
        if self.decoder is None:
            pairs = tuple(zip(self.keys_store.packed_codecs(), self.values_store.packed_codecs()))
            latent = self.latent is not None
            shape = backends.LayerShape(pairs, self.pre_rope, heads, kv_heads, head_dim, self.inv_freq.device,
                                        self.keys_store.fp16_rows_like(self.values_store), latent,
                                        None if latent else self.widths[1] // kv_heads)
            self.choice = backends.choose(shape)
            self.decoder = self.choice.backend.bind(self, shape)
        return self.decoder

    def _read(self, b: int, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys = reference.stored_keys(self.keys_store, b, self.pre_rope, self.position_offset[b], self.inv_freq,
                                     self.rope_scaling, kv_heads)
        return keys, self.values_store.read(b)


@dataclass
class ReadStep:
    """What a layer's attend of the step read, for the layers reading its cache: KV heads, the span it applied, and
    per sequence the keys and values a prefill read and how its queries read the tokens it moved to the body where it
    is read as decode steps (RuntimeLayer._decode_step_reads, else None); None after a decode step, which read the
    cache as stored, and after a short step, whose own rows wait in `pending` until the last reader: they read the
    cache before it."""

    kv_heads: int
    span: AttentionSpan | None
    reads: dict[int, tuple[torch.Tensor, torch.Tensor, tuple | None]] | None
    readers_left: int
    pending: tuple[torch.Tensor, torch.Tensor] | None = None  # a short step's own keys and values, appended after them


class StatefulRuntimeLayer(RuntimeLayer, LinearAttentionLayer):
    """The cache of an attention layer that also runs a recurrent mixer beside its attention (Falcon-H1's Mamba 2):
    kvcal's K and V stores and transformers' conv and recurrent states, which the mixer finds in the layer by its
    class (a LinearAttentionCacheLayerMixin) and updates in place. The WiredCache holding it gives it the states'
    layout of transformers' own layer for it (take_state)."""

    def __init__(self, *args, **kwargs):
        RuntimeLayer.__init__(self, *args, **kwargs)
        LinearAttentionLayer.__init__(self)

    def reset(self) -> None:
        RuntimeLayer.reset(self)
        LinearAttentionLayer.reset(self)

    def take_sequences(self, seqs: list[int], index: torch.Tensor) -> None:
        RuntimeLayer.take_sequences(self, seqs, index)
        LinearAttentionLayer.reorder_cache(self, index)  # (its states' index_select: any index)

    def lazy_initialization(self, *args, **kwargs) -> None:
        # the attention's call passes keys and values, the mixer's its states by keyword
        if args:
            RuntimeLayer.lazy_initialization(self, *args)
        else:
            LinearAttentionLayer.lazy_initialization(self, **kwargs)


def runtime_layer(make_store, pre_rope: bool, adapter: ModelAdapter, index: int,
                  drop_out_of_window: bool = True) -> RuntimeLayer:
    """The cache of the adapter's attention layer `index` (see RuntimeLayer): one that keeps a recurrent state too
    where the layer has a mixer beside its attention."""
    kind = StatefulRuntimeLayer if adapter.keeps_state[index] else RuntimeLayer
    return kind(make_store, pre_rope, adapter, index, drop_out_of_window)


def take_state(layer, source) -> None:
    """Give a cache layer that keeps a recurrent state (transformers' LinearAttentionCacheLayerMixin) a copy of
    `source`'s: decode steps update states in place, so no two caches may share one."""
    for name in _STATE_ATTRIBUTES:
        setattr(layer, name, copy.deepcopy(getattr(source, name)))


# why a step that pads a sequence is refused where an indexer picks key blocks (ModelAdapter.picks_key_blocks)
BLOCKS_UNDER_PADDING = ("MiniMax-M3's block-sparse indexer places its key blocks by cache column and its queries by "
                        "position, which padding sets apart: a padded sequence's picks are not its own (transformers' own "
                        "cache gives it other tokens than it alone); give sequences of equal length, or one at a time")


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
    plan = layer.cache.plan_for(attention_mask, query, slot.wiring.positions)
    layer.pending_pre_rope = slot.pre_rope_keys
    chosen = wiring.chosen_columns(kwargs, layer.padded_length + query.shape[2], adapter.layers[slot.index].pick_block)
    latent = layer.latent
    if latent is not None:  # the step's latent and rotated key, as transformers handed the cache them
        (latents, rotated_keys), layer.latent_step = layer.latent_step, None
        rotated = query[..., latent.nope_dim :]
        if not latent.rope_in_order:
            rotated, rotated_keys = adapter.in_rope_order(rotated, slot.index), adapter.in_rope_order(rotated_keys, slot.index)
        out = layer.attend(rotated, rotated_keys, latents, plan, scale, sliding_window, None,
                           latent.latent_query(query[..., : latent.nope_dim]), chosen)
        return latent.head_outputs(out.transpose(1, 2)).transpose(1, 2).to(query.dtype), None
    return layer.attend(adapter.in_rope_order(query, slot.index), adapter.in_rope_order(key, slot.index), value, plan, scale,
                        sliding_window, plan.ahead_of(attention_mask), chosen=chosen), None


def _register_attention() -> None:
    wiring.register(ATTENTION_NAME, _runtime_attention, "a kvcal quantized cache (kvcal.runtime.quantized_cache)")


class WiredCache(Cache):
    """A transformers Cache of RuntimeLayers for one model (its attention layers, `attention_layers`; a hybrid model's
    other layers are transformers' own), which it wires (kvcal.wiring) while open; serves only that model, only while
    open (see the module docstring)."""

    def __init__(self, model, adapter: ModelAdapter, layers: list[RuntimeLayer]):
        every = DynamicCache(config=model.config).layers if adapter.hybrid or any(adapter.keeps_state) else list(layers)
        for decoder_index, layer in zip(adapter.model_layers, layers):
            if isinstance(layer, StatefulRuntimeLayer):
                take_state(layer, every[decoder_index])  # transformers' empty states, as many as its layer holds
            every[decoder_index] = layer
        Cache.__init__(self, layers=every)  # (by name: kvcal.model_caches.taking puts a model's cache class next)
        self.attention_layers = layers
        self._attention_index = {decoder_index: i for i, decoder_index in enumerate(adapter.model_layers)}
        self.model, self.adapter = model, adapter
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
            if self._wiring.multimodal:
                pre_rope = [i for i, layer in enumerate(self.attention_layers) if layer.pre_rope]
                if pre_rope:
                    raise KvcalError(wiring.multimodal_refusal(pre_rope))
        self._wiring.serve(index, self.attention_layers[index])
        if self.adapter.latent:  # MLA's: its latent and rotated key (LatentAttention), which its attention reads
            self.attention_layers[index].latent_step = (key_states, value_states)
        return key_states, value_states

    def update_indexer(self, indexer_keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Called by a DeepSeek Sparse Attention layer's indexer (and by RuntimeLayer.update_index): keep the step's
        indexer keys (batch, tokens, channels) as the model computes them -> the layer's every token's so far."""
        self._check_open()
        index = self._attention_index.get(layer_idx)
        if index is None or self.adapter.layers[index].indexer is None:
            raise KvcalError(f"decoder layer {layer_idx} has no sparse attention indexer whose keys this cache keeps")
        return self.attention_layers[index].keep_index_keys(indexer_keys)

    def plan_for(self, attention_mask, query: torch.Tensor, positions: torch.Tensor | None) -> StepPlan:
        """The running step's StepPlan, made by its first layer from that layer's attention mask and position ids."""
        batch, _, m, _ = query.shape
        if self._plan is None or (self._plan.batch, self._plan.m) != (batch, m):
            self._plan = StepPlan(self, attention_mask, batch, m, query.device, positions)
        return self._plan

    def refuse_padded_step(self) -> None:
        """Refuse a step that pads a sequence of a model picking key blocks (BLOCKS_UNDER_PADDING; StepPlan asks, before
        the cache counts the step; no earlier step padded, each was refused so), leaving the cache as it was before the
        step: the indexer keys a layer kept for it (those past its padded length) let go."""
        for layer in self.attention_layers:
            if layer.index_keys is not None:
                layer.index_keys = layer.index_keys[:, : layer.padded_length] if layer.padded_length else None
        raise KvcalError(BLOCKS_UNDER_PADDING)

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
            if self._regenerate_hook is not None:
                self._regenerate_hook.remove()

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

    def load(self, context: FpContext, chunk_bytes: int = LOAD_CHUNK_BYTES) -> None:
        """Fill the empty cache with a context's keys and values (see FpContext), a layer at a time and within a
        layer a few whole sequences at a time: besides the cache, the load holds at most chunk_bytes of fp16 rows (or
        one sequence's) and what the encoders make of them, whatever the batch (a context's rows may be views of one
        sequence's, expanded). Layers that keep a recurrent state get a copy of the context's."""
        self._check_open()
        rows = [layer.context_rows(keys, values)  # first: every layer's widths checked before anything is stored
                for layer, keys, values in zip(self.attention_layers, context.keys, context.values)]
        batch, tokens = context.values[0].shape[:2]
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
            self.attention_layers[i].index_keys = context.index_keys[i]

    def tokens(self) -> list[int]:
        """Tokens each sequence has had (its sliding-window layers hold fewer)."""
        layer = self.attention_layers[0]
        return [layer.keys_store.total(b) for b in range(len(layer.position_offset))] if layer.keys_store else []


@dataclass
class FpContext:
    """The KV cache of a context from one fp prefill, per layer (batch, tokens, width) rows: keys after RoPE (as the
    model caches them), keys before RoPE (as kvcal reads them: in its channel order, kvcal.adapters), values; `cache`
    is the model's own (DynamicCache) copy, None in a context of rows only (of a model without recurrent states).
    Loading it into several quantized caches (WiredCache.load) shares one prefill between methods."""

    keys: list[torch.Tensor]
    pre_rope_keys: list[torch.Tensor]
    values: list[torch.Tensor]
    cache: Cache | None
    # per layer, its sparse attention's indexer keys (batch, tokens, channels), None where it has none
    index_keys: list[torch.Tensor | None] | None = None

    def copy_states_into(self, cache: Cache) -> None:
        """Give each layer of `cache` (laid out as the model's) that keeps a recurrent state a copy of the context's
        (a hybrid model's DeltaNet, Mamba or convolution layers; Falcon-H1's attention layers)."""
        stateful = [i for i, layer in enumerate(cache.layers) if isinstance(layer, LinearAttentionCacheLayerMixin)]
        if stateful and self.cache is None:
            raise KvcalError(f"this context holds rows only (no cache), none of the recurrent states of the model's layers "
                             f"{stateful}; load a context made by fp_context")
        for i in stateful:
            take_state(cache.layers[i], self.cache.layers[i])


def fp_context(model, ids: torch.Tensor, chunk: int | None = None) -> FpContext:
    """Prefill ids (batch, tokens), unpadded, with the fp model and keep its KV cache (with the model's own
    attention implementation, also while a quantized cache is open on it), in steps of `chunk` tokens (None: one
    step; a long context needs steps to keep the prefill's attention within memory). The rows keep every token of
    every layer, so that a quantized cache loading them holds what it would after its own prefill; `cache` is the
    model's own DynamicCache, whose sliding-window layers hold their window only (trimmed to it after each step)."""
    if prefix_lm(model):  # (the decoder alone, handed no token types, would read the context both ways)
        raise KvcalError(f"{type(model).__name__} reads a prompt both ways where its token types say so, which a prefill "
                         "of its decoder alone cannot be told; evaluate it with kvcal eval ppl or agreement")
    adapter = adapt(model)
    step = chunk or ids.shape[1]
    if adapter.long_rope is not None:
        adapter.long_rope.check_prefill_steps(ids.shape[1], step)
    pre_rope: list[list[torch.Tensor]] = [[] for _ in adapter.layers]
    hooks = [handles.key_source.register_forward_hook(
        lambda module, inputs, output, h=handles, i=i: pre_rope[i].append(h.source_rows("k", output.detach())))
        for i, handles in enumerate(adapter.layers)]
    try:
        cache = model_cache(model)
        attending = [cache.layers[i] for i in adapter.model_layers]  # (a hybrid model's others keep a state)
        sliding = {i: {"keys": [], "values": []} for i, layer in enumerate(attending) if layer.is_sliding}
        for i in sliding:
            attending[i].activate_past_recording()
        with wiring.suspended(adapter):  # the decoder alone: the logits of every prompt token are never needed
            for start in range(0, ids.shape[1], step):
                piece = ids[:, start : start + step]
                decoder_of(model)(piece, **cache_argument(cache), use_cache=True, position_ids=chunk_positions(start, piece))
                for i, kept in sliding.items():
                    for kind, parts in kept.items():
                        parts.append(getattr(attending[i], kind)[:, :, -piece.shape[1] :].clone())
                    # back to its window: the next step reads what its mask covers (transformers before 5.18 hands
                    # a recording layer every token it holds)
                    attending[i].crop(0)
    finally:
        for hook in hooks:
            hook.remove()

    def rows(i: int, kind: str) -> torch.Tensor:
        """Layer i's keys or values of every token (batch, tokens, width): a sliding layer's as kept per step."""
        x = torch.cat(sliding[i][kind], 2) if i in sliding else getattr(attending[i], kind)
        return x.transpose(1, 2).flatten(2)  # (batch, kv_heads, tokens, head_dim) -> (batch, tokens, width)

    layers = range(len(attending))
    return FpContext([rows(i, "keys") for i in layers], [torch.cat(parts, 1) for parts in pre_rope],
                     [rows(i, "values") for i in layers], cache, [_indexer_keys(layer) for layer in attending])


def _indexer_keys(layer) -> torch.Tensor | None:
    """A transformers cache layer's indexer keys (batch, tokens, channels): DeepSeek Sparse Attention's
    (indexer_keys), MiniMax-M3's (idx_keys, of one head); None where it keeps none."""
    keys = getattr(layer, "indexer_keys", None)
    if keys is None and getattr(layer, "idx_keys", None) is not None:
        keys = layer.idx_keys[:, 0]
    return keys


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
    return taking(WiredCache, model.config.model_type)(model, adapter, layers)
