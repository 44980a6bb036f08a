// The one-sided dispatch/combine data plane of docs/protocol.md over memory mapped in this
// process (shared-memory segments of local peers, or staging copies a transport ships later).
//
// Ordering contract: a sender writes every data row of one destination first and only then that
// destination's signals with release stores; a receiver loads a signal with acquire and reads
// only the rows counted by a signal whose tag equals the current call number. Stale signals of
// earlier calls carry other tags and never match, so no cleaning pass is needed.
#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "dataplane/api.h"
#include "common/mep_common.h"
#include "dataplane/rows.h"

namespace mep {

namespace {

// ---------------------------------------------------------------------------------------------
// Argument checks shared by the four calls
// ---------------------------------------------------------------------------------------------

void check_peer_bases(const std::vector<uintptr_t>& bases, int64_t num_ranks) {
    if (int64_t(bases.size()) != num_ranks) {
        throw_value_error("peer_half_bases has " + std::to_string(bases.size()) + " entries, expected num_ranks = " +
                          std::to_string(num_ranks));
    }
}

// Every top-k entry must be -1 (skip) or a valid global expert.
void check_topk(const int64_t* topk, int64_t n, int64_t num_experts) {
    for (int64_t i = 0; i < n; ++i) {
        if (topk[i] < -1 || topk[i] >= num_experts) {
            throw_value_error("topk entry " + std::to_string(i) + " = " + std::to_string(topk[i]) + " is outside [-1, " +
                              std::to_string(num_experts) + ")");
        }
    }
}

// The caller's active_ranks tensor (int32 [R]): a local copy to decide with, written through
// when a peer is found dead, and the list of ranks this call marked inactive.
class ActiveMask {
public:
    ActiveMask(uintptr_t ptr, int64_t num_ranks) : mask_(reinterpret_cast<int32_t*>(ptr)), alive_(size_t(num_ranks)) {
        for (int64_t r = 0; r < num_ranks; ++r) alive_[size_t(r)] = mask_[r] != 0;
    }
    bool alive(int64_t r) const { return alive_[size_t(r)] != 0; }
    void fail(int64_t r) {
        if (!alive(r)) return;
        alive_[size_t(r)] = 0;
        mask_[r] = 0;
        newly_.push_back(int(r));
    }
    std::vector<int> newly_inactive() const {
        std::vector<int> out = newly_;
        std::sort(out.begin(), out.end());
        return out;
    }

private:
    int32_t* mask_;
    std::vector<uint8_t> alive_;
    std::vector<int> newly_;
};

// Destinations in protocol order rank+1, rank+2, ... (wrapping, so that ranks do not all write
// to rank 0 first), keeping only active, reachable ones and, if dest >= 0, only dest.
std::vector<int64_t> destination_order(int64_t num_ranks, int64_t rank, int64_t dest, const ActiveMask& active,
                                       const std::vector<uintptr_t>& bases) {
    std::vector<int64_t> order;
    for (int64_t i = 1; i <= num_ranks; ++i) {
        const int64_t d = (rank + i) % num_ranks;
        if (dest >= 0 && d != dest) continue;
        if (!active.alive(d) || bases[size_t(d)] == 0) continue;
        order.push_back(d);
    }
    return order;
}

// High bit of a combine signal's count: the expert owner wrote this rank's rows compactly (the
// Transfer Engine path, so that only routed rows cross the wire): rows of its local expert l start
// after the rows of its experts 0..l-1, in the order the token owner dispatched them (ascending t).
constexpr uint32_t kCompactFlag = 0x80000000u;

// How a data-plane wait spends the time between polls. Ranks usually outnumber idle cores (4 or 8
// ranks on 2 cores, or 2 ranks beside other work), and then the peer we wait for often needs this
// very core: spinning only delays it, and every handoff costs a spin phase. So for the first
// millisecond (MEP_WAIT_YIELD_US, read once; 0 = the Waiter alone) the wait gives the core away at
// once with sched_yield (a syscall of under a microsecond that returns at once when nobody else
// wants the core, so on an idle core this is still a tight poll), and only then falls back to the
// shared Waiter's backoff (its own spin, yield and futex sleeps). The caller checks the deadline
// before every backoff. Measured at R=2 T=1 with both ranks on one core: 115-130 us per round trip
// instead of 160; at R=4 on 2 cores no worse. Sleeping on the futex at once was slower (163-170 us).
class DataplaneWait {
public:
    explicit DataplaneWait(Waiter& waiter) : waiter_(waiter) {}
    void backoff(const void* futex_word, uint32_t futex_expected) {
        const int64_t now = monotonic_ns();
        if (yield_until_ns_ < 0) yield_until_ns_ = now + yield_first_ns();
        if (now < yield_until_ns_) {
            sched_yield();
            return;
        }
        waiter_.backoff(futex_word, futex_expected);
    }

private:
    static int64_t yield_first_ns() {
        static const int64_t ns = [] {
            const char* text = std::getenv("MEP_WAIT_YIELD_US");  // tuning knob, 0 = the Waiter alone
            return text != nullptr ? std::max<int64_t>(0, std::atoll(text)) * 1000 : int64_t(1000) * 1000;
        }();
        return ns;
    }
    Waiter& waiter_;
    int64_t yield_until_ns_ = -1;
};

// Polls signal words [P][L] (peer p's signals are words p*L .. p*L+L-1) until every alive peer's
// L signals carry `tag`, recording the counts. A peer that sends a count > T, or whose signals
// are not all there by the deadline, is marked inactive and counts as having sent nothing.
// This serves both dispatch_signals[s][l] and combine_signals[d*L + l].
// `abort_word` (nullable): an 8-byte word of the caller's; once it is non-zero the wait stops and
// throws std::runtime_error (RuntimeError), leaving the mask untouched, so that destroying a Buffer
// never waits for a receive that has no deadline (timeout_us == -1). Checked before every backoff
// (a sleep is at most 128 us), so an abort is seen within a fraction of a millisecond.
// `dead` (nullable): int32 [P] flags of the caller's (a peer watcher sets them when a peer process
// is gone); a peer whose flag is non-zero and whose signals are not all there is marked inactive at
// once, exactly as at the deadline, instead of being waited for until then.
// `compact` (nullable, combine only): per peer, whether its signals carry kCompactFlag (its rows for
// this rank sit behind each other, see combine_to_destination); a peer whose L signals disagree on
// the flag is marked inactive. With `compact` null a flagged count is out of range (dispatch).
void wait_for_signals(const uint8_t* words, int64_t num_peers, int64_t L, uint32_t tag, int64_t max_tokens,
                      Waiter& waiter, ActiveMask& active, std::vector<uint32_t>& counts, const void* abort_word,
                      const int32_t* dead, std::vector<uint8_t>* compact = nullptr) {
    DataplaneWait wait(waiter);
    counts.assign(size_t(num_peers * L), 0);
    if (compact != nullptr) compact->assign(size_t(num_peers), 0);
    std::vector<int64_t> next(size_t(num_peers), 0);  // signals of p confirmed so far (in order)
    for (;;) {
        bool complete = true;
        for (int64_t p = 0; p < num_peers; ++p) {
            int64_t& l = next[size_t(p)];
            while (active.alive(p) && l < L) {
                const uint64_t v = load_acquire(words + (p * L + l) * 8);
                if (signal_tag(v) != tag) break;  // not yet written for this call (or stale)
                uint32_t c = signal_count(v);
                if (compact != nullptr) {
                    const uint8_t flagged = (c & kCompactFlag) != 0 ? 1 : 0;
                    c &= ~kCompactFlag;
                    if (l == 0) {
                        (*compact)[size_t(p)] = flagged;
                    } else if ((*compact)[size_t(p)] != flagged) {
                        active.fail(p);  // protocol error: mixed layouts from one owner
                        break;
                    }
                }
                if (int64_t(c) > max_tokens) {
                    active.fail(p);  // protocol error: a corrupted or hostile peer
                    break;
                }
                counts[size_t(p * L + l)] = c;
                ++l;
            }
            if (active.alive(p) && l < L) complete = false;
        }
        if (complete) return;
        if (dead != nullptr) {
            bool failed = false;
            for (int64_t p = 0; p < num_peers; ++p) {
                if (active.alive(p) && next[size_t(p)] < L &&
                    __atomic_load_n(dead + p, __ATOMIC_ACQUIRE) != 0) {
                    active.fail(p);
                    failed = true;
                }
            }
            if (failed) continue;  // re-check completeness without the failed peers
        }
        if (abort_word != nullptr && load_acquire(abort_word) != 0) {
            throw std::runtime_error("aborted: the Buffer was destroyed while this call waited for its peers");
        }
        if (waiter.expired()) {
            for (int64_t p = 0; p < num_peers; ++p) {
                if (active.alive(p) && next[size_t(p)] < L) active.fail(p);
            }
            return;
        }
        // Sleep (if it comes to that) on the last signal of the first incomplete peer: a sender
        // writes a peer's L signals in order and then wakes that word's waiters.
        const void* futex_word = nullptr;
        uint32_t futex_expected = 0;
        for (int64_t p = 0; p < num_peers; ++p) {
            if (active.alive(p) && next[size_t(p)] < L) {
                const uint8_t* last = words + (p * L + L - 1) * 8;
                futex_word = signal_futex_word(last);
                futex_expected = signal_tag(load_acquire(last));
                break;
            }
        }
        wait.backoff(futex_word, futex_expected);
    }
}

// ---------------------------------------------------------------------------------------------
// Dispatch send
// ---------------------------------------------------------------------------------------------

// Per-expert token lists: tokens[offset[e] .. offset[e+1]) ascending, for experts owned by a
// targeted destination; used[t] marks tokens that go anywhere. Reused across calls per thread.
struct Routing {
    std::vector<int64_t> offset;
    std::vector<int32_t> tokens;
    std::vector<uint8_t> used;
};

// True if topk row entry k repeats an earlier entry (a token is sent to an expert once).
inline bool repeats_earlier(const int64_t* row, int64_t k) {
    for (int64_t j = 0; j < k; ++j) {
        if (row[j] == row[k]) return true;
    }
    return false;
}

void build_routing(const int64_t* topk, int64_t num_tokens, int64_t top_k, const Layout& lay,
                   const std::vector<uint8_t>& targeted, Routing& rt) {
    const int64_t E = lay.num_experts, L = lay.num_local_experts;
    rt.offset.assign(size_t(E + 1), 0);
    rt.used.assign(size_t(num_tokens), 0);
    auto selects = [&](int64_t t, int64_t k) {
        const int64_t* row = topk + t * top_k;
        return row[k] >= 0 && targeted[size_t(row[k] / L)] && !repeats_earlier(row, k);
    };
    for (int64_t t = 0; t < num_tokens; ++t) {
        for (int64_t k = 0; k < top_k; ++k) {
            if (selects(t, k)) ++rt.offset[size_t(topk[t * top_k + k] + 1)];
        }
    }
    // Check capacity before anything is written (Python validates num_tokens <= T, so this only
    // fires on a caller bug).
    for (int64_t e = 0; e < E; ++e) {
        if (rt.offset[size_t(e + 1)] > lay.max_tokens) {
            throw_value_error("dispatch_send: expert " + std::to_string(e) + " would receive " +
                              std::to_string(rt.offset[size_t(e + 1)]) +
                              " tokens from this rank, more than num_max_dispatch_tokens_per_rank = " +
                              std::to_string(lay.max_tokens));
        }
    }
    for (int64_t e = 0; e < E; ++e) rt.offset[size_t(e + 1)] += rt.offset[size_t(e)];
    rt.tokens.resize(size_t(rt.offset[size_t(E)]));
    std::vector<int64_t> cursor(rt.offset.begin(), rt.offset.end() - 1);
    for (int64_t t = 0; t < num_tokens; ++t) {  // ascending t keeps every list sorted
        for (int64_t k = 0; k < top_k; ++k) {
            if (!selects(t, k)) continue;
            rt.tokens[size_t(cursor[size_t(topk[t * top_k + k])]++)] = int32_t(t);
            rt.used[size_t(t)] = 1;
        }
    }
}

// Source rows for one dispatch: bf16 rows of x, or FP8 rows quantized once per token.
struct SendRows {
    const uint16_t* x = nullptr;   // bf16 [N, H]
    const uint8_t* q = nullptr;    // fp8 [N, H]   (use_fp8)
    const float* scales = nullptr; // f32 [N, G]   (use_fp8)
};

// Writes the rows, source indices and (FP8) scales of every local expert of destination d into
// d's half, then (if asked) d's signals. Signals strictly after data: a reader that sees the tag
// with acquire also sees every row it counts. `column` is the source column written: this rank's
// in a peer's half; d itself in a staging copy that holds every destination at once (the
// Transfer Engine path then copies column d of the staging into column `rank` of peer d).
//
// With `compact` (the Transfer Engine route: each token crosses the wire once per destination, as
// in docs/protocol.md) the rows of every token that selected any expert of d go once each, in
// ascending token order, to dispatch_data[0][column][0..m) (FP8 rows dense at H bytes from the start
// of that block, so that only m*H bytes cross the wire); the per-expert token lists (int32,
// ascending, local expert 0 first) go behind each other to the start of dispatch_data[1][column];
// FP8 scales of the m rows to dispatch_scales[0][column]; every signal carries kCompactFlag.
void send_to_destination(uint8_t* half, const Layout& lay, int64_t column, int64_t d, const Routing& rt,
                         const SendRows& src, bool use_fp8, uint32_t tag, bool write_signals, bool compact) {
    const int64_t R = lay.num_ranks, T = lay.max_tokens, H = lay.hidden, L = lay.num_local_experts;
    const int64_t G = lay.num_scale_groups;
    const int64_t rank = column;
    uint8_t* data = half + lay.dispatch_data;
    auto* scales = reinterpret_cast<float*>(half + lay.dispatch_scales);
    auto* srcidx = reinterpret_cast<int32_t*>(half + lay.dispatch_src);
    if (compact) {
        thread_local std::vector<uint8_t> chosen;
        chosen.assign(rt.used.size(), 0);
        auto* meta = reinterpret_cast<int32_t*>(data + (1 * R + rank) * T * lay.row_bytes);
        int64_t at = 0;
        for (int64_t l = 0; l < L; ++l) {
            const int64_t e = d * L + l;
            for (int64_t i = rt.offset[size_t(e)]; i < rt.offset[size_t(e + 1)]; ++i) {
                const int32_t t = rt.tokens[size_t(i)];
                meta[at++] = t;
                chosen[size_t(t)] = 1;
            }
        }
        int64_t m = 0;
        const int64_t slot0 = (0 * R + rank) * T;
        uint8_t* rows = data + slot0 * lay.row_bytes;  // FP8 rows dense at H bytes: half the bytes to send
        for (size_t t = 0; t < chosen.size(); ++t) {
            if (!chosen[t]) continue;
            const int64_t row = m++;
            const int64_t slot = slot0 + row;
            if (use_fp8) {
                std::memcpy(rows + row * H, src.q + int64_t(t) * H, size_t(H));
                std::memcpy(scales + slot * G, src.scales + int64_t(t) * G, size_t(G) * sizeof(float));
            } else {
                std::memcpy(data + slot * lay.row_bytes, src.x + int64_t(t) * H, size_t(lay.row_bytes));
            }
        }
    }
    for (int64_t l = 0; l < L && !compact; ++l) {
        const int64_t e = d * L + l;
        const int64_t slot0 = (l * R + rank) * T;  // dispatch_*[l][column][0]
        const int64_t begin = rt.offset[size_t(e)], count = rt.offset[size_t(e + 1)] - begin;
        for (int64_t i = 0; i < count; ++i) {
            const int64_t t = rt.tokens[size_t(begin + i)];
            const int64_t slot = slot0 + i;
            if (use_fp8) {
                std::memcpy(data + slot * lay.row_bytes, src.q + t * H, size_t(H));
                std::memcpy(scales + slot * G, src.scales + t * G, size_t(G) * sizeof(float));
            } else {
                std::memcpy(data + slot * lay.row_bytes, src.x + t * H, size_t(lay.row_bytes));
            }
            srcidx[slot] = int32_t(t);
        }
    }
    if (!write_signals) return;
    const uint32_t flag = compact ? kCompactFlag : 0u;
    for (int64_t l = 0; l < L; ++l) {
        const int64_t e = d * L + l;
        const auto count = uint32_t(rt.offset[size_t(e + 1)] - rt.offset[size_t(e)]);
        store_release(half + lay.dispatch_signals + (rank * L + l) * 8, make_signal(tag, count | flag));
    }
    wake_signal_waiters(half + lay.dispatch_signals + (rank * L + L - 1) * 8);
}

// ---------------------------------------------------------------------------------------------
// Dispatch receive
// ---------------------------------------------------------------------------------------------

// Whether a compact dispatch fits: its token lists (at most L*T int32) sit in one T-row block.
bool compact_dispatch_fits(const Layout& lay) {
    return lay.num_local_experts >= 2 && 4 * lay.num_local_experts <= lay.row_bytes;
}

// Every token index a live source wrote must lie in [0, T); otherwise the source is failed. For a
// compact source the lists must also be strictly ascending; `unions[s]` then maps each token to its
// row among the source's m compact rows (-1: not sent).
void validate_dispatch_sources(const uint8_t* half, const Layout& lay, const std::vector<uint32_t>& counts,
                               const std::vector<uint8_t>& compact, ActiveMask& active,
                               std::vector<std::vector<int32_t>>& unions) {
    const int64_t R = lay.num_ranks, T = lay.max_tokens, L = lay.num_local_experts;
    const auto* srcidx = reinterpret_cast<const int32_t*>(half + lay.dispatch_src);
    unions.assign(size_t(R), {});
    for (int64_t s = 0; s < R; ++s) {
        if (!active.alive(s)) continue;
        if (compact[size_t(s)]) {
            if (!compact_dispatch_fits(lay)) {
                active.fail(s);  // protocol error: this layout has no room for compact lists
                continue;
            }
            const auto* meta =
                reinterpret_cast<const int32_t*>(half + lay.dispatch_data + (1 * R + s) * T * lay.row_bytes);
            std::vector<int32_t>& row_of = unions[size_t(s)];
            row_of.assign(size_t(T), -1);
            int64_t at = 0;
            for (int64_t l = 0; l < L && active.alive(s); ++l) {
                const int64_t c = counts[size_t(s * L + l)];
                for (int64_t i = 0; i < c; ++i) {
                    const int32_t t = meta[at + i];
                    if (t < 0 || t >= T || (i > 0 && t <= meta[at + i - 1])) {
                        active.fail(s);
                        break;
                    }
                    row_of[size_t(t)] = 0;
                }
                at += c;
            }
            int32_t m = 0;
            for (int64_t t = 0; t < T; ++t) {
                if (row_of[size_t(t)] == 0) row_of[size_t(t)] = m++;
            }
            continue;
        }
        for (int64_t l = 0; l < L && active.alive(s); ++l) {
            const int32_t* idx = srcidx + (l * R + s) * T;
            const int64_t c = counts[size_t(s * L + l)];
            for (int64_t i = 0; i < c; ++i) {
                if (idx[i] < 0 || idx[i] >= T) {
                    active.fail(s);
                    break;
                }
            }
        }
    }
}

struct RecvOutputs {
    uint8_t* x;             // [L, R*T, H] bf16 or fp8
    float* scales;          // physical [L][G][R*T] (fp8 only)
    int32_t* src_info;      // [L, R*T]
    int64_t* layout_range;  // [L, R]
    int32_t* recv_count;    // [L]
};

// Packs the counted rows of every live source (ascending) behind each other per local expert.
void pack_dispatch(const uint8_t* half, const Layout& lay, const std::vector<uint32_t>& counts,
                   const ActiveMask& active, bool use_fp8, const RecvOutputs& out,
                   const std::vector<std::vector<int32_t>>& unions) {
    const int64_t R = lay.num_ranks, T = lay.max_tokens, H = lay.hidden, L = lay.num_local_experts;
    const int64_t G = lay.num_scale_groups, RT = R * T;
    const uint8_t* data = half + lay.dispatch_data;
    const auto* scales = reinterpret_cast<const float*>(half + lay.dispatch_scales);
    const auto* srcidx = reinterpret_cast<const int32_t*>(half + lay.dispatch_src);
    for (int64_t l = 0; l < L; ++l) {
        int64_t begin = 0;
        for (int64_t s = 0; s < R; ++s) {
            int64_t& range = out.layout_range[l * R + s];
            if (!active.alive(s)) {
                range = 0;
                continue;
            }
            const int64_t c = counts[size_t(s * L + l)];
            const int64_t slot0 = (l * R + s) * T;
            const int64_t row0 = l * RT + begin;  // first packed row of this block
            if (!unions[size_t(s)].empty()) {  // compact source: rows by token from its m rows
                const std::vector<int32_t>& row_of = unions[size_t(s)];
                const auto* meta =
                    reinterpret_cast<const int32_t*>(data + (1 * R + s) * T * lay.row_bytes);
                int64_t at = 0;
                for (int64_t k = 0; k < l; ++k) at += counts[size_t(s * L + k)];
                const int64_t base = (0 * R + s) * T;
                for (int64_t i = 0; i < c; ++i) {
                    const int32_t t = meta[at + i];
                    const int64_t slot = base + row_of[size_t(t)];
                    if (use_fp8) {  // compact FP8 rows are dense at H bytes
                        std::memcpy(out.x + (row0 + i) * H, data + base * lay.row_bytes + row_of[size_t(t)] * H,
                                    size_t(H));
                        for (int64_t g = 0; g < G; ++g) out.scales[(l * G + g) * RT + begin + i] = scales[slot * G + g];
                    } else {
                        std::memcpy(out.x + (row0 + i) * lay.row_bytes, data + slot * lay.row_bytes,
                                    size_t(lay.row_bytes));
                    }
                    out.src_info[row0 + i] = t;
                }
                range = (begin << 32) | c;
                begin += c;
                continue;
            }
            if (use_fp8) {
                // FP8 rows sit in the first H bytes of 2H-byte slots: one copy per row.
                for (int64_t i = 0; i < c; ++i) {
                    std::memcpy(out.x + (row0 + i) * H, data + (slot0 + i) * lay.row_bytes, size_t(H));
                }
                // Transpose scales to token-contiguous [L][G][R*T].
                for (int64_t g = 0; g < G; ++g) {
                    float* dst = out.scales + (l * G + g) * RT + begin;
                    for (int64_t i = 0; i < c; ++i) dst[i] = scales[(slot0 + i) * G + g];
                }
            } else {
                // bf16 slots are dense rows: the whole (l, s) block is one copy.
                std::memcpy(out.x + row0 * lay.row_bytes, data + slot0 * lay.row_bytes, size_t(c * lay.row_bytes));
            }
            std::memcpy(out.src_info + row0, srcidx + slot0, size_t(c) * sizeof(int32_t));
            range = (begin << 32) | c;
            begin += c;
        }
        out.recv_count[l] = int32_t(begin);
        // src_info past the received rows is 0 (outputs may be reused buffers, not fresh zeros).
        std::memset(out.src_info + l * RT + begin, 0, size_t(RT - begin) * sizeof(int32_t));
    }
}

// ---------------------------------------------------------------------------------------------
// Combine send
// ---------------------------------------------------------------------------------------------

// (begin, count) of layout_range[l][s] with bounds checks (values come from dispatch_recv but
// the caller may hand in anything).
void decode_range(const int64_t* layout_range, const int32_t* src_info, const Layout& lay, int64_t l, int64_t s,
                  int64_t& begin, int64_t& count) {
    const int64_t R = lay.num_ranks, T = lay.max_tokens, RT = R * T;
    const auto v = uint64_t(layout_range[l * R + s]);
    begin = int64_t(v >> 32);
    count = int64_t(v & 0xffffffffu);
    if (count > T || begin + count > RT) {
        throw_value_error("layout_range[" + std::to_string(l) + "][" + std::to_string(s) + "] = (begin " +
                          std::to_string(begin) + ", count " + std::to_string(count) + ") exceeds R*T = " +
                          std::to_string(RT));
    }
    for (int64_t i = 0; i < count; ++i) {
        const int32_t t = src_info[l * RT + begin + i];
        if (t < 0 || t >= T) {
            throw_value_error("src_info[" + std::to_string(l) + "][" + std::to_string(begin + i) + "] = " +
                              std::to_string(t) + " is outside [0, " + std::to_string(T) + ")");
        }
    }
}

// Returns each expert output row to its token's slot in rank s's combine_data, then signals.
// `column` picks the expert block written: this rank's (combine_data[rank*L + l]) in a peer's half,
// s's own in a staging copy that holds every destination at once (see send_to_destination).
// With `compact`, the rows go behind each other instead (row i of local expert l at combine_data
// row column*L*T + count(0..l-1) + i, in the order received = the owner's ascending token order)
// and every signal carries kCompactFlag: the owner's rows are one contiguous range of exactly the
// routed rows, which the Transfer Engine path ships in one write.
void combine_to_destination(uint8_t* half, const Layout& lay, int64_t column, int64_t s, const uint16_t* x,
                            const int32_t* src_info, const int64_t* layout_range, uint32_t tag, bool write_signals,
                            bool compact) {
    const int64_t rank = column;
    const int64_t R = lay.num_ranks, T = lay.max_tokens, H = lay.hidden, L = lay.num_local_experts, RT = R * T;
    std::vector<uint32_t> counts(static_cast<size_t>(L));
    int64_t packed = 0;  // compact rows written so far
    for (int64_t l = 0; l < L; ++l) {
        int64_t begin, count;
        decode_range(layout_range, src_info, lay, l, s, begin, count);
        counts[size_t(l)] = uint32_t(count);
        if (compact) {
            uint8_t* rows = half + lay.combine_data + (rank * L * T + packed) * lay.row_bytes;
            std::memcpy(rows, x + (l * RT + begin) * H, size_t(count * lay.row_bytes));
            packed += count;
            continue;
        }
        const int64_t e = rank * L + l;
        uint8_t* rows = half + lay.combine_data + e * T * lay.row_bytes;  // combine_data[e][0]
        for (int64_t i = 0; i < count; ++i) {
            const int64_t t = src_info[l * RT + begin + i];
            std::memcpy(rows + t * lay.row_bytes, x + (l * RT + begin + i) * H, size_t(lay.row_bytes));
        }
    }
    if (!write_signals) return;
    // All rows for s are written; now publish them (release).
    const uint32_t flag = compact ? kCompactFlag : 0u;
    for (int64_t l = 0; l < L; ++l) {
        store_release(half + lay.combine_signals + (rank * L + l) * 8, make_signal(tag, counts[size_t(l)] | flag));
    }
    wake_signal_waiters(half + lay.combine_signals + (rank * L + L - 1) * 8);
}

// Shape arguments common to all four calls.
void check_call(const Layout& lay, int64_t rank, uintptr_t active_ptr) {
    check_range(rank, 0, lay.num_ranks, "rank");
    check_nonnull(active_ptr, "active_ptr");
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Exposed calls
// ---------------------------------------------------------------------------------------------

void dispatch_send(uintptr_t x_ptr, int64_t num_tokens, int64_t hidden, uintptr_t topk_ptr, int64_t top_k,
                   int64_t num_experts, int64_t num_ranks, int64_t rank, int64_t max_tokens, uintptr_t active_ptr,
                   const std::vector<uintptr_t>& peer_half_bases, int64_t tag, bool use_fp8, int64_t dest,
                   bool write_signals, bool by_destination, bool compact, uintptr_t fp8_rows_ptr,
                   uintptr_t fp8_scales_ptr) {
    const Layout lay = compute_layout(num_ranks, max_tokens, hidden, num_experts);
    check_call(lay, rank, active_ptr);
    const uint32_t tag32 = check_tag(tag);
    check_range(dest, -1, num_ranks, "dest");
    // Token indices travel as int32 and index combine_data[e][0:T]: at most T tokens per call.
    if (num_tokens < 0 || num_tokens > max_tokens) {
        throw_value_error("num_tokens = " + std::to_string(num_tokens) +
                          " must be in [0, num_max_dispatch_tokens_per_rank = " + std::to_string(max_tokens) + "]");
    }
    check_range(top_k, 0, int64_t(1) << 31, "top_k");
    check_peer_bases(peer_half_bases, num_ranks);
    if (num_tokens > 0) {
        check_nonnull(x_ptr, "x_ptr");
        if (top_k > 0) check_nonnull(topk_ptr, "topk_ptr");
    }
    const auto* topk = reinterpret_cast<const int64_t*>(topk_ptr);
    if (num_tokens > 0 && top_k > 0) check_topk(topk, num_tokens * top_k, num_experts);

    if ((fp8_rows_ptr == 0) != (fp8_scales_ptr == 0)) {
        throw_value_error("fp8_rows_ptr and fp8_scales_ptr: expected both or neither, got " +
                          std::to_string(fp8_rows_ptr) + " and " + std::to_string(fp8_scales_ptr));
    }
    if (compact && !compact_dispatch_fits(lay)) {
        throw_value_error("compact: a compact dispatch needs at least 2 local experts and 4 * L <= 2 * hidden, got L = " +
                          std::to_string(lay.num_local_experts) + ", hidden = " + std::to_string(hidden));
    }
    const ActiveMask active(active_ptr, num_ranks);
    const std::vector<int64_t> dests = destination_order(num_ranks, rank, dest, active, peer_half_bases);
    std::vector<uint8_t> targeted(size_t(num_ranks), 0);
    for (int64_t d : dests) targeted[size_t(d)] = 1;

    thread_local Routing rt;
    build_routing(topk, num_tokens, top_k, lay, targeted, rt);

    SendRows rows;
    rows.x = reinterpret_cast<const uint16_t*>(x_ptr);
    if (use_fp8 && fp8_rows_ptr != 0) {  // quantized by the caller (once for several sends)
        rows.q = reinterpret_cast<const uint8_t*>(fp8_rows_ptr);
        rows.scales = reinterpret_cast<const float*>(fp8_scales_ptr);
    } else if (use_fp8) {
        // Quantize every routed token once; each destination then copies the same bytes.
        thread_local std::vector<uint8_t> q;
        thread_local std::vector<float> scales;
        const int64_t H = hidden, G = lay.num_scale_groups;
        q.resize(size_t(num_tokens * H));
        scales.resize(size_t(num_tokens * G));
        for (int64_t t = 0; t < num_tokens; ++t) {
            if (rt.used[size_t(t)]) quantize_row_fp8(rows.x + t * H, H, q.data() + t * H, scales.data() + t * G);
        }
        rows.q = q.data();
        rows.scales = scales.data();
    }
    for (int64_t d : dests) {
        send_to_destination(reinterpret_cast<uint8_t*>(peer_half_bases[size_t(d)]), lay, by_destination ? d : rank, d,
                            rt, rows, use_fp8, tag32, write_signals, compact);
    }
}

std::vector<int> dispatch_recv(uintptr_t local_half_base, int64_t num_ranks, int64_t rank, int64_t max_tokens,
                               int64_t hidden, int64_t num_experts, int64_t tag, uintptr_t active_ptr,
                               int64_t timeout_us, bool use_fp8, uintptr_t recv_x_ptr, uintptr_t recv_scales_ptr,
                               uintptr_t src_info_ptr, uintptr_t layout_range_ptr, uintptr_t recv_count_ptr,
                               uintptr_t abort_ptr, uintptr_t dead_ptr) {
    Waiter waiter(timeout_us);  // the deadline covers the whole call
    const Layout lay = compute_layout(num_ranks, max_tokens, hidden, num_experts);
    check_call(lay, rank, active_ptr);
    const uint32_t tag32 = check_tag(tag);
    check_nonnull(local_half_base, "local_half_base");
    check_nonnull(recv_x_ptr, "recv_x_ptr");
    if (use_fp8) check_nonnull(recv_scales_ptr, "recv_scales_ptr");
    check_nonnull(src_info_ptr, "src_info_ptr");
    check_nonnull(layout_range_ptr, "layout_range_ptr");
    check_nonnull(recv_count_ptr, "recv_count_ptr");

    const auto* half = reinterpret_cast<const uint8_t*>(local_half_base);
    ActiveMask active(active_ptr, num_ranks);
    std::vector<uint32_t> counts;
    std::vector<uint8_t> compact;
    wait_for_signals(half + lay.dispatch_signals, num_ranks, lay.num_local_experts, tag32, max_tokens, waiter, active,
                     counts, reinterpret_cast<const void*>(abort_ptr), reinterpret_cast<const int32_t*>(dead_ptr),
                     &compact);
    thread_local std::vector<std::vector<int32_t>> unions;
    validate_dispatch_sources(half, lay, counts, compact, active, unions);

    RecvOutputs out{reinterpret_cast<uint8_t*>(recv_x_ptr), reinterpret_cast<float*>(recv_scales_ptr),
                    reinterpret_cast<int32_t*>(src_info_ptr), reinterpret_cast<int64_t*>(layout_range_ptr),
                    reinterpret_cast<int32_t*>(recv_count_ptr)};
    advise_huge_pages(out.x, lay.num_local_experts * num_ranks * max_tokens * (use_fp8 ? hidden : lay.row_bytes));
    pack_dispatch(half, lay, counts, active, use_fp8, out, unions);
    return active.newly_inactive();
}

void combine_send(uintptr_t x_ptr, int64_t hidden, int64_t num_experts, int64_t num_ranks, int64_t rank,
                  int64_t max_tokens, uintptr_t src_info_ptr, uintptr_t layout_range_ptr, uintptr_t active_ptr,
                  const std::vector<uintptr_t>& peer_half_bases, int64_t tag, int64_t dest, bool write_signals,
                  bool by_destination, bool compact) {
    const Layout lay = compute_layout(num_ranks, max_tokens, hidden, num_experts);
    check_call(lay, rank, active_ptr);
    const uint32_t tag32 = check_tag(tag);
    check_range(dest, -1, num_ranks, "dest");
    check_peer_bases(peer_half_bases, num_ranks);
    check_nonnull(x_ptr, "x_ptr");
    check_nonnull(src_info_ptr, "src_info_ptr");
    check_nonnull(layout_range_ptr, "layout_range_ptr");

    const auto* x = reinterpret_cast<const uint16_t*>(x_ptr);
    const auto* src_info = reinterpret_cast<const int32_t*>(src_info_ptr);
    const auto* layout_range = reinterpret_cast<const int64_t*>(layout_range_ptr);
    const ActiveMask active(active_ptr, num_ranks);
    const std::vector<int64_t> dests = destination_order(num_ranks, rank, dest, active, peer_half_bases);

    // Validate every range and token index before the first byte goes out.
    for (int64_t s : dests) {
        for (int64_t l = 0; l < lay.num_local_experts; ++l) {
            int64_t begin, count;
            decode_range(layout_range, src_info, lay, l, s, begin, count);
        }
    }
    for (int64_t s : dests) {
        combine_to_destination(reinterpret_cast<uint8_t*>(peer_half_bases[size_t(s)]), lay, by_destination ? s : rank,
                               s, x, src_info, layout_range, tag32, write_signals, compact);
    }
}

std::vector<int> combine_recv(uintptr_t local_half_base, int64_t num_ranks, int64_t rank, int64_t max_tokens,
                              int64_t hidden, int64_t num_experts, int64_t tag, uintptr_t active_ptr,
                              int64_t timeout_us, uintptr_t topk_ptr, uintptr_t weights_ptr, int64_t num_tokens,
                              int64_t top_k, uintptr_t out_ptr, uintptr_t abort_ptr, uintptr_t dead_ptr,
                              uintptr_t bias0_ptr, uintptr_t bias1_ptr, int64_t bias_stride, int64_t bias_hidden) {
    Waiter waiter(timeout_us);
    const Layout lay = compute_layout(num_ranks, max_tokens, hidden, num_experts);
    check_call(lay, rank, active_ptr);
    const uint32_t tag32 = check_tag(tag);
    check_nonnull(local_half_base, "local_half_base");
    check_range(num_tokens, 0, max_tokens + 1, "num_tokens");
    check_range(top_k, 0, int64_t(1) << 31, "top_k");
    const auto* topk = reinterpret_cast<const int64_t*>(topk_ptr);
    const auto* weights = reinterpret_cast<const float*>(weights_ptr);
    const RowBias bias = make_row_bias(bias0_ptr, bias1_ptr, bias_stride, bias_hidden, hidden);
    if (num_tokens > 0) {
        check_nonnull(out_ptr, "out_ptr");
        if (top_k > 0) {
            check_nonnull(topk_ptr, "topk_ptr");
            check_nonnull(weights_ptr, "weights_ptr");
            check_topk(topk, num_tokens * top_k, num_experts);
        }
    }

    // Wait for the signal of every expert of every live owner, selected or not: this is what
    // makes reusing the half two calls later safe without a barrier (protocol.md).
    const auto* half = reinterpret_cast<const uint8_t*>(local_half_base);
    const int64_t L = lay.num_local_experts, T = max_tokens, H = hidden;
    ActiveMask active(active_ptr, num_ranks);
    std::vector<uint32_t> counts;
    std::vector<uint8_t> compact;
    wait_for_signals(half + lay.combine_signals, num_ranks, L, tag32, max_tokens, waiter, active, counts,
                     reinterpret_cast<const void*>(abort_ptr), reinterpret_cast<const int32_t*>(dead_ptr), &compact);

    // Compact owners: token t's row for expert e is e's (ascending, duplicates in a top-k row skipped
    // as dispatch_send's routing does) selection number behind the rows of the owner's earlier
    // experts. An owner whose counts differ from what this rank dispatched would make us read rows
    // of other tokens: it is failed instead.
    const int64_t E = num_experts;
    bool any_compact = false;
    for (int64_t p = 0; p < num_ranks; ++p) any_compact = any_compact || (active.alive(p) && compact[size_t(p)]);
    thread_local std::vector<int64_t> compact_row;  // [num_tokens * top_k], row within the owner's block
    if (any_compact) {
        std::vector<int64_t> selected(size_t(E), 0);
        compact_row.assign(size_t(num_tokens * top_k), -1);
        for (int64_t t = 0; t < num_tokens; ++t) {
            const int64_t* row = topk + t * top_k;
            for (int64_t k = 0; k < top_k; ++k) {
                const int64_t e = row[k];
                if (e < 0 || !compact[size_t(e / L)]) continue;
                int64_t j = 0;
                while (j < k && row[j] != e) ++j;
                compact_row[size_t(t * top_k + k)] =
                    j < k ? compact_row[size_t(t * top_k + j)] : selected[size_t(e)]++;
            }
        }
        for (int64_t p = 0; p < num_ranks; ++p) {
            if (!active.alive(p) || !compact[size_t(p)]) continue;
            int64_t before = 0;
            for (int64_t l = 0; l < L; ++l) {
                if (selected[size_t(p * L + l)] != int64_t(counts[size_t(p * L + l)])) {
                    active.fail(p);
                    break;
                }
                selected[size_t(p * L + l)] = before;  // now: the first row of expert p*L+l in p's block
                before += counts[size_t(p * L + l)];
            }
            if (!active.alive(p)) continue;
            for (int64_t i = 0; i < num_tokens * top_k; ++i) {
                const int64_t e = topk[i];
                if (e >= 0 && e / L == p) compact_row[size_t(i)] += p * L * T + selected[size_t(e)];
            }
        }
    }

    // Reduce in top-k order, skipping -1 and experts whose owner is inactive.
    auto* out = reinterpret_cast<uint16_t*>(out_ptr);
    const uint8_t* rows_base = half + lay.combine_data;
    // Two entries in front for the bias rows (biased_sum_row: the sum starts from them).
    std::vector<const uint16_t*> rows(size_t(std::max<int64_t>(top_k, 1) + 2));
    std::vector<float> w(rows.size());
    for (int64_t t = 0; t < num_tokens; ++t) {
        int64_t n = 0;
        for (int64_t k = 0; k < top_k; ++k) {
            const int64_t e = topk[t * top_k + k];
            if (e < 0 || !active.alive(e / L)) continue;
            const int64_t slot = compact[size_t(e / L)] ? compact_row[size_t(t * top_k + k)] : e * T + t;
            rows[size_t(2 + n)] = reinterpret_cast<const uint16_t*>(rows_base + slot * lay.row_bytes);
            w[size_t(2 + n)] = weights[t * top_k + k];
            ++n;
        }
        biased_sum_row(out + t * H, H, rows.data() + 2, w.data() + 2, n, bias, t);
    }
    return active.newly_inactive();
}

// Synchronous calls: the send phase and then the receive phase in one crossing from Python (the
// small-message round trip is dominated by per-call overhead). Same checks, same order, same results.
std::vector<int> dispatch_round(uintptr_t x_ptr, int64_t num_tokens, int64_t hidden, uintptr_t topk_ptr, int64_t top_k,
                                int64_t num_experts, int64_t num_ranks, int64_t rank, int64_t max_tokens,
                                uintptr_t active_ptr, const std::vector<uintptr_t>& peer_half_bases, int64_t tag,
                                bool use_fp8, uintptr_t local_half_base, int64_t timeout_us, uintptr_t recv_x_ptr,
                                uintptr_t recv_scales_ptr, uintptr_t src_info_ptr, uintptr_t layout_range_ptr,
                                uintptr_t recv_count_ptr, uintptr_t abort_ptr, uintptr_t dead_ptr) {
    dispatch_send(x_ptr, num_tokens, hidden, topk_ptr, top_k, num_experts, num_ranks, rank, max_tokens, active_ptr,
                  peer_half_bases, tag, use_fp8, -1, true, false, false);
    return dispatch_recv(local_half_base, num_ranks, rank, max_tokens, hidden, num_experts, tag, active_ptr, timeout_us,
                         use_fp8, recv_x_ptr, recv_scales_ptr, src_info_ptr, layout_range_ptr, recv_count_ptr, abort_ptr,
                         dead_ptr);
}

std::vector<int> combine_round(uintptr_t x_ptr, int64_t hidden, int64_t num_experts, int64_t num_ranks, int64_t rank,
                               int64_t max_tokens, uintptr_t src_info_ptr, uintptr_t layout_range_ptr,
                               uintptr_t active_ptr, const std::vector<uintptr_t>& peer_half_bases, int64_t tag,
                               uintptr_t local_half_base, int64_t timeout_us, uintptr_t topk_ptr,
                               uintptr_t weights_ptr, int64_t num_tokens, int64_t top_k, uintptr_t out_ptr,
                               uintptr_t abort_ptr, uintptr_t dead_ptr, uintptr_t bias0_ptr, uintptr_t bias1_ptr,
                               int64_t bias_stride, int64_t bias_hidden) {
    make_row_bias(bias0_ptr, bias1_ptr, bias_stride, bias_hidden, hidden);  // refused before anything is sent
    combine_send(x_ptr, hidden, num_experts, num_ranks, rank, max_tokens, src_info_ptr, layout_range_ptr, active_ptr,
                 peer_half_bases, tag, -1, true, false, false);
    return combine_recv(local_half_base, num_ranks, rank, max_tokens, hidden, num_experts, tag, active_ptr, timeout_us,
                        topk_ptr, weights_ptr, num_tokens, top_k, out_ptr, abort_ptr, dead_ptr, bias0_ptr, bias1_ptr,
                        bias_stride, bias_hidden);
}

}  // namespace mep
