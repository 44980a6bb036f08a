// Python bindings: mooncake_ep_switch._native.
//
// Pointers are Python ints (torch's data_ptr()). Every data-plane and packing call releases the
// GIL after its arguments are converted (py::call_guard), so ranks simulated by threads, the
// engine and the transports' progress threads keep running while a call copies or waits.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "dataplane/api.h"
#include "eplb/api.h"
#include "switch/api.h"
#include "common/mep_common.h"
#include "sockets/inbound_reaper.h"

namespace py = pybind11;
using namespace pybind11::literals;

namespace {

// Memory mapped by the package (a region or a peer's), lent to Python objects through the buffer protocol.
struct MappedBytes {
    uintptr_t address;
    int64_t nbytes;
    py::object owner;
};

py::dict region_layout_dict(int64_t num_ranks, int64_t max_tokens, int64_t hidden, int64_t num_experts) {
    const mep::Layout lay = mep::compute_layout(num_ranks, max_tokens, hidden, num_experts);
    py::dict d;
    d["control_bytes"] = lay.control_bytes;
    d["half_bytes"] = lay.half_bytes;
    d["total_bytes"] = lay.total_bytes;
    d["row_bytes"] = lay.row_bytes;
    d["num_local_experts"] = lay.num_local_experts;
    d["num_scale_groups"] = lay.num_scale_groups;
    d["dispatch_data"] = lay.dispatch_data;
    d["dispatch_scales"] = lay.dispatch_scales;
    d["dispatch_src"] = lay.dispatch_src;
    d["combine_data"] = lay.combine_data;
    d["dispatch_signals"] = lay.dispatch_signals;
    d["combine_signals"] = lay.combine_signals;
    d["combine_send"] = lay.combine_send;
    return d;
}

void* checked_signal_addr(uintptr_t addr) {
    if (addr == 0 || addr % 8 != 0) {
        throw std::invalid_argument("signal address " + std::to_string(addr) + " must be nonzero and 8-byte aligned");
    }
    return reinterpret_cast<void*>(addr);
}

void signal_store(uintptr_t addr, uint64_t value) { mep::store_release(checked_signal_addr(addr), value); }

uint64_t signal_load(uintptr_t addr) { return mep::load_acquire(checked_signal_addr(addr)); }

}  // namespace

PYBIND11_MODULE(_native, m) {
    m.doc() = "Native core of mooncake_ep_switch: region layout, POSIX shared memory, the one-sided "
              "dispatch/combine data plane of docs/protocol.md, and packing kernels.";
    using release = py::call_guard<py::gil_scoped_release>;

    m.attr("CONTROL_BYTES") = mep::kControlBytes;

    m.def("region_layout", &region_layout_dict, "num_ranks"_a, "num_max_dispatch_tokens_per_rank"_a, "hidden"_a,
          "num_experts"_a,
          "Byte layout of an EP region for a call shape (offsets relative to a half), as a dict of ints.");

    // ---- shared memory ----
    m.def("region_create", &mep::region_create, "nbytes"_a,
          "Create an anonymous 0600 shared region (memfd 'mep_region', sealed against shrinking and growing) "
          "of nbytes, mapped; returns (fd, base).");
    m.def("region_map_peer", &mep::region_map_peer, "pid"_a, "fd"_a, "nbytes"_a,
          "Map a peer's region through /proc/<pid>/fd/<fd>; returns the base address. Only a region made by "
          "region_create (a memfd 'mep_region' sealed against resizing) of exactly nbytes is mapped: anything "
          "else raises ValueError naming the path and what was found; a missing pid/fd raises FileNotFoundError.");
    m.def("region_close_fd", &mep::region_close_fd, "fd"_a, "Close a region's file descriptor.");
    m.def("region_unmap", &mep::region_unmap, "base"_a, "nbytes"_a,
          "Unmap a mapping made by region_create/region_map_peer.");
    m.def("set_parent_death_signal", &mep::set_parent_death_signal, "signal"_a,
          "prctl(PR_SET_PDEATHSIG, signal): this process gets the signal when its parent exits (0 = none).");
    py::class_<mep::InboundReaper>(m, "InboundReaper",
        "Shut down this process's accepted TCP connections on local `port` every `period_s` from a native "
        "thread, until stop() or `max_s` (used while a Transfer Engine is destroyed: its handshake listener "
        "blocks on them).")
        .def(py::init<int64_t, double, double, double>(), "port"_a, "period_s"_a, "max_s"_a, py::kw_only(),
             "report_after_s"_a = 0.0)
        .def("stop", &mep::InboundReaper::stop, py::call_guard<py::gil_scoped_release>(),
             "End the scans and join the thread; returns how many sockets were shut down.")
        .def_property_readonly("aborted", &mep::InboundReaper::aborted)
        .def_property_readonly("reported", &mep::InboundReaper::reported,
                               "Whether the still-running report went to stderr (after report_after_s).");
    m.def("thread_report", &mep::thread_report, py::call_guard<py::gil_scoped_release>(), "max_threads"_a = 256,
          "What each thread of this process waits in, one line each (tid name wchan syscall), from /proc/self/task.");
    m.def("shutdown_inbound", &mep::shutdown_inbound, py::call_guard<py::gil_scoped_release>(), "port"_a,
          "Shut down this process's TCP connections on local `port` (not its listening socket); returns how many.");
    m.def("enter_net_namespace", &mep::enter_net_namespace, "fd"_a,
          "setns(fd, CLONE_NEWNET): move the calling thread into the network namespace an open fd names.");
    m.def("copy_bytes", &mep::copy_bytes, py::call_guard<py::gil_scoped_release>(), "dst"_a, "src"_a, "nbytes"_a,
          "std::memcpy(dst, src, nbytes) between non-overlapping addresses of this process.");
    m.def("malloc_bytes", &mep::malloc_bytes,
          "glibc malloc of this process: (bytes in use, mmapped chunks included; bytes free inside the arenas).");
    py::class_<MappedBytes>(m, "MappedBytes", py::buffer_protocol(),
                            "nbytes of writable memory at an address, exposed through the buffer protocol (no copy); "
                            "holds `owner` (the object that keeps the memory mapped) as long as it lives.")
        .def(py::init([](uintptr_t address, int64_t nbytes, py::object owner) {
                 if (address == 0) throw std::invalid_argument("address must be nonzero");
                 if (nbytes <= 0) throw std::invalid_argument("nbytes must be > 0, got " + std::to_string(nbytes));
                 return MappedBytes{address, nbytes, std::move(owner)};
             }),
             "address"_a, "nbytes"_a, "owner"_a = py::none())
        .def_readonly("owner", &MappedBytes::owner)
        .def_buffer([](MappedBytes& b) {
            return py::buffer_info(reinterpret_cast<void*>(b.address), 1, py::format_descriptor<uint8_t>::format(), 1,
                                   {static_cast<py::ssize_t>(b.nbytes)}, {static_cast<py::ssize_t>(1)}, false);
        });

    // ---- signals ----
    m.def("signal_store", &signal_store, "addr"_a, "value"_a, "Release-store a uint64 at an 8-aligned address.");
    m.def("signal_load", &signal_load, "addr"_a, "Acquire-load a uint64 from an 8-aligned address.");

    // ---- data plane ----
    // ---- argument value checks (read only; "" when valid, else what was expected and found) ----
    m.def("check_topk_values", &mep::check_topk_values, "topk_ptr"_a, "num_tokens"_a, "top_k"_a, "num_experts"_a,
          "Check int64 [num_tokens, top_k] expert ids: in [-1, num_experts), no expert twice in a row.");
    m.def("check_mask_values", &mep::check_mask_values, "mask_ptr"_a, "n"_a,
          "Check an int32 [n] rank mask holds only 0 and 1.");
    m.def("check_call_values", &mep::check_call_values, "topk_ptr"_a, "num_tokens"_a, "top_k"_a, "num_experts"_a,
          "mask_ptr"_a, "num_ranks"_a,
          "check_topk_values then check_mask_values; \"\" when valid, else the message naming the argument.");

    m.def("dispatch_send", &mep::dispatch_send, release(), "x_ptr"_a, "num_tokens"_a, "hidden"_a, "topk_ptr"_a,
          "top_k"_a, "num_experts"_a, "num_ranks"_a, "rank"_a, "num_max_dispatch_tokens_per_rank"_a, "active_ptr"_a,
          "peer_half_bases"_a, "tag"_a, py::kw_only(), "use_fp8"_a, "dest"_a = -1, "write_signals"_a = true,
          "by_destination"_a = false, "compact"_a = false, "fp8_rows_ptr"_a = 0, "fp8_scales_ptr"_a = 0,
          "Write this rank's tokens into every active destination's half, then its dispatch signals. With "
          "by_destination, destination d's rows and signals go to source column d instead of this rank's "
          "(a staging copy holding every destination at once). With compact, each token goes once per "
          "destination with its per-expert token lists beside it, and the signals say so (protocol.md). "
          "With use_fp8 and fp8_rows_ptr / fp8_scales_ptr ([num_tokens, H] e4m3fn, [num_tokens, H/128] "
          "float32, as quantize_fp8_rows writes them), the rows are taken from there instead of being "
          "quantized again (one quantization for several sends of one dispatch).");
    m.def("dispatch_recv", &mep::dispatch_recv, release(), "local_half_base"_a, "num_ranks"_a, "rank"_a,
          "num_max_dispatch_tokens_per_rank"_a, "hidden"_a, "num_experts"_a, "tag"_a, "active_ptr"_a,
          "timeout_us"_a, py::kw_only(), "use_fp8"_a, "recv_x_ptr"_a, "recv_scales_ptr"_a, "src_info_ptr"_a,
          "layout_range_ptr"_a,
          "recv_count_ptr"_a, "abort_ptr"_a = 0, "dead_ptr"_a = 0,
          "Wait for every active source's dispatch signals (one deadline), pack the received rows; "
          "returns the ranks newly marked inactive. A non-zero 8-byte word at abort_ptr (0 = none) ends "
          "the wait with RuntimeError; a non-zero int32 dead_ptr[p] (0 = no array) marks a source whose signals "
          "are not all there inactive at once.");
    m.def("combine_send", &mep::combine_send, release(), "x_ptr"_a, "hidden"_a, "num_experts"_a, "num_ranks"_a,
          "rank"_a, "num_max_dispatch_tokens_per_rank"_a, "src_info_ptr"_a, "layout_range_ptr"_a, "active_ptr"_a,
          "peer_half_bases"_a, "tag"_a, py::kw_only(), "dest"_a = -1, "write_signals"_a = true,
          "by_destination"_a = false, "compact"_a = false,
          "Return expert outputs to the token owners' combine_data, then their combine signals. With "
          "by_destination, owner s's rows and signals go to expert block s instead of this rank's (a "
          "staging copy holding every owner at once). With compact, each owner's rows go behind each "
          "other (only the routed rows, one contiguous range) and the signals say so (protocol.md).");
    m.def("combine_recv", &mep::combine_recv, release(), "local_half_base"_a, "num_ranks"_a, "rank"_a,
          "num_max_dispatch_tokens_per_rank"_a, "hidden"_a, "num_experts"_a, "tag"_a, "active_ptr"_a,
          "timeout_us"_a, "topk_ptr"_a, "weights_ptr"_a, "num_tokens"_a, "top_k"_a, "out_ptr"_a, "abort_ptr"_a = 0,
          "dead_ptr"_a = 0, "bias0_ptr"_a = 0, "bias1_ptr"_a = 0, "bias_stride"_a = 0, "bias_hidden"_a = 0,
          "Wait for the combine signal of every expert of every active owner, then reduce; returns the "
          "ranks newly marked inactive. A non-zero 8-byte word at abort_ptr (0 = none) ends the wait with "
          "RuntimeError; a non-zero int32 dead_ptr[p] (0 = no array) marks an owner whose signals are not "
          "all there inactive at once. bias0_ptr / bias1_ptr (0 = none): bf16 [num_tokens, bias_hidden] "
          "rows bias_stride bytes apart that each token's fp32 sum starts from (weight 1, bias 0 first).");

    m.def("dispatch_round", &mep::dispatch_round, release(), "x_ptr"_a, "num_tokens"_a, "hidden"_a, "topk_ptr"_a,
          "top_k"_a, "num_experts"_a, "num_ranks"_a, "rank"_a, "num_max_dispatch_tokens_per_rank"_a, "active_ptr"_a,
          "peer_half_bases"_a, "tag"_a, py::kw_only(), "use_fp8"_a, "local_half_base"_a, "timeout_us"_a, "recv_x_ptr"_a,
          "recv_scales_ptr"_a, "src_info_ptr"_a, "layout_range_ptr"_a, "recv_count_ptr"_a, "abort_ptr"_a = 0,
          "dead_ptr"_a = 0, "A synchronous dispatch: dispatch_send to every destination, then dispatch_recv; returns the ranks "
          "newly marked inactive.");
    m.def("combine_round", &mep::combine_round, release(), "x_ptr"_a, "hidden"_a, "num_experts"_a, "num_ranks"_a,
          "rank"_a, "num_max_dispatch_tokens_per_rank"_a, "src_info_ptr"_a, "layout_range_ptr"_a, "active_ptr"_a,
          "peer_half_bases"_a, "tag"_a, "local_half_base"_a, "timeout_us"_a, "topk_ptr"_a, "weights_ptr"_a,
          "num_tokens"_a, "top_k"_a, "out_ptr"_a, "abort_ptr"_a = 0, "dead_ptr"_a = 0, "bias0_ptr"_a = 0,
          "bias1_ptr"_a = 0, "bias_stride"_a = 0, "bias_hidden"_a = 0,
          "A synchronous combine: combine_send to every destination, then combine_recv (its bias "
          "arguments too); returns the ranks newly marked inactive.");

    // ---- packing kernels ----
    m.def("gather_rows", &mep::gather_rows, release(), "dst_ptr"_a, "dst_stride"_a, "src_ptr"_a, "src_stride"_a,
          "row_bytes"_a, "index_ptr"_a, "n"_a, "dst row i = src row index[i] (strides in bytes, int64 index).");
    m.def("scatter_rows", &mep::scatter_rows, release(), "dst_ptr"_a, "dst_stride"_a, "src_ptr"_a, "src_stride"_a,
          "row_bytes"_a, "index_ptr"_a, "n"_a, "dst row index[i] = src row i (strides in bytes, int64 index).");
    m.def("quantize_fp8_rows", &mep::quantize_fp8_rows, release(), "src_ptr"_a, "src_stride"_a, "index_ptr"_a,
          "n"_a, "hidden"_a, "dst_ptr"_a, "scales_ptr"_a,
          "Quantize bf16 rows (index[i], or i if index_ptr is 0) to e4m3fn [n, H] + float32 scales [n, H/128].");
    m.def("scatter_fp8_rows", &mep::scatter_fp8_rows, release(), "data_ptr"_a, "scales_ptr"_a, "n"_a, "hidden"_a,
          "pos_ptr"_a, "recv_x_ptr"_a, "recv_scales_ptr"_a, "rows_per_expert"_a,
          "Place compact FP8 rows at flat positions of the packed layout with token-contiguous scales.");
    m.def("combine_reduce", &mep::combine_reduce, release(), "out_ptr"_a, "num_tokens"_a, "hidden"_a, "top_k"_a,
          "row_index_ptr"_a, "weights_ptr"_a, "rows_base_ptr"_a, "row_stride"_a, "bias0_ptr"_a = 0,
          "bias1_ptr"_a = 0, "bias_stride"_a = 0, "bias_hidden"_a = 0,
          "out[t] = bf16(bias0[t] + bias1[t] + sum_k in order of w[t,k] * row(row_index[t,k])), -1 "
          "skipped, fp32, no FMA; bias0_ptr / bias1_ptr 0 = none, each [num_tokens, bias_hidden] bf16.");
    // ---- the ElasticBuffer's rows on host tensors (dataplane/elastic.cpp) ----
    m.def("elastic_pack_rows", &mep::elastic_pack_rows, release(), "x_ptr"_a, "x_bytes"_a, "scales_ptr"_a,
          "scales_bytes"_a, "topk_ptr"_a, "num_tokens"_a, "top_k"_a, "num_experts"_a, "num_ranks"_a, "rank"_a,
          "num_bias"_a, "weights_ptr"_a, "rows_ptr"_a, "row_bytes"_a, "inner_topk_ptr"_a,
          "Check int64 top-k ids (in [-1, E), none twice in a row), then write each token's inner routing "
          "[num_bias + min(K, R)] int64 and its dispatch row [x | scales | ids int32 | weights f32 (0 if "
          "weights_ptr is 0) | zeros] of row_bytes. Returns [0, -1], or [1, row] (an id out of range) / "
          "[2, row] (an id twice) with nothing written.");
    m.def("elastic_unpack_rows", &mep::elastic_unpack_rows, release(), "rows_ptr"_a, "row_stride"_a, "num_rows"_a,
          "x_bytes"_a, "scales_bytes"_a, "top_k"_a, "first_expert"_a, "num_local"_a, "x_ptr"_a, "scales_ptr"_a,
          "local_ptr"_a, "weights_ptr"_a, "counts_ptr"_a,
          "Split received dispatch rows: the token bytes, scale bytes, top-k ids made local (int64, -1 "
          "outside [first_expert, first_expert + num_local)), weight bytes; counts[j] (int64) = entries "
          "of local expert j.");
    m.def("elastic_sources", &mep::elastic_sources, release(), "src_info_ptr"_a, "layout_words_ptr"_a, "num_ranks"_a,
          "num_max_tokens"_a, "src_global_ptr"_a,
          "Where the inner dispatch put one slot's rows: [0, first, stop] with src_global (int64) = source * T "
          "+ token, when the blocks follow each other in source order and ascend; [1|2|3, ...] otherwise.");
    m.def("elastic_write_partials", &mep::elastic_write_partials, release(), "rows_ptr"_a, "row_stride"_a,
          "partial_ptr"_a, "partial_stride"_a, "num_rows"_a, "partial_bytes"_a, "weights_ptr"_a, "local_ptr"_a,
          "top_k"_a,
          "Combine rows: each partial's bytes, then its float32 weight bytes as bf16 numbers (0 where the "
          "local id is -1 or weights_ptr is 0).");
    m.def("elastic_read_combined", &mep::elastic_read_combined, release(), "rows_ptr"_a, "row_stride"_a,
          "num_rows"_a, "x_bytes"_a, "top_k"_a, "x_ptr"_a, "weights_ptr"_a,
          "The inner combine's rows: the token bytes, and the weight numbers after them as bytes.");
    // ---- collective transport records (dataplane/kernels.cpp) ----
    m.def("coll_dispatch_pack", &mep::coll_dispatch_pack, release(), "x"_a, "num_tokens"_a, "hidden"_a, "topk"_a,
          "top_k"_a, "num_experts"_a, "num_ranks"_a, "max_tokens"_a, "active"_a, py::kw_only(), "use_fp8"_a, "fixed"_a,
          "rec_size"_a, "meta"_a, "send"_a, "send_bytes"_a, "tokens_to"_a, "pairs_to"_a, "row_index"_a,
          "Write this rank's dispatch records into send; returns the number of records.");
    m.def("coll_dispatch_unpack", &mep::coll_dispatch_unpack, release(), "recv"_a, "recv_bytes"_a, "num_ranks"_a,
          "max_tokens"_a, "hidden"_a, "num_local"_a, "rec_size"_a, "meta"_a, py::kw_only(), "fixed"_a, "recv_tokens"_a,
          "accepted_by"_a, "accept"_a, "use_fp8"_a, "recv_x"_a, "recv_scales"_a, "src_info"_a, "layout_range"_a,
          "recv_count"_a, "rows_to_rank"_a,
          "Validate received records and pack them into the dispatch outputs; returns the rows packed.");
    m.def("coll_combine_pack", &mep::coll_combine_pack, release(), "x"_a, "hidden"_a, "num_local"_a, "num_ranks"_a,
          "max_tokens"_a, "layout_range"_a, "send"_a, "send_rows"_a,
          "Copy the expert outputs each source gets back into send (by source, local expert, token).");
    // ---- switch helpers (switch/switch_ops.cpp) ----
    m.def("copy_blocks", &mep::copy_blocks, release(), "desc_ptr"_a, "n"_a, "dst_lo"_a, "dst_hi"_a, "src_lo"_a,
          "src_hi"_a,
          "Copy int64 [n][6] blocks (dst, src, rows, row_bytes, dst_stride, src_stride), each checked to lie in "
          "[dst_lo, dst_hi) and [src_lo, src_hi) before anything is written.");
    m.def("wait_words", &mep::wait_words, release(), "addrs"_a, "expected"_a, "mode"_a, "timeout_us"_a,
          "Wait until every uint64 word matches (mode 0: same tag in the high 32 bits; mode 1: >= expected) "
          "with one deadline (-1 = none); returns the indices still unmatched.");
    m.def(
        "kv_peer_blocks",
        [](uintptr_t moves_ptr, int64_t num_moves, int64_t rank, int64_t num_ranks, const std::vector<int64_t>& peers,
           const std::vector<uint64_t>& pool_bases, const std::vector<int64_t>& geometry, uintptr_t out_ptr,
           int64_t capacity, uintptr_t bounds_ptr, bool sending) {
            if (geometry.size() != 8) {
                mep::throw_value_error("kv_peer_blocks: geometry has " + std::to_string(geometry.size()) +
                                       " entries, expected 8 (num_units, unit_bytes, heads, head_bytes, page_size, "
                                       "token_bytes, planes, plane_bytes)");
            }
            const mep::KVBlockGeometry g{geometry[0], geometry[1], geometry[2], geometry[3],
                                         geometry[4], geometry[5], geometry[6], geometry[7]};
            return mep::kv_peer_blocks(moves_ptr, num_moves, rank, num_ranks, peers, pool_bases, g, out_ptr, capacity,
                                       bounds_ptr, sending);
        },
        release(), "moves_ptr"_a, "num_moves"_a, "rank"_a, "num_ranks"_a, "peers"_a, "pool_bases"_a, "geometry"_a,
        "out_ptr"_a, "capacity"_a, "bounds_ptr"_a, py::kw_only(), "sending"_a,
        "The copy blocks of the KV moves [num_moves][5] that rank sends (or receives), grouped by peer in the order "
        "of peers, into out [capacity][6] and each group's bounds into bounds [len(peers) + 1]; returns the blocks.");
    m.def("prefault", &mep::prefault, release(), "base"_a, "nbytes"_a,
          "Populate the page tables of a mapped range for writing.");
    // ---- EPLB placement search and refinement (eplb/search.cpp, eplb/refine.cpp) ----
    m.def(
        "eplb_search",
        [](int64_t num_logical, int64_t num_replicas, int64_t num_gpus, int64_t gpus_per_node, bool hierarchical,
           uintptr_t weight, uintptr_t experts, uintptr_t counts, uintptr_t pinned, uintptr_t start, uintptr_t rows,
           int64_t num_rows, uintptr_t peak_limit, uintptr_t item_limit, uintptr_t budget, bool split, bool relieve, bool revert,
           double node_margin, int64_t retries, int64_t max_steps, int64_t near, int64_t swap_from, int64_t heavy, int64_t threads) {
            mep::eplb_search({num_logical, num_replicas, num_gpus, gpus_per_node, hierarchical},
                             {weight, experts, counts, pinned, start, rows, num_rows, peak_limit, item_limit, budget},
                             {split, relieve, revert, node_margin, retries, max_steps, near, swap_from, heavy, threads});
        },
        release(), "num_logical"_a, "num_replicas"_a, "num_gpus"_a, "gpus_per_node"_a, py::kw_only(), "hierarchical"_a,
        "weight"_a,
        "experts"_a, "counts"_a, "pinned"_a, "start"_a, "rows"_a, "num_rows"_a, "peak_limit"_a, "item_limit"_a,
        "budget"_a, "split"_a, "relieve"_a, "revert"_a, "node_margin"_a, "retries"_a, "max_steps"_a, "near"_a, "swap_from"_a, "heavy"_a, "threads"_a,
        "The EPLB movement-aware search for the layers in rows, in place (arrays validated by "
        "eplb/policy/local_search.py; start and budget may be 0 for none).");
    m.def("eplb_refine", &mep::eplb_refine, release(), "experts"_a, "sizes"_a, "pinned"_a, "num_rows"_a,
          "num_bins"_a, "slots"_a, "bin_node"_a, py::kw_only(), "sweeps"_a, "descend_steps"_a, "near"_a, "threads"_a,
          "Swap-refine packed rows in place: group sweeps (if sweeps), then descent of the heaviest bin "
          "(arrays validated by eplb/policy/packing.py).");
    m.def("signal_publish", &mep::signal_publish, "addr"_a, "value"_a,
          "Release-store a uint64 signal word and wake every wait_words() sleeping on it.");
}
