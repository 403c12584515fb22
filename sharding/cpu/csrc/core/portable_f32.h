// The portable tile of core/f32_linear.cpp (R rows x 32 outputs of one block, auto-vectorized), included there where
// the build's ISA header (arch/x86/f32.h, arch/arm/f32.h) has none. Moved here unchanged from f32_linear.cpp.
#pragma once

namespace {

template <int R>
inline void f32_tile(const float* x, int64_t ldx, const float* w, int64_t K, const float* bias, float* y, int64_t ldy,
                     int64_t ncols) {
  float acc[R][BW] = {};
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = w + k * BW;
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * ldx + k];
#pragma omp simd
      for (int64_t j = 0; j < BW; ++j) acc[r][j] += xv * wk[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < ncols; ++j) y[r * ldy + j] = bias ? acc[r][j] + bias[j] : acc[r][j];
}

}  // namespace
