// Warp-level matrix instructions, asynchronous copies and bit tricks for the tensor-core kernels, each
// behind a small device function so that the kernels read as code rather than inline assembly.
//
// Every primitive has two definitions with one meaning: below, inline PTX for the device build (NVRTC /
// CuPy); in tests/kernel_emulation/intrinsics_on_cpu.h, a C++ model of the same PTX semantics for the CPU
// emulator. The host build of the kernels defines KVCAL_HOST_EMULATION (tests/test_kernel_emulation.py)
// and finds that header on its include path. The dequantizing converters at the end are written once, on
// top of the primitives, so the emulator runs exactly their device logic.
//
// References are to sections of the PTX ISA by title (their numbers move between versions):
//   [mma16816]  "Matrix Fragments for mma.m16n8k16 with floating point type"
//   [ldmatrix]  "Warp-level matrix load instruction: ldmatrix"
//   [movmatrix] "Warp-level matrix transpose instruction: movmatrix"
//   [cp.async]  "Data Movement and Conversion Instructions: cp.async" (and cp.async.commit_group / wait_group)
//   [lop3]      "Logic and Shift Instructions: lop3"
//   [prmt]      "Data Movement and Conversion Instructions: prmt"
//   [f16x2]     "Half Precision Floating-Point Instructions: sub, fma"
#pragma once

#ifdef KVCAL_HOST_EMULATION
#include "intrinsics_on_cpu.h"  // tests/kernel_emulation: the emulator's definitions of everything below
#else

// ---- Tensor-core matrix product: D = A * B + C, m16n8k16, fp32 accumulation [mma16816] ----
// Each lane holds fragments of the warp's tiles; with g = lane / 4 and t = lane % 4:
//   A (16x16, row-major), a[r] = two 16-bit elements, the lower one in bits 0-15:
//       a[0] = A[g][2t, 2t+1]   a[1] = A[g+8][2t, 2t+1]   a[2] = A[g][2t+8, 2t+9]   a[3] = A[g+8][2t+8, 2t+9]
//   B (16x8, "col": the two elements of a register are consecutive in k):
//       b[0] = B[2t, 2t+1][g]   b[1] = B[2t+8, 2t+9][g]
//   C, D (16x8 fp32): acc[0] = D[g][2t]  acc[1] = D[g][2t+1]  acc[2] = D[g+8][2t]  acc[3] = D[g+8][2t+1]
// The product accumulates into acc (D = C = acc). All 32 lanes must execute it (.sync.aligned).
__device__ __forceinline__ void mma_m16n8k16_f16(float (&acc)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ void mma_m16n8k16_bf16(float (&acc)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// ---- ldmatrix: 8x8 tiles of 16-bit elements from shared memory into fragments [ldmatrix] ----
// Lane 8i + j passes the address of row j of tile i (16 contiguous bytes, 16-byte aligned); .x2 reads the
// addresses of lanes 0-15, .x4 of all 32. Lane L receives in r[i] row L/4, columns 2(L%4) and 2(L%4)+1 of
// tile i; with .trans, of the transposed tile: column L/4, rows 2(L%4) and 2(L%4)+1. Tiles of a row-major
// A therefore land as the mma A fragment, and .trans turns a k-major (row-major K x N) B, such as a
// token-major V tile, into the mma B fragment.
__device__ __forceinline__ unsigned shared_address(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row)));
}

__device__ __forceinline__ void ldmatrix_x2(unsigned (&r)[2], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(shared_address(row)));
}

__device__ __forceinline__ void ldmatrix_x2_trans(unsigned (&r)[2], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(shared_address(row)));
}

// ---- movmatrix: an 8x8 matrix of 16-bit elements transposed in registers [movmatrix] ----
// Lane L holds row L/4, columns 2(L%4) and 2(L%4)+1 of the matrix (the lower one in bits 0-15), as an mma
// accumulator's rows g or g + 8 do once packed; it receives the same places of the transpose: column L/4, rows
// 2(L%4) and 2(L%4)+1 of the matrix, as a B fragment's register holds them.
__device__ __forceinline__ unsigned movmatrix_trans(unsigned a) {
    unsigned d;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(d) : "r"(a));
    return d;
}

// ---- cp.async: 16 bytes global -> shared without a register round trip [cp.async] ----
// .cg caches in L2 only (streamed data). src_bytes < 16 is the zero-fill form: only src_bytes are read and
// the rest of the 16 destination bytes become zero, so predicated tails need no branch (src_bytes = 0
// reads nothing, but src must still be a valid address expression). Both addresses 16-byte aligned.
// Copies are per thread: a thread's copies since its last commit form one group; wait<N> returns once at
// most N of the thread's most recent groups are still in flight. Other threads see the data only after
// the waiting thread passes a barrier (__syncthreads) that they pass too.
__device__ __forceinline__ void cp_async_16(void* shared_dst, const void* global_src, int src_bytes = 16) {
    // A generic pointer to global memory is its global address (as CUTLASS and Marlin pass it).
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(shared_address(shared_dst)), "l"(global_src),
                 "r"(src_bytes)
                 : "memory");
}

// 8 bytes (cp.async.ca: the 4- and 8-byte sizes go through L1); the same zero fill past src_bytes.
__device__ __forceinline__ void cp_async_8(void* shared_dst, const void* global_src, int src_bytes = 8) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(shared_address(shared_dst)), "l"(global_src),
                 "r"(src_bytes)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// ---- Bit manipulation [lop3], [prmt] ----
// lop3: any function of three words, bit by bit. LUT is the function's truth table evaluated on
// a = 0xF0, b = 0xCC, c = 0xAA: e.g. (a & b) | c is (0xF0 & 0xCC) | 0xAA = 0xEA.
template <int LUT>
__device__ __forceinline__ unsigned lop3(unsigned a, unsigned b, unsigned c) {
    unsigned d;
    asm("lop3.b32 %0, %1, %2, %3, %4;" : "=r"(d) : "r"(a), "r"(b), "r"(c), "n"(LUT));
    return d;
}

// prmt (default mode): byte i of the result is byte (nibble i of selector) & 7 of the 8-byte value
// {b:a} (a's bytes are 0-3, b's 4-7); if the nibble's bit 3 is set, that byte's sign bit fills it instead.
__device__ __forceinline__ unsigned prmt(unsigned a, unsigned b, unsigned selector) {
    unsigned d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
    return d;
}

// ---- Two fp16 lanes in one word, IEEE round to nearest even per lane [f16x2] ----
__device__ __forceinline__ unsigned hsub2_bits(unsigned a, unsigned b) {
    unsigned d;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

__device__ __forceinline__ unsigned hfma2_bits(unsigned a, unsigned b, unsigned c) {
    unsigned d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// -x per lane; a NaN lane gives some NaN (PTX leaves which unspecified). Feeding an fma.f16x2, ptxas folds it into
// the fma's operand: a subtraction for free.
__device__ __forceinline__ unsigned hneg2_bits(unsigned x) {
    unsigned d;
    asm("neg.f16x2 %0, %1;" : "=r"(d) : "r"(x));
    return d;
}

// max per lane (sm_80+): a NaN lane yields the other input's lane (both NaN: the canonical NaN 0x7FFF)
__device__ __forceinline__ unsigned hmax2_bits(unsigned a, unsigned b) {
    unsigned d;
    asm("max.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

#endif  // KVCAL_HOST_EMULATION

// ======================= Codes -> fp16 fragments by magic numbers (both builds) =======================
// A code c placed in the low mantissa bits of the fp16 1024.0 (0x6400, ulp 1) reads as 1024 + c; placed
// s bits higher it reads as 1024 + c * 2^s. One lop3 ((q & mask) | 0x6400'6400) builds two such halves
// at once, one fp16 sub or fma (x * 2^-s - 1024 * 2^-s) leaves exactly c: 1024 + c * 2^s stays below 2048
// and scaling by 2^-s is exact, so nothing rounds. The outputs are the codes themselves as fp16
// (0 .. 2^bits - 1); scales and zero points are the kernel's (an integer offset could ride in the
// sub / fma constants for free, as Marlin's -8 does).
//
// Output order (half2 = {low 16 bits, high 16 bits}): a word of N codes, code i at bits i*bits .. ,
// converts to N/2 words, out[j] = {code j, code j + N/2}. The append kernel permutes codes into this order
// so that each out[j] is one mma fragment register.

namespace magic {
constexpr unsigned FP16_1024 = 0x64006400u, FP16_MINUS_1024 = 0xE400E400u;  // {1024, 1024}, {-1024, -1024}
// exponent field 0: a code c placed s bits up the mantissa reads c * 2^(s - 24), an fp16 subnormal, with no offset
constexpr unsigned FP16_SUBNORMAL = 0u;
constexpr int AND_OR = (0xF0 & 0xCC) | 0xAA;  // lop3 LUT of (a & b) | c
constexpr int SELECT = (0xF0 & 0xAA) | (0xCC & ~0xAA & 0xFF);  // lop3 LUT of c ? a : b, bit by bit
// {2^-s, 2^-s} and {-1024 * 2^-s, ...} as fp16 pairs, for s = 2, 4, 6
constexpr unsigned FP16_QUARTER = 0x34003400u, FP16_MINUS_256 = 0xDC00DC00u;
constexpr unsigned FP16_SIXTEENTH = 0x2C002C00u, FP16_MINUS_64 = 0xD400D400u;
constexpr unsigned FP16_64TH = 0x24002400u, FP16_MINUS_16 = 0xCC00CC00u;
}  // namespace magic

// The converters in two halves. The lop3 half (raw_*) leaves out[j] = {1024 + c * 2^s, ...} with s = raw_shift(j);
// the fix-up (raw_fixed: one hsub2 / hfma2 per word) leaves c. A caller that multiplies the raw words by an operand it
// can scale by 2^-s, and subtracts 1024 times that operand's sum elsewhere, skips the fix-up (decode_tc's uniform keys).
// With BASE = FP16_SUBNORMAL the lop3 half leaves {c * 2^(s - 24), ...}: no offset, for a caller that scales the
// products by 2^(24 - s) afterwards (decode_tc's uniform values; the tensor core multiplies subnormal fp16 exactly).

// s of a raw word: out[j] of raw_u2 (BITS 2) or raw_nibbles (BITS 3, 4) reads 1024 + c * 2^raw_shift<BITS>(j).
template <int BITS>
__device__ __forceinline__ constexpr int raw_shift(int j) { return BITS == 2 ? 2 * (j % 4) : (j & 1) * 4; }

// The fp16 pair {2^-s, 2^-s} for a raw_shift s (0, 2, 4 or 6).
__device__ __forceinline__ constexpr unsigned pow2_down_pair(int s) {
    return s == 0 ? 0x3C003C00u : s == 2 ? magic::FP16_QUARTER : s == 4 ? magic::FP16_SIXTEENTH : magic::FP16_64TH;
}

// c from a raw word that reads 1024 + c * 2^s: x - 1024, or x * 2^-s - 1024 * 2^-s (exact: 1024 + c * 2^s < 2048).
__device__ __forceinline__ unsigned raw_fixed(unsigned x, int s) {
    constexpr unsigned MINUS[4] = {0, magic::FP16_MINUS_256, magic::FP16_MINUS_64, magic::FP16_MINUS_16};
    return s == 0 ? hsub2_bits(x, magic::FP16_1024) : hfma2_bits(x, pow2_down_pair(s), MINUS[s / 2]);
}

// Four codes of up to 4 bits in nibbles 0, 4 (and 1, 5 through the high-mask path) of q: nibble values
// masked to BITS bits. out[0] = {nibble 0, nibble 4}, out[1] = {nibble 1, nibble 5}, out[2] = {2, 6},
// out[3] = {3, 7}. Raw: 4 lop3, 1 shift (s = 0, 4, 0, 4); fixed: 2 sub and 2 fma more.
template <int BITS, unsigned BASE = magic::FP16_1024>
__device__ __forceinline__ void raw_nibbles(unsigned q, unsigned* out) {
    constexpr unsigned LOW = 0x00010001u * ((1u << BITS) - 1u), HIGH = LOW << 4;
    const unsigned upper = q >> 8;  // nibbles 2, 3 and 6, 7 moved to where 0, 1 and 4, 5 were
    out[0] = lop3<magic::AND_OR>(q, LOW, BASE);
    out[1] = lop3<magic::AND_OR>(q, HIGH, BASE);
    out[2] = lop3<magic::AND_OR>(upper, LOW, BASE);
    out[3] = lop3<magic::AND_OR>(upper, HIGH, BASE);
}
template <int BITS>
__device__ __forceinline__ void nibbles_to_half2(unsigned q, unsigned* out) {
    raw_nibbles<BITS>(q, out);
#pragma unroll
    for (int j = 0; j < 4; ++j) out[j] = raw_fixed(out[j], raw_shift<BITS>(j));
}

// 4-bit codes: q holds codes 0..7 (code i at bits 4i). out[j] = {code j, code j + 4}, j = 0..3.
__device__ __forceinline__ void u4_to_half2(unsigned q, unsigned (&out)[4]) { nibbles_to_half2<4>(q, out); }

// 2-bit codes: q holds codes 0..15 (code i at bits 2i). out[j] = {code j, code j + 8}, j = 0..7.
// The codes of out[k], k < 4, sit at bits 2k of each 16-bit half: masked in place they read
// 1024 + c * 4^k (s = 2k); q >> 8 brings those of out[4 + k] to the same bits. Raw: 9 instructions for 16 codes;
// fixed: 17.
template <unsigned BASE = magic::FP16_1024>
__device__ __forceinline__ void raw_u2(unsigned q, unsigned* out) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const unsigned word = half ? q >> 8 : q;  // codes 4..7 and 12..15 moved to where 0..3 and 8..11 were
#pragma unroll
        for (int k = 0; k < 4; ++k) out[4 * half + k] = lop3<magic::AND_OR>(word, 0x00030003u << (2 * k), BASE);
    }
}
__device__ __forceinline__ void u2_to_half2(unsigned q, unsigned (&out)[8]) {
    raw_u2(q, out);
#pragma unroll
    for (int j = 0; j < 8; ++j) out[j] = raw_fixed(out[j], raw_shift<2>(j));
}

// 3-bit codes as bit planes (2 + 1): low2 holds the low two bits of codes 0..15 exactly as u2_to_half2
// reads them; high1 holds their third bits in bits 2 and 3 of each nibble: code 2j's at bit 4j + 2, code
// 2j+1's at bit 4j + 3 (bits 0 and 1 of each nibble are ignored, so one plane word serves two low2 words:
// pass plane for the first and plane << 2 for the second). out[j] = {code j, code j + 8}, j = 0..7.
// Two SELECT lop3s merge each code's bits into a nibble (bit 3 of a nibble is another code's bit and is
// masked off), then the nibble converter runs with 3-bit masks: 22 instructions for 16 codes.
__device__ __forceinline__ void u3_planes_to_half2(unsigned low2, unsigned high1, unsigned (&out)[8]) {
    constexpr unsigned LOW_PAIRS = 0x33333333u;  // bits 0-1 of every nibble
    const unsigned even = lop3<magic::SELECT>(low2, high1, LOW_PAIRS);            // nibble j = code 2j (+ junk bit 3)
    const unsigned odd = lop3<magic::SELECT>(low2 >> 2, high1 >> 1, LOW_PAIRS);   // nibble j = code 2j+1 (+ junk)
    unsigned e[4], o[4];
    nibbles_to_half2<3>(even, e);  // {0, 8}, {2, 10}, {4, 12}, {6, 14}
    nibbles_to_half2<3>(odd, o);   // {1, 9}, {3, 11}, {5, 13}, {7, 15}
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        out[2 * j] = e[j];
        out[2 * j + 1] = o[j];
    }
}

// 8-bit codes: q holds codes 0..3 (code i in byte i). out[0] = {code 0, code 2}, out[1] = {code 1, code 3}.
// prmt pairs each code byte with the exponent byte 0x64 (1024 + c), one sub removes the 1024.
__device__ __forceinline__ void u8_to_half2(unsigned q, unsigned (&out)[2]) {
    constexpr unsigned EXPONENT_BYTES = 0x64646464u;  // bytes 4..7 of {b:a} in prmt
    out[0] = hsub2_bits(prmt(q, EXPONENT_BYTES, 0x7250u), magic::FP16_1024);  // bytes {q0, 0x64, q2, 0x64}
    out[1] = hsub2_bits(prmt(q, EXPONENT_BYTES, 0x7351u), magic::FP16_1024);  // bytes {q1, 0x64, q3, 0x64}
}
