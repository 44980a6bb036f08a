// The host-emulator build of the CUDA kernels: module `_cuda_sim`. ep_kernels.cuh compiled by the
// host compiler on the block/warp emulator of cuda/sim_device.h, bound with the same names and
// arguments as `_cuda`'s kernels. Pointers are host addresses ("device" regions are host memory
// and a rank's peers are other host buffers); streams are ignored (launches run to completion).
// Built on every machine, so CI executes the device-kernel logic against the CPU transport's outputs
// (tests/test_cuda_sim.py).
#include <pybind11/pybind11.h>

#include "cuda/bindings.h"
#include "cuda/copy_kernels.cuh"
#include "cuda/device.h"
#include "cuda/ep_kernels.cuh"

namespace {

// One 16-byte load at `address`, as the kernels' wide accesses do: it traps (SIGILL) unless `address` is
// 16-byte aligned, as the GPU faults (setup.py builds this module with alignment checks that trap).
// tests/test_cuda_sim.py proves the checks are in the build with it.
int64_t load_int4(uintptr_t address) {
    const mep_sim::int4 v = *reinterpret_cast<const mep_sim::int4*>(address);
    return int64_t(v.x) + v.y + v.z + v.w;
}

}  // namespace

PYBIND11_MODULE(_cuda_sim, m) {
    using namespace pybind11::literals;
    m.doc() = "The CUDA dispatch/combine kernels on a host emulator of blocks and warps (tests and CI)";
    mep_cuda::bind_kernels(m);
    m.def("copy_blocks_kernel", [](uintptr_t desc_ptr, int64_t n) {
              if (n < 0) throw std::invalid_argument("n: expected >= 0, got " + std::to_string(n));
              const auto* desc = reinterpret_cast<const int64_t*>(desc_ptr);
              const mep_cuda::CopyTotals totals = mep_cuda::copy_totals(desc, n);
              if (n > 0 && totals.bytes > 0) mep_cuda::launch_copy_blocks(desc, n, totals.max_pieces, nullptr);
              return totals.bytes;
          },
          "desc_ptr"_a, "n"_a,
          "Run the device moves' block-copy kernel (copy_kernels.cuh) on the emulator over the table [n][6] "
          "(dst, src, rows, row_bytes, dst_stride, src_stride) of blocks the caller checked; returns the bytes");
    m.def("set_block_order", &mep_sim::set_block_order, pybind11::kw_only(), "reversed"_a,
          "Run every grid's blocks in descending index order (True) or ascending (False, the default)");
    m.def("load_int4", &load_int4, "address"_a,
          "The sum of the four int32 at `address` (16-byte aligned; any other address traps, as on the GPU)");
}
