// The kernel bindings shared by the CUDA module (`_cuda`, module.cpp) and its host-emulator build
// (`_cuda_sim`, sim.cpp): the same names and arguments, so one Python test drives either.
#pragma once

#include <pybind11/pybind11.h>

#include "cuda/api.h"

namespace mep_cuda {

inline void bind_kernels(pybind11::module_& m) {
    namespace py = pybind11;
    using namespace pybind11::literals;
    using release = py::call_guard<py::gil_scoped_release>;

    py::class_<mep_cuda::Region>(m, "Region", "Byte offsets of the EP region (docs/protocol.md)", py::module_local())
        .def(py::init([](int64_t control_bytes, int64_t half_bytes, int64_t dispatch_data, int64_t dispatch_scales,
                         int64_t dispatch_src, int64_t combine_data, int64_t dispatch_signals,
                         int64_t combine_signals) {
                 return mep_cuda::Region{control_bytes, half_bytes, dispatch_data, dispatch_scales, dispatch_src,
                                         combine_data, dispatch_signals, combine_signals};
             }),
             "control_bytes"_a, "half_bytes"_a, "dispatch_data"_a, "dispatch_scales"_a, "dispatch_src"_a,
             "combine_data"_a, "dispatch_signals"_a, "combine_signals"_a)
        .def_readonly("half_bytes", &mep_cuda::Region::half_bytes);

    py::class_<mep_cuda::Call>(m, "Call", "One call of one rank (see csrc/cuda/api.h)", py::module_local())
        .def(py::init([](int32_t num_ranks, int32_t rank, int32_t max_tokens, int32_t hidden, int32_t num_experts,
                         int32_t half_index, int64_t host_call, uintptr_t peer_bases, uintptr_t active,
                         uintptr_t counter, uintptr_t call_word, uintptr_t control, uintptr_t dead, int64_t timeout_us,
                         int32_t advance, int32_t fused, int32_t row_warps, int32_t grid_blocks) {
                 return mep_cuda::Call{num_ranks, rank,    max_tokens, hidden,    num_experts, half_index, host_call,
                                       peer_bases, active, counter,    call_word, control,     dead,       timeout_us,
                                       advance,    fused,       row_warps,  grid_blocks};
             }),
             "num_ranks"_a, "rank"_a, "max_tokens"_a, "hidden"_a, "num_experts"_a, "half_index"_a, "host_call"_a,
             "peer_bases"_a, "active"_a, "counter"_a, "call_word"_a, "control"_a, "dead"_a, "timeout_us"_a,
             "advance"_a, "fused"_a = 0, "row_warps"_a = 0, "grid_blocks"_a = 0);

    m.def("call_word_size", &mep_cuda::call_word_size, "num_ranks"_a,
          "int64 words of a call's word (the call number, the writable snapshot, the fused kernels' counts).");
    m.def("dispatch_scratch_bytes", &mep_cuda::dispatch_scratch_bytes, "num_ranks"_a, "max_tokens"_a, "hidden"_a,
          "num_experts"_a, "top_k"_a, "Device scratch bytes of a dispatch shape (both halves).");
    // The call path passes everything by position (pybind11 matches keywords by name: microseconds a call) but
    // the flag, which stays keyword-only last (no positional bools at the native boundary).
    m.def(
        "dispatch_send",
        [](const mep_cuda::Call& call, const mep_cuda::Region& region, uintptr_t x, int32_t num_tokens,
           uintptr_t topk_idx, int32_t top_k, uintptr_t scratch, uintptr_t stream, bool use_fp8) {
            mep_cuda::dispatch_send(call, region, x, num_tokens, topk_idx, top_k, use_fp8, scratch, stream);
        },
        release(), "call"_a, "region"_a, "x"_a, "num_tokens"_a, "topk_idx"_a, "top_k"_a, "scratch"_a, "stream"_a,
        py::kw_only(), "use_fp8"_a, "Launch a dispatch's send phase on `stream`.");
    m.def(
        "dispatch_recv",
        [](const mep_cuda::Call& call, const mep_cuda::Region& region, int32_t top_k, uintptr_t scratch,
           uintptr_t recv_x, uintptr_t recv_scales, uintptr_t src_info, uintptr_t layout_range, uintptr_t recv_count,
           uintptr_t stream, bool use_fp8) {
            mep_cuda::dispatch_recv(call, region, use_fp8, top_k, scratch, recv_x, recv_scales, src_info,
                                    layout_range, recv_count, stream);
        },
        release(), "call"_a, "region"_a, "top_k"_a, "scratch"_a, "recv_x"_a, "recv_scales"_a, "src_info"_a,
        "layout_range"_a, "recv_count"_a, "stream"_a, py::kw_only(), "use_fp8"_a,
        "Launch a dispatch's receive phase on `stream`.");
    m.def("combine_send", &mep_cuda::combine_send, release(), "call"_a, "region"_a, "x"_a, "src_info"_a,
          "layout_range"_a, "stream"_a, "Launch a combine's send phase on `stream`.");
    m.def("combine_recv", &mep_cuda::combine_recv, release(), "call"_a, "region"_a, "topk_idx"_a, "topk_weights"_a,
          "num_tokens"_a, "top_k"_a, "out"_a, "stream"_a, "bias0_ptr"_a = 0, "bias1_ptr"_a = 0,
          "bias_stride"_a = 0, "bias_hidden"_a = 0,
          "Launch a combine's receive phase on `stream` (the sums start from the bias rows, 0 = none).");
    m.def("check_values", &mep_cuda::check_values, release(), "topk_idx"_a, "num_tokens"_a, "top_k"_a,
          "num_experts"_a, "active"_a, "num_ranks"_a, "problem"_a, "stream"_a,
          "Launch the value check of a call's routing and mask into `problem` (device int32 [4]).");
}

}  // namespace mep_cuda
