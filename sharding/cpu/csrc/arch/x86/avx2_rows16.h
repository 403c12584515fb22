// The closing store shared by the AVX2 loops of the 16-row weight layout (quant_avx2.h: int8 / int4; kquant_avx2.h:
// the GGUF block types): R activation rows of float32 accumulators, two 256-bit halves each (output rows 0-7 and
// 8-15 of the block), written to y; a last block of fewer than 16 rows goes through a stack copy.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace {

template <int R>
inline void store_rows16(const __m256 (&acc)[R][2], float* y, int64_t ldy, int64_t nrows) {
  for (int r = 0; r < R; ++r) {
    if (nrows >= 16) {
      _mm256_storeu_ps(y + r * ldy, acc[r][0]);
      _mm256_storeu_ps(y + r * ldy + 8, acc[r][1]);
    } else {
      alignas(32) float tmp[16];
      _mm256_store_ps(tmp, acc[r][0]);
      _mm256_store_ps(tmp + 8, acc[r][1]);
      std::memcpy(y + r * ldy, tmp, nrows * sizeof(float));
    }
  }
}

}  // namespace
