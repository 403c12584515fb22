// vpdpbusd (vdpbf16ps) with the 4 activation bytes (2 bfloat16) at p broadcast from memory ({1to16}), for the VNNI
// and BF16 kernels of quant_avx512.h and kquant_avx512.h. GCC 12 does not fold _mm512_set1_epi32 of a load into
// either: it emits a vpbroadcastd of its own per product (and register copies around it). That cost ~10 % of the kq
// kernels at 8 and 128 activation rows, and a quarter of the int8/int4 kernels' time at one row with the weights in
// cache; 1-9 % of a decode step, which memory bounds (Zen 4, BENCHMARKS.md section 27).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace {

#if defined(__AVX512VNNI__)
inline __m512i dpbusd_bcst(__m512i acc, __m512i v, const int32_t* p) {
#if defined(__GNUC__) && !defined(__clang__)
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(v), "m"(*p));  // (AT&T syntax: GCC's default)
  return acc;
#else
  return _mm512_dpbusd_epi32(acc, v, _mm512_set1_epi32(*p));
#endif
}
#endif

#if defined(__AVX512BF16__)
inline __m512 dpbf16_bcst(__m512 acc, __m512bh v, const int32_t* p) {
#if defined(__GNUC__) && !defined(__clang__)
  __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(v), "m"(*p));
  return acc;
#else
  return _mm512_dpbf16_ps(acc, v, (__m512bh)_mm512_set1_epi32(*p));
#endif
}
#endif

}  // namespace
