// Codes looked up in registers for the tensor-core decode kernel (decode_attention_tc.cu): a codebook's entries
// (or uniform 3-bit codes' values, from constants) as byte planes that prmt indexes four at a time, and the 3-bit
// indices of planes3 rows (kvcal/packing.py's bit planes) that those lookups take. docs/kernels.md (Codebooks) walks
// through them.
#pragma once

#include "intrinsics.cuh"

namespace tc {

// A table of E fp16 entries (a 2-, 3- or 4-bit codebook) as byte planes: the low bytes of entries 0-3, 4-7, .., then
// their high bytes, so that one prmt looks up 4 entries' low (or high) bytes of 8 by a selector of 4 indices, in
// registers: no shared-memory lookups. Aligned for its loads' width (a 2-bit table: two words).
template <int E>
struct alignas(E == 4 ? 8 : 16) EntryPlanes {
    unsigned low[E / 4], high[E / 4];
};
using Planes3Table = EntryPlanes<8>;

// Word w of an EntryPlanes<E> from a side's entries in global memory (kvcal.runtime.tensor_core.codebook_entries:
// word x holds entry x in its low half)
template <int E>
__device__ __forceinline__ void table_planes_word(EntryPlanes<E>* to, const unsigned* __restrict__ entries, int w) {
    unsigned word = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int x = w % (E / 4) * 4 + i;
        const unsigned entry = __ldg(entries + x) & 0xFFFFu;
        word |= (w < E / 4 ? entry & 0xFFu : entry >> 8) << (8 * i);
    }
    reinterpret_cast<unsigned*>(to)[w] = word;
}

// out[k] = {entry of byte k's low nibble, of its high nibble} of x, k < N = 4 (a field: the two 4-bit codes of a
// pair) from a 4-bit codebook's planes: each half's 4 indices looked up in entries 0-7 and 8-15 (within: their bit 3
// clear, which is prmt's sign mode), then each picked by its bit 3
template <int N>
__device__ __forceinline__ void table_fields(const EntryPlanes<16>& table, unsigned x, unsigned* out) {
    static_assert(N == 4, "a word of 4-bit codes");
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const unsigned s = x >> 16 * h, within = s & 0x7777u, pick = lop3<magic::AND_OR>(s >> 1, 0x4444u, 0x3210u);
        const unsigned lo = prmt(prmt(table.low[0], table.low[1], within), prmt(table.low[2], table.low[3], within), pick);
        const unsigned hi = prmt(prmt(table.high[0], table.high[1], within), prmt(table.high[2], table.high[3], within), pick);
        out[2 * h] = prmt(lo, hi, 0x5140u), out[2 * h + 1] = prmt(lo, hi, 0x7362u);
    }
}

// out[i] = {entry a_i, entry b_i}, i < N (2 or 4): a_i, b_i the indices in nibble i of a and b (bit 3 clear: prmt's
// sign mode; E = 4: bit 2 clear too, so the planes' one word is both prmt sources). The four planes' lookups, then
// each entry's low and high bytes interleaved across a and b.
template <int N = 4, int E>
__device__ __forceinline__ void table_pairs(const EntryPlanes<E>& table, unsigned a, unsigned b, unsigned* out) {
    static_assert(E == 8 || E == 4, "3- or 2-bit indices");
    const unsigned la = prmt(table.low[0], table.low[E / 4 - 1], a), ha = prmt(table.high[0], table.high[E / 4 - 1], a);
    const unsigned lb = prmt(table.low[0], table.low[E / 4 - 1], b), hb = prmt(table.high[0], table.high[E / 4 - 1], b);
#pragma unroll
    for (int k = 0; k < N / 2; ++k) {  // {low byte of a_2k, of b_2k, of a_2k+1, of b_2k+1}, the same of the high bytes
        const unsigned lo = prmt(la, lb, k ? 0x7362u : 0x5140u), hi = prmt(ha, hb, k ? 0x7362u : 0x5140u);
        out[2 * k] = prmt(lo, hi, 0x5140u), out[2 * k + 1] = prmt(lo, hi, 0x7362u);
    }
}

// out[k] = {entry of nibble k's low 2 bits, of its high 2 bits} of x, k < N (2, 4 or 8; a field: the two 2-bit codes
// of a pair) from a 2-bit codebook's planes: the fields' first and second codes spread to nibbles, then table_pairs.
template <int N>
__device__ __forceinline__ void table_fields(const EntryPlanes<4>& table, unsigned x, unsigned* out) {
    static_assert(N == 2 || N == 4 || N == 8, "fields of a half-word or a word");
    const unsigned first = x & 0x33333333u, second = x >> 2 & 0x33333333u;
    table_pairs<N == 2 ? 2 : 4>(table, first, second, out);
    if constexpr (N == 8) table_pairs(table, first >> 16, second >> 16, out + 4);
}

// out[i] = {entry n_i, entry n_(i+2)}, i < 2: n_i the index in nibble i of x (two rows' codes side by side).
__device__ __forceinline__ void table_pairs_of_halves(const Planes3Table& table, unsigned x, unsigned* out) {
    const unsigned lo = prmt(table.low[0], table.low[1], x), hi = prmt(table.high[0], table.high[1], x);
    out[0] = prmt(lo, hi, 0x6240u), out[1] = prmt(lo, hi, 0x7351u);
}

// Uniform 3-bit codes' table: entry k is fp16(k), k < 8. Its low bytes are all 0 and its high bytes (0x00, 0x3C, 0x40,
// 0x42, 0x44 .. 0x47) constants below 0x80, so a lookup needs the high plane alone, from immediates, and an entry's
// low byte is prmt's sign mode on its high byte (bit 3 of the selector's nibble: 0x00): table_pairs and
// table_pairs_of_halves as for an EntryPlanes<8>, in half the prmt.
struct Uniform3Table {};
constexpr unsigned UNIFORM3_HIGH_0_3 = 0x42403C00u, UNIFORM3_HIGH_4_7 = 0x47464544u;

template <int N = 4>
__device__ __forceinline__ void table_pairs(const Uniform3Table&, unsigned a, unsigned b, unsigned* out) {
    static_assert(N == 2 || N == 4, "a half-word or a word of indices");
    const unsigned ha = prmt(UNIFORM3_HIGH_0_3, UNIFORM3_HIGH_4_7, a), hb = prmt(UNIFORM3_HIGH_0_3, UNIFORM3_HIGH_4_7, b);
#pragma unroll
    for (int i = 0; i < N; ++i)  // {0, high byte of entry a_i, 0, high byte of entry b_i}
        out[i] = prmt(ha, hb, (4u + i) << 12 | (8u + i) << 8 | (unsigned)i << 4 | (8u + i));
}

__device__ __forceinline__ void table_pairs_of_halves(const Uniform3Table&, unsigned x, unsigned* out) {
    const unsigned hi = prmt(UNIFORM3_HIGH_0_3, UNIFORM3_HIGH_4_7, x);
    out[0] = prmt(hi, 0u, 0x2808u), out[1] = prmt(hi, 0u, 0x3919u);  // {0, n_i's high byte, 0, n_(i+2)'s}
}

// A side's lookup table: a codebook's EntryPlanes (made in shared memory from its entries) or uniform 3-bit codes'
// Uniform3Table; the other uniform codes convert without one (the EntryPlanes type, never read)
template <bool CB, int BITS>
struct SideTable {
    using type = EntryPlanes<(1 << BITS)>;
};
template <>
struct SideTable<false, 3> {
    using type = Uniform3Table;
};

// The 3-bit indices of 16 codes of a planes3 half-unit (low: their low bits, code j at bit 2j; high: their high bits,
// codes 0-7 in byte 0 and 8-15 in byte 2, code j at bit j % 8): nibble m of even holds code 2m's, of odd code 2m + 1's
// (codes 0-7's in the low 16 bits, 8-15's above), as table_pairs reads them.
struct Planes3Indices {
    unsigned even, odd;
};
__device__ __forceinline__ Planes3Indices planes3_indices(unsigned low, unsigned high) {
    constexpr int OR_AND = (0xF0 | 0xCC) & 0xAA;  // lop3 LUT of (a | b) & c
    high = lop3<OR_AND>(high, high << 4, 0x0F0F0F0Fu);  // codes 4k .. 4k + 3 in byte k's low nibble
    high = lop3<OR_AND>(high, high << 2, 0x33333333u);  // codes 2m, 2m + 1 at bits 4m, 4m + 1
    high = lop3<OR_AND>(high, high << 1, 0x55555555u);  // code j at bit 2j
    return {lop3<magic::SELECT>(low, high << 2, 0x33333333u), lop3<magic::SELECT>(low >> 2, high, 0x33333333u)};
}

// Where codes first .. first + N - 1 of a planes3 row lie (kvcal/packing.py: units of 32 codes in 3 words, word
// 3u + h the low bits of half h, word 3u + 2 the high bits): the words of their low and high bits, the shift that
// moves a quarter's (an eighth's) low bits to the bottom (N = 8, 4), and the prmt selector that moves their high-bit
// bytes to bytes 0 and 2 (N = 16: the first step of spreading their 2-bit fields) or byte 0 (N = 8, 4: an eighth's
// high bits are that byte's nibble shift / 2 & 4; uniform 3-bit values in groups of 32 channels, 4 a lane); a whole
// unit (N = 32, head_dim 256) is its first half's place. decode_tc makes a lane's places once (first: a lane
// constant; pre-RoPE keys and values), so its loop addresses rows without arithmetic.
struct Planes3Place {
    int low, high;
    unsigned shift, selector;
};
template <int N>
__device__ __forceinline__ Planes3Place planes3_place(int first) {
    static_assert(N == 32 || N == 16 || N == 8 || N == 4, "a unit, a half, a quarter or an eighth of a unit");
    const int unit = first >> 5, half = first >> 4 & 1;
    if constexpr (N == 32 || N == 16) return {3 * unit + half, 3 * unit + 2, 0u, half ? 0x4342u : 0x4140u};
    return {3 * unit + half, 3 * unit + 2, 2u * (first & 15), 0x4440u + (first >> 3 & 3)};
}

// The indices (planes3_indices) of the 16 codes at `at` (planes3_place<16>) of a planes3 row.
__device__ __forceinline__ Planes3Indices planes3_indices_at(const unsigned* row, const Planes3Place& at) {
    return planes3_indices(row[at.low], prmt(row[at.high], 0u, at.selector));
}

// The indices of the N codes at `at` (planes3_place<N>, N = 8 or 4) of two planes3 rows in one word: a's as codes
// 0 .. N - 1, b's as codes N .. 2 N - 1 (one planes3_indices for both).
template <int N>
__device__ __forceinline__ Planes3Indices planes3_indices_of_rows(const unsigned* a, const unsigned* b, const Planes3Place& at) {
    static_assert(N == 8 || N == 4, "a quarter or an eighth of a unit a row");
    const unsigned la = a[at.low] >> at.shift, lb = b[at.low] >> at.shift;  // the codes' low bits at the bottom
    const unsigned ha = prmt(a[at.high], 0u, at.selector), hb = prmt(b[at.high], 0u, at.selector);  // high bits: byte 0
    if constexpr (N == 8) return planes3_indices(prmt(la, lb, 0x5410u), prmt(ha, hb, 0x5410u));
    const unsigned s = at.shift >> 1 & 4;  // an eighth's high bits: a nibble of byte 0
    return planes3_indices(prmt(la, lb, 0x5140u), lop3<magic::SELECT>(ha >> s, hb >> s << 4, 0xFFFFFF0Fu));  // (ha >> s: 0 above byte 0)
}

// A whole unit (N = 32): its second half's place, the next low-bits word and high-bit bytes 1 and 3.
__device__ __forceinline__ Planes3Place second_half(const Planes3Place& at) { return {at.low + 1, at.high, 0u, 0x4342u}; }

// Codes at `at` (planes3_place<N>, N = 16 or 32) of a planes3 row as N / 2 pairs {code 2m, code 2m + 1} of the
// table's entries.
template <int N, class Table>
__device__ __forceinline__ void planes3_codes(const unsigned* row, const Planes3Place& at, unsigned* out, const Table& table) {
    static_assert(N == 16 || N == 32, "a half or a whole unit");
    if constexpr (N == 32) {
        planes3_codes<16>(row, at, out, table);
        planes3_codes<16>(row, second_half(at), out + 8, table);
    } else {
        const Planes3Indices x = planes3_indices_at(row, at);
        table_pairs(table, x.even, x.odd, out);
        table_pairs(table, x.even >> 16, x.odd >> 16, out + 4);
    }
}

// Codes at `at` (planes3_place<N>, N = 4 .. 32) of two planes3 rows a and b as N pairs {a's code c, b's code c} of
// the table's entries, c = 0 .. N - 1 (values: a token pair's fragment of each channel).
template <int N, class Table>
__device__ __forceinline__ void planes3_token_pairs(const unsigned* a, const unsigned* b, const Planes3Place& at, unsigned* out,
                                                    const Table& table) {
    if constexpr (N == 32) {
        planes3_token_pairs<16>(a, b, at, out, table);
        planes3_token_pairs<16>(a, b, second_half(at), out + 16, table);
    } else {
        unsigned even[N / 2], odd[N / 2];  // {a's, b's} code 2m, code 2m + 1
        if constexpr (N == 16) {
            const Planes3Indices x = planes3_indices_at(a, at), y = planes3_indices_at(b, at);
            table_pairs(table, x.even, y.even, even), table_pairs(table, x.odd, y.odd, odd);
            table_pairs(table, x.even >> 16, y.even >> 16, even + 4), table_pairs(table, x.odd >> 16, y.odd >> 16, odd + 4);
        } else if constexpr (N == 8) {  // a's codes in the indices' low 16 bits, b's above
            const Planes3Indices x = planes3_indices_of_rows<8>(a, b, at);
            table_pairs(table, x.even, x.even >> 16, even), table_pairs(table, x.odd, x.odd >> 16, odd);
        } else {  // a's codes in nibbles 0-1 of each parity, b's in 2-3
            const Planes3Indices x = planes3_indices_of_rows<4>(a, b, at);
            table_pairs_of_halves(table, x.even, even), table_pairs_of_halves(table, x.odd, odd);
        }
#pragma unroll
        for (int m = 0; m < N / 2; ++m) out[2 * m] = even[m], out[2 * m + 1] = odd[m];
    }
}

}  // namespace tc
