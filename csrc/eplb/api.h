// The EPLB placement functions module.cpp exposes as mooncake_ep_switch._native (the compute loops
// of mooncake_ep_switch/eplb/policy/local_search.py and packing.py). Arrays arrive as integer addresses
// (uintptr_t), already validated by the Python layer.
#pragma once

#include <cstdint>

namespace mep {

// ---- EPLB placement search (eplb/search.cpp) ----
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
// The movement-aware search of eplb/policy/local_search.py for every layer in rows, in place.
void eplb_search(const EplbShape& shape, const EplbArrays& arrays, const EplbSearchParams& params);
// Swap refinement of packed rows (eplb/refine.cpp; eplb/policy/packing.py): experts [B, N, S] int64,
// sizes [B, N, S] float64, pinned [B, N, S] uint8 (all modified), bin_node [N] int64.
void eplb_refine(uintptr_t experts, uintptr_t sizes, uintptr_t pinned, int64_t num_rows, int64_t num_bins,
                 int64_t slots, uintptr_t bin_node, bool sweeps, int64_t descend_steps, int64_t near, int64_t threads);

}  // namespace mep
