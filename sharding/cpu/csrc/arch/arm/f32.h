// NEON tiles of core/f32_linear.cpp (included there, in its anonymous namespace, on ARM64). NEON has 32 registers of
// 4 floats: a block's 32 outputs are 8 of them per activation row, so a tile of 3 rows keeps 24 accumulators, 3
// broadcasts of x and the weight vector in flight in registers (8 rows would need 64); a tile of up to 8 rows walks
// the block's weights once per 3 rows, as the AVX2 tiles do (the block's K x 128 bytes are in cache for the next
// pass). Each output is the chain acc = fma(x[m, k], W[n, k], acc) over k = 0 .. K-1 from zero, then + bias: vfmaq_f32
// is a fused multiply-add, so the outputs equal the AVX-512 and AVX2 builds' bit for bit
// (tests/sharding/test_kernel_harness.py, under qemu-aarch64).
#pragma once

#include <arm_neon.h>

#define TPSERVE_F32_TILE 1

namespace {

// R (1-3) rows x 32 outputs of one block
template <int R>
inline void f32_tile_neon(const float* x, int64_t ldx, const float* w, int64_t K, const float* bias, float* y,
                          int64_t ldy, int64_t ncols) {
  float32x4_t acc[R][8];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 8; ++c) acc[r][c] = vdupq_n_f32(0.f);
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = w + k * BW;
    float32x4_t xb[R];
    for (int r = 0; r < R; ++r) xb[r] = vdupq_n_f32(x[r * ldx + k]);
    for (int c = 0; c < 8; ++c) {
      const float32x4_t wc = vld1q_f32(wk + 4 * c);
      for (int r = 0; r < R; ++r) acc[r][c] = vfmaq_f32(acc[r][c], xb[r], wc);
    }
  }
  // out through a local buffer at constant indices (as arch/x86/f32.h: indexing `acc` by variable made GCC keep the
  // accumulators in memory)
  alignas(16) float out[R][BW];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) vst1q_f32(out[r] + 4 * c, acc[r][c]);
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < ncols; ++j) y[r * ldy + j] = bias ? out[r][j] + bias[j] : out[r][j];
}

template <int R>
inline void f32_tile(const float* x, int64_t ldx, const float* w, int64_t K, const float* bias, float* y, int64_t ldy,
                     int64_t ncols) {
  int r0 = 0;
  for (; r0 + 3 <= R; r0 += 3) f32_tile_neon<3>(x + r0 * ldx, ldx, w, K, bias, y + r0 * ldy, ldy, ncols);
  if (R - r0 == 2) f32_tile_neon<2>(x + r0 * ldx, ldx, w, K, bias, y + r0 * ldy, ldy, ncols);
  if (R - r0 == 1) f32_tile_neon<1>(x + r0 * ldx, ldx, w, K, bias, y + r0 * ldy, ldy, ncols);
}

}  // namespace
