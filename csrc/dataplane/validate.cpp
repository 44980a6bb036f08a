// Value checks the Python layer asks for before any byte moves: one pass over small int arrays
// instead of a dozen tensor operations. They only read; a non-empty result describes the first
// violation and the caller raises an error that names the argument.
#include <cstdint>
#include <string>

#include "dataplane/api.h"

namespace mep {

std::string check_topk_values(uintptr_t topk_ptr, int64_t num_tokens, int64_t top_k, int64_t num_experts) {
    if (num_tokens == 0 || top_k == 0) return {};
    const int64_t* topk = reinterpret_cast<const int64_t*>(topk_ptr);
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t* row = topk + t * top_k;
        for (int64_t k = 0; k < top_k; ++k) {
            const int64_t e = row[k];
            if (e < -1 || e >= num_experts) {
                return "values in [-1, " + std::to_string(num_experts) + "), got " + std::to_string(e) +
                       " at row " + std::to_string(t) + ", column " + std::to_string(k);
            }
            if (e < 0) continue;
            for (int64_t j = 0; j < k; ++j) {
                if (row[j] == e) {
                    return "distinct experts within a row (-1 may repeat), got expert " + std::to_string(e) +
                           " twice in row " + std::to_string(t);
                }
            }
        }
    }
    return {};
}

std::string check_mask_values(uintptr_t mask_ptr, int64_t n) {
    const int32_t* mask = reinterpret_cast<const int32_t*>(mask_ptr);
    for (int64_t i = 0; i < n; ++i) {
        if (mask[i] != 0 && mask[i] != 1) {
            return "only 0 (inactive) and 1 (active), got " + std::to_string(mask[i]) + " at index " +
                   std::to_string(i);
        }
    }
    return {};
}

std::string check_call_values(uintptr_t topk_ptr, int64_t num_tokens, int64_t top_k, int64_t num_experts,
                              uintptr_t mask_ptr, int64_t num_ranks) {
    std::string problem = check_topk_values(topk_ptr, num_tokens, top_k, num_experts);
    if (!problem.empty()) return "topk_idx: expected " + problem;
    problem = check_mask_values(mask_ptr, num_ranks);
    if (!problem.empty()) return "active_ranks: expected " + problem;
    return {};
}

}  // namespace mep
