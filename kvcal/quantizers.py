"""Reference quantizers (torch, any device) as codecs: `encode` turns a (tokens, channels) tensor into
integer codes plus the parameters that would be stored, `decode` turns them back, and `quantize`
returns decode(encode(x)) with what storing it costs, so that simulated evaluation and the runtime
cache (kvcal.runtime) share one definition of every quantizer. Parameters are rounded to their storage
dtype (fp16, or fp8 e4m3 for SKVQ --fp8) before codes are computed, so decoding stored data gives
exactly what the simulation sees.

- TokenUniform: asymmetric min-max per token over groups of G channels (KIVI/KVmix values, int-N).
- ChannelBlockUniform: asymmetric min-max per channel over blocks of G consecutive tokens (KIVI/KVmix keys).
- CodebookCodec: non-uniform (codebook) codes of values normalized to [-1, 1] by per-channel thresholds
  fixed offline or per-token thresholds computed online; dense-and-sparse keeps elements outside the
  thresholds exactly (fp16) as outliers (KVQuant).
- GroupedClipped (in kvcal.fit.skvq): SKVQ's permuted, clipped per-token groups.
Tensors are (tokens, channels): the channels of all KV heads of one token side by side. Every codec declares its
`kind` (CodecKind): what the runtime's stores, tables and kernels dispatch on, never the codec's class.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace
from typing import ClassVar, Protocol

import torch

from kvcal.packing import OUTLIER_BYTES, packed_row_bits

FP16_BITS = 16
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # FP4 E2M1's values (NVFP4, MXFP4 and SGLang's fp4)
TINY_SCALE = 2.0**-24  # the smallest positive fp16: stored scales are clamped to it when decoded


@dataclass
class Quantized:
    """A quantized (tokens, channels) tensor: dequantized values, storage per token row (codes,
    per-row parameters, outliers) and per-tensor storage (thresholds, codebooks)."""

    values: torch.Tensor
    row_bits: torch.Tensor  # (tokens,) what the runtime stores per token row: packed codes, parameters, outliers
    row_outliers: torch.Tensor | None = None  # (tokens,) outliers kept aside per token row, None when none can be


@dataclass
class Encoded:
    """What a codec stores for a run of tokens. codes: (tokens, channels) unpacked integers; token:
    parameters with one row per token; block: parameters with one row per block of `block_tokens`
    tokens; outliers: (token row, channel, fp16 value) of elements kept exactly, or None."""

    codes: torch.Tensor
    token: dict[str, torch.Tensor] = field(default_factory=dict)
    block: dict[str, torch.Tensor] = field(default_factory=dict)
    outliers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


class CodecKind(enum.Enum):
    """What a codec stores, as the runtime reads it (its stores, decode tables and kernels dispatch on this)."""

    FP16 = "fp16"  # kept as fp16
    UNIFORM_TOKEN = "uniform-token"  # TokenUniform
    UNIFORM_CHANNEL = "uniform-channel"  # ChannelBlockUniform
    CODEBOOK_CHANNEL = "codebook-channel"  # CodebookCodec with per-channel thresholds
    CODEBOOK_TOKEN = "codebook-token"  # CodebookCodec with per-token thresholds
    PERMUTED_GROUPS = "permuted-groups"  # SKVQ (kvcal.fit.skvq.SkvqTensor)
    SIMULATED = "simulated"  # another engine's cache type, simulated by `eval ppl` only: no runtime store holds it


class Codec(Protocol):
    """A quantizer (kvcal.quantizers): encode/decode what is stored, quantize = decode(encode) + its cost."""

    kind: CodecKind
    block_tokens: int

    def encode(self, x: torch.Tensor): ...

    def decode(self, encoded) -> torch.Tensor: ...

    def quantize(self, x: torch.Tensor) -> Quantized: ...


@dataclass(frozen=True, eq=True)
class LayerCodecs:
    """How one layer stores keys and values; pre-RoPE keys are rotated after dequantization."""

    key_codec: Codec
    value_codec: Codec
    key_pre_rope: bool

    def for_key_width(self, width: int) -> LayerCodecs:
        """These codecs for a key of `width` channels: one of none (MLA's on a layer without RoPE, Mistral Large 4's)
        stores nothing whatever the recipe, through NO_CHANNEL_CODEC."""
        return self if width else replace(self, key_codec=NO_CHANNEL_CODEC)


@dataclass(frozen=True)
class Fp16Codec:
    """Kept as the cache's fp16: a layer an engine leaves unquantized (vLLM's skipped layers)."""

    kind: ClassVar[CodecKind] = CodecKind.FP16
    block_tokens = 1
    bits = FP16_BITS

    def row_bits(self, channels: int) -> float:
        return float(FP16_BITS * channels)

    def quantize(self, x: torch.Tensor) -> Quantized:
        return Quantized(x.to(torch.float16).float(), torch.full((x.shape[0],), self.row_bits(x.shape[1]), device=x.device))


FP16_LAYER = LayerCodecs(Fp16Codec(), Fp16Codec(), key_pre_rope=False)


def scale_in_use(stored: torch.Tensor) -> torch.Tensor:
    """The scale a decoder uses for a stored (fp16/fp8) scale."""
    return stored.float().clamp(min=TINY_SCALE)


def store_as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast to a storage dtype, saturating at its largest finite value instead of overflowing."""
    limit = torch.finfo(dtype).max
    return x.clamp(-limit, limit).to(dtype)


def divided(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """x / divisor rounded once, on every device. Torch on CUDA multiplies by the reciprocal of a Python-number divisor
    (one bit lost now and then), so CUDA-made parameters would differ from the CPU's and the append kernels'."""
    return x / torch.full_like(x, divisor)


def _min_max_params(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored fp16 (scale, zero) of asymmetric min-max quantization over [lo, hi]."""
    return store_as(divided(hi - lo, 2**bits - 1), torch.float16), store_as(lo, torch.float16)


def _min_max_codes(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes of x under stored (scale, zero) that broadcast against it."""
    return torch.round((x - zero.float()) / scale_in_use(scale)).clamp(0, 2**bits - 1).long()


def _min_max_decode(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale_in_use(scale) + zero.float()


def _channel_groups(channels: int, group: int, device) -> torch.Tensor:
    return torch.arange(channels, device=device) // group


@dataclass(frozen=True)
class TokenUniform:
    """Asymmetric min-max per token over groups of `group` channels (the last group may be shorter).
    Each group stores an fp16 scale and zero (its minimum)."""

    kind: ClassVar[CodecKind] = CodecKind.UNIFORM_TOKEN
    bits: int
    group: int
    block_tokens = 1

    def encode(self, x: torch.Tensor) -> Encoded:
        x = x.float()
        tokens, channels = x.shape
        groups = math.ceil(channels / self.group)
        padded = torch.nn.functional.pad(x, (0, groups * self.group - channels), value=float("nan")).view(tokens, groups, self.group)
        lo = padded.nan_to_num(float("inf")).amin(2)
        hi = padded.nan_to_num(float("-inf")).amax(2)
        scale, zero = _min_max_params(lo, hi, self.bits)
        member = _channel_groups(channels, self.group, x.device)
        return Encoded(_min_max_codes(x, scale[:, member], zero[:, member], self.bits), token={"scale": scale, "zero": zero})

    def decode(self, encoded: Encoded) -> torch.Tensor:
        member = _channel_groups(encoded.codes.shape[1], self.group, encoded.codes.device)
        scale, zero = encoded.token["scale"], encoded.token["zero"]
        return _min_max_decode(encoded.codes, scale[:, member], zero[:, member])

    def row_bits(self, channels: int) -> float:
        return float(packed_row_bits(channels, self.bits) + 2 * FP16_BITS * math.ceil(channels / self.group))

    def quantize(self, x: torch.Tensor) -> Quantized:
        return Quantized(self.decode(self.encode(x)), torch.full((x.shape[0],), self.row_bits(x.shape[1]), device=x.device))


@dataclass(frozen=True)
class ChannelBlockUniform:
    """Asymmetric min-max per channel over blocks of `group` consecutive tokens (KIVI keys). Each block
    stores an fp16 scale and zero per channel. encode takes whole blocks; quantize leaves a trailing
    partial block unchanged (it stays in the fp16 residual)."""

    kind: ClassVar[CodecKind] = CodecKind.UNIFORM_CHANNEL
    bits: int
    group: int

    @property
    def block_tokens(self) -> int:
        return self.group

    def encode(self, x: torch.Tensor) -> Encoded:
        tokens, channels = x.shape
        if tokens % self.group:
            raise ValueError(f"per-channel blocks take multiples of {self.group} tokens, not {tokens}")
        blocks = x.float().view(-1, self.group, channels)
        scale, zero = _min_max_params(blocks.amin(1), blocks.amax(1), self.bits)
        codes = _min_max_codes(blocks, scale[:, None], zero[:, None], self.bits)
        return Encoded(codes.view(tokens, channels), block={"scale": scale, "zero": zero})

    def decode(self, encoded: Encoded) -> torch.Tensor:
        tokens, channels = encoded.codes.shape
        codes = encoded.codes.view(-1, self.group, channels)
        scale, zero = encoded.block["scale"], encoded.block["zero"]
        return _min_max_decode(codes, scale[:, None], zero[:, None]).view(tokens, channels)

    def row_bits(self, channels: int) -> float:
        return packed_row_bits(channels, self.bits) + 2 * FP16_BITS * channels / self.group

    def quantize(self, x: torch.Tensor) -> Quantized:
        full = x.shape[0] - x.shape[0] % self.group
        out = x.float().clone()
        if full:
            out[:full] = self.decode(self.encode(x[:full]))
        return Quantized(out, torch.full((x.shape[0],), self.row_bits(x.shape[1]), device=x.device))


# the codec of a key of no channel (LayerCodecs.for_key_width): it stores no bit, and, of no parameter and one token a
# block, passes through the simulation and the runtime's stores as any codec (the CPU kernel reads it, scoring the
# latent alone; its appends go to the torch codec: nothing to encode)
NO_CHANNEL_CODEC = TokenUniform(bits=4, group=1)


def keep_fraction_quantiles(x: torch.Tensor, outlier_fraction: float, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Lower and upper thresholds along `dim`: percentiles 1-t and t with t = 1 - outlier_fraction/2
    (KVQuant); min and max when no outliers are kept. Zeros for a tensor of no element (an MLA key of no channel)."""
    if x.numel() == 0:
        reduced = x.shape[:dim] + x.shape[dim + 1 :]
        return x.new_zeros(reduced), x.new_zeros(reduced)
    if outlier_fraction == 0:
        return x.amin(dim), x.amax(dim)
    t = 1.0 - outlier_fraction / 2
    bounds = torch.quantile(x.float(), torch.tensor([1.0 - t, t], device=x.device), dim=dim)
    return bounds[0].to(x.dtype), bounds[1].to(x.dtype)


def normalize(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """x^ = (x - (hi+lo)/2) / ((hi-lo)/2): inliers land in [-1, 1]."""
    return (x - (hi + lo) / 2) / ((hi - lo) / 2).clamp(min=1e-8)


def denormalize(xhat: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    return xhat * ((hi - lo) / 2).clamp(min=1e-8) + (hi + lo) / 2


def nearest_codes(xhat: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Index of the nearest entry of a sorted codebook, by bucketing at the midpoints."""
    midpoints = (codebook[1:] + codebook[:-1]) / 2
    return torch.bucketize(xhat.contiguous(), midpoints.to(xhat.dtype))


@dataclass(frozen=True, eq=False)
class CodebookCodec:
    """Codebook codes of x normalized by thresholds: per channel (lo, hi given, fixed offline) or per
    token (lo, hi None: percentiles of each token computed online and stored in fp16). With
    outlier_fraction > 0 the thresholds keep 1 - outlier_fraction of the elements and the rest are
    stored exactly (dense-and-sparse: position and fp16 value, kvcal.packing.OUTLIER_BYTES each); with 0 they are
    min/max and nothing is kept aside."""

    codebook: torch.Tensor
    lo: torch.Tensor | None = None
    hi: torch.Tensor | None = None
    outlier_fraction: float = 0.0
    block_tokens = 1

    @property
    def kind(self) -> CodecKind:
        return CodecKind.CODEBOOK_CHANNEL if self.lo is not None else CodecKind.CODEBOOK_TOKEN

    @property
    def bits(self) -> int:
        return int(math.log2(self.codebook.numel()))

    def _thresholds(self, encoded, device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.lo is not None:
            return self.lo.to(device).float(), self.hi.to(device).float()
        return encoded.token["lo"].float(), encoded.token["hi"].float()  # (tokens, 1)

    def encode(self, x: torch.Tensor) -> Encoded:
        x = x.float()
        encoded = Encoded(torch.empty(0))
        if self.lo is None:
            lo, hi = keep_fraction_quantiles(x, self.outlier_fraction, dim=1)
            encoded.token = {"lo": store_as(lo[:, None], torch.float16), "hi": store_as(hi[:, None], torch.float16)}
        lo, hi = self._thresholds(encoded, x.device)
        xhat = normalize(x, lo, hi)
        encoded.codes = nearest_codes(xhat.clamp(-1, 1), self.codebook.to(x.device))
        if self.outlier_fraction > 0:
            rows, channels = torch.nonzero(xhat.abs() > 1, as_tuple=True)
            encoded.outliers = (rows, channels, x[rows, channels].half())
        return encoded

    def decode(self, encoded: Encoded) -> torch.Tensor:
        lo, hi = self._thresholds(encoded, encoded.codes.device)
        out = denormalize(self.codebook.to(encoded.codes.device)[encoded.codes], lo, hi)
        if encoded.outliers is not None:
            rows, channels, values = encoded.outliers
            out[rows, channels] = values.float()
        return out

    def row_bits(self, encoded: Encoded) -> torch.Tensor:
        tokens, channels = encoded.codes.shape
        bits = torch.full((tokens,), float(packed_row_bits(channels, self.bits)), device=encoded.codes.device)
        if self.lo is None:
            bits += 2 * FP16_BITS  # the token's thresholds
        if encoded.outliers is not None:
            bits += self._row_outliers(encoded) * 8 * OUTLIER_BYTES
        return bits

    @staticmethod
    def _row_outliers(encoded: Encoded) -> torch.Tensor | None:
        return None if encoded.outliers is None else torch.bincount(encoded.outliers[0], minlength=encoded.codes.shape[0])

    def quantize(self, x: torch.Tensor) -> Quantized:
        encoded = self.encode(x)
        return Quantized(self.decode(encoded), self.row_bits(encoded), self._row_outliers(encoded))


def uniform_per_token(x: torch.Tensor, bits: int, group: int) -> Quantized:
    return TokenUniform(bits, group).quantize(x)


def uniform_per_channel(x: torch.Tensor, bits: int, group: int) -> Quantized:
    return ChannelBlockUniform(bits, group).quantize(x)


def uniform_codebook(bits: int) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, 2**bits)


def normal_float_codebook(bits: int, offset: float = 0.9677) -> torch.Tensor:
    """NormalFloat (QLoRA): quantiles of N(0, 1), an exact zero, scaled to [-1, 1]."""
    half = 2 ** (bits - 1)
    positive = torch.special.ndtri(torch.linspace(offset, 0.5, half + 1, dtype=torch.float64)[:-1])
    negative = -torch.special.ndtri(torch.linspace(offset, 0.5, half, dtype=torch.float64)[:-1])
    values = torch.cat([positive, torch.zeros(1, dtype=torch.float64), negative]).sort().values
    return (values / values.abs().max()).float()
