// Packing kernels: FP8 quantization, row gathers/scatters and the weighted top-k reduction.
// They are shared by the one-sided data plane (dataplane.cpp) and the PyTorch-collective fallback.
#include <algorithm>
#include <string>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "dataplane/api.h"
#include "common/mep_common.h"
#include "dataplane/rows.h"

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
    return bf16_amax_from_bits(amax_bits);
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
        const float scale = fp8_group_scale(group_amax(x + g * kScaleGroup));
        scales[g] = scale;
        quantize_group(x + g * kScaleGroup, scale, q + g * kScaleGroup);
    }
}

#if defined(__x86_64__)
namespace {

// The AVX2 form of weighted_sum_row below: the same operations in the same order per channel
// (acc starts at +0.0f; acc = acc + w[k] * x as a separate multiply and add, never an FMA; then
// round to bf16 to nearest even, NaN kept quiet), 32 channels at a time in registers.
__attribute__((target("avx2"))) inline __m256 bf16x8_to_f32(const uint16_t* p) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

__attribute__((target("avx2"))) inline __m256i f32x8_to_bf16_bits(__m256 f) {
    const __m256i u = _mm256_castps_si256(f);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i quiet_nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x0040));
    const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                              _mm256_set1_epi32(0x7f800000));
    return _mm256_blendv_epi8(rounded, quiet_nan, is_nan);  // 32-bit lanes holding 0..0xffff
}

__attribute__((target("avx2"))) inline void store_bf16x16(uint16_t* out, __m256 a, __m256 b) {
    // packus works per 128-bit lane: [a0..a3 b0..b3 | a4..a7 b4..b7]; reorder the 64-bit quarters.
    const __m256i packed = _mm256_packus_epi32(f32x8_to_bf16_bits(a), f32x8_to_bf16_bits(b));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permute4x64_epi64(packed, 0xd8));
}

__attribute__((target("avx2"))) void weighted_sum_row_avx2(uint16_t* out, int64_t hidden,
                                                            const uint16_t* const* rows, const float* w, int64_t n) {
    int64_t j = 0;
    for (; j + 32 <= hidden; j += 32) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t k = 0; k < n; ++k) {
            const uint16_t* r = rows[k] + j;
            const __m256 wk = _mm256_set1_ps(w[k]);
            a0 = _mm256_add_ps(a0, _mm256_mul_ps(wk, bf16x8_to_f32(r)));
            a1 = _mm256_add_ps(a1, _mm256_mul_ps(wk, bf16x8_to_f32(r + 8)));
            a2 = _mm256_add_ps(a2, _mm256_mul_ps(wk, bf16x8_to_f32(r + 16)));
            a3 = _mm256_add_ps(a3, _mm256_mul_ps(wk, bf16x8_to_f32(r + 24)));
        }
        store_bf16x16(out + j, a0, a1);
        store_bf16x16(out + j + 16, a2, a3);
    }
    for (; j < hidden; ++j) {  // hidden is a multiple of 128 in practice; kept general
        float acc = 0.0f;
        for (int64_t k = 0; k < n; ++k) acc = acc + w[k] * bf16_to_float(rows[k][j]);
        out[j] = float_to_bf16(acc);
    }
}

// __builtin_cpu_init() first: this initializer may run before libgcc's own constructor.
const bool kHasAvx2 = (__builtin_cpu_init(), __builtin_cpu_supports("avx2") != 0);

}  // namespace
#endif

void weighted_sum_row(uint16_t* out, int64_t hidden, const uint16_t* const* rows, const float* w, int64_t n) {
#if defined(__x86_64__)
    if (kHasAvx2) {
        weighted_sum_row_avx2(out, hidden, rows, w, n);
        return;
    }
#endif
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

namespace {

// Copy n rows of row_bytes; `index` picks the source row (gather) or the destination row
// (scatter) of row i. Arguments are checked before anything is written.
void copy_indexed_rows(uintptr_t dst_ptr, int64_t dst_stride, uintptr_t src_ptr, int64_t src_stride,
                       int64_t row_bytes, uintptr_t index_ptr, int64_t n, bool index_is_source) {
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
    for (int64_t i = 0; i < n; ++i) {
        const int64_t from = index_is_source ? index[i] : i;
        const int64_t to = index_is_source ? i : index[i];
        std::memcpy(dst + to * dst_stride, src + from * src_stride, size_t(row_bytes));
    }
}

}  // namespace

void gather_rows(uintptr_t dst_ptr, int64_t dst_stride, uintptr_t src_ptr, int64_t src_stride, int64_t row_bytes,
                 uintptr_t index_ptr, int64_t n) {
    copy_indexed_rows(dst_ptr, dst_stride, src_ptr, src_stride, row_bytes, index_ptr, n, true);
}

void scatter_rows(uintptr_t dst_ptr, int64_t dst_stride, uintptr_t src_ptr, int64_t src_stride, int64_t row_bytes,
                  uintptr_t index_ptr, int64_t n) {
    copy_indexed_rows(dst_ptr, dst_stride, src_ptr, src_stride, row_bytes, index_ptr, n, false);
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

RowBias make_row_bias(uintptr_t bias0_ptr, uintptr_t bias1_ptr, int64_t bias_stride, int64_t bias_hidden,
                      int64_t hidden) {
    RowBias bias;
    if (bias0_ptr == 0 && bias1_ptr == 0) return bias;
    if (bias_hidden <= 0 || bias_hidden > hidden)
        throw_value_error("bias_hidden: expected [1, " + std::to_string(hidden) + "] (the combine's hidden), got " +
                          std::to_string(bias_hidden));
    if (bias_stride < 2 * bias_hidden)
        throw_value_error("bias_stride: expected >= " + std::to_string(2 * bias_hidden) + " bytes (2 * bias_hidden), got " +
                          std::to_string(bias_stride));
    bias.bias0 = reinterpret_cast<const uint8_t*>(bias0_ptr);
    bias.bias1 = reinterpret_cast<const uint8_t*>(bias1_ptr);
    bias.stride = bias_stride;
    bias.hidden = bias_hidden;
    return bias;
}

void biased_sum_row(uint16_t* out, int64_t hidden, const uint16_t** rows, float* w, int64_t n, const RowBias& bias,
                    int64_t t) {
    const int64_t nb = bias.count();
    if (nb == 0) {
        weighted_sum_row(out, hidden, rows, w, n);
        return;
    }
    const uint16_t** first = rows - nb;
    float* first_w = w - nb;
    int64_t i = 0;
    for (const uint8_t* b : {bias.bias0, bias.bias1}) {
        if (b == nullptr) continue;
        first[i] = reinterpret_cast<const uint16_t*>(b + t * bias.stride);
        first_w[i] = 1.0f;
        ++i;
    }
    // Channels are independent: the biased ones, then the rest from the same rows (a bias of zeros
    // there would add +0.0 to +0.0 first, which changes nothing).
    weighted_sum_row(out, bias.hidden, first, first_w, n + nb);
    if (bias.hidden < hidden) {
        for (int64_t k = 0; k < n; ++k) rows[k] += bias.hidden;
        weighted_sum_row(out + bias.hidden, hidden - bias.hidden, rows, w, n);
    }
}

void combine_reduce(uintptr_t out_ptr, int64_t num_tokens, int64_t hidden, int64_t top_k, uintptr_t row_index_ptr,
                    uintptr_t weights_ptr, uintptr_t rows_base_ptr, int64_t row_stride, uintptr_t bias0_ptr,
                    uintptr_t bias1_ptr, int64_t bias_stride, int64_t bias_hidden) {
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
    const RowBias bias = make_row_bias(bias0_ptr, bias1_ptr, bias_stride, bias_hidden, hidden);
    const auto* row_index = reinterpret_cast<const int64_t*>(row_index_ptr);
    const auto* weights = reinterpret_cast<const float*>(weights_ptr);
    const auto* base = reinterpret_cast<const uint8_t*>(rows_base_ptr);
    auto* out = reinterpret_cast<uint16_t*>(out_ptr);

    // Two entries in front for the bias rows (biased_sum_row).
    std::vector<const uint16_t*> rows(size_t(std::max<int64_t>(top_k, 1) + 2));
    std::vector<float> w(rows.size());
    for (int64_t t = 0; t < num_tokens; ++t) {
        int64_t n = 0;
        for (int64_t k = 0; k < top_k; ++k) {
            const int64_t idx = row_index[t * top_k + k];
            if (idx < 0) continue;  // -1: not selected
            rows[size_t(2 + n)] = reinterpret_cast<const uint16_t*>(base + idx * row_stride);
            w[size_t(2 + n)] = weights[t * top_k + k];
            ++n;
        }
        biased_sum_row(out + t * hidden, hidden, rows.data() + 2, w.data() + 2, n, bias, t);
    }
}

}  // namespace mep

// ---------------------------------------------------------------------------------------------
// Collective fallback packing (fallback/collective.py): records for all_to_all_single
// ---------------------------------------------------------------------------------------------
//
// A record carries one (token, destination rank) pair: [payload | int32 token | L flag bytes |
// zero pad] of `rec_size` bytes, payload = the bf16 row (2H bytes) or the FP8 row (H bytes) and its
// float32 scales (4 * H/128 bytes). Flag l is 1 when local expert l of the destination selected
// the token. In exact mode the records of all destinations follow each other (destination-major,
// tokens ascending); in fixed mode destination d owns slots [d*(T+1), (d+1)*(T+1)) of `rec_size`
// bytes, slot 0 holding the header int64 {records, accepted}, records from slot 1 on.
//
// The entry points (dataplane/api.h, bound in module.cpp) return a count >= 0 and throw ValueError /
// RuntimeError (through pybind11) with the reason on malformed input.

namespace mep {
namespace {

struct CollRecords {
    int64_t hidden, local, rec_size, meta, payload;
    bool use_fp8;
};

CollRecords coll_records(int64_t hidden, int64_t local, int64_t rec_size, int64_t meta, bool use_fp8) {
    check_hidden(hidden);
    if (local <= 0) throw_value_error("num_local_experts must be > 0");
    const int64_t payload = use_fp8 ? hidden + 4 * (hidden / kScaleGroup) : 2 * hidden;
    if (meta != payload || rec_size < payload + 4 + local || rec_size % 16 != 0) {
        throw_value_error("record layout (rec_size " + std::to_string(rec_size) + ", meta " + std::to_string(meta) +
                          ") does not fit a payload of " + std::to_string(payload) + " bytes and " +
                          std::to_string(local) + " flags");
    }
    return {hidden, local, rec_size, meta, payload, use_fp8};
}

int64_t coll_dispatch_pack(const uint16_t* x, int64_t N, int64_t H, const int64_t* topk, int64_t K, int64_t E,
                           int64_t R, int64_t T, const int32_t* active, bool use_fp8, bool fixed, int64_t rec_size,
                           int64_t meta, uint8_t* send, int64_t send_bytes, int64_t* tokens_to, int64_t* pairs_to,
                           int64_t* row_index) {
    if (R <= 0 || E <= 0 || E % R != 0) throw_value_error("num_experts must be a positive multiple of num_ranks");
    if (N < 0 || N > T) throw_value_error("num_tokens = " + std::to_string(N) + " must be in [0, T]");
    if (K < 0) throw_value_error("top_k must be >= 0");
    const int64_t L = E / R;
    const CollRecords rec = coll_records(H, L, rec_size, meta, use_fp8);
    if (N > 0) {
        check_nonnull(uintptr_t(x), "x");
        if (K > 0) check_nonnull(uintptr_t(topk), "topk");
    }
    // sel[t][e]: token t goes to expert e (valid entry, active owner); reach[t][d]: to rank d.
    thread_local std::vector<uint8_t> sel, reach;
    thread_local std::vector<int64_t> expert_rows;
    sel.assign(size_t(N * E), 0);
    reach.assign(size_t(N * R), 0);
    expert_rows.assign(size_t(E + 1), 0);
    for (int64_t t = 0; t < N; ++t) {
        for (int64_t k = 0; k < K; ++k) {
            const int64_t e = topk[t * K + k];
            if (e < -1 || e >= E) throw_value_error("topk entry " + std::to_string(e) + " is outside [-1, E)");
            if (e < 0 || !active[e / L]) continue;
            uint8_t& s = sel[size_t(t * E + e)];
            if (s) throw_value_error("token " + std::to_string(t) + " selects expert " + std::to_string(e) + " twice");
            s = 1;
            reach[size_t(t * R + e / L)] = 1;
            ++expert_rows[size_t(e + 1)];
        }
    }
    // Combine receive rows: the sent (expert, token) pairs, expert-major, tokens ascending.
    for (int64_t e = 0; e < E; ++e) expert_rows[size_t(e + 1)] += expert_rows[size_t(e)];
    for (int64_t d = 0; d < R; ++d) pairs_to[d] = expert_rows[size_t((d + 1) * L)] - expert_rows[size_t(d * L)];
    for (int64_t t = 0; t < N; ++t) {
        for (int64_t k = 0; k < K; ++k) {
            const int64_t e = topk[t * K + k];
            row_index[t * K + k] = (e >= 0 && sel[size_t(t * E + e)]) ? expert_rows[size_t(e)]++ : -1;
        }
    }
    int64_t total = 0;
    for (int64_t d = 0; d < R; ++d) {
        int64_t n = 0;
        for (int64_t t = 0; t < N; ++t) n += reach[size_t(t * R + d)];
        tokens_to[d] = n;
        total += n;
    }
    const int64_t needed = fixed ? R * (T + 1) * rec_size : total * rec_size;
    if (needed > send_bytes) {
        throw_value_error("send buffer of " + std::to_string(send_bytes) + " bytes, " + std::to_string(needed) +
                          " needed");
    }
    // FP8: quantize every routed token once.
    thread_local std::vector<uint8_t> q;
    thread_local std::vector<float> scales;
    const int64_t G = H / kScaleGroup;
    if (use_fp8) {
        q.resize(size_t(N * H));
        scales.resize(size_t(N * G));
        for (int64_t t = 0; t < N; ++t) {
            bool used = false;
            for (int64_t d = 0; d < R; ++d) used |= reach[size_t(t * R + d)] != 0;
            if (used) quantize_row_fp8(x + t * H, H, q.data() + t * H, scales.data() + t * G);
        }
    }
    uint8_t* out = send;
    for (int64_t d = 0; d < R; ++d) {
        if (fixed) {
            uint8_t* header = send + d * (T + 1) * rec_size;
            const int64_t words[2] = {tokens_to[d], int64_t(active[d] != 0)};
            std::memset(header, 0, size_t(rec_size));
            std::memcpy(header, words, sizeof(words));
            out = header + rec_size;
        }
        for (int64_t t = 0; t < N; ++t) {
            if (!reach[size_t(t * R + d)]) continue;
            if (use_fp8) {
                std::memcpy(out, q.data() + t * H, size_t(H));
                std::memcpy(out + H, scales.data() + t * G, size_t(G) * sizeof(float));
            } else {
                std::memcpy(out, x + t * H, size_t(2 * H));
            }
            const int32_t token = int32_t(t);
            std::memcpy(out + rec.meta, &token, sizeof(token));
            std::memcpy(out + rec.meta + 4, sel.data() + t * E + d * L, size_t(L));
            std::memset(out + rec.meta + 4 + L, 0, size_t(rec_size - rec.meta - 4 - L));
            out += rec_size;
        }
    }
    return total;
}

int64_t coll_dispatch_unpack(const uint8_t* recv, int64_t recv_bytes, int64_t R, int64_t T, int64_t H, int64_t L,
                             int64_t rec_size, int64_t meta, bool fixed, int64_t* recv_tokens, int64_t* accepted_by,
                             const int32_t* accept, bool use_fp8, uint8_t* recv_x, float* recv_scales,
                             int32_t* src_info, int64_t* layout_range, int32_t* recv_count, int64_t* rows_to_rank) {
    if (R <= 0 || T <= 0) throw_value_error("num_ranks and T must be > 0");
    const CollRecords rec = coll_records(H, L, rec_size, meta, use_fp8);
    check_nonnull(uintptr_t(recv_x), "recv_x");
    if (use_fp8) check_nonnull(uintptr_t(recv_scales), "recv_scales");
    // First record of every source, and its record count (fixed mode: from the header).
    thread_local std::vector<const uint8_t*> first;
    first.assign(size_t(R), nullptr);
    int64_t offset = 0;
    for (int64_t s = 0; s < R; ++s) {
        if (fixed) {
            const uint8_t* header = recv + s * (T + 1) * rec_size;
            int64_t words[2];
            std::memcpy(words, header, sizeof(words));
            recv_tokens[s] = words[0];
            accepted_by[s] = words[1] != 0;
            first[size_t(s)] = header + rec_size;
        } else {
            first[size_t(s)] = recv + offset * rec_size;
        }
        if (recv_tokens[s] < 0 || recv_tokens[s] > T) {
            throw_value_error("rank " + std::to_string(s) + " announced " + std::to_string(recv_tokens[s]) +
                              " tokens, outside [0, " + std::to_string(T) + "]");
        }
        offset += recv_tokens[s];
    }
    const int64_t needed = fixed ? R * (T + 1) * rec_size : offset * rec_size;
    if (needed > recv_bytes) throw_value_error("receive buffer smaller than the announced records");
    // Token indices of accepted sources must lie in [0, T) before anything is written.
    for (int64_t s = 0; s < R; ++s) {
        if (!accept[s]) continue;
        for (int64_t i = 0; i < recv_tokens[s]; ++i) {
            int32_t token;
            std::memcpy(&token, first[size_t(s)] + i * rec_size + rec.meta, sizeof(token));
            if (token < 0 || token >= T) {
                throw_value_error("rank " + std::to_string(s) + " sent token index " + std::to_string(token) +
                                  " outside [0, " + std::to_string(T) + ")");
            }
        }
    }
    // Pack per local expert: sources ascending, their records (tokens ascending) in order.
    const int64_t RT = R * T, G = H / kScaleGroup;
    const int64_t row_bytes = use_fp8 ? H : 2 * H;
    advise_huge_pages(recv_x, L * RT * row_bytes);
    for (int64_t s = 0; s < R; ++s) rows_to_rank[s] = 0;
    int64_t total = 0;
    for (int64_t l = 0; l < L; ++l) {
        int64_t begin = 0;
        for (int64_t s = 0; s < R; ++s) {
            int64_t count = 0;
            if (accept[s]) {
                const uint8_t* r = first[size_t(s)];
                for (int64_t i = 0; i < recv_tokens[s]; ++i, r += rec_size) {
                    if (!r[rec.meta + 4 + l]) continue;
                    const int64_t row = l * RT + begin + count;
                    std::memcpy(recv_x + row * row_bytes, r, size_t(row_bytes));
                    if (use_fp8) {  // scales go token-contiguous: physical [L][G][R*T]
                        for (int64_t g = 0; g < G; ++g) {
                            std::memcpy(recv_scales + (l * G + g) * RT + begin + count, r + H + g * 4, sizeof(float));
                        }
                    }
                    std::memcpy(src_info + row, r + rec.meta, sizeof(int32_t));
                    ++count;
                }
            }
            layout_range[l * R + s] = (begin << 32) | count;
            rows_to_rank[s] += count;
            begin += count;
        }
        recv_count[l] = int32_t(begin);
        // src_info past the received rows is 0 (outputs may be reused buffers, not fresh zeros).
        std::memset(src_info + l * RT + begin, 0, size_t(RT - begin) * sizeof(int32_t));
        total += begin;
    }
    return total;
}

int64_t coll_combine_pack(const uint8_t* x, int64_t H, int64_t L, int64_t R, int64_t T, const int64_t* layout_range,
                          uint8_t* send, int64_t send_rows) {
    if (R <= 0 || T <= 0 || L <= 0 || H <= 0) throw_value_error("shape arguments must be > 0");
    const int64_t RT = R * T, row = 2 * H;
    int64_t total = 0;
    for (int64_t i = 0; i < L * R; ++i) {
        const auto v = uint64_t(layout_range[i]);
        const int64_t begin = int64_t(v >> 32), count = int64_t(v & 0xffffffffu);
        if (count > T || begin + count > RT) {
            throw_value_error("layout_range entry " + std::to_string(i) + " (begin " + std::to_string(begin) +
                              ", count " + std::to_string(count) + ") exceeds R*T = " + std::to_string(RT));
        }
        total += count;
    }
    if (total != send_rows) {
        throw_value_error("layout_range counts " + std::to_string(total) + " rows, the send buffer holds " +
                          std::to_string(send_rows));
    }
    // By source rank, then local expert: every (l, s) block is one contiguous run of rows.
    uint8_t* out = send;
    for (int64_t s = 0; s < R; ++s) {
        for (int64_t l = 0; l < L; ++l) {
            const auto v = uint64_t(layout_range[l * R + s]);
            const int64_t begin = int64_t(v >> 32), count = int64_t(v & 0xffffffffu);
            if (count == 0) continue;
            std::memcpy(out, x + (l * RT + begin) * row, size_t(count * row));
            out += count * row;
        }
    }
    return total;
}

}  // namespace
}  // namespace mep

namespace mep {

int64_t coll_dispatch_pack(uintptr_t x, int64_t num_tokens, int64_t hidden, uintptr_t topk, int64_t top_k,
                           int64_t num_experts, int64_t num_ranks, int64_t max_tokens, uintptr_t active, bool use_fp8,
                           bool fixed, int64_t rec_size, int64_t meta, uintptr_t send, int64_t send_bytes,
                           uintptr_t tokens_to, uintptr_t pairs_to, uintptr_t row_index) {
    return coll_dispatch_pack(reinterpret_cast<const uint16_t*>(x), num_tokens, hidden,
                              reinterpret_cast<const int64_t*>(topk), top_k, num_experts, num_ranks, max_tokens,
                              reinterpret_cast<const int32_t*>(active), use_fp8, fixed, rec_size, meta,
                              reinterpret_cast<uint8_t*>(send), send_bytes, reinterpret_cast<int64_t*>(tokens_to),
                              reinterpret_cast<int64_t*>(pairs_to), reinterpret_cast<int64_t*>(row_index));
}

int64_t coll_dispatch_unpack(uintptr_t recv, int64_t recv_bytes, int64_t num_ranks, int64_t max_tokens, int64_t hidden,
                             int64_t num_local, int64_t rec_size, int64_t meta, bool fixed, uintptr_t recv_tokens,
                             uintptr_t accepted_by, uintptr_t accept, bool use_fp8, uintptr_t recv_x,
                             uintptr_t recv_scales, uintptr_t src_info, uintptr_t layout_range, uintptr_t recv_count,
                             uintptr_t rows_to_rank) {
    return coll_dispatch_unpack(reinterpret_cast<const uint8_t*>(recv), recv_bytes, num_ranks, max_tokens, hidden,
                                num_local, rec_size, meta, fixed, reinterpret_cast<int64_t*>(recv_tokens),
                                reinterpret_cast<int64_t*>(accepted_by), reinterpret_cast<const int32_t*>(accept),
                                use_fp8, reinterpret_cast<uint8_t*>(recv_x), reinterpret_cast<float*>(recv_scales),
                                reinterpret_cast<int32_t*>(src_info), reinterpret_cast<int64_t*>(layout_range),
                                reinterpret_cast<int32_t*>(recv_count), reinterpret_cast<int64_t*>(rows_to_rank));
}

int64_t coll_combine_pack(uintptr_t x, int64_t hidden, int64_t num_local, int64_t num_ranks, int64_t max_tokens,
                          uintptr_t layout_range, uintptr_t send, int64_t send_rows) {
    return coll_combine_pack(reinterpret_cast<const uint8_t*>(x), hidden, num_local, num_ranks, max_tokens,
                             reinterpret_cast<const int64_t*>(layout_range), reinterpret_cast<uint8_t*>(send),
                             send_rows);
}

}  // namespace mep
