"""One of K or V of one layer, as segments of one cache (kvcal.runtime.store holds the bytes).

- SegmentedStore: fp16 sinks | quantized body | fp16 recent tokens (an SKVQ window, a KIVI residual, a
  KVmix recent pivotal context, keys waiting for a whole per-channel block). Which recent tokens stay
  fp16 follows the layer's SegmentPolicy, exactly as the simulation (kvcal.simulate) reads them, plus
  KVmix's RPC: after a step that brought m new tokens, num_RPC = floor(r * (m + previous num_RPC)) of
  the latest tokens stay fp16 (so a long prefill keeps r of it in fp16, and token-by-token decoding
  decays it to none).
- CocktailStore: fp16 chunks | int4 chunks | int2 chunks | fp16 recent: everything is fp16 until
  `compress` moves the context's chunks to the width Cocktail chose for each, grouped by width; every
  chunk keeps its start position, so RoPE and attention are unchanged by the reordering.
Positions returned by `positions(b)` count the sequence's own tokens from 0 (padding is never stored).

Both append a batch at once (`append_rows`: rows of several sequences, grouped by sequence): which rows go
to which segment is decided per sequence in Python (lengths are lists), then each segment is written with
one indexed store and the body encodes everything leaving the fp16 segments with one call. `read_batch`
reads every sequence at once for the batched reference decode: (batch, tokens, C) float32 in the store's
order, sequence b's tokens first (see `assemble`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from kvcal.errors import KvcalError
from kvcal.kv import SegmentPolicy, window_dropped
from kvcal.runtime.store import Fp16Rows, PackedRows, spans, upload
from kvcal.spans import AttentionSpan

POSITION_BYTES = 4  # a Cocktail chunk's start position, int32
# a step of several tokens keeps a copy of the last tokens it moved to the body (SegmentedStore.undo_rows), so that up
# to this many of its last tokens can be taken back (SegmentedStore.take_back: speculative decoding's rejected ones)
UNDO_TOKENS = 64


@dataclass
class _Undo:
    """What a step of several tokens did to a SegmentedStore: its sequences and their tokens, per sequence before it
    (sink, body and recent lengths, RPC count, tokens dropped) and its route (SegmentedStore._route), and a copy of
    the last tokens it moved to the body (fp16, grouped by sequence: `tail` of each, the last of its moved ones)."""

    seqs: list[int]
    counts: list[int]
    before: list[tuple[int, int, int, int, int]]
    routes: list[tuple[int, int, int, int]]
    tail_rows: torch.Tensor | None
    tail: dict[int, int]


@dataclass
class DecodeStepReads:
    """How a step of several tokens read as decode steps reads one store's tokens past the body it had before the
    step (stored tokens `start` on): query i of the step, as the decode step of its token would, reads those before
    ends[i] quantized (from the store's read after the step) and the others as `rows`, their fp16 rows (the recent
    tokens before the step, then the step's own)."""

    start: int
    rows: torch.Tensor
    ends: list[int]


@dataclass
class _Kept:
    """What taking tokens back leaves of one sequence (SegmentedStore._taken_back): its sink and body lengths, RPC
    count, the rows of the step's tail copy that are fp16 recent tokens again, and how many stored recent tokens stay
    after them."""

    seq: int
    sinks: int
    body: int
    rpc: int
    copied_back: slice
    stayed: int


class SegmentedStore:
    def __init__(self, codec, policy: SegmentPolicy, keys: bool, rpc_ratio: float, batch: int, width: int, device,
                 layout: str | None = None, encoder_for=None, head_dim: int | None = None,
                 decode_later_steps: bool = False):
        """encoder_for: how the packed body encodes (kvcal.runtime.store.PackedRows); None = the torch codec.
        head_dim: channels per KV head, needed by codecs that keep outliers. decode_later_steps: a step of several
        tokens after a sequence's first is routed as that many one-token steps (KVmix's RPC count decays a token at a
        time; every other policy routes alike either way), the runtime's later_steps="decode"."""
        self.policy, self.keys, self.rpc_ratio = policy, keys, rpc_ratio
        self.decode_later_steps = decode_later_steps
        self.sink = Fp16Rows(batch, width, device)
        self.body = PackedRows(codec, batch, width, device, encoder_for, layout, head_dim)
        self.recent = Fp16Rows(batch, width, device)
        self.rpc = [0] * batch
        self.dropped = [0] * batch  # tokens dropped from the front: stored token i is the sequence's token dropped + i
        self._undo: _Undo | None = None  # the last append's, where it was a step of several tokens (UNDO_TOKENS)
        # how many of the last tokens a step moves to the body its log copies: the fp16 tokens after a step of n - t
        # tokens are at most t plus what the count kept fp16 may swing by (keys leave a KIVI residual whole, and
        # per-channel blocks whole) more than after n
        self.undo_rows = UNDO_TOKENS + max((self.body.block, *((policy.residual, policy.key_block) if keys else ())))

    ordered = True  # read_batch gives each sequence's tokens in position order

    def count(self, b: int) -> int:
        """Tokens stored."""
        return self.sink.length[b] + self.body.length[b] + self.recent.length[b]

    def total(self, b: int) -> int:
        """Tokens the sequence has had, dropped ones included (what the segment policy counts)."""
        return self.dropped[b] + self.count(b)

    def sinks(self, b: int) -> int:
        """The sequence's tokens that went to its fp16 sinks (dropped ones included)."""
        return min(self.policy.sink, self.total(b))

    def body_end(self, b: int) -> int:
        """The sequence's token after its last body row (fp16 recent tokens follow)."""
        return self.sinks(b) + self.body.dropped[b] + self.body.length[b]

    def drop(self, dropped: list[int]) -> None:
        """Drop each sequence b's first tokens up to dropped[b] in all (a sliding window's, kvcal.kv.window_dropped):
        its sinks, then body rows; then give back storage the body no longer needs."""
        for b, target in enumerate(dropped):
            if target > self.dropped[b]:
                rows = target - self.sinks(b) - self.body.dropped[b]
                self.sink.clear(b)
                self.body.drop_front(b, rows)
                self.dropped[b] = target
        self.body.release()

    def append(self, b: int, x: torch.Tensor) -> None:
        """Store new fp16 tokens (tokens, C) of sequence b, quantizing those that leave the fp16 segments."""
        self.append_rows([b], [len(x)], x)

    def _route(self, b: int, n: int) -> tuple[int, int, int, int]:
        """Where n new tokens of sequence b go: (tokens to its sinks, tokens leaving for the body (its oldest recent
        tokens first, then new ones), how many of those leave the recent segment, its RPC count after the step)."""
        return self._route_from(self.total(b), self.recent.length[b], self.rpc[b], n)

    def _route_from(self, total: int, stored: int, rpc: int, n: int) -> tuple[int, int, int, int]:
        """_route of a sequence that has had `total` tokens, `stored` of them fp16 recent ones, after RPC count `rpc`."""
        if self.decode_later_steps and total and n != 1:  # (no token: no step, the RPC count as it was)
            routes = self._token_routes(total, stored, rpc, n)
            leaving = sum(route[1] for route in routes)
            return sum(route[0] for route in routes), leaving, min(leaving, stored), routes[-1][3] if routes else rpc
        return _route(self.policy, self.keys, self.rpc_ratio, self.body.block, total, stored, rpc, n)

    def _token_routes(self, total: int, stored: int, rpc: int, n: int) -> tuple[tuple[int, int, int, int], ...]:
        """_route_from of each of n tokens appended one at a time."""
        return _token_routes(self.policy, self.keys, self.rpc_ratio, self.body.block, total, stored, rpc, n)

    def decode_step_reads(self, b: int, rows: torch.Tensor) -> DecodeStepReads:
        """How the queries of a step bringing sequence b fp16 `rows` (tokens, C), about to be appended, read this
        store when the step is read as that many decode steps (decode_later_steps): see DecodeStepReads."""
        start = self.sink.length[b] + self.body.length[b]
        body, ends = self.body.length[b], []
        sinks = self.sink.length[b]
        for to_sink, leaving, _, _ in self._token_routes(self.total(b), self.recent.length[b], self.rpc[b], len(rows)):
            sinks, body = sinks + to_sink, body + leaving
            ends.append(sinks + body)
        return DecodeStepReads(start, torch.cat([self.recent.read(b), rows.to(torch.float16)]), ends)

    def append_rows(self, seqs: list[int], counts: list[int], x: torch.Tensor) -> None:
        """Store new fp16 tokens x (sum(counts), C), counts[i] of them for sequence seqs[i], grouped in that order:
        each sequence's first tokens fill its sinks, the rest join its recent fp16 tokens, and those that leave
        the recent segment (the oldest first: earlier recent tokens, then new ones) are quantized into the body,
        all sequences at once. A step of several tokens a sequence is logged for take_back."""
        logged = max(counts, default=0) > 1
        before = [(self.sink.length[b], self.body.length[b], self.recent.length[b], self.rpc[b], self.dropped[b])
                  for b in seqs] if logged else None
        self._undo = None
        routes = [self._route(b, n) for b, n in zip(seqs, counts)]
        for b, route in zip(seqs, routes):
            self.rpc[b] = route[3]
        if counts.count(1) == len(counts) and len(set(routes)) == 1 and self._append_one_each(seqs, counts, routes[0], x):
            return
        sink, new, recent = ([], [], []), ([], [], []), ([], [], [])  # (sequences, counts, first rows in x) each
        old_seqs, old_counts = [], []  # recent tokens leaving from the front of the fp16 segment
        body_seqs, body_counts, from_old_first = [], [], []  # what the body gets, per sequence: old tokens first
        first = 0
        for b, n, (to_sink, leaving, from_old, _) in zip(seqs, counts, routes):
            from_new = leaving - from_old
            _add(sink, b, first, to_sink)
            _add(new, b, first + to_sink, from_new)
            _add(recent, b, first + to_sink + from_new, n - to_sink - from_new)
            if from_old:
                old_seqs.append(b)
                old_counts.append(from_old)
            if leaving:
                body_seqs.append(b)
                body_counts.append(leaving)
                from_old_first.append(from_old)
            first += n
        if sink[0]:
            self.sink.write(sink[0], sink[1], _rows(x, sink[2], sink[1]))
        leaving_rows = None
        if body_seqs:
            old = self.recent.take_front(old_seqs, old_counts) if old_seqs else None
            fresh = _rows(x, new[2], new[1]) if new[0] else None
            if old is None or fresh is None:
                leaving_rows = fresh if old is None else old
            else:  # each sequence's old tokens, then its new ones: runs of cat([old, fresh]), interleaved
                from_old = np.asarray(from_old_first, dtype=np.int64)
                from_new = np.asarray(body_counts, dtype=np.int64) - from_old
                firsts = np.stack([np.cumsum(from_old) - from_old, len(old) + np.cumsum(from_new) - from_new], 1)
                order = spans(firsts.reshape(-1), np.stack([from_old, from_new], 1).reshape(-1))
                leaving_rows = torch.cat([old, fresh.to(old.dtype)]).index_select(0, upload(order, old.device))
            self.body.append_rows(body_seqs, body_counts, leaving_rows)
        if logged:  # (copied before the recent segment is written over the rows that left it)
            self._undo = self._log(seqs, counts, before, routes, body_seqs, body_counts, leaving_rows)
        if recent[0]:
            self.recent.write(recent[0], recent[1], _rows(x, recent[2], recent[1]))

    def _log(self, seqs, counts, before, routes, body_seqs, body_counts, leaving_rows) -> _Undo:
        """The undo log of an append (see _Undo): a copy of the last `undo_rows` of each sequence's rows that left for
        the body (leaving_rows, grouped as body_seqs), which a take_back may need in fp16 again."""
        tail = {b: min(n, self.undo_rows) for b, n in zip(body_seqs, body_counts)}
        tail_rows = None
        if body_seqs:
            copied = [tail[b] for b in body_seqs]
            tail_rows = _rows(leaving_rows, list(np.cumsum(body_counts) - copied), copied).clone()
        return _Undo(list(seqs), list(counts), before, routes, tail_rows, tail)

    def _taken_back(self, tokens: int) -> list[_Kept] | str:
        """Per sequence of the last append, what taking back its last `tokens` tokens leaves; or why that cannot be
        done exactly."""
        undo = self._undo
        if undo is None:
            return "the last step brought one token a sequence (a decode step), which is not logged"
        if min(undo.counts) < tokens or tokens > UNDO_TOKENS:
            return f"the last step brought {min(undo.counts)} tokens to a sequence; up to {UNDO_TOKENS} of them can go"
        kept, first = [], 0
        for b, n, (sink, body, recent, rpc, dropped), (to_sink, leaving, _, _) in zip(undo.seqs, undo.counts, undo.before,
                                                                                    undo.routes):
            if self.dropped[b] != dropped:
                return "a sliding window let go of tokens after that step, which taking its last tokens back needs again"
            to_sink_kept, leaving_kept, _, rpc_kept = self._route_from(dropped + sink + body + recent, recent, rpc,
                                                                       n - tokens)
            # the step's stream: its recent tokens before it, then its tokens past the sinks; it moved the stream's
            # first `leaving` to the body (the copy holds the last `copied` of those), the shorter step its first
            # `leaving_kept`, and keeps the rest of its `stream` tokens fp16 (a shorter step that only fills sinks
            # has none: the sinks fill before anything else is stored)
            stream, copied = recent + n - tokens - to_sink_kept, undo.tail.get(b, 0)
            copy_start = leaving - copied
            if leaving_kept < copy_start:
                return "the shorter step would keep fp16 more tokens than the step moved to the body and logged"
            copied_back = slice(first + leaving_kept - copy_start, first + min(stream, leaving) - copy_start)
            kept.append(_Kept(b, sink + to_sink_kept, body + leaving_kept, rpc_kept, copied_back, max(stream - leaving, 0)))
            first += copied
        return kept

    def take_back_refusal(self, tokens: int) -> str | None:
        """Why the last `tokens` tokens of each sequence of the last append cannot be taken back exactly, or None."""
        kept = self._taken_back(tokens)
        return kept if isinstance(kept, str) else None

    def take_back(self, tokens: int) -> list[int]:
        """Take back each sequence's last `tokens` tokens of the last append (a step of several tokens; see
        take_back_refusal) -> the sequences it brought tokens to. The store is then what a step without them would
        have left: the body keeps the rows such a step moves to it (each quantized alike: codecs quantize rows and
        blocks on their own), its later rows and their outliers go, and the recent segment holds the tokens after
        them in fp16, from the step's tail copy and from itself; RPC counts are the shorter step's."""
        kept = self._taken_back(tokens)
        if isinstance(kept, str):
            raise KvcalError(f"cannot take back {tokens} tokens: {kept}")
        undo, self._undo = self._undo, None
        self.body.truncate([part.seq for part in kept], [part.body for part in kept])
        pieces, counts = [], []
        for part in kept:
            back = part.copied_back
            pieces += [undo.tail_rows[back]] if back.stop > back.start else []  # (no copy where nothing left)
            pieces.append(self.recent.read(part.seq)[: part.stayed])
            counts.append(max(back.stop - back.start, 0) + part.stayed)
        rows = torch.cat(pieces)  # (a copy: the recent segment is written over below)
        for part in kept:
            self.recent.clear(part.seq)
            self.sink.length[part.seq], self.rpc[part.seq] = part.sinks, part.rpc
        self.recent.write(undo.seqs, counts, rows)
        return undo.seqs

    def _append_one_each(self, seqs: list[int], ones: list[int], route: tuple[int, int, int, int], x: torch.Tensor) -> bool:
        """A decode step's steady cases, every sequence one token (ones: its counts) routed alike (the cases of
        append_rows, without its row bookkeeping): the token joins the recent tokens, goes straight to the body, or
        joins the recent tokens as their oldest moves to the body. False for any other route (sinks filling, blocks
        leaving)."""
        to_sink, leaving, from_old, _ = route
        if to_sink or leaving > 1:
            return False
        if leaving and not from_old:
            self.body.append_rows(seqs, ones, x)
            return True
        if leaving:  # the oldest recent token of each sequence is quantized before the recent segment is written
            self.body.append_rows(seqs, ones, self.recent.take_front(seqs, ones))
        self.recent.write(seqs, ones, x)
        return True

    def read(self, b: int) -> torch.Tensor:
        """(tokens, C) float32 in position order, the body dequantized."""
        return torch.cat([self.sink.read(b).float(), self.body.read(b), self.recent.read(b).float()])

    def read_from(self, b: int, first: int) -> torch.Tensor:
        """read(b)[first:], dequantizing only the body rows from the block holding the first it needs."""
        sinks, body = self.sink.length[b], self.body.length[b]
        row = min(max(first - sinks, 0), body)
        aligned = row - (self.body.head[b] + row) % self.body.block
        return torch.cat([self.sink.read(b)[first:].float(), self.body.read(b, aligned)[row - aligned :],
                          self.recent.read(b)[max(first - sinks - body, 0) :].float()])

    def parts(self) -> list[tuple[torch.Tensor, list[int], list[int]]]:
        return [self.sink.part(), self.body.part(), self.recent.part()]

    def read_batch(self, memo: dict | None = None, heads: int | None = None) -> torch.Tensor:
        """Every sequence at once: (batch, most tokens, C) float32 in position order, or (batch, heads, most tokens,
        C / heads) with `heads` (see assemble)."""
        return assemble(self.parts(), memo, heads)

    def positions(self, b: int) -> torch.Tensor:
        return torch.arange(self.dropped[b], self.total(b), device=self.sink.data.device)

    def used_bytes(self, b: int) -> int:
        return self.sink.used_bytes(b) + self.body.used_bytes(b) + self.recent.used_bytes(b)

    def outliers(self, b: int) -> int:
        return self.body.outliers[b]

    def take_sequences(self, seqs: list[int], index: torch.Tensor) -> None:
        """Keep sequences seqs[0], seqs[1], ... (repeats allowed; `index` the same on the device) as sequences 0, 1,
        ... (kvcal.runtime.store.Fp16Rows.take_sequences)."""
        for segment in (self.sink, self.body, self.recent):
            segment.take_sequences(seqs, index)
        self.rpc, self.dropped = [self.rpc[b] for b in seqs], [self.dropped[b] for b in seqs]
        self._undo = None  # (its sequences are no longer these)

    def kernel_segments(self) -> list[tuple]:
        """(fp16 sink, packed body, fp16 recent) per decode-attention launch (kvcal.runtime.kernels), in position order."""
        return [(self.sink, self.body, self.recent)]

    def fp16_rows_like(self, other: SegmentedStore) -> bool:
        """Whether this store (a layer's K) and `other` (its V) keep the same tokens fp16 at every step."""
        return self.policy == other.policy and fp16_rows_alike(self.policy, (self.body.block, other.body.block),
                                                               (self.rpc_ratio, other.rpc_ratio))

    def packed_codecs(self) -> list:
        return [self.body.codec]


class CocktailStore:
    WIDTHS = (16, 4, 2)

    def __init__(self, codecs: dict, chunk: int, batch: int, width: int, device, encoder_for=None):
        self.chunk, self.device = chunk, device
        self.parts = {16: Fp16Rows(batch, width, device),
                      **{bits: PackedRows(codecs[bits], batch, width, device, encoder_for) for bits in (4, 2)}}
        self.chunk_starts = {bits: [[] for _ in range(batch)] for bits in self.WIDTHS}
        self.recent = Fp16Rows(batch, width, device)
        self.recent_start = [0] * batch
        self.dropped = [0] * batch  # tokens dropped from the front: none (a Cocktail cache serves no sliding window)

    ordered = False  # read_batch gives chunks grouped by width (positions(b) says where each token is)
    decode_later_steps = False  # (every step's tokens stay fp16 until compress: read alike either way)

    def count(self, b: int) -> int:
        return sum(part.length[b] for part in self.parts.values()) + self.recent.length[b]

    def append(self, b: int, x: torch.Tensor) -> None:
        self.recent.append(b, x)

    def append_rows(self, seqs: list[int], counts: list[int], x: torch.Tensor) -> None:
        self.recent.write(seqs, counts, x)

    def compress(self, b: int, chunk_bits: list[int]) -> None:
        """Move the first len(chunk_bits) chunks of the fp16 tokens to their widths (16, 4 or 2)."""
        if len(chunk_bits) * self.chunk > self.recent.length[b]:
            raise ValueError(f"{len(chunk_bits)} chunks of {self.chunk} tokens but only {self.recent.length[b]} tokens are cached")
        if not chunk_bits:  # a context shorter than a chunk stays fp16
            return
        start = self.recent_start[b]
        rows = self.recent.pop_front(b, len(chunk_bits) * self.chunk).view(len(chunk_bits), self.chunk, -1)
        for bits in self.WIDTHS:
            chosen = [i for i, w in enumerate(chunk_bits) if w == bits]
            if chosen:
                self.parts[bits].append(b, rows[chosen].flatten(0, 1))
                self.chunk_starts[bits][b].extend(start + i * self.chunk for i in chosen)
        self.recent_start[b] = start + len(chunk_bits) * self.chunk

    def read(self, b: int) -> torch.Tensor:
        return torch.cat([self.parts[bits].read(b).float() for bits in self.WIDTHS] + [self.recent.read(b).float()])

    def read_batch(self, memo: dict | None = None, heads: int | None = None) -> torch.Tensor:
        """Every sequence at once in the order of read(b): (batch, most tokens, C) float32, or (batch, heads, most
        tokens, C / heads) with `heads` (see assemble)."""
        return assemble([self.parts[bits].part() for bits in self.WIDTHS] + [self.recent.part()], memo, heads)

    def positions(self, b: int) -> torch.Tensor:
        within = torch.arange(self.chunk)
        parts = [(torch.tensor(self.chunk_starts[bits][b], dtype=torch.long)[:, None] + within).flatten() for bits in self.WIDTHS]
        parts.append(self.recent_start[b] + torch.arange(self.recent.length[b]))
        return torch.cat(parts).to(self.device)

    def used_bytes(self, b: int) -> int:
        chunks = sum(len(self.chunk_starts[bits][b]) for bits in self.WIDTHS)
        return sum(part.used_bytes(b) for part in self.parts.values()) + self.recent.used_bytes(b) + chunks * POSITION_BYTES

    def outliers(self, b: int) -> int:
        return 0

    def take_sequences(self, seqs: list[int], index: torch.Tensor) -> None:
        """Keep sequences seqs[0], seqs[1], ... (see SegmentedStore.take_sequences)."""
        for part in (*self.parts.values(), self.recent):
            part.take_sequences(seqs, index)
        self.chunk_starts = {bits: [list(starts[b]) for b in seqs] for bits, starts in self.chunk_starts.items()}
        self.recent_start, self.dropped = [self.recent_start[b] for b in seqs], [self.dropped[b] for b in seqs]

    def fp16_rows_like(self, other: CocktailStore) -> bool:
        """K's and V's chunks move together (`compress`): their fp16 chunks and recent tokens are the same tokens."""
        return True

    def kernel_segments(self) -> list[tuple]:
        """One launch per packed width, the int4 chunks' also over the fp16 chunks (as its sinks) and the recent
        tokens: RoPE is already applied, so no token's place matters, and no launch is fp16 alone (the tensor-core
        kernel's segment blocks read those rows in the int4 launch)."""
        return [(self.parts[16], self.parts[4], self.recent), (None, self.parts[2], None)]

    def packed_codecs(self) -> list:
        return [self.parts[bits].codec for bits in (4, 2)]


def _route(policy: SegmentPolicy, keys: bool, rpc_ratio: float, block: int, total: int, stored: int, rpc: int,
           n: int) -> tuple[int, int, int, int]:
    """SegmentedStore._route_from of a step of n tokens, for a store of this policy, side, RPC ratio and body block."""
    to_sink = max(min(policy.sink - total, n), 0)
    rest = n - to_sink
    fp16_recent = policy.fp16_recent(total + n, keys)
    if rpc_ratio:
        rpc = math.floor(rpc_ratio * (rest + rpc))
        fp16_recent = max(fp16_recent, rpc)
    leaving = max(0, stored + rest - fp16_recent)
    leaving -= leaving % block  # per-channel key blocks leave whole
    return to_sink, leaving, min(leaving, stored), rpc


@functools.lru_cache(maxsize=64)  # every layer of a step asks alike for a sequence and side, twice
def _token_routes(policy: SegmentPolicy, keys: bool, rpc_ratio: float, block: int, total: int, stored: int, rpc: int,
                  n: int) -> tuple[tuple[int, int, int, int], ...]:
    """_route of each of n tokens appended one at a time."""
    routes = []
    for _ in range(n):
        routes.append(_route(policy, keys, rpc_ratio, block, total, stored, rpc, 1))
        to_sink, leaving, _, rpc = routes[-1]
        total, stored = total + 1, stored + 1 - to_sink - leaving
    return tuple(routes)


def fp16_rows_alike(policy: SegmentPolicy, blocks: tuple[int, int], rpc: tuple[float, float]) -> bool:
    """Whether a layer's K and V stores under one segment policy (blocks: their bodies' row blocks, rpc: their RPC
    ratios; keys' first) keep the same tokens fp16 at every step: sinks and windows do; a KIVI residual (values leave
    it a token at a time, keys a block at a time), per-channel key blocks and unequal RPC ratios do not."""
    return not policy.residual and not policy.key_block and blocks == (1, 1) and rpc[0] == rpc[1]


def out_of_window(keys: SegmentedStore, values: SegmentedStore, span: AttentionSpan) -> list[int]:
    """Per sequence, how many first tokens a windowed layer's K and V stores may have dropped, alike
    (kvcal.kv.window_dropped at the body end and block size both allow)."""
    block = math.lcm(keys.body.block, values.body.block)
    return [window_dropped(keys.total(b), keys.sinks(b), min(keys.body_end(b), values.body_end(b)), block, span)
            for b in range(len(keys.dropped))]


def _add(target: tuple[list, list, list], b: int, first: int, count: int) -> None:
    if count:
        target[0].append(b)
        target[1].append(count)
        target[2].append(first)


def _rows(x: torch.Tensor, firsts: list[int], counts: list[int]) -> torch.Tensor:
    """Rows firsts[i] .. firsts[i] + counts[i] - 1 of x for every i, in order: a view when they are one run."""
    if all(firsts[i + 1] == firsts[i] + counts[i] for i in range(len(firsts) - 1)):
        return x[firsts[0] : firsts[0] + sum(counts)]
    return x.index_select(0, upload(spans(firsts, counts), x.device))


def assemble(parts: list[tuple[torch.Tensor, list[int], list[int]]], memo: dict | None = None, heads: int | None = None) -> torch.Tensor:
    """Every sequence's live rows of `parts` (each: rows (batch, n, C), first live row, live rows per sequence), part
    after part, as one float32 tensor (batch, N, C), N the most rows of a sequence, or with `heads` (batch, heads, N,
    C / heads) contiguous, as attention reads it; sequence b's rows come first and the rest is finite filler. One cat
    when every sequence has the same layout, else one row gather whose index is made once per layout (memo: shared
    by the layers of a step)."""
    batch, width = parts[0][0].shape[0], parts[0][0].shape[2]
    split = (lambda rows: rows) if heads is None else (lambda rows: rows.unflatten(2, (heads, width // heads)).transpose(1, 2))
    if all(len(set(starts)) <= 1 and len(set(lengths)) <= 1 for _, starts, lengths in parts):
        pieces = [split(rows[:, starts[0] : starts[0] + lengths[0]]) for rows, starts, lengths in parts if lengths and lengths[0]]
        if not pieces:
            return split(parts[0][0].new_zeros(batch, 0, width, dtype=torch.float32)).contiguous()
        out = torch.cat(pieces, 1 if heads is None else 2).contiguous()
        return out if out.dtype == torch.float32 else out.float()
    columns = sum(rows.shape[1] for rows, _, _ in parts)
    key = ("assemble", columns, heads, tuple((tuple(starts), tuple(lengths)) for _, starts, lengths in parts))
    index = memo.get(key) if memo is not None else None
    if index is None:
        per_sequence: list[list[int]] = [[] for _ in range(batch)]
        offset = 0
        for rows, starts, lengths in parts:
            for b in range(batch):
                first = b * columns + offset + starts[b]
                per_sequence[b].extend(range(first, first + lengths[b]))
            offset += rows.shape[1]
        most = max(len(rows) for rows in per_sequence)
        index = np.array([rows + [b * columns] * (most - len(rows)) for b, rows in enumerate(per_sequence)], dtype=np.int64)
        if heads is not None:  # rows of one head: (b, h, position) -> source row * heads + h
            index = index[:, None, :] * heads + np.arange(heads)[None, :, None]
        index = upload(np.ascontiguousarray(index.reshape(-1)), parts[0][0].device)
        if memo is not None:
            memo[key] = index
    source = torch.cat([rows.float() for rows, _, _ in parts], 1)
    if heads is None:
        return source.view(batch * columns, width).index_select(0, index).view(batch, -1, width)
    # (sizes given: a key of no channel leaves -1 ambiguous)
    return (source.view(batch * columns * heads, width // heads).index_select(0, index)
            .view(batch, heads, index.numel() // (batch * heads), width // heads))
