// CUDA's execution model on the CPU, so that the kernels in kernels/ run unchanged where no GPU is (the
// tests in tests/test_kernel_emulation.py). Every thread of a block is a fiber of one OS thread;
// __syncthreads, __syncwarp, shuffles and ballots switch fibers at exactly the points where CUDA threads
// synchronize, so shared-memory and warp-level data flow is what the GPU executes; blocks run one after
// another, which a correct kernel cannot tell apart. A barrier that not every thread reaches is reported
// as a deadlock. What this cannot show is speed, memory coalescing or races between blocks: the GPU tests
// (tests/test_runtime_kernels.py) remain the authority.
#pragma once

#include <math.h>
#include <setjmp.h>
#include <ucontext.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

using std::max;
using std::min;

struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(16) int4 {
    int x, y, z, w;
};
struct alignas(8) float2 {
    float x, y;
};
struct alignas(8) uint2 {
    unsigned x, y;
};
struct alignas(8) int2 {
    int x, y;
};

struct Dim3 {
    unsigned x = 1, y = 1, z = 1;
};
inline Dim3 threadIdx, blockIdx, blockDim, gridDim;  // of the running fiber (set at every switch)

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__
#define __shared__ static  // one block runs at a time, so a static is exactly the block's shared memory

namespace emulation {

// Fibers start with makecontext/swapcontext and then switch with _setjmp/_longjmp, which do not save
// the signal mask (swapcontext makes a system call on every switch).
struct Fiber {
    ucontext_t start;
    jmp_buf resume;
    bool started = false, done = false, waiting = false;
};

struct Barrier {
    unsigned needed = 0, arrived = 0;
    std::vector<unsigned> waiters;
};

struct Block {
    std::vector<Fiber> fibers;
    ucontext_t launcher;
    jmp_buf scheduler;
    unsigned current = 0;
    Barrier whole;
    std::vector<Barrier> warps;
    std::vector<uint32_t> exchange;  // one slot per thread for shuffles and ballots
    const std::function<void()>* body = nullptr;
};

constexpr size_t STACK_BYTES = 128 * 1024;
inline Block* running = nullptr;
// Which runnable fiber goes first: thread 0 (the default) or the block's last thread. A kernel whose results
// depend on the order its threads reach shared memory between two synchronization points (floating-point atomics
// into one word) gives other bits in reverse; the GPU promises neither order.
inline bool reverse_schedule = false;
inline std::vector<std::vector<char>> stacks;  // reused by every block

inline void yield_to_scheduler() {
    Block& block = *running;
    if (!_setjmp(block.fibers[block.current].resume)) _longjmp(block.scheduler, 1);
}

inline void wait(Barrier& barrier) {
    Block& block = *running;
    const unsigned me = block.current;
    if (++barrier.arrived == barrier.needed) {  // the last to arrive releases the others and goes on
        barrier.arrived = 0;
        for (unsigned t : barrier.waiters) block.fibers[t].waiting = false;
        barrier.waiters.clear();
        return;
    }
    block.fibers[me].waiting = true;
    barrier.waiters.push_back(me);
    yield_to_scheduler();
}

inline void fiber_main() {
    (*running->body)();
    running->fibers[running->current].done = true;
    _longjmp(running->scheduler, 1);  // never returns: the scheduler picks the next fiber
}

inline void run_block(unsigned threads, const std::function<void()>& body) {
    Block block;
    running = &block;
    block.body = &body;
    block.fibers.resize(threads);
    block.exchange.assign(threads, 0);
    block.whole.needed = threads;
    block.warps.resize((threads + 31) / 32);
    for (auto& warp : block.warps) warp.needed = 32;
    while (stacks.size() < threads) stacks.emplace_back(STACK_BYTES);
    for (;;) {
        bool ran = false, left = false;
        for (unsigned i = 0; i < threads; ++i) {
            const unsigned t = reverse_schedule ? threads - 1 - i : i;
            Fiber& fiber = block.fibers[t];
            if (fiber.done) continue;
            left = true;
            if (fiber.waiting) continue;
            block.current = t;
            threadIdx = {t, 0, 0};
            ran = true;
            if (_setjmp(block.scheduler)) continue;  // back here when the fiber waits or ends
            if (fiber.started) _longjmp(fiber.resume, 1);
            fiber.started = true;
            getcontext(&fiber.start);
            fiber.start.uc_stack.ss_sp = stacks[t].data();
            fiber.start.uc_stack.ss_size = STACK_BYTES;
            fiber.start.uc_link = nullptr;
            makecontext(&fiber.start, fiber_main, 0);
            swapcontext(&block.launcher, &fiber.start);
        }
        if (!left) break;
        if (!ran) {
            std::fprintf(stderr, "deadlock: block (%u, %u, %u) waits at a barrier that not every thread reaches\n", blockIdx.x,
                         blockIdx.y, blockIdx.z);
            std::abort();
        }
    }
    running = nullptr;
}

template <typename Kernel>
void launch(Dim3 grid, Dim3 block, Kernel kernel) {
    gridDim = grid;
    blockDim = block;
    const std::function<void()> body = kernel;
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                blockIdx = {x, y, z};
                run_block(block.x, body);
            }
}

inline uint32_t exchange_in_warp(uint32_t mine, unsigned source_lane) {
    Block& block = *running;
    const unsigned me = threadIdx.x, base = me & ~31u;
    block.exchange[me] = mine;
    wait(block.warps[me / 32]);
    const uint32_t theirs = block.exchange[base + source_lane];
    wait(block.warps[me / 32]);
    threadIdx = {me, 0, 0};
    return theirs;
}

// The lanes of this thread's warp whose posted word passes `keep`, as a mask: every lane posts `mine`, then reads all.
template <typename Keep>
inline unsigned lanes_where(uint32_t mine, Keep keep) {
    Block& block = *running;
    const unsigned me = threadIdx.x, base = me & ~31u;
    block.exchange[me] = mine;
    wait(block.warps[me / 32]);
    unsigned lanes = 0;
    for (unsigned lane = 0; lane < 32; ++lane) lanes |= (keep(block.exchange[base + lane]) ? 1u : 0u) << lane;
    wait(block.warps[me / 32]);
    threadIdx = {me, 0, 0};
    return lanes;
}

}  // namespace emulation

inline void __syncthreads() {
    const unsigned me = threadIdx.x;
    emulation::wait(emulation::running->whole);
    threadIdx = {me, 0, 0};
}

inline void __syncwarp(unsigned = 0xffffffffu) {
    const unsigned me = threadIdx.x;
    emulation::wait(emulation::running->warps[me / 32]);
    threadIdx = {me, 0, 0};
}

inline float __shfl_xor_sync(unsigned, float x, int offset) {
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    bits = emulation::exchange_in_warp(bits, (threadIdx.x & 31u) ^ (unsigned)offset);
    float out;
    std::memcpy(&out, &bits, 4);
    return out;
}

inline unsigned __ballot_sync(unsigned, bool predicate) {
    return emulation::lanes_where(predicate, [](uint32_t theirs) { return theirs != 0; });
}

inline unsigned __match_any_sync(unsigned, unsigned value) {  // the lanes whose value equals this lane's
    return emulation::lanes_where(value, [value](uint32_t theirs) { return theirs == value; });
}

inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}
template <typename T>
inline T __ldg(const T* p) { return *p; }
inline float __fmul_rn(float a, float b) { return a * b; }  // built with -ffp-contract=off: no fused multiply-add
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }  // one rounding, as the GPU's
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline void __sincosf(float x, float* s, float* c) {
    *s = sinf(x);
    *c = cosf(x);
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __float2int_rn(float x) {  // cvt.rni.s32.f32: to nearest even, saturated, NaN to 0
    if (x != x) return 0;
    return x >= 2147483648.0f ? 2147483647 : x < -2147483648.0f ? (-2147483647 - 1) : (int)nearbyintf(x);
}
template <typename T>
inline T atomicAdd(T* address, T value) {  // fibers never interleave inside a call
    const T old = *address;
    *address = old + value;
    return old;
}
inline void __threadfence() {}  // one block runs at a time: what it wrote is visible to the blocks after it

inline float half_to_float(unsigned short h) {
    _Float16 f;
    std::memcpy(&f, &h, 2);
    return (float)f;
}
inline unsigned short round_to_half(float x) {
    const _Float16 f = (_Float16)x;  // IEEE round to nearest even
    unsigned short h;
    std::memcpy(&h, &f, 2);
    return h;
}
