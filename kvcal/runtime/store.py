"""Preallocated storage of one of K or V of one layer for a batch of sequences.

Every buffer is (batch, capacity, ...) and grows by GROWTH tokens (rounded to whole codec blocks) when a
sequence needs more; appends write in place. Each sequence has its own length (left padding is never
stored). Layouts, per sequence:
- Fp16Rows: fp16 tokens (capacity, C), a FIFO: `head` is the first live row, rows before it are free
  and reused by compacting the live rows to the front when the end is reached.
- PackedRows: the quantized body. codes (capacity, words) int32 packed with kvcal.packing.layout_for;
  per-token parameters (capacity, P) in their storage dtype (fp16 scale/zero or lo/hi, fp8 for SKVQ
  --fp8); per-block parameters (capacity / block_tokens, C) for per-channel key blocks; outliers as
  three parallel arrays (token row int32, channel int16, value fp16) with a count per sequence.
Reading decodes with the same codec that the simulation uses (kvcal.quantizers / kvcal.skvq).
"""

from __future__ import annotations

import math

import torch

from kvcal.packing import layout_for, pack, packed_words, unpack
from kvcal.quantizers import Encoded

GROWTH = 256  # tokens added to a buffer's capacity at a time
OUTLIER_BYTES = 4 + 2 + 2  # token row int32, channel int16, value fp16


def _grown(buffer: torch.Tensor, rows: int) -> torch.Tensor:
    """buffer (batch, capacity, ...) with capacity `rows`, the old contents kept."""
    bigger = torch.zeros(buffer.shape[0], rows, *buffer.shape[2:], dtype=buffer.dtype, device=buffer.device)
    bigger[:, : buffer.shape[1]] = buffer
    return bigger


class Fp16Rows:
    def __init__(self, batch: int, width: int, device):
        self.data = torch.zeros(batch, 0, width, dtype=torch.float16, device=device)
        self.head = [0] * batch
        self.length = [0] * batch

    def append(self, b: int, x: torch.Tensor) -> None:
        end = self.head[b] + self.length[b]
        if end + len(x) > self.data.shape[1]:
            if self.head[b]:  # reuse the rows that left the front
                live = self.data[b, self.head[b] : end].clone()
                self.data[b, : self.length[b]] = live
                self.head[b], end = 0, self.length[b]
            if end + len(x) > self.data.shape[1]:
                self.data = _grown(self.data, math.ceil((end + len(x)) / GROWTH) * GROWTH)
        self.data[b, end : end + len(x)] = x.to(torch.float16)
        self.length[b] += len(x)

    def read(self, b: int) -> torch.Tensor:
        return self.data[b, self.head[b] : self.head[b] + self.length[b]]

    def pop_front(self, b: int, count: int) -> torch.Tensor:
        rows = self.data[b, self.head[b] : self.head[b] + count].float()
        self.head[b] += count
        self.length[b] -= count
        return rows

    def used_bytes(self, b: int) -> int:
        return self.length[b] * self.data.shape[2] * 2


class PackedRows:
    def __init__(self, codec, batch: int, width: int, device, use_kernels: bool | None = None, layout: str | None = None):
        """use_kernels: quantize with the CUDA append kernels (kvcal.runtime.kernels); None = when the device is
        CUDA and the codec has one. layout: a kvcal.packing layout, by default layout_for(codec.bits)."""
        from kvcal.runtime import kernels

        self.codec, self.width, self.device = codec, width, device
        self.layout = layout or layout_for(codec.bits)
        if use_kernels is None:
            use_kernels = kernels.cuda_ready(device) and kernels.append_supported(codec, width, self.layout)
        self.use_kernels = use_kernels
        self.block = codec.block_tokens
        self.words = torch.zeros(batch, 0, packed_words(width, codec.bits, self.layout), dtype=torch.int32, device=device)
        self.token: dict[str, torch.Tensor] = {}
        self.blocks: dict[str, torch.Tensor] = {}
        self.outlier_rows = torch.zeros(batch, 0, dtype=torch.int32, device=device)
        self.outlier_channels = torch.zeros(batch, 0, dtype=torch.int16, device=device)
        self.outlier_values = torch.zeros(batch, 0, dtype=torch.float16, device=device)
        self.length = [0] * batch
        self.outliers = [0] * batch

    def _reserve(self, rows: int) -> None:
        if rows <= self.words.shape[1]:
            return
        step = math.ceil(GROWTH / self.block) * self.block
        capacity = math.ceil(rows / step) * step
        self.words = _grown(self.words, capacity)
        self.token = {name: _grown(t, capacity) for name, t in self.token.items()}
        self.blocks = {name: _grown(t, capacity // self.block) for name, t in self.blocks.items()}

    def reserve_outliers(self, count: int) -> None:
        if count > self.outlier_rows.shape[1]:
            capacity = math.ceil(count / GROWTH) * GROWTH
            self.outlier_rows = _grown(self.outlier_rows, capacity)
            self.outlier_channels = _grown(self.outlier_channels, capacity)
            self.outlier_values = _grown(self.outlier_values, capacity)

    def _parameter(self, table: dict, name: str, rows: int, columns: int, dtype) -> torch.Tensor:
        if name not in table:
            table[name] = torch.zeros(self.words.shape[0], rows, columns, dtype=dtype, device=self.device)
        return table[name]

    def append(self, b: int, x: torch.Tensor) -> None:
        """Quantize rows x (tokens, C) (a whole number of codec blocks) into sequence b's storage."""
        start, count = self.length[b], len(x)
        self._reserve(start + count)
        if self.use_kernels:
            from kvcal.runtime import kernels

            per_token, per_block = kernels.parameter_columns(self.codec, self.width)
            for name, columns in per_token.items():
                self._parameter(self.token, name, self.words.shape[1], columns, torch.float16)
            for name, columns in per_block.items():
                self._parameter(self.blocks, name, self.words.shape[1] // self.block, columns, torch.float16)
            self.outliers[b] += kernels.encode_into(self, b, x, start)
            self.length[b] += count
            return
        encoded = self.codec.encode(x.float())
        self.words[b, start : start + count] = pack(encoded.codes, self.codec.bits, self.layout)
        for name, values in encoded.token.items():
            self._parameter(self.token, name, self.words.shape[1], values.shape[1], values.dtype)[b, start : start + count] = values
        for name, values in encoded.block.items():
            blocks = self._parameter(self.blocks, name, self.words.shape[1] // self.block, values.shape[1], values.dtype)
            blocks[b, start // self.block : (start + count) // self.block] = values
        if encoded.outliers is not None:
            rows, channels, values = encoded.outliers
            first = self.outliers[b]
            self.reserve_outliers(first + len(rows))
            self.outlier_rows[b, first : first + len(rows)] = (rows + start).to(torch.int32)
            self.outlier_channels[b, first : first + len(rows)] = channels.to(torch.int16)
            self.outlier_values[b, first : first + len(rows)] = values
            self.outliers[b] += len(rows)
        self.length[b] += count

    def read(self, b: int) -> torch.Tensor:
        """Sequence b's rows, dequantized (tokens, C) float32: unpack, then the codec's decode."""
        n = self.length[b]
        if n == 0:
            return torch.zeros(0, self.width, device=self.device)
        encoded = Encoded(unpack(self.words[b, :n], self.codec.bits, self.width, self.layout),
                          token={name: t[b, :n] for name, t in self.token.items()},
                          block={name: t[b, : n // self.block] for name, t in self.blocks.items()})
        if self.outliers[b]:
            k = self.outliers[b]
            encoded.outliers = (self.outlier_rows[b, :k].long(), self.outlier_channels[b, :k].long(), self.outlier_values[b, :k])
        return self.codec.decode(encoded)

    def used_bytes(self, b: int) -> int:
        n = self.length[b]
        per_token = self.words.shape[2] * 4 + sum(t.shape[2] * t.element_size() for t in self.token.values())
        per_block = sum(t.shape[2] * t.element_size() for t in self.blocks.values())
        return n * per_token + (n // self.block) * per_block + self.outliers[b] * OUTLIER_BYTES
