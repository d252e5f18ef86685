// Test-only kernels that exercise every primitive of kernels/intrinsics.cuh, for
// tests/test_kernel_intrinsics.py: compiled with NVRTC for sm_80 / sm_90 (the inline PTX is valid), run
// on the CPU emulator (checked against torch and against the PTX ISA's layouts written out in Python),
// and, where a GPU is present, run on it too and compared with the emulator.
#include "intrinsics.cuh"

// One warp: D (16x16 fp32) = A (16x16) * B (16x16) + C, as two m16n8k16 products (columns 0-7, 8-15).
// a, b: row-major fp16 (bf16 != 0: bf16) bits; c, d: row-major fp32. path picks how fragments are built:
//   0: straight from global memory by the PTX ISA's fragment formulas (mma alone, no ldmatrix);
//   1: A by ldmatrix.x4, B by ldmatrix.x4.trans from row-major (k-major) B, both n-tiles at once;
//   2: A by ldmatrix.x4, B by ldmatrix.x2 from B transposed in shared memory (n-major, "col");
//   3: A by ldmatrix.x4, B by ldmatrix.x2.trans per n-tile from row-major B.
extern "C" __global__ void probe_mma(const unsigned short* a, const unsigned short* b, const float* c, float* d, int bf16,
                                     int path) {
    alignas(16) __shared__ unsigned short sa[16 * 16];
    alignas(16) __shared__ unsigned short sb[16 * 16];   // B[k][n]
    alignas(16) __shared__ unsigned short sbt[16 * 16];  // B[n][k]
    const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
    for (int i = lane; i < 256; i += 32) {
        sa[i] = a[i];
        sb[i] = b[i];
        sbt[(i % 16) * 16 + i / 16] = b[i];
    }
    __syncthreads();

    unsigned fa[4], fb[2][2];
    if (path == 0) {
        for (int r = 0; r < 4; ++r) {
            const int row = g + 8 * (r & 1), col = 2 * t + 8 * (r >> 1);
            fa[r] = a[row * 16 + col] | (unsigned)a[row * 16 + col + 1] << 16;
        }
        for (int n = 0; n < 2; ++n)
            for (int r = 0; r < 2; ++r) {
                const int k = 2 * t + 8 * r, col = 8 * n + g;
                fb[n][r] = b[k * 16 + col] | (unsigned)b[(k + 1) * 16 + col] << 16;
            }
    } else {
        ldmatrix_x4(fa, sa + (lane % 16) * 16 + 8 * (lane / 16));  // tiles: rows 0-7 | 8-15, columns 0-7 | 8-15
        if (path == 1) {
            unsigned r[4];  // tiles: k 0-7 | 8-15 of n-tile 0, then of n-tile 1
            ldmatrix_x4_trans(r, sb + (lane % 8 + 8 * ((lane / 8) % 2)) * 16 + 8 * (lane / 16));
            fb[0][0] = r[0], fb[0][1] = r[1], fb[1][0] = r[2], fb[1][1] = r[3];
        } else {
            for (int n = 0; n < 2; ++n) {
                if (path == 2) ldmatrix_x2(fb[n], sbt + (8 * n + lane % 8) * 16 + 8 * ((lane / 8) % 2));
                else ldmatrix_x2_trans(fb[n], sb + (lane % 16) * 16 + 8 * n);
            }
        }
    }
    for (int n = 0; n < 2; ++n) {
        float acc[4];
        for (int i = 0; i < 4; ++i) acc[i] = c[(g + 8 * (i / 2)) * 16 + 8 * n + 2 * t + i % 2];
        if (bf16) mma_m16n8k16_bf16(acc, fa, fb[n]);
        else mma_m16n8k16_f16(acc, fa, fb[n]);
        for (int i = 0; i < 4; ++i) d[(g + 8 * (i / 2)) * 16 + 8 * n + 2 * t + i % 2] = acc[i];
    }
}

// One warp: the registers ldmatrix gives each lane from a 16x16 row-major tile, out[lane][4].
// variant 0: .x4, 1: .x4.trans, 2: .x2, 3: .x2.trans; lane L addresses row L % 16, column 8 (L / 16).
extern "C" __global__ void probe_ldmatrix(const unsigned short* tile, unsigned* out, int variant) {
    alignas(16) __shared__ unsigned short s[16 * 16];
    const int lane = threadIdx.x;
    for (int i = lane; i < 256; i += 32) s[i] = tile[i];
    __syncthreads();
    const unsigned short* row = s + (lane % 16) * 16 + 8 * (lane / 16);
    unsigned r[4] = {0, 0, 0, 0};
    if (variant == 0) ldmatrix_x4(r, row);
    else if (variant == 1) ldmatrix_x4_trans(r, row);
    else {
        unsigned r2[2];
        if (variant == 2) ldmatrix_x2(r2, row);
        else ldmatrix_x2_trans(r2, row);
        r[0] = r2[0], r[1] = r2[1];
    }
    for (int i = 0; i < 4; ++i) out[lane * 4 + i] = r[i];
}

// One warp: movmatrix.trans of each lane's word, out[lane].
extern "C" __global__ void probe_movmatrix(const unsigned* in, unsigned* out) {
    out[threadIdx.x] = movmatrix_trans(in[threadIdx.x]);
}

// cp.async through a STAGES-deep ring of shared buffers, one 16-byte chunk per thread and stage (64
// threads, 1 KiB stages): src (bytes long, any length) to dst (whole stages; the tail zero-filled by the
// src-size form). Each thread stores the chunk its neighbour copied, so the data must cross the barrier.
// bug 1 waits for one group too few (reads a stage still in flight); bug 2 leaves out the barrier that
// keeps a buffer from being refilled while other threads still read it.
template <int STAGES>
__device__ void copy_pipeline(const unsigned char* src, int bytes, uint4* dst, int bug) {
    constexpr int THREADS = 64, STAGE_BYTES = THREADS * 16;
    alignas(16) __shared__ uint4 ring[STAGES][THREADS];
    const int tid = threadIdx.x, stages = (bytes + STAGE_BYTES - 1) / STAGE_BYTES;
    auto issue = [&](int stage) {
        if (stage < stages) {
            const int offset = stage * STAGE_BYTES + tid * 16;
            const int valid = bytes - offset < 0 ? 0 : (bytes - offset > 16 ? 16 : bytes - offset);
            cp_async_16(&ring[stage % STAGES][tid], valid ? src + offset : src, valid);
        }
        cp_async_commit();  // an empty group keeps the count of groups per stage fixed
    };
    for (int s = 0; s < STAGES - 1; ++s) issue(s);
    for (int s = 0; s < stages; ++s) {
        issue(s + STAGES - 1);
        if (bug == 1) cp_async_wait<STAGES>();
        else cp_async_wait<STAGES - 1>();  // stage s has landed (for this thread's copies)
        __syncthreads();                    // ... and for everyone's
        const int from = (tid + 1) % THREADS;
        dst[s * THREADS + from] = ring[s % STAGES][from];
        if (bug != 2) __syncthreads();  // buffer s % STAGES is refilled by the next iteration's issue
    }
    cp_async_wait<0>();
}

extern "C" __global__ void probe_cp_async(const unsigned char* src, int bytes, uint4* dst, int stages, int bug) {
    if (stages == 2) copy_pipeline<2>(src, bytes, dst, bug);
    else if (stages == 3) copy_pipeline<3>(src, bytes, dst, bug);
    else copy_pipeline<4>(src, bytes, dst, bug);
}

// Bit operations on n word triples: out[i][0..6] = lop3 with LUTs 0xEA ((a & b) | c), 0xE4 (c ? a : b),
// 0x96 (a ^ b ^ c), 0x01 (~(a | b | c)), 0x78 (a ^ (b & c)), prmt(a, b, c), and max.f16x2 of a and b.
extern "C" __global__ void probe_bits(const unsigned* a, const unsigned* b, const unsigned* c, unsigned* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned* o = out + 8 * i;
    o[0] = lop3<0xEA>(a[i], b[i], c[i]);
    o[1] = lop3<0xE4>(a[i], b[i], c[i]);
    o[2] = lop3<0x96>(a[i], b[i], c[i]);
    o[3] = lop3<0x01>(a[i], b[i], c[i]);
    o[4] = lop3<0x78>(a[i], b[i], c[i]);
    o[5] = prmt(a[i], b[i], c[i]);
    o[6] = hmax2_bits(a[i], b[i]);
    o[7] = hneg2_bits(a[i]);
}

// The code converters on n inputs: bits 4 (u4_to_half2, 4 words out per word in), 2 (u2_to_half2, 8),
// 3 (u3_planes_to_half2 on word pairs {low2, high1}, 8 per pair), 8 (u8_to_half2, 2).
extern "C" __global__ void probe_dequant(const unsigned* words, unsigned* out, int n, int bits) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    if (bits == 4) {
        unsigned h[4];
        u4_to_half2(words[i], h);
        for (int j = 0; j < 4; ++j) out[4 * i + j] = h[j];
    } else if (bits == 2) {
        unsigned h[8];
        u2_to_half2(words[i], h);
        for (int j = 0; j < 8; ++j) out[8 * i + j] = h[j];
    } else if (bits == 3) {
        unsigned h[8];
        u3_planes_to_half2(words[2 * i], words[2 * i + 1], h);
        for (int j = 0; j < 8; ++j) out[8 * i + j] = h[j];
    } else {
        unsigned h[2];
        u8_to_half2(words[i], h);
        for (int j = 0; j < 2; ++j) out[2 * i + j] = h[j];
    }
}
