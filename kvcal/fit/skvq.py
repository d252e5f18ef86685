"""SKVQ (`kvcal fit-skvq`): channel reorder, clipped dynamic per-token group quantization, sliding
window and attention sinks.

Per layer, separately for keys (pre-RoPE) and values: the channels of the whole KV width are clustered
by their calibration [min, max] with seeded KMeans into kv_width / group_size groups; the permutation
(argsort of the labels) and the group boundaries are stored as int32 (groups are unequal). Each token is
quantized per group with a clipping scale alpha: h = alpha (max - min) / (2^N - 1), at least alpha |min| / (M / 2)
for M the storage dtype's largest value (so that z fits it), z = alpha min / h, x^ = h (clamp(round(x / h - z), 0,
2^N - 1) + z). Alpha is chosen from a grid, per layer or per group, to minimize the MSE of the attention output on
the profile's stored windows, with the window and sinks as they will be at decode time. Optionally h and z are
stored as FP8 (e4m3), simulated during the search. 1.5-bit values are ternary (three levels, packed 20 to an int32
word: 1.6 bits stored). Permutations cross head boundaries, so they are applied inside quantize/dequantize, not
folded into W_q/W_o.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import ClassVar

import numpy as np
import torch

from kvcal.adapters import (attention_sinks, attention_softcap, kv_shapes, kv_widths, latent_attention, query_heads,
                            score_scale)
from kvcal.artifacts import read_artifact, write_artifact
from kvcal.data import check_seed
from kvcal.errors import KvcalError
from kvcal.packing import packed_row_bits
from kvcal.quantizers import FP16_BITS, TINY_SCALE, CodecKind, Encoded, LayerCodecs, Quantized, divided, scale_in_use, store_as
from kvcal.rope import layer_inv_freq, layer_rope_scaling, rotate_keys
from kvcal.kv import SegmentPolicy, per_query_head, softcapped, softmax_with_sinks

SKVQ_KIND = "skvq"
CLIP_GRID = tuple(round(1.0 - 0.05 * i, 2) for i in range(15))  # 1.00, 0.95, ..., 0.30
GROUP_REFINE = 0.15  # per-group search covers the layer-wise alpha +- this
TERNARY = 1.5


def levels(bits: float) -> int:
    return 2 if bits == TERNARY else 2 ** int(bits) - 1


@dataclass(frozen=True)
class SkvqSettings:
    kbits: float = 2
    vbits: float = 2
    group_size: int = 64
    window: int = 128
    sink: int = 5
    fp8: bool = False
    clip: str = "group"  # group, layer or none
    reorder: bool = True
    seed: int = 0

    def validate(self) -> None:
        if self.kbits not in (1, 2, 3, 4):
            raise KvcalError(f"--kbits {self.kbits} is not one of 1, 2, 3, 4")
        if self.vbits not in (TERNARY, 1, 2, 3, 4):
            raise KvcalError(f"--vbits {self.vbits} is not one of 1.5 (ternary), 1, 2, 3, 4")
        if self.group_size < 1:
            raise KvcalError(f"--group-size must be at least 1 (got {self.group_size})")
        if self.window < 0:
            raise KvcalError(f"--window must be 0 or more (got {self.window}); 0 quantizes every token")
        if self.sink < 0:
            raise KvcalError(f"--sink must be 0 or more (got {self.sink})")
        check_seed(self.seed)
        if self.clip not in ("group", "layer", "none"):
            raise KvcalError(f"--clip '{self.clip}' is not one of group, layer, none")

    @property
    def policy(self) -> SegmentPolicy:
        return SegmentPolicy(sink=self.sink, window=self.window)


def channel_groups(minimum: torch.Tensor, maximum: torch.Tensor, groups: int, reorder: bool, seed: int):
    """(permutation, group starts) of the channels; starts has groups + 1 entries, the last = width (no group of a
    tensor of no channel: an MLA key's on a layer without RoPE)."""
    width = minimum.numel()
    if width == 0:
        return torch.zeros(0, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    equal_parts = np.array(list(range(0, width, -(-width // groups))) + [width])
    features = torch.stack([minimum, maximum], dim=1).double().numpy()
    if not reorder:
        permutation, starts = np.arange(width), equal_parts
    elif len(np.unique(features, axis=0)) < groups:  # fewer distinct channels than groups (keys a model clamps, DBRX's):
        # KMeans would leave groups empty; equal parts of the channels ordered by max, then min
        permutation, starts = np.lexsort((features[:, 0], features[:, 1])), equal_parts
    else:
        from sklearn.cluster import KMeans  # (here: the runtime imports this module, and a second of sklearn, for no fit)

        labels = KMeans(n_clusters=groups, n_init=4, random_state=seed).fit(features).labels_
        # Number clusters by their mean max so the layout does not depend on KMeans' label order.
        order = np.argsort([features[labels == g, 1].mean() for g in range(groups)], kind="stable")
        rank = np.empty(groups, dtype=np.int64)
        rank[order] = np.arange(groups)
        ranked = rank[labels]
        permutation = np.argsort(ranked, kind="stable")
        starts = np.concatenate([[0], np.cumsum(np.bincount(ranked, minlength=groups))])
    return torch.from_numpy(permutation.astype(np.int32)), torch.from_numpy(starts.astype(np.int32))


def clipped_params(block: torch.Tensor, alpha: torch.Tensor, bits: float, fp8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored (scale, zero) of each row (token) of `block`, (tokens, 1) each, in fp8 e4m3 or fp16. The zero is in
    units of the scale, so the scale is at least |low| / (half the dtype's largest value): a group whose range is
    (nearly) zero, such as one channel alone, keeps its value instead of a zero saturated at that largest value."""
    steps = levels(bits)
    low, high = alpha * block.amin(1, keepdim=True), alpha * block.amax(1, keepdim=True)
    dtype = torch.float8_e4m3fn if fp8 else torch.float16
    zero_room = torch.finfo(dtype).max / 2  # rounding the scale to the dtype cannot push low / scale past the largest value
    scale = store_as(torch.maximum(divided(high - low, steps), divided(low.abs(), zero_room)).clamp(min=TINY_SCALE), dtype)
    return scale, store_as(low / scale_in_use(scale), dtype)


def clipped_codes(block: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: float) -> torch.Tensor:
    return torch.round(block / scale_in_use(scale) - zero.float()).clamp(0, levels(bits))


def clipped_dynamic(block: torch.Tensor, alpha: torch.Tensor, bits: float, fp8: bool) -> torch.Tensor:
    """SKVQ clipped dynamic quantization of each row (token) of `block`, dequantized."""
    block = block.float()
    scale, zero = clipped_params(block, alpha, bits, fp8)
    return (clipped_codes(block, scale, zero, bits) + zero.float()) * scale_in_use(scale)


@dataclass(eq=False)
class SkvqTensor:
    """How one of K or V of one layer is stored: a codec whose codes are in permuted channel order, with
    a scale and zero per (token, group)."""

    permutation: torch.Tensor
    starts: torch.Tensor
    clip: torch.Tensor
    bits: float
    fp8: bool
    kind: ClassVar[CodecKind] = CodecKind.PERMUTED_GROUPS
    block_tokens = 1

    def _members(self, device) -> torch.Tensor:
        """Group of every permuted channel."""
        sizes = (self.starts[1:] - self.starts[:-1]).long().to(device)
        return torch.repeat_interleave(torch.arange(len(sizes), device=device), sizes)

    def encode(self, x: torch.Tensor) -> Encoded:
        permuted = x.float()[:, self.permutation.long().to(x.device)]
        members = self._members(x.device)
        dtype = torch.float8_e4m3fn if self.fp8 else torch.float16
        scale = torch.empty(x.shape[0], self.clip.numel(), dtype=dtype, device=x.device)
        zero = torch.empty_like(scale)
        bounds = self.starts.tolist()
        for g, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            s, z = clipped_params(permuted[:, start:end], self.clip[g].to(x.device).float(), self.bits, self.fp8)
            scale[:, g], zero[:, g] = s[:, 0], z[:, 0]
        codes = clipped_codes(permuted, scale[:, members], zero[:, members], self.bits)
        return Encoded(codes.long(), token={"scale": scale, "zero": zero})

    def decode(self, encoded: Encoded) -> torch.Tensor:
        members = self._members(encoded.codes.device)
        scale, zero = encoded.token["scale"][:, members], encoded.token["zero"][:, members]
        permuted = (encoded.codes.float() + zero.float()) * scale_in_use(scale)
        restored = torch.empty_like(permuted)
        restored[:, self.permutation.long().to(permuted.device)] = permuted
        return restored

    def quantize(self, x: torch.Tensor) -> Quantized:
        per_row = packed_row_bits(x.shape[1], self.bits) + self.clip.numel() * 2 * (8 if self.fp8 else FP16_BITS)
        return Quantized(self.decode(self.encode(x)), torch.full((x.shape[0],), float(per_row), device=x.device))


def skvq_layer(keys: SkvqTensor, values: SkvqTensor) -> LayerCodecs:
    return LayerCodecs(keys, values, key_pre_rope=True)


class _ClipObjective:
    """MSE of one layer's attention output over the stored windows, quantized vs original.

    Only query rows that can see a quantized token matter (earlier ones read only fp16 sinks and window);
    up to QUERY_ROWS of them, evenly spaced, are used. The fp scores are computed once; while values are
    searched the attention probabilities (with the chosen keys) are cached, so a value trial is one matmul."""

    QUERY_ROWS = 128

    def __init__(self, profile: dict, layer: int, profile_config: dict, policy: SegmentPolicy):
        prefix = f"layers.{layer}.windows"
        fingerprint, rope_scaling = profile_config["model"]["fingerprint"], layer_rope_scaling(profile_config["rope"], layer)
        self.kv_heads, self.head_dim = kv_shapes(fingerprint)[layer]
        heads = query_heads(fingerprint)[layer]
        self.group = heads // self.kv_heads
        self.inv_freq, self.rope_scaling = layer_inv_freq(profile["rope.inv_freq"], layer, self.head_dim), rope_scaling
        self.positions = profile["windows.positions"].long()
        self.keys = profile[f"{prefix}.k"].float()
        self.values = profile[f"{prefix}.v"].float()
        tokens = self.keys.shape[1]
        key_mask, value_mask = policy.quantized_masks(tokens)
        visible = torch.nonzero(key_mask.any(1) | value_mask.any(1)).flatten()
        self.rows = visible[torch.linspace(0, len(visible) - 1, min(self.QUERY_ROWS, len(visible))).round().long()] if len(visible) else visible
        self.key_mask, self.value_mask = key_mask[self.rows], value_mask[self.rows]
        causal = torch.ones(tokens, tokens, dtype=torch.bool).tril()[self.rows]
        self.blocked = ~causal
        scaling = score_scale(profile_config["model"])
        sinks = attention_sinks(profile_config["model"], layer)
        self.sinks = sinks.view(-1, 1, 1) if sinks is not None else None  # per query head
        self.softcap = attention_softcap(profile_config["model"])
        self.queries, self.fp_scores, self.reference = [], [], []
        for w in range(self.keys.shape[0]):
            q = rotate_keys(profile[f"{prefix}.q"][w].float(), self.positions[w], heads, self.inv_freq, rope_scaling)
            q = q[self.rows].view(len(self.rows), heads, self.head_dim).transpose(0, 1) * scaling
            k = rotate_keys(self.keys[w], self.positions[w], self.kv_heads, self.inv_freq, rope_scaling)
            scores = q @ self._per_head(k).transpose(1, 2)
            self.queries.append(q)
            self.fp_scores.append(scores)
            self.reference.append(self._softmax(scores) @ self._per_head(self.values[w]))
        self.cached_probs = None

    def _per_head(self, x: torch.Tensor) -> torch.Tensor:
        return per_query_head(x, self.kv_heads, self.kv_heads * self.group)

    def _softmax(self, scores: torch.Tensor) -> torch.Tensor:
        return softmax_with_sinks(softcapped(scores, self.softcap).masked_fill(self.blocked, float("-inf")), self.sinks)

    def _probs(self, keys: SkvqTensor, w: int) -> torch.Tensor:
        k_hat = rotate_keys(keys.quantize(self.keys[w]).values, self.positions[w], self.kv_heads, self.inv_freq, self.rope_scaling)
        scores = torch.where(self.key_mask, self.queries[w] @ self._per_head(k_hat).transpose(1, 2), self.fp_scores[w])
        return self._softmax(scores)

    def key_error(self, keys: SkvqTensor) -> float:
        """Keys quantized, values fp."""
        return sum(float((self._probs(keys, w) @ self._per_head(v) - ref).square().mean())
                   for w, (v, ref) in enumerate(zip(self.values, self.reference)))

    def cache_keys(self, keys: SkvqTensor) -> None:
        self.cached_probs = [self._probs(keys, w) for w in range(len(self.values))]

    def value_error(self, values: SkvqTensor) -> float:
        """Values quantized, keys as fixed by cache_keys."""
        total = 0.0
        for probs, v, ref in zip(self.cached_probs, self.values, self.reference):
            v_hat = values.quantize(v).values
            out = (probs * self.value_mask) @ self._per_head(v_hat) + (probs * ~self.value_mask) @ self._per_head(v)
            total += float((out - ref).square().mean())
        return total


def _search_clip(error: Callable[[SkvqTensor], float], tensor: SkvqTensor, mode: str) -> None:
    """Set tensor.clip in place: one alpha for all groups (layer), then group by group (group)."""
    groups = tensor.clip.numel()
    best_alpha, best = 1.0, float("inf")
    for alpha in CLIP_GRID:
        tensor.clip = torch.full((groups,), alpha)
        current = error(tensor)
        if current < best:
            best_alpha, best = alpha, current
    tensor.clip = torch.full((groups,), best_alpha)
    if mode != "group":
        return
    for g in range(groups):  # refine each group near the layer-wise optimum
        chosen = float(tensor.clip[g])
        for alpha in (a for a in CLIP_GRID if abs(a - best_alpha) <= GROUP_REFINE + 1e-9 and a != best_alpha):
            tensor.clip[g] = alpha
            current = error(tensor)
            if current < best:
                chosen, best = alpha, current
        tensor.clip[g] = chosen


def fit_skvq(profile_path: str, settings: SkvqSettings, on_layer: Callable[[int], None] | None = None) -> tuple[dict, dict]:
    settings.validate()
    profile, profile_config = read_artifact(profile_path, "profile")
    fingerprint = profile_config["model"]["fingerprint"]
    widths = {kind: kv_widths(fingerprint, kind) for kind in "kv"}
    narrowest = min(width for width in widths["k"] + widths["v"] if width)  # (an MLA key may have no channel)
    if settings.group_size > narrowest:
        raise KvcalError(f"SKVQ's groups of {settings.group_size} channels (--group-size) are wider than the KV width "
                         f"{narrowest} of this model's layers; give --group-size {narrowest} or less")
    if settings.clip != "none" and latent_attention(fingerprint):
        raise KvcalError("the clip search fits attention outputs over the profile's windows, which an MLA model's profile "
                         "does not keep (their queries would need absorbing into the latent); pass --clip none")
    if settings.clip != "none" and "layers.0.windows.q" not in profile:
        raise KvcalError(f"'{profile_path}' has no stored Q/K/V windows, which the clip search needs; re-run "
                         "kvcal profile-gradients with --store-windows 2, or pass --clip none")
    tensors = {"rope.inv_freq": profile["rope.inv_freq"]}
    for layer in range(fingerprint["num_layers"]):
        prefix = f"layers.{layer}"
        stored = {}
        for kind, name, bits in (("k", "k_pre", settings.kbits), ("v", "v", settings.vbits)):
            groups = -(-widths[kind][layer] // settings.group_size)
            permutation, starts = channel_groups(profile[f"{prefix}.{name}.min"], profile[f"{prefix}.{name}.max"],
                                                 groups, settings.reorder, settings.seed)
            stored[kind] = SkvqTensor(permutation, starts, torch.ones(groups), bits, settings.fp8)
        if settings.clip != "none":
            objective = _ClipObjective(profile, layer, profile_config, settings.policy)
            if len(objective.rows):  # else the window and sinks cover every calibration token: nothing to clip
                _search_clip(objective.key_error, stored["k"], settings.clip)
                objective.cache_keys(stored["k"])
                _search_clip(objective.value_error, stored["v"], settings.clip)
        for kind, tensor in stored.items():
            tensors[f"{prefix}.{kind}.perm"] = tensor.permutation
            tensors[f"{prefix}.{kind}.group_start"] = tensor.starts
            tensors[f"{prefix}.{kind}.clip"] = tensor.clip.float()
        if on_layer is not None:
            on_layer(layer)
    config = {"model": profile_config["model"], "rope": profile_config["rope"], "calibration": profile_config["calibration"],
              "skvq": asdict(settings)}
    return tensors, config


def write_skvq(path, tensors: dict, config: dict):
    return write_artifact(path, tensors, SKVQ_KIND, config)


def skvq_layers(tensors: dict, config: dict, path: str) -> list[LayerCodecs]:
    """The per-layer codecs of an SKVQ artifact's (tensors, config)."""
    settings = SkvqSettings(**config["skvq"])
    layers = []
    for layer in range(config["model"]["fingerprint"]["num_layers"]):
        prefix = f"layers.{layer}"
        try:
            parts = {kind: SkvqTensor(tensors[f"{prefix}.{kind}.perm"], tensors[f"{prefix}.{kind}.group_start"],
                                      tensors[f"{prefix}.{kind}.clip"], bits, settings.fp8)
                     for kind, bits in (("k", settings.kbits), ("v", settings.vbits))}
        except KeyError as exc:
            raise KvcalError(f"'{path}' lacks tensor {exc}; re-create it with kvcal fit-skvq") from exc
        layers.append(skvq_layer(parts["k"], parts["v"]))
    return layers


def skvq_name(settings: SkvqSettings) -> str:
    name = f"skvq-K{settings.kbits:g}V{settings.vbits:g}-g{settings.group_size}-w{settings.window}-s{settings.sink}"
    tags = [t for t, on in (("fp8", settings.fp8), (f"clip {settings.clip}", settings.clip != "group"),
                            ("no reorder", not settings.reorder)) if on]
    return name + (" [" + ", ".join(tags) + "]" if tags else "")
