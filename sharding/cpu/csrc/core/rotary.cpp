// Rotary position embedding of one head, torch-free (the op: rotary.cpp; decode_glue.cpp calls it too). Same
// arithmetic as transformers' formula `x * cos + rotate_half(x) * sin`, product by product, without contraction into
// FMAs (this file is compiled with fp-contract off), so the result is bitwise the formula's on every build
// (tests/sharding/test_perf_paths.py, tests/sharding/test_kernel_harness.py).

#pragma GCC optimize("fp-contract=off")

#include "kernels.h"

namespace tpserve {

// dst = rotary(src) over one head of D floats, given the cos/sin of its token's position; dst may be src
void rotate_head(float* dst, const float* src, const float* c, const float* s, int64_t D) {
  const int64_t half = D / 2;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = src[i], x2 = src[i + half];
    const float a1 = x1 * c[i], b1 = x2 * s[i];
    const float a2 = x2 * c[i + half], b2 = x1 * s[i + half];
    dst[i] = a1 - b1;
    dst[i + half] = a2 + b2;
  }
}

}  // namespace tpserve
