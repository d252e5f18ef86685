"""vLLM's per-token-head KV cache dtypes (`--kv-cache-dtype`) as kvcal codecs, with the arithmetic of vLLM's own
kernels, for `eval ppl` (vLLM caches keys after RoPE; the model's dtype, what the kernels read and the rotation is
cast back to, is fp16 here, as kvcal's cache holds fp16). Tensors are (tokens, kv_heads * head_dim), quantized per
(token, KV head); every codec gives `quantize` -> kvcal.quantizers.Quantized and `row_bits(channels)`.

- PerTokenHead("int8" | "fp8"): scale s = max(absmax / qmax, 1e-6) in fp32 per (token, KV head), q = x * (1 / s),
  int8: rounded half away from zero (+-0.5, then the int8 store truncates), clamped to [-128, 127]; fp8: clamped to
  +-448 and cast to e4m3 (round to nearest even); x^ = q * s. Codes and an fp32 scale per (token, KV head).
  Source: vllm/v1/attention/ops/triton_reshape_and_cache_flash.py @ 055e47c28003156421365af985d676fc921cb075
  (_reshape_cache_per_token_head; the +-0.5 since vLLM PR #45361: before it int8 truncated toward zero).
- DsMlaLatent (`fp8_ds_mla`, the latent of vLLM's cache of DeepSeek-V3.2's sparse MLA, FlashMLA's format, for a
  latent of 512 and a rotated key of 64; kvcal takes any whole tiles): per token, tiles of 128 latent channels, each
  s = max(max|x| / 448, FLT_MIN) in fp32 (the max passing a NaN over, as fmaxf does) and its codes e4m3(x / s),
  saturating (round to nearest even); x^ = code * s. 8 bits a channel and an fp32 scale a tile; the rotated key
  beside it is kept in the model's 16 bits, and the indexer's keys as FP8 with a power-of-two scale per 128 channels
  (kvcal.indexer_keys "fp8"). Source: vLLM's csrc/cache_kernels.cu, concat_and_cache_ds_mla_kernel (tile_scale,
  fp8::scaled_convert) and indexer_k_quant_and_cache_kernel (use_ue8m0), as read in its public source (the commit
  is not pinned here).
- Int4PerTokenHead: x rotated by vLLM's randomized Hadamard transform (fixed signs from a CPU generator seeded
  0x9E3779B9, the unnormalized Walsh-Hadamard butterfly in fp32) and cast to the model dtype; then per (token, KV
  head) s = max((max - min) / 15, 1e-6), zp = clamp(round(-min / s), 0, 15), q = clamp(round(x / s + zp), 0, 15)
  (round half away from zero); the stored fp32 scale carries zp in its low 4 mantissa bits, so the read uses s with
  them cleared: x^_rot = (q - zp) * s', x^ = signs * H(x^_rot) / head_dim. Two codes a byte and the fp32 word.
  Source: vllm/v1/attention/ops/int4_per_token_head.py @ 055e47c28003156421365af985d676fc921cb075.
- Nvfp4 (`nvfp4`, `nvfp4_4over6`): per (token, KV head), blocks of 16 channels in the model dtype, vecMax = max|x|; a
  candidate scale for denominator d is SF = fp32(vecMax * fp32(1 / d)) * gs, stored as e4m3 (round to nearest even,
  saturating at 448), and the element scale os = 1 / (SF_e4m3 * (1 / gs)) (0 for SF_e4m3 = 0); each x * os is coded as
  e2m1 (round to nearest even on 0, 0.5, 1, 1.5, 2, 3, 4, 6, saturating at 6). gs = 1 / k_scale (v_scale for values),
  the layer's scale: vLLM's default 1.0; a per-layer one loads only with a ModelOpt checkpoint (KV_CACHE_QUANT_ALGOS
  "FP8", "NVFP4" in model_executor/layers/quantization/modelopt.py), whose weights are quantized too (`Nvfp4.k_scale`;
  kvcal exports none: benchmarks/results/nvfp4_scales.md). nvfp4 takes d = 6; nvfp4_4over6 takes d = 4 where its
  block's squared error is smaller than d = 6's (ties keep 6): error = sum over the 8 pairs, in order, of fma(dx0,
  dx0, dx1 * dx1) with dx = fma(q, 1 / os, -x), as the compiled kernel contracts it. Read: e2m1 * SF_e4m3 * k_scale.
  Bits: 4 a code and an e4m3 byte a block: 4.5. Source: the vLLM 0.33.0 release (commit 4ba787ec9)
  csrc/nvfp4_kv_cache_kernels.cu (round_to_nearest_e2m1, nvfp4_candidate_scale, nvfp4_reconstruction_error,
  cvt_warp_fp16_to_fp4_4over6; global scale 1 / *k_scale_ptr) and csrc/quantization/fp4/nvfp4_utils.cuh
  (cvt_warp_fp16_to_fp4), the SM100 writer; on other GPUs FlashInfer's
  nvfp4_quantize_append_paged_kv_cache_with_slot_mapping (flashinfer 0.7.2.post1, include/flashinfer/page.cuh)
  computes the same bytes at k_scale 1.0 and has no 4over6. Taken as exact: the hardware reciprocals (rcp.approx.ftz)
  as correctly rounded; the FMAs of the 4over6 error emulated in float64 (a double rounding could flip a choice
  between two candidates whose errors agree to the last bit).
- TurboQuant presets (`turboquant_k8v4`, `turboquant_4bit_nc`, `turboquant_k3v4_nc`, `turboquant_3bit_nc`: TQ_PRESETS,
  key bits, value bits, norm correction): keys either fp8 e4m3 (k8v4: cast saturating at +-448, no scale; the
  Hopper-and-later format, e4nv) or, per (token, KV head), n = ||k|| in fp32, y = (k / (n + 1e-8)) H with H the
  orthonormal Sylvester Hadamard matrix (the same for every layer, no signs), each coordinate coded as the count of
  Lloyd-Max midpoints <= y (centroids of N(0, 1/head_dim) by vLLM's own solver: `lloyd_max_centroids`), n stored fp16;
  decoded c = centroids[code], with norm correction c / sqrt(sum c^2 + 1e-16), k^ = fp16(n) c H (vLLM scores
  q H . fp16(n) c: the same). Values per (token, KV head): s = max((max - min) / (2^b - 1), 1e-8), codes
  clamp(trunc((v - min) / s + 0.5)) with the fp32 s and min, v^ = code * fp16(s) + fp16(min). Bits: keys
  8 x head_dim, or ceil(head_dim x b / 8) bytes + an fp16 norm; values ceil(head_dim x b / 8) bytes + fp16 scale and
  zero, per KV head. vLLM keeps the first and last TQ_BOUNDARY_LAYERS layers unquantized (`tq_boundary_layers`; none in a hybrid
  model, get_boundary_skip_layers @ 1471680b24719d9d3b2fe1235878196142af89cc).
  Sources @ 0135d081c30fa476130ae77a152539ce317ab8b1 (model_executor/layers/quantization/turboquant/config.py and
  centroids.py; v1/attention/backends/turboquant_attn.py: _build_hadamard, the midpoints; v1/attention/ops/
  triton_turboquant_store.py) and @ 055e47c28003156421365af985d676fc921cb075 (v1/attention/ops/
  triton_turboquant_decode.py: _tq_full_dequant_kv); the boundary layers from engine/arg_utils.py's merge of
  TurboQuantConfig.get_boundary_skip_layers. Not modelled: Triton's fp32 division may round differently from
  IEEE division at a code boundary; Ampere's e4b15 fp8 keys.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvcal.errors import KvcalError
from kvcal.quantizers import E2M1_MAGNITUDES, CodecKind, Quantized

SCALE_FLOOR = 1e-6  # vLLM's floor of every per-token-head scale
FP32_BITS = 32
FP8_MAX = 448.0  # float8_e4m3fn (CUDA)
DS_MLA_TILE = 128  # fp8_ds_mla's latent channels a scale serves
RHT_SEED = 0x9E3779B9  # vLLM's _get_rht_signs(d, round_idx=0)


def _per_head(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    tokens, channels = x.shape
    if channels % head_dim:
        raise KvcalError(f"{channels} channels are not whole KV heads of {head_dim}")
    return x.float().view(tokens, channels // head_dim, head_dim)


def _require_power_of_two(head_dim: int, dtype: str) -> None:
    if head_dim & (head_dim - 1):
        raise KvcalError(f"vLLM's {dtype} rotates heads with a Hadamard transform: head_dim {head_dim} is not a power of two")


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """Triton's where(x >= 0, x + 0.5, x - 0.5) then a float -> int cast (truncation toward zero), in fp32."""
    return torch.where(x >= 0, x + 0.5, x - 0.5).trunc()


@dataclass(frozen=True)
class PerTokenHead:
    kind: ClassVar[CodecKind] = CodecKind.SIMULATED
    dtype: str  # "int8" or "fp8"
    head_dim: int
    block_tokens = 1
    bits = 8

    def row_bits(self, channels: int) -> float:
        return float(8 * channels + FP32_BITS * (channels // self.head_dim))

    def quantize(self, x: torch.Tensor) -> Quantized:
        heads = _per_head(x, self.head_dim)
        qmax = 127.0 if self.dtype == "int8" else FP8_MAX
        scale = torch.clamp(heads.abs().amax(-1, keepdim=True) / qmax, min=SCALE_FLOOR)
        q = heads * (1.0 / scale)
        if self.dtype == "int8":
            q = round_half_away(q).clamp(-128.0, 127.0)
        else:
            q = q.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
        values = (q * scale).view(x.shape)
        return Quantized(values, torch.full((x.shape[0],), self.row_bits(x.shape[1]), device=x.device))


@dataclass(frozen=True)
class DsMlaLatent:
    kind: ClassVar[CodecKind] = CodecKind.SIMULATED
    block_tokens = 1
    bits = 8

    def row_bits(self, channels: int) -> float:
        return float(8 * channels + FP32_BITS * (channels // DS_MLA_TILE))

    def quantize(self, x: torch.Tensor) -> Quantized:
        tiles = _per_head(x, DS_MLA_TILE)
        largest = torch.where(tiles.isnan(), 0.0, tiles.abs()).amax(-1, keepdim=True)  # (fmaxf passes NaN over)
        scale = torch.clamp(largest / FP8_MAX, min=torch.finfo(torch.float32).tiny)
        codes = (tiles / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
        return Quantized((codes * scale).view(x.shape), torch.full((x.shape[0],), self.row_bits(x.shape[1]), device=x.device))


def hadamard_butterfly(x: torch.Tensor) -> torch.Tensor:
    """vLLM's unnormalized Walsh-Hadamard transform over the last dimension (a power of two), its CPU tier: stages of
    (a + b, a - b) in the input's dtype."""
    d = x.shape[-1]
    h = 1
    while h < d:
        pairs = x.reshape(*x.shape[:-1], d // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack([a + b, a - b], dim=-2).reshape(*x.shape[:-1], d)
        h <<= 1
    return x


@functools.lru_cache(maxsize=None)
def rht_signs(head_dim: int) -> torch.Tensor:
    """vLLM's randomized Hadamard signs: +-1 from bernoulli(0.5) of a CPU generator seeded RHT_SEED."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(RHT_SEED)
    return 2.0 * torch.bernoulli(torch.full((head_dim,), 0.5), generator=generator) - 1.0


def without_low_mantissa(scale: torch.Tensor) -> torch.Tensor:
    """An fp32 scale with its low 4 mantissa bits cleared (where vLLM's int4 cache keeps the zero point)."""
    return (scale.view(torch.int32) & -16).view(torch.float32)


@dataclass(frozen=True)
class Int4PerTokenHead:
    head_dim: int
    kind: ClassVar[CodecKind] = CodecKind.SIMULATED
    block_tokens = 1
    bits = 4

    def __post_init__(self):
        _require_power_of_two(self.head_dim, "int4_per_token_head")

    def row_bits(self, channels: int) -> float:
        return float(4 * channels + FP32_BITS * (channels // self.head_dim))

    def quantize(self, x: torch.Tensor) -> Quantized:
        signs = rht_signs(self.head_dim).to(x.device)
        rotated = hadamard_butterfly(_per_head(x, self.head_dim) * signs).to(torch.float16).float()
        low, high = rotated.amin(-1, keepdim=True), rotated.amax(-1, keepdim=True)
        scale = torch.clamp((high - low) / 15.0, min=SCALE_FLOOR)
        zero = round_half_away(-low / scale).clamp(0.0, 15.0)
        q = round_half_away(rotated * (1.0 / scale) + zero).clamp(0.0, 15.0)
        restored = (q - zero) * without_low_mantissa(scale)
        values = (hadamard_butterfly(restored) * signs / self.head_dim).view(x.shape)
        return Quantized(values, torch.full((x.shape[0],), self.row_bits(x.shape[1]), device=x.device))


# ---------------------------------------------------------------------------------------------------------
# NVFP4

NVFP4_BLOCK = 16  # channels per e4m3 block scale
NVFP4_SCALE_BITS = 8
MODEL_DTYPE = torch.float16


def e2m1_nearest_even(x: torch.Tensor) -> torch.Tensor:
    """cvt.rn.satfinite.e2m1x2.f32 as vLLM's round_to_nearest_e2m1 writes it: ties go to the even code (0.25 -> 0,
    0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), magnitudes above 5 to 6."""
    ax = x.abs()
    index = ((ax > 0.25).int() + (ax >= 0.75).int() + (ax > 1.25).int() + (ax >= 1.75).int() + (ax > 2.5).int()
             + (ax >= 3.5).int() + (ax > 5.0).int())
    return torch.copysign(x.new_tensor(E2M1_MAGNITUDES)[index], x)


def _nvfp4_candidate(vec_max: torch.Tensor, denominator: float, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(SF as stored in e4m3, the element scale os) of one candidate denominator; all fp32."""
    reciprocal = torch.tensor(1.0 / denominator, dtype=torch.float32)
    scale = (global_scale * (vec_max * reciprocal)).clamp(max=FP8_MAX).to(torch.float8_e4m3fn).float()
    inverse_global = 1.0 / global_scale
    return scale, torch.where(scale != 0, 1.0 / (scale * inverse_global), torch.zeros_like(scale))


def _nvfp4_error(blocks: torch.Tensor, element_scale: torch.Tensor) -> torch.Tensor:
    """A block's squared reconstruction error as the 4over6 kernel sums it (per pair fma(dx0, dx0, dx1 * dx1) with
    dx = fma(q, 1 / os, -x), pairs added in order in fp32)."""
    dequant = torch.where(element_scale != 0, 1.0 / element_scale, torch.zeros_like(element_scale))
    q = e2m1_nearest_even(blocks * element_scale)
    dx = (q.double() * dequant.double() - blocks.double()).float().unflatten(-1, (-1, 2))
    pairs = (dx[..., 0].double() ** 2 + (dx[..., 1] * dx[..., 1]).double()).float()
    error = torch.zeros_like(pairs[..., 0])
    for i in range(pairs.shape[-1]):
        error = error + pairs[..., i]
    return error.unsqueeze(-1)


@dataclass(frozen=True)
class Nvfp4:
    head_dim: int
    four_over_six: bool = False
    k_scale: float = 1.0  # the layer's checkpoint k_scale (or v_scale): global scale 1 / k_scale; vLLM's default 1.0
    kind: ClassVar[CodecKind] = CodecKind.SIMULATED
    block_tokens = 1
    bits = 4

    def __post_init__(self):
        if self.head_dim % NVFP4_BLOCK:
            raise KvcalError(f"vLLM's nvfp4 scales blocks of {NVFP4_BLOCK} channels: head_dim {self.head_dim} is not a multiple of it")

    def row_bits(self, channels: int) -> float:
        return float(4 * channels + NVFP4_SCALE_BITS * (channels // NVFP4_BLOCK))

    def quantize(self, x: torch.Tensor) -> Quantized:
        tokens, channels = x.shape
        blocks = x.to(MODEL_DTYPE).float().view(tokens, channels // NVFP4_BLOCK, NVFP4_BLOCK)
        vec_max = blocks.abs().amax(-1, keepdim=True)
        k_scale = torch.tensor(self.k_scale, dtype=torch.float32)
        global_scale = 1.0 / k_scale
        scale, element_scale = _nvfp4_candidate(vec_max, 6.0, global_scale)
        if self.four_over_six:
            scale4, element_scale4 = _nvfp4_candidate(vec_max, 4.0, global_scale)
            use4 = _nvfp4_error(blocks, element_scale4) < _nvfp4_error(blocks, element_scale)
            scale, element_scale = torch.where(use4, scale4, scale), torch.where(use4, element_scale4, element_scale)
        values = e2m1_nearest_even(blocks * element_scale) * scale * k_scale
        return Quantized(values.view(tokens, channels), torch.full((tokens,), self.row_bits(channels), device=x.device))


# ---------------------------------------------------------------------------------------------------------
# TurboQuant

TQ_PRESETS = {  # preset -> (key bits, 8 = fp8 keys; value bits; norm correction)
    "turboquant_k8v4": (8, 4, False),
    "turboquant_4bit_nc": (4, 4, True),
    "turboquant_k3v4_nc": (3, 4, True),
    "turboquant_3bit_nc": (3, 3, True),
}
TQ_BOUNDARY_LAYERS = 2  # first and last layers vLLM leaves unquantized under a TurboQuant preset
TQ_NORM_EPS = 1e-8  # k / (||k|| + eps)
TQ_VALUE_SCALE_FLOOR = 1e-8
FP16_BITS = 16


def tq_boundary_layers(num_layers: int) -> set[int]:
    """The layers vLLM keeps unquantized under a TurboQuant preset: the first and last TQ_BOUNDARY_LAYERS, at most half
    of the layers from each end."""
    n = min(TQ_BOUNDARY_LAYERS, num_layers // 2)
    return set(range(n)) | set(range(num_layers - n, num_layers))


@functools.lru_cache(maxsize=None)
def lloyd_max_centroids(head_dim: int, bits: int) -> torch.Tensor:
    """vLLM's TurboQuant codebook: Lloyd-Max centroids of N(0, 1/head_dim), 2^bits of them, by its own procedure:
    start evenly inside +-3.5 sigma, integrate each cell (the outer ones to +-10.5 sigma) with the trapezoidal rule
    on 200 intervals, at most 200 rounds, stop (keeping the previous centroids) once none moves 1e-10; float32."""
    levels, variance = 2**bits, 1.0 / head_dim
    sigma = math.sqrt(variance)

    def density(x: float) -> float:
        return math.exp(-x * x / (2 * variance)) / math.sqrt(2 * math.pi * variance)

    def integral(f, a: float, b: float, steps: int = 200) -> float:
        h = (b - a) / steps
        return (0.5 * (f(a) + f(b)) + sum(f(a + i * h) for i in range(1, steps))) * h

    lo, hi = -3.5 * sigma, 3.5 * sigma
    centroids = [lo + (hi - lo) * (i + 0.5) / levels for i in range(levels)]
    for _ in range(200):
        edges = [3 * lo] + [(a + b) / 2 for a, b in zip(centroids, centroids[1:])] + [3 * hi]
        moved = []
        for i in range(levels):
            mass = integral(density, edges[i], edges[i + 1])
            moved.append(integral(lambda x: x * density(x), edges[i], edges[i + 1]) / mass if mass > 1e-15 else centroids[i])
        if max(abs(a - b) for a, b in zip(moved, centroids)) < 1e-10:
            break
        centroids = moved
    return torch.tensor(centroids, dtype=torch.float32)


@functools.lru_cache(maxsize=None)
def sylvester_hadamard(head_dim: int) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix (symmetric: its own inverse) TurboQuant rotates keys with."""
    h = torch.ones(1, 1)
    while h.shape[0] < head_dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(head_dim)


@dataclass(frozen=True)
class TurboQuantKeys:
    """One preset's keys: fp8 (bits 8) or Lloyd-Max codes of the rotated unit vector and an fp16 norm."""

    kind: ClassVar[CodecKind] = CodecKind.SIMULATED
    bits: int
    head_dim: int
    norm_correction: bool
    block_tokens = 1

    def __post_init__(self):
        _require_power_of_two(self.head_dim, "TurboQuant")

    def row_bits(self, channels: int) -> float:
        heads = channels // self.head_dim
        if self.bits == 8:
            return float(8 * channels)
        return float(heads * (8 * math.ceil(self.head_dim * self.bits / 8) + FP16_BITS))

    def quantize(self, x: torch.Tensor) -> Quantized:
        heads = _per_head(x, self.head_dim)
        if self.bits == 8:
            values = heads.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
        else:
            centroids = lloyd_max_centroids(self.head_dim, self.bits).to(x.device)
            midpoints = (centroids[:-1] + centroids[1:]) / 2
            rotation = sylvester_hadamard(self.head_dim).to(x.device)
            norm = heads.norm(dim=-1, keepdim=True)
            codes = torch.searchsorted(midpoints, (heads / (norm + TQ_NORM_EPS)) @ rotation, right=True)
            unit = centroids[codes]
            if self.norm_correction:
                unit = unit * (1.0 / torch.sqrt((unit * unit).sum(-1, keepdim=True) + 1e-16))
            values = (norm.to(torch.float16).float() * unit) @ rotation
        return Quantized(values.reshape(x.shape), torch.full((x.shape[0],), self.row_bits(x.shape[1]), device=x.device))


@dataclass(frozen=True)
class TurboQuantValues:
    """One preset's values: uniform codes per (token, KV head), fp16 scale and minimum."""

    kind: ClassVar[CodecKind] = CodecKind.SIMULATED
    bits: int
    head_dim: int
    block_tokens = 1

    def row_bits(self, channels: int) -> float:
        return float(channels // self.head_dim * (8 * math.ceil(self.head_dim * self.bits / 8) + 2 * FP16_BITS))

    def quantize(self, x: torch.Tensor) -> Quantized:
        heads = _per_head(x, self.head_dim)
        low, high = heads.amin(-1, keepdim=True), heads.amax(-1, keepdim=True)
        top = 2**self.bits - 1
        scale = (high - low) / top
        scale = torch.where(scale > TQ_VALUE_SCALE_FLOOR, scale, TQ_VALUE_SCALE_FLOOR)
        codes = ((heads - low) / scale + 0.5).trunc().clamp(0, top)
        values = codes * scale.to(torch.float16).float() + low.to(torch.float16).float()
        return Quantized(values.reshape(x.shape), torch.full((x.shape[0],), self.row_bits(x.shape[1]), device=x.device))
