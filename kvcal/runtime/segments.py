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
"""

from __future__ import annotations

import math

import torch

from kvcal.runtime.store import Fp16Rows, PackedRows
from kvcal.simulate import SegmentPolicy

POSITION_BYTES = 4  # a Cocktail chunk's start position, int32


class SegmentedStore:
    def __init__(self, codec, policy: SegmentPolicy, keys: bool, rpc_ratio: float, batch: int, width: int, device,
                 layout: str | None = None):
        self.policy, self.keys, self.rpc_ratio = policy, keys, rpc_ratio
        self.sink = Fp16Rows(batch, width, device)
        self.body = PackedRows(codec, batch, width, device, layout=layout)
        self.recent = Fp16Rows(batch, width, device)
        self.rpc = [0] * batch

    def count(self, b: int) -> int:
        return self.sink.length[b] + self.body.length[b] + self.recent.length[b]

    def append(self, b: int, x: torch.Tensor) -> None:
        """Store new fp16 tokens (tokens, C) of sequence b, quantizing those that leave the fp16 segments."""
        to_sink = min(self.policy.sink - self.sink.length[b], len(x))
        self.sink.append(b, x[:to_sink])
        x = x[to_sink:]
        self.recent.append(b, x)
        fp16_recent = int(self.policy.fp16_recent(self.count(b), self.keys))
        if self.rpc_ratio:
            self.rpc[b] = math.floor(self.rpc_ratio * (len(x) + self.rpc[b]))
            fp16_recent = max(fp16_recent, self.rpc[b])
        leaving = max(0, self.recent.length[b] - fp16_recent)
        leaving -= leaving % self.body.block  # per-channel key blocks leave whole
        if leaving:
            self.body.append(b, self.recent.pop_front(b, leaving))

    def read(self, b: int) -> torch.Tensor:
        """(tokens, C) float32 in position order, the body dequantized."""
        return torch.cat([self.sink.read(b).float(), self.body.read(b), self.recent.read(b).float()])

    def positions(self, b: int) -> torch.Tensor:
        return torch.arange(self.count(b), device=self.sink.data.device)

    def used_bytes(self, b: int) -> int:
        return self.sink.used_bytes(b) + self.body.used_bytes(b) + self.recent.used_bytes(b)

    def outliers(self, b: int) -> int:
        return self.body.outliers[b]

    def kernel_segments(self) -> list[tuple]:
        """(fp16 sink, packed body, fp16 recent) per decode-attention launch (kvcal.runtime.kernels), in position order."""
        return [(self.sink, self.body, self.recent)]

    def packed_codecs(self) -> list:
        return [self.body.codec]


class CocktailStore:
    WIDTHS = (16, 4, 2)

    def __init__(self, codecs: dict, chunk: int, batch: int, width: int, device):
        self.chunk, self.device = chunk, device
        self.parts = {16: Fp16Rows(batch, width, device), **{bits: PackedRows(codecs[bits], batch, width, device) for bits in (4, 2)}}
        self.chunk_starts = {bits: [[] for _ in range(batch)] for bits in self.WIDTHS}
        self.recent = Fp16Rows(batch, width, device)
        self.recent_start = [0] * batch

    def count(self, b: int) -> int:
        return sum(part.length[b] for part in self.parts.values()) + self.recent.length[b]

    def append(self, b: int, x: torch.Tensor) -> None:
        self.recent.append(b, x)

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

    def kernel_segments(self) -> list[tuple]:
        """One launch for the fp16 chunks with the recent tokens, one per packed width (RoPE is already applied)."""
        return [(self.parts[16], None, self.recent), (None, self.parts[4], None), (None, self.parts[2], None)]

    def packed_codecs(self) -> list:
        return [self.parts[bits].codec for bits in (4, 2)]
