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

}  // namespace mep
