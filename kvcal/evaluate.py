"""`kvcal eval ppl`: perplexity of the fp model and of simulated quantization methods on the same
consecutive, non-overlapping windows of a corpus, with effective bits from what would be stored."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch

from kvcal.adapters import ModelAdapter, text_inputs
from kvcal.artifacts import check_same_model
from kvcal.errors import KvcalError
from kvcal.simulate import Method, StorageTally, simulated


@dataclass
class PplResult:
    method: str
    nominal_bits: float | None
    effective_bits: float | None
    key_bits: float | None
    value_bits: float | None
    outlier_fraction: float | None
    ppl: float
    delta_pct: float = 0.0
    # bits per element of DeepSeek Sparse Attention's indexer keys, which effective_bits counts beside K and V (None:
    # the model keeps none, or the fp row)
    index_bits: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def consecutive_windows(ids: torch.Tensor, seqlen: int, windows: int) -> torch.Tensor:
    needed = seqlen * windows
    if ids.numel() < needed:
        raise KvcalError(f"asked for {windows} windows of {seqlen} tokens = {needed} tokens but the text has only "
                         f"{ids.numel()}; lower --windows or --seqlen")
    return ids[:needed].view(windows, seqlen)


def check_model_matches(method: Method, adapter: ModelAdapter, model_spec: str, artifact: str) -> None:
    if method.fingerprint is not None:
        check_same_model(method.fingerprint, adapter.fingerprint(), f"'{artifact}'", f"--model {model_spec}",
                         "calibrate for this model or pass the matching --model")


def _window_nll(model, window: torch.Tensor) -> float:
    ids = window[None].to(model.get_input_embeddings().weight.device)
    logits = model(input_ids=ids, use_cache=False, **text_inputs(model, ids)).logits[0, :-1].float()
    return float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))


def evaluate_ppl(model, adapter: ModelAdapter, windows: torch.Tensor, methods: list[Method],
                 on_step: Callable[[], None] | None = None) -> list[PplResult]:
    """fp first, then every method, each over all windows. One forward per (window, method)."""
    predicted = windows.shape[0] * (windows.shape[1] - 1)
    results = []
    with torch.inference_mode():
        for method in [None, *methods]:
            nll = 0.0
            tally = StorageTally()
            with nullcontext() if method is None else simulated(model, adapter, method, tally):
                for window in windows:
                    nll += _window_nll(model, window)
                    if on_step is not None:
                        on_step()
            ppl = math.exp(nll / predicted)
            if method is None:
                results.append(PplResult("fp", None, 16.0, 16.0, 16.0, None, ppl))
                continue
            results.append(PplResult(
                method.name, method.nominal_bits, tally.effective_bits,
                tally.key_bits / tally.key_elements if tally.key_elements else None,  # (MLA without RoPE stores no key)
                tally.value_bits / tally.value_elements, tally.outliers / tally.elements, ppl,
                100.0 * (ppl / results[0].ppl - 1.0),
                tally.index_bits / tally.index_elements if tally.index_elements else None,
            ))
    return results
