// The CUDA build of the dispatch/combine kernels (module `_cuda`): the kernels themselves are in
// ep_kernels.cuh, shared with the host emulator build (sim.cpp, module `_cuda_sim`).
#include "cuda/device.h"
#include "cuda/ep_kernels.cuh"
