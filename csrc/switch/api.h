// The switch functions module.cpp exposes as mooncake_ep_switch._native (runtime TP<->EP switching,
// mooncake_ep_switch/switch/). Pointers arrive as integers (uintptr_t).
#pragma once

#include <cstdint>
#include <vector>

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
// The geometry of a paged KV pool's copy blocks (switch/kv_cache.py): a unit is `heads` heads of one page,
// `head_bytes` apart; a head's page holds `page_size` token rows of `token_bytes`; `planes` (layers x K/V)
// repeat the units at `plane_bytes`.
struct KVBlockGeometry {
    int64_t num_units, unit_bytes, heads, head_bytes, page_size, token_bytes, planes, plane_bytes;
};
// The copy blocks of the KV moves int64 [num_moves][5] (src_rank, src_unit, dst_rank, dst_unit, filled) that
// `rank` sends (`sending`) or receives, for the ranks `peers` only and grouped in that order (the moves' own
// order within a peer): one block a head, (dst, src, planes, filled * token_bytes, plane_bytes, plane_bytes), each
// side's unit in the pool at `pool_bases[that side's rank]`. Writes the blocks into out [capacity][6] and the groups'
// bounds into bounds [peers + 1]; returns the blocks. The geometry and every move used are checked first
// (ValueError: nothing written).
int64_t kv_peer_blocks(uintptr_t moves_ptr, int64_t num_moves, int64_t rank, int64_t num_ranks,
                       const std::vector<int64_t>& peers, const std::vector<uint64_t>& pool_bases,
                       const KVBlockGeometry& geometry, uintptr_t out_ptr, int64_t capacity, uintptr_t bounds_ptr,
                       bool sending);
// Release-store a signal word and wake every wait_words() sleeping on it (any process).
void signal_publish(uintptr_t addr, uint64_t value);

}  // namespace mep
