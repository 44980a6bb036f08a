// CUDA error checking for the runtime and the launchers (nvcc translation units only).
#pragma once

#include <cuda_runtime.h>

#include <cstring>
#include <stdexcept>
#include <string>

namespace mep_cuda {

inline void check(cudaError_t status, const char* what) {
    if (status != cudaSuccess) {
        cudaGetLastError();  // clear a non-sticky error so the Buffer stays usable
        throw std::runtime_error(std::string(what) + ": " + cudaGetErrorName(status) + " (" +
                                 cudaGetErrorString(status) + ")");
    }
}

// After a launch: a bad configuration or a launch failure is reported here, not later.
inline void check_launch(const char* kernel) { check(cudaGetLastError(), kernel); }

}  // namespace mep_cuda
