// A host emulator of the CUDA execution model, enough to run ep_kernels.cuh unchanged on a CPU:
// a grid's blocks run one after another; a block's threads are cooperative fibers (ucontext) on
// the calling thread, switched at __syncthreads, warp collectives and __nanosleep, so block and warp
// barriers, ballots, shuffles and `__shared__` variables (function statics: one block runs at a
// time) behave as on a GPU. Atomics are host atomics, the "global timer" is the host's monotonic
// clock, and the memory-model helpers are C++ release/acquire atomics (so emulated kernels of rank
// processes sharing memory see each other's signals). It checks logic (indices, packing,
// arithmetic, waits and their failure paths), not the GPU's memory model or speed.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>

namespace mep_sim {

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

struct alignas(16) int4 {  // as CUDA's: a 16-byte access, which the GPU faults on unless 16-byte aligned
    int x, y, z, w;
};

// The running thread's coordinates (valid inside a kernel run by run_grid).
dim3 thread_index();
dim3 block_index();
dim3 block_dim();
dim3 grid_dim();

// Collectives of the running thread's block or warp (every participating thread must call them).
void sync_threads();
void sync_warp();
unsigned ballot(bool predicate);
uint32_t shuffle_xor(uint32_t value, int lane_mask);
// Let the other threads of the block run (inside the emulator's barriers).
void yield();
// A spin-wait's pause (__nanosleep): the thread waits for something outside the block (a signal of
// another rank); the scheduler backs off with short sleeps while every thread only waits.
void pause();
// Nanoseconds of the host's monotonic clock (the emulated global timer).
uint64_t timer_ns();
// The running block's dynamic shared memory (zeroed per block, 16-byte aligned).
unsigned char* dynamic_shared_bytes();

// Run `body` as every thread of every block of a (grid, block) launch; returns when all finished.
// Throws std::runtime_error if the threads of a block stop making progress without waiting on
// anything outside the block (a barrier some thread never reaches).
void run_grid(dim3 grid, dim3 block, size_t shared_bytes, const std::function<void()>& body);
// The order run_grid runs a grid's blocks in: ascending (default) or descending index. A GPU runs them in any
// order and at once; a kernel whose result depends on which block finishes last shows it in one of the two.
void set_block_order(bool reversed);

}  // namespace mep_sim

using mep_sim::dim3;
using mep_sim::int4;
using std::max;
using std::min;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static

#define threadIdx (::mep_sim::thread_index())
#define blockIdx (::mep_sim::block_index())
#define blockDim (::mep_sim::block_dim())
#define gridDim (::mep_sim::grid_dim())

inline void __syncthreads() { mep_sim::sync_threads(); }
inline void __syncwarp(unsigned = 0xffffffffu) { mep_sim::sync_warp(); }
inline unsigned __ballot_sync(unsigned, int predicate) { return mep_sim::ballot(predicate != 0); }
inline int __any_sync(unsigned, int predicate) { return mep_sim::ballot(predicate != 0) != 0; }
inline uint32_t __shfl_xor_sync(unsigned, uint32_t value, int lane_mask) {
    return mep_sim::shuffle_xor(value, lane_mask);
}
inline int __popc(unsigned value) { return __builtin_popcount(value); }
inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __nanosleep(unsigned) { mep_sim::pause(); }
// Round-to-nearest float operations (compiled with -ffp-contract=off: never fused).
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }

inline int atomicCAS(int* addr, int compare, int value) {
    __atomic_compare_exchange_n(addr, &compare, value, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return compare;
}
inline unsigned long long atomicCAS(unsigned long long* addr, unsigned long long compare, unsigned long long value) {
    __atomic_compare_exchange_n(addr, &compare, value, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return compare;
}
inline unsigned atomicAdd(unsigned* addr, unsigned value) {
    return __atomic_fetch_add(addr, value, __ATOMIC_SEQ_CST);
}
inline unsigned atomicExch(unsigned* addr, unsigned value) {
    return __atomic_exchange_n(addr, value, __ATOMIC_SEQ_CST);
}
inline unsigned long long atomicMax(unsigned long long* addr, unsigned long long value) {
    unsigned long long seen = __atomic_load_n(addr, __ATOMIC_SEQ_CST);
    while (seen < value && !__atomic_compare_exchange_n(addr, &seen, value, false, __ATOMIC_SEQ_CST,
                                                        __ATOMIC_SEQ_CST)) {
    }
    return seen;
}

#define MEP_LAUNCH(kernel, grid, block, shared, stream, ...)                                 \
    do {                                                                                     \
        (void)(stream);                                                                      \
        ::mep_sim::run_grid(dim3(grid), dim3(block), (shared), [&] { kernel(__VA_ARGS__); }); \
    } while (0)

namespace mep_cuda {

using Stream = void*;

inline void store_release_sys(uint64_t* addr, uint64_t value) { __atomic_store_n(addr, value, __ATOMIC_RELEASE); }
inline uint64_t load_acquire_sys(const uint64_t* addr) { return __atomic_load_n(addr, __ATOMIC_ACQUIRE); }
inline uint64_t global_timer_ns() { return mep_sim::timer_ns(); }
template <class T>
inline T* dynamic_shared() {
    return reinterpret_cast<T*>(mep_sim::dynamic_shared_bytes());
}
inline void check_launch(const char*) {}

}  // namespace mep_cuda
