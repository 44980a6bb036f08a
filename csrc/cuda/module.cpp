// pybind11 bindings of the CUDA data plane: mooncake_ep_switch._cuda. Built by setup.py whenever
// nvcc is found (the kernels and runtime calls are nvcc objects linked with the static CUDA
// runtime); importing it needs no GPU, and device_count() is 0 where there is none. No torch
// linkage: pointers and streams are integers.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "cuda/api.h"

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
    m.def("copy_to_device", &mep_cuda::copy_to_device, release(), "dst"_a, "src"_a, "nbytes"_a,
          "Synchronous host-to-device copy.");
    m.def("copy_to_host", &mep_cuda::copy_to_host, release(), "dst"_a, "src"_a, "nbytes"_a,
          "Synchronous device-to-host copy.");
    m.def("stream_synchronize", &mep_cuda::stream_synchronize, release(), "stream"_a, "cudaStreamSynchronize.");

    py::class_<mep_cuda::Region>(m, "Region", "Byte offsets of the EP region (docs/protocol.md)")
        .def(py::init([](int64_t control_bytes, int64_t half_bytes, int64_t dispatch_data, int64_t dispatch_scales,
                         int64_t dispatch_src, int64_t combine_data, int64_t dispatch_signals,
                         int64_t combine_signals) {
                 return mep_cuda::Region{control_bytes, half_bytes, dispatch_data, dispatch_scales, dispatch_src,
                                         combine_data, dispatch_signals, combine_signals};
             }),
             "control_bytes"_a, "half_bytes"_a, "dispatch_data"_a, "dispatch_scales"_a, "dispatch_src"_a,
             "combine_data"_a, "dispatch_signals"_a, "combine_signals"_a)
        .def_readonly("half_bytes", &mep_cuda::Region::half_bytes);

    py::class_<mep_cuda::Call>(m, "Call", "One call of one rank (see csrc/cuda/api.h)")
        .def(py::init([](int32_t num_ranks, int32_t rank, int32_t max_tokens, int32_t hidden, int32_t num_experts,
                         int32_t half_index, int64_t host_call, uintptr_t peer_bases, uintptr_t active,
                         uintptr_t counter, uintptr_t call_word, uintptr_t control, uintptr_t dead, int64_t timeout_us,
                         int32_t advance) {
                 return mep_cuda::Call{num_ranks, rank,    max_tokens, hidden,    num_experts, half_index, host_call,
                                       peer_bases, active, counter,    call_word, control,     dead,       timeout_us,
                                       advance};
             }),
             "num_ranks"_a, "rank"_a, "max_tokens"_a, "hidden"_a, "num_experts"_a, "half_index"_a, "host_call"_a,
             "peer_bases"_a, "active"_a, "counter"_a, "call_word"_a, "control"_a, "dead"_a, "timeout_us"_a,
             "advance"_a);

    m.def("dispatch_scratch_bytes", &mep_cuda::dispatch_scratch_bytes, "num_ranks"_a, "max_tokens"_a, "hidden"_a,
          "num_experts"_a, "top_k"_a, "Device scratch bytes of a dispatch shape (both halves).");
    m.def("dispatch_send", &mep_cuda::dispatch_send, release(), "call"_a, "region"_a, "x"_a, "num_tokens"_a,
          "topk_idx"_a, "top_k"_a, "use_fp8"_a, "scratch"_a, "stream"_a,
          "Launch a dispatch's send phase on `stream`.");
    m.def("dispatch_recv", &mep_cuda::dispatch_recv, release(), "call"_a, "region"_a, "use_fp8"_a, "top_k"_a,
          "scratch"_a, "recv_x"_a, "recv_scales"_a, "src_info"_a, "layout_range"_a, "recv_count"_a, "stream"_a,
          "Launch a dispatch's receive phase on `stream`.");
    m.def("combine_send", &mep_cuda::combine_send, release(), "call"_a, "region"_a, "x"_a, "src_info"_a,
          "layout_range"_a, "stream"_a, "Launch a combine's send phase on `stream`.");
    m.def("combine_recv", &mep_cuda::combine_recv, release(), "call"_a, "region"_a, "topk_idx"_a, "topk_weights"_a,
          "num_tokens"_a, "top_k"_a, "out"_a, "stream"_a, "Launch a combine's receive phase on `stream`.");
    m.def("check_values", &mep_cuda::check_values, release(), "topk_idx"_a, "num_tokens"_a, "top_k"_a,
          "num_experts"_a, "active"_a, "num_ranks"_a, "problem"_a, "stream"_a,
          "Launch the value check of a call's routing and mask into `problem` (device int32 [4]).");
}
