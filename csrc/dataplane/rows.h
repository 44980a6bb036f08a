// Row primitives of the packing kernels (kernels.cpp), shared inside the data plane by the one-sided
// dispatch/combine (dataplane.cpp) and the collective transport's record packers (kernels.cpp).
#pragma once

#include <cstdint>

namespace mep {

// ---------------------------------------------------------------------------------------------
// Packing primitives shared by the one-sided data plane and the collective transport
// ---------------------------------------------------------------------------------------------

// Quantizes one bf16 row of `hidden` channels to e4m3fn, one float32 scale per 128 channels.
void quantize_row_fp8(const uint16_t* x, int64_t hidden, uint8_t* q, float* scales);

// out[j] = bf16( sum_{k < n}, in order, of w[k] * float(rows[k][j]) ), accumulated in float32
// from 0.0f with a separate multiply and add (no FMA: the build uses -ffp-contract=off).
void weighted_sum_row(uint16_t* out, int64_t hidden, const uint16_t* const* rows, const float* w, int64_t n);

// Up to two bf16 bias tensors `[num_tokens, hidden]` (rows `stride` bytes apart; 0 = absent) that a
// combine's reduction starts from: channel j < hidden of token t sums bias0[t][j] and then bias1[t][j],
// each with weight 1.0, before the rows (as if they were the first two rows of the top-k); channels
// past `hidden` sum the rows alone. No bias row is ever copied.
struct RowBias {
    const uint8_t* bias0 = nullptr;
    const uint8_t* bias1 = nullptr;
    int64_t stride = 0;
    int64_t hidden = 0;

    int64_t count() const { return int64_t(bias0 != nullptr) + int64_t(bias1 != nullptr); }
};

// Checks a combine's bias arguments (ValueError naming the argument) and returns them as a RowBias.
RowBias make_row_bias(uintptr_t bias0_ptr, uintptr_t bias1_ptr, int64_t bias_stride, int64_t bias_hidden,
                      int64_t hidden);

// weighted_sum_row of token t's n rows with `bias`'s rows of t first. `rows` and `w` must have
// bias.count() free entries before them (rows[-1], rows[-2]); `rows` is changed (the caller rebuilds
// it per token).
void biased_sum_row(uint16_t* out, int64_t hidden, const uint16_t** rows, float* w, int64_t n, const RowBias& bias,
                    int64_t t);

}  // namespace mep
