// The log-sum-exp merge of a decode step's split outputs: decode_attention_tc.cu runs it in the last block of a
// (sequence, KV head) to finish (tc::merge_when_last).
#pragma once

#include "common.cuh"

namespace merge {

constexpr int UNROLL = 16;  // splits a thread loads before it adds them up: its loads in flight per L2 round trip

// The float4 columns of a run's GQA rows of D channels, and the threads that share a column (PARTS: each takes every
// PARTS-th split, where the block has more threads than columns).
template <int GQA, int D, int THREADS>
struct Columns {
    static constexpr int ROW = D / 4, COUNT = GQA * ROW, PARTS = COUNT >= THREADS ? 1 : THREADS / COUNT;
    // shared scratch: the rows' maxima (MAXIMA floats: 16-byte aligned after them), then the sums and totals of the
    // parts past the first
    static constexpr int MAXIMA = 16, SCRATCH_BYTES = 4 * MAXIMA + (PARTS - 1) * COUNT * (16 + 4);
    static_assert(D % 4 == 0 && GQA <= MAXIMA, "whole float4 columns; the rows' maxima fit their floats");
};

// A column's weighted sum over the splits part, part + parts, ... and its total weight 2^(lse - shift). UNROLL
// splits' loads are issued before any is added: the merge is a chain of L2 round trips, tens of splits long at one
// KV head. Plain coherent loads (no __restrict__, which would allow the non-coherent path): in the fused merge an
// acquire fence before the call makes the other blocks' splits visible (ld.global.cg loads instead cost registers,
// and spills, in head_dim 256's two-width variants).
__device__ __forceinline__ void sum_column(const float4* partial, const float* lse, int row_columns, int splits, int part, int parts,
                                           float shift, float4& value, float& total) {
    const float none = -KVCAL_INF;
    for (int s = part; s < splits; s += UNROLL * parts) {
        float weight[UNROLL];
        float4 x[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {  // past the last split: weight 2^-inf = 0 on zeros
            const int split = s + u * parts;
            weight[u] = split < splits ? lse[split] : none;
            x[u] = split < splits ? partial[(long long)split * row_columns] : float4{};
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const float w = exp2f(weight[u] - shift);
            total += w;
            value.x += w * x[u].x;
            value.y += w * x[u].y;
            value.z += w * x[u].z;
            value.w += w * x[u].w;
        }
    }
}

// out[run * GQA + h] (D floats) = row h's split outputs weighted by 2^(lse - max lse), 0 for a row no split saw a
// token of (every lse -inf; an empty split writes 0 and -inf). Each row's maximum first (a warp a row, its lanes over
// the splits), then each thread's float4 columns over its splits (sum_column); parts past the first are added to the
// first's in their order, through shared memory. scratch: Columns::SCRATCH_BYTES of shared memory, 16-byte aligned.
template <int GQA, int D, int THREADS>
__device__ __forceinline__ void merge_splits(const float* out_partial, const float* lse_partial, float* __restrict__ out,
                                             long long run, int splits, float* scratch) {
    using C = Columns<GQA, D, THREADS>;
    const float none = -KVCAL_INF;
    float* const row_max = scratch;
    float4* const part_sums = reinterpret_cast<float4*>(scratch + C::MAXIMA);  // [PARTS - 1][COUNT]
    float* const part_totals = scratch + C::MAXIMA + 4 * (C::PARTS - 1) * C::COUNT;
    const int lane = threadIdx.x % 32;
    for (int h = threadIdx.x / 32; h < GQA; h += THREADS / 32) {
        const float* lse = lse_partial + (run * GQA + h) * splits;
        float m = none;
        for (int s = lane; s < splits; s += 32) m = fmaxf(m, lse[s]);
        for (int offset = 16; offset > 0; offset >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
        if (lane == 0) row_max[h] = m;
    }
    __syncthreads();
    // column c: row c / ROW's channels 4 (c % ROW) .. + 3
    auto sum = [&](int column, int part, float4& value, float& total) {
        const long long row = run * GQA + column / C::ROW;
        const float m = row_max[column / C::ROW], shift = m == none ? 0.0f : m;  // no tokens: every weight 2^-inf = 0
        const float4* partial = reinterpret_cast<const float4*>(out_partial + row * splits * D) + column % C::ROW;
        sum_column(partial, lse_partial + row * splits, C::ROW, splits, part, C::PARTS, shift, value, total);
    };
    auto store = [&](int column, const float4& value, float total) {
        reinterpret_cast<float4*>(out)[(run * GQA) * C::ROW + column] =
            total > 0.0f ? float4{value.x / total, value.y / total, value.z / total, value.w / total} : float4{};
    };
    if constexpr (C::PARTS == 1) {
        for (int column = threadIdx.x; column < C::COUNT; column += THREADS) {
            float4 value{};
            float total = 0.0f;
            sum(column, 0, value, total);
            store(column, value, total);
        }
    } else {
        const int column = threadIdx.x % C::COUNT, part = threadIdx.x / C::COUNT;  // parts past PARTS - 1: none
        float4 value{};
        float total = 0.0f;
        if (part < C::PARTS) sum(column, part, value, total);
        if (part > 0 && part < C::PARTS) {
            part_sums[(part - 1) * C::COUNT + column] = value;
            part_totals[(part - 1) * C::COUNT + column] = total;
        }
        __syncthreads();
        if (part == 0) {
            for (int p = 0; p < C::PARTS - 1; ++p) {
                const float4 x = part_sums[p * C::COUNT + column];
                value = float4{value.x + x.x, value.y + x.y, value.z + x.z, value.w + x.w};
                total += part_totals[p * C::COUNT + column];
            }
            store(column, value, total);
        }
    }
}

}  // namespace merge
