"""Preallocated storage of one of K or V of one layer for a batch of sequences.

Every buffer is (batch, capacity, ...) and grows by GROWTH tokens (rounded to whole codec blocks) when a
sequence needs more; appends write in place. Each sequence has its own length (left padding is never
stored). Layouts, per sequence:
- Fp16Rows: fp16 tokens (capacity, C), a FIFO: `head` is the first live row, rows before it are free
  and reused by compacting the live rows to the front when the end is reached.
- PackedRows: the quantized body. codes (capacity, pieces, words) int32 packed with kvcal.packing.layout_for ("planes3"
  for 3 bits: exactly 3 bits per code), a row cut into pieces of whole packing units, one a KV head where the head_dim
  is known and a head's codes fill whole units (else one piece). A CPU store keeps each piece's rows together (storage
  (pieces, capacity, words), `words` its permuted view): its decode kernel reads a KV head's tokens in turn. A CUDA
  store keeps each token's row whole by default (kvcal.runtime.kernels.AppendKernels; the CUDA kernels read either,
  until a GPU measures which is faster: STORE_LAYOUTS names both). Per-token parameters in their storage dtype (fp16
  scale/zero or lo/hi, fp8 for SKVQ --fp8) stored (P, capacity): each of the P columns (a group of channels) runs along
  the tokens, so that a KV head's parameters of consecutive tokens are contiguous, as the kernels copy them
  (`token[name]` is the (capacity, P) view of it); per-block parameters (capacity / block_tokens, C) for per-channel key
  blocks; for codecs that keep outliers, kvcal.packing's outlier layout per (sequence, KV head): positions inside the
  tile (kv_heads, outlier capacity) int16 holding the uint16 pattern, fp16 values beside them, the int32 offset table
  (kv_heads, capacity / OUTLIER_TILE_TOKENS) of every started tile, and the counts `outlier_count` (batch, kv_heads)
  int32 on the device (what the decode kernel reads for the last tile's end). A sliding-window layer drops rows from the
  front (`drop_front`, whole blocks): `head` is the first live row; when an append reaches the end, the live rows move
  to the front by a multiple of whole blocks and outlier tiles (the tiles that leave take their outliers and table
  entries along), and `release` gives back what a long prefill grew once its rows are dropped; so a sliding layer's
  storage stays near its window, with one move per (capacity - window) tokens, never a copy per step.

Appends are batched: `write`/`append_rows` take rows of several sequences at once (grouped by sequence, in
the order of `seqs`), encode them with one call of the codec (or one launch of the CUDA append kernels, see
`encoder_for`) and write every buffer with one indexed store; the bookkeeping (lengths, heads, outlier
counts) is Python lists, never a tensor op per sequence. On the kernel path the outlier counts live on the
device only and the host keeps an upper bound per (sequence, KV head) to size the outlier arrays ahead, so an
append never waits for the device (see PackedRows.reserve_outlier_room).

Reading decodes with the same codec that the simulation uses (kvcal.quantizers / kvcal.fit.skvq): `read(b)`
one sequence through codec.decode; `decoded(rows)` every sequence at once for the batched reference
decode, through per-parameter-row tables of the codec's decode formula (for the uniform, codebook and SKVQ
codecs; bit-equal to codec.decode, a test checks it) or codec.decode itself.
"""

from __future__ import annotations

import math
import weakref

import numpy as np
import torch

from kvcal.errors import KvcalError
from kvcal.packing import (OUTLIER_BYTES, OUTLIER_TILE_TOKENS, check_outlier_head_dim, layout_for, outlier_table_bytes, pack,
                           packed_words, unit_shape, unpack, unpack_units)
from kvcal.quantizers import TINY_SCALE, CodecKind, Encoded

# a store layout's name -> PackedRows' rows_together: each token's row whole, or each KV head's rows together
STORE_LAYOUTS = {"rows": True, "heads": False}

GROWTH = 256  # tokens added to a buffer's capacity at a time


def _grown(buffer: torch.Tensor, rows: int, dim: int = 1) -> torch.Tensor:
    """buffer with `rows` entries along dim (its capacity), the old contents kept (as many as fit)."""
    shape = list(buffer.shape)
    shape[dim] = rows
    resized = torch.zeros(shape, dtype=buffer.dtype, device=buffer.device)
    kept = min(rows, buffer.shape[dim])
    resized.narrow(dim, 0, kept).copy_(buffer.narrow(dim, 0, kept))
    return resized


def _words(batch: int, capacity: int, pieces: int, piece_words: int, rows_together: bool, device) -> torch.Tensor:
    """Zeroed code words, (batch, capacity, pieces, piece_words): contiguous where rows_together (a row's pieces side
    by side), else a view of (batch, pieces, capacity, piece_words) storage (a piece's rows together)."""
    if rows_together:
        return torch.zeros(batch, capacity, pieces, piece_words, dtype=torch.int32, device=device)
    return torch.zeros(batch, pieces, capacity, piece_words, dtype=torch.int32, device=device).transpose(1, 2)


def sequences_of(buffer: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """buffer's sequences index[0], index[1], ... (along dim 0; repeats allowed) as its batch, laid out in memory as
    buffer is (a permuted view stays one: the kernels read the strides a store made)."""
    order = sorted(range(buffer.dim()), key=lambda d: (-buffer.stride(d), d))  # dims, outermost in memory first
    # (one copy: index_select on the dims in memory order gives its output that order)
    taken = buffer.permute(order).index_select(order.index(0), index)
    return taken.permute([order.index(d) for d in range(buffer.dim())])


def upload(values, device, dtype=torch.long) -> torch.Tensor:
    """A host list or numpy array as a tensor on `device`, without waiting for the device: through pinned memory
    and a non-blocking copy on CUDA (torch's pinned allocator keeps the source until the copy is done)."""
    cuda = torch.device(device).type == "cuda"
    if isinstance(values, np.ndarray):
        host = torch.from_numpy(values).to(dtype)
        return host.pin_memory().to(device, non_blocking=True) if cuda else host.to(device)
    if cuda:
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype, device=device)


def spans(starts, counts) -> np.ndarray:
    """starts[i] .. starts[i] + counts[i] - 1 for every i in order, one int64 array, made by numpy (a bulk append has
    a row per token of every sequence: no Python object per row)."""
    counts = np.asarray(counts, dtype=np.int64)
    ends = np.cumsum(counts)
    return np.arange(ends[-1] if len(ends) else 0) + np.repeat(np.asarray(starts, dtype=np.int64) - (ends - counts), counts)


def row_index(seqs: list[int], starts: list[int], counts: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, row) index tensors of rows starts[i] .. starts[i] + counts[i] - 1 of sequence seqs[i], for every
    i in order: the destinations of rows grouped by sequence. One upload, whatever the batch."""
    if all(c == 1 for c in counts):
        both = upload([seqs, starts], device)
        return both[0], both[1]
    both = upload(np.stack([np.repeat(np.asarray(seqs, dtype=np.int64), counts), spans(starts, counts)]), device)
    return both[0], both[1]


# ---------------------------------------------------------------------------------------------------------
# table decoding of a whole batch


def permuted_groups(codec) -> bool:
    """Whether `codec` is SKVQ's (kvcal.fit.skvq.SkvqTensor). Its codec encodes and decodes codes in permuted channel
    order; a store keeps them in channel order (a channel's code where the channel is, as for every other codec, so
    that the kernels unpack a head's codes without a gather)."""
    return codec.kind is CodecKind.PERMUTED_GROUPS


_PERMUTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # codec -> {device: (slots, groups)}


def channel_slots_and_groups(codec, device) -> tuple[torch.Tensor, torch.Tensor]:
    """For a permuted-groups codec, per channel: its slot in the permuted order (slot i holds channel
    permutation[i]) and its parameter group, int64 on `device`; made once per codec and device."""
    per_device = _PERMUTED.setdefault(codec, {})
    key = str(device)
    if key not in per_device:
        slots = torch.argsort(codec.permutation.long().to(device))
        sizes = (codec.starts[1:] - codec.starts[:-1]).long().to(device)
        group_of_slot = torch.repeat_interleave(torch.arange(len(sizes), device=device), sizes)
        per_device[key] = (slots, group_of_slot[slots])
    return per_device[key]


def _to_channel_order(codec, codes: torch.Tensor) -> torch.Tensor:
    """Codes (rows, C) of a permuted-groups codec from its permuted order."""
    return codes.index_select(1, channel_slots_and_groups(codec, codes.device)[0])


def _token_rows(store: PackedRows, name: str, rows: int) -> torch.Tensor:
    """The per-token parameter `name` of the first `rows` rows, (batch, rows, columns) float32, contiguous (the
    store keeps it column by column: PackedRows._parameter)."""
    return store.token[name][:, :rows].float().contiguous()


class _Table:
    """How a codec's decode of a batch becomes one table lookup: value = table[code + offset], where the table
    holds the decoded value of every code for every parameter row (computed with the codec's own formula on the
    parameters, so the lookup is bit-equal to codec.decode) and offset selects the row."""

    @staticmethod
    def for_codec(codec):
        table = {CodecKind.UNIFORM_TOKEN: _TokenUniformTable, CodecKind.UNIFORM_CHANNEL: _ChannelBlockTable,
                 CodecKind.CODEBOOK_CHANNEL: _CodebookTable, CodecKind.CODEBOOK_TOKEN: _CodebookTable,
                 CodecKind.PERMUTED_GROUPS: _PermutedGroupsTable}.get(codec.kind)
        return table() if table is not None else None


class _TokenUniformTable(_Table):
    def decode(self, store: PackedRows, codes: torch.Tensor, rows: int) -> torch.Tensor:
        """codes (B, rows, words, per_word) -> (B, rows, channels_padded) float32."""
        codec = store.codec
        levels = 2 ** int(codec.bits)
        scale = _token_rows(store, "scale", rows).clamp(min=TINY_SCALE)  # scale_in_use
        zero = _token_rows(store, "zero", rows)
        batch, groups = scale.shape[0], scale.shape[2]
        table = torch.arange(levels, dtype=torch.float32, device=codes.device) * scale[..., None] + zero[..., None]
        channel_group = store.channel_index // codec.group  # (words, per_word)
        offsets = (torch.arange(batch * rows, dtype=torch.int32, device=codes.device) * (groups * levels)).view(batch, rows, 1, 1)
        index = codes.add_(channel_group * levels).add_(offsets)
        return table.view(-1).index_select(0, index.view(-1)).view(batch, rows, -1)


class _ChannelBlockTable(_Table):
    def decode(self, store: PackedRows, codes: torch.Tensor, rows: int) -> torch.Tensor:
        codec = store.codec
        levels, block = 2 ** int(codec.bits), codec.group
        scale = store.blocks["scale"][:, : rows // block].float().clamp(min=TINY_SCALE)
        zero = store.blocks["zero"][:, : rows // block].float()
        batch, blocks, channels = scale.shape
        table = torch.arange(levels, dtype=torch.float32, device=codes.device) * scale[..., None] + zero[..., None]
        channel = store.channel_index  # (words, per_word)
        offsets = (torch.arange(batch * blocks, dtype=torch.int32, device=codes.device) * (channels * levels)).view(batch, blocks, 1, 1, 1)
        index = codes.view(batch, blocks, block, *codes.shape[2:]).add_(channel * levels).add_(offsets)
        return table.view(-1).index_select(0, index.view(-1)).view(batch, rows, -1)


class _CodebookTable(_Table):
    constants = None

    def decode(self, store: PackedRows, codes: torch.Tensor, rows: int) -> torch.Tensor:
        codec = store.codec
        if self.constants is None:  # the codebook on the device, and for per-channel thresholds the whole table
            codebook = codec.codebook.to(codes.device)
            table = offsets = None
            if codec.lo is not None:
                lo, hi = codec.lo.to(codes.device).float(), codec.hi.to(codes.device).float()
                table = codebook * ((hi - lo) / 2).clamp(min=1e-8)[:, None] + ((hi + lo) / 2)[:, None]  # denormalize
                offsets = store.channel_index * codebook.numel()
            self.constants = (codebook, table, offsets)
        codebook, table, offsets = self.constants
        levels = codebook.numel()
        if table is not None:  # per channel: a table row per channel
            batch = codes.shape[0]
            return table.view(-1).index_select(0, codes.add_(offsets).view(-1)).view(batch, rows, -1)
        lo, hi = _token_rows(store, "lo", rows), _token_rows(store, "hi", rows)  # (B, rows, 1)
        batch = lo.shape[0]
        table = codebook * ((hi - lo) / 2).clamp(min=1e-8) + (hi + lo) / 2  # (B, rows, levels)
        offsets = (torch.arange(batch * rows, dtype=torch.int32, device=codes.device) * levels).view(batch, rows, 1, 1)
        return table.view(-1).index_select(0, codes.add_(offsets).view(-1)).view(batch, rows, -1)


class _PermutedGroupsTable(_Table):
    """SKVQ's codec (see permuted_groups): codes stored in channel order, a scale and zero per (token, group of
    permuted slots), value = (code + zero) * scale with the group of each channel's slot."""

    constants = None

    def decode(self, store: PackedRows, codes: torch.Tensor, rows: int) -> torch.Tensor:
        codec = store.codec
        if self.constants is None:
            levels = 3 if codec.bits == 1.5 else 2 ** int(codec.bits)
            self.constants = ((channel_slots_and_groups(codec, codes.device)[1] * levels).to(torch.int32), levels)
        channel_offsets, levels = self.constants
        scale = _token_rows(store, "scale", rows).clamp(min=TINY_SCALE)  # scale_in_use
        zero = _token_rows(store, "zero", rows)
        batch, groups = scale.shape[0], scale.shape[2]
        table = (torch.arange(levels, dtype=torch.float32, device=codes.device) + zero[..., None]) * scale[..., None]
        offsets = (torch.arange(batch * rows, dtype=torch.int32, device=codes.device) * (groups * levels)).view(batch, rows, 1)
        index = codes.view(batch, rows, -1)[..., : store.width] + channel_offsets + offsets
        return table.view(-1).index_select(0, index.view(-1)).view(batch, rows, -1)


# ---------------------------------------------------------------------------------------------------------
# fp16 segments


class Fp16Rows:
    def __init__(self, batch: int, width: int, device):
        self.data = torch.zeros(batch, 0, width, dtype=torch.float16, device=device)
        self.head = [0] * batch
        self.length = [0] * batch
        self.moves = 0  # buffers replaced so far: a kernel descriptor made at the same count is still valid

    def _room(self, seqs: list[int], counts: list[int]) -> None:
        """Capacity for counts[i] more rows of sequence seqs[i]: compact every sequence's live rows to the front
        (one gather and one store for the batch) when one would run past the end, grow if still short."""
        capacity = self.data.shape[1]
        if all(self.head[b] + self.length[b] + c <= capacity for b, c in zip(seqs, counts)):
            return
        moved = [b for b in range(len(self.head)) if self.head[b] and self.length[b]]
        if moved:
            lengths = [self.length[b] for b in moved]
            source = row_index(moved, [self.head[b] for b in moved], lengths, self.data.device)
            target = row_index(moved, [0] * len(moved), lengths, self.data.device)
            self.data.index_put_(target, self.data[source])
        self.head = [0] * len(self.head)
        need = max(self.length[b] + c for b, c in zip(seqs, counts))
        if need > capacity:
            self.data = _grown(self.data, math.ceil(need / GROWTH) * GROWTH)
            self.moves += 1

    def write(self, seqs: list[int], counts: list[int], x: torch.Tensor) -> None:
        """Append rows x (sum(counts), C), counts[i] of them to sequence seqs[i], in that order."""
        if not len(x):
            return
        self._room(seqs, counts)
        ends = [self.head[b] + self.length[b] for b in seqs]
        if len(seqs) == 1:  # one sequence: a slice, far less host time than an indexed store
            self.data[seqs[0], ends[0] : ends[0] + counts[0]].copy_(x)
        else:
            self.data.index_put_(row_index(seqs, ends, counts, self.data.device), x.to(torch.float16))
        for b, c in zip(seqs, counts):
            self.length[b] += c

    def take_front(self, seqs: list[int], counts: list[int]) -> torch.Tensor:
        """Remove the first counts[i] live rows of sequence seqs[i]; returns them (sum(counts), C) fp16, grouped (for
        one sequence a view of the buffer, valid until the next write)."""
        if len(seqs) == 1:
            rows = self.data[seqs[0], self.head[seqs[0]] : self.head[seqs[0]] + counts[0]]
        else:
            rows = self.data[row_index(seqs, [self.head[b] for b in seqs], counts, self.data.device)]
        for b, c in zip(seqs, counts):
            self.head[b] += c
            self.length[b] -= c
        return rows

    def append(self, b: int, x: torch.Tensor) -> None:
        self.write([b], [len(x)], x)

    def clear(self, b: int) -> None:
        """Drop sequence b's rows."""
        self.head[b] = self.length[b] = 0

    def read(self, b: int) -> torch.Tensor:
        return self.data[b, self.head[b] : self.head[b] + self.length[b]]

    def pop_front(self, b: int, count: int) -> torch.Tensor:
        rows = self.data[b, self.head[b] : self.head[b] + count].float()
        self.head[b] += count
        self.length[b] -= count
        return rows

    def part(self) -> tuple[torch.Tensor, list[int], list[int]]:
        """(rows (B, n, C) fp16 covering every sequence's live rows, first live row, live rows) per sequence."""
        end = max((h + n for h, n in zip(self.head, self.length)), default=0)
        return self.data[:, :end], self.head, self.length

    def used_bytes(self, b: int) -> int:
        return self.length[b] * self.data.shape[2] * 2

    def take_sequences(self, seqs: list[int], index: torch.Tensor) -> None:
        """Keep sequences seqs[0], seqs[1], ... (repeats allowed; `index` the same on the device) as sequences 0, 1,
        ...: beam search's reordering, a batch's selection or repetition."""
        self.data = sequences_of(self.data, index)
        self.head, self.length = [self.head[b] for b in seqs], [self.length[b] for b in seqs]
        self.moves += 1


# ---------------------------------------------------------------------------------------------------------
# the quantized body


class PackedRows:
    def __init__(self, codec, batch: int, width: int, device, encoder_for=None, layout: str | None = None,
                 head_dim: int | None = None, rows_together: bool | None = None):
        """encoder_for(codec, width, layout, device): an encoder that quantizes straight into this store (the CUDA
        append kernels, kvcal.runtime.kernels.append_encoder) or None, when the torch codec encodes.
        layout: a kvcal.packing layout, by default layout_for(codec.bits).
        head_dim: channels per KV head; needed by codecs that keep outliers (stored per KV head); cuts a row into a
        piece per KV head (the module docstring says where the pieces lie).
        rows_together: keep each token's row whole (True) or each piece's rows together (False, where a row has
        pieces); None: as the store's kernels read it."""
        self.codec, self.width, self.device = codec, width, device
        self.layout = layout or layout_for(codec.bits)
        self.encoder = encoder_for(codec, width, self.layout, device) if encoder_for else None
        self.block = codec.block_tokens
        self.row_words = packed_words(width, codec.bits, self.layout)
        per_unit = unit_shape(codec.bits, self.layout)[1]
        self.pieces = width // head_dim if head_dim and width % head_dim == 0 and head_dim % per_unit == 0 else 1
        if rows_together is None:  # the encoder's layout; the torch codec's stores: the CPU kernel's on the CPU
            rows_together = self.encoder.rows_together if self.encoder is not None else torch.device(device).type != "cpu"
        self.rows_together = rows_together or self.pieces == 1
        self.words = _words(batch, 0, self.pieces, self.row_words // self.pieces, self.rows_together, device)
        self.token: dict[str, torch.Tensor] = {}
        self.blocks: dict[str, torch.Tensor] = {}
        self.length = [0] * batch  # live rows
        self.head = [0] * batch  # the row of the first live one (rows before it were dropped: drop_front)
        self.dropped = [0] * batch  # rows dropped from the front so far; row r is the sequence's body row dropped + r - head
        self.aligned = math.lcm(self.block, OUTLIER_TILE_TOKENS)  # compaction moves rows by multiples of this
        self.moves = 0  # buffers replaced or added so far: a kernel descriptor made at the same count is still valid
        self._columns: tuple[dict[str, int], dict[str, int]] | None = None  # the encoder's parameter columns
        self.keeps_outliers = getattr(codec, "outlier_fraction", 0) > 0
        self.head_dim, self.kv_heads = head_dim, 0
        if self.keeps_outliers:
            if head_dim is None or head_dim <= 0 or width % head_dim:
                raise KvcalError(f"a store of {width} channels for a codec that keeps outliers needs the head_dim that divides "
                                 f"them into KV heads (got {head_dim}); pass head_dim")
            check_outlier_head_dim(head_dim)
            self.kv_heads = width // head_dim
        # outliers (kvcal.packing): per (sequence, KV head) positions in their tile (uint16 patterns) and fp16 values
        # in append order; the offset table of every started tile; the counts on the device, which the kernels read
        self.outlier_positions = torch.zeros(batch, self.kv_heads, 0, dtype=torch.int16, device=device)
        self.outlier_values = torch.zeros(batch, self.kv_heads, 0, dtype=torch.float16, device=device)
        self.outlier_offsets = torch.zeros(batch, self.kv_heads, 0, dtype=torch.int32, device=device)
        self.outlier_count = torch.zeros(batch, self.kv_heads, dtype=torch.int32, device=device)
        self._outliers = [[0] * self.kv_heads for _ in range(batch)]  # the torch path's counts, on the host
        # the kernel path's host upper bound per (sequence, KV head) (see reserve_outlier_room)
        self._bound = [[0] * self.kv_heads for _ in range(batch)]
        self._added = [[0] * self.kv_heads for _ in range(batch)]  # what the bound allowed for since the last snapshot
        self._snapshot: tuple[torch.Tensor, object] | None = None
        self._table = _Table.for_codec(codec)
        # the channel of every code slot of a row's units (the row's padding slots count as its last channel)
        words_per_unit, per_unit = unit_shape(codec.bits, self.layout)
        units = self.row_words // words_per_unit
        self.channel_index = torch.arange(units * per_unit, dtype=torch.int32, device=device).clamp(max=width - 1).view(units, per_unit)

    @property
    def use_kernels(self) -> bool:
        return self.encoder is not None

    def outlier_counts(self) -> list[list[int]]:
        """Outliers stored per (sequence, KV head) (on the kernel path this reads the device counts: not for a
        decode step)."""
        return self.outlier_count.tolist() if self.encoder is not None else [list(row) for row in self._outliers]

    @property
    def outliers(self) -> list[int]:
        """Outliers stored per sequence, from the tile of its first live row on (on the kernel path this reads the
        device counts: not for a decode step)."""
        counts = [sum(heads) for heads in self.outlier_counts()]
        for b, (head, length) in enumerate(zip(self.head, self.length)):
            if head and self.kv_heads:  # the entries before the tile of the first live row left with their rows
                counts[b] = counts[b] - int(self.outlier_offsets[b, :, head // OUTLIER_TILE_TOKENS].sum()) if length else 0
        return counts

    def _room(self, seqs: list[int], counts: list[int]) -> None:
        """Capacity for counts[i] more rows of sequence seqs[i]: compact the live rows to the front when one would
        run past the end, then grow if still short."""
        ends = lambda: max(self.head[b] + self.length[b] + c for b, c in zip(seqs, counts))
        if ends() <= self.words.shape[1]:  # a decode step, almost always
            return
        if any(head >= self.aligned for head in self.head):
            self._compact()
        if ends() > self.words.shape[1]:
            self._resize(ends())

    def _resize(self, rows: int) -> None:
        """Capacity for `rows` rows (grown, or shrunk to what the live rows need), in whole GROWTH steps of blocks."""
        step = math.ceil(GROWTH / self.aligned) * self.aligned
        capacity = max(math.ceil(rows / step), 1) * step
        if capacity == self.words.shape[1]:
            return
        words = _words(self.words.shape[0], capacity, self.pieces, self.words.shape[3], self.rows_together, self.device)
        kept = min(capacity, self.words.shape[1])
        words[:, :kept] = self.words[:, :kept]
        self.words = words
        self.token = {name: _grown(t.transpose(1, 2), capacity, dim=2).transpose(1, 2) for name, t in self.token.items()}
        self.blocks = {name: _grown(t, capacity // self.block) for name, t in self.blocks.items()}
        self.outlier_offsets = _grown(self.outlier_offsets, math.ceil(capacity / OUTLIER_TILE_TOKENS), dim=2)
        self.moves += 1

    def drop_front(self, b: int, rows: int) -> None:
        """Drop sequence b's first `rows` live rows (whole blocks; a sliding-window layer's tokens out of its window).
        Their storage is reused by the next compaction (_compact); the outliers of a tile stay counted until all of
        its rows are dropped."""
        if rows % self.block or rows > self.length[b]:
            raise ValueError(f"can drop whole blocks of {self.block} of the {self.length[b]} live rows, not {rows}")
        self.head[b] += rows
        self.dropped[b] += rows
        self.length[b] -= rows

    def release(self) -> None:
        """After drops: give back the storage past what the live rows need when it is more than half of it."""
        need = max(head % self.aligned + length for head, length in zip(self.head, self.length))
        if 2 * need + GROWTH < self.words.shape[1]:
            self._compact()
            self._resize(need)
            if self.keeps_outliers:
                most = int(self.outlier_count.max()) if self.outlier_count.numel() else 0
                capacity = max(math.ceil(most / GROWTH), 1) * GROWTH
                if capacity < self.outlier_positions.shape[2]:
                    self.outlier_positions = _grown(self.outlier_positions, capacity, dim=2)
                    self.outlier_values = _grown(self.outlier_values, capacity, dim=2)
                    self.moves += 1

    def _compact(self) -> None:
        """Move every sequence's live rows to the front, by a multiple of `aligned` rows (so that rows keep their
        place in their blocks and outlier tiles), with the outliers of the tiles that leave."""
        for b, head in enumerate(self.head):
            shift = head - head % self.aligned
            if not shift:
                continue
            rows = head % self.aligned + self.length[b]
            self.words[b, :rows] = self.words[b, shift : shift + rows].clone()
            for t in self.token.values():
                t[b, :rows] = t[b, shift : shift + rows].clone()
            for t in self.blocks.values():
                t[b, : rows // self.block] = t[b, shift // self.block : (shift + rows) // self.block].clone()
            if self.keeps_outliers:
                self._drop_outlier_tiles(b, shift // OUTLIER_TILE_TOKENS, math.ceil((head + self.length[b]) / OUTLIER_TILE_TOKENS))
            self.head[b] = head - shift

    def _drop_outlier_tiles(self, b: int, tiles: int, started: int) -> None:
        """Sequence b's first `tiles` outlier tiles (of `started`) leave: their entries and offset-table entries."""
        counts = self.outlier_count[b].long()
        first = self.outlier_offsets[b, :, tiles].long() if tiles < started else counts  # (kv_heads,) entries that leave
        capacity = self.outlier_positions.shape[2]
        index = (torch.arange(capacity, device=self.device)[None, :] + first[:, None]).clamp(max=capacity - 1)
        self.outlier_positions[b] = self.outlier_positions[b].gather(1, index)
        self.outlier_values[b] = self.outlier_values[b].gather(1, index)
        remaining = max(started - tiles, 0)
        self.outlier_offsets[b, :, :remaining] = self.outlier_offsets[b, :, tiles : tiles + remaining] - first[:, None].int()
        self.outlier_count[b] = (counts - first).int()
        if self.encoder is None:
            self._outliers[b] = (counts - first).tolist()

    def reserve_outliers(self, count: int) -> None:
        """Room for `count` outliers in every (sequence, KV head)."""
        if count > self.outlier_positions.shape[2]:
            capacity = math.ceil(count / GROWTH) * GROWTH
            self.outlier_positions = _grown(self.outlier_positions, capacity, dim=2)
            self.outlier_values = _grown(self.outlier_values, capacity, dim=2)
            self.moves += 1

    def reserve_outlier_room_on_host(self, seqs: list[int], added: np.ndarray) -> None:
        """CPU stores, whose counts are host memory: room for (sequence seqs[i], KV head h)'s count plus added[i, h]."""
        counts = self.outlier_count.numpy()
        self.reserve_outliers(max(int(counts.max()), int((counts[seqs] + added).max())))

    def reserve_outlier_room(self, seqs: list[int], most: list[list[int]]) -> None:
        """Kernel path: (sequence seqs[i], KV head h) may gain up to most[i][h] outliers; grow the outlier arrays so
        that every count stays within their capacity. The host never reads the device counts here: it keeps an
        upper bound per (sequence, KV head), made exact again from a snapshot of the counts copied to the host
        without waiting (on CUDA: into pinned memory, with an event; taken after each append, read once it is done)."""
        self._refresh_bound()
        for b, per_head in zip(seqs, most):
            self._bound[b] = [bound + m for bound, m in zip(self._bound[b], per_head)]
            self._added[b] = [added + m for added, m in zip(self._added[b], per_head)]
        self.reserve_outliers(max(max(heads, default=0) for heads in self._bound))

    def _refresh_bound(self) -> None:
        if self._snapshot is None:
            return
        counts, event = self._snapshot
        if event is not None and not event.query():
            return  # not copied yet: the bound stays as it is (still an upper bound)
        self._bound = [[c + a for c, a in zip(row, added)] for row, added in zip(counts.tolist(), self._added)]
        self._snapshot = None

    def snapshot_outlier_count(self) -> None:
        """After a kernel-path append: start copying the device counts to the host (see reserve_outlier_room)."""
        if self.outlier_count.device.type == "cuda":
            if self._snapshot is None:
                host = torch.empty(self.outlier_count.shape, dtype=torch.int32, pin_memory=True)
            else:
                host = self._snapshot[0]
            host.copy_(self.outlier_count, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._snapshot = (host, event)
        else:
            self._snapshot = (self.outlier_count.clone(), None)
        self._added = [[0] * self.kv_heads for _ in self._added]

    def _parameter(self, table: dict, name: str, rows: int, columns: int, dtype) -> torch.Tensor:
        """table[name], (batch, rows, columns), made on first use: per-token parameters (self.token) as the view of
        (batch, columns, rows) storage, per-block ones as they are."""
        if name not in table:
            self.moves += 1
            batch = self.words.shape[0]
            if table is self.token:
                table[name] = torch.zeros(batch, columns, rows, dtype=dtype, device=self.device).transpose(1, 2)
            else:
                table[name] = torch.zeros(batch, rows, columns, dtype=dtype, device=self.device)
        return table[name]

    def append(self, b: int, x: torch.Tensor) -> None:
        """Quantize rows x (tokens, C) (a whole number of codec blocks) into sequence b's storage."""
        self.append_rows([b], [len(x)], x)

    def append_rows(self, seqs: list[int], counts: list[int], x: torch.Tensor) -> None:
        """Quantize rows x (sum(counts), C), counts[i] of them (a whole number of codec blocks) for sequence
        seqs[i], grouped in that order: one encode (or one kernel launch) and one store per buffer."""
        if 0 in counts:
            seqs, counts = [b for b, c in zip(seqs, counts) if c], [c for c in counts if c]
            if not seqs:
                return
        self._room(seqs, counts)
        starts = [self.head[b] + self.length[b] for b in seqs]
        if self.encoder is not None:
            if self._columns is None:  # the encoder's parameter buffers, made once (_resize grows them with the rows)
                self._columns = per_token, per_block = self.encoder.parameter_columns(self.codec, self.width)
                dtype = self.encoder.parameter_dtype(self.codec)
                for name, columns in per_token.items():
                    self._parameter(self.token, name, self.words.shape[1], columns, dtype)
                for name, columns in per_block.items():
                    self._parameter(self.blocks, name, self.words.shape[1] // self.block, columns, dtype)
            self.encoder.encode_rows(self, seqs, starts, counts, x)
        else:
            self._encode_rows(seqs, starts, counts, x)
        for b, c in zip(seqs, counts):
            self.length[b] += c

    def _encode_rows(self, seqs: list[int], starts: list[int], counts: list[int], x: torch.Tensor) -> None:
        encoded = self.codec.encode(x.float())
        target = row_index(seqs, starts, counts, self.device)
        codes = _to_channel_order(self.codec, encoded.codes) if permuted_groups(self.codec) else encoded.codes
        self.words.index_put_(target, pack(codes, self.codec.bits, self.layout, check=False).view(len(codes), self.pieces, -1))
        for name, values in encoded.token.items():
            self._parameter(self.token, name, self.words.shape[1], values.shape[1], values.dtype).index_put_(target, values)
        if encoded.block:
            blocks = row_index(seqs, [s // self.block for s in starts], [c // self.block for c in counts], self.device)
            for name, values in encoded.block.items():
                self._parameter(self.blocks, name, self.words.shape[1] // self.block, values.shape[1], values.dtype).index_put_(blocks, values)
        if encoded.outliers is not None:
            self._place_outliers(seqs, starts, counts, *encoded.outliers)

    def _place_outliers(self, seqs: list[int], starts: list[int], counts: list[int], rows: torch.Tensor, channels: torch.Tensor,
                        values: torch.Tensor) -> None:
        """Torch path: the codec's outliers of x (row of x, channel, fp16 value; in row order, so grouped by sequence
        like x) into each (sequence, KV head)'s arrays after its own, and the offsets of the tiles this append
        starts. Where each goes is worked out on the host (the torch path reads its outliers' rows; the kernel path
        does not)."""
        heads, head_dim = self.kv_heads, self.head_dim
        row = np.asarray(rows.tolist(), dtype=np.int64)
        channel = np.asarray(channels.tolist(), dtype=np.int64)
        group = np.repeat(np.arange(len(seqs)), counts)[row]
        row_in_sequence = row + (np.array(starts) - (np.cumsum(counts) - counts))[group]
        head, channel_in_head = np.divmod(channel, head_dim)
        run = group * heads + head  # (sequence, KV head) runs, numbered by group
        order = np.argsort(run, kind="stable")  # by run, append order within each
        per_run = np.bincount(run, minlength=len(seqs) * heads)
        first_of_run = np.cumsum(per_run) - per_run
        bases = np.array([self._outliers[b] for b in seqs], dtype=np.int64).reshape(-1)  # counts before, per run
        sorted_run = run[order]
        slot = bases[sorted_run] + np.arange(len(order)) - first_of_run[sorted_run]
        position = (row_in_sequence % OUTLIER_TILE_TOKENS) * head_dim + channel_in_head  # < 2^16 (check_outlier_head_dim)
        self.reserve_outliers(int((bases + per_run).max()))
        sequence_of_run = np.repeat(np.array(seqs, dtype=np.int64), heads)
        index = upload(np.stack([sequence_of_run[sorted_run], head[order], slot, position[order], order]), self.device)
        self.outlier_positions.index_put_((index[0], index[1], index[2]), index[3].to(torch.int16))  # the uint16 pattern
        self.outlier_values.index_put_((index[0], index[1], index[2]), values.index_select(0, index[4]))
        # a started tile's offset: its run's count before the tile's first row (runs sorted, rows sorted within a run)
        tile_group, tile = started_tiles(starts, counts)
        tile_run = (tile_group[:, None] * heads + np.arange(heads)).reshape(-1)
        span = max(s + c for s, c in zip(starts, counts)) + 1
        keys = sorted_run * span + row_in_sequence[order]
        earlier = np.searchsorted(keys, tile_run * span + np.repeat(tile, heads) * OUTLIER_TILE_TOKENS) - first_of_run[tile_run]
        offsets = upload(np.stack([sequence_of_run[tile_run], tile_run % heads, np.repeat(tile, heads), bases[tile_run] + earlier]),
                         self.device)
        self.outlier_offsets.index_put_((offsets[0], offsets[1], offsets[2]), offsets[3].to(torch.int32))
        totals = bases + per_run
        runs = upload(np.stack([sequence_of_run, np.tile(np.arange(heads), len(seqs)), totals]), self.device)
        self.outlier_count.index_put_((runs[0], runs[1]), runs[2].to(torch.int32))
        for i, b in enumerate(seqs):
            self._outliers[b] = totals[i * heads: (i + 1) * heads].tolist()

    def _live_outliers(self, seqs: list[int], from_rows: list[int] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every stored outlier of sequences `seqs`, or with from_rows those of the tiles from the one holding storage
        row from_rows[i] on (a started tile): (index into seqs, body row, channel, fp16 value), 1-D each. A row comes
        from the entry's tile (the offset table: entries from offset[t] on are in tile t or later) and its position in
        the tile."""
        counts = self.outlier_counts()
        heads, head_dim, capacity = self.kv_heads, self.head_dim, self.outlier_positions.shape[2]
        skipped = np.zeros(len(seqs) * heads, dtype=np.int64)  # runs: (index into seqs, KV head)
        if from_rows is not None:
            skipped = np.array([self.outlier_offsets[b, :, row // OUTLIER_TILE_TOKENS].tolist()
                                for b, row in zip(seqs, from_rows)], dtype=np.int64).reshape(-1)
        per_run = np.array([counts[b] for b in seqs], dtype=np.int64).reshape(-1) - skipped
        run = np.repeat(np.arange(len(per_run)), per_run)
        entry = np.arange(len(run)) - (np.cumsum(per_run) - per_run)[run] + skipped[run]
        sequence, head, index = upload(np.stack([run // heads, run % heads, run * capacity + entry]), self.device)
        chosen = upload(seqs, self.device)
        started = upload([math.ceil((self.head[b] + self.length[b]) / OUTLIER_TILE_TOKENS) for b in seqs], self.device)
        offsets = self.outlier_offsets.index_select(0, chosen).long()  # (seqs, heads, tiles)
        tiles = torch.arange(offsets.shape[2], device=self.device)
        offsets = torch.where(tiles < started[:, None, None], offsets, capacity)[..., 1:]  # unstarted tiles: past the end
        marks = torch.zeros(len(seqs), heads, capacity + 1, dtype=torch.long, device=self.device)
        tile = marks.scatter_add_(2, offsets, torch.ones_like(offsets)).cumsum(2)[..., :capacity].reshape(-1).index_select(0, index)
        position = self.outlier_positions.index_select(0, chosen).reshape(-1).index_select(0, index).long() & 0xFFFF
        rows = tile * OUTLIER_TILE_TOKENS + position // head_dim
        channels = head * head_dim + position % head_dim
        values = self.outlier_values.index_select(0, chosen).reshape(-1).index_select(0, index)
        return sequence, rows, channels, values

    def _outliers_before(self, seqs: list[int], cuts: list[int]) -> torch.Tensor:
        """(len(seqs), kv_heads): each (sequence, KV head)'s outliers in storage rows before cuts[i]: the offset
        table's count before the cut's tile, and those of that tile in rows before the cut (entries lie in row order,
        a tile's from its offset to the next started tile's, or to the count)."""
        chosen = torch.tensor(seqs, device=self.device)
        counts = self.outlier_count.index_select(0, chosen).long()
        offsets = self.outlier_offsets.index_select(0, chosen).long()
        started = [math.ceil((self.head[b] + self.length[b]) / OUTLIER_TILE_TOKENS) for b in seqs]
        tiles = [cut // OUTLIER_TILE_TOKENS for cut in cuts]

        def before_tile(shift: int) -> torch.Tensor:  # entries before tile tiles[i] + shift: the table's, once started
            at = torch.tensor([min(t + shift, offsets.shape[2] - 1) for t in tiles], device=self.device)
            table = offsets.gather(2, at[:, None, None].expand(-1, self.kv_heads, 1))[..., 0] if offsets.shape[2] else counts
            return torch.where(torch.tensor([t + shift < s for t, s in zip(tiles, started)], device=self.device)[:, None],
                               table, counts)

        first, end = before_tile(0), before_tile(1)
        most = int((end - first).max()) if len(seqs) else 0
        if most == 0:
            return first
        index = first[..., None] + torch.arange(most, device=self.device)
        capacity = self.outlier_positions.shape[2]
        positions = self.outlier_positions.index_select(0, chosen).gather(2, index.clamp(max=capacity - 1)).long() & 0xFFFF
        within = torch.tensor([cut % OUTLIER_TILE_TOKENS for cut in cuts], device=self.device)[:, None, None]
        return first + ((index < end[..., None]) & (positions // self.head_dim < within)).sum(-1)

    def read(self, b: int, first: int = 0) -> torch.Tensor:
        """Sequence b's live rows from its `first` on (the first of a block of rows), dequantized (tokens, C) float32:
        unpack, then the codec's decode."""
        n, head = self.length[b] - first, self.head[b] + first
        if head % self.block:
            raise ValueError(f"row {first} of sequence {b} is not the first of a block of {self.block}")
        if n <= 0:
            return torch.zeros(0, self.width, device=self.device)
        codes = unpack(self.words[b, head : head + n].reshape(n, -1), self.codec.bits, self.width, self.layout)
        if permuted_groups(self.codec):  # the codec decodes its permuted order
            codes = codes.index_select(1, self.codec.permutation.long().to(codes.device))
        encoded = Encoded(codes, token={name: t[b, head : head + n] for name, t in self.token.items()},
                          block={name: t[b, head // self.block : (head + n) // self.block] for name, t in self.blocks.items()})
        if self.keeps_outliers:
            _, rows, channels, values = self._live_outliers([b], [head])
            live = rows >= head  # (the tile holding the first row read may hold earlier ones)
            encoded.outliers = (rows[live] - head, channels[live], values[live])
        return self.codec.decode(encoded)

    def decoded(self, rows: int) -> torch.Tensor:
        """The first `rows` rows of every sequence, dequantized: (batch, rows, C) float32 (rows past a sequence's
        length are finite filler). Equal to read(b) for each sequence's own rows."""
        batch = self.words.shape[0]
        if rows == 0:
            return torch.zeros(batch, 0, self.width, device=self.device)
        # (B, rows, units, per_unit), contiguous (the tables index its flat view) whatever order the rows' pieces lie in
        codes = unpack_units(self.words[:, :rows].reshape(batch, rows, -1).contiguous(), self.codec.bits, self.layout)
        if self._table is not None:
            out = self._table.decode(self, codes, rows)
        else:
            flat = codes.flatten(-2)[..., : self.width].reshape(batch * rows, self.width).long()
            encoded = Encoded(flat, token={name: t[:, :rows].flatten(0, 1) for name, t in self.token.items()},
                              block={name: t[:, : rows // self.block].flatten(0, 1) for name, t in self.blocks.items()})
            out = self.codec.decode(encoded)
        out = out.view(batch, rows, -1)  # (B, rows, slots): the row's padding slots beyond C, if any, at the end
        if self.keeps_outliers:  # every live outlier of every sequence
            sequence, outlier_rows, channels, values = self._live_outliers(list(range(batch)))
            slots = out.shape[2]
            at = (sequence * rows + outlier_rows) * slots + channels
            out.view(-1).index_put_((at,), values.float())
        return out[..., : self.width]

    def part(self) -> tuple[torch.Tensor, list[int], list[int]]:
        """(decoded rows (B, n, C) float32, first live row, live rows) per sequence (see Fp16Rows.part)."""
        n = max((h + length for h, length in zip(self.head, self.length)), default=0)
        return self.decoded(n), self.head, self.length

    def truncate(self, seqs: list[int], lengths: list[int]) -> None:
        """Sequences seqs[i] back to their first lengths[i] live rows: the later rows and their outliers go (their
        storage is written again by the next append). Outliers lie in row order per (sequence, KV head), so each count
        becomes that of the outliers before the cut (on the kernel path this reads the device: not for a decode step;
        its host bounds stay upper bounds)."""
        if self.keeps_outliers:
            counts = self._outliers_before(seqs, [self.head[b] + n for b, n in zip(seqs, lengths)]).to(torch.int32)
            self.outlier_count[torch.tensor(seqs, device=self.device)] = counts
            for i, b in enumerate(seqs):
                self._outliers[b] = counts[i].tolist()
        for b, n in zip(seqs, lengths):
            self.length[b] = n

    def take_sequences(self, seqs: list[int], index: torch.Tensor) -> None:
        """Keep sequences seqs[0], seqs[1], ... (repeats allowed; `index` the same on the device) as sequences 0, 1,
        ... (see Fp16Rows.take_sequences). The kernel path's pending snapshot of outlier counts is let go: the host
        bounds, taken along, stay upper bounds."""
        self.words = sequences_of(self.words, index)
        self.token = {name: sequences_of(t, index) for name, t in self.token.items()}
        self.blocks = {name: sequences_of(t, index) for name, t in self.blocks.items()}
        for name in ("outlier_positions", "outlier_values", "outlier_offsets", "outlier_count"):
            setattr(self, name, sequences_of(getattr(self, name), index))
        self.length, self.head, self.dropped = ([counts[b] for b in seqs] for counts in (self.length, self.head, self.dropped))
        self._outliers, self._bound, self._added = ([list(per_head[b]) for b in seqs]
                                                    for per_head in (self._outliers, self._bound, self._added))
        self._snapshot = None
        self.moves += 1

    def used_bytes(self, b: int) -> int:
        """Bytes of sequence b's live rows, with the outliers and offset-table entries of every tile that holds one."""
        n, head = self.length[b], self.head[b]
        per_token = self.row_words * 4 + sum(t.shape[2] * t.element_size() for t in self.token.values())
        per_block = sum(t.shape[2] * t.element_size() for t in self.blocks.values())
        outliers = self.outliers[b] * OUTLIER_BYTES + outlier_table_bytes(n, self.kv_heads, head) if self.keeps_outliers else 0
        return n * per_token + (n // self.block) * per_block + outliers


def started_tiles(starts: list[int], counts: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The outlier tiles an append of rows starts[i] .. starts[i] + counts[i] - 1 (for each i) starts: (i, tile)
    arrays, in order; a tile starts with its first row."""
    tiles = [(i, t) for i, (s, c) in enumerate(zip(starts, counts))
             for t in range(-(-s // OUTLIER_TILE_TOKENS), -(-(s + c) // OUTLIER_TILE_TOKENS))]
    return np.array([i for i, _ in tiles], dtype=np.int64), np.array([t for _, t in tiles], dtype=np.int64)
