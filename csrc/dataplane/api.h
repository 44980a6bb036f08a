// The data-plane functions module.cpp exposes as mooncake_ep_switch._native: shared-memory regions,
// the one-sided dispatch/combine, the packing kernels (with the collective transport's record
// packers) and the argument value checks. Pointers arrive as integers (uintptr_t) from torch's
// data_ptr(); sizes and strides are in elements unless named *_bytes or *_stride (bytes). See
// docs/protocol.md for the region layout and the ordering rules.
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
// setns(fd, CLONE_NEWNET): move the calling thread into the network namespace `fd` names.
void enter_net_namespace(int64_t fd);
// std::memcpy of nbytes between non-overlapping addresses (the memcpy baseline of the benchmarks).
void copy_bytes(uintptr_t dst, uintptr_t src, int64_t nbytes);
// glibc mallinfo2(): (bytes in use, mmapped chunks included; bytes free inside the arenas).
std::pair<int64_t, int64_t> malloc_bytes();

// ---- one-sided data plane (dataplane.cpp) ----
void dispatch_send(uintptr_t x_ptr, int64_t num_tokens, int64_t hidden, uintptr_t topk_ptr, int64_t top_k,
                   int64_t num_experts, int64_t num_ranks, int64_t rank, int64_t max_tokens, uintptr_t active_ptr,
                   const std::vector<uintptr_t>& peer_half_bases, int64_t tag, bool use_fp8, int64_t dest,
                   bool write_signals, bool by_destination = false, bool compact = false,
                   uintptr_t fp8_rows_ptr = 0, uintptr_t fp8_scales_ptr = 0);

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
                              int64_t top_k, uintptr_t out_ptr, uintptr_t abort_ptr = 0, uintptr_t dead_ptr = 0,
                              uintptr_t bias0_ptr = 0, uintptr_t bias1_ptr = 0, int64_t bias_stride = 0,
                              int64_t bias_hidden = 0);

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
                               uintptr_t abort_ptr = 0, uintptr_t dead_ptr = 0, uintptr_t bias0_ptr = 0,
                               uintptr_t bias1_ptr = 0, int64_t bias_stride = 0, int64_t bias_hidden = 0);

// ---- packing kernels (kernels.cpp) ----
void gather_rows(uintptr_t dst_ptr, int64_t dst_stride, uintptr_t src_ptr, int64_t src_stride, int64_t row_bytes,
                 uintptr_t index_ptr, int64_t n);
void scatter_rows(uintptr_t dst_ptr, int64_t dst_stride, uintptr_t src_ptr, int64_t src_stride, int64_t row_bytes,
                  uintptr_t index_ptr, int64_t n);
void quantize_fp8_rows(uintptr_t src_ptr, int64_t src_stride, uintptr_t index_ptr, int64_t n, int64_t hidden,
                       uintptr_t dst_ptr, uintptr_t scales_ptr);
void scatter_fp8_rows(uintptr_t data_ptr, uintptr_t scales_ptr, int64_t n, int64_t hidden, uintptr_t pos_ptr,
                      uintptr_t recv_x_ptr, uintptr_t recv_scales_ptr, int64_t rows_per_expert);
// bias0_ptr / bias1_ptr (0 = none): bf16 `[num_tokens, bias_hidden]` rows `bias_stride` bytes apart that
// each token's sum starts from (rows.h RowBias); the same in combine_recv and combine_round.
void combine_reduce(uintptr_t out_ptr, int64_t num_tokens, int64_t hidden, int64_t top_k, uintptr_t row_index_ptr,
                    uintptr_t weights_ptr, uintptr_t rows_base_ptr, int64_t row_stride, uintptr_t bias0_ptr = 0,
                    uintptr_t bias1_ptr = 0, int64_t bias_stride = 0, int64_t bias_hidden = 0);

// ---- the ElasticBuffer's rows on host tensors (elastic.cpp) ----
std::vector<int64_t> elastic_pack_rows(uintptr_t x_ptr, int64_t x_bytes, uintptr_t scales_ptr, int64_t scales_bytes,
                                       uintptr_t topk_ptr, int64_t num_tokens, int64_t top_k, int64_t num_experts,
                                       int64_t num_ranks, int64_t rank, int64_t num_bias, uintptr_t weights_ptr,
                                       uintptr_t rows_ptr, int64_t row_bytes, uintptr_t inner_topk_ptr);
void elastic_unpack_rows(uintptr_t rows_ptr, int64_t row_stride, int64_t num_rows, int64_t x_bytes,
                         int64_t scales_bytes, int64_t top_k, int64_t first_expert, int64_t num_local,
                         uintptr_t x_ptr, uintptr_t scales_ptr, uintptr_t local_ptr, uintptr_t weights_ptr,
                         uintptr_t counts_ptr);
// Where the inner dispatch put one slot's rows: layout_words [num_ranks] ((begin << 32) | count per source),
// src_info [R*T] int32 tokens. Returns [0, first, stop] with src_global[0..stop-first) = source * T + token
// when the blocks follow each other in source order and the globals ascend ([0, 0, 0]: no rows);
// [1, ...] a gap or blocks out of order, [2, ...] not ascending, [3, ...] a block past R*T (the caller's
// general path; src_global may be partly written).
std::vector<int64_t> elastic_sources(uintptr_t src_info_ptr, uintptr_t layout_words_ptr, int64_t num_ranks,
                                     int64_t num_max_tokens, uintptr_t src_global_ptr);
// Combine rows: partial_bytes of each partial row, then per top-k entry its 4 float32 weight bytes, each
// written as the bf16 number it is (0 where local[i, k] < 0 or weights_ptr is 0).
void elastic_write_partials(uintptr_t rows_ptr, int64_t row_stride, uintptr_t partial_ptr, int64_t partial_stride,
                            int64_t num_rows, int64_t partial_bytes, uintptr_t weights_ptr, uintptr_t local_ptr,
                            int64_t top_k);
// The inner combine's rows back: x_bytes of each row to x, and (weights_ptr not 0) the 4 * top_k bf16
// numbers after them as bytes (the float32 weights).
void elastic_read_combined(uintptr_t rows_ptr, int64_t row_stride, int64_t num_rows, int64_t x_bytes, int64_t top_k,
                           uintptr_t x_ptr, uintptr_t weights_ptr);

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
