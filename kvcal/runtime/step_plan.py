"""The plan of one forward step through a quantized cache (kvcal.runtime.cache.WiredCache): what every attention
layer of the step shares, made by its first layer and reused by the others (StepPlan)."""

from __future__ import annotations

import torch

from kvcal import wiring
from kvcal.errors import KvcalError
from kvcal.runtime import kernels, reference
from kvcal.runtime.store import upload
from kvcal.spans import AttentionSpan

# why a step that pads a sequence is refused where an indexer picks key blocks (ModelAdapter.picks_key_blocks)
BLOCKS_UNDER_PADDING = ("MiniMax-M3's block-sparse indexer places its key blocks by cache column and its queries by "
                        "position, which padding sets apart: a padded sequence's picks are not its own (transformers' own "
                        "cache gives it other tokens than it alone); give sequences of equal length, or one at a time")


class StepPlan:
    """What every layer of one forward step shares, made once (by WiredCache.plan_for at the step's first layer):
    which of the step's tokens are real (`valid` on the device; per sequence `counts`, the sequences with a token
    `rows`), tokens stored per sequence before and after the step, each sequence's RoPE offset (the position id of
    its first stored token), and, made on first use and kept for the other layers (`memo`): gather indices per
    store layout, RoPE tables and decode masks per length, and the kernels' launch data (kernels.DecodeStep).

    The host reads the device at most once here: which tokens are padding when the step has an attention mask
    (none when it has no mask), and the position id of a sequence's first token in the step that brings it; and,
    in a step of several tokens of a model attending to images both ways, whether a token sees a later one."""

    def __init__(self, cache, attention_mask, batch: int, m: int, device, positions: torch.Tensor | None):
        self.batch, self.m, self.device = batch, m, device
        self.mask = attention_mask
        self.valid = wiring.real_tokens(attention_mask, batch, m, device)
        self.image_blocks = cache.adapter.image_blocks
        self.all_valid = attention_mask is None
        self._flags = None if self.all_valid else self.valid.tolist()
        self.counts = [m] * batch if self.all_valid else [sum(row) for row in self._flags]
        self.rows = [b for b in range(batch) if self.counts[b]]
        if cache.adapter.picks_key_blocks and min(self.counts) < m:
            raise KvcalError(BLOCKS_UNDER_PADDING)  # (before the cache counts the step: the layers keep none of it)
        self.ones = [1] * len(self.rows)
        if cache.lengths is None:
            cache.lengths, cache.position_offset = [0] * batch, [None] * batch
        elif len(cache.lengths) != batch:
            raise KvcalError(f"this step feeds {batch} sequences to a cache holding {len(cache.lengths)}: give the cache the "
                             f"batch first (cache.batch_repeat_interleave(n) for n beams or samples of each sequence it "
                             "holds, cache.take_sequences(index)), or empty it (cache.reset())")
        self.before = list(cache.lengths)
        self.after = [n + c for n, c in zip(self.before, self.counts)]
        first_seen = [b for b in self.rows if cache.position_offset[b] is None]
        found = [0] * len(first_seen)
        if first_seen and positions is not None:  # the position id of each sequence's first real token
            columns = [0 if self.all_valid else self._flags[b].index(True) for b in first_seen]
            found = positions.expand(batch, m)[torch.tensor(first_seen), torch.tensor(columns)].tolist()
        offsets = list(cache.position_offset)
        for b, position in zip(first_seen, found):
            offsets[b] = int(position)
        # the last position + 1 over the batch after the step: what transformers' LongRoPE picks its frequencies by
        self.rope_tokens = max((o + n for o, n in zip(offsets, self.after) if o is not None), default=0)
        cache.rope_era(self.rope_tokens)  # (refused before the cache counts the step)
        cache.lengths, cache.position_offset[:] = list(self.after), offsets
        self.offsets = cache.position_offset
        self.memo: dict = {}

    def ahead_of(self, attention_mask) -> torch.Tensor | None:
        """(batch, q, q): the step's tokens each of the mask's q queries (the step's last q) sees after itself under a
        layer's mask (an image's, which Gemma 3's layers and Gemma 4's sliding ones attend to both ways:
        wiring.own_tokens_ahead), None where none does; made once per mask, which the layers of a type share."""
        if not self.image_blocks:
            return None
        # keyed by the mask's identity, the mask kept beside its answer so that no other takes its id this step
        made = self.shared(("ahead", id(attention_mask)),
                           lambda: (attention_mask, wiring.own_tokens_ahead(attention_mask, self.valid)))
        return made[1]

    def shared(self, key, make):
        """memo[key], made by make() the first time (once per step, whichever layer asks first)."""
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]

    def step_rows(self, new: torch.Tensor) -> torch.Tensor:
        """A decode step's real tokens (len(rows), C) fp16 of new (B, 1, C): the whole batch, or an index of it."""
        if len(self.rows) == self.batch:
            return new[:, 0].to(torch.float16)
        index = self.shared("rows", lambda: upload(self.rows, new.device))
        return new[:, 0].index_select(0, index).to(torch.float16)

    def in_sequence(self) -> torch.Tensor:
        """(B, m): each column's position in its sequence (0: its first real token), counting its real tokens (a
        padding column: the position before the next real one)."""
        return self.shared("in sequence", lambda: torch.tensor(self.before, device=self.device)[:, None]
                           + self.valid.long().cumsum(-1) - 1)

    def columns(self, b: int) -> torch.Tensor:
        """The columns of sequence b's real tokens in the step."""
        return self.shared(("columns", b), lambda: torch.arange(self.m, device=self.device) if self.all_valid else
                           torch.tensor([i for i, real in enumerate(self._flags[b]) if real], device=self.device))

    def chosen_tokens(self, chosen: torch.Tensor, b: int) -> torch.Tensor:
        """(groups, sequence b's real tokens of the step, its tokens: those stored before the step, then the step's):
        which ones each attends, of `chosen` (batch, groups, m, columns of the mask: a sparse layer's pick,
        wiring.chosen_columns). Its columns are the sequence's tokens where its last real token sees them (those layers
        have no window: it sees all)."""
        rows = self.columns(b)
        if self.mask is None:  # (no padding: every column is the sequence's)
            return chosen[b][:, rows]
        last = self.m - 1 - self._flags[b][::-1].index(True)
        own = self.shared(("own columns", b), lambda: wiring.visible(self.mask)[b, last])
        return chosen[b][:, rows][..., own]

    def chosen_rows(self, chosen: torch.Tensor) -> torch.Tensor:
        """(batch, groups, the longest sequence's stored tokens): which of its stored tokens each sequence's query
        attends, of a decode step's `chosen` (batch, groups, 1, columns of the mask): its stored tokens are the columns
        its query sees, in order (no padding is stored; the layers picking have no window)."""
        picked = chosen[:, :, 0].transpose(0, 1)  # (groups, batch, columns)
        own = torch.ones_like(picked[0]) if self.mask is None else wiring.visible(self.mask)[:, -1]
        rows = torch.zeros(len(picked), self.batch, max(self.after), dtype=torch.bool, device=chosen.device)
        sequence = torch.arange(self.batch, device=chosen.device)[:, None].expand_as(own)
        rows[:, sequence[own], (own.cumsum(-1) - 1)[own]] = picked[:, own]
        return rows.transpose(0, 1)

    def real_rows(self, new: torch.Tensor, seqs: list[int]) -> torch.Tensor:
        """The real tokens (fp16, grouped by sequence) of sequences `seqs` of new (B, m, C)."""
        if self.all_valid and seqs == list(range(self.batch)):
            return new.reshape(-1, new.shape[-1]).to(torch.float16)
        chosen = torch.zeros_like(self.valid)
        chosen[seqs] = self.valid[seqs]
        return new[chosen].to(torch.float16)

    def zero_padding(self, out: torch.Tensor) -> torch.Tensor:
        """out (B, 1, ...) with the sequences that have no token this step set to zeros."""
        if len(self.rows) == self.batch:
            return out
        return out.masked_fill(~self.valid[:, :1].view(self.batch, 1, *[1] * (out.dim() - 2)), 0)

    def rope(self, tokens: int, inv_freq: torch.Tensor, rope_scaling: float, dropped: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (B, 1, tokens, head_dim) at each sequence's positions offset + dropped .. offset + dropped + tokens
        - 1 (dropped: the tokens its store dropped from the front)."""
        def make():
            offsets = torch.tensor([(o or 0) + d for o, d in zip(self.offsets, dropped)], device=self.device)[:, None]
            positions = torch.arange(tokens, device=self.device)[None, :] + offsets
            cos, sin = reference.rope_tables(positions, inv_freq, rope_scaling)
            return cos[:, None], sin[:, None]
        return self.shared(("rope", tokens, inv_freq.data_ptr(), rope_scaling, tuple(dropped)), make)

    def visible(self, tokens: int, span: AttentionSpan | None, store) -> torch.Tensor:
        """(B, tokens): which of the padded tokens (store.read_batch) each sequence's decode query sees: its stored
        ones, of them (with a span) those in its span."""
        if span is not None and not store.ordered:  # tokens not in position order: their own positions
            positions = [store.positions(b) for b in range(self.batch)]
            padded = torch.stack([torch.cat([p, p.new_full((tokens - len(p),), -1)]) for p in positions]).to(self.device)
            after = torch.tensor(self.after, device=self.device)[:, None]
            return (torch.arange(tokens, device=self.device)[None, :] < after) & (padded >= span.first_seen(after - 1))

        dropped = tuple(store.dropped)

        def make():
            after = torch.tensor(self.after, device=self.device)[:, None]
            index = torch.arange(tokens, device=self.device)[None, :] + torch.tensor(dropped, device=self.device)[:, None]
            seen = index < after
            return seen & (index >= span.first_seen(after - 1)) if span is not None else seen
        return self.shared(("visible", tokens, span, dropped), make)

    def stored_positions(self, dropped: list[int]) -> list[int]:
        """Each sequence's position of its first stored token, past the `dropped` tokens a span let go."""
        return [(o or 0) + d for o, d in zip(self.offsets, dropped)]

    def first_visible(self, span: AttentionSpan | None, dropped: list[int]) -> list[int] | None:
        """Each sequence's first stored token its decode query sees (None: all of them, no span)."""
        return None if span is None else [max(span.first_seen(after - 1) - d, 0) for after, d in zip(self.after, dropped)]

    def kernel_step(self, device):
        return self.shared(("kernels", str(device)), lambda: kernels.DecodeStep(device))
