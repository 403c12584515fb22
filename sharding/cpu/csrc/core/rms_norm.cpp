// RMSNorm of float32 rows in one pass, torch-free (the op: rms_norm.cpp): y = w * (x * rsqrt(mean(x^2) + eps)), the
// order transformers uses. Portable C++ on every build (the compiler vectorizes both loops).

#include "kernels.h"

#include <cmath>

namespace tpserve {

void rms_norm_rows(const float* x, const float* w, float eps, float* y, int64_t D, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * D;
    float* yr = y + r * D;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < D; ++i) ss += xr[i] * xr[i];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) yr[i] = w[i] * (xr[i] * inv);
  }
}

}  // namespace tpserve
