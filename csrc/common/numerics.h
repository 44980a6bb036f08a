// Number formats shared by the CPU kernels (g++) and the CUDA kernels (nvcc): bf16 <-> float,
// float -> FP8 e4m3fn, the FP8 scale rule and the signal word. One definition, so the two data
// planes produce the same bits (docs/protocol.md, "FP8"; tests/test_native_kernels.py checks the
// CPU side against torch, tests/test_cuda.py the device side against the CPU transport).
//
// Every function is MEP_HD: __host__ __device__ under nvcc, plain inline under a host compiler.
// No library calls: bit casts go through __builtin_memcpy, which both compilers lower to a move.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MEP_HD __host__ __device__ __forceinline__
#else
#define MEP_HD inline
#endif

namespace mep {

MEP_HD uint32_t float_bits(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, sizeof(u));
    return u;
}

MEP_HD float bits_float(uint32_t u) {
    float f;
    __builtin_memcpy(&f, &u, sizeof(f));
    return f;
}

// bf16 -> float is exact: the bf16 bits are the top half of the float.
MEP_HD float bf16_to_float(uint16_t b) { return bits_float(uint32_t(b) << 16); }

// float -> bf16, round to nearest, ties to even (what torch does). NaN stays a (quiet) NaN of
// the same sign; finite values that round past the largest bf16 become infinity.
MEP_HD uint16_t float_to_bf16(float f) {
    const uint32_t u = float_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x0040u);
    const uint32_t lsb = (u >> 16) & 1u;
    return uint16_t((u + 0x7fffu + lsb) >> 16);
}

// float -> FP8 e4m3fn (1 sign bit, 4 exponent bits with bias 7, 3 mantissa bits, no infinity,
// largest finite 448 = 0x7e, NaN = 0x7f). Round to nearest even; magnitudes >= 448 (and
// infinities) saturate to +-448, NaN maps to sign|0x7f. This matches torch's
// `tensor.to(torch.float8_e4m3fn)` on CPU bit for bit.
//
// Written without branches (every case is computed, then selected) so that the compiler can
// vectorize the quantization loop. The subnormal rounding (add and subtract 2^23) relies on
// IEEE float arithmetic without reassociation: no -ffast-math / --use_fast_math.
MEP_HD uint8_t float_to_e4m3fn(float f) {
    const uint32_t u = float_bits(f);
    const uint32_t sign = (u >> 24) & 0x80u;
    const int32_t mag = int32_t(u & 0x7fffffffu);

    // Normal range (|f| >= 2^-6): keep the float's exponent and top 3 mantissa bits, round the
    // 20 dropped bits to nearest even; a carry out of the mantissa correctly bumps the exponent.
    // Then rebias the exponent from 127 to 7 (subtract 120 << 3).
    const int32_t r = mag >> 20;
    const int32_t rest = mag & 0xfffff;
    const int32_t round_up = int32_t(rest > 0x80000) | (int32_t(rest == 0x80000) & r);
    const int32_t normal = r + (round_up & 1) - (120 << 3);

    // Subnormal range: the result is m * 2^-9 with m in [0, 8] (8 encodes 2^-6, the smallest
    // normal, which is also the bit pattern 0x08). Scaling by 2^9 is exact; adding and
    // subtracting 2^23 rounds to an integer with ties to even. The input is clamped to 2^-6
    // first so that the float->int conversion is always in range.
    const int32_t sub_in = mag < 0x3c800000 ? mag : 0x3c800000;
    const float scaled = bits_float(uint32_t(sub_in)) * 512.0f;
    const int32_t subnormal = int32_t((scaled + 8388608.0f) - 8388608.0f);

    int32_t code = mag >= 0x3c800000 ? normal : subnormal;
    code = mag >= 0x43e00000 ? 0x7e : code;  // >= 448.0f, incl. infinity: saturate
    code = mag > 0x7f800000 ? 0x7f : code;   // NaN
    return uint8_t(uint32_t(code) | sign);
}

// The FP8 scale of one 128-channel group from its amax (the largest |x| as a float; a NaN amax
// stays NaN): amax clamped below at 1e-4, divided by 448 (e4m3fn's largest finite value).
MEP_HD float fp8_group_scale(float amax) {
    if (amax < 1e-4f) amax = 1e-4f;  // clamp(min=1e-4); NaN compares false and stays NaN
    return amax / 448.0f;
}

// The amax of bf16 values by their magnitude bits (bf16 magnitudes order like their bit
// patterns): `amax_bits` the largest `x & 0x7fff` of the group. Every NaN becomes the canonical
// quiet NaN, as torch's amax reports it.
MEP_HD float bf16_amax_from_bits(uint16_t amax_bits) {
    return amax_bits > 0x7f80u ? bits_float(0x7fc00000u) : bf16_to_float(amax_bits);
}

// Signals: one aligned 64-bit word (tag << 32) | count.
MEP_HD uint64_t make_signal(uint32_t tag, uint32_t count) { return (uint64_t(tag) << 32) | count; }
MEP_HD uint32_t signal_tag(uint64_t v) { return uint32_t(v >> 32); }
MEP_HD uint32_t signal_count(uint64_t v) { return uint32_t(v & 0xffffffffu); }

// The 32-bit, never-zero signal tag of call number `call` (calls are numbered from 1; wraps after
// 2^32 - 1 calls). Python's one_sided.signal_tag is the same rule.
MEP_HD uint32_t call_tag(uint64_t call) { return uint32_t((call - 1) % 0xffffffffull + 1); }

}  // namespace mep
