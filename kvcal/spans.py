"""Which earlier tokens a query of a windowed layer sees (a sliding window's, an attention chunk's), as the model's
mask says: what the adapter reads from a config, the simulation, the runtime cache and the bytes formula share."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionSpan:
    """The earlier tokens a query of a windowed layer sees, by their positions in its sequence (0: its first real
    token): a sliding window's last `size`, itself included (Mistral's, Gemma's sliding layers), or, `chunked`, those of
    its own chunk (Llama 4's chunked attention, as transformers' chunked mask counts past left padding): from its
    position rounded down to a multiple of `size`. Either way a query sees at most `size` tokens, and transformers'
    cache keeps a layer's last size - 1."""

    size: int
    chunked: bool = False

    def __str__(self) -> str:
        return f"chunks of {self.size} tokens" if self.chunked else f"a sliding window of {self.size} tokens"

    def first_seen(self, position):
        """The first position a query at `position` (an int or an integer tensor) sees."""
        return position // self.size * self.size if self.chunked else position - (self.size - 1)

    def sees(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """(len(queries), len(keys)): which keys each query sees, both given by position (causal within the span)."""
        keys = keys[None, :]
        return (keys <= queries[:, None]) & (keys >= self.first_seen(queries)[:, None])


def attention_span(window: int | None, chunk: int | None) -> AttentionSpan | None:
    """A layer's span from its sliding window or its attention chunk (at most one of them), None for neither."""
    if window is not None:
        return AttentionSpan(window)
    return AttentionSpan(chunk, chunked=True) if chunk is not None else None


def call_mismatch(window: int | None, span: AttentionSpan | None) -> str | None:
    """Why an attention call asking for sliding window `window` (None: none) does not attend as a layer of this span
    does, or None where it does (a chunked layer's call names none: transformers passes chunks in the mask alone)."""
    if window == (None if span is None or span.chunked else span.size):
        return None
    given = f"a sliding window of {window} tokens" if window is not None else "no sliding window"
    return f"attends with {given} but its config gives it {span or 'neither'}"


def recorded_spans(model_config: dict, num_layers: int) -> list[AttentionSpan | None]:
    """Per layer, the span an artifact's `model` config records (its `windows` and `chunks`; neither in profiles of
    models without, nor in those written before they were recorded)."""
    windows = model_config.get("windows") or [None] * num_layers
    chunks = model_config.get("chunks") or [None] * num_layers
    return [attention_span(window, chunk) for window, chunk in zip(windows, chunks)]
