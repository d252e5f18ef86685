"""Uncalibrated rotation-based KV-cache codecs that users run today, as kvcal codecs (the Codec protocol of
kvcal.quantizers: `bits`, `block_tokens`, `encode` -> Encoded, `decode`, `quantize` -> Quantized, and
`row_bits(channels)`, the real stored bits of one token row). Tensors are (tokens, channels) with the
channels of all KV heads of a token side by side (head h owns channels h*head_dim ... (h+1)*head_dim-1);
every codec takes `head_dim` and works per head. Codes are unpacked integers in channel order; token
parameters are stored in their storage dtype (fp16 unless said otherwise) and are rounded to it before
codes are computed, so decode(stored data) is exactly what `quantize` returns.

- HadamardRotation: seeded random-sign normalized Walsh-Hadamard transform per head (or, with
  random_signs=False and a block size, llama.cpp's plain Sylvester Hadamard on blocks of a head).
- HadamardInt(bits, head_dim, seed): rotation, then per token-head asymmetric min-max int (fp16 scale and
  zero per token-head, kvcal.quantizers.TokenUniform with group = head_dim). Bits 2-8.
- TurboQuant(bits, head_dim, seed): rotation, fp16 L2 norm per token-head, the unit vector's coordinates
  coded with the Lloyd-Max codebook of N(0, 1/head_dim). Bits 1-4.
- LlamaCppKV(qtype, head_dim, tensor, hadamard): llama.cpp / ggml KV cache types q8_0, q5_0, q5_1, q4_0, q4_1,
  iq4_nl (blocks of 32 along the row, ggml's reference rounding), with the Hadamard rotation llama.cpp
  applies to a quantized K and V cache (or ik_llama.cpp's under -khad / -vhad, or none).

Bits per element (row_bits / channels), head_dim 64: hadamard-intN N + 0.5 (4.5 / 3.5 / 2.5 for N = 4/3/2);
turboN N + 0.25; q8_0 8.5, q5_0 5.5, q5_1 6.0, q4_0 4.5, q4_1 5.0, iq4_nl 4.5 (any head_dim). The rotation signs and the TurboQuant codebook follow from (head_dim, seed, bits)
and are not stored.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvcal.errors import KvcalError
from kvcal.quantizers import FP16_BITS, CodecKind, Encoded, Quantized, TokenUniform, nearest_codes, store_as

# ---------------------------------------------------------------------------------------------------------
# rotations


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@functools.lru_cache(maxsize=None)
def sylvester_hadamard(n: int) -> torch.Tensor:
    """The n x n Sylvester Hadamard matrix normalized by 1/sqrt(n) (float64): H[i, j] = (-1)^popcount(i & j)
    / sqrt(n), symmetric and its own inverse. The same matrix as ggml_gen_hadamard in llama.cpp's
    src/llama-kv-cache.cpp (H_2s = [[H, H], [H, -H]] from H_1 = 1/sqrt(n))."""
    if not _is_power_of_two(n):
        raise KvcalError(f"a Walsh-Hadamard transform needs a power-of-two size, not {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


@functools.lru_cache(maxsize=None)
def _rotation_matrix(head_dim: int, block: int, seed: int | None) -> torch.Tensor:
    """(head_dim, head_dim) float64 orthonormal M with rotate(x) = M x: block-diagonal copies of the
    normalized Hadamard of size `block`, times diag(signs) when seed is not None."""
    hadamard = sylvester_hadamard(block)
    matrix = torch.block_diag(*[hadamard] * (head_dim // block))
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        signs = torch.randint(0, 2, (head_dim,), generator=generator).to(torch.float64) * 2 - 1
        matrix = matrix * signs[None, :]
    return matrix


@dataclass(frozen=True)
class HadamardRotation:
    """An orthonormal rotation of every head's channels: y = H_n D x with H_n the normalized Walsh-Hadamard
    matrix (entries +-1/sqrt(n)) and D = diag of random signs drawn from torch.Generator().manual_seed(seed)
    (one sign per channel of a head, the same for every head). Deterministic from the seed; unrotate(rotate(x))
    == x up to float32 rounding.

    block: size of the Hadamard blocks along a head (default head_dim, which must then be a power of two);
    a smaller power of two divides the head into independently rotated blocks (llama.cpp rotates K with the
    largest power of two dividing head_dim, V with 64). random_signs=False drops D (llama.cpp's rotation)."""

    head_dim: int
    seed: int = 0
    block: int | None = None
    random_signs: bool = True

    def __post_init__(self):
        block = self.block or self.head_dim
        if not _is_power_of_two(block):
            what = "head_dim" if self.block is None else "the rotation block"
            raise KvcalError(f"the Hadamard rotation needs {what} to be a power of two, not {block}")
        if self.head_dim % block:
            raise KvcalError(f"the rotation block {block} must divide head_dim {self.head_dim}")

    def matrix(self, device=None, dtype=torch.float32) -> torch.Tensor:
        """M (head_dim x head_dim): rotate(x) = M x for one head's column vector x."""
        seed = self.seed if self.random_signs else None
        return _rotation_matrix(self.head_dim, self.block or self.head_dim, seed).to(device=device, dtype=dtype, copy=True)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        tokens, channels = x.shape
        if channels % self.head_dim:
            raise KvcalError(f"{channels} channels are not a whole number of heads of {self.head_dim}")
        return x.reshape(tokens, channels // self.head_dim, self.head_dim)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """(tokens, channels) -> rotated (tokens, channels), float32."""
        x = x.float()
        return (self._heads(x) @ self.matrix(x.device).T).reshape(x.shape)

    def unrotate(self, y: torch.Tensor) -> torch.Tensor:
        y = y.float()
        return (self._heads(y) @ self.matrix(y.device)).reshape(y.shape)


def _full_bits(codec, x: torch.Tensor) -> torch.Tensor:
    return torch.full((x.shape[0],), float(codec.row_bits(x.shape[1])), device=x.device)


def bits_per_element(codec, channels: int) -> float:
    """Real stored bits per cached element of a token row of `channels` channels."""
    return codec.row_bits(channels) / channels


# ---------------------------------------------------------------------------------------------------------
# Hadamard + per-token-head int


@dataclass(frozen=True)
class HadamardInt:
    """`hadamard-intN`: rotate each head (HadamardRotation(head_dim, seed)), then asymmetric min-max int of
    `bits` bits per token-head: scale = (max - min) / (2^bits - 1) and zero = min, both stored fp16 and
    rounded before the codes are computed (kvcal.quantizers.TokenUniform with group = head_dim); decode,
    then unrotate.

    Stored per token row: bits x channels code bits + one fp16 scale and one fp16 zero per head.
    Encoded: codes (tokens, channels) in [0, 2^bits) of the rotated values; token {"scale", "zero"}:
    (tokens, heads) fp16. Bits per element: bits + 32 / head_dim (4.5 / 3.5 / 2.5 at head_dim 64)."""

    bits: int
    head_dim: int
    seed: int = 0
    kind: ClassVar[CodecKind] = CodecKind.SIMULATED
    block_tokens = 1

    def __post_init__(self):
        if not 2 <= self.bits <= 8:
            raise KvcalError(f"hadamard-int takes 2 to 8 bits, not {self.bits}")
        HadamardRotation(self.head_dim, self.seed)  # validates head_dim

    @property
    def rotation(self) -> HadamardRotation:
        return HadamardRotation(self.head_dim, self.seed)

    @property
    def _inner(self) -> TokenUniform:
        return TokenUniform(self.bits, self.head_dim)

    def encode(self, x: torch.Tensor) -> Encoded:
        return self._inner.encode(self.rotation.rotate(x))

    def decode(self, encoded: Encoded) -> torch.Tensor:
        return self.rotation.unrotate(self._inner.decode(encoded))

    def row_bits(self, channels: int) -> float:
        return float(self.bits * channels + 2 * FP16_BITS * (channels // self.head_dim))

    def quantize(self, x: torch.Tensor) -> Quantized:
        return Quantized(self.decode(self.encode(x)), _full_bits(self, x))


# ---------------------------------------------------------------------------------------------------------
# TurboQuant-style: rotation + Lloyd-Max codebook + fp16 norm


def _normal_pdf(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _lloyd_max_update(levels: torch.Tensor) -> torch.Tensor:
    """One Lloyd-Max step for N(0, 1): each level becomes the conditional mean of its cell, the cells being
    bounded by the midpoints between levels: E[X | a < X < b] = (pdf(a) - pdf(b)) / (cdf(b) - cdf(a))."""
    inf = torch.tensor([math.inf], dtype=levels.dtype)
    edges = torch.cat([-inf, (levels[1:] + levels[:-1]) / 2, inf])
    a, b = edges[:-1], edges[1:]
    mass = torch.special.ndtr(b) - torch.special.ndtr(a)
    return (_normal_pdf(a) - _normal_pdf(b)) / mass


def lloyd_max_gaussian(bits: int) -> torch.Tensor:
    """The 2^bits-level Lloyd-Max (MSE-optimal scalar) quantizer of N(0, 1), float64, sorted and exactly
    symmetric: iterate the centroid condition from levels at the cell quantiles until no level moves by
    more than 1e-12 (deterministic; no scipy). 1 bit: +-sqrt(2/pi); 2 bits: +-0.4528, +-1.5104."""
    return _lloyd_max_gaussian(bits).clone()


@functools.lru_cache(maxsize=None)
def _lloyd_max_gaussian(bits: int, tol: float = 1e-12, max_iter: int = 200_000) -> torch.Tensor:
    if not 1 <= bits <= 4:
        raise KvcalError(f"Lloyd-Max codebooks are computed for 1 to 4 bits, not {bits}")
    n = 2**bits
    levels = torch.special.ndtri((torch.arange(n, dtype=torch.float64) + 0.5) / n)
    for _ in range(max_iter):
        updated = _lloyd_max_update(levels)
        updated = (updated - updated.flip(0)) / 2  # keep it exactly symmetric
        moved = float((updated - levels).abs().max())
        levels = updated
        if moved < tol:
            break
    else:  # pragma: no cover - 4 bits converges in under 0.1 s
        raise RuntimeError(f"Lloyd-Max for {bits} bits did not converge")
    return levels


def turbo_codebook(bits: int, head_dim: int) -> torch.Tensor:
    """Codebook (float32) for the coordinates of a random unit vector in head_dim dimensions, approximated
    by N(0, 1/head_dim): the N(0, 1) Lloyd-Max levels / sqrt(head_dim)."""
    return (_lloyd_max_gaussian(bits) / math.sqrt(head_dim)).float()


@dataclass(frozen=True)
class TurboQuant:
    """`turboN`: rotate each head (HadamardRotation(head_dim, seed)); per token-head store the L2 norm in
    fp16 and code every coordinate of the unit vector (rotated / stored norm) with the nearest entry of
    turbo_codebook(bits, head_dim), the Lloyd-Max codebook of N(0, 1/head_dim) (a rotated unit vector's
    coordinates are nearly that); decode = norm * codebook[code], then unrotate. A zero vector decodes to 0.

    This is the MSE variant of TurboQuant (random rotation + per-coordinate Lloyd-Max codebook of the
    Beta/Gaussian coordinate law + norm; Zandieh et al., arXiv:2504.19874, the paper cited by vLLM's
    TurboQuant KV-cache pull requests) with a random-sign Hadamard as the rotation and no QJL residual bit; it is not
    claimed to match vLLM's `turboquant_*` cache modes bit for bit.

    Stored per token row: bits x channels code bits + one fp16 norm per head. Encoded: codes (tokens,
    channels) in [0, 2^bits); token {"norm"}: (tokens, heads) fp16. Bits per element: bits + 16 / head_dim
    (4.25 / 3.25 / 2.25 at head_dim 64)."""

    bits: int
    head_dim: int
    seed: int = 0
    kind: ClassVar[CodecKind] = CodecKind.SIMULATED
    block_tokens = 1

    def __post_init__(self):
        if not 1 <= self.bits <= 4:
            raise KvcalError(f"turbo takes 1 to 4 bits, not {self.bits}")
        HadamardRotation(self.head_dim, self.seed)

    @property
    def rotation(self) -> HadamardRotation:
        return HadamardRotation(self.head_dim, self.seed)

    def codebook(self, device=None) -> torch.Tensor:
        return turbo_codebook(self.bits, self.head_dim).to(device)

    def encode(self, x: torch.Tensor) -> Encoded:
        rotated = self.rotation.rotate(x)
        tokens, channels = rotated.shape
        heads = rotated.view(tokens, channels // self.head_dim, self.head_dim)
        norm = store_as(torch.linalg.vector_norm(heads, dim=2), torch.float16)
        unit = heads / norm.float().clamp(min=torch.finfo(torch.float32).tiny)[:, :, None]
        codes = nearest_codes(unit, self.codebook(x.device)).view(tokens, channels)
        return Encoded(codes, token={"norm": norm})

    def decode(self, encoded: Encoded) -> torch.Tensor:
        tokens, channels = encoded.codes.shape
        values = self.codebook(encoded.codes.device)[encoded.codes].view(tokens, -1, self.head_dim)
        values = values * encoded.token["norm"].float()[:, :, None]
        return self.rotation.unrotate(values.view(tokens, channels))

    def row_bits(self, channels: int) -> float:
        return float(self.bits * channels + FP16_BITS * (channels // self.head_dim))

    def quantize(self, x: torch.Tensor) -> Quantized:
        return Quantized(self.decode(self.encode(x)), _full_bits(self, x))


# ---------------------------------------------------------------------------------------------------------
# llama.cpp / ggml KV cache types

GGML_BLOCK = 32  # QK4_0 = QK4_1 = QK5_0 = QK5_1 = QK8_0 = QK4_NL = 32
# bytes per block of 32: fp16 d (+ fp16 m) + codes (+ 4 bytes of 5th bits)
GGML_BLOCK_BYTES = {"q8_0": 2 + 32, "q5_0": 2 + 4 + 16, "q5_1": 2 + 2 + 4 + 16, "q4_0": 2 + 16, "q4_1": 2 + 2 + 16, "iq4_nl": 2 + 16}
GGML_CODE_BITS = {"q8_0": 8, "q5_0": 5, "q5_1": 5, "q4_0": 4, "q4_1": 4, "iq4_nl": 4}
KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
GROUP_MAX_EPS = 1e-15  # ggml-quants.c: an iq4_nl block with max |x| below it is stored as zeros
LLAMA_CPP_TYPES = tuple(GGML_BLOCK_BYTES)
HADAMARDS = ("llama.cpp", "ik_llama.cpp", None)  # LlamaCppKV's rotations: whose, or none


def llama_cpp_rotation_size(head_dim: int, tensor: str) -> int:
    """Hadamard block size llama.cpp uses for a quantized cache (src/llama-kv-cache.cpp,
    build_input_k_rot / build_input_v_rot, from ggml-org/llama.cpp#21038): none (0) unless head_dim % 64 == 0;
    K: the largest power of two dividing head_dim (64, 128, 256, ...); V: 64."""
    if tensor not in ("k", "v"):
        raise KvcalError(f"tensor must be 'k' or 'v', not {tensor!r}")
    if head_dim % 64:
        return 0
    if tensor == "v":
        return 64
    size = 64
    while head_dim % (size * 2) == 0:
        size *= 2
    return size


def ik_llama_cpp_rotation_size(head_dim: int) -> int:
    """Hadamard block size ik_llama.cpp uses for K under -khad and for V under -vhad (src/llama-model.h,
    hadamard_size): head_dim itself when it is a power of two, else the largest of 512, 256, 128, 64 dividing it, else
    none (0)."""
    if head_dim & (head_dim - 1) == 0:
        return head_dim
    return next((size for size in (512, 256, 128, 64) if head_dim % size == 0), 0)


def _c_round(x: torch.Tensor) -> torch.Tensor:
    """C roundf: halves away from zero (torch.round rounds halves to even)."""
    whole = torch.trunc(x)
    return whole + torch.where((x - whole).abs() >= 0.5, torch.sign(x), torch.zeros_like(x))


def _first_extreme(blocks: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return torch.gather(blocks, -1, index[..., None])[..., 0]


def _signed_absmax(blocks: torch.Tensor) -> torch.Tensor:
    """The element of largest |x| in each block, the first one on ties, +0.0 for an all-zero block (the
    `if (amax < fabsf(v)) { amax = fabsf(v); max = v; }` loop from amax = max = 0)."""
    magnitude = blocks.abs()
    first = _first_extreme(blocks, magnitude.argmax(-1))
    return torch.where(magnitude.amax(-1) > 0, first, torch.zeros_like(first))


def _reciprocal_or_zero(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d != 0, 1.0 / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(d))


def _iq4nl_index(scaled: torch.Tensor) -> torch.Tensor:
    """best_index_int8(16, kvalues_iq4nl, x): the nearest value, ties to the larger one (x + x compared with
    the sum of two neighbours, both exact in float32)."""
    values = torch.tensor(KVALUES_IQ4NL, dtype=torch.float32, device=scaled.device)
    sums = values[1:] + values[:-1]
    return ((scaled + scaled)[..., None] >= sums).sum(-1)


def _ggml_encode(qtype: str, blocks: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ggml's reference quantize_row_<qtype>_ref on (..., 32) float32 blocks: codes (unsigned, the stored
    bits) and fp16 d (and m). Float32 arithmetic in the C source's order, one rounding per operation."""
    if qtype in ("q4_0", "q5_0"):
        half = 8 if qtype == "q4_0" else 16
        d = _signed_absmax(blocks) / -half
        inv = _reciprocal_or_zero(d)[..., None]
        codes = torch.trunc(blocks * inv + (half + 0.5)).clamp(max=2 * half - 1)
        return codes.long(), {"d": d.half()}
    if qtype in ("q4_1", "q5_1"):
        top = 15 if qtype == "q4_1" else 31
        low = _first_extreme(blocks, blocks.argmin(-1))
        high = _first_extreme(blocks, blocks.argmax(-1))
        d = (high - low) / top
        inv = _reciprocal_or_zero(d)[..., None]
        codes = torch.trunc((blocks - low[..., None]) * inv + 0.5).long()
        codes = codes.clamp(max=15) if qtype == "q4_1" else codes & 31  # q5_1 keeps the low 5 bits
        return codes, {"d": d.half(), "m": low.half()}
    if qtype == "q8_0":
        d = blocks.abs().amax(-1) / 127
        inv = _reciprocal_or_zero(d)[..., None]
        signed = _c_round(blocks * inv).long()
        return signed & 0xFF, {"d": d.half()}  # the int8 stored as its byte
    if qtype == "iq4_nl":  # quantize_row_iq4_nl_ref: quantize_row_iq4_nl_impl(..., quant_weights=NULL, ntry=-1)
        amax = blocks.abs().amax(-1)
        d0 = _signed_absmax(blocks) / KVALUES_IQ4NL[0]
        inv = 1.0 / torch.where(amax >= GROUP_MAX_EPS, d0, torch.ones_like(d0))
        codes = _iq4nl_index(blocks * inv[..., None])
        q = torch.tensor(KVALUES_IQ4NL, dtype=torch.float32, device=blocks.device)[codes]
        weight_q = blocks * blocks * q  # (w*q) with w = x*x
        sum_qx = torch.zeros_like(amax)
        sum_q2 = torch.zeros_like(amax)
        for j in range(blocks.shape[-1]):  # sequential float32 sums, as the C loop
            sum_qx = sum_qx + weight_q[..., j] * blocks[..., j]
            sum_q2 = sum_q2 + weight_q[..., j] * q[..., j]
        d = torch.where(sum_q2 > 0, sum_qx / torch.where(sum_q2 > 0, sum_q2, torch.ones_like(sum_q2)), torch.zeros_like(sum_q2))
        small = amax < GROUP_MAX_EPS
        d = torch.where(small, torch.zeros_like(d), d)
        codes = torch.where(small[..., None], torch.zeros_like(codes), codes)
        return codes, {"d": d.half()}
    raise KvcalError(f"unknown llama.cpp cache type '{qtype}'; use one of {', '.join(LLAMA_CPP_TYPES)}")


def _ggml_decode(qtype: str, codes: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
    """ggml's dequantize_row_<qtype> on (..., 32) codes: float32."""
    d = params["d"].float()[..., None]
    if qtype == "q4_0":
        return (codes - 8).float() * d
    if qtype == "q5_0":
        return (codes - 16).float() * d
    if qtype in ("q4_1", "q5_1"):
        return codes.float() * d + params["m"].float()[..., None]
    if qtype == "q8_0":
        return torch.where(codes >= 128, codes - 256, codes).float() * d
    if qtype == "iq4_nl":
        return d * torch.tensor(KVALUES_IQ4NL, dtype=torch.float32, device=codes.device)[codes]
    raise KvcalError(f"unknown llama.cpp cache type '{qtype}'; use one of {', '.join(LLAMA_CPP_TYPES)}")


@dataclass(frozen=True)
class LlamaCppKV:
    """A llama.cpp KV cache type (`--cache-type-k/-v`): q8_0, q5_0, q5_1, q4_0, q4_1 or iq4_nl, exact to
    ggml's reference quantizers (ggml/src/ggml-quants.c quantize_row_<type>_ref; the CPU backend's
    quantize_row_<type> calls them for q4_0, q4_1, q5_0, q5_1 and iq4_nl, the CUDA set-rows kernels in
    cpy-utils.cuh use the same formulas, while the CPU's x86 AVX q8_0 path rounds halves to even with
    id = 127/amax) and dequantizers, after llama.cpp's KV rotation. Each float operation is rounded to
    float32 as written in the C source (a build that contracts a*b+c into an FMA can differ on exact
    rounding boundaries).

    Each token row (all heads, ggml's row of n_embd_k_gqa / n_embd_v_gqa) is cut into blocks of 32
    channels (channels % 32 == 0); per block:
      q4_0: d = max / -8 (max = the signed element of largest |x|), q = min(15, (int)(x/d + 8.5)),
            x^ = (q - 8) d.                                             fp16 d + 32 x 4 bits = 4.5 bits/element
      q5_0: d = max / -16, q = min(31, (int)(x/d + 16.5)), x^ = (q - 16) d.   fp16 d + 32 x 5 bits = 5.5
      q4_1: d = (max - min) / 15, m = min, q = min(15, (int)((x - min)/d + 0.5)), x^ = q d + m.
                                                                    fp16 d, fp16 m + 32 x 4 bits = 5.0
      q5_1: d = (max - min) / 31, q = (int)((x - min)/d + 0.5), x^ = q d + m.        = 6.0
      q8_0: d = amax / 127, q = roundf(x/d) (int8), x^ = q d.       fp16 d + 32 x 8 bits = 8.5
      iq4_nl: d0 = max / -127, q = nearest of kvalues_iq4nl to x/d0 (ties up), d = sum(w q x) / sum(w q^2)
            with w = x^2 (no scale search: the _ref path, ntry = -1), x^ = d kvalues[q].  fp16 d + 32 x 4 = 4.5
    where x/d means x * (1/d) in float32 computed from the fp32 d (d is then stored fp16, and decoding uses
    the fp16 d). Encoded: codes (tokens, channels), unsigned, the stored bits of each element (q8_0: the
    int8 as its byte; q5_*: the 5th bit included); token {"d"} (and {"m"}): (tokens, channels/32) fp16.
    ggml packs codes j and j+16 of a block in one byte and the q5 5th bits in a 32-bit qh; the bit count is
    the same.

    Rotation (llama.cpp >= ggml-org/llama.cpp#21038, on by default, LLAMA_ATTN_ROT_DISABLE=1 turns it off):
    with a quantized cache type and head_dim % 64 == 0, Q and K are multiplied by the normalized Sylvester
    Hadamard on blocks of llama_cpp_rotation_size(head_dim, "k") channels of each head, V by blocks of 64
    (and the attention output back), no random signs. `tensor` ("k" or "v") picks the block size. `hadamard`
    "ik_llama.cpp" rotates as ik_llama.cpp does under -khad / -vhad (blocks of ik_llama_cpp_rotation_size, K and V
    alike; the same Sylvester matrix, its fast_ht in ggml/src/iqk/iqk_cpu_ops.cpp); None gives the plain cache
    type. decode() unrotates, so it returns the stored values in model coordinates (exactly what rotated attention
    computes, up to float rounding)."""

    qtype: str
    head_dim: int
    tensor: str = "k"
    hadamard: str | None = "llama.cpp"  # whose rotation: "llama.cpp", "ik_llama.cpp" or None
    kind: ClassVar[CodecKind] = CodecKind.SIMULATED
    block_tokens = 1

    def __post_init__(self):
        if self.qtype not in GGML_BLOCK_BYTES:
            raise KvcalError(f"unknown llama.cpp cache type '{self.qtype}'; use one of {', '.join(LLAMA_CPP_TYPES)}")
        llama_cpp_rotation_size(self.head_dim, self.tensor)  # validates tensor
        if self.hadamard not in HADAMARDS:
            raise KvcalError(f"hadamard must be one of {HADAMARDS}, not {self.hadamard!r}")

    @property
    def bits(self) -> int:
        return GGML_CODE_BITS[self.qtype]

    @property
    def rotation(self) -> HadamardRotation | None:
        if self.hadamard == "llama.cpp":
            size = llama_cpp_rotation_size(self.head_dim, self.tensor)
        else:
            size = ik_llama_cpp_rotation_size(self.head_dim) if self.hadamard == "ik_llama.cpp" else 0
        return HadamardRotation(self.head_dim, block=size, random_signs=False) if size else None

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        tokens, channels = x.shape
        if channels % GGML_BLOCK:
            raise KvcalError(f"ggml quantizes rows in blocks of {GGML_BLOCK}; {channels} channels are not a multiple")
        return x.reshape(tokens, channels // GGML_BLOCK, GGML_BLOCK)

    def encode(self, x: torch.Tensor) -> Encoded:
        x = x.float() if self.rotation is None else self.rotation.rotate(x)
        codes, params = _ggml_encode(self.qtype, self._blocks(x))
        return Encoded(codes.reshape(x.shape), token=params)

    def decode(self, encoded: Encoded) -> torch.Tensor:
        codes = encoded.codes
        values = _ggml_decode(self.qtype, self._blocks(codes), encoded.token).reshape(codes.shape)
        return values if self.rotation is None else self.rotation.unrotate(values)

    def row_bits(self, channels: int) -> float:
        return float(8 * GGML_BLOCK_BYTES[self.qtype] * (channels // GGML_BLOCK))

    def quantize(self, x: torch.Tensor) -> Quantized:
        return Quantized(self.decode(self.encode(x)), _full_bits(self, x))
