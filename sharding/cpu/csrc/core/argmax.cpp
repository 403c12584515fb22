// torch.argmax of a row of floats, torch-free (the op: decode_glue.cpp's argmax_rows, for greedy sampling): the first
// maximal value; a NaN counts as the maximum, as torch's does. One vectorized max pass and one compare pass over the
// row (arch/x86/argmax.h on x86; elsewhere the scalar loops, which the compiler may vectorize).

#include "kernels.h"

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include "../arch/x86/argmax.h"
#endif

namespace {

inline bool is_nan(float v) {  // by its bits: -ffast-math folds std::isnan to false
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return (bits & 0x7FFFFFFFu) > 0x7F800000u;
}

}  // namespace

namespace tpserve {

int64_t argmax_row(const float* row, int64_t V) {
  float best = row[0];
  bool nan = false;
  int64_t i = 0;
#ifdef TPSERVE_ARGMAX_VECTOR
  i = max_vectors(row, V, best, nan);
#endif
  for (; i < V; ++i) {
    nan |= is_nan(row[i]);
    best = row[i] > best ? row[i] : best;
  }
  if (nan) {
    int64_t at = 0;
    while (!is_nan(row[at])) ++at;
    return at;
  }
  i = 0;
#ifdef TPSERVE_ARGMAX_VECTOR
  i = find_vectors(row, V, best);
#endif
  while (row[i] != best) ++i;
  return i;
}

}  // namespace tpserve
