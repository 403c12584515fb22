// AVX2 inner loops of core/quant_linear.cpp (included there, in its anonymous namespace, where the build has AVX2, FMA
// and F16C but not AVX-512: the x86-64-v3 variant). Moved here unchanged from quant_linear.cpp: the same outputs as
// the VNNI build's, bit for bit (tests/sharding/test_cpu_variants.py, tests/sharding/test_kernel_harness.py).
#pragma once

#include <immintrin.h>

#include <cstring>

#include "avx2_rows16.h"
#include "prefetch.h"

namespace {

#define TPSERVE_AVX2_DOT 1
#define TPSERVE_INT8_DOT 1
// AVX2 without AVX-512 (AMD Zen 2 and 3, Intel client cores): the VNNI kernels' layout and int8 activations, with
// llama.cpp's AVX2 way of multiplying bytes (vpmaddubsw: unsigned by signed bytes, pairs summed to int16; vpmaddwd by
// ones: pairs of those to int32). A 64-byte line of the 16-row block is two 256-bit halves (rows 0-7, rows 8-15),
// each lane of a half one output row, so there is still no reduction across lanes. int8: |x| times the weights with
// x's sign (vpsignb), which keeps every pair within int16 (|w|, |x| <= 127); int4: the unsigned nibbles (w + 8) by x,
// whose int16 pair sums stay below 2 * 15 * 127, so a block's 8 products add up in int16 before one vpmaddwd, then
// less 8 * the block's sum of x. The int32 dot products are exact, and the float32 steps after them are the VNNI
// kernels': the same outputs bit for bit.
constexpr int64_t NV = tpserve::VNNI_BLOCK;  // output rows per block: one 32-bit lane each (of two halves)
constexpr int64_t MB_VNNI = 4;  // activation rows per pass
constexpr int64_t DOT_BLOCKS = 1, DOT_BLOCKS_ROWS = 1;  // blocks of 16 output rows a call (quant_linear.cpp)

inline void row_scales16(const tpserve::fp16_t* s, __m256 (&sw)[2]) {  // the block's 16 float16 scales of one group
  sw[0] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  sw[1] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 8)));
}

template <int R>
inline void add_scaled(__m256 (&acc)[R][2], int r, const __m256i (&dot)[2], const __m256 (&sw)[2], float xs) {
  const __m256 s = _mm256_set1_ps(xs);
  for (int h = 0; h < 2; ++h)
    acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[h]), _mm256_mul_ps(sw[h], s), acc[r][h]);
}

template <int R>
inline void int8_dot_block(const tpserve::Int8Rows& xq, int64_t m0, const int8_t* w, int64_t K, int64_t nrows,
                           const tpserve::fp16_t* scale, float* y, int64_t ldy) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const int64_t nb = K / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* wb = w + b * 8 * 64;
    prefetch_lines_ahead(wb, 512);
    __m256 sw[2];
    row_scales16(scale + b * NV, sw);
    for (int r = 0; r < R; ++r) {
      const int64_t row = m0 + r;
      const int32_t* xr = reinterpret_cast<const int32_t*>(xq.q.data() + row * K + b * 32);
      __m256i dot[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
      for (int i = 0; i < 8; ++i) {
        const __m256i xb = _mm256_set1_epi32(xr[i]);
        const __m256i ax = _mm256_abs_epi8(xb);
        for (int h = 0; h < 2; ++h) {
          const __m256i line = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + i * 64 + h * 32));
          dot[h] = _mm256_add_epi32(dot[h], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(line, xb)),
                                                              ones));
        }
      }
      add_scaled<R>(acc, r, dot, sw, xq.scale[row * nb + b]);
    }
  }
  store_rows16<R>(acc, y, ldy, nrows);
}

// int4: a row's byte i of each run of 8 inputs holds input i (low nibble) and input i + 4 (high nibble)
template <int R>
inline void int4_dot_block(const tpserve::Int8Rows& xq, int64_t m0, const uint8_t* w, int64_t K, int64_t nrows,
                           const tpserve::fp16_t* scale, int64_t G, float* y, int64_t ldy) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const int64_t nb = K / 32;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = w + b * 4 * 64;
    prefetch_lines_ahead(wb, 256);
    __m256i half[2][8];  // per 8-row half: inputs 8i..8i+3 (low nibbles), 8i+4..8i+7 (high), i = 0..3
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < 4; ++i) {
        const __m256i line = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + i * 64 + h * 32));
        half[h][2 * i] = _mm256_and_si256(line, low);
        half[h][2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16(line, 4), low);
      }
    __m256 sw[2];
    row_scales16(scale + (b * 32 / G) * NV, sw);
    for (int r = 0; r < R; ++r) {
      const int64_t row = m0 + r;
      const int32_t* xr = reinterpret_cast<const int32_t*>(xq.q.data() + row * K + b * 32);
      const __m256i fix = _mm256_set1_epi32(-8 * xq.sum[row * nb + b]);  // the nibbles are w + 8
      __m256i dot[2];
      for (int h = 0; h < 2; ++h) {
        __m256i p = _mm256_setzero_si256();
        for (int i = 0; i < 8; ++i)
          p = _mm256_add_epi16(p, _mm256_maddubs_epi16(half[h][i], _mm256_set1_epi32(xr[i])));
        dot[h] = _mm256_add_epi32(_mm256_madd_epi16(p, ones), fix);
      }
      add_scaled<R>(acc, r, dot, sw, xq.scale[row * nb + b]);
    }
  }
  store_rows16<R>(acc, y, ldy, nrows);
}

}  // namespace
