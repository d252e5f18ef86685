// Quantize-and-append on the CPU for every body codec of the recipes: the codebook codec (kvcal.quantizers.CodebookCodec:
// KVQuant's nuq, the mixed recipe; append.cu's append_codebook and append_codebook_outliers), per-token uniform values
// (TokenUniform: KIVI, KVmix), per-channel key blocks (ChannelBlockUniform: KIVI's and KVmix's keys) and SKVQ's
// permuted groups, writing the same codes, fp16 parameters and outliers, bit for bit, as the torch encoders that
// kvcal/runtime/store.py uses otherwise (tests/test_runtime_cpu_kernel.py checks it), straight into the store's buffers.
// Launched by kvcal/runtime/cpu_kernel.py; compiled without -ffast-math and with -ffp-contract=off, so that every
// float operation rounds where torch's does.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <tuple>
#include <utility>
#include <vector>

namespace {

constexpr float MIN_HALF_RANGE = 1e-8f;  // kvcal.quantizers.normalize's clamp
constexpr float TINY_SCALE = 5.9604644775390625e-8f;  // kvcal.quantizers.TINY_SCALE (2^-24)
constexpr float FP16_MAX = 65504.0f;
constexpr float FP8_MAX = 448.0f;  // the largest finite fp8 e4m3 (torch.float8_e4m3fn)
enum Layout { LSB1 = 1, LSB2 = 2, PLANES3 = 3, LSB4 = 4, KVMIX3 = 5 };

// IEEE binary16 as the compiler knows it: ARM's __fp16 on aarch64 (GCC's C++ has no _Float16 there before GCC 13),
// _Float16 elsewhere; both convert from float by rounding to nearest even.
#if defined(__aarch64__)
typedef __fp16 half;
#else
typedef _Float16 half;
#endif

inline float half_to_float(uint16_t h) {
    half f;
    std::memcpy(&f, &h, 2);
    return (float)f;
}

// kvcal.quantizers.store_as(x, float16): saturate at the largest finite fp16, round to nearest even; a NaN stays
// NaN, as torch's clamp keeps it.
inline uint16_t float_to_half(float x) {
    const half f = (half)(x < -FP16_MAX ? -FP16_MAX : (x > FP16_MAX ? FP16_MAX : x));
    uint16_t h;
    std::memcpy(&h, &f, 2);
    return h;
}

// fp8 e4m3 (torch.float8_e4m3fn) -> float, exact: bias 7, subnormals m * 2^-9.
inline float e4m3_to_float(uint8_t v) {
    const int exponent = (v >> 3) & 15, mantissa = v & 7;
    const float magnitude = exponent ? std::ldexp(1.0f + (float)mantissa / 8.0f, exponent - 7) : (float)mantissa * 0.001953125f;
    return v & 0x80 ? -magnitude : magnitude;
}

// kvcal.quantizers.store_as(x, float8_e4m3fn): saturate at the largest finite e4m3, round to nearest even. Subnormals
// are m 2^-9, and m = 8 is the bit pattern of the least normal, 2^-6, so a subnormal rounding up carries on.
inline uint8_t float_to_e4m3(float x) {
    const float a = std::fmin(std::fabs(x), FP8_MAX);
    const uint8_t sign = std::signbit(x) ? 0x80 : 0;
    if (a < 0.015625f) return sign | (uint8_t)std::nearbyint(a * 512.0f);
    int exponent;
    std::frexp(a, &exponent);  // a = f 2^exponent, f in [0.5, 1)
    --exponent;                // floor(log2 a), -6 .. 8
    // a / 2^(exponent - 3), exact, in [8, 16): the implicit bit and 3 mantissa bits; 16 carries into the exponent
    const unsigned steps = (unsigned)std::nearbyint(std::ldexp(a, 3 - exponent));
    return sign | (uint8_t)(((unsigned)(exponent + 7) << 3) + steps - 8u);
}

// torch.quantile (linear interpolation) at q of n values, from the two order statistics it reads: sorted[below] and
// sorted[below + 1] (the latter where the rank is not whole), below = floor(q (n - 1)); between them ATen's lerp, one
// fused multiply-add (vec::fmadd: a product rounded apart moves some rows' fp16 thresholds by one step).
struct QuantileRank {
    float rank;
    int below, above;
    float weight;
    QuantileRank(float q, int n)
        : rank(q * (float)(n - 1)), below((int)rank), above((int)std::ceil(rank)), weight(rank - (float)below) {}
    float between(float a, float b) const {
        return weight < 0.5f ? std::fma(weight, b - a, a) : std::fma(weight - 1.0f, b - a, b);
    }
};

// The order statistics the row's q_low and q_high quantiles read: the few least and greatest values kept sorted as
// the row streams by (at q = 0.005 and 0.995: the 2 least and 2 greatest of 192 values, the 42 of 8192), or, where
// more than MAX_KEPT would be kept, std::nth_element on a copy. Either way the values a full sort puts at those ranks
// (which of two equal zeros, +0 or -0, lands there may differ from torch's sort). The caller keeps NaN rows out.
class RowQuantiles {
  public:
    static constexpr int MAX_KEPT = 48;

    RowQuantiles(int n, float q_low, float q_high) : n_(n), low_(q_low, n), high_(q_high, n) {
        least_ = low_.above + 1;      // sorted[0, least_)
        greatest_ = n - high_.below;  // sorted[n - greatest_, n)
        selecting_ = least_ > MAX_KEPT || greatest_ > MAX_KEPT;
    }

    // the row's (lo, hi)
    std::pair<float, float> of(const float* values, std::vector<float>& scratch) const {
        if (selecting_) {
            scratch.assign(values, values + n_);
            return {selected(scratch.data(), low_), selected(scratch.data(), high_)};
        }
        float least[MAX_KEPT], greatest[MAX_KEPT];  // ascending; descending
        int held_least = 0, held_greatest = 0;
        for (int c = 0; c < n_; ++c) {
            const float v = values[c];
            if (held_least < least_ || v < least[least_ - 1]) insert(least, held_least, least_, v, std::less<float>());
            if (held_greatest < greatest_ || v > greatest[greatest_ - 1])
                insert(greatest, held_greatest, greatest_, v, std::greater<float>());
        }
        auto sorted = [&](int i) { return i < least_ ? least[i] : greatest[n_ - 1 - i]; };
        return {low_.between(sorted(low_.below), sorted(low_.above)), high_.between(sorted(high_.below), sorted(high_.above))};
    }

  private:
    // v into kept[0, held) ordered by `before`, keeping at most `most`
    template <class Before>
    static void insert(float* kept, int& held, int most, float v, Before before) {
        int i = held < most ? held++ : most - 1;
        for (; i > 0 && before(v, kept[i - 1]); --i) kept[i] = kept[i - 1];
        kept[i] = v;
    }

    // the rank's two order statistics by selection (std::nth_element, then the least of the rest); reorders values
    float selected(float* values, const QuantileRank& at) const {
        std::nth_element(values, values + at.below, values + n_);
        const float a = values[at.below], b = at.above == at.below ? a : *std::min_element(values + at.below + 1, values + n_);
        return at.between(a, b);
    }

    int n_;
    QuantileRank low_, high_;
    int least_, greatest_;
    bool selecting_;
};

int code_bits(int layout) { return layout == KVMIX3 ? 3 : layout; }

// One row's codes packed in kvcal/packing.py's layout (append.cu's pack_unit, for every unit of the row).
void pack_row(const uint32_t* codes, int width, int layout, uint32_t* out, int words_per_row) {
    std::memset(out, 0, (size_t)words_per_row * 4);
    if (layout == PLANES3) {
        // a unit of 32 codes: their low 2 bits in two words (16 codes each), then their high bits in one; OR-reductions
        // over a unit's codes, which the compiler vectorizes
        for (int first = 0; first < width; first += 32) {
            const uint32_t* unit_codes = codes + first;
            const int n = std::min(32, width - first);
            uint32_t low0 = 0, low1 = 0, high = 0;
            for (int i = 0; i < std::min(n, 16); ++i) low0 |= (unit_codes[i] & 3u) << (i * 2);
            for (int i = 16; i < n; ++i) low1 |= (unit_codes[i] & 3u) << ((i - 16) * 2);
            for (int i = 0; i < n; ++i) high |= (unit_codes[i] >> 2) << i;
            uint32_t* unit = out + (first / 32) * 3;
            unit[0] = low0;
            unit[1] = low1;
            unit[2] = high;
        }
        return;
    }
    // word by word: no division by the runtime per_word per code
    const int bits = code_bits(layout), per_word = layout == KVMIX3 ? 11 : 32 / bits;
    const uint32_t most = (1u << bits) - 1u;
    for (int first = 0; first < width; first += per_word) {
        const int n = std::min(per_word, width - first);
        uint32_t word = 0;
        for (int slot = 0; slot < n; ++slot) {
            const uint32_t limit = (layout == KVMIX3 && slot == 10) ? 3u : most;
            word |= std::min(codes[first + slot], limit) << (slot * bits);
        }
        out[first / per_word] = word;
    }
}

// Where a store's rows go (kvcal.runtime.store.PackedRows.words; kvcal/runtime/cpu_kernel.py's CpuAppend passes
// it): {words, sequence stride, row stride, piece stride (in words), words a piece, pieces a row}. A row's pieces lie
// piece_stride apart: next to each other where the store keeps rows whole, a capacity apart where it keeps each
// piece's (KV head's) rows together.
struct RowWords {
    uint32_t* words;
    long long seq_stride, row_stride, piece_stride;
    int piece_words, pieces;
    explicit RowWords(const long long* d)
        : words((uint32_t*)d[0]), seq_stride(d[1]), row_stride(d[2]), piece_stride(d[3]), piece_words((int)d[4]), pieces((int)d[5]) {}
    // a row's codes packed (pack_row, into `packed`), then each piece to its place
    void put(long long seq, long long row, const uint32_t* codes, int width, int layout, std::vector<uint32_t>& packed) const {
        packed.resize((size_t)piece_words * pieces);
        pack_row(codes, width, layout, packed.data(), piece_words * pieces);
        uint32_t* const at = words + seq * seq_stride + row * row_stride;
        for (int p = 0; p < pieces; ++p) std::memcpy(at + p * piece_stride, packed.data() + (size_t)p * piece_words, (size_t)piece_words * 4);
    }
};

// The lesser / greater of x and y: y where it is less / greater or x is NaN, else x (so a tie of signed zeros keeps x,
// a group's first). These are the bits std::fmin / std::fmax gave in SKVQ's loops (checked on its appends), inlined:
// the library calls cost more than the loops they sit in.
inline float least_of(float x, float y) { return (y < x || x != x) ? y : x; }
inline float greatest_of(float x, float y) { return (y > x || x != x) ? y : x; }

// kvcal.quantizers.normalize, x^ = (x - (hi + lo) / 2) / max((hi - lo) / 2, 1e-8), with each channel's thresholds
// (channel_lo/hi, made once a call) or the row's (set_row).
class Normalization {
  public:
    Normalization(const float* channel_lo, const float* channel_hi, int width) {
        if (channel_lo == nullptr) return;
        centre_.resize(width);
        half_range_.resize(width);
        for (int c = 0; c < width; ++c) set(channel_lo[c], channel_hi[c], centre_[c], half_range_[c]);
    }
    bool per_channel() const { return !centre_.empty(); }
    void set_row(float lo, float hi) { set(lo, hi, row_centre_, row_half_range_); }
    // x (width) normalized into out: a loop the compiler vectorizes (a division rounds alike in any lane)
    void apply(const float* x, int width, float* out) const {
        if (per_channel()) {
            for (int c = 0; c < width; ++c) out[c] = (x[c] - centre_[c]) / half_range_[c];
        } else {
            for (int c = 0; c < width; ++c) out[c] = (x[c] - row_centre_) / row_half_range_;
        }
    }

  private:
    static void set(float lo, float hi, float& centre, float& half_range) {
        centre = (hi + lo) / 2.0f;
        half_range = std::fmax((hi - lo) / 2.0f, MIN_HALF_RANGE);
    }
    std::vector<float> centre_, half_range_;
    float row_centre_ = 0.0f, row_half_range_ = 1.0f;
};

bool has_nan(const float* x, int width) {
    bool nan = false;
    for (int c = 0; c < width; ++c) nan |= std::isnan(x[c]);
    return nan;
}

void to_float(const uint16_t* x, int width, float* out) {
    for (int c = 0; c < width; ++c) out[c] = half_to_float(x[c]);
}

}  // namespace

// Phase 2, with room for them: every row's outliers, in row order and channel order, go after their (sequence, KV
// head) run's own (counts (batch, heads), incremented), each its uint16 position in its tile of tile_tokens body rows
// and its exact fp16 value; a row that starts a tile first records, for every head, the run's count as that tile's
// offset (offsets (batch, heads, offset_stride)).
extern "C" void kvcal_place_outliers_cpu(const uint16_t* x, int rows, int width, int head_dim, int tile_tokens,
                                         const float* channel_lo, const float* channel_hi, const uint16_t* token_lo,
                                         const uint16_t* token_hi, long long token_stride, const int32_t* seq_of_row,
                                         const int32_t* row_in_seq, uint16_t* positions, uint16_t* values,
                                         long long outlier_stride, int32_t* offsets, long long offset_stride, int32_t* counts) {
    const int heads = width / head_dim;
    Normalization normalization(channel_lo, channel_hi, width);
    std::vector<float> row_values(width), normalized(width);
    for (int r = 0; r < rows; ++r) {
        const long long seq = seq_of_row[r], first_run = seq * heads;
        const int row = row_in_seq[r], tile = row / tile_tokens;
        if (!normalization.per_channel()) {
            const long long at = seq * token_stride + row;
            normalization.set_row(half_to_float(token_lo[at]), half_to_float(token_hi[at]));
        }
        if (row % tile_tokens == 0)
            for (int h = 0; h < heads; ++h) offsets[(first_run + h) * offset_stride + tile] = counts[first_run + h];
        const uint16_t* xr = x + (long long)r * width;
        to_float(xr, width, row_values.data());
        normalization.apply(row_values.data(), width, normalized.data());
        for (int c = 0; c < width; ++c) {
            if (!(std::fabs(normalized[c]) > 1.0f)) continue;
            const int h = c / head_dim;
            const long long at = (first_run + h) * outlier_stride + counts[first_run + h]++;
            positions[at] = (uint16_t)((row % tile_tokens) * head_dim + c - h * head_dim);
            values[at] = xr[c];
        }
    }
}

// Phase 1, every row r of x (rows, width) fp16, for sequence seq_of_row[r] at body row row_in_seq[r]: thresholds
// per channel (channel_lo/hi) or per token (the q_low/q_high quantiles of the row, min/max without outliers, stored
// fp16 at token_lo/hi[seq * token_stride + row]); codes = the codebook midpoints below clamp(normalized, -1, 1),
// packed into the row's place in `target` (RowWords); found (rows, width / head_dim) = the elements with
// |normalized| > 1 per (row, KV head) when keep_outliers. Then phase 2 where every run's count plus what it found fits
// the outlier arrays (outlier_stride entries per run): 1; else 0, and the caller makes room and calls phase 2 (a
// decode step's few outliers almost always fit: one call instead of two).
extern "C" int kvcal_append_codebook_cpu(const uint16_t* x, int rows, int width, int head_dim, int layout,
                                         const float* channel_lo, const float* channel_hi, float q_low, float q_high,
                                         int keep_outliers, const float* midpoints, const int32_t* seq_of_row,
                                         const int32_t* row_in_seq, const long long* target, uint16_t* token_lo, uint16_t* token_hi, long long token_stride,
                                         int32_t* found, int tile_tokens, uint16_t* positions, uint16_t* values,
                                         long long outlier_stride, int32_t* offsets, long long offset_stride, int32_t* counts) {
    const int entries = 1 << code_bits(layout), heads = width / head_dim;
    Normalization normalization(channel_lo, channel_hi, width);
    const RowQuantiles quantiles(width, q_low, q_high);
    std::vector<float> row_values(width), normalized(width), scratch;
    std::vector<uint32_t> codes(width), packed;
    const RowWords rows_to(target);
    for (int r = 0; r < rows; ++r) {
        to_float(x + (long long)r * width, width, row_values.data());
        if (!normalization.per_channel()) {
            float lo = NAN, hi = NAN;  // a row with a NaN keeps NaN thresholds, as torch's quantile, amin and amax give
            if (!has_nan(row_values.data(), width)) {
                if (keep_outliers) {
                    std::tie(lo, hi) = quantiles.of(row_values.data(), scratch);
                } else {
                    const auto [least, most] = std::minmax_element(row_values.begin(), row_values.end());
                    lo = *least;
                    hi = *most;
                }
            }
            const long long at = seq_of_row[r] * token_stride + row_in_seq[r];
            token_lo[at] = float_to_half(lo);
            token_hi[at] = float_to_half(hi);
            normalization.set_row(half_to_float(token_lo[at]), half_to_float(token_hi[at]));
        }
        normalization.apply(row_values.data(), width, normalized.data());
        if (keep_outliers) {
            int32_t* row_found = found + (long long)r * heads;
            for (int h = 0; h < heads; ++h) {
                int32_t n = 0;
                for (int c = h * head_dim; c < (h + 1) * head_dim; ++c) n += std::fabs(normalized[c]) > 1.0f;
                row_found[h] = n;
            }
        }
        // clamp(x^, -1, 1) as min and max instructions take it (a NaN stays NaN), then the midpoints not above it
        // (torch.bucketize's count: a NaN counts them all), one midpoint a pass over the row (both loops vectorize)
        for (int c = 0; c < width; ++c) {
            const float v = normalized[c];
            normalized[c] = v < -1.0f ? -1.0f : (v > 1.0f ? 1.0f : v);
            codes[c] = 0;
        }
        for (int i = 0; i < entries - 1; ++i) {
            const float midpoint = midpoints[i];
            for (int c = 0; c < width; ++c) codes[c] += !(normalized[c] <= midpoint);
        }
        rows_to.put(seq_of_row[r], row_in_seq[r], codes.data(), width, layout, packed);
    }
    if (!keep_outliers) return 1;
    int last_seq = 0;
    for (int r = 0; r < rows; ++r) last_seq = std::max(last_seq, seq_of_row[r]);
    std::vector<long long> after((size_t)(last_seq + 1) * heads, -1);  // per run a row of the call touches: its count after
    for (int r = 0; r < rows; ++r)
        for (int h = 0; h < heads; ++h) {
            const long long run = (long long)seq_of_row[r] * heads + h;
            after[run] = (after[run] < 0 ? counts[run] : after[run]) + found[(long long)r * heads + h];
            if (after[run] > outlier_stride) return 0;
        }
    kvcal_place_outliers_cpu(x, rows, width, head_dim, tile_tokens, channel_lo, channel_hi, token_lo, token_hi, token_stride,
                             seq_of_row, row_in_seq, positions, values, outlier_stride, offsets, offset_stride, counts);
    return 1;
}

// kvcal.quantizers._min_max_params over [lo, hi]: fp16 scale = (hi - lo) / levels and zero = lo, stored at *scale, *zero.
inline void min_max_params(float lo, float hi, int levels, uint16_t* scale, uint16_t* zero) {
    *scale = float_to_half((hi - lo) / (float)levels);
    *zero = float_to_half(lo);
}

// The stored fp16 scale as the codes divide by it: kvcal.quantizers.scale_in_use, max(scale, 2^-24).
inline float scale_in_use(uint16_t scale) { return std::fmax(half_to_float(scale), TINY_SCALE); }

// kvcal.quantizers._min_max_codes: round((x - zero) / scale) clamped to [0, levels], from the stored zero as a float
// and scale_in_use.
inline uint32_t uniform_code(float x, float zero, float scale, int levels) {
    float q = std::nearbyint((x - zero) / scale);
    q = q < 0.0f ? 0.0f : q;  // as max and min instructions take them: the loops over channels vectorize
    q = q > (float)levels ? (float)levels : q;
    return (uint32_t)q;
}

// TokenUniform (kvcal.quantizers): per (row, group of `group` channels) min-max parameters at scale/zero[seq *
// param_stride + row * param_row + g * param_column] (kvcal.runtime.store: each group runs along the tokens).
extern "C" void kvcal_append_token_uniform_cpu(const uint16_t* x, int rows, int width, int layout, int group,
                                               const int32_t* seq_of_row, const int32_t* row_in_seq, const long long* target,
                                               uint16_t* scale, uint16_t* zero, long long param_stride, long long param_row,
                                               long long param_column) {
    const int levels = (1 << code_bits(layout)) - 1, groups = (width + group - 1) / group;
    std::vector<uint32_t> codes(width), packed;
    const RowWords rows_to(target);
    for (int r = 0; r < rows; ++r) {
        const uint16_t* xr = x + (long long)r * width;
        for (int g = 0; g < groups; ++g) {
            const long long at = seq_of_row[r] * param_stride + row_in_seq[r] * param_row + g * param_column;
            const int first = g * group, end = std::min(width, first + group);
            float lo = INFINITY, hi = -INFINITY;
            for (int c = first; c < end; ++c) {
                // as min and max instructions take them (rows hold no NaN): vectorized; an fmin reduction here made
                // GCC 12's aarch64 vectorizer crash at -O3
                const float v = half_to_float(xr[c]);
                lo = v < lo ? v : lo;
                hi = v > hi ? v : hi;
            }
            min_max_params(lo, hi, levels, scale + at, zero + at);
            const float z = half_to_float(zero[at]), s = scale_in_use(scale[at]);
            for (int c = first; c < end; ++c) codes[c] = uniform_code(half_to_float(xr[c]), z, s, levels);
        }
        rows_to.put(seq_of_row[r], row_in_seq[r], codes.data(), width, layout, packed);
    }
}

// ChannelBlockUniform (kvcal.quantizers: KIVI's and KVmix's keys): per (block of `block` rows, channel) min-max
// parameters at scale/zero[seq * param_stride + (row / block) * param_row + c]. Rows come in whole blocks of one
// sequence each (kvcal.runtime.store appends whole blocks): a block's first row names its sequence and body row.
extern "C" void kvcal_append_channel_block_cpu(const uint16_t* x, int rows, int width, int layout, int block,
                                               const int32_t* seq_of_row, const int32_t* row_in_seq, const long long* target,
                                               uint16_t* scale, uint16_t* zero, long long param_stride, long long param_row) {
    const int levels = (1 << code_bits(layout)) - 1;
    std::vector<float> lo(width), hi(width), zeros(width), scales(width);  // scales: scale_in_use
    std::vector<uint32_t> codes(width), packed;
    const RowWords rows_to(target);
    for (int first = 0; first < rows; first += block) {
        std::fill(lo.begin(), lo.end(), INFINITY);
        std::fill(hi.begin(), hi.end(), -INFINITY);
        for (int r = first; r < first + block; ++r)
            for (int c = 0; c < width; ++c) {  // as min and max instructions take them (rows hold no NaN): vectorized
                const float v = half_to_float(x[(long long)r * width + c]);
                lo[c] = v < lo[c] ? v : lo[c];
                hi[c] = v > hi[c] ? v : hi[c];
            }
        const long long seq = seq_of_row[first], at = seq * param_stride + (long long)(row_in_seq[first] / block) * param_row;
        for (int c = 0; c < width; ++c) {  // the stored parameters as the codes read them, once per block
            min_max_params(lo[c], hi[c], levels, scale + at + c, zero + at + c);
            zeros[c] = half_to_float(zero[at + c]);
            scales[c] = scale_in_use(scale[at + c]);
        }
        for (int r = first; r < first + block; ++r) {
            const uint16_t* xr = x + (long long)r * width;
            for (int c = 0; c < width; ++c) codes[c] = uniform_code(half_to_float(xr[c]), zeros[c], scales[c], levels);
            rows_to.put(seq, row_in_seq[r], codes.data(), width, layout, packed);
        }
    }
}

// SKVQ (kvcal.fit.skvq.SkvqTensor): channels in permuted order, per (row, group of permuted slots starts[g] ..
// starts[g + 1]) clipped min-max: low/high = clip[g] x min/max, scale = stored(max((high - low) / levels, |low| /
// (largest / 2), 2^-24)), zero = stored(low / max(scale, 2^-24)) at scale/zero[seq * param_stride + row * param_row + g *
// param_column], codes round(x / max(scale, 2^-24) - zero) clamped to [0, levels], packed in channel order (the store's,
// see kvcal.runtime.store.permuted_groups). stored: fp16 (Param uint16_t) or fp8 e4m3 (uint8_t), largest its largest
// finite value.
template <typename Param>
void append_permuted_groups(const uint16_t* x, int rows, int width, int layout, const int32_t* permutation,
                            const int32_t* starts, int groups, const float* clip, const int32_t* seq_of_row,
                            const int32_t* row_in_seq, const long long* target, Param* scale,
                            Param* zero, long long param_stride, long long param_row, long long param_column) {
    constexpr bool FP8 = sizeof(Param) == 1;
    constexpr float LARGEST = FP8 ? FP8_MAX : FP16_MAX;
    const auto stored = [](float v) -> Param {
        if constexpr (FP8) return float_to_e4m3(v);
        else return float_to_half(v);
    };
    const auto value = [](Param v) {
        if constexpr (FP8) return e4m3_to_float(v);
        else return half_to_float(v);
    };
    const int levels = (1 << code_bits(layout)) - 1;
    std::vector<float> permuted(width);
    std::vector<uint32_t> codes(width), packed;
    const RowWords rows_to(target);
    for (int r = 0; r < rows; ++r) {
        const uint16_t* xr = x + (long long)r * width;
        for (int i = 0; i < width; ++i) permuted[i] = half_to_float(xr[permutation[i]]);
        for (int g = 0; g < groups; ++g) {
            const long long at = seq_of_row[r] * param_stride + row_in_seq[r] * param_row + g * param_column;
            float lo = INFINITY, hi = -INFINITY;
            for (int i = starts[g]; i < starts[g + 1]; ++i) {
                lo = least_of(lo, permuted[i]);
                hi = greatest_of(hi, permuted[i]);
            }
            const float low = clip[g] * lo, high = clip[g] * hi;
            scale[at] = stored(std::fmax(std::fmax((high - low) / (float)levels, std::fabs(low) / (LARGEST / 2.0f)), TINY_SCALE));
            const float s = std::fmax(value(scale[at]), TINY_SCALE);
            zero[at] = stored(low / s);
            const float z = value(zero[at]);
            for (int i = starts[g]; i < starts[g + 1]; ++i) {
                const float q = std::nearbyint(permuted[i] / s - z);
                codes[permutation[i]] = (uint32_t)least_of(greatest_of(q, 0.0f), (float)levels);  // stored in channel order
            }
        }
        rows_to.put(seq_of_row[r], row_in_seq[r], codes.data(), width, layout, packed);
    }
}

// SKVQ's append: fp8 != 0 stores the parameters as fp8 e4m3 bytes (SKVQ --fp8), else as fp16.
extern "C" void kvcal_append_permuted_groups_cpu(const uint16_t* x, int rows, int width, int layout, const int32_t* permutation,
                                                 const int32_t* starts, int groups, const float* clip,
                                                 const int32_t* seq_of_row, const int32_t* row_in_seq, const long long* target,
                                                 void* scale, void* zero,
                                                 long long param_stride, long long param_row, long long param_column, int fp8) {
    if (fp8)
        append_permuted_groups(x, rows, width, layout, permutation, starts, groups, clip, seq_of_row, row_in_seq, target,
                               (uint8_t*)scale, (uint8_t*)zero, param_stride, param_row, param_column);
    else
        append_permuted_groups(x, rows, width, layout, permutation, starts, groups, clip, seq_of_row, row_in_seq, target,
                               (uint16_t*)scale, (uint16_t*)zero, param_stride, param_row,
                               param_column);
}
