// One side of a KV cache read as the decode kernel's blocks read it, and nothing else done with it: how fast a layout
// alone lets a GPU read (benchmarks/kernels/layout.py). Block (split, head, sequence) reads the pieces of head `head`
// of its tokens, PIECE_CHUNKS 16-byte chunks a token. The cache is cut into blocks of 2^block_shift tokens; chunk c of
// token t's piece is at
//   cache + sequence * sequence_stride + (t >> block_shift) * block_stride + (t mod 2^block_shift) * token_stride
//         + head * head_stride + c   (in chunks)
// which holds a token's row of every head's piece (blocks of one token), a head's run of every token's (one block of
// them all) and the paged layouts between (a head's run of a block's tokens).
// The chunks stream through a cp.async pipeline as the decode kernel's copies do: a thread copies PER_STAGE chunks a
// stage into its own shared slots and keeps STAGES - 1 stages in flight while it folds the oldest (96 KiB in flight a
// multiprocessor at 4 blocks, as much as the decode kernel's int2 g128, and more than Little's law asks at full
// bandwidth: 700 ns x 4.8 TB/s over an H200's 132 multiprocessors is 25 KiB), so that the layout, not this kernel's
// latency, sets the time. Every chunk is folded by
// xor into one word a block, which the host checks: no copy can be left out, and a block that read the wrong bytes
// shows. Copies past the split's last chunk read nothing and land as zeros (xor's identity).

#include "intrinsics.cuh"

template <int PIECE_CHUNKS>
__global__ void __launch_bounds__(128) read_pieces(const uint4* __restrict__ cache, long long sequence_stride,
                                                   long long block_stride, long long token_stride, long long head_stride,
                                                   int block_shift, int tokens, int tokens_per_split,
                                                   unsigned* __restrict__ folded) {
    constexpr int THREADS = 128, PER_STAGE = 4, STAGES = 4, PER_ROUND = PER_STAGE * THREADS;
    __shared__ uint4 slots[STAGES][PER_STAGE][THREADS];  // a thread's chunks of each stage in flight
    __shared__ unsigned threads[THREADS];
    const int first = blockIdx.x * tokens_per_split;
    const int chunks = max(min(tokens_per_split, tokens - first), 0) * PIECE_CHUNKS;
    const uint4* const base = cache + blockIdx.z * sequence_stride + blockIdx.y * head_stride;
    const int in_block = (1 << block_shift) - 1;
    const auto copy_round = [&](int round) {  // chunks round * PER_ROUND + k * THREADS + threadIdx.x, k < PER_STAGE
#pragma unroll
        for (int k = 0; k < PER_STAGE; ++k) {
            const int i = round * PER_ROUND + k * THREADS + threadIdx.x, t = first + i / PIECE_CHUNKS;
            const bool live = i < chunks;
            const uint4* const at = base + (t >> block_shift) * block_stride + (t & in_block) * token_stride + i % PIECE_CHUNKS;
            cp_async_16(&slots[round % STAGES][k][threadIdx.x], live ? at : base, live ? 16 : 0);
        }
        cp_async_commit();
    };
    const int rounds = (chunks + PER_ROUND - 1) / PER_ROUND;
    for (int round = 0; round < STAGES - 1; ++round) copy_round(round);
    unsigned x = 0;
    for (int round = 0; round < rounds; ++round) {
        copy_round(round + STAGES - 1);  // into the slots folded last round
        cp_async_wait<STAGES - 1>();
#pragma unroll
        for (int k = 0; k < PER_STAGE; ++k) {
            const uint4 v = slots[round % STAGES][k][threadIdx.x];
            x ^= v.x ^ v.y ^ v.z ^ v.w;
        }
    }
    cp_async_wait<0>();  // the zero-filled rounds past the last
    threads[threadIdx.x] = x;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int t = 1; t < THREADS; ++t) x ^= threads[t];
        folded[((long long)blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x] = x;
    }
}
