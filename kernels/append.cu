// Quantize-and-append: encode fp16 rows into the packed body of kvcal/runtime/store.py (PackedRows) in
// place, the same codes and parameters as the torch codecs of kvcal/quantizers.py. One launch serves a prefill
// (many rows) or a decode step (one per sequence); the per-token codecs write each row straight into its sequence's
// rows (RowTarget), per-channel blocks into a staging area the host scatters.
// Arithmetic uses explicitly rounded intrinsics where torch rounds each operation, so that no fused
// multiply-add changes a code.
#include "common.cuh"

#define MAX_WIDTH 4096   // channels of one token row (kv_heads * head_dim)
#define MAX_GROUPS 1024  // per-token parameter groups of one row

__device__ __forceinline__ int code_levels(int layout) { return (1 << code_bits(layout)) - 1; }

// One packing unit of a row (kvcal.packing): codes of channels unit * codes_per_unit(layout) ..., written to
// out[0 .. words_per_unit(layout)). One-word layouts fill LSB first (layout 5's eleventh code has 2 bits and is
// clamped to 3); planes3 puts the low 2 bits of codes 0-15 and 16-31 in words 0 and 1, their high bits in word 2.
// Each code is computed once (code_of may count outliers).
template <typename CodeOf>
__device__ __forceinline__ void pack_unit(int unit, int width, int layout, CodeOf code_of, unsigned* out) {
    const int per_unit = codes_per_unit(layout), bits = code_bits(layout);
    if (layout == PLANES3) {
        unsigned low0 = 0u, low1 = 0u, high = 0u;  // not an array: indexing one by i >> 4 puts it on the stack
        for (int i = 0; i < per_unit; ++i) {
            const int channel = unit * per_unit + i;
            if (channel >= width) break;
            const unsigned code = code_of(channel), low_bits = (code & 3u) << ((i & 15) * 2);
            if (i < 16) low0 |= low_bits; else low1 |= low_bits;
            high |= (code >> 2) << i;
        }
        out[0] = low0;
        out[1] = low1;
        out[2] = high;
        return;
    }
    unsigned packed = 0;
    for (int slot = 0; slot < per_unit; ++slot) {
        const int channel = unit * per_unit + slot;
        if (channel >= width) break;
        const unsigned limit = (layout == KVMIX3 && slot == 10) ? 3u : (1u << bits) - 1u;
        packed |= min(code_of(channel), limit) << (slot * bits);
    }
    out[0] = packed;
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

// Where row `row` of a launch is stored: row row_in_sequence[row] of sequence sequence_of_row[row] of the store's
// buffers. Its code words in pieces of piece_words (kvcal.runtime.store.PackedRows: one a KV head, or one a row),
// word w at sequence * words_sequence + row * words_row + (w / piece_words) * piece_stride + w % piece_words; its
// per-token parameters at sequence * param_sequence + row * param_row + column * param_column elements
// (kvcal.runtime.store keeps them along the tokens).
struct RowTarget {
    const long long* sequence_of_row;
    const long long* row_in_sequence;
    long long words_sequence, words_row, piece_stride;
    int piece_words;
    long long param_sequence, param_row, param_column;
    __device__ __forceinline__ long long word(long long row, int w) const {
        return sequence_of_row[row] * words_sequence + row_in_sequence[row] * words_row + (w / piece_words) * piece_stride +
               w % piece_words;
    }
    __device__ __forceinline__ long long parameter(long long row, int column) const {
        return sequence_of_row[row] * param_sequence + row_in_sequence[row] * param_row + column * param_column;
    }
};

// The smallest and largest of value(i), i in [begin, end).
template <typename Value>
__device__ __forceinline__ void min_max_over(int begin, int end, Value value, float* lo, float* hi) {
    *lo = KVCAL_INF, *hi = -KVCAL_INF;
    for (int i = begin; i < end; ++i) {
        const float v = value(i);
        *lo = fminf(*lo, v);
        *hi = fmaxf(*hi, v);
    }
}

// A stored parameter as a float: fp16, or SKVQ --fp8's e4m3.
__device__ __forceinline__ float stored_value(half_bits h) { return half_to_float(h); }
__device__ __forceinline__ float stored_value(unsigned char v) { return e4m3_to_float(v); }

// One block per row, whose parameters come per group of channels: the row into shared memory, then each group's
// stored (scale, zero) (fp16 half_bits or fp8 e4m3 bytes) from params_of(g, x_s, &scale, &zero), then each channel's
// code from code_of(c, x_s, scale_s, zero_s) given the groups' stored values as floats, in place (to).
template <typename Param, typename ParamsOf, typename CodeOf>
__device__ __forceinline__ void append_grouped_row(const half_bits* __restrict__ x, int width, int layout, int groups,
                                                   const RowTarget& to, unsigned* __restrict__ words, int words_per_row,
                                                   Param* __restrict__ scale, Param* __restrict__ zero, ParamsOf params_of,
                                                   CodeOf code_of) {
    __shared__ float x_s[MAX_WIDTH];
    __shared__ float scale_s[MAX_GROUPS], zero_s[MAX_GROUPS];
    const long long row = blockIdx.x;
    for (int c = threadIdx.x; c < width; c += blockDim.x) x_s[c] = half_to_float(x[row * width + c]);
    __syncthreads();
    for (int g = threadIdx.x; g < groups; g += blockDim.x) {
        Param s, z;
        params_of(g, x_s, &s, &z);
        scale[to.parameter(row, g)] = s;
        zero[to.parameter(row, g)] = z;
        scale_s[g] = stored_value(s);
        zero_s[g] = stored_value(z);
    }
    __syncthreads();
    const int units = words_per_row / words_per_unit(layout);  // (a packing unit never spans two pieces)
    for (int u = threadIdx.x; u < units; u += blockDim.x)
        pack_unit(u, width, layout, [&](int c) { return code_of(c, x_s, scale_s, zero_s); },
                  words + to.word(row, u * words_per_unit(layout)));
}

// TokenUniform: grid = rows, groups of `group` consecutive channels.
extern "C" __global__ void append_token_uniform(const half_bits* __restrict__ x, int width, int layout, int group,
                                                const long long* __restrict__ sequence_of_row,
                                                const long long* __restrict__ row_in_sequence,
                                                long long words_sequence, long long words_row, long long piece_stride,
                                                int piece_words, long long param_sequence, long long param_row,
                                                long long param_column,
                                                unsigned* __restrict__ words, int words_per_row,
                                                half_bits* __restrict__ scale, half_bits* __restrict__ zero, int groups) {
    const int levels = code_levels(layout);
    const RowTarget to = {sequence_of_row, row_in_sequence, words_sequence, words_row, piece_stride, piece_words,
                          param_sequence, param_row, param_column};
    append_grouped_row(x, width, layout, groups, to, words, words_per_row, scale, zero,
        [&](int g, const float* x_s, half_bits* s, half_bits* z) {
            float lo, hi;
            min_max_over(g * group, min((g + 1) * group, width), [&](int c) { return x_s[c]; }, &lo, &hi);
            min_max_params(lo, hi, levels, s, z);
        },
        [&](int c, const float* x_s, const float* scale_s, const float* zero_s) {
            return min_max_code(x_s[c], scale_s[c / group], zero_s[c / group], levels);
        });
}

// SKVQ's permuted groups (kvcal.fit.skvq.SkvqTensor): grid = rows. Group g is the channels
// permutation[starts[g] .. starts[g + 1]); its range, clipped by clip[g], gives clipped_params' scale and zero, stored
// as fp16 (Param half_bits, largest value KVCAL_FP16_MAX) or fp8 e4m3 (unsigned char, KVCAL_FP8_MAX): the zero in units
// of the scale, the scale at least |low| / (largest / 2) so that the zero fits the type; codes in channel order
// (group_of_channel: each channel's group).
template <typename Param>
__device__ __forceinline__ void append_permuted(const half_bits* __restrict__ x, int width, int layout,
                                                const int* __restrict__ permutation, const int* __restrict__ starts,
                                                const float* __restrict__ clip, const int* __restrict__ group_of_channel,
                                                const RowTarget& to, unsigned* __restrict__ words, int words_per_row,
                                                Param* __restrict__ scale, Param* __restrict__ zero, int groups) {
    constexpr float largest = sizeof(Param) == 1 ? KVCAL_FP8_MAX : KVCAL_FP16_MAX;
    const int levels = code_levels(layout);
    const auto stored = [](float f) {
        if constexpr (sizeof(Param) == 1) return float_to_e4m3(f);
        else return float_to_half(f);
    };
    append_grouped_row(x, width, layout, groups, to, words, words_per_row, scale, zero,
        [&](int g, const float* x_s, Param* s, Param* z) {
            float lo, hi;
            min_max_over(starts[g], starts[g + 1], [&](int i) { return x_s[permutation[i]]; }, &lo, &hi);
            const float low = __fmul_rn(clip[g], lo), high = __fmul_rn(clip[g], hi);
            const float zero_fits = __fdiv_rn(fabsf(low), largest / 2.0f);
            *s = stored(fmaxf(fmaxf(__fdiv_rn(__fsub_rn(high, low), (float)levels), zero_fits), KVCAL_TINY_SCALE));
            *z = stored(__fdiv_rn(low, fmaxf(stored_value(*s), KVCAL_TINY_SCALE)));
        },
        [&](int c, const float* x_s, const float* scale_s, const float* zero_s) {
            const int g = group_of_channel[c];
            const float q = rintf(__fsub_rn(__fdiv_rn(x_s[c], fmaxf(scale_s[g], KVCAL_TINY_SCALE)), zero_s[g]));
            return (unsigned)fminf(fmaxf(q, 0.0f), (float)levels);
        });
}

extern "C" __global__ void append_permuted_groups(const half_bits* __restrict__ x, int width, int layout,
                                                  const int* __restrict__ permutation, const int* __restrict__ starts,
                                                  const float* __restrict__ clip, const int* __restrict__ group_of_channel,
                                                  const long long* __restrict__ sequence_of_row,
                                                  const long long* __restrict__ row_in_sequence,
                                                  long long words_sequence, long long words_row, long long piece_stride,
                                                  int piece_words, long long param_sequence, long long param_row,
                                                  long long param_column,
                                                  unsigned* __restrict__ words, int words_per_row,
                                                  half_bits* __restrict__ scale, half_bits* __restrict__ zero, int groups) {
    const RowTarget to = {sequence_of_row, row_in_sequence, words_sequence, words_row, piece_stride, piece_words,
                          param_sequence, param_row, param_column};
    append_permuted(x, width, layout, permutation, starts, clip, group_of_channel, to, words, words_per_row, scale, zero, groups);
}

extern "C" __global__ void append_permuted_groups_fp8(const half_bits* __restrict__ x, int width, int layout,
                                                      const int* __restrict__ permutation, const int* __restrict__ starts,
                                                      const float* __restrict__ clip, const int* __restrict__ group_of_channel,
                                                      const long long* __restrict__ sequence_of_row,
                                                      const long long* __restrict__ row_in_sequence,
                                                      long long words_sequence, long long words_row, long long piece_stride,
                                                      int piece_words, long long param_sequence, long long param_row,
                                                      long long param_column,
                                                      unsigned* __restrict__ words, int words_per_row,
                                                      unsigned char* __restrict__ scale, unsigned char* __restrict__ zero,
                                                      int groups) {
    const RowTarget to = {sequence_of_row, row_in_sequence, words_sequence, words_row, piece_stride, piece_words,
                          param_sequence, param_row, param_column};
    append_permuted(x, width, layout, permutation, starts, clip, group_of_channel, to, words, words_per_row, scale, zero, groups);
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
    const int units = words_per_row / words_per_unit(layout);
    for (int i = threadIdx.x; i < block_tokens * units; i += blockDim.x) {
        const long long row = first + i / units;
        pack_unit(i % units, width, layout, [&](int c) {
            return min_max_code(half_to_float(x[row * width + c]), scale_s[c], zero_s[c], levels);
        }, words + row * words_per_row + (i % units) * words_per_unit(layout));
    }
}

// kvcal.quantizers.normalize: (x - (hi + lo) / 2) / max((hi - lo) / 2, 1e-8).
__device__ __forceinline__ float normalized(float x, float lo, float hi) {
    return __fdiv_rn(__fsub_rn(x, __fdiv_rn(__fadd_rn(hi, lo), 2.0f)), fmaxf(__fdiv_rn(__fsub_rn(hi, lo), 2.0f), KVCAL_MIN_HALF_RANGE));
}

// torch.quantile (linear interpolation) of sorted[0, n) at q: ATen's lerp, one fused multiply-add (vec::fmadd).
__device__ __forceinline__ float quantile(const float* sorted, int n, float q) {
    const float rank = __fmul_rn(q, (float)(n - 1));
    const int below = (int)rank, above = (int)ceilf(rank);
    const float weight = __fsub_rn(rank, (float)below), a = sorted[below], b = sorted[above];
    return weight < 0.5f ? __fmaf_rn(weight, __fsub_rn(b, a), a) : __fmaf_rn(__fsub_rn(weight, 1.0f), __fsub_rn(b, a), b);
}

// The thresholds of a row: per channel (channel_lo/hi given) or this token's (stored fp16, read back).
struct Thresholds {
    const float* channel_lo;
    const float* channel_hi;
    float token_lo, token_hi;
    __device__ __forceinline__ float lo(int c) const { return channel_lo ? channel_lo[c] : token_lo; }
    __device__ __forceinline__ float hi(int c) const { return channel_hi ? channel_hi[c] : token_hi; }
};

// CodebookCodec, a decode step's outliers (each row the only row of its sequence in the append), one warp (lane):
// row `row`'s outliers of KV head h go, in channel order, at the device count of run (sequence_of_row[row], h)
// (run_counts, [sequence][head]) on, and the count grows by as many; a row that starts an outlier tile
// (row_in_sequence % tile_tokens == 0) writes the count it found as the tile's offset (tile_offsets, [sequence][head]
// runs of tiles_per_run). Nothing is placed by the host, so a decode step's codes and outliers cost one launch.
__device__ __forceinline__ void place_step_outliers(long long row, int lane, const half_bits* x, int width, int head_dim,
                                                    int tile_tokens, const Thresholds& t, const long long* sequence_of_row,
                                                    const long long* row_in_sequence, int* run_counts, int* tile_offsets,
                                                    int tiles_per_run, int outlier_stride, unsigned short* positions,
                                                    half_bits* values) {
    const int heads = width / head_dim, row_of_sequence = (int)row_in_sequence[row];
    const bool starts_tile = row_of_sequence % tile_tokens == 0;
    const int first_position = (row_of_sequence % tile_tokens) * head_dim;
    for (int head = 0; head < heads; ++head) {
        const long long run = sequence_of_row[row] * heads + head;
        const int before = run_counts[run];
        int written = 0;  // the row's outliers of this head so far
        for (int base = 0; base < head_dim; base += 32) {
            const int c = head * head_dim + base + lane;
            const bool outlier =
                base + lane < head_dim && fabsf(normalized(half_to_float(x[row * width + c]), t.lo(c), t.hi(c))) > 1.0f;
            const unsigned ballot = __ballot_sync(0xffffffffu, outlier);
            if (outlier) {
                const long long at = run * outlier_stride + before + written + __popc(ballot & ((1u << lane) - 1u));
                positions[at] = (unsigned short)(first_position + base + lane);
                values[at] = x[row * width + c];
            }
            written += __popc(ballot);
        }
        __syncwarp();  // every lane read the count before lane 0 replaces it
        if (lane == 0) {
            run_counts[run] = before + written;
            if (starts_tile) tile_offsets[run * tiles_per_run + row_of_sequence / tile_tokens] = before;
        }
    }
}

// CodebookCodec, phase 1: grid = rows. Thresholds per channel (channel_lo/hi, float32) or, when those are
// null, per token: the q_low/q_high quantiles of the row (min/max when keep_outliers is 0), stored fp16 in
// token_lo/hi. Codes: the nearest codebook entry of clamp(normalized, -1, 1), by counting the codebook's midpoints
// below it. Words and thresholds in place (RowTarget). outlier_counts (rows, width / head_dim), zeroed by the caller,
// gets the elements with |normalized| > 1 per (row, KV head) (null: not counted). In a decode step (run_counts not
// null) the block's first warp then places the row's outliers itself (place_step_outliers, with tile_tokens ..
// values).
extern "C" __global__ void append_codebook(const half_bits* __restrict__ x, int width, int head_dim, int layout,
                                           const float* __restrict__ channel_lo, const float* __restrict__ channel_hi,
                                           float q_low, float q_high, int keep_outliers, const float* __restrict__ midpoints,
                                           const long long* __restrict__ sequence_of_row,
                                           const long long* __restrict__ row_in_sequence,
                                           long long words_sequence, long long words_row, long long piece_stride,
                                           int piece_words, long long param_sequence, long long param_row,
                                           unsigned* __restrict__ words, int words_per_row, half_bits* __restrict__ token_lo,
                                           half_bits* __restrict__ token_hi, int* __restrict__ outlier_counts, int tile_tokens,
                                           int* __restrict__ run_counts, int* __restrict__ tile_offsets, int tiles_per_run,
                                           int outlier_stride, unsigned short* __restrict__ positions,
                                           half_bits* __restrict__ values) {
    __shared__ float x_s[MAX_WIDTH];
    __shared__ float sorted_s[MAX_WIDTH];
    __shared__ float mid_s[16];
    __shared__ float bounds_s[2];
    const long long row = blockIdx.x;
    const RowTarget to = {sequence_of_row, row_in_sequence, words_sequence, words_row, piece_stride, piece_words,
                          param_sequence, param_row, 0};
    const int entries = 1 << code_bits(layout);
    for (int c = threadIdx.x; c < width; c += blockDim.x) x_s[c] = half_to_float(x[row * width + c]);
    for (int i = threadIdx.x; i < entries - 1; i += blockDim.x) mid_s[i] = midpoints[i];
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
            const long long at = to.parameter(row, 0);
            token_lo[at] = float_to_half(lo);
            token_hi[at] = float_to_half(hi);
            bounds_s[0] = half_to_float(token_lo[at]);
            bounds_s[1] = half_to_float(token_hi[at]);
        }
    }
    __syncthreads();
    const Thresholds t = {channel_lo, channel_hi, bounds_s[0], bounds_s[1]};
    int* const head_counts = outlier_counts ? outlier_counts + row * (width / head_dim) : nullptr;
    const int units = words_per_row / words_per_unit(layout);
    for (int u = threadIdx.x; u < units; u += blockDim.x)
        pack_unit(u, width, layout, [&](int c) {
            const float v = normalized(x_s[c], t.lo(c), t.hi(c));
            if (head_counts && fabsf(v) > 1.0f) atomicAdd(head_counts + c / head_dim, 1);
            const float clamped = fminf(fmaxf(v, -1.0f), 1.0f);
            unsigned code = 0;
            for (int i = 0; i < entries - 1; ++i) code += mid_s[i] < clamped;
            return code;
        }, words + to.word(row, u * words_per_unit(layout)));
    if (run_counts != nullptr && threadIdx.x < 32)
        place_step_outliers(row, threadIdx.x, x, width, head_dim, tile_tokens, t, sequence_of_row, row_in_sequence, run_counts,
                            tile_offsets, tiles_per_run, outlier_stride, positions, values);
}

// The thresholds of launch row `row`: per channel, or its token's, read where append_codebook stored them (to).
__device__ __forceinline__ Thresholds row_thresholds(const float* channel_lo, const float* channel_hi, const half_bits* token_lo,
                                                     const half_bits* token_hi, const RowTarget& to, long long row) {
    if (channel_lo) return {channel_lo, channel_hi, 0.0f, 0.0f};
    const long long at = to.parameter(row, 0);
    return {nullptr, nullptr, half_to_float(token_lo[at]), half_to_float(token_hi[at])};
}

// CodebookCodec, phase 2: grid = rows, one warp each (per-token thresholds read in place). Writes each row's
// outliers into the store's outlier layout (kvcal/packing.py): in the run of (sequence_of_row[row], KV head), at
// first_slot[row, head] plus the outlier's rank among the row's outliers (first_slot is where the row's outliers
// of that head start, less the row's outliers of earlier heads), its uint16 position in its tile of tile_tokens
// body rows and its exact fp16 value. Channel order within a row, rows in append order: each run stays in append
// order.
extern "C" __global__ void append_codebook_outliers(const half_bits* __restrict__ x, int width, int head_dim, int tile_tokens,
                                                    const float* __restrict__ channel_lo, const float* __restrict__ channel_hi,
                                                    const half_bits* __restrict__ token_lo, const half_bits* __restrict__ token_hi,
                                                    const long long* __restrict__ sequence_of_row,
                                                    const long long* __restrict__ row_in_sequence, long long param_sequence,
                                                    long long param_row, const int* __restrict__ first_slot, int outlier_stride,
                                                    unsigned short* __restrict__ positions, half_bits* __restrict__ values) {
    const long long row = blockIdx.x;
    const int lane = threadIdx.x, heads = width / head_dim;
    const Thresholds t = row_thresholds(channel_lo, channel_hi, token_lo, token_hi,
                                        {sequence_of_row, row_in_sequence, 0, 0, 0, 1, param_sequence, param_row, 0}, row);
    const long long first_run = sequence_of_row[row] * heads;
    const int first_position = (int)(row_in_sequence[row] % tile_tokens) * head_dim;
    int written = 0;  // the row's outliers so far, every head
    for (int base = 0; base < width; base += 32) {
        const int c = base + lane;
        const bool outlier = c < width && fabsf(normalized(half_to_float(x[row * width + c]), t.lo(c), t.hi(c))) > 1.0f;
        const unsigned ballot = __ballot_sync(0xffffffffu, outlier);
        if (outlier) {
            const int head = c / head_dim;
            const long long at = (first_run + head) * outlier_stride + first_slot[row * heads + head] + written +
                                 __popc(ballot & ((1u << lane) - 1u));
            positions[at] = (unsigned short)(first_position + c - head * head_dim);
            values[at] = x[row * width + c];
        }
        written += __popc(ballot);
    }
}
