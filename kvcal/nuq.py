"""KVQuant (`kvcal fit-nuq`): per-layer non-uniform datatypes fit offline from a profile.

Keys: pre-RoPE (or post-RoPE, ablation), per-channel thresholds fixed from calibration (or per-token
online, ablation). Values: per-token thresholds computed online across all KV heads of the token.
Thresholds are the 1-t and t percentiles with t = 1 - outliers/2; elements outside are kept exactly
(dense-and-sparse). One codebook of 2^bits signposts per layer for K and one for V, fit on the
normalized inliers by k-means weighted by the Fisher information; Q-Norm re-centres it so the
dequantized inliers keep the calibration mean and standard deviation. The first `sink` tokens stay fp16.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch
from sklearn.cluster import KMeans

from kvcal.artifacts import read_artifact, write_artifact
from kvcal.errors import KvcalError
from kvcal.quantizers import (
    CodebookCodec,
    LayerCodecs,
    keep_fraction_quantiles,
    nearest_codes,
    normal_float_codebook,
    normalize,
    uniform_codebook,
)

NUQ_KIND = "nuq"
CODEBOOKS = ("nuq", "uniform", "nf")
KMEANS_MAX_POINTS = 1_000_000  # seeded subsample above this, to bound fitting time on wide models


@dataclass(frozen=True)
class NuqSettings:
    bits: int = 3
    bits_from_profile: bool = False
    outliers: float = 0.01
    sink: int = 1
    qnorm: str = "auto"  # auto = on at 2 bits or fewer
    key_granularity: str = "channel"  # channel (KVQuant) or token (ablation)
    key_rope: str = "pre"  # pre (KVQuant) or post (ablation)
    codebook: str = "nuq"  # nuq (Fisher-weighted k-means), uniform, nf (NormalFloat)
    weighting: str = "fisher"  # fisher or none
    seed: int = 0

    def validate(self) -> None:
        if not 1 <= self.bits <= 4:
            raise KvcalError(f"--bits {self.bits} is outside 1-4")
        if not 0.0 <= self.outliers <= 0.1:
            raise KvcalError(f"--outliers {self.outliers} is outside [0, 0.1]; 0.01 keeps 1% of elements exact")
        if self.sink < 0:
            raise KvcalError(f"--sink must be 0 or more (got {self.sink})")
        for name, value, allowed in (("qnorm", self.qnorm, ("auto", "on", "off")),
                                     ("key-granularity", self.key_granularity, ("channel", "token")),
                                     ("key-rope", self.key_rope, ("pre", "post")),
                                     ("codebook", self.codebook, CODEBOOKS),
                                     ("weighting", self.weighting, ("fisher", "none"))):
            if value not in allowed:
                raise KvcalError(f"--{name} '{value}' is not one of {', '.join(allowed)}")

    def uses_qnorm(self, bits: int) -> bool:
        return self.qnorm == "on" or (self.qnorm == "auto" and bits <= 2)


def fit_codebook(points: torch.Tensor, weights: torch.Tensor | None, bits: int, kind: str, qnorm: bool, seed: int) -> torch.Tensor:
    """A sorted codebook of 2^bits signposts for normalized inlier values `points` in [-1, 1]."""
    if kind == "uniform":
        codebook = uniform_codebook(bits)
    elif kind == "nf":
        codebook = normal_float_codebook(bits)
    else:
        x = points.double().numpy()[:, None]
        w = None if weights is None else (weights / weights.mean().clamp(min=1e-30)).double().numpy()
        model = KMeans(n_clusters=2**bits, n_init=1, random_state=seed, max_iter=300).fit(x, sample_weight=w)
        codebook = torch.from_numpy(np.sort(model.cluster_centers_[:, 0])).float()
    if qnorm:
        quantized = codebook[nearest_codes(points, codebook)]
        mu1, s1 = points.mean(), points.std()
        mu2, s2 = quantized.mean(), quantized.std().clamp(min=1e-8)
        codebook = (codebook - mu2) * s1 / s2 + mu1
    return codebook


def _inliers(samples: torch.Tensor, fisher: torch.Tensor | None, per_channel: bool, outliers: float, seed: int):
    """Normalized inliers and their weights, plus per-channel thresholds when those are fixed offline."""
    lo, hi = keep_fraction_quantiles(samples, outliers, dim=0 if per_channel else 1)
    if not per_channel:
        lo, hi = lo[:, None], hi[:, None]
    xhat = normalize(samples, lo, hi)
    keep = xhat.abs() <= 1
    points = xhat[keep]
    weights = None if fisher is None else fisher[keep]
    if points.numel() > KMEANS_MAX_POINTS:
        chosen = torch.from_numpy(np.random.default_rng(seed).choice(points.numel(), KMEANS_MAX_POINTS, replace=False))
        points = points[chosen]
        weights = None if weights is None else weights[chosen]
    return points, weights, ((lo, hi) if per_channel else None)


def fit_nuq(profile_path: str, settings: NuqSettings, on_layer: Callable[[int], None] | None = None) -> tuple[dict, dict]:
    """(tensors, config) of a nuq artifact fit from a profile."""
    settings.validate()
    profile, profile_config = read_artifact(profile_path, "profile")
    calibration = profile_config["calibration"]
    if settings.sink < calibration["sink"]:
        raise KvcalError(
            f"--sink {settings.sink} is below the profile's sink {calibration['sink']}: those tokens were not profiled; "
            f"re-run profile-gradients with --sink {settings.sink}"
        )
    num_layers = profile_config["model"]["fingerprint"]["num_layers"]
    if settings.bits_from_profile:
        bits_k = profile["kvmix.bits.k"].tolist()
        bits_v = profile["kvmix.bits.v"].tolist()
    else:
        bits_k = bits_v = [settings.bits] * num_layers
    rows = profile["samples.position"] >= settings.sink
    if not rows.any():
        raise KvcalError(f"the profile has no sampled tokens past --sink {settings.sink}")
    key_name = "k_pre" if settings.key_rope == "pre" else "k_post"
    # Fisher is taken w.r.t. the pre-RoPE key; for post-RoPE keys it is an approximation (ablation only).
    use_fisher = settings.weighting == "fisher" and settings.codebook == "nuq"
    tensors = {"rope.inv_freq": profile["rope.inv_freq"]}
    for layer in range(num_layers):
        prefix = f"layers.{layer}"
        for kind, sample_name, fisher_name, per_channel, bits in (
            ("k", key_name, "k_pre", settings.key_granularity == "channel", bits_k[layer]),
            ("v", "v", "v", False, bits_v[layer]),
        ):
            samples = profile[f"{prefix}.{sample_name}.samples"][rows]
            fisher = profile[f"{prefix}.{fisher_name}.fisher"][rows] if use_fisher else None
            points, weights, thresholds = _inliers(samples, fisher, per_channel, settings.outliers, settings.seed)
            tensors[f"{prefix}.{kind}.codebook"] = fit_codebook(
                points, weights, bits, settings.codebook, settings.uses_qnorm(bits), settings.seed)
            if thresholds is not None:
                tensors[f"{prefix}.{kind}.lo"], tensors[f"{prefix}.{kind}.hi"] = thresholds
        if on_layer is not None:
            on_layer(layer)
    config = {
        "model": profile_config["model"],
        "rope": profile_config["rope"],
        "calibration": calibration,
        "nuq": {**asdict(settings), "bits_k": bits_k, "bits_v": bits_v,
                "qnorm_k": [settings.uses_qnorm(b) for b in bits_k], "qnorm_v": [settings.uses_qnorm(b) for b in bits_v]},
    }
    return tensors, config


def write_nuq(path, tensors: dict, config: dict):
    return write_artifact(path, tensors, NUQ_KIND, config)


def nuq_layer(key_codebook: torch.Tensor, value_codebook: torch.Tensor, key_lo: torch.Tensor | None,
              key_hi: torch.Tensor | None, outliers: float, key_pre_rope: bool) -> LayerCodecs:
    """How one layer stores keys (per-channel thresholds key_lo/key_hi, or per token when None) and
    values (per-token thresholds computed online) under a fitted nuq artifact."""
    return LayerCodecs(CodebookCodec(key_codebook, key_lo, key_hi, outliers), CodebookCodec(value_codebook, None, None, outliers),
                       key_pre_rope)


def nuq_layers(tensors: dict, config: dict, path: str) -> list[LayerCodecs]:
    """The per-layer codecs of a nuq artifact's (tensors, config)."""
    nuq = config["nuq"]
    per_channel = nuq["key_granularity"] == "channel"
    layers = []
    for layer in range(config["model"]["fingerprint"]["num_layers"]):
        prefix = f"layers.{layer}"
        names = [f"{prefix}.k.codebook", f"{prefix}.v.codebook"] + ([f"{prefix}.k.lo", f"{prefix}.k.hi"] if per_channel else [])
        missing = [name for name in names if name not in tensors]
        if missing:
            raise KvcalError(f"'{path}' lacks tensor {missing[0]}; re-create it with kvcal fit-nuq")
        layers.append(nuq_layer(tensors[names[0]], tensors[names[1]], tensors[names[2]] if per_channel else None,
                                tensors[names[3]] if per_channel else None, nuq["outliers"], nuq["key_rope"] == "pre"))
    return layers


def nuq_name(nuq: dict) -> str:
    """A nuq artifact's name from its settings, ablation tags in brackets: nuq3-1%, uq4 [K post-RoPE], ..."""
    bits_k, bits_v = nuq["bits_k"], nuq["bits_v"]
    width = str(bits_k[0]) if len(set(bits_k + bits_v)) == 1 else f"-K{sum(bits_k) / len(bits_k):.2f}V{sum(bits_v) / len(bits_v):.2f}"
    name = {"nuq": "nuq", "uniform": "uq", "nf": "nf"}[nuq["codebook"]] + width
    if nuq["outliers"]:
        name += f"-{nuq['outliers'] * 100:g}%"
    tags = []
    if nuq["key_granularity"] == "token":
        tags.append("K per-token")
    if nuq["key_rope"] == "post":
        tags.append("K post-RoPE")
    if nuq["codebook"] == "nuq" and nuq["weighting"] == "none":
        tags.append("unweighted")
    if nuq["qnorm"] != "auto":
        tags.append(f"Q-Norm {nuq['qnorm']}")
    if nuq["sink"] != 1:
        tags.append(f"sink {nuq['sink']}")
    return name + (" [" + ", ".join(tags) + "]" if tags else "")
