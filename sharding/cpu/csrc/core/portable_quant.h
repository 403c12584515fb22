// The portable loops of core/quant_linear.cpp's 4-row layout (float32 activations), included there where the build's
// ISA header (arch/x86/quant_avx512.h) has none of its own: in the AVX-512 loops' shape so that the compiler
// vectorizes them (AVX2, NEON): a block's weights converted to float32 once per 16 inputs and used by every
// activation row, 16 lanes of partial sums per (activation row, output row), summed at the end. Moved here unchanged
// from quant_linear.cpp.
#pragma once

#include <cstring>

namespace {

// acc[r][j] += x[r][k, k + 16) * wf[j] for the R activation rows and the block's NB output rows
template <int R>
inline void fma_rows(float (&acc)[R][NB][16], const float* x, int64_t ldx, int64_t k, const float (&wf)[NB][16]) {
  for (int r = 0; r < R; ++r) {
    const float* xr = x + r * ldx + k;
    for (int j = 0; j < NB; ++j)
#pragma omp simd
      for (int i = 0; i < 16; ++i) acc[r][j][i] += xr[i] * wf[j][i];
  }
}

template <int R>
inline void store_sums(const float (&acc)[R][NB][16], int64_t nrows, float* y, int64_t ldy) {
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < nrows; ++j) {
      float sum = 0.f;
      for (int i = 0; i < 16; ++i) sum += acc[r][j][i];
      y[r * ldy + j] = sum;
    }
}

template <int R>
inline void int8_block(const float* x, int64_t ldx, const int8_t* w, int64_t K, int64_t nrows,
                       const tpserve::fp16_t* scale, float* y, int64_t ldy) {
  float acc[R][NB][16] = {};
  for (int64_t k = 0; k < K; k += 16) {
    const int8_t* c = w + k * NB;
    float wf[NB][16];
    for (int j = 0; j < NB; ++j) {
      const float s = tpserve::fp16_to_float(scale[(k / 32) * NB + j]);
#pragma omp simd
      for (int i = 0; i < 16; ++i) wf[j][i] = static_cast<float>(c[j * RUN + i]) * s;
    }
    fma_rows<R>(acc, x, ldx, k, wf);
  }
  store_sums<R>(acc, nrows, y, ldy);
}

// w: the block's bytes; row j's 16 bytes of inputs [k, k + 32) at w + (k / 2) * NB + j * RUN, input k + i in the low
// nibble of byte i, k + 16 + i in its high nibble
template <int R>
inline void int4_block(const float* x, int64_t ldx, const uint8_t* w, int64_t K, int64_t nrows,
                       const tpserve::fp16_t* scale, int64_t G, float* y, int64_t ldy) {
  float acc[R][NB][16] = {};
  for (int64_t k = 0; k < K; k += 32) {
    const uint8_t* c = w + (k / 2) * NB;
    float lo[NB][16], hi[NB][16];
    for (int j = 0; j < NB; ++j) {
      const float s = tpserve::fp16_to_float(scale[(k / G) * NB + j]);
#pragma omp simd
      for (int i = 0; i < 16; ++i) {
        const uint8_t b = c[j * RUN + i];
        lo[j][i] = static_cast<float>((b & 0x0F) - 8) * s;
        hi[j][i] = static_cast<float>((b >> 4) - 8) * s;
      }
    }
    fma_rows<R>(acc, x, ldx, k, lo);
    fma_rows<R>(acc, x, ldx, k + 16, hi);
  }
  store_sums<R>(acc, nrows, y, ldy);
}

template <int R>
inline void bf16_block(const float* x, int64_t ldx, const uint16_t* w, int64_t K, int64_t nrows, float* y,
                       int64_t ldy) {
  float acc[R][NB][16] = {};
  for (int64_t k = 0; k < K; k += 16) {
    const uint16_t* c = w + k * NB;
    float wf[NB][16];
    for (int j = 0; j < NB; ++j)
#pragma omp simd
      for (int i = 0; i < 16; ++i) {  // a bfloat16 is the top half of its float32
        const uint32_t bits = static_cast<uint32_t>(c[j * 16 + i]) << 16;
        std::memcpy(&wf[j][i], &bits, sizeof(float));
      }
    fma_rows<R>(acc, x, ldx, k, wf);
  }
  store_sums<R>(acc, nrows, y, ldy);
}

}  // namespace
