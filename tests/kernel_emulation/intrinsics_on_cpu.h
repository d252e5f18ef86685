// The emulator's definitions of the primitives of kernels/intrinsics.cuh, one per PTX definition there,
// following the PTX ISA's semantics (sections cited as there: [mma16816], [ldmatrix], ...). The kernels'
// header includes this file when KVCAL_HOST_EMULATION is defined; it builds on cuda_on_cpu.h (fibers,
// warp barriers) and adds nothing to it.
//
// Warp-collective instructions (mma, ldmatrix) work like the existing shuffles: every lane writes its
// operands (fragment registers, row addresses) into a per-thread slot, waits at its warp's barrier, reads
// what it needs from the other lanes' slots, and waits again so that no lane overwrites its slot while
// another still reads it. A lane that never arrives is reported as a deadlock by the scheduler; lanes
// that arrive at different collectives are reported as a mismatch.
//
// cp.async is emulated to expose pipeline bugs rather than hide them: a copy snapshots its source when
// issued, fills its destination with 0xFF bytes (a NaN in fp16, bf16 and fp32), and writes the data only
// when a cp.async.wait_group retires its group. A kernel that reads shared memory before its wait, or
// before the barrier that follows the copying thread's wait, reads NaNs; one that overwrites a buffer that
// other threads still read (a missing barrier before the next stage's copies) hands them NaNs too. A
// correct kernel cannot tell this from the GPU, where the data lands at some time between issue and wait.
// Copies a block leaves in flight when it ends are dropped at the next block's first cp.async call (the
// next block is recognised by its index, so a kernel of one block launched twice in a row that never
// waits would carry them over: no kvcal kernel ends with copies in flight).
#pragma once

#include <climits>
#include <cmath>
#include <deque>

#include "cuda_on_cpu.h"

namespace emulation {
namespace intrinsics {

enum Collective : unsigned { MMA_F16 = 1, MMA_BF16, LDMATRIX_X2, LDMATRIX_X4, LDMATRIX_X2_TRANS, LDMATRIX_X4_TRANS, MOVMATRIX };

struct Slot {  // what one lane contributes to a warp-collective instruction
    unsigned op = 0;
    unsigned a[4] = {}, b[2] = {};
    const unsigned char* address = nullptr;
};
inline std::vector<Slot> slots;  // one per thread of the running block (blocks run one at a time)

[[noreturn]] inline void fail(const char* what) {
    std::fprintf(stderr, "emulated PTX: %s (block (%u, %u, %u), thread %u)\n", what, blockIdx.x, blockIdx.y, blockIdx.z,
                 threadIdx.x);
    std::abort();
}

inline Slot& my_slot() {
    if (slots.size() < blockDim.x) slots.resize(blockDim.x);
    return slots[threadIdx.x];
}

inline void warp_rendezvous() {
    const unsigned me = threadIdx.x;
    wait(running->warps[me / 32]);
    threadIdx = {me, 0, 0};
}

inline void check_same_collective() {
    const unsigned base = threadIdx.x & ~31u;
    for (unsigned lane = 0; lane < 32; ++lane)
        if (slots[base + lane].op != slots[threadIdx.x].op)
            fail("lanes of one warp reached different warp-collective instructions");
}

inline float bits_to_float(unsigned bits16, bool bf16) {
    if (bf16) return __int_as_float((int)(bits16 << 16));  // bf16 is the upper half of an fp32
    _Float16 h;
    const unsigned short b = (unsigned short)bits16;
    std::memcpy(&h, &b, 2);
    return (float)h;
}

// The tensor core's sum d = c + sum_k a_k b_k. The PTX ISA leaves its order and internal precision
// unspecified; this is the rule an H100 (sm_90) follows, fitted to and then matched bit for bit on 153,600
// outputs of random fp16 and bf16 products (scales 2^-12 .. 100, fp16 subnormals included; A100 not measured):
// the 16 products are exact; each term (c and the products) is truncated toward zero to a multiple of
// 2^(e - 25), where e is the largest exponent among the nonzero terms, counting a product's exponent as
// the sum of its factors' exponents (floor(log2 |x|)) before normalisation; the truncated terms are added
// exactly and the sum is rounded toward zero to fp32. Its error stays below (17 * 2^-25 + 2^-23) *
// (|c| + sum |a_k b_k|). Infinities and NaNs take the plain IEEE sum; overflow behaviour is not measured.
inline float tensor_core_sum(float c, const double (&a)[16], const double (&b)[16]) {
    double terms[17] = {c};
    int e = INT_MIN;
    bool finite = std::isfinite(c);
    if (c != 0) e = std::ilogb(c);
    double plain = c;
    for (int k = 0; k < 16; ++k) {
        terms[k + 1] = a[k] * b[k];  // exact: 11 x 11 (8 x 8) significant bits
        plain += terms[k + 1];
        finite = finite && std::isfinite(terms[k + 1]);
        if (terms[k + 1] != 0) e = std::max(e, std::ilogb(a[k]) + std::ilogb(b[k]));
    }
    if (!finite) return (float)plain;
    if (e == INT_MIN) return 0.0f;
    long long sum = 0;  // in units of 2^(e - 25): every truncated term is below 2^27 of them
    for (double term : terms) sum += (long long)std::ldexp(term, 25 - e);  // the cast truncates toward zero
    if (sum == 0) return 0.0f;
    unsigned long long m = sum < 0 ? -(unsigned long long)sum : (unsigned long long)sum;
    const int top = 63 - __builtin_clzll(m) + e - 25;  // exponent of the leading bit
    const int shift = std::max(top - 23, -149) - (e - 25);  // fp32 ulp (subnormals included) in units
    if (shift >= 64) m = 0;
    else if (shift > 0) m = m >> shift << shift;
    return (float)std::copysign(std::ldexp((double)m, e - 25), (double)sum);
}

// mma.m16n8k16 .row.col .f32 accumulation [mma16816]. Each lane computes its own four outputs
// from the other lanes' fragments; see kernels/intrinsics.cuh for the layout, tensor_core_sum for rounding.
template <bool BF16>
inline void mma_m16n8k16(float (&acc)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    Slot& mine = my_slot();
    mine.op = BF16 ? MMA_BF16 : MMA_F16;
    std::memcpy(mine.a, a, sizeof mine.a);
    std::memcpy(mine.b, b, sizeof mine.b);
    warp_rendezvous();
    check_same_collective();
    const unsigned base = threadIdx.x & ~31u, lane = threadIdx.x & 31u, g = lane >> 2, t = lane & 3u;
    // A[row][k]: lane (row % 8) * 4 + (k % 8) / 2, register row / 8 + 2 * (k / 8), half k % 2
    auto A = [&](unsigned row, unsigned k) {
        const unsigned word = slots[base + (row & 7u) * 4 + (k & 7u) / 2].a[(row >> 3) + 2 * (k >> 3)];
        return bits_to_float((word >> (16 * (k & 1u))) & 0xFFFFu, BF16);
    };
    // B[k][col]: lane col * 4 + (k % 8) / 2, register k / 8, half k % 2
    auto B = [&](unsigned k, unsigned col) {
        const unsigned word = slots[base + col * 4 + (k & 7u) / 2].b[k >> 3];
        return bits_to_float((word >> (16 * (k & 1u))) & 0xFFFFu, BF16);
    };
    float d[4];
    for (unsigned i = 0; i < 4; ++i) {  // acc[i] = D[g + 8 (i / 2)][2t + i % 2]
        const unsigned row = g + 8 * (i >> 1), col = 2 * t + (i & 1u);
        double a_row[16], b_col[16];
        for (unsigned k = 0; k < 16; ++k) a_row[k] = A(row, k), b_col[k] = B(k, col);
        d[i] = tensor_core_sum(acc[i], a_row, b_col);
    }
    warp_rendezvous();
    mine.op = 0;  // a lane that reaches a shuffle next, while the others reach a collective, shows as a mismatch
    std::memcpy(acc, d, sizeof d);
}

// ldmatrix .m8n8 .b16 [ldmatrix]: lane 8i + j gives row j of tile i; lane L gets row L/4,
// columns 2(L%4), 2(L%4)+1 of tile i in r[i] (.trans: column L/4, rows 2(L%4), 2(L%4)+1).
template <unsigned TILES, bool TRANS>
inline void ldmatrix(unsigned* r, const void* row) {
    Slot& mine = my_slot();
    const unsigned lane = threadIdx.x & 31u, base = threadIdx.x & ~31u;
    mine.op = TILES == 4 ? (TRANS ? LDMATRIX_X4_TRANS : LDMATRIX_X4) : (TRANS ? LDMATRIX_X2_TRANS : LDMATRIX_X2);
    mine.address = static_cast<const unsigned char*>(row);
    if (lane < 8 * TILES && reinterpret_cast<uintptr_t>(row) % 16) fail("ldmatrix row address is not 16-byte aligned");
    warp_rendezvous();
    check_same_collective();
    unsigned out[TILES];
    for (unsigned i = 0; i < TILES; ++i) {
        if (!TRANS) {
            std::memcpy(&out[i], slots[base + 8 * i + lane / 4].address + 4 * (lane % 4), 4);
        } else {
            unsigned short lo, hi;
            std::memcpy(&lo, slots[base + 8 * i + 2 * (lane % 4)].address + 2 * (lane / 4), 2);
            std::memcpy(&hi, slots[base + 8 * i + 2 * (lane % 4) + 1].address + 2 * (lane / 4), 2);
            out[i] = lo | (unsigned)hi << 16;
        }
    }
    warp_rendezvous();
    mine.op = 0;
    std::memcpy(r, out, sizeof out);
}

// movmatrix .m8n8 .trans .b16 [movmatrix]: lane L holds row L/4, columns 2(L%4), 2(L%4)+1 and gets
// column L/4, rows 2(L%4), 2(L%4)+1: element (r, c) is in lane 4r + c/2, half c % 2.
inline unsigned movmatrix_trans(unsigned a) {
    Slot& mine = my_slot();
    const unsigned lane = threadIdx.x & 31u, base = threadIdx.x & ~31u, column = lane / 4, row = 2 * (lane % 4);
    mine.op = MOVMATRIX;
    mine.a[0] = a;
    warp_rendezvous();
    check_same_collective();
    const auto element = [&](unsigned r, unsigned c) { return slots[base + 4 * r + c / 2].a[0] >> (16 * (c % 2)) & 0xFFFFu; };
    const unsigned out = element(row, column) | element(row + 1, column) << 16;
    warp_rendezvous();
    mine.op = 0;
    return out;
}

// cp.async state of each thread of the running block: its copies since the last commit, then its
// committed groups, oldest first ([cp.async]: groups are per thread and complete in order).
struct Copy {
    unsigned char* dst;
    unsigned char bytes[16];
    int size;
};
struct AsyncCopies {
    std::vector<Copy> open;
    std::deque<std::vector<Copy>> committed;
};
inline std::vector<AsyncCopies> copies;
inline const void* copies_owner = nullptr;  // the block the state belongs to
inline Dim3 copies_block;

inline AsyncCopies& my_copies() {
    // A new block drops what the last one left in flight: its shared memory is gone on the GPU.
    if (copies_owner != running || copies_block.x != blockIdx.x || copies_block.y != blockIdx.y ||
        copies_block.z != blockIdx.z) {
        copies.assign(blockDim.x, {});
        copies_owner = running;
        copies_block = blockIdx;
    }
    return copies[threadIdx.x];
}

inline void land(std::vector<Copy>& group) {
    for (Copy& c : group) std::memcpy(c.dst, c.bytes, c.size);
}

}  // namespace intrinsics
}  // namespace emulation

inline void mma_m16n8k16_f16(float (&acc)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    emulation::intrinsics::mma_m16n8k16<false>(acc, a, b);
}
inline void mma_m16n8k16_bf16(float (&acc)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
    emulation::intrinsics::mma_m16n8k16<true>(acc, a, b);
}

inline void ldmatrix_x4(unsigned (&r)[4], const void* row) { emulation::intrinsics::ldmatrix<4, false>(r, row); }
inline void ldmatrix_x4_trans(unsigned (&r)[4], const void* row) { emulation::intrinsics::ldmatrix<4, true>(r, row); }
inline void ldmatrix_x2(unsigned (&r)[2], const void* row) { emulation::intrinsics::ldmatrix<2, false>(r, row); }
inline void ldmatrix_x2_trans(unsigned (&r)[2], const void* row) { emulation::intrinsics::ldmatrix<2, true>(r, row); }
inline unsigned movmatrix_trans(unsigned a) { return emulation::intrinsics::movmatrix_trans(a); }

namespace emulation {
namespace intrinsics {
// cp.async of `size` bytes with src-size src_bytes (the rest of the destination zero-filled), landing at the wait.
inline void async_copy(void* shared_dst, const void* global_src, int src_bytes, int size) {
    if (reinterpret_cast<uintptr_t>(shared_dst) % size || reinterpret_cast<uintptr_t>(global_src) % size)
        fail("cp.async addresses must be aligned to the copy size");
    if (src_bytes < 0 || src_bytes > size) fail("cp.async src-size must be 0..cp-size");
    Copy copy{static_cast<unsigned char*>(shared_dst), {}, size};
    std::memcpy(copy.bytes, global_src, src_bytes);  // the zero-fill form reads only src_bytes
    my_copies().open.push_back(copy);
    std::memset(shared_dst, 0xFF, size);  // undefined until the wait: poison
}
}  // namespace intrinsics
}  // namespace emulation

inline void cp_async_16(void* shared_dst, const void* global_src, int src_bytes = 16) {
    emulation::intrinsics::async_copy(shared_dst, global_src, src_bytes, 16);
}
inline void cp_async_8(void* shared_dst, const void* global_src, int src_bytes = 8) {
    emulation::intrinsics::async_copy(shared_dst, global_src, src_bytes, 8);
}

inline void cp_async_commit() {
    auto& mine = emulation::intrinsics::my_copies();
    mine.committed.push_back(std::move(mine.open));  // an empty group is a group too
    mine.open.clear();
}

template <int N>
inline void cp_async_wait() {
    auto& mine = emulation::intrinsics::my_copies();
    while (mine.committed.size() > (size_t)N) {
        emulation::intrinsics::land(mine.committed.front());
        mine.committed.pop_front();
    }
}

// lop3 [lop3]: bit i of the result is bit (a_i b_i c_i as a 3-bit number) of LUT.
template <int LUT>
inline unsigned lop3(unsigned a, unsigned b, unsigned c) {
    static_assert(LUT >= 0 && LUT <= 0xFF, "lop3 takes an 8-bit truth table");
    unsigned d = 0;
    for (unsigned minterm = 0; minterm < 8; ++minterm)
        if (LUT >> minterm & 1) d |= (minterm & 4 ? a : ~a) & (minterm & 2 ? b : ~b) & (minterm & 1 ? c : ~c);
    return d;
}

// prmt, default mode [prmt].
inline unsigned prmt(unsigned a, unsigned b, unsigned selector) {
    const unsigned long long bytes = (unsigned long long)b << 32 | a;
    unsigned d = 0;
    for (unsigned i = 0; i < 4; ++i) {
        const unsigned nibble = selector >> (4 * i) & 0xFu;
        unsigned byte = bytes >> (8 * (nibble & 7u)) & 0xFFu;
        if (nibble & 8u) byte = byte & 0x80u ? 0xFFu : 0u;  // sign replication
        d |= byte << (8 * i);
    }
    return d;
}

// .f16x2 arithmetic, IEEE round to nearest even per lane. In double, a - b is exact and a * b + c is exact
// whenever it spans at most 53 bits (every use in kernels/intrinsics.cuh), so one rounding to fp16 remains.
namespace emulation {
namespace intrinsics {
inline double half_lane(unsigned word, unsigned lane) { return (double)bits_to_float(word >> (16 * lane) & 0xFFFFu, false); }
inline unsigned half_bits_of(double x) {
    const _Float16 h = (_Float16)x;
    unsigned short bits;
    std::memcpy(&bits, &h, 2);
    return bits;
}
}  // namespace intrinsics
}  // namespace emulation

inline unsigned hsub2_bits(unsigned a, unsigned b) {
    using namespace emulation::intrinsics;
    return half_bits_of(half_lane(a, 0) - half_lane(b, 0)) | half_bits_of(half_lane(a, 1) - half_lane(b, 1)) << 16;
}

inline unsigned hfma2_bits(unsigned a, unsigned b, unsigned c) {
    using namespace emulation::intrinsics;
    return half_bits_of(half_lane(a, 0) * half_lane(b, 0) + half_lane(c, 0)) |
           half_bits_of(half_lane(a, 1) * half_lane(b, 1) + half_lane(c, 1)) << 16;
}

// neg.f16x2: the sign bit of each lane flipped (a NaN stays a NaN, which PTX allows)
inline unsigned hneg2_bits(unsigned x) { return x ^ 0x80008000u; }

// max.f16x2: per lane the larger value; a NaN lane loses to a number, two NaNs give the canonical NaN 0x7FFF;
// +0 is taken as larger than -0.
inline unsigned hmax2_bits(unsigned a, unsigned b) {
    using namespace emulation::intrinsics;
    unsigned d = 0;
    for (unsigned lane = 0; lane < 2; ++lane) {
        const unsigned x = a >> (16 * lane) & 0xFFFFu, y = b >> (16 * lane) & 0xFFFFu;
        const double u = half_lane(a, lane), v = half_lane(b, lane);
        unsigned r;
        if (u != u && v != v) r = 0x7FFFu;
        else if (u != u) r = y;
        else if (v != v) r = x;
        else if (u == v) r = (x & 0x8000u) ? y : x;  // equal values: only the zeros differ, in sign
        else r = u > v ? x : y;
        d |= r << (16 * lane);
    }
    return d;
}
