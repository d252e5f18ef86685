"""FP8 KV-cache scales searched on a kvcal profile (`kvcal profile-gradients`).

For each layer, starting from absmax / 448 (absmax over every calibration token the profile saw: its streaming
statistics and its stored windows), multiples 0.5 to 2.0 of it are tried and the one with the smallest error of the
attention output on the profile's stored windows is kept: keys first (values fp), then values (keys at the chosen
scale). With `attn_head` every KV head is chosen on its own (a head's output depends only on its own scales). A layer
or head whose calibrated pair does not beat absmax / 448 on the windows keeps absmax / 448. A profile without stored
windows gives plain absmax / 448 from its streaming statistics (sink tokens excluded). `scales="absmax"` gives the
absmax / 448 starting scales without searching: the baseline the calibrated scales are measured against."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvcal.adapters import attention_sinks, attention_softcap, kv_shapes, query_heads, score_scale
from kvcal.artifacts import read_artifact
from kvcal.errors import KvcalError
from kvcal.export.fp8 import FP8_MAX, fp8_fake_quantize
from kvcal.kv import softcapped, softmax_with_sinks
from kvcal.rope import layer_inv_freq, layer_rope_scaling, rotate_keys

STRATEGIES = ("tensor", "attn_head")
# Multiples of absmax / 448 tried, 0.5 to 2.0 by 0.025; 1.0 first so that ties keep plain absmax / 448. Below 1
# the largest values saturate; from 1 to 2 nothing does and the e4m3 grid (3 mantissa bits) shifts by one
# octave, which is all a float format's scale changes apart from saturation and subnormals.
SCALE_GRID = (1.0, *(round(0.5 + 0.025 * i, 3) for i in range(61) if i != 20))
MIN_SCALE = 2.0**-24  # a head that is all zeros still gets a usable (positive) scale
SCALE_CHOICES = ("calibrated", "absmax")  # searched on the windows, or the absmax / 448 they start from


@dataclass
class LayerScales:
    """One layer's chosen scales and their absmax / 448 starting points, (heads,) float32 each, where
    heads is 1 for the tensor strategy; errors are the attention-output MSE on the stored windows."""

    k: torch.Tensor
    v: torch.Tensor
    k_absmax: torch.Tensor
    v_absmax: torch.Tensor
    error_absmax: float | None = None
    error_calibrated: float | None = None
    kept_absmax: int = 0  # heads (or the layer) where the searched pair lost to absmax / 448

    @property
    def reduction(self) -> float | None:
        if self.error_absmax is None or self.error_calibrated is None or self.error_absmax == 0:
            return None
        return 1.0 - self.error_calibrated / self.error_absmax


@dataclass
class ScaleFit:
    strategy: str
    source: str  # "windows" (absmax over windows and statistics) or "statistics" (absmax of the streaming statistics only)
    scales: str = "calibrated"  # what was asked: searched scales, or the absmax / 448 starting points
    fingerprint: dict | None = None  # of the profiled model, which the scales are for
    layers: list[LayerScales] = field(default_factory=list)

    @property
    def searched(self) -> bool:
        return self.source == "windows" and self.scales == "calibrated"

    @property
    def note(self) -> str:
        if self.scales == "absmax" and self.source == "windows":
            return ("scales are plain absmax / 448 (--scales absmax) over every token the profile saw (post-RoPE keys, values), "
                    "not searched")
        if self.source == "windows":
            return "scales searched on the profile's stored windows (attention-output MSE, post-RoPE keys)"
        return ("the profile has no stored windows: scales are plain absmax / 448 of its streaming statistics "
                "(post-RoPE keys, values; sink tokens excluded), not searched; re-run kvcal profile-gradients "
                "with --store-windows 2 to calibrate them")


def check_strategy(strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise KvcalError(f"unknown --strategy '{strategy}'; choose one of {', '.join(STRATEGIES)}")


def check_scales(scales: str) -> None:
    if scales not in SCALE_CHOICES:
        raise KvcalError(f"unknown --scales '{scales}'; choose one of {', '.join(SCALE_CHOICES)}")


class WindowAttention:
    """One layer's attention over the profile's stored windows, with K (post-RoPE) and V fake-quantized to
    FP8 as vLLM stores them; errors are per KV head: the MSE of the attention output of the query heads
    it serves, summed over windows. Every query row sees every earlier token quantized (vLLM keeps no
    fp16 sinks or window)."""

    def __init__(self, profile: dict, layer: int, profile_config: dict):
        prefix = f"layers.{layer}.windows"
        fingerprint, rope_scaling = profile_config["model"]["fingerprint"], layer_rope_scaling(profile_config["rope"], layer)
        scale = score_scale(profile_config["model"])
        heads, (self.kv_heads, self.head_dim) = query_heads(fingerprint)[layer], kv_shapes(fingerprint)[layer]
        self.group = heads // self.kv_heads
        sinks = attention_sinks(profile_config["model"], layer)
        self.sinks = sinks.view(self.kv_heads, self.group, 1, 1) if sinks is not None else None  # per query head
        self.softcap = attention_softcap(profile_config["model"])
        inv_freq = layer_inv_freq(profile["rope.inv_freq"], layer, self.head_dim)
        positions = profile["windows.positions"].long()
        self.queries, self.keys, self.values, self.reference = [], [], [], []
        tokens = profile[f"{prefix}.k"].shape[1]
        self.blocked = ~torch.ones(tokens, tokens, dtype=torch.bool).tril()
        for w in range(profile[f"{prefix}.k"].shape[0]):
            q = rotate_keys(profile[f"{prefix}.q"][w].float(), positions[w], heads, inv_freq, rope_scaling)
            self.queries.append(q.view(tokens, self.kv_heads, self.group, self.head_dim).permute(1, 2, 0, 3) * scale)
            self.keys.append(rotate_keys(profile[f"{prefix}.k"][w].float(), positions[w], self.kv_heads, inv_freq, rope_scaling))
            self.values.append(profile[f"{prefix}.v"][w].float())
        self.reference = [self._probs(w, k) @ self._heads(v) for w, (k, v) in enumerate(zip(self.keys, self.values))]
        self._cached: tuple[torch.Tensor | None, list[torch.Tensor]] | None = None

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """(tokens, kv_heads * channels) -> (kv_heads, 1, tokens, channels): keys, or values (MiMo-V2-Flash's narrower)."""
        return x.view(x.shape[0], self.kv_heads, -1).transpose(0, 1)[:, None]

    def _probs(self, w: int, keys: torch.Tensor) -> torch.Tensor:
        scores = self.queries[w] @ self._heads(keys).transpose(-1, -2)
        return softmax_with_sinks(softcapped(scores, self.softcap).masked_fill(self.blocked, float("-inf")), self.sinks)

    def errors(self, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> torch.Tensor:
        """Per-KV-head attention-output MSE (kv_heads,) with keys and/or values quantized at these scales
        (None: kept in full precision). Scales are (kv_heads,) or (1,)."""
        if self._cached is None or not _same(self._cached[0], k_scale):
            probs = [self._probs(w, k if k_scale is None else fp8_fake_quantize(k, k_scale)) for w, k in enumerate(self.keys)]
            self._cached = (None if k_scale is None else k_scale.clone(), probs)
        total = torch.zeros(self.kv_heads, dtype=torch.float64)
        for probs, v, ref in zip(self._cached[1], self.values, self.reference):
            out = probs @ self._heads(v if v_scale is None else fp8_fake_quantize(v, v_scale))
            total += (out - ref).square().mean(dim=(1, 2, 3)).double()
        return total


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and bool(torch.equal(a, b))


def _per_head_absmax(channel_absmax: torch.Tensor, kv_heads: int) -> torch.Tensor:
    return channel_absmax.float().view(kv_heads, -1).amax(dim=1)


def _starting_scales(absmax: torch.Tensor, strategy: str) -> torch.Tensor:
    """absmax / 448 per KV head (attn_head) or the layer's, repeated for every head (tensor)."""
    if strategy == "tensor":
        absmax = absmax.amax().expand_as(absmax)
    return (absmax / FP8_MAX).clamp(min=MIN_SCALE).contiguous()


def _search(error: Callable[[torch.Tensor], torch.Tensor], start: torch.Tensor, per_head: bool) -> torch.Tensor:
    """The multiple of `start` (per head, or one for all heads) with the smallest error."""
    errors = torch.stack([error(start * m) for m in SCALE_GRID])  # (grid, kv_heads)
    grid = torch.tensor(SCALE_GRID, dtype=torch.float32)
    if per_head:
        return start * grid[errors.argmin(dim=0)]
    return start * grid[errors.sum(dim=1).argmin()]


def _fit_layer(objective: WindowAttention, k_start: torch.Tensor, v_start: torch.Tensor, strategy: str) -> LayerScales:
    per_head = strategy == "attn_head"
    k = _search(lambda s: objective.errors(s, None), k_start, per_head)
    v = _search(lambda s: objective.errors(k, s), v_start, per_head)
    calibrated, baseline = objective.errors(k, v), objective.errors(k_start, v_start)
    kept = 0
    if per_head:  # heads are independent: keep absmax / 448 where the searched pair does not beat it
        lost = calibrated > baseline
        kept = int(lost.sum())
        if kept:
            k, v = torch.where(lost, k_start, k), torch.where(lost, v_start, v)
            calibrated = objective.errors(k, v)
    elif float(calibrated.sum()) > float(baseline.sum()):
        k, v, calibrated, kept = k_start, v_start, baseline, 1
    width = slice(None) if per_head else slice(0, 1)
    return LayerScales(k=k[width].clone(), v=v[width].clone(), k_absmax=k_start[width].clone(), v_absmax=v_start[width].clone(),
                       error_absmax=float(baseline.mean()), error_calibrated=float(calibrated.mean()), kept_absmax=kept)


def calibrate_scales(profile_path: str | Path, strategy: str, on_layer: Callable[[int], None] | None = None,
                     scales: str = "calibrated") -> tuple[ScaleFit, dict]:
    """(per-layer FP8 K/V scales, the profile's config) for vLLM from a kvcal profile: searched on its stored
    windows (`scales="calibrated"`), or their absmax / 448 starting points (`scales="absmax"`)."""
    check_strategy(strategy)
    check_scales(scales)
    profile, config = read_artifact(profile_path, "profile")
    fingerprint = config["model"]["fingerprint"]
    shapes, num_layers = kv_shapes(fingerprint), fingerprint["num_layers"]
    has_windows = "layers.0.windows.q" in profile and "windows.positions" in profile
    fit = ScaleFit(strategy, "windows" if has_windows else "statistics", scales, fingerprint)
    for layer in range(num_layers):
        try:
            k_absmax = _per_head_absmax(profile[f"layers.{layer}.k_post.absmax"], shapes[layer][0])
            v_absmax = _per_head_absmax(profile[f"layers.{layer}.v.absmax"], shapes[layer][0])
        except KeyError as exc:
            raise KvcalError(f"profile '{profile_path}' lacks tensor {exc}; re-create it with kvcal profile-gradients") from exc
        if has_windows:  # the windows also hold the sink tokens the streaming statistics leave out
            objective = WindowAttention(profile, layer, config)
            k_absmax = torch.maximum(k_absmax, _per_head_absmax(torch.stack([k.abs().amax(0) for k in objective.keys]).amax(0), shapes[layer][0]))
            v_absmax = torch.maximum(v_absmax, _per_head_absmax(torch.stack([v.abs().amax(0) for v in objective.values]).amax(0), shapes[layer][0]))
        k_start, v_start = _starting_scales(k_absmax, strategy), _starting_scales(v_absmax, strategy)
        if fit.searched:
            fit.layers.append(_fit_layer(objective, k_start, v_start, strategy))
        else:
            width = slice(None) if strategy == "attn_head" else slice(0, 1)
            error = float(objective.errors(k_start, v_start).mean()) if has_windows else None
            fit.layers.append(LayerScales(k=k_start[width].clone(), v=v_start[width].clone(),
                                          k_absmax=k_start[width].clone(), v_absmax=v_start[width].clone(), error_absmax=error))
        if on_layer is not None:
            on_layer(layer)
    return fit, config
