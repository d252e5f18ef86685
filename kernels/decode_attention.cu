// Fused decode attention over the quantized cache (one query token per sequence), split over the sequence
// with a log-sum-exp merge. The specification is kvcal/runtime/reference.py on the stores of
// kvcal/runtime/store.py and kvcal/runtime/segments.py; kvcal/runtime/kernels.py launches these.
//
// A launch covers, for every sequence b, tokens t = 0 .. n_b - 1 in position order. K and V each map t to
// their own segments (sink fp16 | packed body | recent fp16, with their own lengths: a KIVI residual or a
// KVmix RPC differs between K and V). Cocktail's chunk groups of different widths are separate launches
// writing separate split slots of the same partial buffers, merged once. A launch may leave out body rows
// 0 .. skip - 1 of both sides (meta's M_SKIP: the tensor-core kernel serves them into other split slots,
// kvcal.runtime.tensor_core): its tokens are then the sinks and what follows those rows, t -> t + skip past the sinks.
//
// Block = (split, KV head, sequence), 4 warps; it serves all `group` query heads of its KV head, so K/V
// bytes are read once per KV head. A warp takes tiles of 32 tokens: keys one token per lane (its full
// dot products with every query head, RoPE applied on the fly to pre-RoPE keys), online softmax in the
// log2 domain (log2(e) folded into the query scale), then values one channel per lane.
//
// Body codes follow kvcal/packing.py's layouts: a code's word and bit come from shifts and masks ("planes3",
// 3-bit codes in exactly 3 bits, included; kvmix's 11 codes per word divide by 11). Sparse fp16 outliers are
// stored per (sequence, KV head) in append order behind an offset table per tile of body rows (kvcal/packing.py):
// a warp reads exactly the outliers of the (at most two) tiles its 32 tokens' body rows fall in, each a uint16
// position in its tile and an fp16 value, and adds them as corrections. No search, no other head's outliers.
// Nothing dequantized is written to memory; partial (output, lse) per split go to out/lse_partial.
#include "common.cuh"
#include "merge.cuh"
#include "segments.cuh"

#define WARPS 4
#define THREADS (WARPS * 32)
// query heads per KV head served by one block: 8, and 4 at head_dim 256 (8 heads' accumulators of 8 channels a lane
// left ptxas too few registers there: spills)
template <int D>
constexpr int GMAX = D == 256 ? 4 : 8;

// Per-channel tables of a side for the block's KV head: the codebook, for fixed per-channel thresholds the half
// range and midpoint of every channel, for SKVQ's permuted groups the parameter group of every channel.
template <int D>
struct SideTables {
    float codebook[16];
    float half_range[D];
    float mid[D];
    int group[D];
    int param_fp8;
};

// The value of a body code at `channel` (c within the KV head): group is channels per parameter group
// for per-token uniform parameters.
template <int CODEC, int D>
__device__ __forceinline__ float decoded(const TokenRef& ref, const SideTables<D>& tables, unsigned code, int group, int channel, int c) {
    if (CODEC == UNIFORM_TOKEN || CODEC == UNIFORM_CHANNEL) {
        return uniform_value<CODEC>(ref, code, group, channel);
    } else if (CODEC == CODEBOOK_CHANNEL) {
        return tables.codebook[code] * tables.half_range[c] + tables.mid[c];
    } else if (CODEC == PERMUTED_GROUPS) {
        const int i = tables.group[c] * ref.param_column;
        if (tables.param_fp8)
            return permuted_group_value(code, e4m3_to_float(__ldg((const unsigned char*)ref.param0 + i)),
                                        e4m3_to_float(__ldg((const unsigned char*)ref.param1 + i)));
        return permuted_group_value(code, load_half(ref.param0 + i), load_half(ref.param1 + i));
    } else {  // CODEBOOK_TOKEN
        return denormalized(tables.codebook[code], load_half(ref.param0), load_half(ref.param1));
    }
}

template <int CODEC, int D>
__device__ __forceinline__ float body_value(const TokenRef& ref, const SideTables<D>& tables, int layout, int group,
                                            int channel, int c) {
    return decoded<CODEC, D>(ref, tables, code_at(ref.words, channel, layout), group, channel, c);
}

template <int CODEC, int D>
__device__ __forceinline__ float token_value(const TokenRef& ref, const SideTables<D>& tables, int layout, int group,
                                             int channel, int c) {
    if (CODEC == FP16_ONLY || ref.fp16_row != nullptr) return load_half(ref.fp16_row + channel);
    return body_value<CODEC, D>(ref, tables, layout, group, channel, c);
}

template <int CODEC, int D>
__device__ __forceinline__ void load_tables(const Side& s, SideTables<D>& tables, int kv_head) {
    if (CODEC == CODEBOOK_CHANNEL || CODEC == CODEBOOK_TOKEN) {
        int entries = 1 << code_bits(s.layout);
        for (int i = threadIdx.x; i < entries; i += THREADS) tables.codebook[i] = s.codebook[i];
    }
    if (CODEC == CODEBOOK_CHANNEL) {
        for (int c = threadIdx.x; c < D; c += THREADS) {
            float lo = ((const float*)s.param0)[kv_head * D + c], hi = ((const float*)s.param1)[kv_head * D + c];
            tables.half_range[c] = fmaxf((hi - lo) / 2.0f, KVCAL_MIN_HALF_RANGE);
            tables.mid[c] = (hi + lo) / 2.0f;
        }
    }
    if (CODEC == PERMUTED_GROUPS) {
        for (int c = threadIdx.x; c < D; c += THREADS) tables.group[c] = s.group_of_channel[kv_head * D + c];
        tables.param_fp8 = s.param_fp8;
    }
}

// Scores of one key token against the block's query heads (q already scaled), accumulated into s.
// Pre-RoPE keys are rotated on the fly: channel pairs (c, c + D/2), angle (position) x inv_freq[c].
template <int D, bool ROPE>
__device__ __forceinline__ void accumulate(float* s, const float (*q)[D], int group, int c, float k1, float k2, float cos_a,
                                           float sin_a) {
    if (ROPE) {
        const float r1 = k1 * cos_a - k2 * sin_a, r2 = k2 * cos_a + k1 * sin_a;
#pragma unroll
        for (int g = 0; g < GMAX<D>; ++g)
            if (g < group) s[g] += q[g][c] * r1 + q[g][c + D / 2] * r2;
    } else {
#pragma unroll
        for (int g = 0; g < GMAX<D>; ++g)
            if (g < group) s[g] += q[g][c] * k1 + q[g][c + D / 2] * k2;
    }
}

__device__ __forceinline__ void rope_at(bool rope, int position, float inv_freq, float rope_scale, float* cos_a, float* sin_a) {
    if (!rope) return;
    rope_cos_sin(position, inv_freq, cos_a, sin_a);
    *cos_a *= rope_scale;
    *sin_a *= rope_scale;
}

// Any token, element by element: fp16 rows, and packed layouts whose words straddle heads (kvmix's 11 codes per
// word).
template <int CODEC, int D, bool ROPE>
__device__ __forceinline__ void key_scores_by_element(float* s, const TokenRef& ref, const SideTables<D>& tables, int layout,
                                                      int param_group, int head_channel, const float (*q)[D], int group,
                                                      const float* freq, int position, float rope_scale) {
#pragma unroll 2
    for (int c = 0; c < D / 2; ++c) {
        float cos_a = 1.0f, sin_a = 0.0f;
        rope_at(ROPE, position, freq[c], rope_scale, &cos_a, &sin_a);
        const float k1 = token_value<CODEC, D>(ref, tables, layout, param_group, head_channel + c, c);
        const float k2 = token_value<CODEC, D>(ref, tables, layout, param_group, head_channel + c + D / 2, c + D / 2);
        accumulate<D, ROPE>(s, q, group, c, k1, k2, cos_a, sin_a);
    }
}

// 8 consecutive fp16 values from a 16-byte aligned address, as floats.
__device__ __forceinline__ void load8(const half_bits* p, float* out) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
    const unsigned words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = half_to_float((half_bits)(words[i / 2] >> (16 * (i % 2))));
}

// Word `step` of a head's codes: an "lsb" word, or for planes3 the low-bit word of half unit `step` (16 codes),
// their 16 high bits going to *top.
template <int LAYOUT>
__device__ __forceinline__ unsigned step_word(const unsigned* words, int step, unsigned* top) {
    if (LAYOUT != PLANES3) return __ldg(words + step);
    const unsigned* unit = words + (step >> 1) * 3;
    *top = __ldg(unit + 2) >> ((step & 1) * 16);
    return __ldg(unit + (step & 1));
}

// A body token whose head fills whole words ("lsb" 1, 2 or 4 bits, and "planes3": its units of 32 codes never
// straddle heads): one load per word, not per code, and for per-channel uniform parameters one 16-byte load per
// 8 scales (or zeros).
template <int CODEC, int D, bool ROPE, int LAYOUT>
__device__ __forceinline__ void key_scores_by_word(float* s, const TokenRef& ref, const SideTables<D>& tables, int param_group,
                                                   int head_channel, const float (*q)[D], int group, const float* freq,
                                                   int position, float rope_scale) {
    constexpr int BITS = LAYOUT == PLANES3 ? 2 : LAYOUT;  // bits of a code in its step's word (planes3: the low plane)
    constexpr int PER_WORD = 32 / BITS, HALF_WORDS = D / 2 / PER_WORD;
    constexpr unsigned MASK = (1u << BITS) - 1u;
    const unsigned* words = ref.words + (LAYOUT == PLANES3 ? (head_channel >> 5) * 3 : head_channel / PER_WORD);
#pragma unroll 1  // unrolling the outer loops keeps too many loads in flight: sm_80 spilled
    for (int w = 0; w < HALF_WORDS; ++w) {
        unsigned low_top = 0u, high_top = 0u;  // planes3's high bits of the codes of low and high
        const unsigned low = step_word<LAYOUT>(words, w, &low_top), high = step_word<LAYOUT>(words, w + HALF_WORDS, &high_top);
#pragma unroll 1
        for (int part = 0; part < PER_WORD / 8; ++part) {
            const int first = w * PER_WORD + part * 8;  // channels first.. and first + D/2.. within the head
            float scale1[8], zero1[8], scale2[8], zero2[8];
            if (CODEC == UNIFORM_CHANNEL) {
                load8(ref.param0 + head_channel + first, scale1);
                load8(ref.param1 + head_channel + first, zero1);
                load8(ref.param0 + head_channel + first + D / 2, scale2);
                load8(ref.param1 + head_channel + first + D / 2, zero2);
            }
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int c = first + i, slot = part * 8 + i, shift = slot * BITS;
                unsigned code1 = (low >> shift) & MASK, code2 = (high >> shift) & MASK;
                if (LAYOUT == PLANES3) {
                    code1 |= ((low_top >> slot) & 1u) << 2;
                    code2 |= ((high_top >> slot) & 1u) << 2;
                }
                float cos_a = 1.0f, sin_a = 0.0f;
                rope_at(ROPE, position, freq[c], rope_scale, &cos_a, &sin_a);
                float k1, k2;
                if (CODEC == UNIFORM_CHANNEL) {
                    k1 = min_max_value(code1, scale1[i], zero1[i]);
                    k2 = min_max_value(code2, scale2[i], zero2[i]);
                } else {
                    k1 = decoded<CODEC, D>(ref, tables, code1, param_group, head_channel + c, c);
                    k2 = decoded<CODEC, D>(ref, tables, code2, param_group, head_channel + c + D / 2, c + D / 2);
                }
                accumulate<D, ROPE>(s, q, group, c, k1, k2, cos_a, sin_a);
            }
        }
    }
}

// An fp16 token: 16-byte loads of 8 channels (rows are 16-byte aligned: head_dim is a multiple of 8).
template <int D, bool ROPE>
__device__ __forceinline__ void key_scores_fp16(float* s, const half_bits* row, const float (*q)[D], int group,
                                                const float* freq, int position, float rope_scale) {
#pragma unroll 1
    for (int v = 0; v < D / 16; ++v) {
        float low[8], high[8];
        load8(row + v * 8, low);
        load8(row + D / 2 + v * 8, high);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int c = v * 8 + i;
            float cos_a = 1.0f, sin_a = 0.0f;
            rope_at(ROPE, position, freq[c], rope_scale, &cos_a, &sin_a);
            accumulate<D, ROPE>(s, q, group, c, low[i], high[i], cos_a, sin_a);
        }
    }
}

template <int CODEC, int D, bool ROPE>
__device__ __forceinline__ void key_scores(float* s, const TokenRef& ref, const SideTables<D>& tables, int layout, int param_group,
                                           int head_channel, const float (*q)[D], int group, const float* freq, int position,
                                           float rope_scale) {
    if (CODEC == FP16_ONLY || ref.fp16_row != nullptr) {
        key_scores_fp16<D, ROPE>(s, ref.fp16_row + head_channel, q, group, freq, position, rope_scale);
        return;
    }
    switch (layout) {
        case 1: key_scores_by_word<CODEC, D, ROPE, 1>(s, ref, tables, param_group, head_channel, q, group, freq, position, rope_scale); break;
        case 2: key_scores_by_word<CODEC, D, ROPE, 2>(s, ref, tables, param_group, head_channel, q, group, freq, position, rope_scale); break;
        case 3: key_scores_by_word<CODEC, D, ROPE, PLANES3>(s, ref, tables, param_group, head_channel, q, group, freq, position, rope_scale); break;
        case 4: key_scores_by_word<CODEC, D, ROPE, 4>(s, ref, tables, param_group, head_channel, q, group, freq, position, rope_scale); break;
        default:
            key_scores_by_element<CODEC, D, ROPE>(s, ref, tables, layout, param_group, head_channel, q, group, freq, position, rope_scale);
    }
}

// For every outlier of one side in live body rows [row_lo, row_hi) of sequence b (body rows in all, the first live
// one at store row `head`) in the block's KV head that owns(row, c) claims for this lane: apply(row, c, delta), delta
// = the exact value minus what the codes gave, c = the channel within the head. The rows' tiles (of store rows) are
// read straight from the offset table: tile t's outliers are [offset[t], offset[t + 1]), the last started tile's end
// at the run's count; rows within a tile are in append order, so the walk stops at the first row past row_hi.
template <int CODEC, int D, typename Owns, typename Apply>
__device__ __forceinline__ void for_each_outlier(const Side& side, const SideTables<D>& tables, int layout, int param_group,
                                                 int b, int kv_head, int kv_heads, int body, int head, int row_lo, int row_hi,
                                                 int head_channel, Owns owns, Apply apply) {
    if (CODEC == FP16_ONLY || side.outlier_counts == nullptr || row_lo >= row_hi) return;
    const long long run = (long long)b * kv_heads + kv_head;
    const unsigned short* positions = side.outlier_positions + run * side.outlier_stride;
    const half_bits* values = side.outlier_values + run * side.outlier_stride;
    const int* offsets = side.outlier_offsets + run * side.offset_stride;
    const int last_tile = (head + body - 1) >> side.tile_shift;
    for (int tile = (head + row_lo) >> side.tile_shift; tile <= (head + row_hi - 1) >> side.tile_shift; ++tile) {
        const int end = __ldg(tile < last_tile ? offsets + tile + 1 : side.outlier_counts + run);  // one load, no branch
        for (int i = __ldg(offsets + tile); i < end; ++i) {
            const unsigned position = __ldg(positions + i);
            const int stored = (tile << side.tile_shift) + (int)(position / D), row = stored - head, c = (int)(position % D);
            if (row >= row_hi) break;  // a run is in append order: the rest of the tile is past these rows
            if (row < row_lo || !owns(row, c)) continue;
            apply(row, c, load_half(values + i) -
                              body_value<CODEC, D>(body_ref<CODEC>(side, b, stored), tables, layout, param_group, head_channel + c, c));
        }
    }
}

// Launch bounds (128 threads, at least 2 blocks per SM) leave ptxas up to 255 registers: with its default
// occupancy target it capped head_dim 128 + RoPE at 168 registers and spilled.
template <int D, bool ROPE, int KCODEC, int VCODEC>
__global__ void __launch_bounds__(THREADS, 2) decode_attention(
    const float* __restrict__ query,           // (batch, kv_heads * group, D), unscaled
    const long long* __restrict__ descriptor,  // K side then V side, SIDE_FIELDS each
    const int* __restrict__ meta,              // (2, batch, META_FIELDS)
    const int* __restrict__ position_offset,   // (batch,): RoPE position of each sequence's token 0
    const float* __restrict__ inv_freq,        // (D / 2,)
    float* __restrict__ out_partial,           // (batch, heads, total_splits, D)
    float* __restrict__ lse_partial,           // (batch, heads, total_splits), log2 domain
    int batch, int kv_heads, int group, int tokens_per_split, int split_offset, int total_splits,
    float scale_log2, float rope_scale) {
    constexpr int PER_LANE = D / 32;
    // the warps' outputs for the final merge take the place of what the token loop reads (a barrier between): at
    // head_dim 256 both together passed the 48 KB of static shared memory
    struct LoopState {
        float q[GMAX<D>][D];
        float p[WARPS][GMAX<D>][32];
        SideTables<D> k_tables, v_tables;
        float freq[D / 2];
    };
    union SharedState {
        LoopState loop;
        float acc[WARPS][GMAX<D>][D];
    };
    __shared__ SharedState shared;
    float(&q_s)[GMAX<D>][D] = shared.loop.q;
    float(&p_s)[WARPS][GMAX<D>][32] = shared.loop.p;
    SideTables<D>& k_tables = shared.loop.k_tables;
    SideTables<D>& v_tables = shared.loop.v_tables;
    float(&freq_s)[D / 2] = shared.loop.freq;
    float(&acc_s)[WARPS][GMAX<D>][D] = shared.acc;
    __shared__ float m_s[WARPS][GMAX<D>], l_s[WARPS][GMAX<D>];

    const int split = blockIdx.x, kv_head = blockIdx.y, b = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int heads = kv_heads * group, width = kv_heads * D, head_channel = kv_head * D;
    __shared__ Side ks, vs;  // in shared memory: read once per token, not held in registers
    if (threadIdx.x == 0) {
        ks = load_side(descriptor);
        vs = load_side(descriptor + SIDE_FIELDS);
    }
    const Lengths kn = load_lengths(meta, 0, batch, b), vn = load_lengths(meta, 1, batch, b);
    // body rows 0 .. skip - 1 of both sides are another kernel's (both sides' sinks are then equal): launch token t is
    // the sequence's token t below the sinks, t + skip past them
    const int skip = kn.skip, tokens = kn.sink + kn.body + kn.recent - skip;
    auto sequence_token = [&](int t) { return t < kn.sink ? t : t + skip; };
    const int start = split * tokens_per_split, end = min(start + tokens_per_split, tokens);
    const long long slot = split_offset + split;

    const int k_layout = (int)descriptor[LAYOUT], k_group = (int)descriptor[PARAM_EXTRA];
    const int v_layout = (int)descriptor[SIDE_FIELDS + LAYOUT], v_group = (int)descriptor[SIDE_FIELDS + PARAM_EXTRA];

    if (start >= end) {  // an empty split: lse = -inf, and the merge gives it no weight
        for (int i = threadIdx.x; i < group * D; i += THREADS) {
            long long row = (long long)b * heads + kv_head * group + i / D;
            out_partial[(row * total_splits + slot) * D + i % D] = 0.0f;
            if (i % D == 0) lse_partial[row * total_splits + slot] = -KVCAL_INF;
        }
        return;
    }
    for (int i = threadIdx.x; i < GMAX<D> * D; i += THREADS) {
        int g = i / D, c = i % D;
        q_s[g][c] = g < group ? query[((long long)b * heads + kv_head * group + g) * D + c] * scale_log2 : 0.0f;
    }
    for (int i = threadIdx.x; i < D / 2; i += THREADS) freq_s[i] = ROPE ? inv_freq[i] : 0.0f;
    __syncthreads();
    load_tables<KCODEC, D>(ks, k_tables, kv_head);
    load_tables<VCODEC, D>(vs, v_tables, kv_head);
    __syncthreads();

    float m[GMAX<D>], l[GMAX<D>], acc[GMAX<D>][PER_LANE];
#pragma unroll
    for (int g = 0; g < GMAX<D>; ++g) {
        m[g] = -KVCAL_INF;
        l[g] = 0.0f;
#pragma unroll
        for (int j = 0; j < PER_LANE; ++j) acc[g][j] = 0.0f;
    }
    const int position0 = ROPE ? position_offset[b] : 0;

    for (int t0 = start + warp * 32; t0 < end; t0 += WARPS * 32) {
        const int count = min(32, end - t0);
        const int t = t0 + lane, u = sequence_token(t);
        const bool valid = lane < count && u >= kn.first;
        float s[GMAX<D>];
#pragma unroll
        for (int g = 0; g < GMAX<D>; ++g) s[g] = 0.0f;

        // keys: this lane's token against every query head
        if (valid)
            key_scores<KCODEC, D, ROPE>(s, locate<KCODEC>(ks, kn, b, u, width), k_tables, k_layout, k_group, head_channel, q_s,
                                        group, freq_s, position0 + u, rope_scale);

        // key outliers of this tile's body rows, each on the lane that holds its token
        for_each_outlier<KCODEC, D>(
            ks, k_tables, k_layout, k_group, b, kv_head, kv_heads, kn.body, kn.body_head, max(t0 - kn.sink, 0) + skip,
            min(t0 + count - kn.sink + skip, kn.body), head_channel,
            [&](int row, int c) { return lane == row + kn.sink - skip - t0; },
            [&](int row, int c, float delta) {
                if (ROPE) {
                    const int f = c % (D / 2), partner = c < D / 2 ? c + D / 2 : c - D / 2;
                    float cos_a, sin_a;
                    rope_cos_sin(position0 + u, freq_s[f], &cos_a, &sin_a);
                    const float sign = c < D / 2 ? 1.0f : -1.0f;
#pragma unroll
                    for (int g = 0; g < GMAX<D>; ++g)
                        if (g < group) s[g] += delta * rope_scale * (q_s[g][c] * cos_a + sign * q_s[g][partner] * sin_a);
                } else {
#pragma unroll
                    for (int g = 0; g < GMAX<D>; ++g)
                        if (g < group) s[g] += delta * q_s[g][c];
                }
            });

        // online softmax over the tile
#pragma unroll
        for (int g = 0; g < GMAX<D>; ++g) {
            if (g >= group) continue;
            const float score = valid ? s[g] : -KVCAL_INF;
            const float m_new = fmaxf(m[g], warp_max(score));
            const float m_use = m_new == -KVCAL_INF ? 0.0f : m_new;  // a tile before the window's first token: p = 0
            const float correction = exp2f(m[g] - m_use);
            const float p = exp2f(score - m_use);
            l[g] = l[g] * correction + warp_sum(p);
            m[g] = m_new;
#pragma unroll
            for (int j = 0; j < PER_LANE; ++j) acc[g][j] *= correction;
            p_s[warp][g][lane] = p;
        }
        __syncwarp();

        // values: this lane's channels, every token of the tile
        for (int i = 0; i < count; ++i) {
            const TokenRef ref = locate<VCODEC>(vs, vn, b, sequence_token(t0 + i), width);
#pragma unroll
            for (int j = 0; j < PER_LANE; ++j) {
                const int c = lane + 32 * j;
                const float v = token_value<VCODEC, D>(ref, v_tables, v_layout, v_group, head_channel + c, c);
#pragma unroll
                for (int g = 0; g < GMAX<D>; ++g)
                    if (g < group) acc[g][j] += p_s[warp][g][i] * v;
            }
        }
        // value outliers of this tile's body rows, each on the lane that holds its channel
        for_each_outlier<VCODEC, D>(
            vs, v_tables, v_layout, v_group, b, kv_head, kv_heads, vn.body, vn.body_head, max(t0 - vn.sink, 0) + skip,
            min(t0 + count - vn.sink + skip, vn.body), head_channel,
            [&](int row, int c) { return lane == c % 32; },
            [&](int row, int c, float delta) {
                const int tile_token = row + vn.sink - skip - t0;
#pragma unroll
                for (int j = 0; j < PER_LANE; ++j) {  // a select, not acc[g][c / 32]: registers cannot be indexed
                    const float owned = j == c / 32 ? delta : 0.0f;
#pragma unroll
                    for (int g = 0; g < GMAX<D>; ++g)
                        if (g < group) acc[g][j] += p_s[warp][g][tile_token] * owned;
                }
            });
        __syncwarp();
    }

    // merge the warps' partial softmax states, then write this split's (output, lse)
    __syncthreads();  // every warp has left the token loop: acc_s may overwrite its state
#pragma unroll
    for (int g = 0; g < GMAX<D>; ++g) {
#pragma unroll
        for (int j = 0; j < PER_LANE; ++j) acc_s[warp][g][lane + 32 * j] = acc[g][j];
        if (lane == 0) {
            m_s[warp][g] = m[g];
            l_s[warp][g] = l[g];
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < group * D; i += THREADS) {
        const int g = i / D, c = i % D;
        float m_all = -KVCAL_INF;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) m_all = fmaxf(m_all, m_s[w][g]);
        float total = 0.0f, value = 0.0f;
        if (m_all != -KVCAL_INF) {
#pragma unroll
            for (int w = 0; w < WARPS; ++w) {
                const float weight = exp2f(m_s[w][g] - m_all);  // 0 for a warp that saw no tile
                total += l_s[w][g] * weight;
                value += acc_s[w][g][c] * weight;
            }
        }
        const long long row = (long long)b * heads + kv_head * group + g;
        out_partial[(row * total_splits + slot) * D + c] = total > 0.0f ? value / total : 0.0f;
        if (c == 0) lse_partial[row * total_splits + slot] = total > 0.0f ? m_all + log2f(total) : -KVCAL_INF;
    }
}

// out (rows, D): merge.cuh's merge of each row's splits, one block a row. The merge of the CUDA-core kernel's splits
// (and of decode_attention_tc.cu's where that kernel does not merge them itself).
extern "C" __global__ void merge_splits(const float* __restrict__ out_partial, const float* __restrict__ lse_partial,
                                        float* __restrict__ out, int splits, int head_dim) {
    merge_split_row(out_partial, lse_partial, out, blockIdx.x, splits, head_dim, threadIdx.x, blockDim.x);
}
