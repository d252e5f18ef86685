// The log-sum-exp merge of a decode step's split outputs: decode_attention_tc.cu runs it in the last block of a
// (sequence, KV head) to finish (tc::merge_when_last).
#pragma once

// out[row] (head_dim floats) = the row's split outputs weighted by 2^(lse - max lse), 0 for a row no split saw a token
// of (every lse -inf; an empty split writes 0 and -inf). Threads first, first + step, ... take the channels. Plain
// coherent loads (no __restrict__, which would allow the non-coherent path): in the fused merge an acquire fence
// before the call makes the other blocks' splits visible (ld.global.cg loads instead cost head_dim 256's two-width
// variants 11 registers and a spill).
__device__ __forceinline__ void merge_split_row(const float* out_partial, const float* lse_partial, float* __restrict__ out,
                                                long long row, int splits, int head_dim, int first, int step) {
    const float none = -__int_as_float(0x7f800000);
    float m_all = none;
    for (int s = 0; s < splits; ++s) m_all = fmaxf(m_all, lse_partial[row * splits + s]);
    for (int c = first; c < head_dim; c += step) {
        float total = 0.0f, value = 0.0f;
        if (m_all != none) {
            for (int s = 0; s < splits; ++s) {
                const float weight = exp2f(lse_partial[row * splits + s] - m_all);
                total += weight;
                value += weight * out_partial[(row * splits + s) * head_dim + c];
            }
        }
        out[row * head_dim + c] = total > 0.0f ? value / total : 0.0f;
    }
}
