// The EPLB movement-aware local search (mooncake_ep_switch/eplb/policy/local_search.py documents the
// moves and how they are ranked). One layer at a time, one move at a time: the heaviest GPU's
// best move by drop of its load per moved copy, evaluated exactly on every GPU the move changes.
//
// The Python layer validates every array (dtype, shape, contiguity, value ranges) and passes
// pointers; this file only reads and writes inside those arrays:
//   weight [L, E] float64, experts [L, R] int64, counts [L, E] int64, pinned [L, R] uint8,
//   start [L, R] int64 (optional), rows [n] int64, peak_limit / item_limit [L] float64,
//   budget [L] int64 (optional). Slot s is on GPU s / slots_per_gpu; GPU g on node g / gpus_per_node.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "eplb/eplb_common.h"
#include "eplb/api.h"

namespace mep {
namespace {

constexpr double kFree = 0.25;      // added to a move's cost (moved copies) when ranking gains per cost
constexpr double kMinGain = 1e-6;   // a move must lower the heavy GPU by this fraction (per cost) to count
constexpr int kSplitItems = 3;      // the largest copies of the heavy GPU a split considers
constexpr double kInf = std::numeric_limits<double>::infinity();

struct Move {
    int kind = -1;  // 0 swap, 1 park, 2 split
    double gain = 0.0;
    int64_t slot_a = -1, slot_b = -1;  // swap: the two slots; park/split: slot_a is overwritten
    int64_t expert = -1;                // park/split: the expert slot_a receives
};

// One layer's state plus scratch space, reused across layers.
class LayerSearch {
  public:
    LayerSearch(const EplbShape& shape)
        : E_(shape.num_logical), R_(shape.num_replicas), G_(shape.num_gpus), S_(shape.num_replicas / shape.num_gpus),
          per_node_gpus_(shape.gpus_per_node), N_(shape.num_gpus / shape.gpus_per_node),
          hierarchical_(shape.hierarchical), load_(G_), node_load_(N_), size_(R_), copy_load_(E_), unchanged_(R_), holder_(E_ * G_),
          slot_gpu_(R_), gpu_node_(G_), first_(E_ + 1), holder_gpus_(R_), scratch_fill_(E_), delta_(G_, 0.0), mark_(G_, 0), order_(G_), per_node_(E_ * N_) {
        for (int64_t slot = 0; slot < R_; ++slot) slot_gpu_[slot] = slot / S_;
        for (int64_t g = 0; g < G_; ++g) gpu_node_[g] = hierarchical_ ? g / per_node_gpus_ : 0;
    }

    void bind(const double* w, int64_t* ex, int64_t* cnt, uint8_t* pinned, const int64_t* start) {
        w_ = w;
        ex_ = ex;
        cnt_ = cnt;
        pinned_ = pinned;
        start_ = start;
    }

    int64_t gpu_of(int64_t slot) const { return slot_gpu_[slot]; }
    int64_t node_of_gpu(int64_t gpu) const { return gpu_node_[gpu]; }
    double per_copy(int64_t e) const { return w_[e] / static_cast<double>(std::max<int64_t>(cnt_[e], 1)); }

    // Loads of every GPU; returns the heaviest GPU (the first of equals).
    int64_t refresh_loads() {
        const int64_t* ex = ex_;
        double* copy_load = copy_load_.data();
        double* size = size_.data();
        for (int64_t e = 0; e < E_; ++e) copy_load[e] = per_copy(e);
        for (int64_t s = 0; s < R_; ++s) size[s] = copy_load[ex[s]];
        for (int64_t g = 0; g < G_; ++g) sum_gpu(g);
        return heaviest();
    }

    void sum_gpu(int64_t g) {
        const double* size = size_.data() + g * S_;
        double sum = 0.0;
        for (int64_t i = 0; i < S_; ++i) sum += size[i];
        load_[g] = sum;
    }

    int64_t heaviest() const {
        int64_t top = 0;
        for (int64_t g = 1; g < G_; ++g)
            if (load_[g] > load_[top]) top = g;
        return top;
    }

    // Exchange the copies in slots a and b (on different GPUs), updating loads, holders and costs.
    void swap_slots(int64_t a, int64_t b, int64_t& changed) {
        const int64_t ga = gpu_of(a), gb = gpu_of(b), ea = ex_[a], eb = ex_[b];
        std::swap(ex_[a], ex_[b]);
        std::swap(pinned_[a], pinned_[b]);
        std::swap(size_[a], size_[b]);
        sum_gpu(ga);
        sum_gpu(gb);
        holder_[ea * G_ + ga] = 0;
        holder_[eb * G_ + gb] = 0;
        holder_[ea * G_ + gb] = 1;
        holder_[eb * G_ + ga] = 1;
        std::replace(holder_gpus_.begin() + first_[ea], holder_gpus_.begin() + first_[ea + 1], ga, gb);
        std::replace(holder_gpus_.begin() + first_[eb], holder_gpus_.begin() + first_[eb + 1], gb, ga);
        for (int64_t slot : {a, b}) {
            if (start_ == nullptr) continue;
            changed -= unchanged_[slot] == 0.0;
            unchanged_[slot] = ex_[slot] == start_[slot] ? 1.0 : 0.0;
            changed += unchanged_[slot] == 0.0;
        }
    }

    double peak() { return load_[refresh_loads()]; }

    int64_t moved() const {
        if (start_ == nullptr) return 0;
        int64_t n = 0;
        for (int64_t s = 0; s < R_; ++s) n += ex_[s] != start_[s];
        return n;
    }

    // holder_[e * G + g]: GPU g holds a copy of e; holder_gpus_[first_[e] .. first_[e + 1]): those GPUs.
    void refresh_holders() {
        const int64_t* ex = ex_;
        uint8_t* holder = holder_.data();
        int64_t* first = first_.data();
        int64_t* gpus = holder_gpus_.data();
        int64_t* fill = scratch_fill_.data();
        const int64_t E = E_, G = G_, S = S_, R = R_;  // locals: stores through uint8_t* may alias members
        for (int64_t e = 0; e < E; ++e)  // clear the bits the lists set (cheaper than the whole map)
            for (int64_t i = first[e]; i < first[e + 1]; ++i) holder[e * G + gpus[i]] = 0;
        std::fill(first, first + E + 1, 0);
        for (int64_t s = 0; s < R; ++s) ++first[ex[s] + 1];
        for (int64_t e = 0; e < E; ++e) {
            first[e + 1] += first[e];
            fill[e] = first[e];
        }
        for (int64_t g = 0, s = 0; g < G; ++g) {
            for (int64_t i = 0; i < S; ++i, ++s) {
                holder[ex[s] * G + g] = 1;
                gpus[fill[ex[s]]++] = g;
            }
        }
    }

    bool holds(int64_t e, int64_t g) const { return holder_[e * G_ + g] != 0; }

    // ---- exact "largest load among the GPUs a move changes" ----
    void add_delta(int64_t g, double d) {
        if (!mark_[g]) {
            mark_[g] = 1;
            touched_.push_back(g);
        }
        delta_[g] += d;
    }
    void add_expert_delta(int64_t e, double d, int64_t skip_gpu) {
        for (int64_t i = first_[e]; i < first_[e + 1]; ++i)
            if (holder_gpus_[i] != skip_gpu) add_delta(holder_gpus_[i], d);
    }
    double take_max() {
        double m = -kInf;
        for (int64_t g : touched_) {
            m = std::max(m, load_[g] + delta_[g]);
            delta_[g] = 0.0;
            mark_[g] = 0;
        }
        touched_.clear();
        return m;
    }

    void give_slot(int64_t slot, int64_t expert) {
        const int64_t old = ex_[slot];
        ex_[slot] = expert;
        --cnt_[old];
        ++cnt_[expert];
    }

    // Split experts whose copy load exceeds `limit` by overwriting spare copies (one moved copy each).
    void split_large_copies(double limit) {
        for (int64_t step = 0; step < R_; ++step) {
            refresh_loads();
            int64_t receiver = -1;
            double best = -kInf;
            for (int64_t e = 0; e < E_; ++e) {
                const double v = cnt_[e] < G_ ? copy_load_[e] : -1.0;
                if (v > best) {
                    best = v;
                    receiver = e;
                }
            }
            const double receiver_load = copy_load_[receiver];
            if (!(receiver_load > limit * (1 + 1e-9))) return;
            refresh_holders();
            const double new_copy = w_[receiver] / (cnt_[receiver] + 1.0);
            int64_t choice_strict = -1, choice_loose = -1;
            double effect_strict = kInf, effect_loose = kInf;
            for (int64_t s = 0; s < R_; ++s) {
                const int64_t x = ex_[s];
                if (cnt_[x] < 2 || x == receiver || pinned_[s] || holds(receiver, gpu_of(s))) continue;
                const double donor_after = w_[x] / static_cast<double>(cnt_[x] - 1);
                const double change = new_copy - size_[s];
                const double effect = change * (load_[gpu_of(s)] + 0.5 * change);
                if (donor_after <= limit && effect < effect_strict) {
                    effect_strict = effect;
                    choice_strict = s;
                }
                if (donor_after < receiver_load && effect < effect_loose) {
                    effect_loose = effect;
                    choice_loose = s;
                }
            }
            const int64_t choice = choice_strict >= 0 ? choice_strict : choice_loose;
            if (choice < 0) return;
            give_slot(choice, receiver);
        }
    }

    // Hierarchical mode: while the heaviest node is above `node_limit`, give the expert whose extra
    // copy lowers it most a copy on another node, in the slot (after which every node is lighter
    // than the heaviest node was) that lowers the sum of squared GPU loads most.
    void relieve_nodes(double node_limit, double item_limit) {
        for (int64_t step = 0; step < R_ - E_; ++step) {
            refresh_loads();
            std::fill(node_load_.begin(), node_load_.end(), 0.0);
            for (int64_t g = 0; g < G_; ++g) node_load_[node_of_gpu(g)] += load_[g];
            int64_t heavy = 0;
            for (int64_t n = 1; n < N_; ++n)
                if (node_load_[n] > node_load_[heavy]) heavy = n;
            const double peak = node_load_[heavy];
            if (!(peak > node_limit * (1 + 1e-12))) return;
            std::fill(per_node_.begin(), per_node_.end(), 0.0);
            for (int64_t s = 0; s < R_; ++s) per_node_[ex_[s] * N_ + gpu_node_[slot_gpu_[s]]] += 1.0;
            int64_t receiver = -1;
            double best = -1.0;
            for (int64_t e = 0; e < E_; ++e) {
                const double new_size = w_[e] / (cnt_[e] + 1.0);
                double gain = -1.0;
                if (cnt_[e] < G_ && new_size <= item_limit) gain = per_node_[e * N_ + heavy] * (copy_load_[e] - new_size);
                if (gain > best || receiver < 0) {
                    best = gain;
                    receiver = e;
                }
            }
            if (!(best > 0)) return;
            refresh_holders();
            const double new_size = w_[receiver] / (cnt_[receiver] + 1.0);
            const double shrink = per_copy(receiver) - new_size;
            int64_t choice = -1;
            double choice_effect = kInf;
            for (int64_t s = 0; s < R_; ++s) {
                const int64_t x = ex_[s];
                if (cnt_[x] < 2 || pinned_[s] || x == receiver || holds(receiver, gpu_of(s))) continue;
                const double donor_after = w_[x] / static_cast<double>(cnt_[x] - 1);
                if (donor_after > item_limit) continue;
                const double grow = donor_after - size_[s];
                const int64_t slot_node = node_of_gpu(gpu_of(s));
                bool lower = true;
                for (int64_t n = 0; n < N_ && lower; ++n) {
                    double after = node_load_[n] - per_node_[receiver * N_ + n] * shrink + per_node_[x * N_ + n] * grow;
                    if (n == slot_node) after += new_size - donor_after;
                    lower = after < peak * (1 - 1e-12);
                }
                if (!lower) continue;
                const double change = new_size - size_[s];
                const double effect = change * (load_[gpu_of(s)] + 0.5 * change);
                if (effect < choice_effect) {
                    choice_effect = effect;
                    choice = s;
                }
            }
            if (choice < 0) return;
            give_slot(choice, receiver);
        }
    }

    // unchanged_[s]: 1 while slot s still holds its start expert (changing it costs a copy), else 0.
    // Returns the slots already changed.
    int64_t refresh_unchanged() {
        double* unchanged = unchanged_.data();
        if (start_ == nullptr) {
            std::fill(unchanged_.begin(), unchanged_.end(), 1.0);
            return 0;
        }
        const int64_t* ex = ex_;
        const int64_t* start = start_;
        int64_t changed = 0;
        for (int64_t s = 0; s < R_; ++s) {
            const bool same = ex[s] == start[s];
            unchanged[s] = same ? 1.0 : 0.0;
            changed += !same;
        }
        return changed;
    }
    double unchanged(int64_t slot) const { return unchanged_[slot]; }
    // Slots changed against `start` after `slot` takes `expert`, minus before: 1 (a new move),
    // 0, or -1 (the slot gets its start expert back). Without `start` every change costs 1.
    double change_cost(int64_t slot, int64_t expert) const {
        if (start_ == nullptr) return 1.0;
        return static_cast<double>(expert != start_[slot]) - (1.0 - unchanged_[slot]);
    }

    // The best swap of a copy of `top` (positions >= swap_from) with one on a GPU of `partners`.
    void best_swap(int64_t top, const int64_t* partners, int64_t num_partners, int64_t swap_from, Move& best) const {
        const double lh = load_[top];
        const double tol = load_tolerance(lh);
        for (int64_t k = 0; k < num_partners; ++k) {
            const int64_t p = partners[k];
            if (p == top) continue;
            const double half_gap = 0.5 * (lh - load_[p]);
            if (half_gap <= tol) continue;
            if (half_gap / kFree <= best.gain * (1 - 1e-9)) continue;  // no swap with p can win
            const bool same_node = node_of_gpu(p) == node_of_gpu(top);
            for (int64_t i = swap_from; i < S_; ++i) {
                const int64_t a = top * S_ + i;
                const int64_t ea = ex_[a];
                if (holds(ea, p) || (pinned_[a] && !same_node)) continue;
                for (int64_t j = swap_from; j < S_; ++j) {
                    const int64_t b = p * S_ + j;
                    const int64_t eb = ex_[b];
                    if (holds(eb, top) || (pinned_[b] && !same_node)) continue;
                    const double cost = change_cost(a, eb) + change_cost(b, ea);
                    if (cost > room_) continue;  // over the budget
                    const double score = swap_peak(lh, load_[p], size_[a], size_[b], tol);
                    if (score == kNoSwap) continue;
                    const double gain = (lh - score) / (std::max(cost, 0.0) + kFree);
                    if (gain > best.gain) {
                        best.kind = 0;
                        best.gain = gain;
                        best.slot_a = a;
                        best.slot_b = b;
                    }
                }
            }
        }
    }

    // Park: overwrite a copy of x (>= 2 copies, not pinned) on `top` with a copy of the expert whose
    // copy load after one more copy is smallest (and that `top` does not hold).
    void best_park(int64_t top, double item_limit, Move& best) {
        int64_t y = -1;
        double y_cost = kInf;
        for (int64_t e = 0; e < E_; ++e) {
            if (cnt_[e] >= G_ || holds(e, top)) continue;
            const double c = w_[e] / (cnt_[e] + 1.0);
            if (c < y_cost) {
                y_cost = c;
                y = e;
            }
        }
        if (y < 0) return;
        const double lh = load_[top];
        const double shrink_y = w_[y] / static_cast<double>(cnt_[y]) - y_cost;
        for (int64_t i = 0; i < S_; ++i) {
            const int64_t a = top * S_ + i;
            const int64_t x = ex_[a];
            const double cost = change_cost(a, y);
            if (cnt_[x] < 2 || pinned_[a] || cost > room_) continue;
            const double x_after = w_[x] / static_cast<double>(cnt_[x] - 1);
            if (x_after > item_limit) continue;
            add_expert_delta(x, x_after - size_[a], top);
            add_expert_delta(y, -shrink_y, -1);
            add_delta(top, y_cost - size_[a]);
            const double gain = (lh - take_max()) / (std::max(cost, 0.0) + kFree);
            if (gain > best.gain) {
                best = Move{1, gain, a, -1, y};
            }
        }
    }

    // Split: one of the largest copies y of `top` gets another copy in a spare slot (of an expert x
    // with >= 2 copies, not pinned) on a GPU of `partners`.
    void best_split(int64_t top, const int64_t* partners, int64_t num_partners, double item_limit, Move& best) {
        int64_t pos[kSplitItems];
        int64_t q = 0;
        for (int64_t i = 0; i < S_; ++i) {  // the kSplitItems largest, ties by position
            const int64_t a = top * S_ + i;
            int64_t at = q;
            while (at > 0 && size_[pos[at - 1]] < size_[a]) --at;
            if (at >= kSplitItems) continue;
            for (int64_t m = std::min<int64_t>(q, kSplitItems - 1); m > at; --m) pos[m] = pos[m - 1];
            pos[at] = a;
            q = std::min<int64_t>(q + 1, kSplitItems);
        }
        const double lh = load_[top];
        for (int64_t qi = 0; qi < q; ++qi) {
            const int64_t y = ex_[pos[qi]];
            if (cnt_[y] >= G_) continue;
            const double new_y = w_[y] / (cnt_[y] + 1.0);
            const double shrink_y = size_[pos[qi]] - new_y;
            for (int64_t k = 0; k < num_partners; ++k) {
                const int64_t p = partners[k];
                if (p == top || holds(y, p)) continue;
                for (int64_t j = 0; j < S_; ++j) {
                    const int64_t s = p * S_ + j;
                    const int64_t x = ex_[s];
                    const double cost = std::max(change_cost(s, y), 0.0);
                    if (cnt_[x] < 2 || pinned_[s] || cost > room_) continue;
                    // top and p after the move bound the largest changed load from below
                    const double floor = std::max(lh - shrink_y, load_[p] + new_y - size_[s]);
                    if ((lh - floor) / (cost + kFree) <= best.gain * (1 - 1e-9)) continue;
                    const double x_after = w_[x] / static_cast<double>(cnt_[x] - 1);
                    if (x_after > item_limit) continue;
                    add_expert_delta(y, -shrink_y, -1);
                    add_expert_delta(x, x_after - size_[s], -1);
                    add_delta(p, new_y - x_after);
                    const double gain = (lh - take_max()) / (cost + kFree);
                    if (gain > best.gain) {
                        best = Move{2, gain, s, -1, y};
                    }
                }
            }
        }
    }

    // Lower every GPU above `peak_limit`, the heaviest first, one move at a time; stops when no move
    // lowers the heaviest GPU, after `max_steps` moves, or once `budget` copies moved (if >= 0).
    void improve(double peak_limit, double item_limit, int64_t max_steps, int64_t budget, int64_t near,
                 int64_t swap_from, int64_t heavy) {
        near = std::max<int64_t>(1, std::min<int64_t>(near, G_ - 1));
        bool stale = true;  // park and split change copy loads of whole experts: refresh everything
        int64_t changed = 0;
        for (int64_t step = 0; step < max_steps; ++step) {
            if (stale) {
                refresh_loads();
                changed = refresh_unchanged();
                refresh_holders();
                stale = false;
            }
            const int64_t top = heaviest();
            if (!(load_[top] > peak_limit)) return;
            if (budget >= 0 && changed >= budget) return;
            room_ = budget >= 0 ? static_cast<double>(budget - changed) : kInf;
            // GPUs by load, lightest first (partners: the `near` lightest); equal loads by
            // decreasing index, so order_[G - 1] is the first heaviest GPU, `top`
            for (int64_t g = 0; g < G_; ++g) order_[g] = g;
            std::sort(order_.begin(), order_.end(), [&](int64_t a, int64_t b) {
                return load_[a] < load_[b] || (load_[a] == load_[b] && a > b);
            });
            // The heaviest GPU's best move; if it has none, the next heaviest GPU above the limit
            // (up to `heavy` of them): lowering those can open moves for the heaviest later.
            Move best;
            for (int64_t k = 0; k < std::min(heavy, G_) && best.kind < 0; ++k) {
                const int64_t h = order_[G_ - 1 - k];
                const double peak = load_[h];
                if (!(peak > peak_limit)) break;
                best.gain = kMinGain * peak;
                best_swap(h, order_.data(), near, swap_from, best);
                best_park(h, item_limit, best);
                best_split(h, order_.data(), near, item_limit, best);
                if (best.kind < 0 && near < G_ - 1) best_swap(h, order_.data(), G_, swap_from, best);
            }
            if (best.kind < 0) return;
            if (best.kind == 0) {
                swap_slots(best.slot_a, best.slot_b, changed);
            } else {
                give_slot(best.slot_a, best.expert);
                stale = true;
            }
        }
    }

    // Give changed slots back their start expert where that keeps every GPU at or below
    // max(peak_limit, the current heaviest load) and no copy above item_limit: moves the search
    // made on its way that the final placement does not need. Passes until nothing reverts.
    void revert_moves(double peak_limit, double item_limit) {
        if (start_ == nullptr) return;
        for (int64_t pass = 0; pass < R_; ++pass) {
            bool any = false;
            const double bound = std::max(peak_limit, load_[refresh_loads()]);
            refresh_holders();
            for (int64_t s = 0; s < R_; ++s) {
                const int64_t x = start_[s], y = ex_[s], g = gpu_of(s);
                if (x == y || pinned_[s] || cnt_[y] < 2 || cnt_[x] >= G_ || holds(x, g)) continue;
                const double y_after = w_[y] / static_cast<double>(cnt_[y] - 1);
                if (y_after > item_limit) continue;
                const double x_after = w_[x] / (cnt_[x] + 1.0);
                add_expert_delta(y, y_after - size_[s], g);
                add_expert_delta(x, x_after - copy_load_[x], -1);
                add_delta(g, x_after - size_[s]);
                if (take_max() > bound) continue;
                give_slot(s, x);
                any = true;
                refresh_loads();
                refresh_holders();
            }
            if (!any) return;
        }
    }

  private:
    const int64_t E_, R_, G_, S_, per_node_gpus_, N_;
    const bool hierarchical_;
    double room_ = kInf;  // slots the budget still lets the current move change
    const double* w_ = nullptr;
    int64_t* ex_ = nullptr;
    int64_t* cnt_ = nullptr;
    uint8_t* pinned_ = nullptr;
    const int64_t* start_ = nullptr;
    std::vector<double> load_, node_load_, size_, copy_load_, unchanged_;
    std::vector<uint8_t> holder_;
    std::vector<int64_t> slot_gpu_, gpu_node_, first_, holder_gpus_, scratch_fill_;
    std::vector<double> delta_;
    std::vector<uint8_t> mark_;
    std::vector<int64_t> touched_, order_;
    std::vector<double> per_node_;
};

}  // namespace

void eplb_search(const EplbShape& shape, const EplbArrays& arrays, const EplbSearchParams& params) {
    if (shape.num_gpus <= 0 || shape.num_replicas % shape.num_gpus || shape.gpus_per_node <= 0 ||
        shape.num_gpus % shape.gpus_per_node || shape.num_logical <= 0) {
        throw std::invalid_argument("eplb_search: inconsistent shape");
    }
    const int64_t E = shape.num_logical, R = shape.num_replicas;
    const auto* rows = reinterpret_cast<const int64_t*>(arrays.rows);
    const auto* weight = reinterpret_cast<const double*>(arrays.weight);
    auto* experts = reinterpret_cast<int64_t*>(arrays.experts);
    auto* counts = reinterpret_cast<int64_t*>(arrays.counts);
    auto* pinned = reinterpret_cast<uint8_t*>(arrays.pinned);
    const auto* start = reinterpret_cast<const int64_t*>(arrays.start);
    const auto* peak_limit = reinterpret_cast<const double*>(arrays.peak_limit);
    const auto* item_limit = reinterpret_cast<const double*>(arrays.item_limit);
    const auto* budget = reinterpret_cast<const int64_t*>(arrays.budget);
    // Layers are independent and each is searched sequentially, so the result does not depend on
    // how many threads share the rows.
    std::atomic<int64_t> next{0};
    auto work = [&]() {
        LayerSearch search(shape);
        for (int64_t i = next.fetch_add(1); i < arrays.num_rows; i = next.fetch_add(1)) {
            const int64_t layer = rows[i];
            search.bind(weight + layer * E, experts + layer * R, counts + layer * E, pinned + layer * R,
                        start ? start + layer * R : nullptr);
            const double limit = peak_limit[layer], items = item_limit[layer];
            const int64_t cap = budget ? budget[layer] : -1;
            if (params.split) search.split_large_copies(items);
            const double node_limit = limit * shape.gpus_per_node;
            const bool relieve = params.relieve && shape.hierarchical;
            if (relieve) search.relieve_nodes(node_limit * params.node_margin, items);
            search.improve(limit * (1 + 1e-12), items, params.max_steps, cap, params.near, params.swap_from, params.heavy);
            for (int64_t attempt = 0; relieve && attempt < params.retries; ++attempt) {
                if (!(search.peak() > limit * (1 + 1e-9))) break;
                if (cap >= 0 && search.moved() >= cap) break;
                search.relieve_nodes(node_limit * (params.node_margin - 0.005 * (attempt + 1)), items);
                search.improve(limit * (1 + 1e-12), items, params.max_steps, cap, params.near, params.swap_from, params.heavy);
            }
            if (params.revert) search.revert_moves(limit, items);
        }
    };
    run_on_threads(work, params.threads, arrays.num_rows);
}

}  // namespace mep
