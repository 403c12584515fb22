// x86 loops of core/argmax.cpp (included there where the build has AVX-512 F or AVX2): the vector parts of its two
// passes over a row. Moved here unchanged from decode_glue.cpp's argmax_rows.
#pragma once

#include <immintrin.h>

#define TPSERVE_ARGMAX_VECTOR 1

namespace {

// the max of row[0, i) and whether a NaN is there, over the whole vectors of the row; returns i (the scalar tail
// [i, V) is the caller's)
inline int64_t max_vectors(const float* row, int64_t V, float& best, bool& nan) {
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 m = _mm512_set1_ps(row[0]);
  __mmask16 unordered = 0;
  for (; i + 16 <= V; i += 16) {
    const __m512 v = _mm512_loadu_ps(row + i);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    m = _mm512_max_ps(m, v);
  }
  best = _mm512_reduce_max_ps(m);
  nan = unordered != 0;
#else  // AVX2
  __m256 m = _mm256_set1_ps(row[0]);
  __m256 unordered = _mm256_setzero_ps();
  for (; i + 8 <= V; i += 8) {
    const __m256 v = _mm256_loadu_ps(row + i);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    m = _mm256_max_ps(m, v);
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  best = _mm_cvtss_f32(m4);
  nan = _mm256_movemask_ps(unordered) != 0;
#endif
  return i;
}

// the start of the first whole vector holding `best` (or the end of the whole vectors): the first equal value is at or
// after it
inline int64_t find_vectors(const float* row, int64_t V, float best) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 target = _mm512_set1_ps(best);
  for (; i + 16 <= V; i += 16) {
    const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + i), target, _CMP_EQ_OQ);
    if (eq) break;
  }
#else  // AVX2
  const __m256 target = _mm256_set1_ps(best);
  for (; i + 8 <= V; i += 8)
    if (_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), target, _CMP_EQ_OQ))) break;
#endif
  return i;
}

}  // namespace
