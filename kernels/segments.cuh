// What a decode launch reads besides a packed body: the descriptor of its stores (both decode kernels read it) and
// the per-sequence lengths, as kvcal/runtime/kernels.py writes them; and the attention over the fp16 rows beside a
// body (sinks, windows, residuals: kvcal.runtime.segments) that decode_attention_tc.cu's segment blocks run.
#pragma once

#include "common.cuh"

// Fields of one side (K or V) in the int64 descriptor array written by kvcal/runtime/kernels.py.
enum SideField {
    SINK, SINK_STRIDE, RECENT, RECENT_STRIDE, WORDS, WORDS_STRIDE, WORDS_PER_ROW, PARAM0, PARAM1, PARAM_STRIDE,
    PARAM_COLS, PARAM_EXTRA, PARAM_ROW, PARAM_COLUMN, CODEBOOK, OUTLIER_POSITIONS, OUTLIER_VALUES, OUTLIER_STRIDE, OUTLIER_OFFSETS, OFFSET_STRIDE,
    OUTLIER_COUNTS, OUTLIER_TILE_SHIFT, LAYOUT, GROUP_OF_CHANNEL, PARAM_FP8, SIDE_FIELDS
};
// Per-sequence lengths of one side in the int32 meta array (2, batch, META_FIELDS): sink tokens, body tokens, the
// recent segment's first live row, recent tokens, the body's first live row (a sliding window drops rows from its
// front), the body rows another kernel serves, the sequence's first token the query sees (a sliding window; the
// tokens before it weigh nothing).
enum MetaField { M_SINK, M_BODY, M_HEAD, M_RECENT, M_BODY_HEAD, M_SKIP, M_FIRST, META_FIELDS };
// Tokens of the fp16 rows per segment block of decode_attention_tc.cu: a 32-token tile per warp.
enum SegmentShape { SEGMENT_SPLIT_TOKENS = 128 };

namespace segments {

constexpr int WARPS = 4, THREADS = WARPS * 32;
static_assert(SEGMENT_SPLIT_TOKENS == WARPS * 32, "one tile of 32 tokens per warp");

// Shared memory the attention takes: the query and a tile's probabilities, then (after a barrier) the warps' states.
template <int GQA, int D>
constexpr int SHARED_BYTES = (GQA * D + WARPS * GQA * 32 > WARPS * GQA * (D + 2) ? GQA * D + WARPS * GQA * 32 : WARPS * GQA * (D + 2)) * 4;

// An fp16 row of one side of the launch: row j of the fp16 rows, the sinks' j then the recent rows' from their first
// live one (head). width: halves per row (every KV head's channels).
__device__ __forceinline__ const half_bits* fp16_row(const long long* side, const int* lengths, int b, int j, long long width) {
    if (j < lengths[M_SINK]) return reinterpret_cast<const half_bits*>(side[SINK]) + b * side[SINK_STRIDE] + j * width;
    return reinterpret_cast<const half_bits*>(side[RECENT]) + b * side[RECENT_STRIDE] + (lengths[M_HEAD] + j - lengths[M_SINK]) * width;
}

// Attention of sequence b's GQA query heads of KV head kvh over its fp16 rows split * SEGMENT_SPLIT_TOKENS .. of both
// sides (which hold the same tokens: equal sinks and recent lengths, the body between them served elsewhere), written
// as split slot `slot` (normalised output, lse in log2 units; 0 and -inf where no token counts). The launch's token
// j is the sequence's token u = j (a sink) or j + body (a recent one), at position positions[b] + u; ROPE: the keys
// are pre-RoPE, rotated here by that position (kvcal.runtime.kernels' angles, rope_cos_sin); tokens before the
// meta's M_FIRST weigh nothing. query (batch, heads, D) float32 unscaled; scale_log2 carries log2(e) and any RoPE
// attention scaling. smem: SHARED_BYTES<GQA, D>, 16-byte aligned.
template <int GQA, int D, bool ROPE>
__device__ void attend_fp16_rows(const float* query, const long long* descriptor, const int* meta, const int* positions,
                                 const float* inv_freq, float* out_partial, float* lse_partial, int b, int kvh, int kv_heads,
                                 int split, long long slot, int total_splits, float scale_log2, unsigned char* smem) {
    constexpr int PER_LANE = D / 32;  // a lane's channels of a value row (consecutive)
    const int batch = gridDim.z, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int* const k_lengths = meta + (long long)b * META_FIELDS;
    const int* const v_lengths = meta + ((long long)batch + b) * META_FIELDS;
    const int sinks = k_lengths[M_SINK], body = k_lengths[M_BODY], first = k_lengths[M_FIRST];
    const int start = split * SEGMENT_SPLIT_TOKENS, end = min(start + SEGMENT_SPLIT_TOKENS, sinks + k_lengths[M_RECENT]);
    const long long width = (long long)kv_heads * D, heads = (long long)kv_heads * GQA, out_row = b * heads + (long long)kvh * GQA;
    float* const q_s = reinterpret_cast<float*>(smem);  // [GQA][D]
    float* const p_s = q_s + GQA * D;                     // [WARPS][GQA][32]
    for (int i = threadIdx.x; i < GQA * D; i += THREADS) q_s[i] = query[out_row * D + i] * scale_log2;
    __syncthreads();

    float m[GQA], l[GQA], acc[GQA][PER_LANE];
#pragma unroll
    for (int g = 0; g < GQA; ++g) {
        m[g] = -KVCAL_INF;
        l[g] = 0.0f;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) acc[g][i] = 0.0f;
    }
    const int t0 = start + warp * 32;  // this warp's tile: a token per lane for the keys, PER_LANE channels for the values
    if (t0 < end) {
        const int count = min(32, end - t0), j = t0 + lane, u = j < sinks ? j : j + body;
        const bool counts = lane < count && u >= first;
        float s[GQA];
#pragma unroll
        for (int g = 0; g < GQA; ++g) s[g] = 0.0f;
        if (counts) {
            const half_bits* const key = fp16_row(descriptor, k_lengths, b, j, width) + (long long)kvh * D;
            const int position = ROPE ? positions[b] + u : 0;
#pragma unroll 2
            for (int c = 0; c < D / 2; ++c) {  // channel pairs (c, c + D/2), rotated together
                float x = half_to_float(key[c]), y = half_to_float(key[c + D / 2]);
                if (ROPE) {
                    float cos_a, sin_a;
                    rope_cos_sin(position, __ldg(inv_freq + c), &cos_a, &sin_a);
                    const float rx = x * cos_a - y * sin_a;
                    y = y * cos_a + x * sin_a;
                    x = rx;
                }
#pragma unroll
                for (int g = 0; g < GQA; ++g) s[g] += q_s[g * D + c] * x + q_s[g * D + c + D / 2] * y;
            }
        }
#pragma unroll
        for (int g = 0; g < GQA; ++g) {  // the tile's online softmax: the first, so no rescaling
            const float score = counts ? s[g] : -KVCAL_INF;
            m[g] = warp_max(score);
            const float p = m[g] == -KVCAL_INF ? 0.0f : exp2f(score - m[g]);
            l[g] = warp_sum(p);
            p_s[(warp * GQA + g) * 32 + lane] = p;
        }
        __syncwarp();
#pragma unroll 1
        for (int i = 0; i < count; ++i) {
            const half_bits* const value = fp16_row(descriptor + SIDE_FIELDS, v_lengths, b, t0 + i, width) + (long long)kvh * D + lane * PER_LANE;
#pragma unroll
            for (int c = 0; c < PER_LANE; ++c) {
                const float x = half_to_float(value[c]);
#pragma unroll
                for (int g = 0; g < GQA; ++g) acc[g][c] += p_s[(warp * GQA + g) * 32 + i] * x;
            }
        }
    }

    // the warps' states merged into the split's output
    __syncthreads();  // every warp is done with q_s and p_s: the states take their place
    float* const acc_s = reinterpret_cast<float*>(smem);  // [WARPS][GQA][D]
    float* const m_s = acc_s + WARPS * GQA * D;           // [WARPS][GQA]
    float* const l_s = m_s + WARPS * GQA;
#pragma unroll
    for (int g = 0; g < GQA; ++g) {
#pragma unroll
        for (int c = 0; c < PER_LANE; ++c) acc_s[(warp * GQA + g) * D + lane * PER_LANE + c] = acc[g][c];
        if (lane == 0) {
            m_s[warp * GQA + g] = m[g];
            l_s[warp * GQA + g] = l[g];
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < GQA * D; i += THREADS) {
        const int g = i / D, c = i % D;
        float m_all = -KVCAL_INF;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) m_all = fmaxf(m_all, m_s[w * GQA + g]);
        float total = 0.0f, value = 0.0f;
        if (m_all != -KVCAL_INF) {
#pragma unroll
            for (int w = 0; w < WARPS; ++w) {
                const float weight = exp2f(m_s[w * GQA + g] - m_all);  // 0 for a warp whose tile counted no token
                total += l_s[w * GQA + g] * weight;
                value += acc_s[(w * GQA + g) * D + c] * weight;
            }
        }
        out_partial[((out_row + g) * total_splits + slot) * D + c] = total > 0.0f ? value / total : 0.0f;
        if (c == 0) lse_partial[(out_row + g) * total_splits + slot] = total > 0.0f ? m_all + log2f(total) : -KVCAL_INF;
    }
}

}  // namespace segments
