// The host-emulator build of the CUDA kernels: module `_cuda_sim`. ep_kernels.cuh compiled by the
// host compiler on the block/warp emulator of cuda/sim_device.h, bound with the same names and
// arguments as `_cuda`'s kernels. Pointers are host addresses ("device" regions are host memory
// and a rank's peers are other host buffers); streams are ignored (launches run to completion).
// Built on every machine, so CI executes the device-kernel logic against the CPU transport's outputs
// (tests/test_cuda_sim.py).
#include <pybind11/pybind11.h>

#include "cuda/bindings.h"
#include "cuda/device.h"
#include "cuda/ep_kernels.cuh"

PYBIND11_MODULE(_cuda_sim, m) {
    m.doc() = "The CUDA dispatch/combine kernels on a host emulator of blocks and warps (tests and CI)";
    mep_cuda::bind_kernels(m);
}
