// Shared helpers of the native core: number formats (bf16, FP8 e4m3fn), signal words, the
// region layout and the deadline-bounded backoff used by every wait.
//
// Nothing here knows about Python or torch; the bindings live in module.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/numerics.h"

namespace mep {

// ---------------------------------------------------------------------------------------------
// Signals: one aligned 64-bit word (tag << 32) | count
// ---------------------------------------------------------------------------------------------

// make_signal, signal_tag and signal_count are in common/numerics.h (shared with the CUDA kernels).

// Release store: every write this thread made before (the data rows) is visible to a reader
// that observes this value with an acquire load. Works across processes on a shared mapping.
inline void store_release(void* addr, uint64_t v) {
    __atomic_store_n(static_cast<uint64_t*>(addr), v, __ATOMIC_RELEASE);
}

inline uint64_t load_acquire(const void* addr) {
    return __atomic_load_n(static_cast<const uint64_t*>(addr), __ATOMIC_ACQUIRE);
}

// ---------------------------------------------------------------------------------------------
// Region layout (docs/protocol.md, "Region")
// ---------------------------------------------------------------------------------------------

constexpr int64_t kControlBytes = 4096;
constexpr int64_t kHalfAlign = 4096;
constexpr int64_t kArrayAlign = 64;
constexpr int64_t kScaleGroup = 128;

struct Layout {
    // call shape
    int64_t num_ranks = 0;       // R
    int64_t max_tokens = 0;      // T
    int64_t hidden = 0;          // H
    int64_t num_experts = 0;     // E
    // derived sizes
    int64_t control_bytes = 0;
    int64_t half_bytes = 0;
    int64_t total_bytes = 0;
    int64_t row_bytes = 0;       // 2H: one bf16 row
    int64_t num_local_experts = 0;  // L
    int64_t num_scale_groups = 0;   // G
    // byte offsets inside a half
    int64_t dispatch_data = 0;      // [L][R][T] rows of 2H bytes
    int64_t dispatch_scales = 0;    // [L][R][T][G] float32
    int64_t dispatch_src = 0;       // [L][R][T] int32
    int64_t combine_data = 0;       // [E][T] rows of 2H bytes
    int64_t dispatch_signals = 0;   // [R][L] uint64
    int64_t combine_signals = 0;    // [E] uint64
    int64_t combine_send = 0;       // [L][R*T][H] bf16
};

// Computes the layout; throws std::invalid_argument (ValueError) naming the bad argument, or if
// any size overflows int64.
Layout compute_layout(int64_t num_ranks, int64_t max_tokens, int64_t hidden, int64_t num_experts);

// ---------------------------------------------------------------------------------------------
// Deadline-bounded waiting
// ---------------------------------------------------------------------------------------------

int64_t monotonic_ns();

// One deadline for a whole call (start + timeout_us; timeout_us == -1 means none) and a backoff
// that stays polite on an oversubscribed CPU: a short spin with a pause instruction, then
// sched_yield for a while (on an idle core this is still a spin; on a busy one the peers we wait
// for get the core), then sleeps with exponential backoff. A sleep waits on a futex when the caller
// names the signal word it needs next, so a shared-memory writer that calls wake_signal_waiters()
// ends the sleep at once; writers that do not (a remote transport) are seen at the next poll. While
// it sleeps, the thread's timer slack is lowered so that short sleeps are not stretched by the
// default 50 us; the destructor restores it.
class Waiter {
public:
    explicit Waiter(int64_t timeout_us);
    ~Waiter();
    Waiter(const Waiter&) = delete;
    Waiter& operator=(const Waiter&) = delete;

    // True once the deadline has passed (never when there is no deadline).
    bool expired() const;

    // Waits a little before the next poll; never sleeps past the deadline. With `futex_word` (the
    // 4-byte aligned high half of a signal word), a sleep ends early once that word no longer
    // holds `futex_expected`.
    void backoff(const void* futex_word = nullptr, uint32_t futex_expected = 0);

private:
    static constexpr int kSpinPolls = 256;
    static constexpr int64_t kYieldNs = 1000 * 1000;
    static constexpr int64_t kFirstSleepNs = 4 * 1000;
    static constexpr int64_t kMaxSleepNs = 128 * 1000;
    static constexpr long kSleepTimerSlackNs = 1000;

    int64_t deadline_ns_;  // -1: no deadline
    int polls_ = 0;
    int64_t yield_start_ns_ = -1;
    int64_t sleep_ns_ = kFirstSleepNs;
    long saved_timer_slack_ = -1;  // >= 0 once lowered
};

// The high (tag) half of a 64-bit signal word: what a Waiter sleeps on.
inline const void* signal_futex_word(const void* signal_word) {
    static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "signal words are little-endian");
    return static_cast<const uint8_t*>(signal_word) + 4;
}

// Wakes every Waiter sleeping on this signal word (call after its release store). Cheap when
// nobody sleeps; harmless on memory no one waits on.
void wake_signal_waiters(void* signal_word);

// Receive outputs are fresh tensors of the caller; a large one (>= 32 MiB: with glibc always a
// mapping of its own) costs a page fault per 4 KiB the first time a row lands in it, which for
// hidden=7168 costs more than the copies. This asks for transparent huge pages on the whole 2 MiB
// pages inside [base, base + nbytes) (a hint, errors ignored), cutting the faults 512-fold.
void advise_huge_pages(void* base, int64_t nbytes);

// Throws std::invalid_argument unless timeout_us == -1 or timeout_us >= 0.
void check_timeout(int64_t timeout_us);

// ---------------------------------------------------------------------------------------------
// Small argument checks (all throw std::invalid_argument -> ValueError)
// ---------------------------------------------------------------------------------------------

[[noreturn]] void throw_value_error(const std::string& msg);
void check_nonnull(uintptr_t ptr, const char* name);
void check_range(int64_t v, int64_t lo, int64_t hi_exclusive, const char* name);
uint32_t check_tag(int64_t tag);

}  // namespace mep
