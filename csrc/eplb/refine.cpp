// Swap refinement of a packed placement (mooncake_ep_switch/eplb/policy/packing.py documents it): bins
// (GPUs, or nodes when packing groups) of `slots` items each, items = (expert, size, pinned).
// Per row, independently (rows on up to `threads` threads; the result does not depend on it):
//   group sweeps: the i-th of the `heavy` heaviest bins gets the light bins of rank i, i + heavy,
//     i + 2 heavy, ... and applies its best swap with them (disjoint groups: all apply at once);
//     with 1, 3, 7, ... partners, up to 3 sweeps each, while anything improves;
//   descent: the heaviest bin's best swap, first with the `near` lightest bins, then with all,
//     while it lowers the heaviest load, at most `descend_steps` times.
// A swap is valid when neither bin then holds two copies of an expert and a pinned item stays on
// its node; the best one minimises the larger of the two new loads (first of equals in the order
// item of the heavy bin, partner, item of the partner).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <numeric>
#include <vector>

#include "eplb/eplb_common.h"
#include "eplb/api.h"

namespace mep {
namespace {

struct Swap {
    double peak = kNoSwap;
    int64_t bin_a = -1, pos_a = -1, bin_b = -1, pos_b = -1;
};

class RowRefine {
  public:
    RowRefine(int64_t num_bins, int64_t slots, const int64_t* bin_node)
        : N_(num_bins), S_(slots), node_(bin_node), load_(num_bins), order_(num_bins) {}

    void bind(int64_t* ex, double* sz, uint8_t* pn) {
        ex_ = ex;
        sz_ = sz;
        pn_ = pn;
    }

    void refresh_loads() {
        for (int64_t b = 0; b < N_; ++b) {
            double sum = 0.0;
            for (int64_t i = 0; i < S_; ++i) sum += sz_[b * S_ + i];
            load_[b] = sum;
        }
    }

    bool in_bin(int64_t expert, int64_t bin) const {
        const int64_t* e = ex_ + bin * S_;
        for (int64_t i = 0; i < S_; ++i)
            if (e[i] == expert) return true;
        return false;
    }

    // Best swap between bin h and the bins `partners[0..count)`, kept in `best` if better.
    void best_swap(int64_t h, const int64_t* partners, int64_t count, Swap& best) {
        const double lh = load_[h], tol = load_tolerance(lh);
        // blocked_a_[k * S + i]: item i of h may not go to partner k; blocked_b_[k * S + j]: item j
        // of partner k may not come to h (a copy of its expert there already, or a pinned item
        // leaving its node); a partner not lighter than h gets everything blocked.
        blocked_a_.assign(count * S_, 1);
        blocked_b_.assign(count * S_, 1);
        for (int64_t k = 0; k < count; ++k) {
            const int64_t l = partners[k];
            if (l == h || 0.5 * (lh - load_[l]) <= tol) continue;
            const bool same_node = node_[l] == node_[h];
            for (int64_t i = 0; i < S_; ++i) {
                blocked_a_[k * S_ + i] = in_bin(ex_[h * S_ + i], l) || (pn_[h * S_ + i] && !same_node);
                blocked_b_[k * S_ + i] = in_bin(ex_[l * S_ + i], h) || (pn_[l * S_ + i] && !same_node);
            }
        }
        for (int64_t i = 0; i < S_; ++i) {
            const double sa = sz_[h * S_ + i];
            for (int64_t k = 0; k < count; ++k) {
                if (blocked_a_[k * S_ + i]) continue;
                const int64_t l = partners[k];
                const double ll = load_[l];
                for (int64_t j = 0; j < S_; ++j) {
                    if (blocked_b_[k * S_ + j]) continue;
                    const double peak = swap_peak(lh, ll, sa, sz_[l * S_ + j], tol);
                    if (peak < best.peak) best = Swap{peak, h, i, l, j};
                }
            }
        }
    }

    void apply(const Swap& s) {
        const int64_t a = s.bin_a * S_ + s.pos_a, b = s.bin_b * S_ + s.pos_b;
        std::swap(ex_[a], ex_[b]);
        std::swap(sz_[a], sz_[b]);
        std::swap(pn_[a], pn_[b]);
    }

    void sort_bins() {  // order_: bins by load ascending, ties by index
        std::iota(order_.begin(), order_.end(), 0);
        std::stable_sort(order_.begin(), order_.end(), [&](int64_t a, int64_t b) { return load_[a] < load_[b]; });
    }

    void group_sweeps(int64_t heavy, int64_t partners, int64_t max_sweeps) {
        if (heavy < 1 || partners < 1 || heavy * (partners + 1) > N_ || S_ == 0) return;
        std::vector<int64_t> mates(partners);
        std::vector<Swap> found;
        for (int64_t sweep = 0; sweep < max_sweeps; ++sweep) {
            refresh_loads();
            sort_bins();
            found.clear();
            for (int64_t i = 0; i < heavy; ++i) {
                for (int64_t k = 0; k < partners; ++k) mates[k] = order_[k * heavy + i];
                Swap best;
                best_swap(order_[N_ - 1 - i], mates.data(), partners, best);
                if (best.bin_a >= 0) found.push_back(best);
            }
            if (found.empty()) return;
            for (const Swap& s : found) apply(s);
        }
    }

    void descend(int64_t max_steps, int64_t near) {
        if (N_ < 2 || S_ == 0) return;
        near = std::clamp<int64_t>(near, 0, N_ - 1);
        std::vector<int64_t> everyone(N_);
        std::iota(everyone.begin(), everyone.end(), 0);
        for (int64_t step = 0; step < max_steps; ++step) {
            refresh_loads();
            int64_t top = 0;
            for (int64_t b = 1; b < N_; ++b)
                if (load_[b] > load_[top]) top = b;
            Swap best;
            if (near < N_ - 1) {
                sort_bins();
                best_swap(top, order_.data(), near, best);
            }
            if (best.bin_a < 0) best_swap(top, everyone.data(), N_, best);
            if (best.bin_a < 0) return;
            apply(best);
        }
    }

  private:
    const int64_t N_, S_;
    const int64_t* node_;
    int64_t* ex_ = nullptr;
    double* sz_ = nullptr;
    uint8_t* pn_ = nullptr;
    std::vector<double> load_;
    std::vector<int64_t> order_;
    std::vector<uint8_t> blocked_a_, blocked_b_;
};

}  // namespace

void eplb_refine(uintptr_t experts, uintptr_t sizes, uintptr_t pinned, int64_t num_rows, int64_t num_bins,
                 int64_t slots, uintptr_t bin_node, bool sweeps, int64_t descend_steps, int64_t near, int64_t threads) {
    auto* ex = reinterpret_cast<int64_t*>(experts);
    auto* sz = reinterpret_cast<double*>(sizes);
    auto* pn = reinterpret_cast<uint8_t*>(pinned);
    const auto* node = reinterpret_cast<const int64_t*>(bin_node);
    const int64_t per_row = num_bins * slots;
    std::atomic<int64_t> next{0};
    auto work = [&]() {
        RowRefine row(num_bins, slots, node);
        for (int64_t r = next.fetch_add(1); r < num_rows; r = next.fetch_add(1)) {
            row.bind(ex + r * per_row, sz + r * per_row, pn + r * per_row);
            if (sweeps) {
                for (int64_t partners = 1; num_bins / (partners + 1) >= 2; partners = 2 * partners + 1)
                    row.group_sweeps(num_bins / (partners + 1), partners, 3);
            }
            row.descend(descend_steps, near);
        }
    };
    run_on_threads(work, threads, num_rows);
}

}  // namespace mep
