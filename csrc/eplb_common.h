// Shared by the EPLB placement code (eplb_search.cpp, eplb_refine.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>

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

}  // namespace mep
