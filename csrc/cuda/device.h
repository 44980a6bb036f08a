// What differs between the two builds of ep_kernels.cuh: under nvcc the CUDA launch, the PTX
// memory-model helpers, the GPU's global timer and dynamic shared memory; under a host compiler
// the block/warp emulator of cuda/sim_device.h (which CI runs on machines without a GPU).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)

#include <cuda_runtime.h>

#include "cuda/check.h"

// Launch `kernel` on `stream` and report a bad configuration at once.
#define MEP_LAUNCH(kernel, grid, block, shared, stream, ...)                \
    do {                                                                    \
        kernel<<<(grid), (block), (shared), (stream)>>>(__VA_ARGS__);       \
        ::mep_cuda::check_launch(#kernel);                                  \
    } while (0)

namespace mep_cuda {

using Stream = cudaStream_t;

// Release store at system scope: every write this thread made before is visible to a reader on
// any device or process that observes the value with an acquire load.
__device__ __forceinline__ void store_release_sys(uint64_t* addr, uint64_t value) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(addr), "l"(value) : "memory");
}

__device__ __forceinline__ uint64_t load_acquire_sys(const uint64_t* addr) {
    uint64_t value;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(addr) : "memory");
    return value;
}

// Nanoseconds of the GPU's global timer (what the per-source deadlines are measured on).
__device__ __forceinline__ uint64_t global_timer_ns() {
    uint64_t now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    return now;
}

// The block's dynamic shared memory (the launch's `shared` bytes), 16-byte aligned.
template <class T>
__device__ __forceinline__ T* dynamic_shared() {
    extern __shared__ __align__(16) unsigned char mep_dynamic_shared[];
    return reinterpret_cast<T*>(mep_dynamic_shared);
}

}  // namespace mep_cuda

#else

#include "cuda/sim_device.h"

#endif
