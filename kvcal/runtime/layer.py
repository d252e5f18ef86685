"""One attention layer's part of the quantized cache (RuntimeLayer): its K and V stores (kvcal.runtime.segments) and
how a step attends over them and its own tokens (a prefill, a decode step, a short step, a layer reading another's
cache), within its window or chunk; and the layer that also keeps a recurrent mixer's state (StatefulRuntimeLayer).
The semantics it keeps are the cache's (kvcal.runtime.cache)."""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import CacheLayerMixin, LinearAttentionLayer

from kvcal.adapters import ModelAdapter
from kvcal.errors import KvcalError
from kvcal.indexer_keys import StoredRows
from kvcal.rope import rotate_keys
from kvcal.runtime import backends, heap, reference
from kvcal.runtime.memory import FP16_BYTES
from kvcal.runtime.segments import out_of_window
from kvcal.runtime.step_plan import StepPlan
from kvcal.runtime.store import upload
from kvcal.spans import AttentionSpan, attention_span, call_mismatch

if TYPE_CHECKING:  # (the cache that holds a layer, which imports this module)
    from kvcal.runtime.cache import WiredCache

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
        # a sparse layer's indexer keys (batch, padded_length, channels) as the cache's indexer_keys format keeps them,
        # padding too, as transformers' cache keeps them (the indexer scores every column of the mask); None: none yet
        self.index_keys: StoredRows | None = None
        # what decodes a step attending to an indexer's pick (the torch reference: the other decoders read every token)
        self.picking: backends.ReferenceDecoder | None = None
        # (position rows, batch, tokens): position ids Qwen4-Exp's model hands its first indexed layer's cache layer for
        # its indexers, the stored tokens' then the step's (indexer_position_ids); None: none kept
        self._indexer_positions: torch.Tensor | None = None

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
        self.choice = self.decoder = self.step = self.index_keys = self.picking = self._indexer_positions = None
        self.position_offset, self.padded_length = [], 0
        self.is_initialized = False

    def take_sequences(self, seqs: list[int], index: torch.Tensor) -> None:
        """Keep sequences seqs[0], seqs[1], ... (repeats allowed; `index` the same on the device) as sequences 0, 1,
        ... (WiredCache.take_sequences; the layer has attended)."""
        self.keys_store.take_sequences(seqs, index)
        self.values_store.take_sequences(seqs, index)
        if self.index_keys is not None:
            self.index_keys = self.index_keys.sequences(index)
        if self._indexer_positions is not None:
            self._indexer_positions = self._indexer_positions.index_select(1, index)

    def take_back(self, tokens: int) -> list[int]:
        """Take back the last `tokens` tokens of each sequence of the last step (WiredCache.crop, which checked that
        every store can: SegmentedStore.take_back_refusal) -> those sequences."""
        stepped = self.keys_store.take_back(tokens)
        self.values_store.take_back(tokens)
        self.padded_length -= tokens
        self.index_keys, self._indexer_positions = self._stored_index_keys(), self.indexer_position_ids
        return stepped

    def _stored_index_keys(self) -> StoredRows | None:
        """The stored tokens' indexer keys (the first padded_length); None where it stored none. A step refused after
        the model handed over its own leaves them past padded_length, let go so."""
        return self.index_keys.first(self.padded_length) if self.index_keys is not None and self.padded_length else None

    @property
    def indexer_position_ids(self) -> torch.Tensor | None:
        """The position ids (rows, batch, padded_length) of the stored tokens, which Qwen4-Exp's model keeps on its
        first indexed layer's cache layer (transformers' DynamicIndexedLayer's) and reads at a step's start; None: none
        kept. Those of a step refused after the model handed them over are not kept (a cache that stored nothing keeps
        none: the next step may bring another batch)."""
        positions = self._indexer_positions
        return positions.narrow(-1, 0, self.padded_length) if positions is not None and self.padded_length else None

    @indexer_position_ids.setter
    def indexer_position_ids(self, positions: torch.Tensor | None) -> None:
        self._indexer_positions = positions

    def keep_index_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """Append a step's indexer keys (batch, tokens, channels) to the stored tokens' -> every token's so far, as
        stored (transformers' update_indexer; those of a step refused after the model handed them over are not kept)."""
        stored, step = self._stored_index_keys(), StoredRows.encoded(self.cache.indexer_keys, keys)
        self.index_keys = step if stored is None else stored.appended(step)
        return self.index_keys.decoded()

    def update_index(self, indexer_keys: torch.Tensor) -> torch.Tensor:
        """Called by a MiniMax-M3 sparse layer's indexer on its cache layer (transformers' MiniMaxM3VLSparseCacheLayer):
        keep the step's indexer keys (batch, 1, tokens, channels) -> every token's so far, (batch, 1, tokens,
        channels)."""
        return self.cache.update_indexer(indexer_keys[:, 0], self.cache.adapter.model_layers[self.index])[:, None]

    def index_bytes(self) -> int:
        kept = self._stored_index_keys()
        return 0 if kept is None else kept.nbytes

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
        pre_rope_keys, self.pending_pre_rope = self.pending_pre_rope, None  # (a prefill's: not held past its step)
        batch, heads, m, head_dim = query.shape
        kv_heads = key.shape[1]
        width, value_width = self.widths
        span = self._span_for(window, f"layer {self.index}")
        if self.keys_store is None:
            self._allocate(batch, query.device, plan.rope_tokens)
        self.position_offset = plan.offsets
        new_keys = pre_rope_keys if self.pre_rope else key.transpose(1, 2).reshape(batch, m, width)
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
            self._release_after_step(plan, query.device)
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
            self._release_after_step(plan, query.device)
        return output

    def _release_after_step(self, plan: StepPlan, device: torch.device) -> None:
        """After the layer's part of a step of several tokens, its readers' too: the heap its temporaries freed
        handed back where it grew (kvcal.runtime.heap, on CPU)."""
        if plan.m > 1:
            heap.release_if_grown(device)

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
        self._allocate(batch, values.device, tokens)
        self.position_offset = offsets
        step = max(1, chunk_bytes // max(FP16_BYTES * tokens * sum(self.widths), 1))  # sequences per append
        for first in range(0, batch, step):
            seqs = list(range(first, min(first + step, batch)))
            chunk = lambda rows: rows[seqs[0] : seqs[-1] + 1].reshape(len(seqs) * tokens, rows.shape[-1]).half()
            stored_keys = (chunk(pre_rope_keys) if self.pre_rope else chunk(keys) if in_order
                           else self.cache.adapter.rows_in_rope_order(chunk(keys), self.index))
            self.keys_store.append_rows(seqs, [tokens] * len(seqs), stored_keys)
            self.values_store.append_rows(seqs, [tokens] * len(seqs), chunk(values))
        self.padded_length = tokens
        self._drop_out_of_window()
        heap.release_if_grown(values.device)

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
