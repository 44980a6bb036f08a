// pybind11 bindings of the CUDA data plane: mooncake_ep_switch._cuda. Built by setup.py whenever
// nvcc is found (the kernels and runtime calls are nvcc objects linked with the static CUDA
// runtime); importing it needs no GPU, and device_count() is 0 where there is none. No torch
// linkage: pointers and streams are integers.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "cuda/api.h"
#include "cuda/bindings.h"

namespace py = pybind11;
using namespace pybind11::literals;

PYBIND11_MODULE(_cuda, m) {
    m.doc() = "CUDA data plane of mooncake_ep_switch: device regions over CUDA IPC and the dispatch/combine kernels";
    using release = py::call_guard<py::gil_scoped_release>;

    m.def("device_count", &mep_cuda::device_count, "Devices the CUDA runtime sees (0 with no driver or device).");
    m.def("device_status", &mep_cuda::device_status, "Why device_count() is 0 ('' when devices exist).");
    m.def("current_device", &mep_cuda::current_device, "The calling thread's current CUDA device.");
    m.def("device_alloc", &mep_cuda::device_alloc, "nbytes"_a, "device"_a,
          "cudaMalloc nbytes on `device`, zeroed; returns the address.");
    m.def("device_free", &mep_cuda::device_free, "ptr"_a, "cudaFree.");
    m.def("mapped_host_alloc", &mep_cuda::mapped_host_alloc, "nbytes"_a,
          "Pinned host memory mapped into the device (zeroed); the address is valid on both.");
    m.def("mapped_host_free", &mep_cuda::mapped_host_free, "ptr"_a, "cudaFreeHost.");
    m.def("ipc_handle", [](uintptr_t ptr) { return py::bytes(mep_cuda::ipc_handle(ptr)); }, "ptr"_a,
          "The 64-byte CUDA IPC handle of a cudaMalloc'd allocation.");
    m.def("ipc_open", [](py::bytes handle, int device) { return mep_cuda::ipc_open(std::string(handle), device); },
          "handle"_a, "device"_a, "Map another process's allocation by its IPC handle; returns the address here.");
    m.def("ipc_close", &mep_cuda::ipc_close, "ptr"_a, "Unmap an allocation opened with ipc_open.");
    m.def("allocation_bytes", &mep_cuda::allocation_bytes, "ptr"_a,
          "Bytes from ptr to the end of the device allocation holding it (cuMemGetAddressRange).");
    m.def("copy_to_device", &mep_cuda::copy_to_device, release(), "dst"_a, "src"_a, "nbytes"_a,
          "Synchronous host-to-device copy.");
    m.def("copy_to_host", &mep_cuda::copy_to_host, release(), "dst"_a, "src"_a, "nbytes"_a,
          "Synchronous device-to-host copy.");
    m.def("stream_synchronize", &mep_cuda::stream_synchronize, release(), "stream"_a, "cudaStreamSynchronize.");

    m.def("copy_blocks_async", &mep_cuda::copy_blocks_async, release(), "desc_ptr"_a, "n"_a, "dst_lo"_a, "dst_hi"_a,
          "src_lo"_a, "src_hi"_a, "stream"_a, "device_desc"_a = 0,
          "Queue bounds-checked strided copies [n][6] (dst, src, rows, row_bytes, dst_stride, src_stride) on a "
          "stream (one kernel for n >= 8 when device_desc, device memory for the table, is given); returns the "
          "bytes queued.");
    mep_cuda::bind_kernels(m);
}
