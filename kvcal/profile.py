"""`profile-gradients` as a library call: validate, load, capture, allocate, write profile.safetensors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvcal.adapters import adapt
from kvcal.artifacts import check_writable, write_artifact
from kvcal.capture import CaptureResult, CaptureSettings, profile_gradients
from kvcal.errors import KvcalError
from kvcal.data import check_seed, load_text, sample_windows, tokenize
from kvcal.fit.kvmix import WidthChoice, allocate, check_high_frac, check_target_bits, rpc_ratio
from kvcal.models import check_placement, load_model, resolve_model

PROFILE_KIND = "profile"


@dataclass(frozen=True)
class KvmixSettings:
    high_frac: float = 0.2
    target_bits: float | None = None
    key_widths: WidthChoice = WidthChoice(high=3, low=2)
    value_widths: WidthChoice = WidthChoice(high=4, low=2)

    def validate(self) -> None:
        self.key_widths.validate("key")
        self.value_widths.validate("value")
        check_high_frac(self.high_frac)
        if self.target_bits is not None:
            for widths in (self.key_widths, self.value_widths):
                check_target_bits(self.target_bits, widths)


@dataclass(frozen=True)
class ProfileRequest:
    model: str | None
    dataset: str
    nsamples: int
    seqlen: int
    seed: int
    capture: CaptureSettings
    kvmix: KvmixSettings
    dtype: str = "auto"
    device: str = "cpu"

    def validate(self) -> None:
        """Checks that need neither the model nor the text, so they fail in milliseconds."""
        if self.nsamples < 1:
            raise KvcalError(f"--nsamples must be at least 1 (got {self.nsamples})")
        if self.seqlen < 2:
            raise KvcalError(f"--seqlen must be at least 2 (got {self.seqlen})")
        check_seed(self.seed)
        check_placement(self.dtype, self.device)
        if not 0 <= self.capture.sink < self.seqlen:
            raise KvcalError(f"--sink must be in [0, seqlen) (got {self.capture.sink} with seqlen {self.seqlen})")
        if self.capture.max_tokens_per_layer is not None and self.capture.max_tokens_per_layer < 1:
            raise KvcalError(f"--max-tokens-per-layer must be at least 1 (got {self.capture.max_tokens_per_layer})")
        if self.capture.store_windows < 0:
            raise KvcalError(f"--store-windows must be 0 or more (got {self.capture.store_windows})")
        self.kvmix.validate()


def default_profile_path(model_name: str) -> Path:
    return Path("artifacts") / model_name / "profile.safetensors"


def kvmix_tensors(importance_k: torch.Tensor, importance_v: torch.Tensor, settings: KvmixSettings,
                  key_widths: list[int]) -> dict:
    bits_k = allocate(importance_k, settings.key_widths, settings.high_frac, settings.target_bits, key_widths)
    bits_v = allocate(importance_v, settings.value_widths, settings.high_frac, settings.target_bits)
    return {
        "importance.k": importance_k,
        "importance.v": importance_v,
        "kvmix.bits.k": torch.tensor(bits_k, dtype=torch.int32),
        "kvmix.bits.v": torch.tensor(bits_v, dtype=torch.int32),
        "kvmix.rpc.k": torch.tensor([rpc_ratio(b) for b in bits_k], dtype=torch.float32),
        "kvmix.rpc.v": torch.tensor([rpc_ratio(b) for b in bits_v], dtype=torch.float32),
    }


def profile_config(request: ProfileRequest, fingerprint: dict, model_spec: str, corpus_tokens: int,
                   capture: CaptureResult, adapter) -> dict:
    kvmix = asdict(request.kvmix)
    return {
        "model": {"spec": model_spec, "fingerprint": fingerprint, "windows": adapter.windows,
                  **({"chunks": adapter.chunks} if any(adapter.chunks) else {}),
                  "score_scale": adapter.score_scale,
                  **({"score_scales": adapter.score_scales} if len(set(adapter.score_scales)) > 1 else {}),
                  **({"attention_softcap": adapter.softcap} if adapter.softcap is not None else {}),
                  **({"attention_sinks": [h.sinks.detach().float().tolist() for h in adapter.layers]}
                     if adapter.layers[0].sinks is not None else {})},
        "calibration": {
            "dataset": request.dataset,
            "nsamples": request.nsamples,
            "seqlen": request.seqlen,
            "seed": request.seed,
            "corpus_tokens": corpus_tokens,
            **asdict(request.capture),
            **capture.counts,
        },
        "kvmix": kvmix,
        "rope": {"attention_scaling": adapter.rope_scaling, "convention": "rotate_half"},
    }


def run_profile(request: ProfileRequest, out: str | Path | None,
                on_start: Callable[[int], None] | None = None,
                on_window: Callable[[int], None] | None = None) -> tuple[Path, dict, dict]:
    """Validate, load model and text, run the capture pass and write the profile.
    Returns (path, tensors, config). `on_start(nsamples)` fires when the pass begins."""
    request.validate()
    source = resolve_model(request.model)
    out_path = check_writable(out if out is not None else default_profile_path(source.name))
    text = load_text(request.dataset)
    model, tokenizer, source = load_model(request.model, request.dtype, request.device)
    ids = tokenize(text, tokenizer)
    tensors, config = profile_model(model, ids, request, source.spec, on_start, on_window)
    return write_artifact(out_path, tensors, PROFILE_KIND, config), tensors, config


def profile_model(model, ids: torch.Tensor, request: ProfileRequest, model_spec: str,
                  on_start: Callable[[int], None] | None = None,
                  on_window: Callable[[int], None] | None = None) -> tuple[dict, dict]:
    """The capture pass over a model already loaded, on the token ids of its calibration text: the profile's
    (tensors, config), which write_artifact(path, tensors, PROFILE_KIND, config) writes as run_profile does."""
    request.validate()
    adapter = adapt(model)
    adapter.check_seqlen(request.seqlen)
    windows = sample_windows(ids, request.nsamples, request.seqlen, request.seed)
    if on_start is not None:
        on_start(request.nsamples)
    capture = profile_gradients(model, adapter, windows, request.capture, on_window)
    tensors = {**capture.tensors, **kvmix_tensors(capture.importance_k, capture.importance_v, request.kvmix,
                                                  adapter.kv_widths)}
    config = profile_config(request, adapter.fingerprint(), model_spec, ids.numel(), capture, adapter)
    return tensors, config
