// Fused decode attention over the quantized cache on the CPU (one query token per sequence): the CPU
// counterpart of the CUDA decode, reading the same stores through the same descriptor (kvcal/runtime/
// kernels.py's SideField order, plus the CPU fields below), so that a decode step neither dequantizes the
// whole cache into memory nor concatenates it. The specification is kvcal/runtime/reference.py; the tests
// (tests/test_runtime_cpu_kernel.py) compare the two on every codec, layout and segment arrangement.
//
// Per (sequence, KV head), tokens in chunks of CHUNK: a chunk's keys are decoded token-major into a small
// buffer, outliers put in (their exact fp16 values, as the reference does), pre-RoPE keys rotated with the
// step's cos/sin tables, and scored (key_scores, head_scores); an online softmax (natural exponent)
// updates the running state; the chunk's values are decoded token-major and accumulated. MLA's latent
// (kvcal.adapters.LatentAttention) is the values, which the query's latent part scores beside the keys. The
// running state (max, sum, output) lives in the caller's arrays, so launches over different segment groups
// (Cocktail's widths) chain into one softmax.
//
// Compiled at first use by kvcal/runtime/cpu_kernel.py with the host C++ compiler for the CPU's instruction set; a
// call runs on the threads torch uses (see kvcal_decode_attention_cpu), one call per layer.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__F16C__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace {

constexpr int CHUNK = 64;                        // tokens decoded per pass: a chunk of keys for D=128 is 32 KiB
constexpr int SPLIT = 512;                       // tokens per task at most (a multiple of CHUNK): the unit of work of a thread
constexpr int MIN_TASKS = 16;                    // fewer tokens per task (down to CHUNK) until a call has this many tasks
constexpr float TINY_SCALE = 5.9604644775390625e-8f;  // kvcal.quantizers.TINY_SCALE
constexpr float MIN_HALF_RANGE = 1e-8f;          // kvcal.quantizers.denormalize's clamp

enum Codec { FP16_ONLY = 0, UNIFORM_TOKEN = 1, UNIFORM_CHANNEL = 2, CODEBOOK_CHANNEL = 3, CODEBOOK_TOKEN = 4, PERMUTED_GROUPS = 5 };
enum Layout { LSB1 = 1, LSB2 = 2, PLANES3 = 3, LSB4 = 4, KVMIX3 = 5 };

// segments.cuh's SideField order, then the CPU kernel's own fields.
enum SideField {
    SINK, SINK_STRIDE, RECENT, RECENT_STRIDE, WORDS, WORDS_STRIDE, WORDS_PER_ROW, PARAM0, PARAM1, PARAM_STRIDE,
    PARAM_COLS, PARAM_EXTRA, PARAM_ROW, PARAM_COLUMN, CODEBOOK, OUTLIER_POSITIONS, OUTLIER_VALUES, OUTLIER_STRIDE, OUTLIER_OFFSETS, OFFSET_STRIDE,
    OUTLIER_COUNTS, OUTLIER_TILE_SHIFT, LAYOUT, GROUP_OF_CHANNEL, PARAM_FP8, PIECE_STRIDE, PIECE_CHANNELS,
    CODEC, SIDE_FIELDS
};
// Per (side, sequence): side_lengths' four (sink, body and recent rows, the recent segment's first row), then the
// body's first live row (a sliding-window layer drops rows from the front) and the first stored token the query sees.
enum MetaField { M_SINK, M_BODY, M_HEAD, M_RECENT, M_BODY_HEAD, M_FIRST, META_FIELDS };

// fp8 e4m3 (torch.float8_e4m3fn) -> float, exact: bias 7, subnormals m * 2^-9 (its NaN, which kvcal never stores,
// reads as 480). SKVQ's fp8 parameters.
inline float e4m3_to_float(uint8_t v) {
    const int exponent = (v >> 3) & 15, mantissa = v & 7;
    float magnitude = (float)mantissa * 0.001953125f;
    if (exponent) {
        const uint32_t bits = (uint32_t)(exponent + 120) << 23 | (uint32_t)mantissa << 20;
        std::memcpy(&magnitude, &bits, 4);
    }
    return v & 0x80 ? -magnitude : magnitude;
}

// IEEE binary16 -> float, exact (subnormals, infinities and NaN included): the hardware's conversion where the target
// has one (F16C, AVX512-FP16, aarch64: loops of it vectorize), else by bits.
#if defined(__aarch64__)
inline float half_to_float(uint16_t h) {
    __fp16 f;
    std::memcpy(&f, &h, 2);
    return (float)f;
}
#elif defined(__F16C__) || defined(__AVX512FP16__)
inline float half_to_float(uint16_t h) {
    _Float16 f;
    std::memcpy(&f, &h, 2);
    return (float)f;
}
#else
inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t bits = (uint32_t)(h & 0x7fffu) << 13;
    const uint32_t exponent = bits & 0x0f800000u;
    bits += (127u - 15u) << 23;
    float f;
    if (exponent == 0x0f800000u) {
        bits += (128u - 16u) << 23;  // Inf / NaN
        std::memcpy(&f, &bits, 4);
    } else if (exponent == 0) {  // zero / subnormal: renormalize through a float subtraction
        bits += 1u << 23;
        std::memcpy(&f, &bits, 4);
        const uint32_t magic_bits = 113u << 23;
        float magic;
        std::memcpy(&magic, &magic_bits, 4);
        f -= magic;
    } else {
        std::memcpy(&f, &bits, 4);
    }
    uint32_t out;
    std::memcpy(&out, &f, 4);
    out |= sign;
    std::memcpy(&f, &out, 4);
    return f;
}
#endif

// out[c] = half_to_float(in[c]) for c < n, 8 (F16C) or 4 (NEON) at a time: the fp16 sink and recent rows (GCC
// leaves the scalar loop scalar).
inline void halves_to_floats(const uint16_t* __restrict__ in, float* __restrict__ out, int n) {
    int c = 0;
#if defined(__F16C__)
    for (; c + 8 <= n; c += 8) _mm256_storeu_ps(out + c, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(in + c))));
#elif defined(__aarch64__)
    for (; c + 4 <= n; c += 4) vst1q_f32(out + c, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(in + c))));
#endif
    for (; c < n; ++c) out[c] = half_to_float(in[c]);
}

// LANES lanes of int32 / float (GCC vector extensions): 16 where the target has AVX-512 (one zmm register), else 8
// (one ymm register on AVX2; a pair of 128-bit registers on NEON or SSE). The compiler's target decides, so one
// source serves every build (kvcal/runtime/cpu_kernel.py compiles for the CPU's x86-64 level or -march=native).
#if defined(__AVX512F__)
constexpr int LANES = 16;
#else
constexpr int LANES = 8;
#endif
typedef int32_t vi32 __attribute__((vector_size(4 * LANES)));
typedef uint32_t vu32 __attribute__((vector_size(4 * LANES)));
typedef float vf32 __attribute__((vector_size(4 * LANES)));
static_assert(32 % LANES == 0, "a unit of 32 codes is a whole number of vectors");

// The larger of a and b for a b that is not NaN: std::fmax's result (a NaN a gives b) without its libm call (GCC
// inlines fmaxf only under -ffinite-math-only, which the running softmax's -inf forbids).
inline float max_or(float a, float b) { return a > b ? a : b; }

struct Side {
    const uint16_t* sink; long long sink_stride;
    const uint16_t* recent; long long recent_stride;
    // body row r of sequence b: its piece holding channel c (piece_channels a piece) at words + b * words_stride + r *
    // words_per_row + (c / piece_channels) * piece_stride (kvcal.runtime.store.PackedRows: a KV head a piece on CPU)
    const uint32_t* words; long long words_stride; int words_per_row; long long piece_stride; int piece_channels;
    // parameter (row, column) at b * param_stride + row * param_row + column * param_column (segments.cuh's Side)
    const void* param0; const void* param1; long long param_stride; int param_cols; int param_extra;
    long long param_row, param_column;
    const float* codebook;
    const uint16_t* outlier_positions; const uint16_t* outlier_values; long long outlier_stride;
    const int32_t* outlier_offsets; long long offset_stride; const int32_t* outlier_counts; int tile_shift;
    int layout, codec;
    const int32_t* group_of_channel;
    int param_fp8;  // PERMUTED_GROUPS: fp8 e4m3 parameters (1 byte), not fp16
};

Side load_side(const long long* d) {
    Side s;
    s.sink = (const uint16_t*)d[SINK]; s.sink_stride = d[SINK_STRIDE];
    s.recent = (const uint16_t*)d[RECENT]; s.recent_stride = d[RECENT_STRIDE];
    s.words = (const uint32_t*)d[WORDS]; s.words_stride = d[WORDS_STRIDE]; s.words_per_row = (int)d[WORDS_PER_ROW];
    s.piece_stride = d[PIECE_STRIDE]; s.piece_channels = (int)d[PIECE_CHANNELS];
    s.param0 = (const void*)d[PARAM0]; s.param1 = (const void*)d[PARAM1]; s.param_stride = d[PARAM_STRIDE];
    s.param_cols = (int)d[PARAM_COLS]; s.param_extra = (int)d[PARAM_EXTRA];
    s.param_row = d[PARAM_ROW]; s.param_column = d[PARAM_COLUMN];
    s.codebook = (const float*)d[CODEBOOK];
    s.outlier_positions = (const uint16_t*)d[OUTLIER_POSITIONS]; s.outlier_values = (const uint16_t*)d[OUTLIER_VALUES];
    s.outlier_stride = d[OUTLIER_STRIDE]; s.outlier_offsets = (const int32_t*)d[OUTLIER_OFFSETS];
    s.offset_stride = d[OFFSET_STRIDE]; s.outlier_counts = (const int32_t*)d[OUTLIER_COUNTS];
    s.tile_shift = (int)d[OUTLIER_TILE_SHIFT];
    s.layout = (int)d[LAYOUT]; s.codec = (int)d[CODEC];
    s.group_of_channel = (const int32_t*)d[GROUP_OF_CHANNEL];
    s.param_fp8 = (int)d[PARAM_FP8];
    return s;
}

struct Lengths {
    int sink, body, head, recent, body_head;
};

// The code of slot `i` of a packed row (kvcal/packing.py layouts; common.cuh's code_in).
template <int LAYOUT>
inline uint32_t code_at(const uint32_t* row, int i) {
    if (LAYOUT == PLANES3) {
        const uint32_t* unit = row + (i >> 5) * 3;
        const int j = i & 31;
        return ((unit[j >> 4] >> ((j & 15) * 2)) & 3u) | (((unit[2] >> j) & 1u) << 2);
    }
    constexpr int BITS = LAYOUT == KVMIX3 ? 3 : LAYOUT, PER_WORD = LAYOUT == KVMIX3 ? 11 : 32 / BITS;
    return (row[i / PER_WORD] >> ((i % PER_WORD) * BITS)) & ((1u << BITS) - 1u);
}

// What one side needs per call for the work item's KV head.
struct HeadTables {
    std::vector<float> half_range, mid;  // CODEBOOK_CHANNEL: per channel: value = codebook[code] * half_range + mid
    std::vector<float> scale, zero;    // UNIFORM_CHANNEL: the current block's D scales and zeros; PERMUTED_GROUPS: the
                                       // chunk's rows' group parameters, param_slots per row; CODEBOOK_TOKEN: the
                                       // chunk's rows' half ranges and mids, one per row
    std::vector<int32_t> codes;        // one row's codes of the head
    std::vector<int32_t> groups;       // PERMUTED_GROUPS: the parameter group of each of the head's channels
    std::vector<long long> group_at;   // UNIFORM_TOKEN: per LANES channels of the head, its group's parameter column offset
    alignas(64) float codebook[16] = {};  // the codebook (zeros past its levels)
    long long block = -1;
    int levels = 0, param_slots = 0;
};

void prepare_tables(const Side& s, HeadTables& t, int kv_head, int D) {
    if (s.codec == FP16_ONLY) return;
    const int bits = s.layout == KVMIX3 ? 3 : s.layout;
    t.levels = 1 << bits;
    t.block = -1;
    if (s.codebook != nullptr)
        for (int j = 0; j < t.levels; ++j) t.codebook[j] = s.codebook[j];
    if (s.codec == CODEBOOK_CHANNEL) {
        t.half_range.resize(D);
        t.mid.resize(D);
        const float* lo = (const float*)s.param0 + (long long)kv_head * D;
        const float* hi = (const float*)s.param1 + (long long)kv_head * D;
        for (int c = 0; c < D; ++c) {
            t.half_range[c] = max_or((hi[c] - lo[c]) / 2.0f, MIN_HALF_RANGE);
            t.mid[c] = (hi[c] + lo[c]) / 2.0f;
        }
    }
    t.param_slots = s.codec == PERMUTED_GROUPS ? (int)std::max(16, s.param_cols) : 0;  // a lookup reads 16
    t.scale.resize((size_t)std::max(D, CHUNK * std::max(t.param_slots, 1)));
    t.zero.resize(t.scale.size());
    t.codes.resize(D);
    if (s.codec == UNIFORM_TOKEN && s.param_extra > 0) {  // once per head: no division per vector
        t.group_at.resize((D + LANES - 1) / LANES);
        for (int first = 0; first < D; first += LANES)
            t.group_at[first / LANES] = (long long)((kv_head * D + first) / s.param_extra) * s.param_column;
    }
    if (s.codec == PERMUTED_GROUPS)
        t.groups.assign(s.group_of_channel + (long long)kv_head * D, s.group_of_channel + (long long)(kv_head + 1) * D);
}

inline vf32 loadv(const float* p) {
    vf32 v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

inline void storev(float* p, vf32 v) { std::memcpy(p, &v, sizeof v); }

inline vu32 lane_index() {
    vu32 v;
    for (int i = 0; i < LANES; ++i) v[i] = (uint32_t)i;
    return v;
}

// table[index] lane by lane for a table of ENTRIES <= 16 floats (stored with room for 16): one vpermps when the table
// fits a register (AVX-512; AVX2 up to 8 entries), two and a blend on the index's top bit otherwise (AVX2, 16).
template <int ENTRIES>
inline vf32 lookup(const float* table, vi32 index) {
#if defined(__clang__)
    vf32 out;
    for (int i = 0; i < LANES; ++i) out[i] = table[index[i]];
    return out;
#else
    if constexpr (ENTRIES <= LANES)
        return __builtin_shuffle(loadv(table), index);
    else
        return __builtin_shuffle(loadv(table), loadv(table + LANES), index);
#endif
}

// table[index] lane by lane for a table of ENTRIES <= 16 floats held in registers (16 / LANES vectors).
template <int ENTRIES>
inline vf32 select(const vf32* table, vi32 index) {
#if defined(__clang__)
    float spilled[16];
    for (int k = 0; k < 16 / LANES; ++k) storev(spilled + k * LANES, table[k]);
    vf32 out;
    for (int i = 0; i < LANES; ++i) out[i] = spilled[index[i]];
    return out;
#else
    if constexpr (ENTRIES <= LANES)
        return __builtin_shuffle(table[0], index);
    else
        return __builtin_shuffle(table[0], table[1], index);
#endif
}

// Words per unit of 32 codes in the "lsb" 1/2/4 and planes3 layouts.
template <int LAYOUT>
constexpr int UNIT_WORDS = LAYOUT == PLANES3 ? 3 : LAYOUT;

// Codes k .. k + LANES - 1 of the unit of 32 codes at `unit` (k a multiple of LANES), in "lsb" 1/2/4 or planes3.
// Called with a constant k (an unrolled loop over the unit), its shifts are constant vectors.
template <int LAYOUT>
inline vi32 unpack_unit(const uint32_t* unit, int k) {
    const vu32 lanes = lane_index();
    if (LAYOUT == LSB1) return (vi32)((unit[0] >> (lanes + (uint32_t)k)) & 1u);
    if (LAYOUT == LSB2) return (vi32)((unit[k >> 4] >> ((lanes + (uint32_t)(k & 15)) * 2u)) & 3u);
    if (LAYOUT == LSB4) {
        if constexpr (LANES == 8) {
            return (vi32)((unit[k >> 3] >> (lanes * 4u)) & 15u);
        } else {  // two words, 8 codes each, blended from broadcasts (a vector built lane by lane in memory stalls
                  // on store forwarding)
            const vu32 pair = lanes < 8u ? vu32{} + unit[k >> 3] : vu32{} + unit[(k >> 3) + 1];
            return (vi32)((pair >> ((lanes & 7u) * 4u)) & 15u);
        }
    }
    // PLANES3: low 2 bits of codes 0-15 and 16-31 in words 0 and 1, high bits in word 2
    return (vi32)(((unit[k >> 4] >> ((lanes + (uint32_t)(k & 15)) * 2u)) & 3u) | (((unit[2] >> (lanes + (uint32_t)k)) & 1u) << 2));
}

// kvmix's 11 codes per word: codes first .. first + LANES - 1 of a row (first < KVMIX_MAX_CODES).
inline vi32 unpack_kvmix(const uint32_t* words, int first) {
    const vu32 lanes = lane_index();
    const vu32 index = lanes + (uint32_t)first;  // code i: bits 3 (i % 11) .. of word i / 11 (the eleventh keeps 2 bits)
    const vu32 word = (index * 47663u) >> 19;  // index / 11 for index < KVMIX_MAX_CODES, without a division
    const uint32_t base = (uint32_t)first / 11u, last = (uint32_t)(first + LANES - 1) / 11u;  // words read: no further
    const vu32 relative = word - base;  // LANES codes span at most 3 words (2 on 8 lanes)
    vu32 w = relative == 0u ? vu32{} + words[base] : vu32{} + words[std::min(base + 1, last)];
    if constexpr (LANES > 11) w = relative == 2u ? vu32{} + words[std::min(base + 2, last)] : w;
    return (vi32)((w >> ((index - word * 11u) * 3u)) & 7u);
}

template <int LAYOUT>
constexpr int LEVELS = LAYOUT == LSB1 ? 2 : LAYOUT == LSB2 ? 4 : LAYOUT == PLANES3 || LAYOUT == KVMIX3 ? 8 : 16;

constexpr int KVMIX_MAX_CODES = 90000;  // (index * 47663) >> 19 == index / 11 below it (and the product fits 32 bits)

// Body row `row` of sequence b, channels head_channel .. + D, decoded into out[0 .. D); slot: its place in the chunk
// (PERMUTED_GROUPS reads its parameters there: group_parameters).
template <int CODEC, int LAYOUT>
inline void decode_row(const Side& s, HeadTables& t, int b, int row, int slot, int head_channel, int D, float* __restrict__ out) {
    // the piece holding the KV head's channels, from channel code_channel of it (a KV head never spans two pieces)
    const int piece = head_channel / s.piece_channels, code_channel = head_channel - piece * s.piece_channels;
    const uint32_t* words = s.words + b * s.words_stride + (long long)row * s.words_per_row + piece * s.piece_stride;
    const uint16_t* p0 = (const uint16_t*)s.param0;
    const uint16_t* p1 = (const uint16_t*)s.param1;
    int32_t* __restrict__ codes = t.codes.data();
    if (CODEC == UNIFORM_CHANNEL) {  // per (block of tokens, channel): converted once per block
        const long long block = row / s.param_extra;
        if (block != t.block) {
            const long long at = b * s.param_stride + block * s.param_row + head_channel;
            for (int c = 0; c < D; ++c) {
                t.scale[c] = max_or(half_to_float(p0[at + c]), TINY_SCALE);
                t.zero[c] = half_to_float(p1[at + c]);
            }
            t.block = block;
        }
    }
    // CODEBOOK_TOKEN: the row's decoded levels in registers (stored one by one and loaded as a vector, they stalled on
    // store forwarding), from its (half range, mid) in its slot (token_ranges)
    vf32 levels[16 / LANES] = {};
    if (CODEC == CODEBOOK_TOKEN)
        for (int k = 0; k < 16 / LANES; ++k) levels[k] = loadv(t.codebook + k * LANES) * t.scale[slot] + t.zero[slot];
    const float* group_scale = t.scale.data() + (size_t)slot * t.param_slots;  // PERMUTED_GROUPS: this row's
    const float* group_zero = t.zero.data() + (size_t)slot * t.param_slots;
    const bool vector_parameters = CODEC == UNIFORM_TOKEN ? s.param_extra % LANES == 0 : CODEC != PERMUTED_GROUPS || s.param_cols <= 16;
    const bool few_groups = s.param_cols <= LANES;  // PERMUTED_GROUPS: a lookup of one register (one vpermps on AVX2)
    const bool vector_layout = LAYOUT == KVMIX3 ? code_channel + D <= KVMIX_MAX_CODES : code_channel % 32 == 0;
    if (vector_layout && D % 32 == 0 && vector_parameters) {
        const long long token_at = b * s.param_stride + (long long)row * s.param_row;
        const auto decode_vector = [&](int first, vi32 code_index) {
            const vf32 code = __builtin_convertvector(code_index, vf32);
            vf32 value;
            if (CODEC == UNIFORM_TOKEN) {
                const long long g = t.group_at[first / LANES];
                value = code * max_or(half_to_float(p0[token_at + g]), TINY_SCALE) + half_to_float(p1[token_at + g]);
            } else if (CODEC == UNIFORM_CHANNEL) {
                value = code * loadv(t.scale.data() + first) + loadv(t.zero.data() + first);
            } else if (CODEC == CODEBOOK_CHANNEL) {
                value = lookup<LEVELS<LAYOUT>>(t.codebook, code_index) * loadv(t.half_range.data() + first) + loadv(t.mid.data() + first);
            } else if (CODEC == PERMUTED_GROUPS) {
                vi32 group;
                std::memcpy(&group, t.groups.data() + first, sizeof group);
                value = few_groups ? (code + lookup<LANES>(group_zero, group)) * lookup<LANES>(group_scale, group)
                                   : (code + lookup<16>(group_zero, group)) * lookup<16>(group_scale, group);
            } else {  // CODEBOOK_TOKEN
                value = select<LEVELS<LAYOUT>>(levels, code_index);
            }
            storev(out + first, value);
        };
        if constexpr (LAYOUT == KVMIX3) {
            for (int first = 0; first < D; first += LANES) decode_vector(first, unpack_kvmix(words, code_channel + first));
        } else {
            for (int first = 0; first < D; first += 32) {
                const uint32_t* unit = words + ((code_channel + first) >> 5) * UNIT_WORDS<LAYOUT>;
#pragma GCC unroll 4
                for (int k = 0; k < 32; k += LANES) decode_vector(first + k, unpack_unit<LAYOUT>(unit, k));
            }
        }
        return;
    }
    // code by code: kvmix's 11 codes per word, heads not on a 32-code boundary, groups not a multiple of LANES
    for (int c = 0; c < D; ++c) codes[c] = (int32_t)code_at<LAYOUT>(words, code_channel + c);
    if (CODEC == UNIFORM_TOKEN) {  // code * scale + zero, one (scale, zero) per group of channels: a loop per group
        const long long at = b * s.param_stride + (long long)row * s.param_row;
        for (int c = 0; c < D;) {
            const int g = (head_channel + c) / s.param_extra, end = std::min(D, (g + 1) * s.param_extra - head_channel);
            const float scale = max_or(half_to_float(p0[at + g * s.param_column]), TINY_SCALE);
            const float zero = half_to_float(p1[at + g * s.param_column]);
            for (; c < end; ++c) out[c] = (float)codes[c] * scale + zero;
        }
    } else if (CODEC == UNIFORM_CHANNEL) {
        for (int c = 0; c < D; ++c) out[c] = (float)codes[c] * t.scale[c] + t.zero[c];
    } else if (CODEC == CODEBOOK_CHANNEL) {
        for (int c = 0; c < D; ++c) out[c] = t.codebook[codes[c]] * t.half_range[c] + t.mid[c];
    } else if (CODEC == PERMUTED_GROUPS) {
        for (int c = 0; c < D; ++c) out[c] = ((float)codes[c] + group_zero[t.groups[c]]) * group_scale[t.groups[c]];
    } else {  // CODEBOOK_TOKEN
        float table[16];
        for (int k = 0; k < 16 / LANES; ++k) storev(table + k * LANES, levels[k]);
        for (int c = 0; c < D; ++c) out[c] = table[codes[c]];
    }
}

// PERMUTED_GROUPS (SKVQ, codes in channel order: value = (code + zero) * scale of the channel's group): the group
// parameters of body rows first .. first + rows - 1, as floats, into slots from `slot` on; written for the whole chunk
// before its rows are decoded, so that a row's vector reads of them are not stalled behind their scalar stores.
inline void group_parameters(const Side& s, HeadTables& t, int b, int first, int rows, int slot) {
    for (int i = 0; i < rows; ++i) {
        const long long at = b * s.param_stride + (long long)(first + i) * s.param_row;
        float* scale = t.scale.data() + (size_t)(slot + i) * t.param_slots;
        float* zero = t.zero.data() + (size_t)(slot + i) * t.param_slots;
        for (int g = 0; g < s.param_cols; ++g) {
            const long long k = at + g * s.param_column;
            const float raw_scale = s.param_fp8 ? e4m3_to_float(((const uint8_t*)s.param0)[k]) : half_to_float(((const uint16_t*)s.param0)[k]);
            scale[g] = max_or(raw_scale, TINY_SCALE);
            zero[g] = s.param_fp8 ? e4m3_to_float(((const uint8_t*)s.param1)[k]) : half_to_float(((const uint16_t*)s.param1)[k]);
        }
    }
}

// CODEBOOK_TOKEN (a codebook scaled per token: value = codebook[code] * half range + mid): the (half range, mid) of
// body rows first .. first + rows - 1 into slots from `slot` on, in one loop before the rows are decoded, so that a
// row's scalar conversions are not in the chain of its decode.
inline void token_ranges(const Side& s, HeadTables& t, int b, int first, int rows, int slot) {
    const uint16_t* p0 = (const uint16_t*)s.param0;
    const uint16_t* p1 = (const uint16_t*)s.param1;
    for (int i = 0; i < rows; ++i) {
        const long long at = b * s.param_stride + (long long)(first + i) * s.param_row;
        const float lo = half_to_float(p0[at]), hi = half_to_float(p1[at]);
        t.scale[slot + i] = max_or((hi - lo) / 2.0f, MIN_HALF_RANGE);
        t.zero[slot + i] = (hi + lo) / 2.0f;
    }
}

// Tokens t0 .. t0 + n - 1 of sequence b on one side (sink | body | recent in position order), channels of the
// KV head, as floats, token-major: out[i * D + c].
template <int CODEC, int LAYOUT>
void decode_tokens(const Side& s, HeadTables& t, const Lengths& len, int b, int kv_head, int kv_heads, int D, int width,
                   int t0, int n, float* out) {
    const int head_channel = kv_head * D;
    if (CODEC == PERMUTED_GROUPS || CODEC == CODEBOOK_TOKEN) {
        const int first = std::max(t0, len.sink), end = std::min(t0 + n, len.sink + len.body);
        if (first < end)
            (CODEC == PERMUTED_GROUPS ? group_parameters : token_ranges)(s, t, b, len.body_head + first - len.sink, end - first, first - t0);
    }
    for (int i = 0; i < n; ++i) {
        const int token = t0 + i;
        const uint16_t* fp16;
        if (token < len.sink) {
            fp16 = s.sink + b * s.sink_stride + (long long)token * width;
        } else if (CODEC != FP16_ONLY && token - len.sink < len.body) {
            decode_row<CODEC, LAYOUT>(s, t, b, len.body_head + token - len.sink, i, head_channel, D, out + (long long)i * D);
            continue;
        } else {
            fp16 = s.recent + b * s.recent_stride + (long long)(len.head + token - len.sink - len.body) * width;
        }
        halves_to_floats(fp16 + head_channel, out + (long long)i * D, D);
    }
    // outliers of the chunk's body rows (rows of the store: from body_head on): tile t's are [offset[t], offset[t + 1]),
    // the last started tile's end is the run's count; within a tile in append (row) order
    if (CODEC == FP16_ONLY || s.outlier_counts == nullptr) return;
    const int row_lo = len.body_head + std::max(t0 - len.sink, 0), row_hi = len.body_head + std::min(t0 + n - len.sink, len.body);
    if (row_lo >= row_hi) return;
    const long long run = (long long)b * kv_heads + kv_head;
    const uint16_t* positions = s.outlier_positions + run * s.outlier_stride;
    const uint16_t* values = s.outlier_values + run * s.outlier_stride;
    const int32_t* offsets = s.outlier_offsets + run * s.offset_stride;
    const int last_tile = (len.body_head + len.body - 1) >> s.tile_shift;
    const bool power_of_two = (D & (D - 1)) == 0;  // a position's row and channel by shift and mask (no division)
    const int d_shift = __builtin_ctz((unsigned)D);
    for (int tile = row_lo >> s.tile_shift; tile <= (row_hi - 1) >> s.tile_shift; ++tile) {
        const int end = tile < last_tile ? offsets[tile + 1] : s.outlier_counts[run];
        for (int e = offsets[tile]; e < end; ++e) {
            const int position = positions[e];
            const int in_tile = power_of_two ? position >> d_shift : position / D;
            const int row = (tile << s.tile_shift) + in_tile, c = position - in_tile * D;
            if (row >= row_hi) break;
            if (row < row_lo) continue;
            out[(long long)(row - len.body_head + len.sink - t0) * D + c] = half_to_float(values[e]);
        }
    }
}

typedef void (*DecodeTokens)(const Side&, HeadTables&, const Lengths&, int, int, int, int, int, int, int, float*);

template <int CODEC>
DecodeTokens for_layout(int layout) {
    switch (layout) {
        case LSB1: return decode_tokens<CODEC, LSB1>;
        case LSB2: return decode_tokens<CODEC, LSB2>;
        case PLANES3: return decode_tokens<CODEC, PLANES3>;
        case LSB4: return decode_tokens<CODEC, LSB4>;
        default: return decode_tokens<CODEC, KVMIX3>;
    }
}

DecodeTokens decoder(const Side& s) {
    switch (s.codec) {
        case UNIFORM_TOKEN: return for_layout<UNIFORM_TOKEN>(s.layout);
        case UNIFORM_CHANNEL: return for_layout<UNIFORM_CHANNEL>(s.layout);
        case CODEBOOK_CHANNEL: return for_layout<CODEBOOK_CHANNEL>(s.layout);
        case CODEBOOK_TOKEN: return for_layout<CODEBOOK_TOKEN>(s.layout);
        case PERMUTED_GROUPS: return for_layout<PERMUTED_GROUPS>(s.layout);
        default: return decode_tokens<FP16_ONLY, LSB1>;
    }
}

// exp(x) for x <= 0 in float32 to about 2 ulp (Cody-Waite reduction by ln 2, degree-6 polynomial), written so
// that loops over it vectorize (std::exp does not without -ffast-math); x below -87 gives exp(-87), a weight of 2^-125 against the maximum's 1.
inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const int32_t k = (int32_t)(x * 1.44269504088896341f - 0.5f);  // round(x / ln 2) (x <= 0: truncation is ceil)
    const float n = (float)k;
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * __builtin_bit_cast(float, (k + 127) << 23);
}

// Lane j of the result: the sum of the lanes of t[j] (LANES horizontal sums in log2(LANES) rounds of pairwise
// shuffles and adds, instead of a reduction per vector). Round r pairs t[2p], t[2p + 1] and keeps, of each block of
// 2h lanes, the low h lanes' sums in one half and the high h lanes' in the other (h = LANES / 2, / 4, ... 1).
#if defined(__AVX512F__)
inline vf32 sum_lanes(vf32* t) {
    const vi32 low8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}, high8 = low8 + 8;
    const vi32 low4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27}, high4 = low4 + 4;
    const vi32 low2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29}, high2 = low2 + 2;
    const vi32 low1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}, high1 = low1 + 1;
    for (int p = 0; p < 8; ++p) t[p] = __builtin_shuffle(t[2 * p], t[2 * p + 1], low8) + __builtin_shuffle(t[2 * p], t[2 * p + 1], high8);
    for (int p = 0; p < 4; ++p) t[p] = __builtin_shuffle(t[2 * p], t[2 * p + 1], low4) + __builtin_shuffle(t[2 * p], t[2 * p + 1], high4);
    for (int p = 0; p < 2; ++p) t[p] = __builtin_shuffle(t[2 * p], t[2 * p + 1], low2) + __builtin_shuffle(t[2 * p], t[2 * p + 1], high2);
    return __builtin_shuffle(t[0], t[1], low1) + __builtin_shuffle(t[0], t[1], high1);
}
#else
inline vf32 sum_lanes(vf32* t) {
    const vi32 low4 = {0, 1, 2, 3, 8, 9, 10, 11}, high4 = low4 + 4;
    const vi32 low2 = {0, 1, 4, 5, 8, 9, 12, 13}, high2 = low2 + 2;
    const vi32 low1 = {0, 2, 4, 6, 8, 10, 12, 14}, high1 = low1 + 1;
    for (int p = 0; p < 4; ++p) t[p] = __builtin_shuffle(t[2 * p], t[2 * p + 1], low4) + __builtin_shuffle(t[2 * p], t[2 * p + 1], high4);
    for (int p = 0; p < 2; ++p) t[p] = __builtin_shuffle(t[2 * p], t[2 * p + 1], low2) + __builtin_shuffle(t[2 * p], t[2 * p + 1], high2);
    return __builtin_shuffle(t[0], t[1], low1) + __builtin_shuffle(t[0], t[1], high1);
}
#endif

// s[i] = q . keys[i * D ..] for i < n (keys hold CHUNK rows, finite past n): LANES tokens at a time when D is a
// multiple of LANES, their lane-wise products in LANES independent sums (channels outer, tokens inner: one sum per
// token would chain its multiply-adds through the FMA latency) summed across lanes together; one dot product at a
// time otherwise.
inline void key_scores(const float* __restrict__ q, const float* __restrict__ keys, int n, int D, float* __restrict__ s) {
#if !defined(__clang__)
    if (D % LANES == 0) {
        for (int i0 = 0; i0 < n; i0 += LANES) {
            const float* k = keys + (size_t)i0 * D;
            vf32 t[LANES];
            const vf32 q0 = loadv(q);
            for (int j = 0; j < LANES; ++j) t[j] = q0 * loadv(k + (size_t)j * D);
            for (int c = LANES; c < D; c += LANES) {
                const vf32 qc = loadv(q + c);
                for (int j = 0; j < LANES; ++j) t[j] += qc * loadv(k + (size_t)j * D + c);
            }
            storev(s + i0, sum_lanes(t));
        }
        return;
    }
#endif
    for (int i = 0; i < n; ++i) {
        const float* __restrict__ k = keys + (size_t)i * D;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int c = 0; c < D; ++c) dot += q[c] * k[c];
        s[i] = dot;
    }
}

// Query heads scored together (head_scores): a key vector loaded once serves them all, so that a group of many heads
// (MLA's 16 to 128 over one latent) reads the chunk from cache a quarter as often as one head at a time would.
constexpr int SCORED_HEADS = 4;

#if !defined(__clang__)
// s[h * CHUNK + i] (+)= q[h * q_stride ..] . keys[i * D ..] for the SCORED_HEADS heads h and i < n (written up to the
// next multiple of LANES / SCORED_HEADS, within CHUNK; keys finite past n), D a multiple of LANES: LANES /
// SCORED_HEADS tokens at a time, a sum per (head, token) in the lanes of one vector, summed across lanes as
// key_scores sums them.
template <bool ADD>
inline void head_scores(const float* __restrict__ q, int q_stride, const float* __restrict__ keys, int n, int D,
                        float* __restrict__ s) {
    constexpr int H = SCORED_HEADS, TOKENS = LANES / H;
    for (int i0 = 0; i0 < n; i0 += TOKENS) {
        const float* k = keys + (size_t)i0 * D;
        vf32 t[LANES] = {};
        for (int c = 0; c < D; c += LANES) {
            vf32 key[TOKENS], query[H];
            for (int j = 0; j < TOKENS; ++j) key[j] = loadv(k + (size_t)j * D + c);
            for (int h = 0; h < H; ++h) {
                query[h] = loadv(q + (size_t)h * q_stride + c);
#if defined(__AVX__)  // in a register (one holds a vector from AVX on): GCC would fold its load into each multiply-add
                asm("" : "+v"(query[h]));
#endif
            }
            for (int h = 0; h < H; ++h)
                for (int j = 0; j < TOKENS; ++j) t[h * TOKENS + j] += query[h] * key[j];
        }
        const vf32 sums = sum_lanes(t);
        for (int h = 0; h < H; ++h)
            for (int j = 0; j < TOKENS; ++j) {
                float& out = s[(size_t)h * CHUNK + i0 + j];
                out = ADD ? out + sums[h * TOKENS + j] : sums[h * TOKENS + j];
            }
    }
}
#endif

// s[i] = softcap tanh(s[i] / softcap) for i < n (Gemma 2's soft-capped scores: kvcal.kv.softcapped) through
// exp_nonpositive, so that the loop vectorizes: tanh |x| = (1 - e) / (1 + e), e = exp(-2 |x|), the sign put back.
// Within about softcap x 2^-23 of the exact cap (the subtraction near 0 rounds to the ulp of 1).
inline void cap_scores(float* __restrict__ s, int n, float softcap) {
#pragma omp simd
    for (int i = 0; i < n; ++i) {
        const float e = exp_nonpositive(-2.0f * std::fabs(s[i] / softcap));
        s[i] = std::copysign(softcap * ((1.0f - e) / (1.0f + e)), s[i]);
    }
}

// The largest of s[0 .. n) (-inf for n = 0; a NaN score is passed over, as std::fmax would), a vector at a time.
inline float largest(const float* s, int n) {
    vf32 most = vf32{} - INFINITY;
    int i = 0;
    for (; i + LANES <= n; i += LANES) {
        const vf32 v = loadv(s + i);
        most = v > most ? v : most;
    }
    float out = -INFINITY;
    for (int j = 0; j < LANES; ++j) out = max_or(most[j], out);
    for (; i < n; ++i) out = max_or(s[i], out);
    return out;
}

// For H query heads h of a group: a[h * a_stride + c] += sum_i p[h * CHUNK + i] v[i * D + c], channels c0 .. c0 +
// VB * LANES - 1. The H x VB sums stay in registers over the tokens and each value vector is loaded once for all H
// heads: H x VB independent multiply-adds per token (one head at a time chained each sum through the FMA latency
// and loaded every value row once per head).
template <int H, int VB>
inline void accumulate_block(const float* __restrict__ p, const float* __restrict__ v, int n, int D, int c0,
                             float* __restrict__ a, int a_stride) {
    vf32 sum[H][VB];
    for (int h = 0; h < H; ++h)
        for (int k = 0; k < VB; ++k) sum[h][k] = loadv(a + (size_t)h * a_stride + c0 + k * LANES);
    for (int i = 0; i < n; ++i) {
        vf32 x[VB];
        for (int k = 0; k < VB; ++k) x[k] = loadv(v + (size_t)i * D + c0 + k * LANES);
        for (int h = 0; h < H; ++h) {
            const float w = p[(size_t)h * CHUNK + i];
            for (int k = 0; k < VB; ++k) sum[h][k] += w * x[k];
        }
    }
    for (int h = 0; h < H; ++h)
        for (int k = 0; k < VB; ++k) storev(a + (size_t)h * a_stride + c0 + k * LANES, sum[h][k]);
}

// Blocks of 64 channels on AVX-512 (4 vectors x 4 heads: 16 sums of 32 registers), 16 on 8 lanes (2 x 4 of 16),
// then single vectors, then channel by channel.
constexpr int VALUE_BLOCK = LANES == 16 ? 4 : 2;

template <int H>
inline void accumulate_heads(const float* p, const float* v, int n, int D, float* a, int a_stride) {
    int c = 0;
    for (; c + VALUE_BLOCK * LANES <= D; c += VALUE_BLOCK * LANES) accumulate_block<H, VALUE_BLOCK>(p, v, n, D, c, a, a_stride);
    for (; c + LANES <= D; c += LANES) accumulate_block<H, 1>(p, v, n, D, c, a, a_stride);
    for (; c < D; ++c)
        for (int h = 0; h < H; ++h)
            for (int i = 0; i < n; ++i) a[(size_t)h * a_stride + c] += p[(size_t)h * CHUNK + i] * v[(size_t)i * D + c];
}

// Every query head g of the group: a[g * a_stride + c] += sum_i p[g * CHUNK + i] v[i * D + c], up to 4 heads at a time.
inline void accumulate_values(const float* p, const float* v, int n, int D, int group, float* a, int a_stride) {
    for (int g = 0; g < group; g += 4) {
        const float* pg = p + (size_t)g * CHUNK;
        float* ag = a + (size_t)g * a_stride;
        switch (std::min(group - g, 4)) {
            case 1: accumulate_heads<1>(pg, v, n, D, ag, a_stride); break;
            case 2: accumulate_heads<2>(pg, v, n, D, ag, a_stride); break;
            case 3: accumulate_heads<3>(pg, v, n, D, ag, a_stride); break;
            default: accumulate_heads<4>(pg, v, n, D, ag, a_stride); break;
        }
    }
}

// Ask for RoPE table rows first .. first + n - 1 ahead of their use: the tables come from beyond L2 once a layer's
// weights passed, a row per token, too little work apart for the hardware prefetcher to keep them coming.
inline void prefetch_rope_rows(const float* cos_table, const float* sin_table, long long at, int first, int n, int half) {
    constexpr int LINE = 64 / sizeof(float);
    for (int i = first; i < first + n; ++i)
        for (int c = 0; c < half; c += LINE) {
            __builtin_prefetch(cos_table + at + (long long)i * half + c, 0, 2);
            __builtin_prefetch(sin_table + at + (long long)i * half + c, 0, 2);
        }
}

// reference.rotate on one key row: (x1 cos - x2 sin, x2 cos + x1 sin) per channel pair (c, c + half), from a table
// row of the half frequencies (rotate_half's full rows repeat them); LANES pairs at a time, written out (the
// compiler's vectorization of the scalar loop tests k[c] and k[c + half] for overlap and peels, at every row).
inline void rotate_row(float* __restrict__ k, const float* __restrict__ cos_row, const float* __restrict__ sin_row, int half) {
    int c = 0;
    for (; c + LANES <= half; c += LANES) {
        const vf32 x1 = loadv(k + c), x2 = loadv(k + c + half), cs = loadv(cos_row + c), sn = loadv(sin_row + c);
        storev(k + c, x1 * cs - x2 * sn);
        storev(k + c + half, x2 * cs + x1 * sn);
    }
    for (; c < half; ++c) {
        const float x1 = k[c], x2 = k[c + half];
        k[c] = x1 * cos_row[c] - x2 * sin_row[c];
        k[c + half] = x2 * cos_row[c] + x1 * sin_row[c];
    }
}

// One (sequence, KV head)'s tokens t_begin .. t_end - 1 for its `group` query heads, from a fresh softmax state:
// partial = per query head (m, l, acc[Dv]), m the largest scaled score, l the sum of exp(score - m), acc the sum of
// exp(score - m) v; scores soft-capped at softcap first where it is above 0. Keys are D channels wide, values Dv;
// values_scored (MLA's latent, kvcal.adapters.LatentAttention): a query row is D + Dv wide and its last Dv channels
// score the values beside its first D the keys (one attention over keys and values side by side, neither copied).
// row_first (null: none): per query row of the call (batch x heads), its first token seen; the earlier weigh nothing.
void attend_tokens(const Side& ks, const Side& vs, DecodeTokens decode_keys, DecodeTokens decode_values, const Lengths& kn,
                   const Lengths& vn, const float* query, const float* cos_table, const float* sin_table, long long rope_stride,
                   int b, int kv_head, int kv_heads, int group, int D, int Dv, bool values_scored, float scale, float softcap,
                   const int32_t* row_first, int t_begin, int t_end, float* partial) {
    thread_local HeadTables k_tables, v_tables;
    thread_local std::vector<float> q, keys, values, scores, value_scores;
    const int width = kv_heads * D, value_width = kv_heads * Dv, half = D / 2, heads = kv_heads * group;
    const int Dq = values_scored ? D + Dv : D;  // a query row
    q.resize((size_t)group * Dq);
    keys.resize((size_t)CHUNK * D);
    values.resize((size_t)CHUNK * Dv);
    scores.resize((size_t)group * CHUNK);
    value_scores.resize(CHUNK);
    prepare_tables(ks, k_tables, kv_head, D);
    prepare_tables(vs, v_tables, kv_head, Dv);
    const long long first_row = (long long)b * heads + (long long)kv_head * group;
    for (int i = 0; i < group * Dq; ++i) q[i] = query[first_row * Dq + i] * scale;
    for (int g = 0; g < group; ++g) {
        float* state = partial + (size_t)g * (Dv + 2);
        state[0] = -INFINITY;
        std::fill(state + 1, state + Dv + 2, 0.0f);
    }
    if (cos_table != nullptr) prefetch_rope_rows(cos_table, sin_table, b * rope_stride, t_begin, std::min(CHUNK, t_end - t_begin), half);
    for (int t0 = t_begin; t0 < t_end; t0 += CHUNK) {
        const int n = std::min(CHUNK, t_end - t0);
        if (cos_table != nullptr && t0 + CHUNK < t_end)
            prefetch_rope_rows(cos_table, sin_table, b * rope_stride, t0 + CHUNK, std::min(CHUNK, t_end - t0 - CHUNK), half);
        if (D > 0) decode_keys(ks, k_tables, kn, b, kv_head, kv_heads, D, width, t0, n, keys.data());
        if (cos_table != nullptr)
            for (int i = 0; i < n; ++i) {
                const long long row = b * rope_stride + (long long)(t0 + i) * half;
                rotate_row(keys.data() + (size_t)i * D, cos_table + row, sin_table + row, half);
            }
        if (values_scored) decode_values(vs, v_tables, vn, b, kv_head, kv_heads, Dv, value_width, t0, n, values.data());
        int together = 0;  // the query heads scored SCORED_HEADS at a time (head_scores), the rest one by one
#if !defined(__clang__)
        if (D > 0 && D % LANES == 0 && (!values_scored || Dv % LANES == 0)) together = group / SCORED_HEADS * SCORED_HEADS;
        for (int g = 0; g < together; g += SCORED_HEADS) {
            float* s = scores.data() + (size_t)g * CHUNK;
            head_scores<false>(q.data() + (size_t)g * Dq, Dq, keys.data(), n, D, s);
            if (values_scored) head_scores<true>(q.data() + (size_t)g * Dq + D, Dq, values.data(), n, Dv, s);
        }
#endif
        for (int g = 0; g < group; ++g) {
            float* __restrict__ s = scores.data() + (size_t)g * CHUNK;
            float* state = partial + (size_t)g * (Dv + 2);
            const float* qg = q.data() + (size_t)g * Dq;
            if (g >= together) {
                if (D > 0)
                    key_scores(qg, keys.data(), n, D, s);
                else  // a key of no channel (MLA's on a layer without RoPE): the values' scores alone
                    std::fill(s, s + n, 0.0f);
                if (values_scored) {
                    float* __restrict__ extra = value_scores.data();
                    key_scores(qg + D, values.data(), n, Dv, extra);
#pragma omp simd
                    for (int i = 0; i < n; ++i) s[i] += extra[i];
                }
            }
            if (softcap > 0.0f) cap_scores(s, n, softcap);
            if (row_first != nullptr)
                for (int i = 0; i < std::min(row_first[first_row + g] - t0, n); ++i) s[i] = -INFINITY;
            const float chunk_max = largest(s, n);
            const float m_new = max_or(chunk_max, state[0]);
            if (m_new == -INFINITY) {  // nothing seen yet: the chunk adds no weight (and no NaN from -inf - -inf)
                std::fill(s, s + n, 0.0f);
                continue;
            }
            const float correction = state[0] == -INFINITY ? 0.0f : exp_nonpositive(state[0] - m_new);
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int i = 0; i < n; ++i) {
                s[i] = exp_nonpositive(s[i] - m_new);
                sum += s[i];
            }
            state[1] = state[1] * correction + sum;
            state[0] = m_new;
            for (int c = 0; c < Dv; ++c) state[2 + c] *= correction;
        }
        if (!values_scored) decode_values(vs, v_tables, vn, b, kv_head, kv_heads, Dv, value_width, t0, n, values.data());
        accumulate_values(scores.data(), values.data(), n, Dv, group, partial + 2, Dv + 2);
    }
}

struct Task {
    int b, kv_head, t_begin, t_end;
};

}  // namespace

// One launch's tokens for every (sequence, KV head), folded into the running softmax state of each query head:
// m (batch, heads) running max of the scaled scores (soft-capped at softcap where it is above 0: Gemma 2), l
// (batch, heads) sum of exp(score - m), acc (batch, heads, D)
// sum of exp(score - m) v. The first launch of a step (first = 1) starts them from m = -inf, l = 0, acc = 0; the
// last (last = 1) turns acc into the output acc / l (0 for a query head that saw no token).
// Keys are head_dim channels a KV head, values value_dim (acc: (batch, heads, value_dim)); values_scored (MLA's
// latent): query rows are head_dim + value_dim wide, the last value_dim scoring the values (attend_tokens); head_dim 0
// there (a latent layer without RoPE) scores by the values alone.
// query (batch, heads, D or D + value_dim) unscaled; descriptor: K side then V side, SIDE_FIELDS each; meta (2, batch,
// META_FIELDS); cos/sin (batch, >= tokens, D / 2) at each sequence's stored tokens' positions (the first half of each
// row of kvcal.runtime.reference.rope_tables), null for keys stored post-RoPE; row_first (batch, heads): each query
// row's first token seen, past its sequence's (meta's first, which stays the least of its rows': a step of several
// queries under a sliding window, kvcal.runtime.backends), null where every row sees its sequence's.
// Work: every (sequence, KV head)'s tokens in splits of SPLIT tokens, or fewer (halved down to CHUNK) while that
// makes fewer than MIN_TASKS tasks (so that a short context keeps every thread busy); one task
// each, run on `threads` threads (OpenMP, the runtime torch uses where both are libgomp); each task's partial state is
// folded in afterwards in task order. The split depends on the lengths alone, so the result does not depend on the
// number of threads.
extern "C" void kvcal_decode_attention_cpu(const float* query, const long long* descriptor, const int32_t* meta,
                                           const float* cos_table, const float* sin_table, long long rope_stride,
                                           int batch, int kv_heads, int group, int head_dim, int value_dim, int values_scored,
                                           float scale, float softcap, float* m_state, float* l_state, float* acc_state,
                                           const int32_t* row_first, int first, int last, int threads) {
    const int D = head_dim, Dv = value_dim, heads = kv_heads * group;
    if (first) {
        std::fill(m_state, m_state + (size_t)batch * heads, -INFINITY);
        std::fill(l_state, l_state + (size_t)batch * heads, 0.0f);
        std::fill(acc_state, acc_state + (size_t)batch * heads * Dv, 0.0f);
    }
    const Side ks = load_side(descriptor), vs = load_side(descriptor + SIDE_FIELDS);
    const DecodeTokens decode_keys = decoder(ks), decode_values = decoder(vs);
    std::vector<Task> tasks;
    std::vector<Lengths> key_lengths(batch), value_lengths(batch);
    std::vector<int> seen_from(batch), tokens(batch);
    for (int b = 0; b < batch; ++b) {
        const int32_t* km = meta + (long long)b * META_FIELDS;
        const int32_t* vm = meta + ((long long)batch + b) * META_FIELDS;
        key_lengths[b] = Lengths{km[M_SINK], km[M_BODY], km[M_HEAD], km[M_RECENT], km[M_BODY_HEAD]};
        value_lengths[b] = Lengths{vm[M_SINK], vm[M_BODY], vm[M_HEAD], vm[M_RECENT], vm[M_BODY_HEAD]};
        tokens[b] = key_lengths[b].sink + key_lengths[b].body + key_lengths[b].recent;
        seen_from[b] = km[M_FIRST];
    }
    const auto task_count = [&](int split) {
        long long count = 0;
        for (int b = 0; b < batch; ++b) count += (std::max(tokens[b] - seen_from[b], 0) + split - 1) / split;
        return count * kv_heads;
    };
    int split = SPLIT;
    while (split > CHUNK && task_count(split) < MIN_TASKS) split /= 2;
    for (int b = 0; b < batch; ++b)
        for (int t0 = seen_from[b]; t0 < tokens[b]; t0 += split)  // a split's KV heads in turn: its RoPE table rows stay in cache
            for (int kv_head = 0; kv_head < kv_heads; ++kv_head) tasks.push_back(Task{b, kv_head, t0, std::min(tokens[b], t0 + split)});
    const size_t per_task = (size_t)group * (Dv + 2);
    std::vector<float> partials(tasks.size() * per_task);
#pragma omp parallel for schedule(dynamic, 1) num_threads(std::max(threads, 1)) if (threads > 1 && tasks.size() > 1)
    for (long long i = 0; i < (long long)tasks.size(); ++i) {
        const Task& task = tasks[i];
        attend_tokens(ks, vs, decode_keys, decode_values, key_lengths[task.b], value_lengths[task.b], query, cos_table, sin_table,
                      rope_stride, task.b, task.kv_head, kv_heads, group, D, Dv, values_scored != 0, scale, softcap,
                      row_first, task.t_begin, task.t_end, partials.data() + i * per_task);
    }
    for (size_t i = 0; i < tasks.size(); ++i) {
        const long long first_row = (long long)tasks[i].b * heads + (long long)tasks[i].kv_head * group;
        for (int g = 0; g < group; ++g) {
            const float* part = partials.data() + i * per_task + (size_t)g * (Dv + 2);
            float& m = m_state[first_row + g];
            float& l = l_state[first_row + g];
            float* acc = acc_state + (first_row + g) * Dv;
            const float m_new = max_or(part[0], m);
            const float old_weight = m == -INFINITY ? 0.0f : exp_nonpositive(m - m_new);
            const float new_weight = part[0] == -INFINITY ? 0.0f : exp_nonpositive(part[0] - m_new);
            l = l * old_weight + part[1] * new_weight;
            for (int c = 0; c < Dv; ++c) acc[c] = acc[c] * old_weight + part[2 + c] * new_weight;
            m = m_new;
        }
    }
    if (last)
        for (size_t row = 0; row < (size_t)batch * heads; ++row)
            for (int c = 0; c < Dv; ++c) acc_state[row * Dv + c] = l_state[row] > 0.0f ? acc_state[row * Dv + c] / l_state[row] : 0.0f;
}

// What this build is, for kvcal.runtime.cpu_kernel.describe: vector lanes, and the OpenMP version (0: no threads).
extern "C" int kvcal_cpu_lanes() { return LANES; }
extern "C" int kvcal_cpu_openmp() {
#if defined(_OPENMP)
    return _OPENMP;
#else
    return 0;
#endif
}
