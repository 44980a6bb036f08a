// The functions module.cpp exposes as mooncake_ep_switch._native. Pointers arrive as integers
// (uintptr_t) from torch's data_ptr(); sizes and strides are in elements unless named *_bytes or
// *_stride (bytes). See docs/protocol.md for the region layout and the ordering rules.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace mep {

// ---- shared memory (shm.cpp) ----
// Anonymous regions (memfd 'mep_region', mode 0600, sealed against resizing): never named, so nothing can be
// left in /dev/shm; region_map_peer maps only such regions.
std::pair<int, uintptr_t> region_create(int64_t nbytes);
uintptr_t region_map_peer(int64_t pid, int64_t fd, int64_t nbytes);
void region_close_fd(int64_t fd);
void region_unmap(uintptr_t base, int64_t nbytes);
// prctl(PR_SET_PDEATHSIG, signal): this process gets `signal` when its parent thread exits (0 = none).
void set_parent_death_signal(int64_t signal);

// ---- one-sided data plane (dataplane.cpp) ----
void dispatch_send(uintptr_t x_ptr, int64_t num_tokens, int64_t hidden, uintptr_t topk_ptr, int64_t top_k,
                   int64_t num_experts, int64_t num_ranks, int64_t rank, int64_t max_tokens, uintptr_t active_ptr,
                   const std::vector<uintptr_t>& peer_half_bases, int64_t tag, bool use_fp8, int64_t dest,
                   bool write_signals, bool by_destination = false, bool compact = false);

std::vector<int> dispatch_recv(uintptr_t local_half_base, int64_t num_ranks, int64_t rank, int64_t max_tokens,
                               int64_t hidden, int64_t num_experts, int64_t tag, uintptr_t active_ptr,
                               int64_t timeout_us, bool use_fp8, uintptr_t recv_x_ptr, uintptr_t recv_scales_ptr,
                               uintptr_t src_info_ptr, uintptr_t layout_range_ptr, uintptr_t recv_count_ptr,
                               uintptr_t abort_ptr = 0, uintptr_t dead_ptr = 0);

void combine_send(uintptr_t x_ptr, int64_t hidden, int64_t num_experts, int64_t num_ranks, int64_t rank,
                  int64_t max_tokens, uintptr_t src_info_ptr, uintptr_t layout_range_ptr, uintptr_t active_ptr,
                  const std::vector<uintptr_t>& peer_half_bases, int64_t tag, int64_t dest, bool write_signals,
                  bool by_destination = false, bool compact = false);

std::vector<int> combine_recv(uintptr_t local_half_base, int64_t num_ranks, int64_t rank, int64_t max_tokens,
                              int64_t hidden, int64_t num_experts, int64_t tag, uintptr_t active_ptr,
                              int64_t timeout_us, uintptr_t topk_ptr, uintptr_t weights_ptr, int64_t num_tokens,
                              int64_t top_k, uintptr_t out_ptr, uintptr_t abort_ptr = 0, uintptr_t dead_ptr = 0);

// dispatch_send(..., dest = -1, write_signals = true) then dispatch_recv(...), in one call.
std::vector<int> dispatch_round(uintptr_t x_ptr, int64_t num_tokens, int64_t hidden, uintptr_t topk_ptr, int64_t top_k,
                                int64_t num_experts, int64_t num_ranks, int64_t rank, int64_t max_tokens,
                                uintptr_t active_ptr, const std::vector<uintptr_t>& peer_half_bases, int64_t tag,
                                bool use_fp8, uintptr_t local_half_base, int64_t timeout_us, uintptr_t recv_x_ptr,
                                uintptr_t recv_scales_ptr, uintptr_t src_info_ptr, uintptr_t layout_range_ptr,
                                uintptr_t recv_count_ptr, uintptr_t abort_ptr = 0, uintptr_t dead_ptr = 0);

// combine_send(..., dest = -1, write_signals = true) then combine_recv(...), in one call.
std::vector<int> combine_round(uintptr_t x_ptr, int64_t hidden, int64_t num_experts, int64_t num_ranks, int64_t rank,
                               int64_t max_tokens, uintptr_t src_info_ptr, uintptr_t layout_range_ptr,
                               uintptr_t active_ptr, const std::vector<uintptr_t>& peer_half_bases, int64_t tag,
                               uintptr_t local_half_base, int64_t timeout_us, uintptr_t topk_ptr,
                               uintptr_t weights_ptr, int64_t num_tokens, int64_t top_k, uintptr_t out_ptr,
                               uintptr_t abort_ptr = 0, uintptr_t dead_ptr = 0);

// ---- packing kernels (kernels.cpp) ----
void gather_rows(uintptr_t dst_ptr, int64_t dst_stride, uintptr_t src_ptr, int64_t src_stride, int64_t row_bytes,
                 uintptr_t index_ptr, int64_t n);
void scatter_rows(uintptr_t dst_ptr, int64_t dst_stride, uintptr_t src_ptr, int64_t src_stride, int64_t row_bytes,
                  uintptr_t index_ptr, int64_t n);
void quantize_fp8_rows(uintptr_t src_ptr, int64_t src_stride, uintptr_t index_ptr, int64_t n, int64_t hidden,
                       uintptr_t dst_ptr, uintptr_t scales_ptr);
void scatter_fp8_rows(uintptr_t data_ptr, uintptr_t scales_ptr, int64_t n, int64_t hidden, uintptr_t pos_ptr,
                      uintptr_t recv_x_ptr, uintptr_t recv_scales_ptr, int64_t rows_per_expert);
void combine_reduce(uintptr_t out_ptr, int64_t num_tokens, int64_t hidden, int64_t top_k, uintptr_t row_index_ptr,
                    uintptr_t weights_ptr, uintptr_t rows_base_ptr, int64_t row_stride);

// ---- collective transport records (kernels.cpp); record format at coll_dispatch_pack there ----
int64_t coll_dispatch_pack(uintptr_t x, int64_t num_tokens, int64_t hidden, uintptr_t topk, int64_t top_k,
                           int64_t num_experts, int64_t num_ranks, int64_t max_tokens, uintptr_t active, bool use_fp8,
                           bool fixed, int64_t rec_size, int64_t meta, uintptr_t send, int64_t send_bytes,
                           uintptr_t tokens_to, uintptr_t pairs_to, uintptr_t row_index);
int64_t coll_dispatch_unpack(uintptr_t recv, int64_t recv_bytes, int64_t num_ranks, int64_t max_tokens, int64_t hidden,
                             int64_t num_local, int64_t rec_size, int64_t meta, bool fixed, uintptr_t recv_tokens,
                             uintptr_t accepted_by, uintptr_t accept, bool use_fp8, uintptr_t recv_x,
                             uintptr_t recv_scales, uintptr_t src_info, uintptr_t layout_range, uintptr_t recv_count,
                             uintptr_t rows_to_rank);
int64_t coll_combine_pack(uintptr_t x, int64_t hidden, int64_t num_local, int64_t num_ranks, int64_t max_tokens,
                          uintptr_t layout_range, uintptr_t send, int64_t send_rows);

// ---- argument value checks (validate.cpp); empty string = valid ----
std::string check_topk_values(uintptr_t topk_ptr, int64_t num_tokens, int64_t top_k, int64_t num_experts);
std::string check_mask_values(uintptr_t mask_ptr, int64_t n);
// Both of the above in one call (the hot path of dispatch/combine): "" when valid, else the full
// message starting with the argument's name ("topk_idx: expected ..." or "active_ranks: expected ...").
std::string check_call_values(uintptr_t topk_ptr, int64_t num_tokens, int64_t top_k, int64_t num_experts,
                              uintptr_t mask_ptr, int64_t num_ranks);

}  // namespace mep

namespace mep {

// ---- switch helpers (switch_ops.cpp) ----
// Copy blocks described by int64 [n][6] = (dst, src, rows, row_bytes, dst_stride, src_stride):
// row r of a block goes from src + r*src_stride to dst + r*dst_stride. Every block is checked to lie
// inside [dst_lo, dst_hi) and [src_lo, src_hi) before anything is written (ValueError otherwise).
void copy_blocks(uintptr_t desc_ptr, int64_t n, uintptr_t dst_lo, uintptr_t dst_hi, uintptr_t src_lo,
                 uintptr_t src_hi);
// Wait until every word satisfies its expectation (mode 0: same tag, i.e. high 32 bits equal;
// mode 1: value >= expected), with one deadline (-1 = none) and the shared backoff. Returns the
// indices still unsatisfied at the deadline (empty when all arrived).
std::vector<int64_t> wait_words(const std::vector<uintptr_t>& addrs, const std::vector<uint64_t>& expected,
                                int64_t mode, int64_t timeout_us);
// Populate the page tables of a mapped range for writing (MADV_POPULATE_WRITE, or touching pages).
void prefault(uintptr_t base, int64_t nbytes);
// Release-store a signal word and wake every wait_words() sleeping on it (any process).
void signal_publish(uintptr_t addr, uint64_t value);
// Compare-and-set a signal word (sequentially consistent, works across processes on a shared
// mapping): store `desired` only if the word equals `expected`; wake its waiters on success.
// Returns the value the word held before (== expected iff this call stored).
uint64_t signal_cas(uintptr_t addr, uint64_t expected, uint64_t desired);

// ---- EPLB placement search (eplb_search.cpp) ----
// One placement problem's shape: slot s on GPU s / (num_replicas / num_gpus), GPU g on node
// g / gpus_per_node (node 0 for all when not hierarchical).
struct EplbShape {
    int64_t num_logical, num_replicas, num_gpus, gpus_per_node;
    bool hierarchical;
};
// Arrays (validated by the Python layer): weight [L, E] float64, experts [L, R] int64,
// counts [L, E] int64, pinned [L, R] uint8 (all three modified), start [L, R] int64 or 0,
// rows [num_rows] int64, peak_limit / item_limit [L] float64, budget [L] int64 or 0.
struct EplbArrays {
    uintptr_t weight, experts, counts, pinned, start, rows;
    int64_t num_rows;
    uintptr_t peak_limit, item_limit, budget;
};
// Which phases run: split large copies, relieve nodes, revert unneeded moves (with a start
// table); node relief (hierarchical) aims at node_margin of the node
// target, `retries` more rounds 0.5 % lower each), and the local search (`max_steps` moves,
// `near` light partner GPUs, swaps only at slot positions >= swap_from, the `heavy` heaviest GPUs
// tried in turn when the heaviest has no move), on up to `threads` threads
// (layers are independent: the result does not depend on the thread count).
struct EplbSearchParams {
    bool split, relieve, revert;
    double node_margin;
    int64_t retries, max_steps, near, swap_from, heavy, threads;
};
// The movement-aware search of eplb/local_search.py for every layer in rows, in place.
void eplb_search(const EplbShape& shape, const EplbArrays& arrays, const EplbSearchParams& params);
// Swap refinement of packed rows (eplb_refine.cpp; eplb/packing.py): experts [B, N, S] int64,
// sizes [B, N, S] float64, pinned [B, N, S] uint8 (all modified), bin_node [N] int64.
void eplb_refine(uintptr_t experts, uintptr_t sizes, uintptr_t pinned, int64_t num_rows, int64_t num_bins,
                 int64_t slots, uintptr_t bin_node, bool sweeps, int64_t descend_steps, int64_t near, int64_t threads);

}  // namespace mep
