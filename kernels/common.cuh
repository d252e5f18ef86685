// Shared device code of the kvcal kernels: fp16 conversion, the packed code layouts of kvcal/packing.py,
// the codecs of kvcal/quantizers.py (decode side), and RoPE angles. No CUDA headers are needed, so NVRTC
// compiles these files as they are.
#pragma once

#define KVCAL_INF __int_as_float(0x7f800000)
#define KVCAL_TINY_SCALE 5.9604644775390625e-8f  // 2^-24, the smallest positive fp16 (kvcal.quantizers.TINY_SCALE)
#define KVCAL_FP16_MAX 65504.0f
#define KVCAL_FP8_MAX 448.0f  // the largest finite fp8 e4m3 (torch.float8_e4m3fn)
#define KVCAL_MIN_HALF_RANGE 1e-8f  // kvcal.quantizers.denormalize clamps (hi - lo) / 2 to this

typedef unsigned short half_bits;  // fp16 as stored by torch (IEEE binary16)

// Codecs of a packed body, as kvcal.runtime.kernels numbers them.
enum Codec {
    FP16_ONLY = 0,         // no packed body (every token in fp16 segments)
    UNIFORM_TOKEN = 1,     // TokenUniform: fp16 scale/zero per (token, group of channels)
    UNIFORM_CHANNEL = 2,   // ChannelBlockUniform: fp16 scale/zero per (block of tokens, channel)
    CODEBOOK_CHANNEL = 3,  // CodebookCodec with fixed per-channel thresholds (float32 lo/hi)
    CODEBOOK_TOKEN = 4,    // CodebookCodec with per-token fp16 thresholds
    PERMUTED_GROUPS = 5,   // SKVQ: codes in channel order, fp16 or fp8 scale/zero per (token, group of permuted channels)
};

// fp16 <-> float: PTX conversions; a host build of the kernels (tests/kernel_emulation) brings its own.
#ifndef KVCAL_HOST_EMULATION
__device__ __forceinline__ float half_to_float(half_bits h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ half_bits round_to_half(float f) {
    half_bits h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#endif

// store_as(x, float16): saturate at the largest finite fp16, round to nearest even.
__device__ __forceinline__ half_bits float_to_half(float f) {
    return round_to_half(fminf(fmaxf(f, -KVCAL_FP16_MAX), KVCAL_FP16_MAX));
}

__device__ __forceinline__ float load_half(const half_bits* p) { return half_to_float(__ldg(p)); }

// Layouts of kvcal/packing.py, numbered as kvcal.runtime.kernels does: "lsb" by its code width (32, 16 or 8
// codes per word), "planes3" (exactly 3 bits per code) and "kvmix10x3+1x2" (ten 3-bit codes and an eleventh
// 2-bit code at bit 30: the unsigned shift leaves exactly its 2 bits). Rows are packed in units: one word, or
// for planes3 32 codes in 3 words.
enum Layout { LSB1 = 1, LSB2 = 2, PLANES3 = 3, LSB4 = 4, KVMIX3 = 5 };

template <int BITS, int PER_WORD>
__device__ __forceinline__ unsigned lsb_code(const unsigned* row, int channel) {
    unsigned word = __ldg(row + channel / PER_WORD);
    return (word >> ((channel % PER_WORD) * BITS)) & ((1u << BITS) - 1u);
}

// planes3: code i's low 2 bits in word 3 * (i >> 5) + ((i >> 4) & 1) at bit 2 * (i & 15), its high bit in word
// 3 * (i >> 5) + 2 at bit i & 31. Shifts and masks only: no division by 3.
__device__ __forceinline__ unsigned planes3_code(const unsigned* row, int channel) {
    const unsigned* unit = row + (channel >> 5) * 3;
    const int i = channel & 31;
    const unsigned low = (__ldg(unit + (i >> 4)) >> ((i & 15) * 2)) & 3u;
    return low | (((__ldg(unit + 2) >> i) & 1u) << 2);
}

template <int LAYOUT>
__device__ __forceinline__ unsigned code_in(const unsigned* row, int channel) {
    if (LAYOUT == LSB1) return lsb_code<1, 32>(row, channel);
    if (LAYOUT == LSB2) return lsb_code<2, 16>(row, channel);
    if (LAYOUT == PLANES3) return planes3_code(row, channel);
    if (LAYOUT == LSB4) return lsb_code<4, 8>(row, channel);
    return lsb_code<3, 11>(row, channel);
}

__device__ __forceinline__ int codes_per_unit(int layout) {
    switch (layout) {
        case LSB1: return 32;
        case LSB2: return 16;
        case PLANES3: return 32;
        case LSB4: return 8;
        default: return 11;
    }
}

__device__ __forceinline__ int words_per_unit(int layout) { return layout == PLANES3 ? 3 : 1; }

__device__ __forceinline__ int code_bits(int layout) { return layout == KVMIX3 ? 3 : layout; }

// kvcal.quantizers: min-max decode.
__device__ __forceinline__ float min_max_value(unsigned code, float scale, float zero) {
    return (float)code * fmaxf(scale, KVCAL_TINY_SCALE) + zero;
}

// fp8 e4m3 (torch.float8_e4m3fn) -> float, exact: bias 7, subnormals m * 2^-9 (its NaN, which kvcal never stores,
// reads as 480).
__device__ __forceinline__ float e4m3_to_float(unsigned char v) {
    const int exponent = (v >> 3) & 15, mantissa = v & 7;
    const float magnitude = exponent ? __int_as_float(((exponent + 120) << 23) | (mantissa << 20)) : (float)mantissa * 0.001953125f;
    return v & 0x80 ? -magnitude : magnitude;
}

// store_as(x, float8_e4m3fn): saturate at the largest finite e4m3, round to nearest even. Subnormals are m 2^-9, and
// m = 8 is the bit pattern of the least normal, 2^-6, so a subnormal rounding up carries into the exponent as it should.
__device__ __forceinline__ unsigned char float_to_e4m3(float f) {
    const float a = fminf(fabsf(f), KVCAL_FP8_MAX);
    const unsigned sign = (__float_as_uint(f) >> 24) & 0x80u;
    if (a < 0.015625f) return (unsigned char)(sign | (unsigned)rintf(__fmul_rn(a, 512.0f)));
    const int exponent = (int)(__float_as_uint(a) >> 23) - 127;  // floor(log2 a), -6 .. 8
    // a / 2^(exponent - 3), exact, in [8, 16): the implicit bit and 3 mantissa bits; 16 carries into the exponent
    const unsigned steps = (unsigned)rintf(__fmul_rn(a, __int_as_float((130 - exponent) << 23)));
    return (unsigned char)(sign | (((unsigned)(exponent + 7) << 3) + steps - 8u));
}

// cos and sin of angle = float(position) * inv_freq (rounded to float32 as torch computes it). The angle
// is reduced modulo 2 pi in double first: fast sin/cos are only accurate near zero, and positions reach
// the hundreds of thousands.
__device__ __forceinline__ void rope_cos_sin(int position, float inv_freq, float* cos_out, float* sin_out) {
    const double two_pi = 6.283185307179586476925287;
    double angle = (double)__fmul_rn((float)position, inv_freq);
    float reduced = (float)(angle - rint(angle / two_pi) * two_pi);
    __sincosf(reduced, sin_out, cos_out);
}

// A soft-capped score, cap tanh(s / cap) for cap > 0 (Gemma 2: kvcal.kv.softcapped; s and cap both in log2 units,
// which leaves s / cap as it is), through e = exp(-2 |s| / cap): within a few ulps of the cap, with no tanh to call.
__device__ __forceinline__ float soft_capped(float s, float cap) {
    const float e = exp2f(-2.8853900817779268f * fabsf(s) / cap);  // 2 log2(e)
    return copysignf(cap * ((1.0f - e) / (1.0f + e)), s);
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int offset = 16; offset; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
    return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int offset = 16; offset; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}
