// Decode attention on tensor cores (one query token per sequence) over fp16 rows, KIVI-style uniform int4 / int2
// codes, KVQuant's 4-, 3- and 2-bit codebook codes (nuq4, nuq3, nuq2) or SKVQ's int4 / int2 codes in permuted channel
// groups (dequantized per stage into fp16 rows), split over the sequence with a log-sum-exp merge;
// kvcal/runtime/tensor_core.py launches it. Its design (block and warp roles, the matrix mapping, how each codec's
// codes become mma fragments, pre-RoPE rotation, outliers) is written out in docs/kernels.md.
#include "code_lookups.cuh"
#include "intrinsics.cuh"
#include "merge.cuh"
#include "segments.cuh"

namespace tc {

constexpr int WARPS = 4, THREADS = WARPS * 32;
constexpr int OUT_TILE = 64;  // rows of kvcal/packing.py's outlier tiles: one stage of the variants that read outliers
constexpr int CODEBOOK_WORDS = 16;  // a side of the codebooks operand (kvcal.runtime.tensor_core.codebook_entries)
constexpr unsigned FP16_MINUS_ZERO2 = 0x80008000u, FP16_ONE2 = 0x3C003C00u;

#ifdef KVCAL_HOST_EMULATION
inline float shfl_idx(float x, int lane) {
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    bits = emulation::exchange_in_warp(bits, (unsigned)lane);
    float out;
    std::memcpy(&out, &bits, 4);
    return out;
}
inline float ex2(float x) { return exp2f(x); }
inline float lg2(float x) { return log2f(x); }
inline unsigned pack_half2(float lo, float hi) { return (unsigned)round_to_half(lo) | (unsigned)round_to_half(hi) << 16; }
template <int N>
inline void load_words(unsigned (&w)[N], const void* p) { std::memcpy(w, p, 4 * N); }
#define TC_SHARED_ARRAY(name, bytes) __shared__ uint4 name[(bytes) / 16]
#else
__device__ __forceinline__ float shfl_idx(float x, int lane) { return __shfl_sync(0xffffffffu, x, lane); }
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float lg2(float x) { return log2f(x); }
__device__ __forceinline__ unsigned pack_half2(float lo, float hi) {
    unsigned d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));  // the first source goes to the upper half
    return d;
}
template <int N>
__device__ __forceinline__ void load_words(unsigned (&w)[N], const void* p) {
    if constexpr (N % 4 == 0) {
#pragma unroll
        for (int i = 0; i < N / 4; ++i) {
            const uint4 v = static_cast<const uint4*>(p)[i];
            w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
        }
    } else if constexpr (N == 2) {
        const uint2 v = *static_cast<const uint2*>(p);
        w[0] = v.x, w[1] = v.y;
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) w[i] = static_cast<const unsigned*>(p)[i];
    }
}
#define TC_SHARED_ARRAY(name, bytes) extern __shared__ uint4 name[]
#endif

__device__ __forceinline__ unsigned hmul2(unsigned a, unsigned b) { return hfma2_bits(a, b, FP16_MINUS_ZERO2); }
__device__ __forceinline__ unsigned hadd2(unsigned a, unsigned b) { return hfma2_bits(a, FP16_ONE2, b); }

// kvcal.quantizers.scale_in_use: max(stored scale, 2^-24) (fp16 bits 0x0001), both halves of a pair in one max.f16x2.
__device__ __forceinline__ unsigned clamp_scale_pair(unsigned s) { return hmax2_bits(s, 0x00010001u); }

// W consecutive floats x[e] (W = 1, 2 or 4, from a boundary of W) replaced by f(e, x[e]): one load and one store
template <int W, class F>
__device__ __forceinline__ void update_floats(float* at, F f) {
    static_assert(W == 1 || W == 2 || W == 4, "a float, a float2 or a float4");
    if constexpr (W == 4) {
        const float4 x = *reinterpret_cast<const float4*>(at);
        *reinterpret_cast<float4*>(at) = float4{f(0, x.x), f(1, x.y), f(2, x.z), f(3, x.w)};
    } else if constexpr (W == 2) {
        const float2 x = *reinterpret_cast<const float2*>(at);
        *reinterpret_cast<float2*>(at) = float2{f(0, x.x), f(1, x.y)};
    } else {
        *at = f(0, *at);
    }
}

// Q K^T's A fragment of k-steps 2j and 2j + 1 from the query's pairs (two per k-step): rows g hold k-step 2j and
// rows g + 8, unused by the heads (at most 8), k-step 2j + 1. Every pair sits in exactly one fragment, so no mma
// needs zero registers moved into place; the product with k-step 2j's keys is read from rows g of one accumulator
// and with k-step 2j + 1's from rows g + 8 of another.
template <int N>
__device__ __forceinline__ void two_step_fragment(unsigned (&a)[4], const unsigned (&pairs)[N], int j) {
    a[0] = pairs[4 * j], a[1] = pairs[4 * j + 2], a[2] = pairs[4 * j + 1], a[3] = pairs[4 * j + 3];
}

// Q K^T over every k-step with B fragments in registers (b: two pairs per k-step, in k order): rows g of `even`
// accumulate the even k-steps, rows g + 8 of `odd` the odd ones; the sum is even[0..1] + odd[2..3].
template <int N>
__device__ __forceinline__ void paired_k_steps(float (&even)[4], float (&odd)[4], const unsigned (&q)[N], const unsigned (&b)[N]) {
#pragma unroll
    for (int j = 0; j < N / 4; ++j) {
        unsigned a[4];
        two_step_fragment(a, q, j);
        const unsigned b_even[2] = {b[4 * j], b[4 * j + 1]}, b_odd[2] = {b[4 * j + 2], b[4 * j + 3]};
        mma_m16n8k16_f16(even, a, b_even);
        mma_m16n8k16_f16(odd, a, b_odd);
    }
}

// Q K^T with 16 tokens in M and the query heads in N, k0 and k1 the B-fragment pairs (two per k-step, as paired_k_steps
// reads them) of tokens g and g + 8, q the query's pairs: a query pair in two_step_fragment's rows g is head g's
// column of a B fragment, so q serves as it is. The even k-steps accumulate in `even`, the odd ones in `odd` (two
// chains of half the length); the sum is even + odd: rows g and g + 8 tokens g and g + 8, columns heads 2t, 2t + 1.
template <int N>
__device__ __forceinline__ void tokens_in_m_steps(float (&even)[4], float (&odd)[4], const unsigned (&k0)[N], const unsigned (&k1)[N],
                                                  const unsigned (&q)[N]) {
#pragma unroll
    for (int s = 0; s < N / 2; ++s) {
        const unsigned a[4] = {k0[2 * s], k1[2 * s], k0[2 * s + 1], k1[2 * s + 1]}, b[2] = {q[2 * s], q[2 * s + 1]};
        mma_m16n8k16_f16(s & 1 ? odd : even, a, b);
    }
}

// The halves i0 and i1 (compile-time after unrolling) of the word array w, as one pair {w[i0], w[i1]}.
template <int N>
__device__ __forceinline__ unsigned half_pair(const unsigned (&w)[N], int i0, int i1) {
    if (i1 == i0 + 1 && !(i0 & 1)) return w[i0 >> 1];  // a whole word (ptxas keeps a prmt of a word with itself)
    const unsigned selector = (unsigned)((i0 & 1) * 2) | (unsigned)((i0 & 1) * 2 + 1) << 4 | (unsigned)(4 + (i1 & 1) * 2) << 8 |
                              (unsigned)(5 + (i1 & 1) * 2) << 12;
    return prmt(w[i0 >> 1], w[i1 >> 1], selector);
}

// Word of the rope table holding lane part t's {cos, sin} pair of frequency pair q (key_channel's pairs < D/16) at
// offset delta: 16-byte quads of two pairs, [delta][quad][t][4], rows of D / 2 words with 16 words of padding after
// each odd row (rope_row_start), so that the two offsets a quarter-warp reads (g and g + 1, an even and the next odd
// one) fall in different banks, and a lane's loads are one base plus immediates.
template <int D>
__device__ __forceinline__ constexpr int rope_row_start(int delta) { return delta * (D / 2) + (delta + 1) / 2 * 16; }
template <int D>
__device__ __forceinline__ int rope_pair_word(int delta, int t, int q) {
    return rope_row_start<D>(delta) + ((q >> 1) * 4 + t) * 4 + 2 * (q & 1);
}

// BITS: the keys' code width, VBITS the values' (KVmix's and mixed layers' differ). PG: SKVQ's permuted channel groups
// (a scale and zero per token and group of channels, any channel in any group), 1 with fp16 parameters, 2 with fp8
// (e4m3) ones; 0 for the other codecs. GQA: the launch's query heads per KV head (the outliers' scratch holds theirs).
template <int D, int BITS, int KG, int VG, bool ROPE = false, bool CB = false, bool OUT = false, int VBITS = BITS, int PG = 0,
          int GQA = 8>
struct Shape {
    static constexpr bool FP16 = BITS == 16;
    // channel groups: each stage is dequantized into fp16 rows in shared memory (dequantize_stage), which the fp16
    // variants' ldmatrix path then reads: a lane's channels fall in groups that vary per channel and token, which no
    // folding into the query or P covers
    static constexpr bool GROUPS = PG != 0;
    static constexpr bool ROWS16 = FP16 || GROUPS;  // the scores and P V read fp16 rows
    static constexpr int WIDEST = BITS > VBITS ? BITS : VBITS;  // the wider side's width sizes the stages
    static constexpr int KB = CB || GROUPS ? 1 << 24 : KG;  // tokens per key block (codebooks: the whole sequence)
    // tokens per iteration of the block (BLOCK_ST), TPW of them per warp. The uniform codes with post-RoPE keys take 128
    // (int2 in key blocks of 32, 64 or a multiple of 128 tokens, int4 in blocks of 32 or 64): a stage's fixed work (the
    // barrier, the copies' addresses, the key blocks' parameters, the softmax's reductions) is spread over twice the
    // tokens. int4 in blocks of 128+ stays at 64: the 3 stages of 128 its shared memory allows keep 2 in flight, fewer
    // bytes than 5 of 6 stages of 64, and on the H100 it waited on its copies (ncu long_scoreboard 31% of stalls) and
    // ran 9% slower (157.3 us against 145.0); int4 g32 ran 8% faster wide (182.0 against 197.9). The others stay at 64:
    // the outlier tiles (OUT_TILE), the rotation table's rows (ROPE) and the codebook variants' shared memory are sized
    // by it
    static constexpr bool WIDE = !FP16 && !ROPE && !CB && KG > 0 && (KG == 32 || KG == 64 || (WIDEST == 2 && KG % 128 == 0));
    // packed codes stream warp-private pipelines: warp w owns a contiguous quarter of the split and copies, waits for
    // and computes only its own tokens, TPW a stage, behind __syncwarp: no barrier of the block's warps in the loop (the
    // H200 profile of int2 g128 at 94c61ae: 15.9% of stall samples at the block's barrier); each warp makes its own key
    // block's Q' once a block, (pre-RoPE keys) rotates its own query every BLOCK_ST tokens and (outliers) corrects its
    // own outlier tiles. The others share work across warps each stage (the dequantized fp16 rows of channel groups),
    // or rotate the query at head_dim 256, where a lane's rotation tasks would span several frequency pairs' state,
    // past its registers; fp16 rows stream at bandwidth already
    static constexpr bool PRIVATE = !FP16 && !GROUPS && !(ROPE && D > 128);
    static constexpr int BLOCK_ST = WIDE ? 128 : 64, TPW = BLOCK_ST / WARPS;  // tokens per iteration: the block's, a warp's
    static constexpr int ST = PRIVATE ? TPW : BLOCK_ST;  // tokens per stage buffer (PRIVATE: a warp's own)
    static constexpr int RINGS = PRIVATE ? WARPS : 1;    // pipelines of STAGES buffers
    // (outliers: 5 a warp, the most its ring of two outlier tiles allows (OUT_AREAS); 4 in flight still hold > 16 KiB
    // per SM; at head_dim 256 (the block's pipeline), 3, so that a block of nuq3 fitted an A100's 163 KB, and 2 where a
    // side is nuq4 (its padded rows): one stage in flight while one is computed)
    // (nuq4: 5, so that 2 blocks of its padded rows (SROW) still fit an A100's 164 KB)
    // (WIDE: fewer stages of twice the tokens, int2 4 and int4 3: an H100 holds 4 and 3 blocks, an A100 3 and 2; int2
    // g128 at 5 blocks (96 registers, spilling) ran 10% slower on the H100: 123.2 us against 112.2)
    // (fp16 at head_dim 256: 2, 128 KiB, so that a block fits an A100's 164 KB)
    static constexpr int OUT_STAGES = PRIVATE ? 5 : WIDEST == 4 ? 2 : 3;
    // (channel groups: 4, 2 at head_dim 256, beside the fp16 rows of one stage)
    // (pre-RoPE codebooks at head_dim 256: 3 where a side is nuq4, else 5, so that two blocks (8 warps) fit an SM of
    // sm_90 beside the rotation table, where 5-8 stages left one block alone on it)
    // (the most a pipeline takes: at head_dim 256 a private one may take fewer, TWO_BLOCK_STAGES below)
    static constexpr int MOST_STAGES = FP16 ? (D == 256 ? 2 : 3) : GROUPS ? (D == 256 ? 2 : 4) : WIDE ? (WIDEST == 4 ? 3 : 4) : OUT ? OUT_STAGES :
                                       ROPE && CB && D == 256 ? (WIDEST == 4 ? 3 : 5) : (WIDEST == 4 ? (CB ? 5 : 6) : 8);
    static constexpr int KROW = D * BITS / 8, VROW = D * VBITS / 8;  // bytes of one token's head row of keys, of values
    // keys: blocks of KG tokens a stage touches; values: channel groups of the head (VGE channels each)
    static constexpr int KBLOCKS = FP16 ? 0 : (KB >= ST ? 1 : ST / KB);
    static constexpr int VGE = FP16 ? D : (VG >= D ? D : VG), VGROUPS = FP16 ? 1 : D / VGE;
    static constexpr int LANE_V = VGE / 8;  // value channels a lane owns per group (M rows g and g + 8 of VGE / 16 m-tiles)
    // shared memory's row stride. nuq4's 64-byte rows get 16 bytes of padding, so that rows 2 apart start in different
    // banks: its value loads of rows 2t (t < 4) were 4-way bank conflicts, and nuq4 is bound by shared-memory
    // wavefronts (H100, ncu: L1 87% busy; padded, 13% fewer wavefronts and 3.6% faster). Not for the uniform codes:
    // int4 g128 went 10% slower padded (fewer wavefronts, but its L1 was half idle), int2 g128 2%
    static constexpr int KSROW = CB && BITS == 4 ? KROW + 16 : KROW, VSROW = CB && VBITS == 4 ? VROW + 16 : VROW;
    static constexpr int K_BYTES = ST * KSROW, V_BYTES = ST * VSROW, CODE_BYTES = K_BYTES + V_BYTES;
    // [block][scale, zero][D] fp16 per stage; codebook keys' are the whole sequence's: one copy (CB_KP_BYTES)
    static constexpr int KP_BYTES = FP16 || CB || GROUPS ? 0 : KBLOCKS * 2 * D * 2;
    // channel groups: per side the stage's [scale, zero][slot][token] parameters of the head's groups (GROUP_SLOTS at
    // most: kvcal.runtime.tensor_core.group_tables says which), each run padded by 16 bytes so that the runs of different
    // slots a warp reads at one token start in different banks
    static constexpr int GROUP_SLOTS = 16, PARAM_BYTES = PG == 2 ? 1 : 2, GROUP_RUN = ST * PARAM_BYTES + 16;
    static constexpr int GP_BYTES = GROUPS ? 2 * 2 * GROUP_SLOTS * GROUP_RUN : 0;
    // [scale, zero][group][token] fp16: uniform codes copy each group's run of the stage's tokens (kvcal.runtime.store
    // keeps a per-token parameter column along the tokens), 16-byte chunks of 8 tokens
    static constexpr int VP_HALVES = FP16 ? 0 : 2 * VGROUPS * ST;
    // codebooks: kvcal.quantizers.denormalize's scale and zero per token (fp32), made from the row's lo and hi
    static constexpr int VP_BYTES = CB ? ST * 8 : GROUPS ? GP_BYTES : (VP_HALVES * 2 + 15) / 16 * 16;
    static constexpr int STAGE_BYTES = K_BYTES + V_BYTES + KP_BYTES + VP_BYTES;
    // outliers (OUT): an outlier tile's area, its header (tc::OutlierHeader), then per side OUT_SLOTS positions and
    // OUT_SLOTS values (uint16 / fp16), copied from the 16-byte chunk that holds lo on, with the tile's first stage.
    // TILE_STAGES of a pipeline's stages make a tile: the block's one, or (PRIVATE) 4 of its warp's. Areas per
    // pipeline (OUT_AREAS): one a stage buffer, or (PRIVATE) a ring of two tiles', written STAGES - 1 stages ahead
    static constexpr int OUT_SLOTS = OUT ? 192 : 0;
    static constexpr int OUT_BYTES = OUT ? 32 + 2 * 2 * OUT_SLOTS * 2 : 0;
    static constexpr int TILE_STAGES = OUT ? OUT_TILE / ST : 1;
    static constexpr int MERGE_BYTES = WARPS * (8 * D + 16 + 8 * VGROUPS) * 4;
    // the unscaled query fragments, [pair][lane] words, reread when a key block's Q' is made (not kept in registers)
    static constexpr int Q_BYTES = FP16 || ROPE ? 0 : D / 8 * 32 * 4;
    // pre-RoPE keys: the query rotated to a position as A fragments, buffers of [pair / 4][lane][4] words (q_stage_word):
    // the block's two by stage parity (rotated to each stage's first position), or (PRIVATE) one per warp (rotated every
    // ROTATE_EVERY of its stages, to the first position of their BLOCK_ST tokens)
    static constexpr int QSTAGE_WORDS = ROPE ? D / 8 * 32 : 0, QSTAGE_BUFFERS = PRIVATE ? WARPS : 2;
    static constexpr int ROTATE_EVERY = BLOCK_ST / ST;
    // pre-RoPE keys: the table of {cos, sin} (delta theta) pairs for delta < BLOCK_ST (rope_pair_word)
    static constexpr int ROPE_TABLE_BYTES = ROPE && !GROUPS ? (BLOCK_ST * (D / 2) + BLOCK_ST / 2 * 16) * 4 : 0;  // rope_row_start(BLOCK_ST)
    // codebooks and 3-bit codes in planes3 (channel groups aside: they read theirs as they dequantize a stage) look
    // their 2^bits entries up in registers from byte planes (EntryPlanes: 2^bits / 2 words a side, keys' then values',
    // each from a 16-byte boundary, made from the codebooks; uniform 3-bit codes' code values 0..7 are constants,
    // Uniform3Table). Shared-memory tables of the entries' pairs had cost a wavefront or more a lookup: 1.97 and 3.51
    // a warp's lookup for one 3- and 4-bit copy
    static constexpr bool PLANES3 = !GROUPS && (BITS == 3 || VBITS == 3);
    static constexpr int KEY_PLANE_WORDS = !GROUPS && CB ? (1 << BITS) / 2 : 0;
    static constexpr int VALUE_PLANE_WORDS = !GROUPS && CB ? (1 << VBITS) / 2 : 0;
    static constexpr int VALUE_PLANES_AT = (KEY_PLANE_WORDS + 3) / 4 * 4;
    static constexpr int PLANE_WORDS = VALUE_PLANES_AT + (VALUE_PLANE_WORDS + 3) / 4 * 4;
    static constexpr int CB_KP_BYTES = CB ? 2 * D * 2 : 0;  // [scale, zero][D] fp16, copied once
    static constexpr int PLACES_BYTES = PLANES3 ? 32 * 2 * 16 : 0;  // [lane][keys, values] Planes3Place
    // pre-RoPE keys at head_dim 256: a lane's scale and zero pairs (2 x D / 8 words) do not fit in registers beside
    // the rest (ptxas spilled them); codebook keys' one block keeps them in shared memory, [scale, zero][pair / 4][t][4]
    // words (key_pair_word), made once, and a lane reloads them per part of a rotated key, 16 bytes a load
    static constexpr bool KEY_PAIRS_SHARED = ROPE && D == 256 && !GROUPS;
    static constexpr int KEY_PAIRS_BYTES = KEY_PAIRS_SHARED ? 2 * (D / 8) * 4 * 4 : 0;
    // channel groups: the computed stage's keys (rotated by their offset in the stage) and values as fp16 rows, in
    // the fp16 variants' swizzled layout
    static constexpr int ROW16 = D * 2, WORK_BYTES = GROUPS ? 2 * ST * ROW16 : 0;
    // a block's shared memory but its stage buffers and outlier scratch
    static constexpr int FIXED_BYTES = Q_BYTES + QSTAGE_BUFFERS * QSTAGE_WORDS * 4 + ROPE_TABLE_BYTES + PLANE_WORDS * 4 + CB_KP_BYTES +
                                       PLACES_BYTES + KEY_PAIRS_BYTES + WORK_BYTES;
    // At head_dim 256 a private pipeline (post-RoPE codes: no outliers) takes no more stages than let two blocks (8
    // warps) share an SM of sm_90 (228 KB, 1 KB reserved a block), where that leaves it 3 or more: int4 in key blocks
    // of 128 took 6, 130 KB, one block of 4 warps alone on an SM, where each warp's stalls idle its scheduler; in 5, 8
    // warps keep 4 stages each in flight. The wide int4 ones keep 3 (one block): 2 would leave a warp one in flight
    static constexpr int TWO_BLOCK_STAGES = (228 * 1024 / 2 - 1024 - FIXED_BYTES) / (RINGS * STAGE_BYTES);
    static constexpr int STAGES =
        D == 256 && PRIVATE && TWO_BLOCK_STAGES >= 3 && TWO_BLOCK_STAGES < MOST_STAGES ? TWO_BLOCK_STAGES : MOST_STAGES;
    static constexpr int OUT_AREAS = PRIVATE ? 2 : STAGES;
    // outliers: the pipelines' outlier areas; per pipeline its tile's key outliers' score corrections [head][token]
    // (int, fixed point), the tile's P [head][token] (fp16) and where its slices' value outliers start (32 bytes); per
    // warp the value outliers' corrections of its output [warp][D][head] (fp32); per key channel 4 floats (decode_tc's
    // key_extremes); the two sides' OutlierRun (in shared memory, not in registers). GQA heads, not M's 8 rows: at
    // head_dim 256 the padding rows' 17.5 KB kept nuq3 / nuq4 / nuq2 with outliers to one block per SM on sm_90
    static constexpr int OUT_SCRATCH_BYTES =
        OUT ? RINGS * (OUT_AREAS * OUT_BYTES + GQA * OUT_TILE * (4 + 2) + 32) + WARPS * GQA * D * 4 + 4 * D * 4 + 2 * 32 : 0;
    static constexpr int PIPE_BYTES = RINGS * STAGES * STAGE_BYTES + FIXED_BYTES + OUT_SCRATCH_BYTES;
    static constexpr int SMEM_BYTES = PIPE_BYTES > MERGE_BYTES ? PIPE_BYTES : MERGE_BYTES;
    // resident blocks per SM the register allocation must allow (ptxas caps registers at 65536 / (128 * MIN_BLOCKS)):
    // fp16 is held to 2 by its shared memory; the packed g128 variants fit 128 registers (4 blocks, 16 warps); pre-RoPE
    // keys at D = 128 hold the block's scale and zero pairs (32 registers) besides the rotated query: 2; at D = 256
    // shared memory holds every post-RoPE uniform variant to 2 blocks of sm_90 at most: 2 (3 had ptxas spill int3 keys
    // in key blocks of 128 on sm_80 at 168 registers) (KB < BLOCK_ST: key blocks of 32 or 64 tokens, whose Q' a warp
    // remakes every iteration or two)
    static constexpr int MIN_BLOCKS =
        FP16 || OUT || GROUPS || (ROPE && D >= 128) || D == 256 ? 2
                                                                             : (ROPE || KB < BLOCK_ST || VGROUPS > 1 || LANE_V * VBITS > 32 ? 3 : 4);
    static_assert(!OUT || (CB && ROPE), "outliers: codebook codes (KVQuant's dense-and-sparse) with pre-RoPE keys");
    static_assert(!OUT || BLOCK_ST == OUT_TILE, "outliers: a block's stage is one outlier tile, four stages of a warp's one");
    static_assert(!OUT || STAGES - 1 <= TILE_STAGES * (OUT_AREAS - 1), "a tile's area is rewritten only past its last reads");
    static_assert(!OUT || VGE == D, "outliers: one value scale per token (the value corrections read it)");
    static_assert(!OUT || MERGE_BYTES <= PIPE_BYTES - OUT_SCRATCH_BYTES, "the warps' merge leaves the value corrections alone");
    static_assert(D == 64 || D == 128 || D == 256, "head_dim 64, 128 or 256");
    static_assert(!KEY_PAIRS_SHARED || CB, "pre-RoPE keys at head_dim 256: codebook codes (one key block)");
    static_assert(FP16 || BITS == 4 || BITS == 3 || BITS == 2 || (GROUPS && BITS == 1), "fp16, 4-, 3- or 2-bit codes (channel groups: 1 too)");
    static_assert(FP16 == (VBITS == 16) && (FP16 || VBITS == 4 || VBITS == 3 || VBITS == 2 || (GROUPS && VBITS == 1)),
                  "values: fp16 with fp16 keys, or codes");
    static_assert(FP16 || (KB > 0 && KB % TPW == 0 && (KB >= ST ? KB % ST == 0 : ST % KB == 0)), "key blocks of a multiple of 16 tokens");
    static_assert(!CB || (BITS != 16 && VG == D), "codebooks: 4-, 3- or 2-bit codes; one value threshold pair per token");
    static_assert(BITS != 3 || CB || GROUPS || !ROPE, "3-bit uniform keys: post-RoPE (KVmix's)");
    static_assert(FP16 || (VG % D == 0 || D % VG == 0), "value groups cover whole heads or divide them");
    static_assert(FP16 || LANE_V * VBITS >= 8, "a lane's value channels per group must fill a byte (groups of 32 channels or more)");
    static_assert(VBITS != 3 || LANE_V >= 4, "3-bit values: at least an eighth of a planes3 unit a lane");
    static_assert(!GROUPS || (ROPE && !CB && !OUT && VG == D), "channel groups: SKVQ's pre-RoPE keys, 1- to 4-bit codes");
    static_assert(!ROPE || (!FP16 && (D * BITS >= 256 || BITS == 3 || CB || GROUPS)),
                  "pre-RoPE keys: packed codes, a lane's D / 8 channels in whole words (planes3: in whole quarter-units; "
                  "2-bit codebooks: half-words)");
};

// One side's rows of a stage, `live` of its ST tokens, from tile (rows `stride` bytes apart) into dst (rows SROW bytes
// apart), ROW bytes each, by COPIERS threads (the block's, or a warp's lanes for its own stage; `copier` numbers them)
// in 16-byte cp.async chunks (8-byte ones for nuq3's 24-byte rows at head_dim 64), zero-filled past live.
// Compile-time trip counts: every thread's copies unroll into straight-line code, offsets within a stage in 32 bits.
// fp16 rows are read by ldmatrix: their chunks XOR-swizzled by token % 8 (no bank conflicts).
template <int ST, int ROW, int SROW, bool SWIZZLE, int COPIERS>
__device__ __forceinline__ void copy_rows(unsigned char* dst, const unsigned char* tile, int stride, int live_tokens, int copier) {
    constexpr int C = ROW % 16 ? 8 : 16, CHUNKS = ROW / C, COPIES = ST * CHUNKS;
#pragma unroll
    for (int i = 0; i < (COPIES + COPIERS - 1) / COPIERS; ++i) {
        const int c = copier + i * COPIERS;
        if (COPIES % COPIERS == 0 || c < COPIES) {
            const int token = c / CHUNKS, chunk = c % CHUNKS;
            const bool live = token < live_tokens;
            const int place = SWIZZLE ? (chunk ^ (token & 7)) : chunk;
            const unsigned char* const src = live ? tile + (token * stride + chunk * C) : tile;
            if constexpr (C == 16) cp_async_16(dst + token * SROW + place * C, src, live ? 16 : 0);
            else cp_async_8(dst + token * SROW + place * C, src, live ? 8 : 0);
        }
    }
}

// Position, among a lane's consecutive key codes, of element e of its pair p: the converters' order ({j, j + 8} of
// a word of 8 int4 codes, {j, j + 16} of int2) or the tables' (codebooks, 3-bit codes: pairs of neighbours).
template <int BITS, bool CB>
__device__ __forceinline__ constexpr int pair_code(int p, int e) {
    constexpr int CODES = 32 / BITS, HALF = CODES / 2;
    return CB || BITS == 3 ? 2 * p + e : (p / HALF) * CODES + p % HALF + e * HALF;
}

// Channel of lane t's key pair p, element e (the k index of both Q K^T operands).
template <int D, int BITS, bool ROPE = false, bool CB = false>
__device__ __forceinline__ int key_channel(int t, int p, int e) {
    if constexpr (BITS == 16) {
        return 16 * (p >> 1) + 8 * (p & 1) + 2 * t + e;  // ldmatrix order: k-step p / 2, register p % 2
    } else if constexpr (ROPE) {  // pairs 0 .. D/16 - 1: channels [t D/8, (t+1) D/8); the rest: the same + D/2
        constexpr int PART = D / 16;
        return (p / PART) * (D / 2) + t * (D / 8) + pair_code<BITS, CB>(p % PART, e);
    } else {
        return t * (D / 4) + pair_code<BITS, CB>(p, e);  // lane t's D / 4 channels
    }
}

// Codes -> fp16 pairs: the magic-number converters (uniform codes: code values; RAW: their lop3 half, BASE + code
// * 2^raw_shift: 1024 + ..., or with FP16_SUBNORMAL code * 2^(raw_shift - 24)), or codebook values of a field's two
// codes from the codebook's planes (N: the word's first N pairs, 16 / BITS of them by default).
template <int BITS, bool CB, bool RAW = false, int N = 16 / BITS, unsigned BASE = magic::FP16_1024>
__device__ __forceinline__ void codes_to_half2(unsigned word, unsigned* out, const EntryPlanes<(1 << BITS)>* planes = nullptr) {
    if constexpr (CB) {
        table_fields<N>(*planes, word, out);
    } else if constexpr (RAW) {
        if constexpr (BITS == 4) raw_nibbles<4, BASE>(word, out); else raw_u2<BASE>(word, out);
    } else {
        unsigned pairs[16 / BITS];
        if constexpr (BITS == 4) u4_to_half2(word, pairs); else u2_to_half2(word, pairs);
#pragma unroll
        for (int j = 0; j < 16 / BITS; ++j) out[j] = pairs[j];
    }
}

// A task of the per-stage query rotation (pre-RoPE keys; GQA x D / 4 of them): its head, lane part (the t of the
// lanes that read it) and frequency pair (key_channel's pairs < D/16).
struct RopeTask {
    int head, part, pair;
};
template <int D>
__device__ __forceinline__ RopeTask rope_task(int task) { return {task / (D / 4), task % (D / 4) / (D / 16), task % (D / 16)}; }

// Word of a stage's query fragments (Shape::QSTAGE_WORDS) holding lane `lane`'s pair p: [p / 4][lane][4] in
// two_step_fragment's order (pairs 4j, 4j + 2, 4j + 1, 4j + 3), so that one 16-byte load is one A fragment.
__device__ __forceinline__ int q_stage_word(int p, int lane) { return ((p >> 2) * 32 + lane) * 4 + ((p & 1) << 1 | (p >> 1 & 1)); }

// Word of the key pairs table (Shape::KEY_PAIRS_SHARED) holding lane part t's pair p: [p / 4][t][4], so that
// a lane's pairs 4j .. 4j + 3 are one 16-byte load and the four parts' loads fall in different banks.
__device__ __forceinline__ int key_pair_word(int p, int t) { return ((p >> 2) * 4 + t) * 4 + (p & 3); }

// cos and sin of the angle position * inv_freq, exact in double (below 2^29 positions) and reduced modulo 2 pi there,
// so that the fast sincos sees |x| <= pi at any position.
__device__ __forceinline__ void exact_cos_sin(int position, float inv_freq, float* c, float* s) {
    const double two_pi = 6.283185307179586476925287, angle = (double)position * (double)inv_freq;
    __sincosf((float)(angle - rint(angle * (1.0 / two_pi)) * two_pi), s, c);
}

// Output channel of value m-tile mt, row g + 8 r.
template <int D, int BITS, int VGE>
__device__ __forceinline__ int value_channel(int g, int mt, int r) {
    if constexpr (BITS == 16) {
        return 16 * mt + 8 * r + g;
    } else {
        constexpr int MPG = VGE / 16, LANE_V = VGE / 8;
        return (mt / MPG) * VGE + g * LANE_V + 2 * (mt % MPG) + r;
    }
}

// One side's outliers of the block's (sequence, KV head) (kvcal/packing.py): positions (uint16: token in the tile of
// ST rows x D + channel) and fp16 values in append order, the offset table per tile, the count; tiles: those started.
struct OutlierRun {  // 32 bytes
    const unsigned short* positions;
    const unsigned short* values;
    const int* offsets;
    int count, tiles;
};
static_assert(sizeof(OutlierRun) == 32, "Shape's OUT_SCRATCH_BYTES holds two");
struct OutlierRange {
    int lo, hi;
};
// A stage's outliers in its copies (the 16-byte chunks of each side from the one that holds lo): per side the first
// global index copied (base = lo rounded down to 8) and [first, end) = [lo, hi) - base; crowded: a side holds more than
// one round of the patch pass (THREADS). 32 bytes at the head of the stage's outlier area.
struct OutlierHeader {
    int k_first, k_end, v_first, v_end, k_base, v_base, crowded, unused;
};

// rows: the store's rows from row 0; first: the row the kernel reads first, a tile's (the run's tiles count from it).
__device__ __forceinline__ OutlierRun outlier_run(const unsigned short* positions, const unsigned short* values, const int* offsets,
                                                  const int* counts, long long run, long long stride, long long offset_stride,
                                                  int rows, int first) {
    OutlierRun r{positions + run * stride, values + run * stride, offsets + run * offset_stride + first / OUT_TILE, 0, 0};
    if (counts != nullptr) r.count = __ldg(counts + run), r.tiles = (rows + OUT_TILE - 1) / OUT_TILE - first / OUT_TILE;
    return r;
}

// Outliers [lo, hi) of tile `tile`: the offset table, the last started tile's end at the count; none past it.
__device__ __forceinline__ OutlierRange outlier_range(const OutlierRun& r, int tile) {
    if (tile >= r.tiles) return {0, 0};
    return {__ldg(r.offsets + tile), tile + 1 < r.tiles ? __ldg(r.offsets + tile + 1) : r.count};
}

// The two fp8 e4m3 (finite) bytes in x's low 16 bits -> an fp16 pair {byte 0, byte 1}: each one's 7 magnitude bits
// placed as an fp16's (exponent bias 15 against 7), times 2^8 (0x5C00); exact, subnormals included.
__device__ __forceinline__ unsigned e4m3_pair_by_half(unsigned x) {
    const unsigned spread = prmt(x, 0u, 0x4140u);  // bytes: x's byte 0, 0, x's byte 1, 0
    return hmul2(lop3<magic::AND_OR>(spread << 7, 0x3F803F80u, (spread << 8) & 0x80008000u), 0x5C005C00u);
}

// the shared bytes merge_when_last takes: MERGE_FLAG_BYTES for its flag, then merge::merge_splits' scratch
constexpr int MERGE_FLAG_BYTES = 64;
template <int GQA, int D>
constexpr int MERGE_SMEM_BYTES = MERGE_FLAG_BYTES + merge::Columns<GQA, D, THREADS>::SCRATCH_BYTES;

// The fused split merge: each block arrives at its (sequence, KV head)'s counter (arrivals[run]) once its split is
// written; the last of the launch's blocks to arrive merges every split slot of the KV head's GQA query heads into
// out (the slots earlier launches wrote are done: they ran before this one on the stream) and sets the counter back
// to 0 for the next launch. smem: MERGE_SMEM_BYTES of shared memory no thread reads any more: the block's flag (is
// it the last?) in the first word, the merge's scratch MERGE_FLAG_BYTES on (a thread may still read the flag when
// another writes the scratch).
template <int GQA, int D>
__device__ __forceinline__ void merge_when_last(const float* out_partial, const float* lse_partial, float* out,
                                                unsigned* arrivals, int kv_heads, int total_splits, unsigned char* smem) {
    unsigned* const flag = reinterpret_cast<unsigned*>(smem);
    const long long run = (long long)blockIdx.z * kv_heads + blockIdx.y;  // (sequence, KV head)
    __threadfence();  // this thread's writes of the split are visible device-wide before the block counts as arrived
    __syncthreads();
    if (threadIdx.x == 0) {
        const bool last = atomicAdd(arrivals + run, 1u) == gridDim.x - 1;
        if (last) arrivals[run] = 0u;
        *flag = last;
    }
    __syncthreads();
    if (!*flag) return;
    __threadfence();  // acquire: the loads below see every split the arrivals counted (the PTX memory model's fence-fence
                      // synchronization through the counter), not lines an earlier read left in this SM's L1
    merge::merge_splits<GQA, D, THREADS>(out_partial, lse_partial, out, run, total_splits, reinterpret_cast<float*>(smem + MERGE_FLAG_BYTES));
}

// A segment block: segments::attend_rows into slot `slot` (row_first: its rows' first tokens, or null), then the fused merge.
template <int GQA, int D, bool ROPE, int KCODEC, int VCODEC, int KLAYOUT, int VLAYOUT>
__device__ __forceinline__ void segment_block(const float* query, const long long* descriptor, const int* meta, const int* positions,
                                           const float* inv_freq, float* out_partial, float* lse_partial, int kv_heads, int split,
                                           long long slot, int total_splits, float scale_log2, float softcap_log2, float* out,
                                           unsigned* arrivals, const int* row_first, unsigned char* smem) {
    segments::attend_rows<GQA, D, ROPE, KCODEC, VCODEC, KLAYOUT, VLAYOUT>(query, descriptor, meta, positions, inv_freq, out_partial, lse_partial,
                                                        blockIdx.z, blockIdx.y, kv_heads, split, slot, total_splits, scale_log2,
                                                        softcap_log2, row_first, smem);
    if (out != nullptr)
        merge_when_last<GQA, D>(out_partial, lse_partial, out, arrivals, kv_heads, total_splits, smem);
}

}  // namespace tc

// query (batch, heads, D) float32; keys / values: fp16 rows (batch, capacity, kv_heads * D) or int32 words
// (kvcal.runtime.store.PackedRows: (batch, capacity, kv_heads, a KV head's words), rows whole or each KV head's rows
// together); *_seq / *_head / *_row: strides of a sequence, a KV head's piece (its D channels of a row) and a row in
// bytes. Key block parameters
// (batch, capacity / KG, kv_heads * D) fp16, strides in halves; value token parameters fp16 stored (batch, groups,
// capacity) (kvcal.runtime.store: each group's column along the tokens), strides of a sequence and a group in halves,
// multiples of 8 (8 tokens' are one 16-byte chunk; codebooks: keys' per-channel scale and zero, strides 0; values'
// per-token lo and hi of the whole row, one group). meta (batch, META) int32: the keys' first row, tokens, position of
// the first row (ROPE), the key and value bodies' rows from row 0 (OUT: their started outlier tiles), the first of the
// tokens the query sees (a sliding window, or a body's live rows past the first row; the ones before weigh nothing),
// the values' first row. A packed body's first rows are multiples of its key blocks and outlier tiles, so that the
// parameter chunks and tiles are aligned.
// OUT: per side the outliers of kvcal.runtime.store (batch, kv_heads, capacity) positions and values, (batch,
// kv_heads, tiles) offsets, (batch, kv_heads) counts (null: that side keeps none), strides per (sequence, KV head) run
// in elements. ROPE: inv_freq (D / 2) float32 and rope_table (rope_row_start(ST)) words, the shared-memory image of
// rope_pair_word's table.
// CB: codebooks, the keys' and then the values' CODEBOOK_WORDS entries (codebook_entries); PG: in their place the channel group
// tables (tensor_core.group_tables), the keys' per-token parameters in key_scale / key_zero as the values' (strides
// kp_seq / kp_row of a sequence and a group's run, in elements: fp8 ones are bytes). per_split tokens
// (a multiple of ST) per split. scale_log2: the score scale times log2(e); softcap_log2 > 0: the scores soft-capped
// there (tc::soft_capped, in log2 units), 0: not capped. out_partial (batch, heads, total_splits, D) float32, normalised; lse_partial
// (batch, heads, total_splits) in log2 units; this launch's splits are slots split_offset .. (a layer's other launches
// fill the others: kvcal.runtime.kernels.prepare_decode). out (batch, heads, D) float32: where not null, the
// launch merges all total_splits slots into it (tc::merge_when_last; arrivals (batch, kv_heads) uint32, zero before
// the launch and after it). The grid's last segment_splits blocks along x are segment blocks: they attend the
// launch's other tokens (segments::attend_rows over the decode launch's descriptor and meta, segment_positions the
// position of each sequence's first stored token) into the slots after the body's splits.
// row_first: null, or (2, batch, heads) int32 where each query row sees tokens of its own (a step of several queries a
// sequence under a sliding window or chunk, as more query heads): per row its first body row it sees (meta's field
// of the sequence's, which is the least of its rows'), then its first token in the segment blocks' numbering.
template <int D, int BITS, int KG, int VG, int GQA, bool ROPE, bool CB, bool OUT, int VBITS = BITS, int PG = 0>
__global__ void __launch_bounds__(tc::THREADS, tc::Shape<D, BITS, KG, VG, ROPE, CB, OUT, VBITS, PG, GQA>::MIN_BLOCKS) decode_tc(
    const float* __restrict__ query, const unsigned char* __restrict__ keys, const unsigned char* __restrict__ values,
    const unsigned short* __restrict__ key_scale, const unsigned short* __restrict__ key_zero,
    const unsigned short* __restrict__ value_scale, const unsigned short* __restrict__ value_zero, const int* __restrict__ meta,
    const float* __restrict__ inv_freq, const unsigned* __restrict__ rope_table, const unsigned* __restrict__ codebooks,
    float* __restrict__ out_partial, float* __restrict__ lse_partial, const unsigned short* __restrict__ key_outlier_positions,
    const unsigned short* __restrict__ key_outlier_values, const int* __restrict__ key_outlier_offsets,
    const int* __restrict__ key_outlier_counts, const unsigned short* __restrict__ value_outlier_positions,
    const unsigned short* __restrict__ value_outlier_values, const int* __restrict__ value_outlier_offsets,
    const int* __restrict__ value_outlier_counts, long long k_seq, long long k_head, long long k_row, long long v_seq,
    long long v_head, long long v_row,
    long long kp_seq, long long kp_row, long long vp_seq, long long vp_group, long long k_outlier_run, long long k_offset_run,
    long long v_outlier_run, long long v_offset_run, int kv_heads, int per_split, int split_offset, int total_splits,
    float scale_log2, float softcap_log2, float* __restrict__ out, unsigned* __restrict__ arrivals,
    const long long* __restrict__ segment_descriptor,
    const int* __restrict__ segment_meta, const int* __restrict__ segment_positions, int segment_splits,
    const int* __restrict__ row_first) {
    using namespace tc;
    using S = Shape<D, BITS, KG, VG, ROPE, CB, OUT, VBITS, PG, GQA>;
    constexpr int ST = S::ST, TPW = S::TPW;  // tokens per stage, and per warp of a stage
    constexpr int NT = TPW / 8, KT = TPW / 16;  // a warp's n-tiles of 8 tokens (Q K^T) and k-steps of 16 (P V)
    // uniform codes are read raw (codes_to_half2's lop3 half): post-RoPE keys as 1024 + code * 2^s, all values as fp16
    // subnormals, code * 2^(s - 24), exact and without an offset: the output's accumulators hold no 1024s to take out
    // (their sums truncate to the largest term, so 1024s there would cost the codes' bits)
    constexpr bool RAW = !S::ROWS16 && !CB;
    constexpr bool KEY_RAW = RAW && BITS != 3, VALUE_RAW = RAW && VBITS != 3;  // 3-bit codes come from their table as code values
    constexpr unsigned VALUE_BASE = magic::FP16_SUBNORMAL;
    constexpr int META = 7;  // meta's fields per sequence
    static_assert(GQA >= 1 && GQA <= 8, "1 to 8 query heads per KV head");
    constexpr int PAIRS = D / 8;  // key fragment registers per lane (two per k-step)
    constexpr int KEY_ORDER = S::ROWS16 ? 16 : BITS;  // the channel order of the keys' B fragments (key_channel)
    constexpr int KSTEPS = D / 16, MTILES = D / 16;
    // warp-private pipelines of post-RoPE uniform codes put a k-step's 16 tokens in M and the GQA group in N
    // (tokens_in_m_steps): half the mma of heads in M with paired k-steps (paired_k_steps, whose rows carry at most 8
    // heads a k-step), for the price of a movmatrix per 8 tokens to make P's B fragments. A lane's scores are then heads
    // 2t and 2t + 1's (HL of them), as its output columns are, where the other layout gives it head g's. Pre-RoPE keys
    // keep heads in M (the rotation works on one token's row at a time), codebooks their lookups' fragment order
    constexpr bool TOKENS_IN_M = S::PRIVATE && !ROPE && !CB;
    constexpr bool ROTATED_KEYS = ROPE && !S::ROWS16;  // pre-RoPE codes rotated in registers, per part of the channels
    constexpr int HL = TOKENS_IN_M ? 2 : 1;
    // the lanes that hold a head's other tokens are the lane's xor partners HEAD_LANES_FROM, 2 HEAD_LANES_FROM, ...
    // below HEAD_LANES_TO: those of its t (tokens in M), or of its g
    constexpr int HEAD_LANES_FROM = TOKENS_IN_M ? 4 : 1, HEAD_LANES_TO = TOKENS_IN_M ? 32 : 4;
    TC_SHARED_ARRAY(smem_words, S::SMEM_BYTES);
    unsigned char* const smem = reinterpret_cast<unsigned char*>(smem_words);

    if ((int)blockIdx.x >= (int)gridDim.x - segment_splits) {  // a segment block: the rows beside the served body
        static_assert(segments::SHARED_BYTES<GQA, D> <= S::SMEM_BYTES, "the segment blocks work in the body's shared memory");
        static_assert(MERGE_SMEM_BYTES<GQA, D> <= S::SMEM_BYTES, "the fused merge works in the body's shared memory");
        // uniform bodies (KIVI's, KVmix's) may hold rows past the served ones on one side, their codes in the layout
        // numbered as their width (LSB2, PLANES3, LSB4); the others' rows are fp16
        constexpr bool UNIFORM = !S::FP16 && !CB && !S::GROUPS;
        static_assert(!UNIFORM || (LSB2 == 2 && PLANES3 == 3 && LSB4 == 4), "the uniform layouts are numbered as their widths");
        segment_block<GQA, D, ROPE, UNIFORM ? UNIFORM_CHANNEL : FP16_ONLY, UNIFORM ? UNIFORM_TOKEN : FP16_ONLY, BITS, VBITS>(
            query, segment_descriptor, segment_meta, segment_positions, inv_freq, out_partial, lse_partial, kv_heads,
            blockIdx.x - (gridDim.x - segment_splits), split_offset + blockIdx.x, total_splits, scale_log2, softcap_log2, out,
            arrivals, row_first == nullptr ? nullptr : row_first + (long long)gridDim.z * kv_heads * GQA, smem);
        return;
    }
    const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z, heads = kv_heads * GQA;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int first = meta[META * b], v_first = meta[META * b + 6], length = meta[META * b + 1], visible = meta[META * b + 5];
    const int start = split * per_split, end = min(start + per_split, length);
    const long long out_row = (long long)b * heads + (long long)kvh * GQA, slot = split_offset + split;
    if (start >= end || end <= visible) {  // an empty split (a short sequence, or before a window): nothing to merge
        for (int i = tid; i < GQA * D; i += THREADS) out_partial[((out_row + i / D) * total_splits + slot) * D + i % D] = 0.0f;
        if (tid < GQA) lse_partial[(out_row + tid) * total_splits + slot] = -KVCAL_INF;
        if (out != nullptr)
            merge_when_last<GQA, D>(out_partial, lse_partial, out, arrivals, kv_heads, total_splits, smem);
        return;
    }
    // the tokens [lo, hi) this thread's pipeline streams: the split's, or (PRIVATE) its warp's quarter of whole stages
    // (outliers: of whole outlier tiles)
    constexpr int QUARTER_UNIT = OUT ? OUT_TILE : ST;
    const int quarter = (end - start + WARPS * QUARTER_UNIT - 1) / (WARPS * QUARTER_UNIT) * QUARTER_UNIT;
    const int lo = S::PRIVATE ? min(end, start + warp * quarter) : start, hi = S::PRIVATE ? min(end, lo + quarter) : end;
    const int tiles = (hi - lo + ST - 1) / ST;
    // the threads that share this thread's pipeline's work (its copies, the query's rotation, the outlier passes): the
    // block's, or (PRIVATE) the warp's lanes; `member` numbers this thread among them
    constexpr int CREW = S::PRIVATE ? 32 : THREADS;
    const int member = S::PRIVATE ? lane : tid;
    const unsigned char* const k_base = keys + b * k_seq + kvh * k_head;
    const unsigned char* const v_base = values + b * v_seq + kvh * v_head;
    // outliers (OUT): an outlier tile is a stage of the block's pipeline, or (PRIVATE) TILE_STAGES of a warp's (a body's
    // first row starts one, splits and quarters hold whole ones); outlier tile n of a pipeline starts at lo + n OUT_TILE.
    // Its ranges per side (OutlierHeader) head its outlier area, written by the pipeline's member 0 from offsets it
    // loaded a tile before, so that the copies and passes of the tile read them from shared memory: the block's thread
    // 0 in iteration n - STAGES + 1 (after the barrier at which every warp has left the area's tile n - STAGES, and
    // before the one behind which the copies read them), a warp's lane 0 as it issues the tile's first stage (behind
    // __syncwarp). The two sides' runs live in shared memory too (the last bytes of the pipeline's area): in registers
    // they pushed the kernel to its limit
    const int out_tile0 = lo / OUT_TILE;
    OutlierRun* const out_runs = reinterpret_cast<OutlierRun*>(smem + S::PIPE_BYTES - 2 * sizeof(OutlierRun));
    OutlierRange k_next{0, 0}, v_next{0, 0};  // member 0: the ranges of the next tile whose header it writes
    // outlier tile n's area in this thread's pipeline: its OutlierHeader, then per side OUT_SLOTS positions and
    // OUT_SLOTS values; the outlier scratch (OUT_SCRATCH_BYTES) begins with the pipelines' areas
    unsigned char* const out_scratch = smem + S::PIPE_BYTES - S::OUT_SCRATCH_BYTES;
    const auto outlier_area = [&](int n) { return out_scratch + ((S::PRIVATE ? warp * S::OUT_AREAS : 0) + n % S::OUT_AREAS) * S::OUT_BYTES; };
    const auto outlier_copies = [&](auto* area, int side) { return area + sizeof(OutlierHeader) + side * (2 * S::OUT_SLOTS * 2); };
    // member 0: outlier tile n's header into its area, then the next tile's ranges loaded
    const auto write_ranges = [&](int n) {
        const int k_base = k_next.lo & ~7, v_base = v_next.lo & ~7;
        *reinterpret_cast<OutlierHeader*>(outlier_area(n)) = {k_next.lo - k_base, k_next.hi - k_base, v_next.lo - v_base,
                                                              v_next.hi - v_base, k_base, v_base,
                                                              max(k_next.hi - k_next.lo, v_next.hi - v_next.lo) > CREW, 0};
        k_next = outlier_range(out_runs[0], out_tile0 + n + 1);
        v_next = outlier_range(out_runs[1], out_tile0 + n + 1);
    };
    if constexpr (OUT) {
        if (tid == 0) {
            const long long run = (long long)b * kv_heads + kvh;
            out_runs[0] = outlier_run(key_outlier_positions, key_outlier_values, key_outlier_offsets, key_outlier_counts, run,
                                      k_outlier_run, k_offset_run, meta[META * b + 3], first);
            out_runs[1] = outlier_run(value_outlier_positions, value_outlier_values, value_outlier_offsets, value_outlier_counts,
                                      run, v_outlier_run, v_offset_run, meta[META * b + 4], v_first);
        }
        __syncthreads();  // the runs written before member 0 of each pipeline reads them
        if (member == 0) {
            k_next = outlier_range(out_runs[0], out_tile0);
            v_next = outlier_range(out_runs[1], out_tile0);
            if constexpr (!S::PRIVATE)
                for (int s = 0; s < S::STAGES - 1; ++s) write_ranges(s);  // the stages issued first
        }
        if constexpr (!S::PRIVATE) __syncthreads();  // the first headers written before the first issue reads them
    }

    // ---- the asynchronous copy of stage `tile` (tokens start + ST tile ..) into buffer tile % STAGES ----
    // Stages are issued in order, so the first rows of the next stage are running pointers, advanced by one stage
    // per issue (no 64-bit row arithmetic per stage).
    if constexpr (!S::FP16 && !CB && !S::GROUPS) {  // the key blocks from the first row's: block 0 of the copies' offsets
        key_scale += (long long)(first / S::KB) * kp_row;
        key_zero += (long long)(first / S::KB) * kp_row;
    }
    const unsigned char* k_tile = k_base + (long long)(first + lo) * k_row;
    const unsigned char* v_tile = v_base + (long long)(v_first + lo) * v_row;
    // uniform codes: where the head's first value group's parameter run has the next stage's first token (in halves);
    // the head's other groups are the next columns, vp_group apart
    long long vp_tile = b * vp_seq + (long long)(kvh * D / (S::FP16 || CB ? 1 : VG)) * vp_group + v_first + lo;
    // channel groups: the runtime's tables (kvcal.runtime.tensor_core.group_tables) come as `codebooks`, int32: per side
    // (keys, values) and KV head the parameter column of each of its GROUP_SLOTS slots, then per side and KV head the
    // slots it uses, then per side the slot of every channel of the KV width. A thread's copies of a stage's
    // parameters are the same runs every stage ([side][scale, zero][slot] runs of GROUP_CHUNKS 16-byte chunks): their
    // sources are running pointers (null: a slot the head does not use), advanced one stage per issue
    const int* const group_tables = reinterpret_cast<const int*>(codebooks);
    constexpr int GROUP_CHUNKS = ST * S::PARAM_BYTES / 16;
    constexpr int GROUP_COPIES_PER_THREAD = S::GROUPS ? 2 * 2 * S::GROUP_SLOTS * GROUP_CHUNKS / THREADS : 1;
    static_assert(!S::GROUPS || 2 * 2 * S::GROUP_SLOTS * GROUP_CHUNKS % THREADS == 0, "whole rounds of parameter copies");
    const unsigned char* group_source[GROUP_COPIES_PER_THREAD] = {};
    if constexpr (S::GROUPS) {
#pragma unroll
        for (int i = 0; i < GROUP_COPIES_PER_THREAD; ++i) {
            const int run = (tid + i * THREADS) / GROUP_CHUNKS, side = run / (2 * S::GROUP_SLOTS);
            const int which = run / S::GROUP_SLOTS % 2, slot = run % S::GROUP_SLOTS;
            if (slot < __ldg(group_tables + 2 * kv_heads * S::GROUP_SLOTS + side * kv_heads + kvh)) {
                const long long column = __ldg(group_tables + (side * kv_heads + kvh) * S::GROUP_SLOTS + slot);
                const unsigned short* const base = side ? (which ? value_zero : value_scale) : (which ? key_zero : key_scale);
                const long long element = side ? b * vp_seq + column * vp_group + v_first + start : b * kp_seq + column * kp_row + first + start;
                group_source[i] = reinterpret_cast<const unsigned char*>(base) + element * S::PARAM_BYTES;
            }
        }
    }
    // stage `tile`'s buffer in this thread's pipeline
    const auto stage_buffer = [&](int tile) { return smem + ((S::PRIVATE ? warp * S::STAGES : 0) + tile % S::STAGES) * S::STAGE_BYTES; };
    auto issue = [&](int tile) {
        unsigned char* const buffer = stage_buffer(tile);
        const int t0 = lo + tile * ST;
        copy_rows<ST, S::KROW, S::KSROW, S::FP16, CREW>(buffer, k_tile, (int)k_row, hi - t0, member);
        copy_rows<ST, S::VROW, S::VSROW, S::FP16, CREW>(buffer + S::K_BYTES, v_tile, (int)v_row, hi - t0, member);
        if constexpr (S::GROUPS) {
#pragma unroll
            for (int i = 0; i < GROUP_COPIES_PER_THREAD; ++i) {
                const int c = tid + i * THREADS, chunk = c % GROUP_CHUNKS;
                if (group_source[i] != nullptr) {
                    const bool live = t0 + chunk * (16 / S::PARAM_BYTES) < end;
                    cp_async_16(buffer + S::CODE_BYTES + c / GROUP_CHUNKS * S::GROUP_RUN + chunk * 16,
                                group_source[i] + (live ? chunk * 16 : 0), live ? 16 : 0);
                    group_source[i] += ST * S::PARAM_BYTES;
                }
            }
        } else if constexpr (!S::FP16 && !CB) {
            constexpr int PCHUNKS = D * 2 / 16, PCOPIES = S::KBLOCKS * 2 * PCHUNKS;  // 16-byte chunks of block parameters
            // (PRIVATE: only a stage that enters a key block, or the pipeline's first, copies its parameters: its warp
            // makes the block's Q' there, from them)
            if (!S::PRIVATE || tile == 0 || t0 % S::KB == 0) {
#pragma unroll
                for (int i = 0; i < (PCOPIES + CREW - 1) / CREW; ++i) {
                    const int c = member + i * CREW;
                    if (PCOPIES % CREW == 0 || c < PCOPIES) {
                        const int block = c / (2 * PCHUNKS), which = (c / PCHUNKS) & 1, chunk = c % PCHUNKS;
                        const int first_token = t0 + block * S::KB;  // KBLOCKS > 1 only when KB < ST
                        const bool live = first_token < hi;
                        const unsigned short* const source = which ? key_zero : key_scale;
                        const long long offset = live ? b * kp_seq + (long long)(first_token / S::KB) * kp_row + (long long)kvh * D : 0;
                        cp_async_16(buffer + S::CODE_BYTES + (block * 2 + which) * D * 2 + chunk * 16,
                                    reinterpret_cast<const unsigned char*>(source + offset) + (live ? chunk * 16 : 0), live ? 16 : 0);
                    }
                }
            }
            // the value parameters: [scale, zero][group] runs of the stage's ST tokens, ST / 8 chunks each (chunks
            // wholly past the end are zero-filled; the tokens past the end in a live chunk are masked, P = 0)
            constexpr int VCHUNKS = ST / 8, VCOPIES = 2 * S::VGROUPS * VCHUNKS;
#pragma unroll
            for (int i = 0; i < (VCOPIES + CREW - 1) / CREW; ++i) {
                const int c = member + i * CREW;
                if (VCOPIES % CREW == 0 || c < VCOPIES) {
                    const int run = c / VCHUNKS, chunk = c % VCHUNKS;  // run: [which][group]
                    const bool live = t0 + chunk * 8 < hi;
                    const unsigned short* const source =
                        (run >= S::VGROUPS ? value_zero : value_scale) + vp_tile + (run % S::VGROUPS) * vp_group;
                    cp_async_16(buffer + S::CODE_BYTES + S::KP_BYTES + c * 16, source + (live ? chunk * 8 : 0), live ? 16 : 0);
                }
            }
        }
        if (OUT && tile % S::TILE_STAGES == 0) {
            // a tile's first stage copies its outliers: 2 CHUNKS copiers (one and a half warps of the block, two rounds
            // of a warp's lanes) a 16-byte chunk of a side's positions and the same chunk of its values each, from the
            // chunk that holds lo on
            const int n = tile / S::TILE_STAGES;
            if constexpr (S::PRIVATE) {
                if (member == 0) write_ranges(n);
                __syncwarp();  // the header written before the warp's lanes read it
            }
            unsigned char* const area = outlier_area(n);
            const OutlierHeader& h = *reinterpret_cast<const OutlierHeader*>(area);
            constexpr int CHUNKS = S::OUT_SLOTS / 8;
#pragma unroll
            for (int i = 0; i < (2 * CHUNKS + CREW - 1) / CREW; ++i) {
                const int c = member + i * CREW, side = c / CHUNKS, chunk = c % CHUNKS;
                if (c < 2 * CHUNKS && chunk * 8 < (side ? h.v_end : h.k_end)) {  // the chunks past OUT_SLOTS are not copied
                    const OutlierRun& run = out_runs[side];
                    const int at = (side ? h.v_base : h.k_base) + chunk * 8;
                    unsigned char* const staged = outlier_copies(area, side) + chunk * 16;
                    cp_async_16(staged, run.positions + at, 16);
                    cp_async_16(staged + S::OUT_SLOTS * 2, run.values + at, 16);
                }
            }
        }
        k_tile += ST * k_row;
        v_tile += ST * v_row;
        vp_tile += ST;
    };
    // codebook values' per-token lo and hi go through registers: loaded with the stage's copies, stored to shared memory
    // at the end of that iteration (the prologue's: before the loop) as the token's scale and zero (fp32), so that the
    // compute pass reads a token pair's with one load, and the iteration's compute hides their latency. Stored before
    // the barrier (PRIVATE: __syncwarp) behind which their stage's tokens are read, into a buffer every thread that
    // reads it has left. Member c < ST of the crew: token c's (a running offset and row, advanced one stage per
    // load, as the copies')
    long long vp_at = b * vp_seq + v_first + lo + member % ST;
    int vp_row_of = lo + member % ST;
    auto load_value_params = [&](unsigned short (&vp_staged)[2]) {
        if constexpr (CB) {
            unsigned short lo = 0, hi = 0;
            if (member < ST) {
                if (vp_row_of < end) lo = __ldg(value_scale + vp_at), hi = __ldg(value_zero + vp_at);
                vp_row_of += ST;
                vp_at += ST;
            }
            vp_staged[0] = lo, vp_staged[1] = hi;
        }
    };
    auto store_value_params = [&](int tile, const unsigned short (&vp_staged)[2]) {
        if constexpr (CB) {
            unsigned char* const vp = stage_buffer(tile) + S::CODE_BYTES + S::KP_BYTES;
            if (member < ST) {
                const float lo = half_to_float(vp_staged[0]), hi = half_to_float(vp_staged[1]);
                reinterpret_cast<float2*>(vp)[member] = float2{fmaxf((hi - lo) * 0.5f, 1e-8f), (hi + lo) * 0.5f};
            }
        }
    };

    // ---- the query rows of the group as A fragments, the same registers B ones with tokens in M (fp16 pairs in
    // key_channel order, log2(e) / sqrt(d) folded in) ----
    unsigned qk[PAIRS];
    unsigned* const q_shared = reinterpret_cast<unsigned*>(smem + S::RINGS * S::STAGES * S::STAGE_BYTES);
    // key blocks shorter than a stage (a warp's Q' remade every iteration or two; 3 blocks an SM leave the registers, at
    // head_dim 64 and 128): the unscaled query held in registers, else read back from q_shared per key block
    constexpr bool HOLD_QUERY = !ROPE && !S::FP16 && S::KB < S::BLOCK_ST && D <= 128;
    unsigned q_held[HOLD_QUERY ? PAIRS : 1];
    if constexpr (!ROPE) {
        const float* const q = query + (out_row + g) * D;
#pragma unroll
        for (int p = 0; p < PAIRS; ++p) {
            float x0 = 0.0f, x1 = 0.0f;
            if (g < GQA) {
                x0 = q[key_channel<D, BITS, false, CB>(t, p, 0)] * scale_log2;
                x1 = q[key_channel<D, BITS, false, CB>(t, p, 1)] * scale_log2;
            }
            qk[p] = pack_half2(x0, x1);
            if constexpr (HOLD_QUERY) q_held[p] = qk[p];
            else if constexpr (!S::FP16)
                if (warp == 0) q_shared[p * 32 + lane] = qk[p];  // read after the block's first barrier
        }
    }
    float bias[HL] = {};  // Q . zero of the current key block: head g, or (TOKENS_IN_M) heads 2t and 2t + 1
    int key_block = -1;

    // ---- the rotated query's fragments (pre-RoPE keys: rotated by -P0, a task = (head, lane part, frequency pair)) ----
    unsigned* const q_stage = q_shared + S::Q_BYTES / 4;  // [buffer][pair / 4][lane][4]
    // the buffer stage `tile` reads its query from: the block's by stage parity, or (PRIVATE) the warp's own
    const auto q_buffer = [&](int tile) { return q_stage + (S::PRIVATE ? warp : tile & 1) * S::QSTAGE_WORDS; };
    unsigned* const rope_smem = q_stage + S::QSTAGE_BUFFERS * S::QSTAGE_WORDS;
    // the sides' tables (SideTable): codebooks' EntryPlanes, keys' then values'; uniform 3-bit codes' constants
    unsigned* const plane_words = rope_smem + S::ROPE_TABLE_BYTES / 4;
    using KeyPlanes = typename SideTable<CB, BITS>::type;
    using ValuePlanes = typename SideTable<CB, VBITS>::type;
    const KeyPlanes* const key_planes = reinterpret_cast<const KeyPlanes*>(plane_words);
    const ValuePlanes* const value_planes = reinterpret_cast<const ValuePlanes*>(plane_words + S::VALUE_PLANES_AT);
    unsigned char* const cb_key_params = reinterpret_cast<unsigned char*>(plane_words + S::PLANE_WORDS);  // codebooks' one key block
    // 3-bit codes: where lane (g, t)'s codes lie in a row, keys' (pre-RoPE: of the first half of the head; the second
    // half's are 3 D / 64 words on) and values', in shared memory: read where used, they cost a load each, where ptxas
    // recomputed them from the lane in every iteration (the kernel is at its register limit)
    Planes3Place* const places = reinterpret_cast<Planes3Place*>(cb_key_params + S::CB_KP_BYTES) + 2 * lane;
    if constexpr (BITS == 3 && !S::GROUPS)
        if (warp == 0) places[0] = planes3_place<D / 8>(t * (D / 8));
    if constexpr (VBITS == 3 && !S::GROUPS)
        if (warp == 0) places[1] = planes3_place<S::LANE_V>(g * S::LANE_V);
    // pre-RoPE keys at head_dim 256: the keys' scale pairs, then their zero pairs (key_pair_word)
    unsigned* const key_pairs = reinterpret_cast<unsigned*>(cb_key_params + S::CB_KP_BYTES + S::PLACES_BYTES);
    // outliers (OUT), after the pipelines' areas: the pipeline's tile's score corrections [head][token], sum over the
    // token's key outliers of the query's product with the rotated (exact - dequantized) key, in fixed point (SCORE_UNIT
    // per log2 unit of the scores: an int sum is the same in whatever order the threads' atomics add); each warp's value
    // corrections [warp][D][head], sum over its tokens' value outliers of P (exact - dequantized), in the units and
    // softmax scale of its output, a channel's heads side by side (read and written HEADS_A_WORD at a time); per key
    // channel {midpoint of the dequantized first and last codes, first * scale, last * scale, zero} (fp32); the pipeline's
    // P of its tile [head][token] (fp16); where the value outliers of each slice of the tile (the TPW tokens a warp
    // computes in an iteration) start among the tile's, and their end (value_runs, SLICES + 1)
    constexpr int SLICES = OUT_TILE / TPW;
    static_assert((SLICES + 1) * 4 <= 32, "Shape's OUT_SCRATCH_BYTES holds a pipeline's value_runs in 32 bytes");
    const int ring = S::PRIVATE ? warp : 0;
    constexpr int HEADS_A_WORD = GQA % 4 == 0 ? 4 : GQA % 2 == 0 ? 2 : 1;
    int* const all_score_corrections = reinterpret_cast<int*>(out_scratch + S::RINGS * S::OUT_AREAS * S::OUT_BYTES);
    int* const score_corrections = all_score_corrections + ring * GQA * OUT_TILE;
    float* const value_corrections = reinterpret_cast<float*>(all_score_corrections + S::RINGS * GQA * OUT_TILE);
    float* const key_extremes = value_corrections + WARPS * D * GQA;
    unsigned short* const all_tile_p = reinterpret_cast<unsigned short*>(key_extremes + 4 * D);
    unsigned short* const tile_p = all_tile_p + ring * GQA * OUT_TILE;
    int* const value_runs = reinterpret_cast<int*>(all_tile_p + S::RINGS * GQA * OUT_TILE) + ring * 8;
    constexpr int TASKS = ROPE ? GQA * D / 4 : 0, TASK_SLOTS = TASKS > CREW ? (TASKS + CREW - 1) / CREW : 1;
    // A member's tasks share their frequency pair (tasks CREW apart are the same pair of another head): cos / sin
    // of P0 theta for its two frequencies, and of BLOCK_ST theta (the step between rotations), held once. Between exact
    // anchors every ANCHOR rotations, the next angle is this one's plus the step (an fp32 rotation: error ~1e-7 a step)
    static_assert(!ROPE || CREW % (D / 4) == 0, "a member's tasks share one frequency pair");
    const RopeTask frequency = rope_task<D>(member);
    constexpr int ANCHOR = 16;
    float task_cs[4] = {}, task_step[4];  // {cos0, sin0, cos1, sin1}
    // a task's query pairs {a0, a1, b0, b1} (log2(e) / sqrt(d) folded in), held per slot across the loop;
    // KEY_PAIRS_SHARED and PRIVATE: reread from L1 per rotation instead (4 registers a task: past head_dim 256's limit,
    // and a lane has GQA tasks where a thread of the block has GQA / 4)
    constexpr bool HOLD_TASK_QUERY = !S::KEY_PAIRS_SHARED && !S::PRIVATE;
    const auto read_query_pairs = [&](const RopeTask& r, float (&pairs)[4]) {
        const float* const q = query + (out_row + r.head) * D;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int c = key_channel<D, KEY_ORDER, true, CB>(r.part, r.pair, e);
            pairs[e] = q[c] * scale_log2, pairs[2 + e] = q[c + D / 2] * scale_log2;
        }
    };
    float task_q[HOLD_TASK_QUERY ? TASK_SLOTS : 1][4];
    // the key block's scale and zero pairs in key_channel order (KEY_PAIRS_SHARED: in key_pairs instead)
    constexpr int KEY_PAIR_REGS = ROPE && !S::KEY_PAIRS_SHARED ? PAIRS : 1;
    unsigned ks2[KEY_PAIR_REGS], kz2[KEY_PAIR_REGS];
    // the query at stage `tile`'s first position P0: R(P0)^T q into its buffer (PRIVATE: every ROTATE_EVERY stages)
    auto rotate_query = [&](int tile) {
        if constexpr (ROPE) {
            const int p0 = meta[META * b + 2] + lo + tile * ST;
            unsigned* const out = q_buffer(tile);
            float* const cs = task_cs;
            // the last rotation's angle advanced by the step, replaced by the exact one at an anchor (the step runs
            // unconditionally: predicated into the rotation, it had made its block as rare as the anchors are not)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float c = cs[2 * e], s = cs[2 * e + 1], c1 = task_step[2 * e], s1 = task_step[2 * e + 1];
                cs[2 * e] = c * c1 - s * s1;
                cs[2 * e + 1] = s * c1 + c * s1;
            }
            if (tile / S::ROTATE_EVERY % ANCHOR == 0) {
#pragma unroll
                for (int e = 0; e < 2; ++e)  // the frequency reloaded: an anchor is rare, registers are not
                    exact_cos_sin(p0, __ldg(inv_freq + key_channel<D, KEY_ORDER, true, CB>(frequency.part, frequency.pair, e)), &cs[2 * e],
                                  &cs[2 * e + 1]);
            }
#pragma unroll
            for (int i = 0; i < TASK_SLOTS; ++i) {
                const int task = member + i * CREW;
                if (TASKS % CREW == 0 || task < TASKS) {
                    const RopeTask r = rope_task<D>(task);
                    float pairs[4], qa[2], qb[2];
                    if constexpr (HOLD_TASK_QUERY) {
#pragma unroll
                        for (int j = 0; j < 4; ++j) pairs[j] = task_q[i][j];
                    } else {
                        read_query_pairs(r, pairs);
                    }
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float a = pairs[e], b = pairs[2 + e];
                        qa[e] = a * cs[2 * e] + b * cs[2 * e + 1];  // (R(P0)^T q)_a = q_a cos + q_b sin
                        qb[e] = b * cs[2 * e] - a * cs[2 * e + 1];  // (R(P0)^T q)_b = q_b cos - q_a sin
                    }
                    const int lane_of = r.head * 4 + r.part;
                    out[q_stage_word(r.pair, lane_of)] = pack_half2(qa[0], qa[1]);
                    out[q_stage_word(r.pair + PAIRS / 2, lane_of)] = pack_half2(qb[0], qb[1]);
                }
            }
        }
    };
    if constexpr (ROPE) {
        constexpr int CHUNKS = S::ROPE_TABLE_BYTES / 16;  // the table joins stage 0's copies (the first commit group)
#pragma unroll
        for (int i = 0; i < CHUNKS / THREADS; ++i)
            cp_async_16(reinterpret_cast<unsigned char*>(rope_smem) + (tid + i * THREADS) * 16,
                        reinterpret_cast<const unsigned char*>(rope_table) + (tid + i * THREADS) * 16, 16);
        for (int i = tid; i < S::QSTAGE_BUFFERS * S::QSTAGE_WORDS; i += THREADS)  // rows of heads past GQA stay zero
            if ((i >> 4 & 7) >= GQA) q_stage[i] = 0u;
#pragma unroll
        for (int e = 0; e < 2; ++e)
            exact_cos_sin(S::BLOCK_ST, inv_freq[key_channel<D, KEY_ORDER, true, CB>(frequency.part, frequency.pair, e)],
                          &task_step[2 * e], &task_step[2 * e + 1]);
#pragma unroll
        for (int i = 0; i < (HOLD_TASK_QUERY ? TASK_SLOTS : 0); ++i) {
            const int task = member + i * CREW;
            if (TASKS % CREW == 0 || task < TASKS) read_query_pairs(rope_task<D>(task), task_q[i]);
        }
        if constexpr (!S::PRIVATE) rotate_query(0);  // (a private pipeline's warp rotates its own in the loop)
    }
    if constexpr (S::PLANE_WORDS > 0) {  // stores, read after the block's first barrier
        if (tid < S::KEY_PLANE_WORDS) table_planes_word(reinterpret_cast<KeyPlanes*>(plane_words), codebooks, tid);
        if (tid >= 32 && tid < 32 + S::VALUE_PLANE_WORDS)
            table_planes_word(reinterpret_cast<ValuePlanes*>(plane_words + S::VALUE_PLANES_AT), codebooks + CODEBOOK_WORDS, tid - 32);
    }
    if constexpr (CB) {  // and codebook keys' per-channel scale and zero
        constexpr int PCHUNKS = D * 2 / 16;
        if (tid < 2 * PCHUNKS)
            cp_async_16(cb_key_params + tid * 16,
                        reinterpret_cast<const unsigned char*>((tid < PCHUNKS ? key_scale : key_zero) + (long long)kvh * D) +
                            tid % PCHUNKS * 16,
                        16);
    }
    if constexpr (S::KEY_PAIRS_SHARED) {  // the key pairs, one (pair, lane part) a thread, read after the first barrier
        static_assert(PAIRS * 4 == THREADS, "a thread per pair and lane part");
        const int p = tid >> 2, part = tid & 3;
        const long long c0 = (long long)kvh * D + key_channel<D, BITS, true, CB>(part, p, 0);
        const long long c1 = (long long)kvh * D + key_channel<D, BITS, true, CB>(part, p, 1);
        key_pairs[key_pair_word(p, part)] = clamp_scale_pair((unsigned)__ldg(key_scale + c0) | (unsigned)__ldg(key_scale + c1) << 16);
        key_pairs[PAIRS * 4 + key_pair_word(p, part)] = (unsigned)__ldg(key_zero + c0) | (unsigned)__ldg(key_zero + c1) << 16;
    }

    // ---- channel groups: a stage's codes into fp16 rows (keys rotated by their offset in the stage) ----
    // A thread takes channels c, c + 1 and their rotation partners c + D / 2, c + D / 2 + 1 of both sides in rounds of
    // four consecutive tokens r0 .. r0 + 3, r0 = 4 (row_group + j ROW_GROUPS). One load brings a slot's parameters of the
    // four (8 bytes, fp8 4) as fp16 pairs along the rows, and a channel's codes of two rows meet in one word's halves:
    // the values' arithmetic runs on those pairs (an f16x2 instruction for two values), a prmt turning them into the
    // rows' words of two channels, one store each; the keys' runs in fp32 and rounds to fp16 once, after the rotation
    // (rounded twice, as f16x2 pairs round them, a sharp softmax moved its output by twice as much). Its channels'
    // slots and the two rotations' starts and steps (a token, and from a round's last token to the next round's first)
    // are made once.
    unsigned char* const work = smem + S::PIPE_BYTES - S::WORK_BYTES;  // the computed stage's fp16 keys, then values
    constexpr int HALF = D / 2, QUARTER = D / 4, ROW_GROUPS = THREADS / QUARTER, ROUND = 4;
    static_assert(!S::GROUPS || (THREADS % QUARTER == 0 && ST % (ROUND * ROW_GROUPS) == 0), "a thread's channels are the same in each of its whole rounds");
    const int pair_channel = 2 * (tid % QUARTER), first_row = ROUND * (tid / QUARTER);
    int slot_of[2][4] = {};  // [side][channel c, c + 1, c + D / 2, c + D / 2 + 1]
    // [channel c, c + 1][cos, sin]: the first row's, a token's step, the step from a round's last row to the next's first
    float rotation_start[2][2] = {}, rotation_step[2][2] = {}, rotation_jump[2][2] = {};
    if constexpr (S::GROUPS) {
        const int* const slots = group_tables + 2 * kv_heads * (S::GROUP_SLOTS + 1) + kvh * D + pair_channel;
#pragma unroll
        for (int i = 0; i < 8; ++i) slot_of[i >> 2][i & 3] = __ldg(slots + (i >> 2) * kv_heads * D + (i & 1) + (i >> 1 & 1) * HALF);
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const float theta = __ldg(inv_freq + pair_channel + e);
            exact_cos_sin(first_row, theta, &rotation_start[e][0], &rotation_start[e][1]);
            exact_cos_sin(1, theta, &rotation_step[e][0], &rotation_step[e][1]);
            exact_cos_sin(ROUND * ROW_GROUPS - (ROUND - 1), theta, &rotation_jump[e][0], &rotation_jump[e][1]);
        }
    }
    const auto dequantize_stage = [&](const unsigned char* stage) {
        // a slot's scale (which 0) or zero (1) of the round's tokens as fp16 pairs {r0, r0 + 1}, {r0 + 2, r0 + 3}
        const auto param_pairs = [&](int side, int which, int slot, int r0, unsigned (&out)[2]) {
            const unsigned char* const at = stage + S::CODE_BYTES + ((side * 2 + which) * S::GROUP_SLOTS + slot) * S::GROUP_RUN + r0 * S::PARAM_BYTES;
            if constexpr (S::PARAM_BYTES == 1) {
                const unsigned word = *reinterpret_cast<const unsigned*>(at);
                out[0] = e4m3_pair_by_half(word), out[1] = e4m3_pair_by_half(word >> 16);
            } else {
                const uint2 words = *reinterpret_cast<const uint2*>(at);
                out[0] = words.x, out[1] = words.y;
            }
        };
        // channels c, c + 1 (c even) of rows r and r + 1 as {row r, row r + 1} pairs of fp16 codes, one a channel: c and
        // c + 1 share a code word of kvcal/packing.py's "lsb" layout (1, 2, 4 bits), and in "planes3" a low-bit word and a
        // high-bit word; their bits of the two rows' words meet in one word's halves (bytes 0 and 2), 1024 + code there
        const auto code_pairs = [&](const unsigned char* rows, int row_bytes, int bits, int c, int r, unsigned (&out)[2]) {
            const unsigned* const a = reinterpret_cast<const unsigned*>(rows + r * row_bytes);
            const unsigned* const b = reinterpret_cast<const unsigned*>(rows + (r + 1) * row_bytes);
            const auto meet = [&](int word, int shift) { return prmt(a[word] >> shift, b[word] >> shift, 0x0400u); };
            if (bits == 3) {
                const unsigned low = meet((c >> 5) * 3 + ((c >> 4) & 1), 2 * (c & 15)), top = meet((c >> 5) * 3 + 2, c & 31);
                out[0] = lop3<magic::AND_OR>(low, 0x00030003u, lop3<magic::AND_OR>(top << 2, 0x00040004u, magic::FP16_1024));
                out[1] = lop3<magic::AND_OR>(low >> 2, 0x00030003u, lop3<magic::AND_OR>(top << 1, 0x00040004u, magic::FP16_1024));
            } else {
                const int per_word = 32 / bits;
                const unsigned both = meet(c / per_word, c % per_word * bits), mask = ((1u << bits) - 1u) * 0x00010001u;
                out[0] = lop3<magic::AND_OR>(both, mask, magic::FP16_1024);
                out[1] = lop3<magic::AND_OR>(both >> bits, mask, magic::FP16_1024);
            }
            out[0] = hsub2_bits(out[0], magic::FP16_1024), out[1] = hsub2_bits(out[1], magic::FP16_1024);
        };
        // a side's channels c, c + 1, c + D / 2, c + D / 2 + 1 of the round's rows, a channel at a time (its scales and
        // zeros, then its codes: fewer values live): `channel(k, codes, scale, zero)` gets channel k's {row, row + 1}
        // pairs of codes, max(stored scale, 2^-24) (as kvcal.fit.skvq.SkvqTensor.decode) and zero, per row pair
        const auto each_channel = [&](int side, const unsigned char* rows, int row_bytes, int r0, auto channel) {
#pragma unroll
            for (int pair = 0; pair < 2; ++pair) {
                unsigned codes[2][2];  // [row pair][channel c, c + 1]
#pragma unroll
                for (int p = 0; p < 2; ++p) code_pairs(rows, row_bytes, side ? VBITS : BITS, pair_channel + pair * HALF, r0 + 2 * p, codes[p]);
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    unsigned scale[2], zero[2];
                    param_pairs(side, 0, slot_of[side][2 * pair + e], r0, scale);
                    param_pairs(side, 1, slot_of[side][2 * pair + e], r0, zero);
                    const unsigned k_codes[2] = {codes[0][e], codes[1][e]}, k_scale[2] = {clamp_scale_pair(scale[0]), clamp_scale_pair(scale[1])};
                    channel(2 * pair + e, k_codes, k_scale, zero);
                }
            }
        };
        // rows r0 + k and r0 + k + 1 of channels c, c + 1 (c even) from their pairs along the rows, in the swizzled
        // layout copy_rows gives the fp16 variants: a word of the two channels per row (a round's first row r0 is
        // first_row + a multiple of 8, so the swizzle depends on the thread and k alone)
        static_assert(ROUND * ROW_GROUPS % 8 == 0, "rounds start a multiple of 8 rows apart");
        const auto row_word = [&](unsigned char* rows, int r0, int k, int c) {
            return reinterpret_cast<unsigned*>(rows + (r0 + k) * S::ROW16 + (((c >> 3) ^ ((first_row + k) & 7)) << 4) + (c & 7) * 2);
        };
        const auto store_rows = [&](unsigned char* rows, int r0, int k, int c, unsigned along_c, unsigned along_c1) {
            *row_word(rows, r0, k, c) = prmt(along_c, along_c1, 0x5410u);
            *row_word(rows, r0, k + 1, c) = prmt(along_c, along_c1, 0x7632u);
        };
        const auto half_of = [](unsigned pair, int i) { return half_to_float((unsigned short)(pair >> 16 * i)); };
        float cs[2][2] = {{rotation_start[0][0], rotation_start[0][1]}, {rotation_start[1][0], rotation_start[1][1]}};
#pragma unroll 1
        for (int j = 0; j < ST / (ROUND * ROW_GROUPS); ++j) {  // (a compile-time count: no remainder path)
            const int r0 = first_row + j * ROUND * ROW_GROUPS;
            // keys: x = (code + zero) scale in fp32, rotated, rounded to fp16 once
            float x[ROUND][4];
            each_channel(0, stage, S::KSROW, r0, [&](int k, const unsigned (&codes)[2], const unsigned (&scale)[2], const unsigned (&zero)[2]) {
#pragma unroll
                for (int i = 0; i < ROUND; ++i) x[i][k] = (half_of(codes[i / 2], i % 2) + half_of(zero[i / 2], i % 2)) * half_of(scale[i / 2], i % 2);
            });
#pragma unroll
            for (int i = 0; i < ROUND; ++i) {
                float rotated[4];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const float a = x[i][e], b = x[i][2 + e], cos = cs[e][0], sin = cs[e][1];
                    rotated[e] = a * cos - b * sin;
                    rotated[2 + e] = b * cos + a * sin;
                    const float* const step = i + 1 < ROUND ? rotation_step[e] : rotation_jump[e];
                    cs[e][0] = cos * step[0] - sin * step[1];
                    cs[e][1] = sin * step[0] + cos * step[1];
                }
                *row_word(work, r0, i, pair_channel) = pack_half2(rotated[0], rotated[1]);
                *row_word(work, r0, i, pair_channel + HALF) = pack_half2(rotated[2], rotated[3]);
            }
            // values: x = (code + zero) scale in fp16 pairs of two rows
            unsigned v[4][2];
            each_channel(1, stage + S::K_BYTES, S::VSROW, r0, [&](int k, const unsigned (&codes)[2], const unsigned (&scale)[2], const unsigned (&zero)[2]) {
#pragma unroll
                for (int p = 0; p < 2; ++p) v[k][p] = hmul2(hadd2(codes[p], zero[p]), scale[p]);
            });
#pragma unroll
            for (int p = 0; p < 2; ++p) {
                store_rows(work + ST * S::ROW16, r0, 2 * p, pair_channel, v[0][p], v[1][p]);
                store_rows(work + ST * S::ROW16, r0, 2 * p, pair_channel + HALF, v[2][p], v[3][p]);
            }
        }
    };

    // ---- outliers (OUT): the corrections zeroed, the extremes of both codebooks; the passes that correct a tile ----
    // An outlier lies outside its thresholds, so its code is the codebook's first or last entry (the nearest to the
    // clamped value, kvcal.quantizers.CodebookCodec.encode) and which one follows the side of the midpoint it lies on:
    // its correction is the exact value minus that entry dequantized.
    float value_first = 0.0f, value_last = 0.0f;  // the value codebook's first and last entries
    if constexpr (OUT) {
        for (int i = tid; i < S::RINGS * GQA * OUT_TILE / 4; i += THREADS) reinterpret_cast<int4*>(all_score_corrections)[i] = int4{};
        for (int i = tid; i < WARPS * GQA * D / 4; i += THREADS) reinterpret_cast<float4*>(value_corrections)[i] = float4{};
        const auto entry = [&](int word) { return half_to_float((unsigned short)(codebooks[word] & 0xFFFFu)); };
        const float key_first = entry(0), key_last = entry((1 << BITS) - 1);
        value_first = entry(CODEBOOK_WORDS), value_last = entry(CODEBOOK_WORDS + (1 << VBITS) - 1);
        for (int c = tid; c < D; c += THREADS) {
            const long long channel = (long long)kvh * D + c;
            const float scale = fmaxf(half_to_float(key_scale[channel]), 5.9604644775390625e-8f), zero = half_to_float(key_zero[channel]);
            key_extremes[4 * c] = 0.5f * (key_first + key_last) * scale + zero;
            key_extremes[4 * c + 1] = key_first * scale;
            key_extremes[4 * c + 2] = key_last * scale;
            key_extremes[4 * c + 3] = zero;
        }
    }
    // A tile's outlier header; a side's copies: OUT_SLOTS positions, then OUT_SLOTS values
    const auto header_of = [&](const unsigned char* area) -> const OutlierHeader& { return *reinterpret_cast<const OutlierHeader*>(area); };
    const auto copies_of = [&](const unsigned char* area, int side) { return reinterpret_cast<const unsigned short*>(outlier_copies(area, side)); };
    // outlier i of a side (indexed as the header's ranges): from the copies while they last, from global memory past them
    const auto position_of = [&](const unsigned short* copies, int side, int base, int i) -> unsigned {
        if (i < S::OUT_SLOTS) return copies[i];
        return __ldg(out_runs[side].positions + base + i);
    };
    const auto value_of = [&](const unsigned short* copies, int side, int base, int i) -> unsigned {
        if (i < S::OUT_SLOTS) return copies[S::OUT_SLOTS + i];
        return __ldg(out_runs[side].values + base + i);
    };
    // A tile's outliers, a side at a time, by the pipeline's crew: member m takes outlier lo + m in one straight round
    // from the tile's copies (they hold lo - base + CREW <= OUT_SLOTS), then a crowded tile's rest, lo + m + CREW, ...,
    // from the copies while they last and from global memory past them. `patch` gets (position, value).
    static_assert(!OUT || 7 + CREW <= S::OUT_SLOTS, "the first round of outliers lies in the tile's copies");
    const auto each_outlier = [&](const unsigned char* area, int side, int from, int to, int base, bool crowded, auto patch) {
        const unsigned short* const copies = copies_of(area, side);
        if (from + member < to) patch(copies[from + member], copies[S::OUT_SLOTS + from + member]);
        if (crowded) {  // the same for the whole crew
#pragma unroll 1
            for (int i = from + member + CREW; i < to; i += CREW) patch(position_of(copies, side, base, i), value_of(copies, side, base, i));
        }
    };
    // The tile's key outliers as score corrections, before its tokens are computed, with the query rotated to the
    // tile's first position (q_buffer(tile)). The key at offset delta rotates by R(delta), so an error e in channel c of the
    // first half (a) moves the rotated channels c and c + D / 2 by e cos and e sin, one in the second half (b) by
    // -e sin and e cos: the score of head h moves by e (q[c] cos + q[c + D / 2] sin), or e (q[c] cos - q[c - D / 2] sin),
    // with the very fp16 query fragments and rotation table the scores use. Two outliers of one token meet: int atomics
    // in fixed point, each term clamped to SCORE_TERM, so that a token's outliers (D at most) sum within an int.
    constexpr float SCORE_UNIT = 16384.0f, SCORE_TERM = (float)(1 << 30) / D;
    const auto correct_keys = [&](const unsigned char* area, int tile) {
        const OutlierHeader& h = header_of(area);
        const unsigned short* const q_halves = reinterpret_cast<const unsigned short*>(q_buffer(tile));
        const unsigned short* const rope_halves = reinterpret_cast<const unsigned short*>(rope_smem);
        each_outlier(area, 0, h.k_first, h.k_end, h.k_base, h.crowded, [&](unsigned position, unsigned value) {
            const int token = (int)(position / D), c = (int)(position % D);
            const float x = half_to_float((unsigned short)value);
            const float4 e = reinterpret_cast<const float4*>(key_extremes)[c];
            const float error = x - (x > e.x ? e.z : e.y) - e.w;
            // channel c's place: lane part t, pair q of the half (key_channel: codebook pairs are neighbours), element i
            const int a = c % (D / 2), part = a / (D / 8), q = a % (D / 8) / 2, i = a & 1;
            const float cos = half_to_float(rope_halves[2 * rope_pair_word<D>(token, part, q) + i]);
            const float sin = half_to_float(rope_halves[2 * (rope_pair_word<D>(token, part, q) + 1) + i]);
            const float first = c < D / 2 ? cos : -sin, second = c < D / 2 ? sin : cos;  // the weights of q[a], q[a + D / 2]
            // head h's query pairs are lanes 4 h + part's: 16 words on per head (q_stage_word)
            const unsigned short* const qa = q_halves + 2 * q_stage_word(q, part) + i;
            const unsigned short* const qb = q_halves + 2 * q_stage_word(q + D / 16, part) + i;
            const float scaled = error * SCORE_UNIT;
#pragma unroll
            for (int head = 0; head < GQA; ++head) {
                const float x = scaled * (half_to_float(qa[32 * head]) * first + half_to_float(qb[32 * head]) * second);
                atomicAdd(score_corrections + head * OUT_TILE + token, __float2int_rn(fminf(fmaxf(x, -SCORE_TERM), SCORE_TERM)));
            }
        });
    };
    // Where each slice's value outliers start among the tile's (value_runs[s]; value_runs[SLICES]: their end), by the
    // crew before the tile is computed. A tile's outliers are in position order (kvcal/packing.py: rows appended in
    // order, a row's outliers in channel order), so slice s's are a run, from the first at or past its first token's
    // row: the member at outlier i marks the slices whose first token lies past outlier i - 1's and not past i's.
    const auto mark_value_runs = [&](const unsigned char* area) {
        const OutlierHeader& h = header_of(area);
        const int first = h.v_first, end = h.v_end, base = h.v_base;
        const unsigned short* const copies = copies_of(area, 1);
        const auto slice_of = [&](int i) { return (int)(position_of(copies, 1, base, i) / D) / TPW; };
#pragma unroll 1
        for (int i = first + member; i <= end; i += CREW) {
            const int s0 = i == first ? 0 : slice_of(i - 1) + 1, s1 = i == end ? SLICES : slice_of(i);
#pragma unroll
            for (int s = 0; s <= SLICES; ++s)
                if (s0 <= s && s <= s1) value_runs[s] = i;
        }
    };
    // The warp's value outliers of its computed slice as sparse corrections, once its P is in tile_p: P (exact -
    // dequantized) per head into the warp's corrections (fp32), a lane an outlier. Outliers of one channel (at different
    // tokens) take turns, lowest lane first, so that a channel's adds come in one order (no float atomics, which add in
    // whatever order the threads arrive). Tokens past the split's end (P = 0) add nothing. stage: the slice's stage
    // buffer (its tokens' value scale and zero): the tile's, or (PRIVATE) the warp's of the slice alone
    const auto correct_values = [&](const unsigned char* area, const unsigned char* stage, int tile, int slice) {
        const int stage_token = S::PRIVATE ? slice * TPW : 0;  // the stage's first token in the tile
        const OutlierHeader& h = header_of(area);
        const unsigned short* const copies = copies_of(area, 1);
        const float2* const vp = reinterpret_cast<const float2*>(stage + S::CODE_BYTES + S::KP_BYTES);  // its tokens' scale, zero
        const int first_token = lo + tile / S::TILE_STAGES * OUT_TILE, end = value_runs[slice + 1];
        float* const corrections = value_corrections + warp * D * GQA;
#pragma unroll 1
        for (int i = value_runs[slice] + lane; i - lane < end; i += 32) {
            const bool mine = i < end;
            const unsigned position = mine ? position_of(copies, 1, h.v_base, i) : (unsigned)(stage_token * D);
            const int token = (int)(position / D), c = mine ? (int)(position % D) : D + lane;  // (a unique channel: no turn)
            const float x = mine ? half_to_float((unsigned short)value_of(copies, 1, h.v_base, i)) : 0.0f;
            const float2 sz = vp[token - stage_token];
            const float delta = mine && first_token + token < hi ? x - ((x > sz.y ? value_last : value_first) * sz.x + sz.y) : 0.0f;
            float add[GQA];
#pragma unroll
            for (int head = 0; head < GQA; ++head) add[head] = half_to_float(tile_p[head * OUT_TILE + token]) * delta;
            const int turn = __popc(__match_any_sync(0xffffffffu, (unsigned)c) & ((1u << lane) - 1u));
#pragma unroll 1
            for (int r = 0; __ballot_sync(0xffffffffu, turn >= r) != 0u; ++r) {
                if (mine && turn == r)
#pragma unroll
                    for (int j = 0; j < GQA / HEADS_A_WORD; ++j)
                        update_floats<HEADS_A_WORD>(corrections + c * GQA + j * HEADS_A_WORD, [&](int e, float x) { return x + add[j * HEADS_A_WORD + e]; });
                __syncwarp();
            }
        }
    };

    float o[MTILES][4];
#pragma unroll
    for (int i = 0; i < MTILES; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    // the zero points' running sum per group: sum_t P z of head g in each lane (codebooks: zsum, fp32), or of heads 2t,
    // 2t + 1 in o's accumulator layout (uniform codes: zacc, an mma per 16 tokens and two groups: rows g group 2i, rows
    // g + 8 group 2i + 1)
    constexpr int ZPAIRS = RAW ? (S::VGROUPS + 1) / 2 : 1;
    float m[HL], l[HL] = {}, zsum[CB ? S::VGROUPS : 1] = {}, zacc[ZPAIRS][4] = {};  // the softmax's state of the lane's heads
#pragma unroll
    for (int h = 0; h < HL; ++h) m[h] = -KVCAL_INF;
    // a running maximum as ex2's offset: 0 while it is -inf (no token seen), so that ex2 gives 0, not NaN
    const auto exponent_offset = [](float running) { return running == -KVCAL_INF ? 0.0f : running; };
    // the first body row the lane's head h sees (row_first's, at least the sequence's; padding rows: the sequence's),
    // read again where a stage needs it (rarely) rather than held in registers through the loop
    const auto first_row_seen = [&](int h) {
        const int query_head = TOKENS_IN_M ? 2 * t + h : g;
        return row_first != nullptr && query_head < GQA ? max(visible, __ldg(row_first + out_row + query_head)) : visible;
    };
    int lane_visible = visible;  // the latest of the lane's heads': a stage from it on needs no mask
#pragma unroll
    for (int h = 0; h < HL; ++h) lane_visible = max(lane_visible, first_row_seen(h));

    // ---- post-RoPE keys: Q' = q * scale and bias = Q . zero of a key block ----
    // (uniform codes read raw: pair p reads 1024 + code * 2^s, so Q' takes 2^-s, and the bias -1024 sum Q', from the very
    // fp16 Q' the scores' mma multiplies: exact products; the sums' truncation costs about what Q's fp16 rounding does)
    const auto key_fragments = [&](const unsigned char* kp) {  // the block's parameters at kp; Q' into qk, the bias into bias
        unsigned sw[D / 8], zw[D / 8];  // lane t's D / 4 channels
        load_words(sw, kp + t * (D / 4) * 2);
        load_words(zw, kp + D * 2 + t * (D / 4) * 2);
        float bacc[4] = {0.0f, 0.0f, 0.0f, 0.0f}, bacc2[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        unsigned z2[PAIRS], qu[PAIRS], minus_1024[PAIRS];  // zeros and the unscaled query in key_channel order
#pragma unroll
        for (int p = 0; p < PAIRS; ++p) {
            qu[p] = HOLD_QUERY ? q_held[HOLD_QUERY ? p : 0] : q_shared[p * 32 + lane];
            z2[p] = half_pair(zw, pair_code<BITS, CB>(p, 0), pair_code<BITS, CB>(p, 1));
            unsigned scale = clamp_scale_pair(half_pair(sw, pair_code<BITS, CB>(p, 0), pair_code<BITS, CB>(p, 1)));
            const int shift = KEY_RAW ? raw_shift<BITS>(p % (16 / BITS)) : 0;
            if (shift) scale = hmul2(scale, pow2_down_pair(shift));
            qk[p] = hmul2(qu[p], scale);
            minus_1024[p] = magic::FP16_MINUS_1024;
        }
        if constexpr (TOKENS_IN_M) {  // zeros (and -1024s) as the rows of every token
            tokens_in_m_steps(bacc, bacc2, z2, z2, qu);
            if constexpr (KEY_RAW) tokens_in_m_steps(bacc, bacc2, minus_1024, minus_1024, qk);
            bias[0] = bacc[0] + bacc2[0], bias[HL - 1] = bacc[1] + bacc2[1];
        } else {
            paired_k_steps(bacc, bacc2, qu, z2);
            if constexpr (KEY_RAW) paired_k_steps(bacc, bacc2, qk, minus_1024);
            bias[0] = bacc[0] + bacc2[2];
        }
    };
    // post-RoPE codes: a token's key row (at `row` in the stage) as B-fragment pairs, lane t's D / 4 channels
    const auto key_row_pairs = [&](unsigned (&kf)[PAIRS], const unsigned char* row) {
        if constexpr (!S::ROWS16 && !ROPE) {
            if constexpr (BITS == 3) {
#pragma unroll
                for (int h = 0; h < D / 64; ++h)
                    planes3_codes<16>(reinterpret_cast<const unsigned*>(row), planes3_place<16>(t * (D / 4) + 16 * h), kf + 8 * h, *key_planes);
            } else {
                constexpr int WORDS = D * BITS / 128;
                unsigned w[WORDS];
                load_words(w, row + t * (S::KROW / 4));
#pragma unroll
                for (int i = 0; i < WORDS; ++i) codes_to_half2<BITS, CB, KEY_RAW>(w[i], kf + i * (16 / BITS), key_planes);
            }
        }
    };
    // stage `tile`'s query fragments from its buffer: each 16-byte load is one A fragment (two_step_fragment)
    const auto load_query_fragments = [&](int tile) {
        const unsigned* const qr = q_buffer(tile) + lane * 4;
#pragma unroll
        for (int j = 0; j < PAIRS / 4; ++j) {
            unsigned w[4];
            load_words(w, qr + j * 128);
            qk[4 * j] = w[0], qk[4 * j + 2] = w[1], qk[4 * j + 1] = w[2], qk[4 * j + 3] = w[3];
        }
    };

    // ---- pipeline prologue: stages 0 .. STAGES - 2 in flight, their codebook value parameters stored ----
    // (PRIVATE: what warps read of each other's before the loop, the unscaled query, 3-bit tables and places, in a group
    // of its own, waited for at the block's one barrier below)
    if constexpr (S::PRIVATE) cp_async_commit();
    unsigned short early[S::STAGES - 1][2], pending[2];
#pragma unroll
    for (int s = 0; s < S::STAGES - 1; ++s) {
        if (s < tiles) {
            issue(s);
            load_value_params(early[s]);
        }
        cp_async_commit();
    }
#pragma unroll
    for (int s = 0; s < S::STAGES - 1; ++s)
        if (s < tiles) store_value_params(s, early[s]);
    if constexpr (S::PRIVATE) {
        cp_async_wait<S::STAGES - 1>();
        __syncthreads();
    }

    for (int tile = 0; tile < tiles; ++tile) {
        cp_async_wait<S::STAGES - 2>();
        // stage `tile` landed for every thread that reads it (PRIVATE: the warp's); buffer (tile - 1) % STAGES is free
        if constexpr (S::PRIVATE) __syncwarp();
        else __syncthreads();
        unsigned char* const buffer = stage_buffer(tile);
        // outliers: the outlier tile this stage lies in, its area, and the slice of it the warp computes
        const unsigned char* const area = outlier_area(tile / S::TILE_STAGES);
        const int slice = S::PRIVATE ? tile % S::TILE_STAGES : warp;
        if constexpr (OUT && !S::PRIVATE) {  // this tile's score corrections and slices' value runs; the header of the tile issued below
            correct_keys(area, tile);
            mark_value_runs(area);
            if (tid == 0) write_ranges(tile + S::STAGES - 1);  // into tile - 1's area
            __syncthreads();
        }
        const int ahead = tile + S::STAGES - 1;
        if (ahead < tiles) {
            issue(ahead);
            load_value_params(pending);
        }
        cp_async_commit();
        if constexpr (ROPE && S::PRIVATE) {
            // the warp's rotated query, every ROTATE_EVERY stages: its lanes last read the buffer in iteration
            // tile - ROTATE_EVERY, before the __syncwarp above
            if (tile % S::ROTATE_EVERY == 0) {
                rotate_query(tile);
                __syncwarp();  // written before the warp's lanes read it
                load_query_fragments(tile);
                if constexpr (OUT) {  // a tile's first stage: its score corrections and slices' value runs (the query is
                                      // rotated to its first position: ROTATE_EVERY == TILE_STAGES)
                    correct_keys(area, tile);
                    mark_value_runs(area);
                    __syncwarp();  // written before the warp's lanes read them
                }
            }
        } else if (ROPE && tile + 1 < tiles) {
            rotate_query(tile + 1);  // the next stage's: its buffer was last read in iteration tile - 1, which every warp has left
        }
        if constexpr (S::GROUPS) {  // (every warp left the fp16 rows at the barrier above: its last reads were the last stage's)
            dequantize_stage(buffer);
            __syncthreads();  // the stage's fp16 rows written before any warp reads them
        }
        // the stage's fp16 keys, then values: the copies themselves (fp16) or what dequantize_stage made of them
        const unsigned char* const rows16 = S::GROUPS ? work : buffer;

        const int tb = S::PRIVATE ? 0 : warp * TPW, token0 = lo + tile * ST + tb;  // the warp's TPW tokens, tb on in the buffer
        if (token0 < hi) {
            // -- key block parameters: Q' = q * scale and bias = Q . zero (ROPE: the query rotated to the stage, and the
            // lane's scale and zero pairs), when the warp enters a new block --
            if constexpr (ROPE) {
                // (KEY_PAIRS_SHARED: the query's fragments from q_stage per k-step, the key pairs from their table)
                if constexpr (!S::KEY_PAIRS_SHARED) {
                    if constexpr (!S::PRIVATE) load_query_fragments(tile);
                    const int block = S::GROUPS ? key_block : token0 / S::KB;  // (channel groups: no key block parameters)
                    if (block != key_block) {
                        key_block = block;
                        const unsigned char* const kp =
                            CB ? cb_key_params : buffer + S::CODE_BYTES + (S::KB >= ST ? 0 : tb / S::KB) * 2 * D * 2;
#pragma unroll
                        for (int part = 0; part < 2; ++part) {
                            unsigned sw[D / 16], zw[D / 16];  // lane t's D / 8 channels of this half
                            const int c0 = part * (D / 2) + t * (D / 8);
                            load_words(sw, kp + c0 * 2);
                            load_words(zw, kp + D * 2 + c0 * 2);
#pragma unroll
                            for (int q = 0; q < PAIRS / 2; ++q) {
                                const int i0 = pair_code<BITS, CB>(q, 0), i1 = pair_code<BITS, CB>(q, 1);
                                ks2[part * (PAIRS / 2) + q] = clamp_scale_pair(half_pair(sw, i0, i1));
                                kz2[part * (PAIRS / 2) + q] = half_pair(zw, i0, i1);
                            }
                        }
                    }
                }
            } else if constexpr (!S::FP16) {
                const int block = token0 / S::KB;
                if (block != key_block) {
                    key_block = block;
                    key_fragments(CB ? cb_key_params : buffer + S::CODE_BYTES + (S::KB >= ST ? 0 : tb / S::KB) * 2 * D * 2);
                }
            }
            // -- S = Q K^T for the warp's n-tiles of 8 tokens: sc[nt] holds tokens 8 nt + 2t, 2t + 1 of head g, or
            // (TOKENS_IN_M) token 8 nt + g of heads 2t, 2t + 1 --
            float sc[NT][2];
#pragma unroll
            for (int kt = 0; kt < (TOKENS_IN_M ? KT : 0); ++kt) {
                unsigned k0[PAIRS], k1[PAIRS];  // tokens g and g + 8 of the k-step
                key_row_pairs(k0, buffer + (tb + 16 * kt + g) * S::KSROW);
                key_row_pairs(k1, buffer + (tb + 16 * kt + 8 + g) * S::KSROW);
                float acc[4] = {bias[0], bias[HL - 1], bias[0], bias[HL - 1]}, acc2[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                tokens_in_m_steps(acc, acc2, k0, k1, qk);
                sc[2 * kt][0] = acc[0] + acc2[0], sc[2 * kt][1] = acc[1] + acc2[1];
                sc[2 * kt + 1][0] = acc[2] + acc2[2], sc[2 * kt + 1][1] = acc[3] + acc2[3];
            }
#pragma unroll
            for (int nt = 0; nt < (TOKENS_IN_M || ROTATED_KEYS ? 0 : NT); ++nt) {
                // even k-steps accumulate in acc's rows g, odd ones in acc2's rows g + 8 (paired_k_steps)
                float acc[4] = {bias[0], bias[0], 0.0f, 0.0f}, acc2[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                if constexpr (S::ROWS16) {
#pragma unroll
                    for (int s2 = 0; s2 < KSTEPS / 2; ++s2) {
                        const int i = lane >> 3, row = tb + 8 * nt + (lane & 7), chunk = 4 * s2 + i;
                        unsigned r[4];
                        ldmatrix_x4(r, rows16 + row * S::ROW16 + ((chunk ^ (row & 7)) * 16));
                        unsigned a[4];
                        two_step_fragment(a, qk, s2);
                        const unsigned b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
                        mma_m16n8k16_f16(acc, a, b0);
                        mma_m16n8k16_f16(acc2, a, b1);
                    }
                } else {
                    unsigned kf[PAIRS];  // lane t's D / 4 channels of token g
                    key_row_pairs(kf, buffer + (tb + 8 * nt + g) * S::KSROW);
                    paired_k_steps(acc, acc2, qk, kf);
                }
                sc[nt][0] = acc[0] + acc2[2], sc[nt][1] = acc[1] + acc2[3];
            }
            if constexpr (ROTATED_KEYS) {
                // lane t's D / 8 channels of each half, dequantized (code * scale + zero), rotated by delta, CP pairs of
                // each half at a time (head_dim 256: four parts of 4; a whole half held too many registers). The parts
                // run outside the warp's n-tiles: a part's key pairs and query fragments serve both n-tiles' tokens
                constexpr int HP = PAIRS / 2, CP = HP > 8 ? 4 : HP, CW = CP * BITS / 16;  // CW: words of a part's codes
                const unsigned* const q_frag = q_buffer(tile) + lane * 4;
                // lane (g, t)'s words of the rotation table at its token of n-tile 0, whose offset from the rotated query's
                // position counts a private warp's stages since it rotated it; rope_row_start adds up over even offsets,
                // so n-tile nt's are rope_row_start(8 nt) on
                const unsigned* const rope_lane = rope_smem + rope_pair_word<D>((S::PRIVATE ? tile % S::ROTATE_EVERY * ST : 0) + tb + g, t, 0);
                float acc[NT][4], acc2[NT][4];  // even k-steps accumulate in acc's rows g, odd ones in acc2's rows g + 8
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int i = 0; i < 4; ++i) acc[nt][i] = i < 2 ? bias[0] : 0.0f, acc2[nt][i] = 0.0f;
                const auto rotated_part = [&](int c) {  // the scores' k-steps of pairs c CP .. c CP + CP - 1 of each half
                    unsigned ks[2 * CP], kz[2 * CP];  // the key block's scale and zero pairs: the first half's, then the second's
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        if constexpr (S::KEY_PAIRS_SHARED) {
#pragma unroll
                            for (int j = 0; j < CP / 4; ++j) {
                                unsigned w[4], z[4];
                                load_words(w, key_pairs + key_pair_word(h * HP + c * CP + 4 * j, t));
                                load_words(z, key_pairs + PAIRS * 4 + key_pair_word(h * HP + c * CP + 4 * j, t));
#pragma unroll
                                for (int i = 0; i < 4; ++i) ks[h * CP + 4 * j + i] = w[i], kz[h * CP + 4 * j + i] = z[i];
                            }
                        } else {
#pragma unroll
                            for (int q = 0; q < CP; ++q) ks[h * CP + q] = ks2[h * HP + c * CP + q], kz[h * CP + q] = kz2[h * HP + c * CP + q];
                        }
                    }
                    // the query's A fragments of these pairs' k-steps (paired_k_steps' order: pair p is k-step p / 2's),
                    // from registers or, with KEY_PAIRS_SHARED, from q_stage (one 16-byte load each)
                    unsigned a[2][CP / 4][4];
#pragma unroll
                    for (int h = 0; h < 2; ++h)
#pragma unroll
                        for (int j = 0; j < CP / 4; ++j) {
                            const int step_pair = (h * HP + c * CP) / 4 + j;
                            if constexpr (S::KEY_PAIRS_SHARED) load_words(a[h][j], q_frag + step_pair * 128);
                            else two_step_fragment(a[h][j], qk, step_pair);
                        }
                    const Planes3Place key_place = BITS != 3 ? Planes3Place{} : HP == CP ? places[0] : planes3_place<2 * CP>(t * (D / 8) + c * 2 * CP);
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) {
                        const int delta = tb + 8 * nt + g;  // the token's row in the buffer
                        const unsigned char* const row = buffer + delta * S::KSROW + t * (S::KROW / 8);
                        unsigned kf[2 * CP], cs[2 * CP];  // the first half's pairs, then the second's
                        if constexpr (BITS == 3) {
                            const unsigned* const words = reinterpret_cast<const unsigned*>(buffer + delta * S::KSROW);
                            const unsigned* const second = words + 3 * (D / 64);  // channels + D / 2
                            if constexpr (CP == 8) {
                                planes3_codes<16>(words, key_place, kf, *key_planes);
                                planes3_codes<16>(second, key_place, kf + CP, *key_planes);
                            } else {  // a quarter unit of each half, in one word of indices
                                const Planes3Indices x = planes3_indices_of_rows<8>(words, second, key_place);
                                table_pairs(*key_planes, x.even, x.odd, kf);
                                table_pairs(*key_planes, x.even >> 16, x.odd >> 16, kf + CP);
                            }
                        } else if constexpr (CW == 0) {  // 2-bit codebooks: a part's 2 CP codes of each half in 16 bits
                            static_assert(2 * CP * BITS == 16, "half-word parts");
                            const unsigned ha = *reinterpret_cast<const unsigned short*>(row + c * 2);
                            const unsigned hb = *reinterpret_cast<const unsigned short*>(row + S::KROW / 2 + c * 2);
                            codes_to_half2<BITS, CB, false, CP>(ha, kf, key_planes);
                            codes_to_half2<BITS, CB, false, CP>(hb, kf + CP, key_planes);
                        } else {
                            unsigned wa[CW], wb[CW];
                            load_words(wa, row + c * CW * 4);
                            load_words(wb, row + S::KROW / 2 + c * CW * 4);
#pragma unroll
                            for (int i = 0; i < CW; ++i) {
                                codes_to_half2<BITS, CB>(wa[i], kf + i * (16 / BITS), key_planes);
                                codes_to_half2<BITS, CB>(wb[i], kf + CP + i * (16 / BITS), key_planes);
                            }
                        }
#pragma unroll
                        for (int j = 0; j < CP / 2; ++j) {
                            unsigned w[4];
                            load_words(w, rope_lane + rope_row_start<D>(8 * nt) + rope_pair_word<D>(0, 0, c * CP + 2 * j));
                            cs[4 * j] = w[0], cs[4 * j + 1] = w[1], cs[4 * j + 2] = w[2], cs[4 * j + 3] = w[3];
                        }
#pragma unroll
                        for (int q = 0; q < CP; ++q) {
                            const unsigned x = hfma2_bits(kf[q], ks[q], kz[q]), y = hfma2_bits(kf[CP + q], ks[CP + q], kz[CP + q]);
                            const unsigned cos = cs[2 * q], sin = cs[2 * q + 1];
                            kf[q] = hfma2_bits(x, cos, hneg2_bits(hmul2(y, sin)));  // x cos - y sin
                            kf[CP + q] = hfma2_bits(y, cos, hmul2(x, sin));         // y cos + x sin
                        }
#pragma unroll
                        for (int h = 0; h < 2; ++h)
#pragma unroll
                            for (int j = 0; j < CP / 4; ++j) {
                                const unsigned* const b = kf + h * CP + 4 * j;
                                const unsigned b_even[2] = {b[0], b[1]}, b_odd[2] = {b[2], b[3]};
                                mma_m16n8k16_f16(acc[nt], a[h][j], b_even);
                                mma_m16n8k16_f16(acc2[nt], a[h][j], b_odd);
                            }
                    }
                };
                if constexpr (HP == CP) {
                    rotated_part(0);
                } else {
#pragma unroll 1  // (head_dim 256: unrolled, ptxas hoisted the parts' loads past its registers)
                    for (int c = 0; c < HP / CP; ++c) rotated_part(c);
                }
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) sc[nt][0] = acc[nt][0] + acc2[nt][2], sc[nt][1] = acc[nt][1] + acc2[nt][3];
            }
            if (OUT && g < GQA) {  // the stage's key outliers (correct_keys): head g's corrections at the lane's tokens, zeroed after
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    int2* const at = reinterpret_cast<int2*>(score_corrections + g * OUT_TILE + slice * TPW + 8 * nt + 2 * t);
                    const int2 d = *at;
                    *at = int2{0, 0};
                    sc[nt][0] += (float)d.x * (1.0f / SCORE_UNIT), sc[nt][1] += (float)d.y * (1.0f / SCORE_UNIT);
                }
            }
            if (softcap_log2 > 0.0f) {  // Gemma 2's soft-cap, of whole scores (outliers corrected), before the masks
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) sc[nt][0] = soft_capped(sc[nt][0], softcap_log2), sc[nt][1] = soft_capped(sc[nt][1], softcap_log2);
            }
            // the split's last stage: tokens past its end weigh nothing; a sliding window's: tokens before the first a
            // head sees (lane-uniform: no lane waits on another in it)
            if (token0 + TPW > hi || token0 < lane_visible) {
                const int seen = first_row_seen(0), other_seen = first_row_seen(HL - 1);
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    const int token = token0 + 8 * nt + (TOKENS_IN_M ? g : 2 * t), other = TOKENS_IN_M ? token : token + 1;
                    sc[nt][0] = token < hi && token >= seen ? sc[nt][0] : -KVCAL_INF;
                    sc[nt][1] = other < hi && other >= other_seen ? sc[nt][1] : -KVCAL_INF;
                }
            }
            // -- online softmax of the lane's heads over these TPW tokens (log2 domain) --
            float mx[HL], alpha[HL];  // the lane's own maxima of its heads, reduced as a tree
            bool rose = false;
#pragma unroll
            for (int h = 0; h < HL; ++h) {
                float part[NT];
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) part[nt] = TOKENS_IN_M ? sc[nt][h] : fmaxf(sc[nt][0], sc[nt][1]);
#pragma unroll
                for (int w = NT / 2; w >= 1; w /= 2)
#pragma unroll
                    for (int i = 0; i < w; ++i) part[i] = fmaxf(part[i], part[i + w]);
                mx[h] = part[0], alpha[h] = 1.0f;
                rose = rose || mx[h] > m[h];
            }
            // only when some lane's maximum passed its head's running one (warp-uniform) are the maxima reduced across
            // the lanes that hold the heads' other tokens (those of the lane's g, or t) and the state rescaled:
            // otherwise every head's maximum stays as it is, and alpha is exactly 1 (or l = o = 0)
            const bool grew = __ballot_sync(0xffffffffu, rose) != 0u;
            if (grew) {
#pragma unroll
                for (int h = 0; h < HL; ++h) {
#pragma unroll
                    for (int x = HEAD_LANES_FROM; x < HEAD_LANES_TO; x *= 2) mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], x));
                    const float m_new = fmaxf(m[h], mx[h]);
                    alpha[h] = ex2(m[h] - exponent_offset(m_new));
                    m[h] = m_new;
                }
                // heads 2t, 2t+1 of o's columns: the lane's own, or lanes 8t and 8t + 4's head g
                const float alpha0 = TOKENS_IN_M ? alpha[0] : shfl_idx(alpha[0], 8 * t);
                const float alpha1 = TOKENS_IN_M ? alpha[HL - 1] : shfl_idx(alpha[0], 8 * t + 4);
#pragma unroll
                for (int i = 0; i < MTILES; ++i) o[i][0] *= alpha0, o[i][1] *= alpha1, o[i][2] *= alpha0, o[i][3] *= alpha1;
#pragma unroll
                for (int i = 0; i < (RAW ? ZPAIRS : 0); ++i)
                    zacc[i][0] *= alpha0, zacc[i][1] *= alpha1, zacc[i][2] *= alpha0, zacc[i][3] *= alpha1;
                if constexpr (OUT) {  // the warp's value corrections, a word of heads at a time: head h's alpha is lane 4 h's
                    float* const corrections = value_corrections + warp * D * GQA;
#pragma unroll
                    for (int k = 0; k < D * GQA / HEADS_A_WORD / 32; ++k) {
                        const int word = lane + 32 * k, head = word % (GQA / HEADS_A_WORD) * HEADS_A_WORD;
                        float scale[HEADS_A_WORD];
#pragma unroll
                        for (int e = 0; e < HEADS_A_WORD; ++e) scale[e] = shfl_idx(alpha[0], 4 * (head + e));
                        update_floats<HEADS_A_WORD>(corrections + word * HEADS_A_WORD, [&](int e, float x) { return x * scale[e]; });
                    }
                }
            }
            float p[NT][2], m_use[HL];  // p as sc
#pragma unroll
            for (int h = 0; h < HL; ++h) l[h] *= alpha[h], m_use[h] = exponent_offset(m[h]);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                p[nt][0] = ex2(sc[nt][0] - m_use[0]), p[nt][1] = ex2(sc[nt][1] - m_use[HL - 1]);
                if constexpr (TOKENS_IN_M) l[0] += p[nt][0], l[1] += p[nt][1];
                else l[0] += p[nt][0] + p[nt][1];
            }
            // -- O^T += V^T P^T, one k-step of 16 tokens at a time (P's n-tiles 2 kt and 2 kt + 1) --
#pragma unroll
            for (int kt = 0; kt < KT; ++kt) {
                const int tk = tb + 16 * kt;  // the k-step's first token in the stage
                if constexpr (S::ROWS16) {
                    const unsigned bp[2] = {pack_half2(p[2 * kt][0], p[2 * kt][1]), pack_half2(p[2 * kt + 1][0], p[2 * kt + 1][1])};
#pragma unroll
                    for (int mt = 0; mt < MTILES; ++mt) {
                        const int i = lane >> 3, row = tk + 8 * (i >> 1) + (lane & 7), chunk = 2 * mt + (i & 1);
                        unsigned a[4];
                        ldmatrix_x4_trans(a, rows16 + ST * S::ROW16 + row * S::ROW16 + ((chunk ^ (row & 7)) * 16));
                        mma_m16n8k16_f16(o[mt], a, bp);
                    }
                } else {
                    const unsigned short* const vp = reinterpret_cast<const unsigned short*>(buffer + S::CODE_BYTES + S::KP_BYTES);
                    const unsigned char* const vrow = buffer + S::K_BYTES + (tk + 2 * t) * S::VSROW;  // tokens 2t, 2t+1; +8 rows: 2t+8, 2t+9
                    constexpr int LANE_BITS = S::LANE_V * VBITS, CHUNKS16 = LANE_BITS / 16, PER16 = 16 / VBITS;
                    unsigned pw[2], zw[RAW ? S::VGROUPS : 1][2];  // uniform codes: fp16(P) of the token pairs; their zeros
                    if constexpr (RAW) {
#pragma unroll
                        for (int half = 0; half < 2; ++half) {
                            pw[half] = pack_half2(p[2 * kt + half][0], p[2 * kt + half][1]);
                            // TOKENS_IN_M: token g (+ 8)'s heads 2t, 2t + 1 become head g's tokens 2t, 2t + 1 (+ 8)
                            if constexpr (TOKENS_IN_M) pw[half] = movmatrix_trans(pw[half]);
                        }
                    }
#pragma unroll
                    for (int group = 0; group < S::VGROUPS; ++group) {
                        // P' = P * scale (per token), and the zero points' running sum
                        unsigned bp[2];
                        if constexpr (CB) {  // the pair's scales and zeros (fp32), made when the stage's were stored
#pragma unroll
                            for (int half = 0; half < 2; ++half) {
                                const float4 sz = reinterpret_cast<const float4*>(vp)[(tk + 2 * t + 8 * half) / 2];
                                const float* const pt = p[2 * kt + half];
                                bp[half] = pack_half2(pt[0] * sz.x, pt[1] * sz.z);
                                zsum[group] = (kt || half ? zsum[group] : zsum[group] * alpha[0]) + pt[0] * sz.y + pt[1] * sz.w;
                            }
                        } else {  // uniform: the token pair's fp16 scales (kvcal.quantizers.scale_in_use clamps them at
                            // 2^-24) and zeros as words; P' = fp16(P) * scale in fp16x2 (P z: after the groups)
#pragma unroll
                            for (int half = 0; half < 2; ++half) {
                                const int token = tk + 2 * t + 8 * half;
                                bp[half] = hmul2(pw[half], clamp_scale_pair(*reinterpret_cast<const unsigned*>(vp + group * ST + token)));
                                zw[group][half] = *reinterpret_cast<const unsigned*>(vp + (S::VGROUPS + group) * ST + token);
                            }
                        }
                        // lane g's LANE_V channels of this group in 4 token rows, pairs of rows interleaved per 16 bits
                        const int bit0 = (group * S::VGE + g * S::LANE_V) * VBITS;
                        unsigned vf[2][S::LANE_V];  // [rows 2t/2t+1 or 2t+8/2t+9][code n]: {token even, token odd}
#pragma unroll
                        for (int half = 0; half < 2; ++half) {
                            const unsigned char* const r0 = vrow + 8 * half * S::VSROW;
                            if constexpr (VBITS == 3) {
                                // a group's place is the first group's a whole number of units on (VGE >= 32)
                                constexpr int GROUP_WORDS = 3 * S::VGE / 32;
                                const Planes3Place value_place = {places[1].low + group * GROUP_WORDS, places[1].high + group * GROUP_WORDS,
                                                                  places[1].shift, places[1].selector};
                                planes3_token_pairs<S::LANE_V>(reinterpret_cast<const unsigned*>(r0), reinterpret_cast<const unsigned*>(r0 + S::VSROW),
                                                               value_place, vf[half], *value_planes);
                            } else if constexpr (CB) {
                                // words of the lane's codes per row (2-bit at head_dim 64: 16 bits), and the table
                                // fields of each (a field: the two tokens' codes of one channel)
                                constexpr int NW = LANE_BITS >= 32 ? LANE_BITS / 32 : 1, FIELDS = LANE_BITS >= 32 ? 16 / VBITS : S::LANE_V / 2;
                                constexpr unsigned LOW = VBITS == 4 ? 0x0F0F0F0Fu : 0x33333333u;  // the low code of each field
                                unsigned wa[NW], wb[NW];
                                if constexpr (LANE_BITS >= 32) {
                                    load_words(wa, r0 + (bit0 >> 3));
                                    load_words(wb, r0 + S::VSROW + (bit0 >> 3));
                                } else {
                                    wa[0] = *reinterpret_cast<const unsigned short*>(r0 + (bit0 >> 3));
                                    wb[0] = *reinterpret_cast<const unsigned short*>(r0 + S::VSROW + (bit0 >> 3));
                                }
#pragma unroll
                                for (int i = 0; i < NW; ++i) {
                                    // field k: the two tokens' codes of channel 2k (even) or 2k + 1 (odd) of word i's
                                    const unsigned even = lop3<magic::SELECT>(wa[i], wb[i] << VBITS, LOW);
                                    const unsigned odd = lop3<magic::SELECT>(wa[i] >> VBITS, wb[i], LOW);
                                    unsigned fe[FIELDS], fo[FIELDS];
                                    table_fields<FIELDS>(*value_planes, even, fe), table_fields<FIELDS>(*value_planes, odd, fo);
#pragma unroll
                                    for (int k = 0; k < FIELDS; ++k) vf[half][2 * FIELDS * i + 2 * k] = fe[k], vf[half][2 * FIELDS * i + 2 * k + 1] = fo[k];
                                }
                            } else {
                                unsigned c16[CHUNKS16 > 0 ? CHUNKS16 : 1];
                                if constexpr (LANE_BITS == 8) {  // int2 g32: the lane's byte of each row, at bits 0 and 16
                                    // (raw_u2's out[0..3] read the low byte of each 16-bit half; the high bytes are junk
                                    // that only out[4..7] read, and those are dropped)
                                    const unsigned wa = *reinterpret_cast<const unsigned*>(r0 + (bit0 >> 5) * 4);
                                    const unsigned wb = *reinterpret_cast<const unsigned*>(r0 + S::VSROW + (bit0 >> 5) * 4);
                                    const unsigned byte = (bit0 >> 3) & 3;
                                    unsigned codes[8];
                                    codes_to_half2<VBITS, false, RAW, PER16, VALUE_BASE>(prmt(wa, wb, byte | (4 + byte) << 8), codes);
#pragma unroll
                                    for (int n = 0; n < S::LANE_V; ++n) vf[half][n] = codes[n];
                                } else if constexpr (LANE_BITS == 16) {
                                    const unsigned wa = *reinterpret_cast<const unsigned*>(r0 + (bit0 >> 5) * 4);
                                    const unsigned wb = *reinterpret_cast<const unsigned*>(r0 + S::VSROW + (bit0 >> 5) * 4);
                                    c16[0] = prmt(wa, wb, (bit0 & 16) ? 0x7632u : 0x5410u);
                                } else {
                                    constexpr int NW = LANE_BITS / 32;
                                    unsigned wa[NW], wb[NW];
                                    load_words(wa, r0 + (bit0 >> 3));
                                    load_words(wb, r0 + S::VSROW + (bit0 >> 3));
#pragma unroll
                                    for (int i = 0; i < NW; ++i) c16[2 * i] = prmt(wa[i], wb[i], 0x5410u), c16[2 * i + 1] = prmt(wa[i], wb[i], 0x7632u);
                                }
#pragma unroll
                                for (int k = 0; k < CHUNKS16; ++k) codes_to_half2<VBITS, false, RAW, PER16, VALUE_BASE>(c16[k], vf[half] + k * PER16);
                            }
                        }
#pragma unroll
                        for (int ml = 0; ml < S::LANE_V / 2; ++ml) {
                            const unsigned a[4] = {vf[0][2 * ml], vf[0][2 * ml + 1], vf[1][2 * ml], vf[1][2 * ml + 1]};
                            float (&acc)[4] = o[group * (S::LANE_V / 2) + ml];
                            mma_m16n8k16_f16(acc, a, bp);
                        }
                    }
                    if constexpr (RAW) {  // P z: an mma of the zeros (rows g: group 2i, rows g + 8: group 2i + 1) with fp16(P)
#pragma unroll
                        for (int i = 0; i < ZPAIRS; ++i) {
                            const int other = 2 * i + 1 < S::VGROUPS ? 2 * i + 1 : 2 * i;
                            const unsigned za[4] = {zw[2 * i][0], zw[other][0], zw[2 * i][1], zw[other][1]};
                            mma_m16n8k16_f16(zacc[i], za, pw);
                        }
                    }
                    static_assert(!OUT || NT == 2, "outliers: a warp's slice of a tile is two n-tiles");
                    if (OUT && g < GQA) {  // P of head g at the warp's tokens, for the slice's value corrections (correct_values)
                        unsigned* const row = reinterpret_cast<unsigned*>(tile_p + g * OUT_TILE + slice * TPW + 2 * t);
                        row[0] = pack_half2(p[0][0], p[0][1]);
                        row[4] = pack_half2(p[1][0], p[1][1]);  // tokens 2t + 8, 2t + 9
                    }
                }
            }
            if constexpr (OUT) {
                __syncwarp();  // the warp's P in tile_p
                correct_values(area, buffer, tile, slice);
            }
        }
        if (ahead < tiles) store_value_params(ahead, pending);  // loaded with its copies above
    }

    // ---- merge the four warps through shared memory into this split's (output, lse) ----
    cp_async_wait<0>();
    __syncthreads();
    float* const merge_o = reinterpret_cast<float*>(smem);                 // [warp][8 heads][D]
    float* const merge_m = merge_o + WARPS * 8 * D;                        // [warp][8]
    float* const merge_l = merge_m + WARPS * 8;                            // [warp][8]
    float* const merge_z = merge_l + WARPS * 8;                            // [warp][8][VGROUPS]
#pragma unroll
    for (int h = 0; h < HL; ++h)  // across the lanes of the head's other tokens, as its maximum
#pragma unroll
        for (int x = HEAD_LANES_FROM; x < HEAD_LANES_TO; x *= 2) l[h] += __shfl_xor_sync(0xffffffffu, l[h], x);
    if constexpr (CB) {
#pragma unroll
        for (int i = 0; i < S::VGROUPS; ++i) {
            zsum[i] += __shfl_xor_sync(0xffffffffu, zsum[i], 1);
            zsum[i] += __shfl_xor_sync(0xffffffffu, zsum[i], 2);
            if (t == 0) merge_z[(warp * 8 + g) * S::VGROUPS + i] = zsum[i];
        }
    } else if constexpr (RAW) {  // rows 0 and 8 of zacc (lanes g = 0) hold groups 2i and 2i + 1 of heads 2t, 2t + 1
#pragma unroll
        for (int i = 0; i < S::VGROUPS; ++i)
            if (g == 0)
#pragma unroll
                for (int e = 0; e < 2; ++e) merge_z[(warp * 8 + 2 * t + e) * S::VGROUPS + i] = zacc[i / 2][(i & 1) * 2 + e];
    }
    if (TOKENS_IN_M ? g == 0 : t == 0) {
#pragma unroll
        for (int h = 0; h < HL; ++h) {
            const int head = TOKENS_IN_M ? 2 * t + h : g;
            merge_m[warp * 8 + head] = m[h];
            merge_l[warp * 8 + head] = l[h];
        }
    }
#pragma unroll
    for (int mt = 0; mt < MTILES; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float x = o[mt][e];
            if constexpr (VALUE_RAW) {  // row g + 8 (e >> 1) of m-tile mt: the lane's raw code n of its group, times 2^(s - 24)
                constexpr int MPG = S::LANE_V / 2, PER_WORD = 16 / VBITS;
                const int n = 2 * (mt % MPG) + (e >> 1);
                x *= 16777216.0f / (float)(1 << raw_shift<VBITS>(n % PER_WORD));
            }
            merge_o[(warp * 8 + 2 * t + (e & 1)) * D + value_channel<D, S::ROWS16 ? 16 : BITS, S::VGE>(g, mt, e >> 1)] = x;
        }
    __syncthreads();
    for (int i = tid; i < GQA * D; i += THREADS) {
        const int h = i / D, d = i % D;
        float most = -KVCAL_INF;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) most = fmaxf(most, merge_m[w * 8 + h]);
        float total = 0.0f, value = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float mw = merge_m[w * 8 + h];
            const float f = mw == -KVCAL_INF ? 0.0f : ex2(mw - most);
            total += merge_l[w * 8 + h] * f;
            float x = merge_o[(w * 8 + h) * D + d];
            if constexpr (!S::ROWS16) x += merge_z[(w * 8 + h) * S::VGROUPS + d / S::VGE];
            if constexpr (OUT) x += value_corrections[(w * D + d) * GQA + h];
            value += x * f;
        }
        // (a head whose first row lies past the split saw none: row_first)
        out_partial[((out_row + h) * total_splits + slot) * D + d] = total > 0.0f ? value / total : 0.0f;
        if (d == 0) lse_partial[(out_row + h) * total_splits + slot] = total > 0.0f ? most + lg2(total) : -KVCAL_INF;
    }
    if (out != nullptr)
        merge_when_last<GQA, D>(out_partial, lse_partial, out, arrivals, kv_heads, total_splits, smem);
}
