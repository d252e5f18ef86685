"""KVQuant (`kvcal fit-nuq`): per-layer non-uniform datatypes fit offline from a profile.

Keys: pre-RoPE (or post-RoPE, ablation), per-channel thresholds fixed from calibration (or per-token
online, ablation). Values: per-token thresholds computed online across all KV heads of the token.
Thresholds are the 1-t and t percentiles with t = 1 - outliers/2; elements outside are kept exactly
(dense-and-sparse). One codebook of 2^bits signposts per layer for K and one for V, fit on the
normalized inliers by k-means weighted by the Fisher information; Q-Norm re-centres it so the
dequantized inliers keep the calibration mean and standard deviation. The first `sink` tokens stay fp16, and
so do the most recent `window` tokens (a sliding window, as SKVQ and KIVI's residual keep): at short
contexts the recent tokens carry much of the attention, and each costs 16 bits per element instead of ~4.

Widths: one for every layer (--bits), the profile's KVmix allocation (--bits-from-profile), or chosen per
layer and per K/V to a budget of real bits (--target-bits, KVQuant's sensitivity): every tensor is fit at
each of KNAPSACK_WIDTHS, its cost is the Fisher-weighted squared error of the calibration samples
(sum F * (x - Q(x))^2, a second-order estimate of the loss it adds) and its price the bits per element the
runtime stores for it (codes, per-token thresholds, outliers; measured on the samples by the codec's own
tally); an exact multiple-choice knapsack picks the widths of least total cost within the budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch

from kvcal.adapters import kv_shapes
from kvcal.artifacts import read_artifact, write_artifact
from kvcal.data import check_seed
from kvcal.errors import KvcalError
from kvcal.packing import OUTLIER_BYTES, OUTLIER_OFFSET_BYTES, OUTLIER_TILE_TOKENS
from kvcal.quantizers import (
    CodebookCodec,
    LayerCodecs,
    keep_fraction_quantiles,
    nearest_codes,
    normal_float_codebook,
    normalize,
    uniform_codebook,
)
from kvcal.spans import AttentionSpan, recorded_spans

NUQ_KIND = "nuq"
CODEBOOKS = ("nuq", "uniform", "nf")
KMEANS_MAX_POINTS = 1_000_000  # seeded subsample above this, to bound fitting time on wide models
MAX_BITS = 8  # 5-7-bit codes are stored as bit-planes, 8-bit ones 4 to a word (kvcal.packing); the kernels serve 1-4
KNAPSACK_WIDTHS = (2, 3, 4)  # the widths --target-bits chooses from
KNAPSACK_STEP = 1e-4  # bits per element: the knapsack's price unit (prices are rounded up to it)


@dataclass(frozen=True)
class NuqSettings:
    bits: int = 3
    bits_from_profile: bool = False
    target_bits: float | None = None  # real bits per element: per-layer widths by the Fisher knapsack
    target_context: int = 0  # tokens at which target_bits is the budget (sliding-window layers hold fewer); 0: any
    outliers: float = 0.01
    sink: int = 1
    window: int = 0  # most recent tokens kept fp16 (the fit is the same; the runtime and simulation keep them)
    qnorm: str = "auto"  # auto = on at 2 bits or fewer
    key_granularity: str = "channel"  # channel (KVQuant) or token (ablation)
    key_rope: str = "pre"  # pre (KVQuant) or post (ablation)
    codebook: str = "nuq"  # nuq (Fisher-weighted k-means), uniform, nf (NormalFloat)
    weighting: str = "fisher"  # fisher or none
    seed: int = 0

    def validate(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 1 <= self.bits <= MAX_BITS:
            raise KvcalError(f"--bits {self.bits} is not a code width in 1-{MAX_BITS}")
        if self.target_bits is not None:
            if self.bits_from_profile:
                raise KvcalError("--target-bits and --bits-from-profile both choose the widths; give one of them")
            floor = min(KNAPSACK_WIDTHS) + 8 * OUTLIER_BYTES * self.outliers  # codes + outliers of the narrowest width
            if not isinstance(self.target_bits, (int, float)) or not floor <= self.target_bits <= 8:
                raise KvcalError(f"--target-bits {self.target_bits} is outside [{floor:g}, 8] real bits per element")
        if self.target_context and self.target_bits is None:
            raise KvcalError("--target-context sets where --target-bits is the budget; give --target-bits too")
        if self.target_context < 0:
            raise KvcalError(f"--target-context must be 0 or a number of tokens (got {self.target_context})")
        if not 0.0 <= self.outliers <= 0.1:
            raise KvcalError(f"--outliers {self.outliers} is outside [0, 0.1]; 0.01 keeps 1% of elements exact")
        check_seed(self.seed)
        if self.sink < 0:
            raise KvcalError(f"--sink must be 0 or more (got {self.sink})")
        if self.window < 0:
            raise KvcalError(f"--window must be 0 or more (got {self.window})")
        for name, value, allowed in (("qnorm", self.qnorm, ("auto", "on", "off")),
                                     ("key-granularity", self.key_granularity, ("channel", "token")),
                                     ("key-rope", self.key_rope, ("pre", "post")),
                                     ("codebook", self.codebook, CODEBOOKS),
                                     ("weighting", self.weighting, ("fisher", "none"))):
            if value not in allowed:
                raise KvcalError(f"--{name} '{value}' is not one of {', '.join(allowed)}")

    def uses_qnorm(self, bits: int) -> bool:
        return self.qnorm == "on" or (self.qnorm == "auto" and bits <= 2)

    @property
    def per_layer_widths(self) -> bool:
        return self.bits_from_profile or self.target_bits is not None


def fit_codebook(points: torch.Tensor, weights: torch.Tensor | None, bits: int, kind: str, qnorm: bool, seed: int) -> torch.Tensor:
    """A sorted codebook of 2^bits signposts for normalized inlier values `points` in [-1, 1]; the uniform one where
    there are none (an MLA key of no channel, which it never decodes)."""
    if kind == "uniform" or points.numel() == 0:
        codebook = uniform_codebook(bits)
    elif kind == "nf":
        codebook = normal_float_codebook(bits)
    else:
        x = points.double().numpy()[:, None]
        w = None if weights is None else (weights / weights.mean().clamp(min=1e-30)).double().numpy()
        from sklearn.cluster import KMeans  # (here: the runtime imports this module, and a second of sklearn, for no fit)

        model = KMeans(n_clusters=2**bits, n_init=1, random_state=seed, max_iter=300).fit(x, sample_weight=w)
        codebook = torch.from_numpy(np.sort(model.cluster_centers_[:, 0])).float()
    if qnorm and points.numel():
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


def choose_widths(costs: np.ndarray, prices: np.ndarray, target_bits: float, shares: np.ndarray | None = None) -> list[int]:
    """Exact multiple-choice knapsack: for every tensor i the choice j minimizing sum(costs[i, j]) with the mean of
    prices[i, j] weighted by shares[i] (the elements tensor i stores, relative; default all alike) at most
    target_bits (weighted prices rounded up to KNAPSACK_STEP). costs, prices: (tensors, choices)."""
    shares = np.ones(len(prices)) if shares is None else np.asarray(shares, dtype=np.float64)
    units = np.ceil(prices * shares[:, None] / KNAPSACK_STEP - 1e-6).astype(np.int64)
    budget = int(np.floor(target_bits * shares.sum() / KNAPSACK_STEP + 1e-6))
    cheapest = units.min(axis=1)
    if cheapest.sum() > budget:
        raise KvcalError(f"--target-bits {target_bits} is below {cheapest.sum() * KNAPSACK_STEP / shares.sum():.3f}, the real "
                         "bits of the narrowest widths; raise it")
    # price above each tensor's cheapest choice, and no more budget than buying every widest choice needs: the table
    # below stays (tensors x a few thousand) whatever the target
    units -= cheapest[:, None]
    budget = int(min(budget - cheapest.sum(), units.max(axis=1).sum()))
    best = np.zeros(budget + 1)  # best[c]: least cost of the tensors so far within a price of c units
    picks = np.zeros((len(units), budget + 1), dtype=np.int8)
    for i in range(len(units)):
        options = np.full((units.shape[1], budget + 1), np.inf)
        for j, unit in enumerate(units[i]):
            if unit <= budget:
                options[j, unit:] = best[: budget + 1 - unit] + costs[i, j]
        picks[i] = options.argmin(axis=0)
        best = options.min(axis=0)
    chosen, left = [], budget
    for i in reversed(range(len(units))):
        j = int(picks[i, left])
        chosen.append(j)
        left -= int(units[i, j])
    return chosen[::-1]


def stored_shares(spans: list[AttentionSpan | None], context: int) -> list[float]:
    """Per layer, the share of a `context`-token sequence its cache stores: min(context, size - 1) / context for a
    layer with a sliding window or attention chunk (what transformers' cache keeps, and kvcal's at most), 1 otherwise
    and for context 0."""
    return [1.0 if not context or span is None else min(context, span.size - 1) / context for span in spans]


def _sensitivity(samples: torch.Tensor, fisher: torch.Tensor, codec: CodebookCodec, head_dim: int) -> tuple[float, float]:
    """(Fisher-weighted squared error of the samples, stored bits per element) under `codec`; the bits include the
    outlier offset table (one entry per KV head and tile) when the codec keeps outliers."""
    if samples.shape[1] == 0:  # (an MLA key of no channel: stores nothing)
        return 0.0, 0.0
    quantized = codec.quantize(samples)
    error = float((fisher * (samples - quantized.values) ** 2).sum())
    table = 8 * OUTLIER_OFFSET_BYTES / (OUTLIER_TILE_TOKENS * head_dim) if codec.outlier_fraction > 0 else 0.0
    return error, float(quantized.row_bits.mean()) / samples.shape[1] + table


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
    fingerprint = profile_config["model"]["fingerprint"]
    shapes = {kind: kv_shapes(fingerprint, kind) for kind in "kv"}
    rows = profile["samples.position"] >= settings.sink
    if not rows.any():
        raise KvcalError(f"the profile has no sampled tokens past --sink {settings.sink}")
    key_name = "k_pre" if settings.key_rope == "pre" else "k_post"
    # Fisher is taken w.r.t. the pre-RoPE key; for post-RoPE keys it is an approximation (ablation only).
    use_fisher = settings.weighting == "fisher" and settings.codebook == "nuq"
    if settings.target_bits is not None:
        candidates = KNAPSACK_WIDTHS
    elif settings.bits_from_profile:
        candidates = None
    else:
        candidates = (settings.bits,)
    fitted = {}  # (layer, kind) -> ({width: codebook}, thresholds, {width: (cost, price)})
    for layer in range(num_layers):
        prefix = f"layers.{layer}"
        for kind, sample_name, fisher_name, per_channel in (
            ("k", key_name, "k_pre", settings.key_granularity == "channel"),
            ("v", "v", "v", False),
        ):
            samples = profile[f"{prefix}.{sample_name}.samples"][rows]
            fisher = profile[f"{prefix}.{fisher_name}.fisher"][rows]
            points, weights, thresholds = _inliers(samples, fisher if use_fisher else None, per_channel, settings.outliers,
                                                   settings.seed)
            widths = candidates or (int(profile[f"kvmix.bits.{kind}"][layer]),)
            codebooks, sensitivity = {}, {}
            for bits in widths:
                codebooks[bits] = fit_codebook(points, weights, bits, settings.codebook, settings.uses_qnorm(bits), settings.seed)
                if len(widths) > 1:
                    lo, hi = thresholds or (None, None)
                    codec = CodebookCodec(codebooks[bits], lo, hi, settings.outliers)
                    sensitivity[bits] = _sensitivity(samples, fisher, codec, shapes[kind][layer][1])
            fitted[layer, kind] = (codebooks, thresholds, sensitivity)
        if on_layer is not None:
            on_layer(layer)
    if settings.target_bits is not None:
        keys = list(fitted)
        costs = np.array([[fitted[key][2][b][0] for b in KNAPSACK_WIDTHS] for key in keys])
        prices = np.array([[fitted[key][2][b][1] for b in KNAPSACK_WIDTHS] for key in keys])
        shares = stored_shares(recorded_spans(profile_config["model"], num_layers), settings.target_context)
        # the elements each tensor stores, relative: its layer's share of the context times its width over the widest
        # (MLA's latent is wider than its key, Gemma 4's full layers than its sliding ones; all 1 where none differ)
        widths = {key: heads * head_dim for key in keys for heads, head_dim in [shapes[key[1]][key[0]]]}
        elements = [shares[layer] * widths[layer, kind] / max(widths.values()) for layer, kind in keys]
        picks = choose_widths(costs, prices, settings.target_bits, np.array(elements))
        chosen = {key: KNAPSACK_WIDTHS[j] for key, j in zip(keys, picks)}
    else:
        chosen = {key: next(iter(codebooks)) for key, (codebooks, _, _) in fitted.items()}
    bits_k = [chosen[layer, "k"] for layer in range(num_layers)]
    bits_v = [chosen[layer, "v"] for layer in range(num_layers)]
    tensors = {"rope.inv_freq": profile["rope.inv_freq"]}
    for (layer, kind), (codebooks, thresholds, _) in fitted.items():
        tensors[f"layers.{layer}.{kind}.codebook"] = codebooks[chosen[layer, kind]]
        if thresholds is not None:
            tensors[f"layers.{layer}.{kind}.lo"], tensors[f"layers.{layer}.{kind}.hi"] = thresholds
    config = {
        "model": profile_config["model"],
        "rope": profile_config["rope"],
        "calibration": calibration,
        "nuq": {**asdict(settings), "bits_k": bits_k, "bits_v": bits_v,
                "qnorm_k": [settings.uses_qnorm(b) for b in bits_k], "qnorm_v": [settings.uses_qnorm(b) for b in bits_v]},
    }
    if settings.target_bits is not None:  # what the knapsack saw (error, real bits) per tensor and width, for `kvcal inspect`
        config["nuq"]["knapsack"] = {f"{layer}.{kind}": {str(b): [float(f"{cost:.4g}"), round(price, 4)]
                                                         for b, (cost, price) in fitted[layer, kind][2].items()}
                                     for layer, kind in fitted}
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
    if nuq.get("window"):  # artifacts fit before the window setting have none
        tags.append(f"window {nuq['window']}")
    return name + (" [" + ", ".join(tags) + "]" if tags else "")
