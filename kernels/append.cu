// Quantize-and-append: encode fp16 rows into the packed body of kvcal/runtime/store.py (PackedRows) in
// place, the same codes and parameters as the torch codecs of kvcal/quantizers.py. Every pointer is
// already offset to the first appended row; one launch serves a prefill (many rows) or a decode step (one).
// Arithmetic uses explicitly rounded intrinsics where torch rounds each operation, so that no fused
// multiply-add changes a code.
#include "common.cuh"

#define MAX_WIDTH 4096   // channels of one token row (kv_heads * head_dim)
#define MAX_GROUPS 1024  // per-token parameter groups of one row

__device__ __forceinline__ int code_levels(int layout) { return (1 << code_bits(layout)) - 1; }

// One packed word of a row: codes of channels word * per_word ..., LSB first; layout 5's eleventh
// code has 2 bits and is clamped to 3 (kvcal.packing).
template <typename CodeOf>
__device__ __forceinline__ unsigned pack_word(int word, int width, int layout, CodeOf code_of) {
    const int per_word = codes_per_word(layout), bits = code_bits(layout);
    unsigned packed = 0;
    for (int slot = 0; slot < per_word; ++slot) {
        const int channel = word * per_word + slot;
        if (channel >= width) break;
        const unsigned limit = (layout == 5 && slot == 10) ? 3u : (1u << bits) - 1u;
        packed |= min(code_of(channel), limit) << (slot * bits);
    }
    return packed;
}

// kvcal.quantizers._min_max_codes: round((x - zero) / max(scale, 2^-24)) clamped to [0, levels].
__device__ __forceinline__ unsigned min_max_code(float x, float scale, float zero, int levels) {
    const float q = rintf(__fdiv_rn(__fsub_rn(x, zero), fmaxf(scale, KVCAL_TINY_SCALE)));
    return (unsigned)fminf(fmaxf(q, 0.0f), (float)levels);
}

// Stored fp16 (scale, zero) of min-max quantization over [lo, hi].
__device__ __forceinline__ void min_max_params(float lo, float hi, int levels, half_bits* scale, half_bits* zero) {
    *scale = float_to_half(__fdiv_rn(__fsub_rn(hi, lo), (float)levels));
    *zero = float_to_half(lo);
}

// TokenUniform: grid = rows, one block per row. scale/zero (rows, groups).
extern "C" __global__ void append_token_uniform(const half_bits* __restrict__ x, int width, int layout, int group,
                                                unsigned* __restrict__ words, int words_per_row,
                                                half_bits* __restrict__ scale, half_bits* __restrict__ zero, int groups) {
    __shared__ float x_s[MAX_WIDTH];
    __shared__ float scale_s[MAX_GROUPS], zero_s[MAX_GROUPS];
    const long long row = blockIdx.x;
    const int levels = code_levels(layout);
    for (int c = threadIdx.x; c < width; c += blockDim.x) x_s[c] = half_to_float(x[row * width + c]);
    __syncthreads();
    for (int g = threadIdx.x; g < groups; g += blockDim.x) {
        float lo = KVCAL_INF, hi = -KVCAL_INF;
        for (int c = g * group; c < min((g + 1) * group, width); ++c) {
            lo = fminf(lo, x_s[c]);
            hi = fmaxf(hi, x_s[c]);
        }
        half_bits s, z;
        min_max_params(lo, hi, levels, &s, &z);
        scale[row * groups + g] = s;
        zero[row * groups + g] = z;
        scale_s[g] = half_to_float(s);
        zero_s[g] = half_to_float(z);
    }
    __syncthreads();
    for (int w = threadIdx.x; w < words_per_row; w += blockDim.x)
        words[row * words_per_row + w] = pack_word(w, width, layout, [&](int c) {
            return min_max_code(x_s[c], scale_s[c / group], zero_s[c / group], levels);
        });
}

// ChannelBlockUniform: grid = blocks of block_tokens rows. scale/zero (blocks, width).
extern "C" __global__ void append_channel_block(const half_bits* __restrict__ x, int width, int layout, int block_tokens,
                                                unsigned* __restrict__ words, int words_per_row,
                                                half_bits* __restrict__ scale, half_bits* __restrict__ zero) {
    __shared__ float scale_s[MAX_WIDTH], zero_s[MAX_WIDTH];
    const long long first = (long long)blockIdx.x * block_tokens;
    const int levels = code_levels(layout);
    for (int c = threadIdx.x; c < width; c += blockDim.x) {
        float lo = KVCAL_INF, hi = -KVCAL_INF;
        for (int r = 0; r < block_tokens; ++r) {
            const float v = half_to_float(x[(first + r) * width + c]);
            lo = fminf(lo, v);
            hi = fmaxf(hi, v);
        }
        half_bits s, z;
        min_max_params(lo, hi, levels, &s, &z);
        scale[blockIdx.x * (long long)width + c] = s;
        zero[blockIdx.x * (long long)width + c] = z;
        scale_s[c] = half_to_float(s);
        zero_s[c] = half_to_float(z);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < block_tokens * words_per_row; i += blockDim.x) {
        const long long row = first + i / words_per_row;
        words[row * words_per_row + i % words_per_row] = pack_word(i % words_per_row, width, layout, [&](int c) {
            return min_max_code(half_to_float(x[row * width + c]), scale_s[c], zero_s[c], levels);
        });
    }
}

// kvcal.quantizers.normalize: (x - (hi + lo) / 2) / max((hi - lo) / 2, 1e-8).
__device__ __forceinline__ float normalized(float x, float lo, float hi) {
    return __fdiv_rn(__fsub_rn(x, __fdiv_rn(__fadd_rn(hi, lo), 2.0f)), fmaxf(__fdiv_rn(__fsub_rn(hi, lo), 2.0f), KVCAL_MIN_HALF_RANGE));
}

// torch.quantile (linear interpolation) of sorted[0, n) at q.
__device__ __forceinline__ float quantile(const float* sorted, int n, float q) {
    const float rank = __fmul_rn(q, (float)(n - 1));
    const int below = (int)rank, above = (int)ceilf(rank);
    const float weight = __fsub_rn(rank, (float)below), a = sorted[below], b = sorted[above];
    return weight < 0.5f ? __fadd_rn(a, __fmul_rn(weight, __fsub_rn(b, a))) : __fsub_rn(b, __fmul_rn(__fsub_rn(b, a), __fsub_rn(1.0f, weight)));
}

// The thresholds of a row: per channel (channel_lo/hi given) or this token's (stored fp16, read back).
struct Thresholds {
    const float* channel_lo;
    const float* channel_hi;
    float token_lo, token_hi;
    __device__ __forceinline__ float lo(int c) const { return channel_lo ? channel_lo[c] : token_lo; }
    __device__ __forceinline__ float hi(int c) const { return channel_hi ? channel_hi[c] : token_hi; }
};

// CodebookCodec, phase 1: grid = rows. Thresholds per channel (channel_lo/hi, float32) or, when those are
// null, per token: the q_low/q_high quantiles of the row (min/max when keep_outliers is 0), stored fp16 in
// token_lo/hi (rows). Codes: the nearest codebook entry of clamp(normalized, -1, 1), by counting the
// codebook's midpoints below it. outlier_counts[row] = elements with |normalized| > 1 (when keep_outliers).
extern "C" __global__ void append_codebook(const half_bits* __restrict__ x, int width, int layout,
                                           const float* __restrict__ channel_lo, const float* __restrict__ channel_hi,
                                           float q_low, float q_high, int keep_outliers, const float* __restrict__ midpoints,
                                           unsigned* __restrict__ words, int words_per_row, half_bits* __restrict__ token_lo,
                                           half_bits* __restrict__ token_hi, int* __restrict__ outlier_counts) {
    __shared__ float x_s[MAX_WIDTH];
    __shared__ float sorted_s[MAX_WIDTH];
    __shared__ float mid_s[16];
    __shared__ float bounds_s[2];
    __shared__ int outliers_s;
    const long long row = blockIdx.x;
    const int entries = 1 << code_bits(layout);
    for (int c = threadIdx.x; c < width; c += blockDim.x) x_s[c] = half_to_float(x[row * width + c]);
    for (int i = threadIdx.x; i < entries - 1; i += blockDim.x) mid_s[i] = midpoints[i];
    if (threadIdx.x == 0) outliers_s = 0;
    if (channel_lo == nullptr) {  // per-token thresholds: bitonic sort of the row, padded with +inf
        int padded = 1;
        while (padded < width) padded <<= 1;
        for (int c = threadIdx.x; c < padded; c += blockDim.x) sorted_s[c] = c < width ? half_to_float(x[row * width + c]) : KVCAL_INF;
        __syncthreads();
        for (int k = 2; k <= padded; k <<= 1) {
            for (int j = k >> 1; j > 0; j >>= 1) {
                for (int i = threadIdx.x; i < padded; i += blockDim.x) {
                    const int partner = i ^ j;
                    if (partner > i) {
                        const float a = sorted_s[i], b = sorted_s[partner];
                        if ((a > b) == ((i & k) == 0)) {
                            sorted_s[i] = b;
                            sorted_s[partner] = a;
                        }
                    }
                }
                __syncthreads();
            }
        }
        if (threadIdx.x == 0) {
            const float lo = keep_outliers ? quantile(sorted_s, width, q_low) : sorted_s[0];
            const float hi = keep_outliers ? quantile(sorted_s, width, q_high) : sorted_s[width - 1];
            token_lo[row] = float_to_half(lo);
            token_hi[row] = float_to_half(hi);
            bounds_s[0] = half_to_float(token_lo[row]);
            bounds_s[1] = half_to_float(token_hi[row]);
        }
    }
    __syncthreads();
    const Thresholds t = {channel_lo, channel_hi, bounds_s[0], bounds_s[1]};
    int outliers = 0;
    for (int w = threadIdx.x; w < words_per_row; w += blockDim.x)
        words[row * words_per_row + w] = pack_word(w, width, layout, [&](int c) {
            const float v = normalized(x_s[c], t.lo(c), t.hi(c));
            outliers += keep_outliers && fabsf(v) > 1.0f;
            const float clamped = fminf(fmaxf(v, -1.0f), 1.0f);
            unsigned code = 0;
            for (int i = 0; i < entries - 1; ++i) code += mid_s[i] < clamped;
            return code;
        });
    atomicAdd(&outliers_s, outliers);
    __syncthreads();
    if (threadIdx.x == 0) outlier_counts[row] = outliers_s;
}

// CodebookCodec, phase 2: grid = rows, one warp each. Writes each row's outliers (body row, channel, exact
// fp16 value) in channel order from offsets[row] (the exclusive prefix sum of phase 1's counts), so the
// outlier list stays sorted by row as the decode kernel's binary search needs.
extern "C" __global__ void append_codebook_outliers(const half_bits* __restrict__ x, int width,
                                                    const float* __restrict__ channel_lo, const float* __restrict__ channel_hi,
                                                    const half_bits* __restrict__ token_lo, const half_bits* __restrict__ token_hi,
                                                    const int* __restrict__ offsets, int first_body_row,
                                                    int* __restrict__ outlier_rows, short* __restrict__ outlier_channels,
                                                    half_bits* __restrict__ outlier_values) {
    const long long row = blockIdx.x;
    const int lane = threadIdx.x;
    const Thresholds t = {channel_lo, channel_hi, channel_lo ? 0.0f : half_to_float(token_lo[row]),
                          channel_lo ? 0.0f : half_to_float(token_hi[row])};
    int written = offsets[row];
    for (int base = 0; base < width; base += 32) {
        const int c = base + lane;
        const bool outlier = c < width && fabsf(normalized(half_to_float(x[row * width + c]), t.lo(c), t.hi(c))) > 1.0f;
        const unsigned ballot = __ballot_sync(0xffffffffu, outlier);
        if (outlier) {
            const int at = written + __popc(ballot & ((1u << lane) - 1u));
            outlier_rows[at] = first_body_row + (int)row;
            outlier_channels[at] = (short)c;
            outlier_values[at] = x[row * width + c];
        }
        written += __popc(ballot);
    }
}
