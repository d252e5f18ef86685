"""kvcal.rotation_codecs: rotations, hadamard-int, TurboQuant-style, llama.cpp KV types checked against a
plain-Python transcription of ggml's reference C loops and against llama.cpp's gguf-py package."""

import math
import struct

import gguf
import pytest
import torch

from kvcal.errors import KvcalError
from kvcal.quantizers import TokenUniform
from kvcal.rotation_codecs import (
    KVALUES_IQ4NL,
    LLAMA_CPP_TYPES,
    HadamardInt,
    HadamardRotation,
    LlamaCppKV,
    TurboQuant,
    bits_per_element,
    ik_llama_cpp_rotation_size,
    llama_cpp_rotation_size,
    lloyd_max_gaussian,
    sylvester_hadamard,
    turbo_codebook,
)


def kv_like(tokens=48, heads=2, head_dim=64, seed=0):
    """Gaussian rows with a few large outlier channels per head, like post-RoPE keys."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, heads * head_dim, generator=g)
    x[:, 3::head_dim] *= 12
    x[:, 17::head_dim] += 6
    return x


# ----------------------------------------------------------------------------------------- rotation


def test_hadamard_rotation_is_orthonormal_deterministic_and_inverts():
    rotation = HadamardRotation(64, seed=3)
    m = rotation.matrix(dtype=torch.float64)
    assert torch.allclose(m @ m.T, torch.eye(64, dtype=torch.float64), atol=1e-12)
    assert torch.all((m.abs() - 1 / 8).abs() < 1e-12)  # +-1/sqrt(64)
    assert torch.equal(m, HadamardRotation(64, seed=3).matrix(dtype=torch.float64))
    assert not torch.equal(m, HadamardRotation(64, seed=4).matrix(dtype=torch.float64))
    x = kv_like(heads=3)
    y = rotation.rotate(x)
    assert torch.allclose(rotation.unrotate(y), x, atol=1e-5)
    heads = lambda t: t.view(t.shape[0], 3, 64)  # noqa: E731
    assert torch.allclose(torch.linalg.vector_norm(heads(y), dim=2), torch.linalg.vector_norm(heads(x), dim=2), rtol=1e-5)
    # each head is rotated on its own: changing head 1 leaves head 0's rotated channels alone
    x2 = x.clone()
    x2[:, 64:128] = 0
    assert torch.equal(rotation.rotate(x2)[:, :64], y[:, :64])


def test_rotation_refuses_sizes_that_are_not_powers_of_two():
    with pytest.raises(KvcalError, match="power of two"):
        HadamardRotation(48)
    with pytest.raises(KvcalError, match="power of two"):
        HadamardInt(4, 96)
    with pytest.raises(KvcalError, match="whole number of heads"):
        HadamardRotation(64).rotate(torch.zeros(2, 96))
    HadamardRotation(192, block=64)  # llama.cpp-style blocks need only divide head_dim


def test_llama_cpp_rotation_is_the_plain_sylvester_hadamard_on_blocks():
    assert [llama_cpp_rotation_size(d, "k") for d in (64, 128, 256, 192, 80)] == [64, 128, 256, 64, 0]
    assert [llama_cpp_rotation_size(d, "v") for d in (64, 128, 256, 80)] == [64, 64, 64, 0]
    sylvester = torch.tensor([[(-1) ** bin(i & j).count("1") for j in range(64)] for i in range(64)], dtype=torch.float64) / 8
    key, value = LlamaCppKV("q4_0", 128, "k"), LlamaCppKV("q4_0", 128, "v")
    assert key.rotation.block == 128 and value.rotation.block == 64
    expected = torch.block_diag(sylvester, sylvester)
    got = value.rotation.matrix(dtype=torch.float64)
    assert torch.allclose(got, expected, atol=1e-15) and torch.allclose(got, got.T)
    assert LlamaCppKV("q8_0", 80).rotation is None  # head_dim % 64 != 0: llama.cpp does not rotate
    assert LlamaCppKV("q8_0", 64, hadamard=None).rotation is None


def test_ik_llama_cpp_rotates_k_and_v_on_blocks_of_its_own_size():
    """ik_llama.cpp's -khad / -vhad (src/llama-model.h hadamard_size): a power-of-two head whole, K and V alike; else
    the largest of 512..64 dividing it. Gemma 3's V (head_dim 256) thus takes blocks of 256 where llama.cpp's take 64."""
    assert [ik_llama_cpp_rotation_size(d) for d in (64, 128, 256, 192, 80, 32)] == [64, 128, 256, 64, 0, 32]
    key, value = LlamaCppKV("q4_0", 256, "k", "ik_llama.cpp"), LlamaCppKV("q4_0", 256, "v", "ik_llama.cpp")
    assert key.rotation.block == value.rotation.block == 256 and LlamaCppKV("q4_0", 256, "v").rotation.block == 64
    assert torch.equal(value.rotation.matrix(dtype=torch.float64), sylvester_hadamard(256).double())
    with pytest.raises(KvcalError, match="hadamard must be one of"):
        LlamaCppKV("q4_0", 64, hadamard="mainline")


# ------------------------------------------------------------------- ggml reference loops, in plain Python

FLT_MAX = 3.4028234663852886e38


def f32(v):
    """Round a Python float to float32: one C float operation on float32 operands, when applied to the
    double-precision result of that operation (exact for + - * /)."""
    return struct.unpack("f", struct.pack("f", v))[0]


def f16(v):
    return struct.unpack("e", struct.pack("e", v))[0]


def c_roundf(v):
    return math.copysign(math.floor(abs(v) + 0.5), v)


def ref_q4_0(xs):
    amax, vmax = 0.0, 0.0
    for v in xs:
        if amax < abs(v):
            amax, vmax = abs(v), v
    d = f32(vmax / -8)
    inv = f32(1.0 / d) if d else 0.0
    qs = [0] * 16
    for j in range(16):
        xi0 = min(15, int(f32(f32(xs[j] * inv) + 8.5)))
        xi1 = min(15, int(f32(f32(xs[16 + j] * inv) + 8.5)))
        qs[j] = xi0 | (xi1 << 4)
    dd = f16(d)
    codes = [qs[j] & 0x0F for j in range(16)] + [qs[j] >> 4 for j in range(16)]
    return codes, [f32((c - 8) * dd) for c in codes]


def ref_q4_1(xs):
    lo, hi = FLT_MAX, -FLT_MAX
    for v in xs:
        if v < lo:
            lo = v
        if v > hi:
            hi = v
    d = f32(f32(hi - lo) / 15)
    inv = f32(1.0 / d) if d else 0.0
    codes = [min(15, int(f32(f32(f32(v - lo) * inv) + 0.5))) for v in xs]
    dd, m = f16(d), f16(lo)
    return codes, [f32(f32(c * dd) + m) for c in codes]


def _q5_unpack(qs, qh):
    codes = []
    for j in range(16):
        codes.append((qs[j] & 0x0F) | (((qh >> j) << 4) & 0x10))
    for j in range(16):
        codes.append((qs[j] >> 4) | ((qh >> (j + 12)) & 0x10))
    return codes


def ref_q5_0(xs):
    amax, vmax = 0.0, 0.0
    for v in xs:
        if amax < abs(v):
            amax, vmax = abs(v), v
    d = f32(vmax / -16)
    inv = f32(1.0 / d) if d else 0.0
    qs, qh = [0] * 16, 0
    for j in range(16):
        xi0 = min(31, int(f32(f32(xs[j] * inv) + 16.5)))
        xi1 = min(31, int(f32(f32(xs[16 + j] * inv) + 16.5)))
        qs[j] = (xi0 & 0x0F) | ((xi1 & 0x0F) << 4)
        qh |= ((xi0 & 0x10) >> 4) << j
        qh |= ((xi1 & 0x10) >> 4) << (j + 16)
    codes, dd = _q5_unpack(qs, qh), f16(d)
    return codes, [f32((c - 16) * dd) for c in codes]


def ref_q5_1(xs):
    lo, hi = FLT_MAX, -FLT_MAX
    for v in xs:
        if v < lo:
            lo = v
        if v > hi:
            hi = v
    d = f32(f32(hi - lo) / 31)
    inv = f32(1.0 / d) if d else 0.0
    qs, qh = [0] * 16, 0
    for j in range(16):
        xi0 = int(f32(f32(f32(xs[j] - lo) * inv) + 0.5)) & 0xFF
        xi1 = int(f32(f32(f32(xs[16 + j] - lo) * inv) + 0.5)) & 0xFF
        qs[j] = (xi0 & 0x0F) | ((xi1 & 0x0F) << 4)
        qh |= ((xi0 & 0x10) >> 4) << j
        qh |= ((xi1 & 0x10) >> 4) << (j + 16)
    codes, dd, m = _q5_unpack(qs, qh), f16(d), f16(lo)
    return codes, [f32(f32(c * dd) + m) for c in codes]


def ref_q8_0(xs):
    amax = 0.0
    for v in xs:
        amax = max(amax, abs(v))
    d = f32(amax / 127)
    inv = f32(1.0 / d) if d else 0.0
    qs = [int(c_roundf(f32(v * inv))) for v in xs]
    dd = f16(d)
    return [q & 0xFF for q in qs], [f32(q * dd) for q in qs]


def best_index_int8(values, x):  # ggml-quants.c, the binary-search form
    if x <= values[0]:
        return 0
    if x >= values[-1]:
        return len(values) - 1
    ml, mu = 0, len(values) - 1
    while mu - ml > 1:
        mav = (ml + mu) // 2
        if x < values[mav]:
            mu = mav
        else:
            ml = mav
    return mu - 1 if f32(x - values[mu - 1]) < f32(values[mu] - x) else mu


def ref_iq4_nl(xs):  # quantize_row_iq4_nl_impl(32, 32, ..., quant_weights=NULL, ntry=-1)
    weight = [f32(v * v) for v in xs]
    amax, vmax = 0.0, 0.0
    for v in xs:
        if abs(v) > amax:
            amax, vmax = abs(v), v
    if amax < f32(1e-15):
        codes, d = [0] * 32, 0.0
    else:
        d = f32(vmax / KVALUES_IQ4NL[0])
        inv = f32(1.0 / d)
        sumqx = sumq2 = 0.0
        codes = []
        for j in range(32):
            l = best_index_int8(KVALUES_IQ4NL, f32(inv * xs[j]))
            codes.append(l)
            q = KVALUES_IQ4NL[l]
            sumqx = f32(sumqx + f32(f32(weight[j] * q) * xs[j]))
            sumq2 = f32(sumq2 + f32(f32(weight[j] * q) * q))
        d = f32(sumqx / sumq2) if sumq2 > 0 else 0.0
    dd = f16(d)
    return codes, [f32(dd * KVALUES_IQ4NL[c]) for c in codes]


REFERENCE = {"q4_0": ref_q4_0, "q4_1": ref_q4_1, "q5_0": ref_q5_0, "q5_1": ref_q5_1, "q8_0": ref_q8_0, "iq4_nl": ref_iq4_nl}


def ggml_test_rows():
    """Rows of 128 channels (4 blocks): random data at several scales plus edge-case blocks."""
    g = torch.Generator().manual_seed(7)
    random = torch.randn(10, 128, generator=g) * torch.tensor([0.01, 1.0, 30.0, 1000.0]).repeat_interleave(32)
    edges = torch.zeros(5, 128)
    edges[0, 32:64] = torch.randn(32, generator=g) * 0.1
    edges[0, 40] = 5e3  # one huge value
    edges[0, 64:96] = torch.randn(32, generator=g)
    edges[0, 70] = -9.0  # negative max
    edges[0, 96:128] = 2.5  # constant block
    edges[1, :32] = torch.tensor([127.0, 2.5, -2.5, 0.5, -0.5, 1.5, -1.5, 126.5] * 4)  # q8_0: roundf halves away from 0
    edges[1, 32:64] = torch.tensor([-8.0, 0.5, -0.5, 7.5, 6.5, -7.5, 3.0, 0.0] * 4)  # q4_0 boundaries: d = 1
    edges[1, 64:96] = torch.tensor([3.0, -3.0] * 16)  # |max| tie: the first element wins
    edges[1, 96:128] = torch.tensor([-3.0, 3.0] * 16)
    edges[2, :32] = 1e-20  # below iq4_nl's GROUP_MAX_EPS
    edges[2, 32:64] = -torch.rand(32, generator=g)  # all negative
    edges[2, 64:96] = torch.rand(32, generator=g) + 1.0  # all positive
    edges[3] = torch.randn(128, generator=g) * 1e-3
    # iq4_nl: d0 = -127 / -127 = 1, every other element on a midpoint of kvalues_iq4nl (ties go up)
    midpoints = [(a + b) / 2 for a, b in zip(KVALUES_IQ4NL, KVALUES_IQ4NL[1:])]
    edges[4, :32] = torch.tensor([-127.0] + midpoints + midpoints + [0.0])
    edges[4, 32:] = torch.randn(96, generator=g)
    return torch.cat([random, edges])


@pytest.mark.parametrize("qtype", LLAMA_CPP_TYPES)
def test_llama_cpp_types_match_ggml_reference_loops(qtype):
    x = ggml_test_rows()
    codec = LlamaCppKV(qtype, 64, hadamard=None)
    encoded = codec.encode(x)
    decoded = codec.decode(encoded)
    expected_codes, expected_values = [], []
    for row in x.tolist():
        codes, values = [], []
        for start in range(0, 128, 32):
            c, v = REFERENCE[qtype](row[start : start + 32])
            codes += c
            values += v
        expected_codes.append(codes)
        expected_values.append(values)
    assert torch.equal(encoded.codes, torch.tensor(expected_codes))
    assert torch.equal(decoded, torch.tensor(expected_values))
    assert all(t.dtype == torch.float16 and t.shape == (x.shape[0], 4) for t in encoded.token.values())
    assert torch.equal(codec.quantize(x).values, decoded)


def ggml_blocks(qtype, encoded):
    """Our encoding laid out as ggml's block structs (ggml-common.h): fp16 d [, fp16 m] [, uint32 qh of the 5th
    bits], then the low bits of elements j and j + 16 in one byte (q8_0: the 32 int8 bytes)."""
    codes = encoded.codes.reshape(-1, 32).to(torch.uint8)
    scales = [encoded.token[name].reshape(-1, 1).view(torch.uint8) for name in ("d", "m") if name in encoded.token]
    if qtype == "q8_0":
        return torch.cat([*scales, codes], dim=1).numpy()
    packed = (codes[:, :16] & 0x0F) | ((codes[:, 16:] & 0x0F) << 4)
    if qtype.startswith("q5"):
        high = ((codes >> 4) & 1).to(torch.int64) << torch.arange(32)
        qh = high.sum(dim=1).to(torch.int32).reshape(-1, 1).view(torch.uint8)  # little-endian uint32
        return torch.cat([*scales, qh, packed], dim=1).numpy()
    return torch.cat([*scales, packed], dim=1).numpy()


@pytest.mark.parametrize("qtype", LLAMA_CPP_TYPES)
def test_llama_cpp_types_match_llama_cpps_gguf_package_byte_for_byte(qtype):
    """gguf-py (llama.cpp's gguf-py/gguf/quants.py, checked against libggml by its tests/test_quants.py) quantizes
    q4_0, q4_1, q5_0, q5_1 and q8_0 and dequantizes all six: the same bytes, and the same values from our bytes."""
    x = ggml_test_rows()
    codec = LlamaCppKV(qtype, 64, hadamard=None)
    encoded = codec.encode(x)
    ours = ggml_blocks(qtype, encoded)
    gguf_type = getattr(gguf.GGMLQuantizationType, qtype.upper())
    if qtype != "iq4_nl":  # gguf-py has no iq4_nl quantizer
        theirs = gguf.quants.quantize(x.numpy().reshape(-1, 32), gguf_type)
        assert ours.shape == theirs.shape and (ours == theirs).all()
    values = gguf.quants.dequantize(ours.reshape(-1), gguf_type).reshape(x.shape)
    assert torch.equal(codec.decode(encoded), torch.from_numpy(values))


@pytest.mark.parametrize("qtype", ["q4_0", "iq4_nl", "q8_0"])
def test_llama_cpp_rotated_cache_quantizes_the_rotated_rows(qtype):
    x = kv_like(heads=2, head_dim=128)
    key = LlamaCppKV(qtype, 128, "k")
    plain = LlamaCppKV(qtype, 128, hadamard=None)
    rotated = key.rotation.rotate(x)
    encoded = key.encode(x)
    assert torch.equal(encoded.codes, plain.encode(rotated).codes)
    assert torch.allclose(key.decode(encoded), key.rotation.unrotate(plain.decode(encoded)))
    # rotation spreads the outlier channels: lower error than the plain type on outlier-heavy keys
    assert (key.quantize(x).values - x).square().mean() < (plain.quantize(x).values - x).square().mean()


def test_unknown_llama_cpp_type_and_odd_widths_are_refused():
    with pytest.raises(KvcalError, match="unknown llama.cpp cache type"):
        LlamaCppKV("q3_k", 64)
    with pytest.raises(KvcalError, match="blocks of 32"):
        LlamaCppKV("q4_0", 16, hadamard=None).encode(torch.zeros(2, 48))


# ------------------------------------------------------------------------------------------ bits


def stored_bits_per_row(codec, encoded):
    """Code bits plus every stored token parameter, per token row."""
    tokens, channels = encoded.codes.shape
    params = sum(t.shape[1] * t.element_size() * 8 for t in encoded.token.values())
    return codec.bits * channels + params


@pytest.mark.parametrize(
    "codec, expected",
    [(LlamaCppKV("q8_0", 64), 8.5), (LlamaCppKV("q5_0", 64), 5.5), (LlamaCppKV("q5_1", 64), 6.0),
     (LlamaCppKV("q4_0", 64), 4.5), (LlamaCppKV("q4_1", 64), 5.0), (LlamaCppKV("iq4_nl", 64, "v"), 4.5),
     (HadamardInt(4, 64), 4.5), (HadamardInt(3, 64), 3.5), (HadamardInt(2, 64), 2.5), (HadamardInt(4, 128), 4.25),
     (TurboQuant(4, 64), 4.25), (TurboQuant(3, 64), 3.25), (TurboQuant(2, 64), 2.25), (TurboQuant(1, 128), 1.125)],
)
def test_bits_per_element_are_the_stored_bits(codec, expected):
    x = kv_like(tokens=8, heads=2, head_dim=codec.head_dim)
    encoded = codec.encode(x)
    assert bits_per_element(codec, x.shape[1]) == expected
    assert codec.row_bits(x.shape[1]) == stored_bits_per_row(codec, encoded)
    quantized = codec.quantize(x)
    assert torch.all(quantized.row_bits == expected * x.shape[1])
    assert int(encoded.codes.min()) >= 0 and int(encoded.codes.max()) < 2**codec.bits


# -------------------------------------------------------------------------------------- TurboQuant

MAX_1960 = {  # Lloyd-Max levels of N(0, 1), positive half (J. Max, 1960)
    2: [0.4528, 1.5104],
    3: [0.2451, 0.7560, 1.3440, 2.1520],
    4: [0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6180, 2.0690, 2.7326],
}


def gaussian_centroids(levels):
    """E[X | X in the cell of each level] under N(0, 1), cells bounded by the midpoints, with math.erf."""
    cdf = lambda t: 0.5 * (1 + math.erf(t / math.sqrt(2)))  # noqa: E731
    pdf = lambda t: math.exp(-t * t / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    edges = [-math.inf] + [(a + b) / 2 for a, b in zip(levels, levels[1:])] + [math.inf]
    return [(pdf(a) - pdf(b)) / (cdf(b) - cdf(a)) for a, b in zip(edges, edges[1:])]


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_turbo_codebook_is_symmetric_and_lloyd_max_optimal(bits):
    levels = lloyd_max_gaussian(bits)
    assert levels.dtype == torch.float64 and levels.numel() == 2**bits
    assert torch.equal(levels, -levels.flip(0)) and torch.all(levels[1:] > levels[:-1])
    centroids = gaussian_centroids(levels.tolist())
    assert max(abs(c - l) for c, l in zip(centroids, levels.tolist())) < 1e-5
    if bits == 1:
        assert abs(levels[1].item() - math.sqrt(2 / math.pi)) < 1e-9
    else:
        assert torch.allclose(levels[2 ** (bits - 1):], torch.tensor(MAX_1960[bits], dtype=torch.float64), atol=1e-3)
    assert torch.allclose(turbo_codebook(bits, 64), (levels / 8).float())


def test_turbo_stores_fp16_norms_and_decodes_zero_vectors_to_zero():
    codec = TurboQuant(3, 64, seed=1)
    x = kv_like(tokens=6)
    x[2, 64:] = 0
    encoded = codec.encode(x)
    norm = encoded.token["norm"]
    assert norm.dtype == torch.float16 and norm.shape == (6, 2)
    assert torch.equal(norm, torch.linalg.vector_norm(x.view(6, 2, 64), dim=2).half())
    decoded = codec.decode(encoded)
    assert torch.equal(decoded[2, 64:], torch.zeros(64))
    # decode = norm * codebook[code] in the rotated coordinates
    rotated = codec.rotation.rotate(decoded).view(6, 2, 64)
    expected = turbo_codebook(3, 64)[encoded.codes].view(6, 2, 64) * norm.float()[:, :, None]
    assert torch.allclose(rotated, expected, atol=1e-5)
    with pytest.raises(KvcalError, match="1 to 4 bits"):
        TurboQuant(5, 64)


# ------------------------------------------------------------------------------------- hadamard-int


def test_hadamard_int_is_min_max_per_token_head_of_the_rotated_values():
    codec = HadamardInt(3, 64, seed=2)
    x = kv_like(tokens=10)
    encoded = codec.encode(x)
    rotated = codec.rotation.rotate(x).view(10, 2, 64)
    lo, hi = rotated.amin(2), rotated.amax(2)
    assert torch.equal(encoded.token["zero"], lo.half())
    assert torch.equal(encoded.token["scale"], ((hi - lo) / 7).half())
    scale, zero = encoded.token["scale"].float()[:, :, None], encoded.token["zero"].float()[:, :, None]
    codes = torch.round((rotated - zero) / scale).clamp(0, 7)
    assert torch.equal(encoded.codes, codes.long().view(10, 128))
    assert torch.allclose(codec.decode(encoded), codec.rotation.unrotate((codes * scale + zero).view(10, 128)), atol=1e-5)
    with pytest.raises(KvcalError, match="2 to 8 bits"):
        HadamardInt(1, 64)


def mse(codec, x):
    return float((codec.quantize(x).values - x).square().mean())


def test_round_trip_error_decreases_with_bits():
    x = kv_like(tokens=64)
    ints = [mse(HadamardInt(b, 64), x) for b in (2, 3, 4, 5, 8)]
    turbos = [mse(TurboQuant(b, 64), x) for b in (1, 2, 3, 4)]
    assert ints == sorted(ints, reverse=True) and turbos == sorted(turbos, reverse=True)
    ggml = {t: mse(LlamaCppKV(t, 64), x) for t in LLAMA_CPP_TYPES}
    assert ggml["q4_0"] > ggml["q5_0"] > ggml["q8_0"] and ggml["q4_1"] > ggml["q5_1"] > ggml["q8_0"]
    assert ggml["iq4_nl"] < ggml["q4_0"]
    assert ints[2] < mse(TokenUniform(4, 64), x)  # the rotation pays off on outlier channels
