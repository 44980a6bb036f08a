// The ElasticBuffer's per-token work on host tensors, one pass each way (elastic_buffer/rows.py holds
// the same computations in torch, used on devices; tests/test_elastic_native_rows.py keeps them equal).
//
// elastic_pack_rows: checks the top-k ids, computes the inner routing and lays out the inner dispatch
// rows. elastic_unpack_rows: splits received rows into the token, its scales, local top-k ids and
// weights, and counts the received (token, local expert) pairs. elastic_sources: where the inner
// dispatch put a slot's rows (one range when its blocks follow each other and the tokens ascend).
// elastic_write_partials / elastic_read_combined: a combine's rows in and out of the inner Buffer.
#include <climits>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "dataplane/api.h"
#include "common/mep_common.h"

namespace mep {

namespace {
constexpr int64_t kInnerSlots = 3;  // inner experts per rank: data, bias 0, bias 1 (rows.INNER_SLOTS)
constexpr int64_t kMaxTopk = 31;    // rows.MAX_TOPK

void within(int64_t value, int64_t low, int64_t high, const char* name) {
    if (value < low || value > high)
        throw std::invalid_argument(std::string(name) + ": expected " + std::to_string(low) + " to " +
                                    std::to_string(high) + ", got " + std::to_string(value));
}
}  // namespace

std::vector<int64_t> elastic_pack_rows(uintptr_t x_ptr, int64_t x_bytes, uintptr_t scales_ptr, int64_t scales_bytes,
                                       uintptr_t topk_ptr, int64_t num_tokens, int64_t top_k, int64_t num_experts,
                                       int64_t num_ranks, int64_t rank, int64_t num_bias, uintptr_t weights_ptr,
                                       uintptr_t rows_ptr, int64_t row_bytes, uintptr_t inner_topk_ptr) {
    within(num_tokens, 0, int64_t(1) << 40, "num_tokens");
    within(top_k, 1, kMaxTopk, "top_k");
    within(num_ranks, 1, int64_t(1) << 20, "num_ranks");
    within(rank, 0, num_ranks - 1, "rank");
    within(num_bias, 0, 2, "num_bias");
    within(num_experts, num_ranks, int64_t(1) << 40, "num_experts");
    if (num_experts % num_ranks) throw std::invalid_argument("num_experts: expected a multiple of num_ranks");
    within(x_bytes, 0, row_bytes, "x_bytes");
    within(scales_bytes, 0, row_bytes, "scales_bytes");
    if (x_bytes + scales_bytes + 8 * top_k > row_bytes)
        throw std::invalid_argument("row_bytes: expected room for the token, its scales, ids and weights");
    if (num_tokens == 0) return {0, -1};
    check_nonnull(x_ptr, "x_ptr");
    check_nonnull(topk_ptr, "topk_ptr");
    check_nonnull(rows_ptr, "rows_ptr");
    check_nonnull(inner_topk_ptr, "inner_topk_ptr");
    if (scales_bytes) check_nonnull(scales_ptr, "scales_ptr");
    const auto* x = reinterpret_cast<const uint8_t*>(x_ptr);
    const auto* scales = reinterpret_cast<const uint8_t*>(scales_ptr);
    const auto* topk = reinterpret_cast<const int64_t*>(topk_ptr);
    const auto* weights = reinterpret_cast<const uint8_t*>(weights_ptr);
    auto* rows = reinterpret_cast<uint8_t*>(rows_ptr);
    auto* inner = reinterpret_cast<int64_t*>(inner_topk_ptr);
    const int64_t local = num_experts / num_ranks;
    const int64_t groups = std::min(top_k, num_ranks);
    const int64_t inner_k = num_bias + groups;
    // First pass: every id checked before anything is written (a bad call changes nothing).
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t* ids = topk + t * top_k;
        for (int64_t k = 0; k < top_k; ++k) {
            if (ids[k] < -1 || ids[k] >= num_experts) return {1, t};
            if (ids[k] < 0) continue;
            for (int64_t j = 0; j < k; ++j)
                if (ids[j] == ids[k]) return {2, t};
        }
    }
    int64_t owner[kMaxTopk];
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t* ids = topk + t * top_k;
        int64_t* out = inner + t * inner_k;
        for (int64_t b = 0; b < num_bias; ++b) out[b] = kInnerSlots * rank + 1 + b;
        for (int64_t k = 0; k < top_k; ++k) owner[k] = ids[k] >= 0 ? ids[k] / local : -1;
        // A rank's group sits at the position of its last entry: entry k is a rank's last when no later
        // entry has the same owner. Groups in order of those positions, -1 padding after.
        int64_t n = 0;
        for (int64_t k = 0; k < top_k && n < groups; ++k) {
            if (owner[k] < 0) continue;
            bool last = true;
            for (int64_t j = k + 1; j < top_k && last; ++j) last = owner[j] != owner[k];
            if (last) out[num_bias + n++] = kInnerSlots * owner[k];
        }
        for (; n < groups; ++n) out[num_bias + n] = -1;
        uint8_t* row = rows + t * row_bytes;
        std::memcpy(row, x + t * x_bytes, size_t(x_bytes));
        int64_t at = x_bytes;
        if (scales_bytes) std::memcpy(row + at, scales + t * scales_bytes, size_t(scales_bytes));
        at += scales_bytes;
        for (int64_t k = 0; k < top_k; ++k) {
            const int32_t id = int32_t(ids[k]);
            std::memcpy(row + at + 4 * k, &id, 4);
        }
        at += 4 * top_k;
        if (weights) std::memcpy(row + at, weights + t * 4 * top_k, size_t(4 * top_k));
        else std::memset(row + at, 0, size_t(4 * top_k));
        at += 4 * top_k;
        std::memset(row + at, 0, size_t(row_bytes - at));
    }
    return {0, -1};
}

void elastic_unpack_rows(uintptr_t rows_ptr, int64_t row_stride, int64_t num_rows, int64_t x_bytes,
                         int64_t scales_bytes, int64_t top_k, int64_t first_expert, int64_t num_local,
                         uintptr_t x_ptr, uintptr_t scales_ptr, uintptr_t local_ptr, uintptr_t weights_ptr,
                         uintptr_t counts_ptr) {
    within(num_rows, 0, int64_t(1) << 40, "num_rows");
    within(top_k, 1, kMaxTopk, "top_k");
    within(num_local, 1, int64_t(1) << 30, "num_local");
    within(x_bytes, 0, row_stride, "x_bytes");
    within(scales_bytes, 0, row_stride, "scales_bytes");
    if (x_bytes + scales_bytes + 8 * top_k > row_stride)
        throw std::invalid_argument("row_stride: expected room for the token, its scales, ids and weights");
    check_nonnull(counts_ptr, "counts_ptr");
    auto* counts = reinterpret_cast<int64_t*>(counts_ptr);
    std::memset(counts, 0, size_t(8 * num_local));
    if (num_rows == 0) return;
    check_nonnull(rows_ptr, "rows_ptr");
    check_nonnull(x_ptr, "x_ptr");
    check_nonnull(local_ptr, "local_ptr");
    check_nonnull(weights_ptr, "weights_ptr");
    if (scales_bytes) check_nonnull(scales_ptr, "scales_ptr");
    const auto* rows = reinterpret_cast<const uint8_t*>(rows_ptr);
    auto* x = reinterpret_cast<uint8_t*>(x_ptr);
    auto* scales = reinterpret_cast<uint8_t*>(scales_ptr);
    auto* local = reinterpret_cast<int64_t*>(local_ptr);
    auto* weights = reinterpret_cast<uint8_t*>(weights_ptr);
    for (int64_t i = 0; i < num_rows; ++i) {
        const uint8_t* row = rows + i * row_stride;
        std::memcpy(x + i * x_bytes, row, size_t(x_bytes));
        if (scales_bytes) std::memcpy(scales + i * scales_bytes, row + x_bytes, size_t(scales_bytes));
        const uint8_t* ids = row + x_bytes + scales_bytes;
        int64_t* out = local + i * top_k;
        for (int64_t k = 0; k < top_k; ++k) {
            int32_t id;
            std::memcpy(&id, ids + 4 * k, 4);
            const int64_t j = int64_t(id) - first_expert;  // a peer's id: anything not ours is -1
            if (j >= 0 && j < num_local) {
                out[k] = j;
                ++counts[j];
            } else {
                out[k] = -1;
            }
        }
        std::memcpy(weights + i * 4 * top_k, ids + 4 * top_k, size_t(4 * top_k));
    }
}

std::vector<int64_t> elastic_sources(uintptr_t src_info_ptr, uintptr_t layout_words_ptr, int64_t num_ranks,
                                     int64_t num_max_tokens, uintptr_t src_global_ptr) {
    within(num_ranks, 1, int64_t(1) << 20, "num_ranks");
    within(num_max_tokens, 1, int64_t(1) << 40, "num_max_tokens");
    check_nonnull(layout_words_ptr, "layout_words_ptr");
    const auto* words = reinterpret_cast<const int64_t*>(layout_words_ptr);
    const int64_t capacity = num_ranks * num_max_tokens;
    int64_t first = -1, stop = -1;
    for (int64_t source = 0; source < num_ranks; ++source) {
        const uint64_t word = uint64_t(words[source]);
        const int64_t count = int64_t(word & 0xFFFFFFFFull), begin = int64_t(word >> 32);
        if (count == 0) continue;
        if (begin + count > capacity) return {3, 0, 0};  // not a layout of this shape: the caller's torch path
        if (first < 0) first = stop = begin;
        if (begin != stop) return {1, 0, 0};  // a gap or blocks out of source order
        stop = begin + count;
    }
    if (first < 0) return {0, 0, 0};
    check_nonnull(src_info_ptr, "src_info_ptr");
    check_nonnull(src_global_ptr, "src_global_ptr");
    const auto* src_info = reinterpret_cast<const int32_t*>(src_info_ptr);
    auto* out = reinterpret_cast<int64_t*>(src_global_ptr);
    int64_t at = 0, previous = INT64_MIN;
    for (int64_t source = 0; source < num_ranks; ++source) {
        const uint64_t word = uint64_t(words[source]);
        const int64_t count = int64_t(word & 0xFFFFFFFFull), begin = int64_t(word >> 32);
        for (int64_t row = begin; row < begin + count; ++row) {
            const int64_t global = source * num_max_tokens + int64_t(src_info[row]);
            if (global <= previous) return {2, first, stop};  // not ascending: the caller sorts
            out[at++] = previous = global;
        }
    }
    return {0, first, stop};
}

namespace {
// bf16 bits of the numbers 0..255 (exact: at most 8 significant bits).
struct ByteNumbers {
    uint16_t bits[256];
    ByteNumbers() {
        for (int b = 0; b < 256; ++b) {
            const float value = float(b);
            uint32_t word;
            std::memcpy(&word, &value, 4);
            bits[b] = uint16_t(word >> 16);
        }
    }
};
const ByteNumbers kByteNumbers;
}  // namespace

void elastic_write_partials(uintptr_t rows_ptr, int64_t row_stride, uintptr_t partial_ptr, int64_t partial_stride,
                            int64_t num_rows, int64_t partial_bytes, uintptr_t weights_ptr, uintptr_t local_ptr,
                            int64_t top_k) {
    within(num_rows, 0, int64_t(1) << 40, "num_rows");
    within(top_k, 1, kMaxTopk, "top_k");
    within(partial_bytes, 0, int64_t(1) << 30, "partial_bytes");
    if (partial_bytes + 8 * top_k > row_stride)
        throw std::invalid_argument("row_stride: expected room for the partial and 4 * top_k weight bytes");
    if (partial_stride < partial_bytes) throw std::invalid_argument("partial_stride: expected >= partial_bytes");
    if (num_rows == 0) return;
    check_nonnull(rows_ptr, "rows_ptr");
    check_nonnull(partial_ptr, "partial_ptr");
    check_nonnull(local_ptr, "local_ptr");
    auto* rows = reinterpret_cast<uint8_t*>(rows_ptr);
    const auto* partial = reinterpret_cast<const uint8_t*>(partial_ptr);
    const auto* weights = reinterpret_cast<const uint8_t*>(weights_ptr);
    const auto* local = reinterpret_cast<const int64_t*>(local_ptr);
    for (int64_t i = 0; i < num_rows; ++i) {
        uint8_t* row = rows + i * row_stride;
        std::memcpy(row, partial + i * partial_stride, size_t(partial_bytes));
        uint16_t numbers[4 * kMaxTopk];
        for (int64_t k = 0; k < top_k; ++k) {
            const bool mine = weights != nullptr && local[i * top_k + k] >= 0;
            for (int64_t b = 0; b < 4; ++b)
                numbers[4 * k + b] = mine ? kByteNumbers.bits[weights[(i * top_k + k) * 4 + b]] : 0;
        }
        std::memcpy(row + partial_bytes, numbers, size_t(8 * top_k));
    }
}

void elastic_read_combined(uintptr_t rows_ptr, int64_t row_stride, int64_t num_rows, int64_t x_bytes, int64_t top_k,
                           uintptr_t x_ptr, uintptr_t weights_ptr) {
    within(num_rows, 0, int64_t(1) << 40, "num_rows");
    within(top_k, 1, kMaxTopk, "top_k");
    within(x_bytes, 0, int64_t(1) << 30, "x_bytes");
    if (x_bytes + (weights_ptr ? 8 * top_k : 0) > row_stride)
        throw std::invalid_argument("row_stride: expected room for the token and 4 * top_k weight numbers");
    if (num_rows == 0) return;
    check_nonnull(rows_ptr, "rows_ptr");
    check_nonnull(x_ptr, "x_ptr");
    const auto* rows = reinterpret_cast<const uint8_t*>(rows_ptr);
    auto* x = reinterpret_cast<uint8_t*>(x_ptr);
    auto* weights = reinterpret_cast<uint8_t*>(weights_ptr);
    for (int64_t i = 0; i < num_rows; ++i) {
        const uint8_t* row = rows + i * row_stride;
        std::memcpy(x + i * x_bytes, row, size_t(x_bytes));
        if (weights == nullptr) continue;
        uint16_t numbers[4 * kMaxTopk];
        std::memcpy(numbers, row + x_bytes, size_t(8 * top_k));
        for (int64_t j = 0; j < 4 * top_k; ++j) {
            const uint32_t word = uint32_t(numbers[j]) << 16;
            float value;
            std::memcpy(&value, &word, 4);
            // torch's bf16 -> uint8 conversion (a truncating cast through int) for the sums' 0..255
            weights[i * 4 * top_k + j] = uint8_t(int32_t(value));
        }
    }
}

}  // namespace mep
