// x86 tiles of core/f32_linear.cpp (included there, in its anonymous namespace, where the build has AVX-512 F, or
// AVX2 and FMA): R rows x 32 outputs of one block, each output the chain acc = fma(x[m, k], W[n, k], acc) over
// k = 0 .. K-1 from zero, then + bias.
#pragma once

#include <immintrin.h>

#define TPSERVE_F32_TILE 1

namespace {

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// R (1-3) rows x 32 outputs of one block: 4R accumulators, R broadcasts, weights as memory operands
template <int R>
inline void f32_tile_avx2(const float* x, int64_t ldx, const float* w, int64_t K, const float* bias, float* y,
                          int64_t ldy, int64_t ncols) {
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = w + k * BW;
    __m256 xb[R];
    for (int r = 0; r < R; ++r) xb[r] = _mm256_broadcast_ss(x + r * ldx + k);
    for (int c = 0; c < 4; ++c) {
      const __m256 wc = _mm256_loadu_ps(wk + 8 * c);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(xb[r], wc, acc[r][c]);
    }
  }
  // out through a local buffer at constant indices: with the stores (and a ragged block's copy) indexing `acc` by
  // variable, GCC kept every accumulator in memory and stored all 12 on every k (2.2x slower at 8 rows)
  alignas(32) float out[R][BW];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) _mm256_store_ps(out[r] + 8 * c, acc[r][c]);
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < ncols; ++j) y[r * ldy + j] = bias ? out[r][j] + bias[j] : out[r][j];
}
#endif

template <int R>
inline void f32_tile(const float* x, int64_t ldx, const float* w, int64_t K, const float* bias, float* y, int64_t ldy,
                     int64_t ncols) {
#if defined(__AVX512F__)
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 w0 = _mm512_loadu_ps(w + k * BW), w1 = _mm512_loadu_ps(w + k * BW + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + k]);
      acc[r][0] = _mm512_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xb, w1, acc[r][1]);
    }
  }
  const __mmask16 m0 = ncols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << ncols) - 1);
  const __mmask16 m1 = ncols >= 32 ? 0xFFFF : ncols <= 16 ? 0 : static_cast<__mmask16>((1u << (ncols - 16)) - 1);
  for (int r = 0; r < R; ++r) {
    __m512 a0 = acc[r][0], a1 = acc[r][1];
    if (bias) {
      a0 = _mm512_add_ps(a0, _mm512_maskz_loadu_ps(m0, bias));
      a1 = _mm512_add_ps(a1, _mm512_maskz_loadu_ps(m1, bias + 16));
    }
    _mm512_mask_storeu_ps(y + r * ldy, m0, a0);
    _mm512_mask_storeu_ps(y + r * ldy + 16, m1, a1);
  }
#else  // AVX2 + FMA
  int r0 = 0;
  for (; r0 + 3 <= R; r0 += 3) f32_tile_avx2<3>(x + r0 * ldx, ldx, w, K, bias, y + r0 * ldy, ldy, ncols);
  if (R - r0 == 2) f32_tile_avx2<2>(x + r0 * ldx, ldx, w, K, bias, y + r0 * ldy, ldy, ncols);
  if (R - r0 == 1) f32_tile_avx2<1>(x + r0 * ldx, ldx, w, K, bias, y + r0 * ldy, ldy, ncols);
#endif
}

}  // namespace
