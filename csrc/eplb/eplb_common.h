// Shared by the EPLB placement code (eplb/search.cpp, eplb/refine.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <exception>
#include <limits>
#include <mutex>
#include <thread>
#include <vector>

namespace mep {

constexpr double kNoSwap = std::numeric_limits<double>::infinity();

// The larger of the two bin loads after a swap moves an item of size `sa` out of a bin of load
// `lh` and one of size `sb` back from a bin of load `ll`; kNoSwap unless that is below lh - tol.
// max(lh - d, ll + d) == (lh + ll) / 2 + |d - (lh - ll) / 2| with d = sa - sb.
inline double swap_peak(double lh, double ll, double sa, double sb, double tol) {
    const double half_gap = 0.5 * (lh - ll);
    const double off = std::abs(sa - sb - half_gap);
    if (off >= half_gap - tol) return kNoSwap;
    return off + (lh - half_gap);
}

// 1e-12 of a load: smaller changes are rounding noise, not improvements.
inline double load_tolerance(double load) { return 1e-12 * std::max(std::abs(load), 1e-300); }

// Run `work` on min(threads, rows) threads (this one included) and wait for all; `work` takes rows
// from a shared counter. The first exception a thread throws is rethrown here after every thread
// has finished (an exception escaping a std::thread would terminate the process).
template <typename Work>
void run_on_threads(Work& work, int64_t threads, int64_t rows) {
    std::exception_ptr failure;
    std::mutex lock;
    auto guarded = [&]() {
        try {
            work();
        } catch (...) {
            std::lock_guard<std::mutex> hold(lock);
            if (!failure) failure = std::current_exception();
        }
    };
    const int64_t helpers = std::min<int64_t>(std::max<int64_t>(threads, 1), rows) - 1;
    std::vector<std::thread> pool;
    for (int64_t t = 0; t < helpers; ++t) pool.emplace_back(guarded);
    guarded();
    for (auto& t : pool) t.join();
    if (failure) std::rethrow_exception(failure);
}

}  // namespace mep
