// Packing kernels: FP8 quantization, row gathers/scatters and the weighted top-k reduction.
// They are shared by the one-sided data plane (dataplane.cpp) and the PyTorch-collective fallback.
#include <algorithm>
#include <string>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "mep_api.h"
#include "mep_common.h"

namespace mep {

// ---------------------------------------------------------------------------------------------
// Core row primitives
// ---------------------------------------------------------------------------------------------

namespace {

// amax over |x| of one group: for bf16, the magnitude bits order like the values, and every NaN
// compares above infinity, so an integer max finds the float max and propagates NaN as torch's
// amax does (which reports the canonical quiet NaN).
inline float group_amax(const uint16_t* xg) {
    uint16_t amax_bits = 0;
    for (int64_t j = 0; j < kScaleGroup; ++j) amax_bits = std::max<uint16_t>(amax_bits, xg[j] & 0x7fffu);
    return amax_bits > 0x7f80u ? bits_float(0x7fc00000u) : bf16_to_float(amax_bits);
}

#if defined(__SSE2__)
// q[j] = e4m3fn(float(x[j]) / scale) for one 128-channel group, four lanes at a time. The same
// arithmetic as float_to_e4m3fn() (see there); explicit SSE2 because the compiler will not
// if-convert the scalar version under the default -ftrapping-math.
void quantize_group(const uint16_t* x, float scale, uint8_t* q) {
    const __m128i zero = _mm_setzero_si128();
    const __m128 vscale = _mm_set1_ps(scale);
    const __m128i abs_mask = _mm_set1_epi32(0x7fffffff);
    const __m128i one = _mm_set1_epi32(1);
    const __m128i min_normal = _mm_set1_epi32(0x3c800000);  // 2^-6
    const __m128 magic = _mm_set1_ps(8388608.0f);           // 2^23
    auto convert4 = [&](__m128i bf16_as_u32) {
        const __m128 f = _mm_div_ps(_mm_castsi128_ps(bf16_as_u32), vscale);  // true division
        const __m128i u = _mm_castps_si128(f);
        const __m128i sign = _mm_and_si128(_mm_srli_epi32(u, 24), _mm_set1_epi32(0x80));
        const __m128i mag = _mm_and_si128(u, abs_mask);
        // normal: round the dropped 20 mantissa bits to nearest even, rebias 127 -> 7
        const __m128i r = _mm_srli_epi32(mag, 20);
        const __m128i rest = _mm_and_si128(mag, _mm_set1_epi32(0xfffff));
        const __m128i above = _mm_cmpgt_epi32(rest, _mm_set1_epi32(0x80000));
        const __m128i tie = _mm_cmpeq_epi32(rest, _mm_set1_epi32(0x80000));
        const __m128i up = _mm_and_si128(_mm_or_si128(above, _mm_and_si128(tie, r)), one);
        const __m128i normal = _mm_sub_epi32(_mm_add_epi32(r, up), _mm_set1_epi32(120 << 3));
        // subnormal: round(|f| * 2^9) to an integer, input clamped to 2^-6
        const __m128i is_normal = _mm_cmpgt_epi32(mag, _mm_set1_epi32(0x3c7fffff));
        const __m128i sub_in = _mm_or_si128(_mm_and_si128(is_normal, min_normal), _mm_andnot_si128(is_normal, mag));
        const __m128 scaled = _mm_mul_ps(_mm_castsi128_ps(sub_in), _mm_set1_ps(512.0f));
        const __m128i subnormal = _mm_cvttps_epi32(_mm_sub_ps(_mm_add_ps(scaled, magic), magic));
        __m128i code = _mm_or_si128(_mm_and_si128(is_normal, normal), _mm_andnot_si128(is_normal, subnormal));
        // saturate >= 448 (incl. infinity) to 0x7e, NaN to 0x7f
        const __m128i sat = _mm_cmpgt_epi32(mag, _mm_set1_epi32(0x43dfffff));
        code = _mm_or_si128(_mm_and_si128(sat, _mm_set1_epi32(0x7e)), _mm_andnot_si128(sat, code));
        const __m128i nan = _mm_cmpgt_epi32(mag, _mm_set1_epi32(0x7f800000));
        code = _mm_or_si128(_mm_and_si128(nan, _mm_set1_epi32(0x7f)), _mm_andnot_si128(nan, code));
        return _mm_or_si128(code, sign);  // 0..255 per 32-bit lane
    };
    for (int64_t j = 0; j < kScaleGroup; j += 16) {
        const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + j));
        const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + j + 8));
        // bf16 -> float bits: each 16-bit value moves to the top half of a 32-bit lane
        const __m128i c0 = convert4(_mm_unpacklo_epi16(zero, lo));
        const __m128i c1 = convert4(_mm_unpackhi_epi16(zero, lo));
        const __m128i c2 = convert4(_mm_unpacklo_epi16(zero, hi));
        const __m128i c3 = convert4(_mm_unpackhi_epi16(zero, hi));
        // narrow 32 -> 16 -> 8 bits; values are in [0, 255], so the saturating packs are exact
        const __m128i bytes = _mm_packus_epi16(_mm_packs_epi32(c0, c1), _mm_packs_epi32(c2, c3));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + j), bytes);
    }
}
#else
void quantize_group(const uint16_t* x, float scale, uint8_t* q) {
    for (int64_t j = 0; j < kScaleGroup; ++j) q[j] = float_to_e4m3fn(bf16_to_float(x[j]) / scale);
}
#endif

}  // namespace

void quantize_row_fp8(const uint16_t* x, int64_t hidden, uint8_t* q, float* scales) {
    const int64_t groups = hidden / kScaleGroup;
    for (int64_t g = 0; g < groups; ++g) {
        float amax = group_amax(x + g * kScaleGroup);
        if (amax < 1e-4f) amax = 1e-4f;  // clamp(min=1e-4); NaN stays NaN
        const float scale = amax / 448.0f;
        scales[g] = scale;
        quantize_group(x + g * kScaleGroup, scale, q + g * kScaleGroup);
    }
}

void weighted_sum_row(uint16_t* out, int64_t hidden, const uint16_t* const* rows, const float* w, int64_t n) {
    // Channels are independent, so work in L1-sized chunks; within a channel the order over k is
    // exactly the given order: acc = acc + w[k] * x (two roundings, never an FMA).
    constexpr int64_t kChunk = 512;
    float acc[kChunk];
    for (int64_t c0 = 0; c0 < hidden; c0 += kChunk) {
        const int64_t len = std::min(kChunk, hidden - c0);
        for (int64_t j = 0; j < len; ++j) acc[j] = 0.0f;
        for (int64_t k = 0; k < n; ++k) {
            const uint16_t* r = rows[k] + c0;
            const float wk = w[k];
            for (int64_t j = 0; j < len; ++j) acc[j] = acc[j] + wk * bf16_to_float(r[j]);
        }
        for (int64_t j = 0; j < len; ++j) out[c0 + j] = float_to_bf16(acc[j]);
    }
}

// ---------------------------------------------------------------------------------------------
// Exposed packing kernels
// ---------------------------------------------------------------------------------------------

namespace {

void check_count(int64_t n, const char* name) {
    if (n < 0) throw_value_error(std::string(name) + " = " + std::to_string(n) + " must be >= 0");
}

void check_hidden(int64_t hidden) {
    if (hidden <= 0 || hidden % kScaleGroup != 0) {
        throw_value_error("hidden = " + std::to_string(hidden) + " must be a positive multiple of 128");
    }
}

// All indices must be >= 0; checked before anything is written.
void check_indices_nonnegative(const int64_t* index, int64_t n, const char* name) {
    for (int64_t i = 0; i < n; ++i) {
        if (index[i] < 0) {
            throw_value_error(std::string(name) + "[" + std::to_string(i) + "] = " + std::to_string(index[i]) +
                              " is negative");
        }
    }
}

}  // namespace

void gather_rows(uintptr_t dst_ptr, int64_t dst_stride, uintptr_t src_ptr, int64_t src_stride, int64_t row_bytes,
                 uintptr_t index_ptr, int64_t n) {
    check_count(n, "n");
    check_count(row_bytes, "row_bytes");
    if (n == 0 || row_bytes == 0) return;
    check_nonnull(dst_ptr, "dst_ptr");
    check_nonnull(src_ptr, "src_ptr");
    check_nonnull(index_ptr, "index_ptr");
    const auto* index = reinterpret_cast<const int64_t*>(index_ptr);
    check_indices_nonnegative(index, n, "index");
    auto* dst = reinterpret_cast<uint8_t*>(dst_ptr);
    const auto* src = reinterpret_cast<const uint8_t*>(src_ptr);
    for (int64_t i = 0; i < n; ++i) std::memcpy(dst + i * dst_stride, src + index[i] * src_stride, size_t(row_bytes));
}

void scatter_rows(uintptr_t dst_ptr, int64_t dst_stride, uintptr_t src_ptr, int64_t src_stride, int64_t row_bytes,
                  uintptr_t index_ptr, int64_t n) {
    check_count(n, "n");
    check_count(row_bytes, "row_bytes");
    if (n == 0 || row_bytes == 0) return;
    check_nonnull(dst_ptr, "dst_ptr");
    check_nonnull(src_ptr, "src_ptr");
    check_nonnull(index_ptr, "index_ptr");
    const auto* index = reinterpret_cast<const int64_t*>(index_ptr);
    check_indices_nonnegative(index, n, "index");
    auto* dst = reinterpret_cast<uint8_t*>(dst_ptr);
    const auto* src = reinterpret_cast<const uint8_t*>(src_ptr);
    for (int64_t i = 0; i < n; ++i) std::memcpy(dst + index[i] * dst_stride, src + i * src_stride, size_t(row_bytes));
}

void quantize_fp8_rows(uintptr_t src_ptr, int64_t src_stride, uintptr_t index_ptr, int64_t n, int64_t hidden,
                       uintptr_t dst_ptr, uintptr_t scales_ptr) {
    check_count(n, "n");
    check_hidden(hidden);
    if (n == 0) return;
    check_nonnull(src_ptr, "src_ptr");
    check_nonnull(dst_ptr, "dst_ptr");
    check_nonnull(scales_ptr, "scales_ptr");
    const auto* index = reinterpret_cast<const int64_t*>(index_ptr);  // may be null: identity
    if (index) check_indices_nonnegative(index, n, "index");
    const auto* src = reinterpret_cast<const uint8_t*>(src_ptr);
    auto* dst = reinterpret_cast<uint8_t*>(dst_ptr);
    auto* scales = reinterpret_cast<float*>(scales_ptr);
    const int64_t groups = hidden / kScaleGroup;
    for (int64_t i = 0; i < n; ++i) {
        const int64_t r = index ? index[i] : i;
        quantize_row_fp8(reinterpret_cast<const uint16_t*>(src + r * src_stride), hidden, dst + i * hidden,
                         scales + i * groups);
    }
}

void scatter_fp8_rows(uintptr_t data_ptr, uintptr_t scales_ptr, int64_t n, int64_t hidden, uintptr_t pos_ptr,
                      uintptr_t recv_x_ptr, uintptr_t recv_scales_ptr, int64_t rows_per_expert) {
    check_count(n, "n");
    check_hidden(hidden);
    if (rows_per_expert <= 0) throw_value_error("rows_per_expert must be > 0");
    if (n == 0) return;
    check_nonnull(data_ptr, "data_ptr");
    check_nonnull(scales_ptr, "scales_ptr");
    check_nonnull(pos_ptr, "pos_ptr");
    check_nonnull(recv_x_ptr, "recv_x_ptr");
    check_nonnull(recv_scales_ptr, "recv_scales_ptr");
    const auto* pos = reinterpret_cast<const int64_t*>(pos_ptr);
    check_indices_nonnegative(pos, n, "pos");
    const auto* data = reinterpret_cast<const uint8_t*>(data_ptr);
    const auto* scales = reinterpret_cast<const float*>(scales_ptr);
    auto* recv_x = reinterpret_cast<uint8_t*>(recv_x_ptr);
    auto* recv_scales = reinterpret_cast<float*>(recv_scales_ptr);
    const int64_t groups = hidden / kScaleGroup;
    for (int64_t i = 0; i < n; ++i) {
        const int64_t p = pos[i];
        const int64_t l = p / rows_per_expert, j = p % rows_per_expert;
        std::memcpy(recv_x + p * hidden, data + i * hidden, size_t(hidden));
        // Scales are stored token-contiguous: physical [L][G][rows_per_expert].
        for (int64_t g = 0; g < groups; ++g) recv_scales[(l * groups + g) * rows_per_expert + j] = scales[i * groups + g];
    }
}

void combine_reduce(uintptr_t out_ptr, int64_t num_tokens, int64_t hidden, int64_t top_k, uintptr_t row_index_ptr,
                    uintptr_t weights_ptr, uintptr_t rows_base_ptr, int64_t row_stride) {
    check_count(num_tokens, "num_tokens");
    check_count(top_k, "top_k");
    if (hidden <= 0) throw_value_error("hidden must be > 0");
    if (num_tokens == 0) return;
    check_nonnull(out_ptr, "out_ptr");
    if (top_k > 0) {
        check_nonnull(row_index_ptr, "row_index_ptr");
        check_nonnull(weights_ptr, "weights_ptr");
        check_nonnull(rows_base_ptr, "rows_base_ptr");
    }
    const auto* row_index = reinterpret_cast<const int64_t*>(row_index_ptr);
    const auto* weights = reinterpret_cast<const float*>(weights_ptr);
    const auto* base = reinterpret_cast<const uint8_t*>(rows_base_ptr);
    auto* out = reinterpret_cast<uint16_t*>(out_ptr);

    std::vector<const uint16_t*> rows(size_t(std::max<int64_t>(top_k, 1)));
    std::vector<float> w(rows.size());
    for (int64_t t = 0; t < num_tokens; ++t) {
        int64_t n = 0;
        for (int64_t k = 0; k < top_k; ++k) {
            const int64_t idx = row_index[t * top_k + k];
            if (idx < 0) continue;  // -1: not selected
            rows[size_t(n)] = reinterpret_cast<const uint16_t*>(base + idx * row_stride);
            w[size_t(n)] = weights[t * top_k + k];
            ++n;
        }
        weighted_sum_row(out + t * hidden, hidden, rows.data(), w.data(), n);
    }
}

}  // namespace mep
