// What a decode launch reads besides the body rows the tensor-core kernel serves: the descriptor of its stores and
// the per-sequence lengths as kvcal/runtime/kernels.py writes them (the CPU kernel reads the same descriptor), where
// each token of a side lives, and the attention over those other tokens (fp16 sinks, windows, residuals of
// kvcal.runtime.segments; rows of a uniform body one side holds alone) that decode_attention_tc.cu's segment blocks run.
#pragma once

#include "common.cuh"

// Fields of one side (K or V) in the int64 descriptor array written by kvcal/runtime/kernels.py.
enum SideField {
    SINK, SINK_STRIDE, RECENT, RECENT_STRIDE, WORDS, WORDS_STRIDE, WORDS_PER_ROW, PARAM0, PARAM1, PARAM_STRIDE,
    PARAM_COLS, PARAM_EXTRA, PARAM_ROW, PARAM_COLUMN, CODEBOOK, OUTLIER_POSITIONS, OUTLIER_VALUES, OUTLIER_STRIDE, OUTLIER_OFFSETS, OFFSET_STRIDE,
    OUTLIER_COUNTS, OUTLIER_TILE_SHIFT, LAYOUT, GROUP_OF_CHANNEL, PARAM_FP8, PIECE_STRIDE, PIECE_CHANNELS, SIDE_FIELDS
};
// Per-sequence lengths of one side in the int32 meta array (2, batch, META_FIELDS): sink tokens, body tokens, the
// recent segment's first live row, recent tokens, the body's first live row (a sliding window drops rows from its
// front), the body rows another kernel serves, the sequence's first token the query sees (a sliding window; the
// tokens before it weigh nothing).
enum MetaField { M_SINK, M_BODY, M_HEAD, M_RECENT, M_BODY_HEAD, M_SKIP, M_FIRST, META_FIELDS };
// Tokens per segment block of decode_attention_tc.cu: a 32-token tile per warp.
enum SegmentShape { SEGMENT_SPLIT_TOKENS = 128 };

struct Side {
    const half_bits* sink; long long sink_stride;
    const half_bits* recent; long long recent_stride;
    // body row r of sequence b: its piece holding channel c (piece_channels a piece) at words + b * words_stride + r *
    // words_per_row + (c / piece_channels) * piece_stride (kvcal.runtime.store.PackedRows: a row whole, or a KV head's
    // rows together)
    const unsigned* words; long long words_stride; int words_per_row; long long piece_stride; int piece_channels;
    // parameter (row, column) of sequence b at b * param_stride + row * param_row + column * param_column: per-token
    // parameters run along the tokens column by column (kvcal.runtime.store), per-block ones are rows of channels
    const void* param0; const void* param1; long long param_stride; int param_cols; int param_extra;
    long long param_row, param_column;
    const float* codebook;
    // outliers per (sequence, KV head) run: positions and values (stride per run), the offset table (offset_stride
    // tiles per run), the count of each run (null when the codec keeps no outliers); tiles of 2^tile_shift rows
    const unsigned short* outlier_positions; const half_bits* outlier_values; long long outlier_stride;
    const int* outlier_offsets; long long offset_stride; const int* outlier_counts; int tile_shift;
    int layout;
    const int* group_of_channel;  // PERMUTED_GROUPS: the parameter group of every channel of the width
    int param_fp8;                // PERMUTED_GROUPS: its parameters are fp8 e4m3 (1 byte), not fp16
};

__device__ __forceinline__ Side load_side(const long long* d) {
    Side s;
    s.sink = (const half_bits*)d[SINK]; s.sink_stride = d[SINK_STRIDE];
    s.recent = (const half_bits*)d[RECENT]; s.recent_stride = d[RECENT_STRIDE];
    s.words = (const unsigned*)d[WORDS]; s.words_stride = d[WORDS_STRIDE]; s.words_per_row = (int)d[WORDS_PER_ROW];
    s.piece_stride = d[PIECE_STRIDE]; s.piece_channels = (int)d[PIECE_CHANNELS];
    s.param0 = (const void*)d[PARAM0]; s.param1 = (const void*)d[PARAM1]; s.param_stride = d[PARAM_STRIDE];
    s.param_cols = (int)d[PARAM_COLS]; s.param_extra = (int)d[PARAM_EXTRA];
    s.param_row = d[PARAM_ROW]; s.param_column = d[PARAM_COLUMN];
    s.codebook = (const float*)d[CODEBOOK];
    s.outlier_positions = (const unsigned short*)d[OUTLIER_POSITIONS]; s.outlier_values = (const half_bits*)d[OUTLIER_VALUES];
    s.outlier_stride = d[OUTLIER_STRIDE]; s.outlier_offsets = (const int*)d[OUTLIER_OFFSETS]; s.offset_stride = d[OFFSET_STRIDE];
    s.outlier_counts = (const int*)d[OUTLIER_COUNTS]; s.tile_shift = (int)d[OUTLIER_TILE_SHIFT];
    s.layout = (int)d[LAYOUT];
    s.group_of_channel = (const int*)d[GROUP_OF_CHANNEL];
    s.param_fp8 = (int)d[PARAM_FP8];
    return s;
}

struct Lengths {
    int sink, body, head, recent, body_head, skip, first;
};

__device__ __forceinline__ Lengths load_lengths(const int* meta, int side, int batch, int b) {
    const int* m = meta + ((long long)side * batch + b) * META_FIELDS;
    Lengths n;
    n.sink = m[M_SINK]; n.body = m[M_BODY]; n.head = m[M_HEAD]; n.recent = m[M_RECENT]; n.body_head = m[M_BODY_HEAD];
    n.skip = m[M_SKIP]; n.first = m[M_FIRST];
    return n;
}

// Where token t of sequence b lives on one side: an fp16 row, or a body row with its codes and the
// parameter rows that scale it (computed once per token, so that the per-element work is unpack + fma).
struct TokenRef {
    const half_bits* fp16_row;  // null for a body token
    const unsigned* words;      // the piece of the row that holds the attended KV head, its first channel piece_channel0
    int piece_channel0;
    const half_bits* param0;
    const half_bits* param1;
    // per-token uniform parameters: elements from one channel group's to the next's (int: a sequence holds fewer
    // than 2^31 parameters, kvcal.runtime.kernels.parameter_fields)
    int param_column;
};

// A uniform body row (the segment blocks read no other codec's): the piece of its codes that holds channel
// head_channel (a KV head's first: a KV head never spans two pieces) and the fp16 parameter rows that scale it.
template <int CODEC>
__device__ __forceinline__ TokenRef body_ref(const Side& s, int b, int row, int head_channel) {
    static_assert(CODEC == UNIFORM_TOKEN || CODEC == UNIFORM_CHANNEL, "the segment blocks read uniform bodies");
    TokenRef ref;
    ref.fp16_row = nullptr;
    const int piece = head_channel / s.piece_channels;
    ref.words = s.words + b * s.words_stride + (long long)row * s.words_per_row + piece * s.piece_stride;
    ref.piece_channel0 = piece * s.piece_channels;
    const long long offset = b * s.param_stride + (long long)(CODEC == UNIFORM_TOKEN ? row : row / s.param_extra) * s.param_row;
    ref.param0 = (const half_bits*)s.param0 + offset;
    ref.param1 = (const half_bits*)s.param1 + offset;
    ref.param_column = (int)s.param_column;
    return ref;
}

// Token t of sequence b on one side, for the KV head whose first channel is head_channel.
template <int CODEC>
__device__ __forceinline__ TokenRef locate(const Side& s, const Lengths& n, int b, int t, int width, int head_channel) {
    TokenRef ref;
    ref.words = nullptr;
    ref.piece_channel0 = 0;
    ref.param0 = ref.param1 = nullptr;
    ref.param_column = 0;
    if (t < n.sink) {
        ref.fp16_row = s.sink + b * s.sink_stride + (long long)t * width;
        return ref;
    }
    t -= n.sink;
    if constexpr (CODEC != FP16_ONLY)
        if (t < n.body) return body_ref<CODEC>(s, b, n.body_head + t, head_channel);
    t -= n.body;
    ref.fp16_row = s.recent + b * s.recent_stride + (long long)(n.head + t) * width;
    return ref;
}

// A uniform body code's value: per-channel block parameters (ChannelBlockUniform) or per-token ones of the channel's
// group of `group` channels (TokenUniform). channel: within the whole width.
template <int CODEC>
__device__ __forceinline__ float uniform_value(const TokenRef& ref, unsigned code, int group, int channel) {
    const int i = CODEC == UNIFORM_TOKEN ? channel / group * ref.param_column : channel;
    return min_max_value(code, load_half(ref.param0 + i), load_half(ref.param1 + i));
}

namespace segments {

constexpr int WARPS = 4, THREADS = WARPS * 32;
static_assert(SEGMENT_SPLIT_TOKENS == WARPS * 32, "one tile of 32 tokens per warp");

// Shared memory the attention takes: the two sides' descriptors and lengths, the query, a tile's probabilities per
// warp, the warps' outputs and their softmax states.
template <int GQA, int D>
constexpr int SHARED_BYTES = 2 * (int)(sizeof(Side) + sizeof(Lengths)) + (GQA * D + WARPS * GQA * (32 + D + 2)) * 4;
// Query heads a lane accumulates values for at a time: at most 8 accumulators. The segment path shares the kernel's
// registers, and variants at their launch-bound limit (int2 g128 at 128, the uniform head_dim 256 ones at 168) spilled
// or took 8-136 byte stack frames with more, or with this loop over head groups kept rolled.
template <int GQA, int D>
constexpr int HEADS_AT_A_TIME = GQA * (D / 32) <= 8 ? GQA : 8 / (D / 32);

// Element `channel` (within the width) of a token's row on one side: fp16, or a uniform body code of LAYOUT
// dequantized.
template <int CODEC, int LAYOUT>
__device__ __forceinline__ float element(const TokenRef& ref, const Side& side, int channel) {
    if (CODEC == FP16_ONLY || ref.fp16_row != nullptr) return load_half(ref.fp16_row + channel);
    return uniform_value<CODEC>(ref, code_in<LAYOUT>(ref.words, channel - ref.piece_channel0), side.param_extra, channel);
}

// Attention of sequence b's GQA query heads of KV head kvh over the launch's tokens split * SEGMENT_SPLIT_TOKENS ..
// (the decode launch's tokens beside the rows the tensor-core body serves: the sinks, then what follows the
// served body rows, meta's M_SKIP: token j is the sequence's u = j below the sinks, j + skip past them; each side maps
// u to its own fp16 sink, body row or fp16 recent row), written as split slot `slot` (normalised output, lse in
// log2 units; 0 and -inf where no token counts). KCODEC / VCODEC: FP16_ONLY where the two sides keep the same tokens
// fp16 around the served rows (no body row to read), UNIFORM_CHANNEL / UNIFORM_TOKEN where a side's body rows past
// the served ones are read too (KIVI's and KVmix's), their codes in KLAYOUT / VLAYOUT (enum Layout). Tokens are at
// positions positions[b] + u; ROPE: the keys are pre-RoPE, rotated here (rope_cos_sin);
// tokens before meta's M_FIRST weigh nothing, and for query head g before row_first[out_row + g] where row_first is
// not null (each row its own first token: a step of several queries under a sliding window or chunk). query (batch,
// heads, D) float32 unscaled; scale_log2 carries log2(e) and any RoPE attention scaling; softcap_log2 > 0 soft-caps
// the scores (soft_capped), 0 leaves them. smem: SHARED_BYTES<GQA, D>, 16-byte aligned.
template <int GQA, int D, bool ROPE, int KCODEC, int VCODEC, int KLAYOUT, int VLAYOUT>
__device__ __forceinline__ void attend_rows(const float* query, const long long* descriptor, const int* meta, const int* positions,
                                            const float* inv_freq, float* out_partial, float* lse_partial, int b, int kvh,
                                            int kv_heads, int split, long long slot, int total_splits, float scale_log2,
                                            float softcap_log2, const int* row_first, unsigned char* smem) {
    constexpr int PER_LANE = D / 32;  // a lane's channels of a value row (consecutive)
    const int batch = gridDim.z, warp = threadIdx.x / 32, lane = threadIdx.x % 32, width = kv_heads * D;
    const long long heads = (long long)kv_heads * GQA, out_row = b * heads + (long long)kvh * GQA;
    Side* const sides = reinterpret_cast<Side*>(smem);                         // keys, values
    Lengths* const lengths = reinterpret_cast<Lengths*>(smem + 2 * sizeof(Side));  // keys, values
    float* const q_s = reinterpret_cast<float*>(smem + 2 * (sizeof(Side) + sizeof(Lengths)));  // [GQA][D]
    float* const p_s = q_s + GQA * D;                                      // [WARPS][GQA][32]
    float* const acc_s = p_s + WARPS * GQA * 32;                           // [WARPS][GQA][D]
    float* const m_s = acc_s + WARPS * GQA * D;                            // [WARPS][GQA]
    float* const l_s = m_s + WARPS * GQA;
    if (threadIdx.x < 2) {
        sides[threadIdx.x] = load_side(descriptor + threadIdx.x * SIDE_FIELDS);
        lengths[threadIdx.x] = load_lengths(meta, threadIdx.x, batch, b);
    }
    for (int i = threadIdx.x; i < GQA * D; i += THREADS) q_s[i] = query[out_row * D + i] * scale_log2;
    __syncthreads();
    const Side &ks = sides[0], &vs = sides[1];
    const Lengths &kn = lengths[0], &vn = lengths[1];
    const int skip = kn.skip, start = split * SEGMENT_SPLIT_TOKENS;
    const int end = min(start + SEGMENT_SPLIT_TOKENS, kn.sink + kn.body + kn.recent - skip);

    const int t0 = start + warp * 32;  // this warp's tile: a token per lane for the keys, PER_LANE channels for the values
    const int count = max(min(32, end - t0), 0), j = t0 + lane, u = j < kn.sink ? j : j + skip;
    const bool counts = lane < count && u >= kn.first;
    float s[GQA];
#pragma unroll
    for (int g = 0; g < GQA; ++g) s[g] = 0.0f;
    if (counts) {
        const int position = ROPE ? positions[b] + u : 0, channel0 = kvh * D;
        const TokenRef key = locate<KCODEC>(ks, kn, b, u, width, channel0);
#pragma unroll 1
        for (int c = 0; c < D / 2; ++c) {  // channel pairs (c, c + D/2), rotated together
            float x = element<KCODEC, KLAYOUT>(key, ks, channel0 + c), y = element<KCODEC, KLAYOUT>(key, ks, channel0 + c + D / 2);
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
        if (softcap_log2 > 0.0f)
#pragma unroll
            for (int g = 0; g < GQA; ++g) s[g] = soft_capped(s[g], softcap_log2);
    }
#pragma unroll
    for (int g = 0; g < GQA; ++g) {  // the tile's softmax state (a warp's one tile: no rescaling)
        const bool seen = counts && (row_first == nullptr || u >= row_first[out_row + g]);
        const float score = seen ? s[g] : -KVCAL_INF;
        const float m = warp_max(score);
        const float p = m == -KVCAL_INF ? 0.0f : exp2f(score - m);
        const float l = warp_sum(p);
        p_s[(warp * GQA + g) * 32 + lane] = p;
        if (lane == 0) {
            m_s[warp * GQA + g] = m;
            l_s[warp * GQA + g] = l;
        }
    }
    __syncwarp();
    constexpr int HC = HEADS_AT_A_TIME<GQA, D>;
#pragma unroll
    for (int g0 = 0; g0 < GQA; g0 += HC) {  // the values, HC query heads at a time
        float acc[HC][PER_LANE];
#pragma unroll
        for (int h = 0; h < HC; ++h)
#pragma unroll
            for (int c = 0; c < PER_LANE; ++c) acc[h][c] = 0.0f;
#pragma unroll 1
        for (int i = 0; i < count; ++i) {
            const TokenRef value = locate<VCODEC>(vs, vn, b, t0 + i < kn.sink ? t0 + i : t0 + i + skip, width, kvh * D);
#pragma unroll
            for (int c = 0; c < PER_LANE; ++c) {
                const float x = element<VCODEC, VLAYOUT>(value, vs, kvh * D + lane * PER_LANE + c);
#pragma unroll
                for (int h = 0; h < HC; ++h)
                    if (g0 + h < GQA) acc[h][c] += p_s[(warp * GQA + g0 + h) * 32 + i] * x;
            }
        }
#pragma unroll
        for (int h = 0; h < HC; ++h)
#pragma unroll
            for (int c = 0; c < PER_LANE; ++c)
                if (g0 + h < GQA) acc_s[(warp * GQA + g0 + h) * D + lane * PER_LANE + c] = acc[h][c];
    }

    // the warps' states merged into the split's output
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
