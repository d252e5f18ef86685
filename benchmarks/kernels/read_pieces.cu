// One side of a KV cache read as the decode kernel's blocks read it, and nothing else done with it: how fast a layout
// alone lets a GPU read (benchmarks/kernels/layout.py). Block (split, head, sequence) reads the pieces of head `head`
// of its tokens, PIECE_CHUNKS 16-byte chunks a token. The cache is cut into blocks of 2^block_shift tokens; chunk c of
// token t's piece is at
//   cache + sequence * sequence_stride + (t >> block_shift) * block_stride + (t mod 2^block_shift) * token_stride
//         + head * head_stride + c   (in chunks)
// which holds a token's row of every head's piece (blocks of one token), a head's run of every token's (one block of
// them all) and the paged layouts between (a head's run of a block's tokens).
// IN_FLIGHT loads a thread are issued before any is used: at 4 blocks a multiprocessor 64 KiB in flight, more than
// Little's law asks at full bandwidth (700 ns x 4.8 TB/s over an H200's 132 multiprocessors: 25 KiB), so that the
// layout, not this kernel's latency, sets the time.
// Every chunk is folded by xor into one word a block, which the host checks: no load can be left out, and a block that
// read the wrong bytes shows.

template <int PIECE_CHUNKS>
__global__ void __launch_bounds__(128) read_pieces(const uint4* __restrict__ cache, long long sequence_stride,
                                                   long long block_stride, long long token_stride, long long head_stride,
                                                   int block_shift, int tokens, int tokens_per_split,
                                                   unsigned* __restrict__ folded) {
    constexpr int THREADS = 128, IN_FLIGHT = 8;
    const int first = blockIdx.x * tokens_per_split;
    const int chunks = max(min(tokens_per_split, tokens - first), 0) * PIECE_CHUNKS;
    const uint4* const base = cache + blockIdx.z * sequence_stride + blockIdx.y * head_stride;
    const int in_block = (1 << block_shift) - 1;
    const auto chunk = [&](int i) {
        const int t = first + i / PIECE_CHUNKS;
        return __ldg(base + (t >> block_shift) * block_stride + (t & in_block) * token_stride + i % PIECE_CHUNKS);
    };
    unsigned x = 0;
    int i = threadIdx.x;
    for (; i + (IN_FLIGHT - 1) * THREADS < chunks; i += IN_FLIGHT * THREADS) {
        uint4 v[IN_FLIGHT];
#pragma unroll
        for (int k = 0; k < IN_FLIGHT; ++k) v[k] = chunk(i + k * THREADS);
#pragma unroll
        for (int k = 0; k < IN_FLIGHT; ++k) x ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
    }
    for (; i < chunks; i += THREADS) {
        const uint4 v = chunk(i);
        x ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    __shared__ unsigned threads[THREADS];
    threads[threadIdx.x] = x;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int t = 1; t < THREADS; ++t) x ^= threads[t];
        folded[((long long)blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x] = x;
    }
}
