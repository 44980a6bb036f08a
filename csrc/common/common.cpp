// Region layout, deadlines/backoff and argument checks.
#include "common/mep_common.h"

#include <linux/futex.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <climits>

#include <algorithm>

namespace mep {

// ---------------------------------------------------------------------------------------------
// Argument checks
// ---------------------------------------------------------------------------------------------

void throw_value_error(const std::string& msg) { throw std::invalid_argument(msg); }

void check_nonnull(uintptr_t ptr, const char* name) {
    if (ptr == 0) throw_value_error(std::string(name) + " must not be 0 (null pointer)");
}

void check_range(int64_t v, int64_t lo, int64_t hi_exclusive, const char* name) {
    if (v < lo || v >= hi_exclusive) {
        throw_value_error(std::string(name) + " = " + std::to_string(v) + " is outside [" + std::to_string(lo) +
                          ", " + std::to_string(hi_exclusive) + ")");
    }
}

uint32_t check_tag(int64_t tag) {
    if (tag <= 0 || tag > int64_t(0xffffffffLL)) {
        throw_value_error("tag = " + std::to_string(tag) + " must be a nonzero 32-bit call number");
    }
    return uint32_t(tag);
}

void check_timeout(int64_t timeout_us) {
    if (timeout_us < -1) {
        throw_value_error("timeout_us = " + std::to_string(timeout_us) + " must be -1 (no deadline) or >= 0");
    }
}

// ---------------------------------------------------------------------------------------------
// Layout
// ---------------------------------------------------------------------------------------------

namespace {

// int64 arithmetic that reports overflow as a ValueError naming the call shape.
class Checked {
public:
    explicit Checked(std::string shape) : shape_(std::move(shape)) {}

    int64_t mul(int64_t a, int64_t b) const {
        int64_t r;
        if (__builtin_mul_overflow(a, b, &r)) overflow();
        return r;
    }
    int64_t add(int64_t a, int64_t b) const {
        int64_t r;
        if (__builtin_add_overflow(a, b, &r)) overflow();
        return r;
    }
    int64_t align_up(int64_t v, int64_t a) const { return add(v, a - 1) / a * a; }

private:
    [[noreturn]] void overflow() const { throw_value_error("region size overflows int64 for " + shape_); }
    std::string shape_;
};

void check_positive(int64_t v, const char* name) {
    if (v <= 0) throw_value_error(std::string(name) + " = " + std::to_string(v) + " must be > 0");
}

}  // namespace

Layout compute_layout(int64_t num_ranks, int64_t max_tokens, int64_t hidden, int64_t num_experts) {
    check_positive(num_ranks, "num_ranks");
    check_positive(max_tokens, "num_max_dispatch_tokens_per_rank");
    check_positive(hidden, "hidden");
    check_positive(num_experts, "num_experts");
    if (hidden % kScaleGroup != 0) {
        throw_value_error("hidden = " + std::to_string(hidden) + " must be a multiple of 128");
    }
    if (num_experts % num_ranks != 0) {
        throw_value_error("num_experts = " + std::to_string(num_experts) + " must be a multiple of num_ranks = " +
                          std::to_string(num_ranks));
    }

    const Checked c("num_ranks=" + std::to_string(num_ranks) + ", num_max_dispatch_tokens_per_rank=" +
                    std::to_string(max_tokens) + ", hidden=" + std::to_string(hidden) +
                    ", num_experts=" + std::to_string(num_experts));
    Layout lay;
    lay.num_ranks = num_ranks;
    lay.max_tokens = max_tokens;
    lay.hidden = hidden;
    lay.num_experts = num_experts;
    lay.control_bytes = kControlBytes;
    lay.row_bytes = c.mul(hidden, 2);
    lay.num_local_experts = num_experts / num_ranks;
    lay.num_scale_groups = hidden / kScaleGroup;

    const int64_t L = lay.num_local_experts, R = num_ranks, T = max_tokens, E = num_experts;
    const int64_t slots = c.mul(c.mul(L, R), T);  // L*R*T dispatch slots (= L * R*T rows)

    // Arrays in protocol order, each at a 64-byte aligned offset.
    int64_t off = 0;
    auto place = [&](int64_t bytes) {
        const int64_t at = c.align_up(off, kArrayAlign);
        off = c.add(at, bytes);
        return at;
    };
    lay.dispatch_data = place(c.mul(slots, lay.row_bytes));
    lay.dispatch_scales = place(c.mul(c.mul(slots, lay.num_scale_groups), 4));
    lay.dispatch_src = place(c.mul(slots, 4));
    lay.combine_data = place(c.mul(c.mul(E, T), lay.row_bytes));
    lay.dispatch_signals = place(c.mul(c.mul(R, L), 8));
    lay.combine_signals = place(c.mul(E, 8));
    lay.combine_send = place(c.mul(slots, lay.row_bytes));

    lay.half_bytes = c.align_up(off, kHalfAlign);
    lay.total_bytes = c.add(kControlBytes, c.mul(lay.half_bytes, 2));
    return lay;
}

// ---------------------------------------------------------------------------------------------
// Waiting
// ---------------------------------------------------------------------------------------------

int64_t monotonic_ns() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return int64_t(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield" ::: "memory");
#else
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
#endif
}

}  // namespace

Waiter::Waiter(int64_t timeout_us) {
    check_timeout(timeout_us);
    if (timeout_us < 0) {
        deadline_ns_ = -1;
    } else {
        // Clamp absurdly long timeouts instead of overflowing.
        const int64_t cap_us = int64_t(1) << 40;
        deadline_ns_ = monotonic_ns() + std::min(timeout_us, cap_us) * 1000;
    }
}

Waiter::~Waiter() {
    if (saved_timer_slack_ >= 0) prctl(PR_SET_TIMERSLACK, saved_timer_slack_, 0, 0, 0);
}

bool Waiter::expired() const { return deadline_ns_ >= 0 && monotonic_ns() >= deadline_ns_; }

void Waiter::backoff(const void* futex_word, uint32_t futex_expected) {
    // Phase 1: spin briefly; data often arrives within microseconds when the peer is running.
    if (polls_ < kSpinPolls) {
        ++polls_;
        cpu_relax();
        return;
    }
    // Phase 2: give the core to a peer that may be the one we wait for. With a core to spare this
    // keeps polling (waking a sleeping thread costs tens of microseconds, more in a VM).
    const int64_t now = monotonic_ns();
    if (yield_start_ns_ < 0) yield_start_ns_ = now;
    if (now - yield_start_ns_ < kYieldNs) {
        sched_yield();
        return;
    }
    // Phase 3: sleep, doubling up to the cap, never past the deadline, with a small timer slack
    // (the default 50 us would stretch every short sleep).
    int64_t ns = sleep_ns_;
    if (deadline_ns_ >= 0) {
        const int64_t left = deadline_ns_ - now;
        if (left <= 0) return;
        ns = std::min(ns, left);
    }
    if (saved_timer_slack_ < 0) {
        const int old = prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
        if (old >= 0 && prctl(PR_SET_TIMERSLACK, kSleepTimerSlackNs, 0, 0, 0) == 0) saved_timer_slack_ = old;
    }
    timespec ts{time_t(ns / 1000000000LL), long(ns % 1000000000LL)};
    if (futex_word != nullptr) {
        // Shared (not private) futex: the word lives in memory mapped by several processes. Returns
        // at once if the word changed already, on a wake, on the timeout or on a signal.
        syscall(SYS_futex, futex_word, FUTEX_WAIT, futex_expected, &ts, nullptr, 0);
    } else {
        nanosleep(&ts, nullptr);  // EINTR just means an earlier poll
    }
    sleep_ns_ = std::min(sleep_ns_ * 2, kMaxSleepNs);
}

void advise_huge_pages(void* base, int64_t nbytes) {
    constexpr int64_t kMinBytes = int64_t(32) << 20;
    constexpr uintptr_t kHuge = uintptr_t(2) << 20;
    if (base == nullptr || nbytes < kMinBytes) return;
    const uintptr_t start = (uintptr_t(base) + kHuge - 1) & ~(kHuge - 1);
    const uintptr_t end = (uintptr_t(base) + uintptr_t(nbytes)) & ~(kHuge - 1);
#ifdef MADV_HUGEPAGE
    if (end > start) madvise(reinterpret_cast<void*>(start), size_t(end - start), MADV_HUGEPAGE);
#endif
}

void wake_signal_waiters(void* signal_word) {
    syscall(SYS_futex, signal_futex_word(signal_word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

}  // namespace mep
