// AVX-512 inner loops of core/quant_linear.cpp (included there, in its anonymous namespace, where the build has
// AVX-512 F and BW: the x86-64-v4 variants): the 4-row layout's float32-activation blocks, and with VNNI (BF16) the
// 16-row layout's int8 (bfloat16) dot products. Moved here unchanged from quant_linear.cpp; the arithmetic of every
// output is what it was, bit for bit (tests/sharding/test_cpu_variants.py, tests/sharding/test_kernel_harness.py).
#pragma once

#include <immintrin.h>

#include "prefetch.h"
#include "vnni_bcst.h"

#define TPSERVE_AVX512 1

namespace {

// w: the block's bytes. Row j's bytes [i, i + 16) are at w + i * NB + j * RUN.
template <int R>
inline void int8_block(const float* x, int64_t ldx, const int8_t* w, int64_t K, int64_t nrows,
                       const tpserve::fp16_t* scale, float* y, int64_t ldy) {
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const int8_t* c = w + k * NB;
    __m512 wf[NB];
    for (int j = 0; j < NB; ++j)
      wf[j] = _mm512_mul_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + j * RUN)))),
          _mm512_set1_ps(tpserve::fp16_to_float(scale[(k / 32) * NB + j])));
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * ldx + k);
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wf[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < nrows; ++j) y[r * ldy + j] = _mm512_reduce_add_ps(acc[r][j]);
}

template <int R>
inline void int4_block(const float* x, int64_t ldx, const uint8_t* w, int64_t K, int64_t nrows,
                       const tpserve::fp16_t* scale, int64_t G, float* y, int64_t ldy) {
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  // the 16 values a nibble stands for, (n - 8), looked up by vpermps from each int32 lane's low 4 bits
  const __m512 values = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t k = 0; k < K; k += 32) {
    const uint8_t* c = w + (k / 2) * NB;
    __m512 lo[NB], hi[NB];
    for (int j = 0; j < NB; ++j) {
      const __m512 table = _mm512_mul_ps(values, _mm512_set1_ps(tpserve::fp16_to_float(scale[(k / G) * NB + j])));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + j * RUN));
      lo[j] = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(b), table);  // bits above the low nibble are ignored
      hi[j] = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_srli_epi16(b, 4)), table);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 x0 = _mm512_loadu_ps(x + r * ldx + k);
      const __m512 x1 = _mm512_loadu_ps(x + r * ldx + k + 16);
      for (int j = 0; j < NB; ++j) {
        acc[r][j] = _mm512_fmadd_ps(x0, lo[j], acc[r][j]);
        acc[r][j] = _mm512_fmadd_ps(x1, hi[j], acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < nrows; ++j) y[r * ldy + j] = _mm512_reduce_add_ps(acc[r][j]);
}

// w: the block's bf16 weights. Row j's weights [k, k + 16) are at w + k * NB + j * 16.
template <int R>
inline void bf16_block(const float* x, int64_t ldx, const uint16_t* w, int64_t K, int64_t nrows, float* y,
                       int64_t ldy) {
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const uint16_t* c = w + k * NB;
    __m512 wf[NB];
    for (int j = 0; j < NB; ++j)  // a bfloat16 is the top half of its float32
      wf[j] = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + j * 16))), 16));
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * ldx + k);
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wf[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < nrows; ++j) y[r * ldy + j] = _mm512_reduce_add_ps(acc[r][j]);
}

// the 16-row layout's kernels (VNNI, BF16)
constexpr int64_t NV = tpserve::VNNI_BLOCK;  // output rows per block: one 32-bit lane each
constexpr int64_t MB_VNNI = 8;  // activation rows per pass: one accumulator each (the block's 16 rows share it)

#if defined(__AVX512VNNI__)
#define TPSERVE_VNNI 1
#define TPSERVE_INT8_DOT 1

// The VNNI kernels: R activation rows (int8, per row and block of 32 inputs) against one block of 16 weight rows
// stored as quant.py's pack_rows(rows=16, run=4) lays them out: per 4 inputs (int8) or 8 inputs (int4), the block's
// 16 rows' 4 bytes side by side, one 64-byte line. vpdpbusd multiplies a line (unsigned bytes) by 4 activation bytes
// broadcast to every lane (signed), so each int32 lane accumulates one output row, with no reduction across lanes at
// the end. Per block of 32 inputs and activation row: 8 vpdpbusd started from the block's correction (the weights
// are stored or flipped to unsigned: w + 8, w + 128), then one conversion to float32 and one FMA by the weights'
// scales (a vector: one per row) times the activations' block scale. The weight lines are loaded (and unpacked) once
// per block and used by every activation row.

inline __m512 row_scales16(const tpserve::fp16_t* s) {  // the block's 16 float16 scales of one group
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
}

inline void store_rows16(const __m512* acc, int R, float* y, int64_t ldy, int64_t nrows) {
  const __mmask16 m = nrows >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << nrows) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy, m, acc[r]);
}

// The R activation rows' pointers, set once per block of weights: each row's bytes, block scales and corrections, so
// that the loop over blocks only adds b (the rows are K bytes apart; the compiler keeps what it can in registers)
template <int R>
struct RowsAt {
  const int32_t* x[R];  // the row's int8 activations, 4 bytes a unit
  const float* scale[R];
  const int32_t* fix[R];
  RowsAt(const tpserve::Int8Rows& xq, int64_t m0, const std::vector<int32_t>& fix_of) {
    const int64_t K = xq.K, nb = K / 32;
    for (int r = 0; r < R; ++r) {
      x[r] = reinterpret_cast<const int32_t*>(xq.q.data() + (m0 + r) * K);
      scale[r] = xq.scale.data() + (m0 + r) * nb;
      fix[r] = fix_of.data() + (m0 + r) * nb;
    }
  }
};

// One block b of 32 inputs for R activation rows: 8 vpdpbusd of the block's unsigned weight lines (w + offset) by each
// row's activation bytes, started from the row's correction for the block (-offset * its sum), then scaled and added in
// float32.
template <int R>
inline void dot_rows(const RowsAt<R>& rows, int64_t b, const __m512i* lines, __m512 sw, __m512* acc) {
  for (int r = 0; r < R; ++r) {
    const int32_t* xr = rows.x[r] + b * 8;
    // two chains of 4 (even and odd lines) halve a row's latency; the int32 sum is the same
    __m512i d0 = _mm512_set1_epi32(rows.fix[r][b]), d1 = _mm512_setzero_si512();
    for (int i = 0; i < 8; i += 2) {
      d0 = dpbusd_bcst(d0, lines[i], xr + i);
      d1 = dpbusd_bcst(d1, lines[i + 1], xr + i + 1);
    }
    d0 = _mm512_add_epi32(d0, d1);
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), _mm512_mul_ps(sw, _mm512_set1_ps(rows.scale[r][b])), acc[r]);
  }
}

template <int R>
inline void int8_dot_block(const tpserve::Int8Rows& xq, int64_t m0, const int8_t* w, int64_t K, int64_t nrows,
                            const tpserve::fp16_t* scale, float* y, int64_t ldy) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t nb = K / 32;
  const RowsAt<R> rows(xq, m0, xq.fix128);  // the bytes flipped to w + 128
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < nb; ++b) {
    __m512i line[8];
    prefetch_lines_ahead(w + b * 512, 512);
    for (int i = 0; i < 8; ++i) line[i] = _mm512_xor_si512(_mm512_loadu_si512(w + (b * 8 + i) * 64), flip);
    dot_rows<R>(rows, b, line, row_scales16(scale + b * NV), acc);
  }
  store_rows16(acc, R, y, ldy, nrows);
}

// int4: a row's byte i of each run of 8 inputs holds input i (low nibble) and input i + 4 (high nibble)
template <int R>
inline void int4_dot_block(const tpserve::Int8Rows& xq, int64_t m0, const uint8_t* w, int64_t K, int64_t nrows,
                            const tpserve::fp16_t* scale, int64_t G, float* y, int64_t ldy) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t nb = K / 32, per_group = G / 32;  // blocks of 32 inputs per scale group
  const RowsAt<R> rows(xq, m0, xq.fix8);  // the nibbles are w + 8
  const __m512i low = _mm512_set1_epi8(0x0F);
  const tpserve::fp16_t* sg = scale;  // the scales of the block's group
  for (int64_t b = 0, in_group = 0; b < nb; ++b) {
    __m512i half[8];  // inputs 8i..8i+3 (low nibbles), 8i+4..8i+7 (high), i = 0..3
    prefetch_lines_ahead(w + b * 256, 256);
    for (int i = 0; i < 4; ++i) {
      const __m512i line = _mm512_loadu_si512(w + (b * 4 + i) * 64);
      half[2 * i] = _mm512_and_si512(line, low);
      half[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(line, 4), low);
    }
    dot_rows<R>(rows, b, half, row_scales16(sg), acc);
    if (++in_group == per_group) in_group = 0, sg += NV;
  }
  store_rows16(acc, R, y, ldy, nrows);
}
#endif

#if defined(__AVX512BF16__)
#define TPSERVE_BF16_DOT 1
// bf16 weights on CPUs with AVX-512 BF16: the activations rounded to bfloat16 once per input (Int8Rows::h), and
// vdpbf16ps multiplies a line of the block's 16 rows x 2 inputs by the row's 2 activations broadcast to every lane:
// 32 products per instruction into one float32 lane per output row (16 per FMA in float32). Weights as pack_rows(
// rows=16, run=4 bytes) lays them out.
template <int R>
inline void bf16_dot_block(const tpserve::Int8Rows& xq, int64_t m0, const uint16_t* w, int64_t K, int64_t nrows,
                           float* y, int64_t ldy) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < K / 2; c += 8) {  // 8 lines: 16 inputs
    __m512bh line[8];
    prefetch_lines_ahead(w + c * 32, 512);
    for (int i = 0; i < 8; ++i) line[i] = (__m512bh)_mm512_loadu_si512(w + (c + i) * 32);
    for (int r = 0; r < R; ++r) {
      const int32_t* xr = reinterpret_cast<const int32_t*>(xq.h.data() + (m0 + r) * K) + c;
      for (int i = 0; i < 8; ++i) acc[r] = dpbf16_bcst(acc[r], line[i], xr + i);
    }
  }
  const __mmask16 m = nrows >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << nrows) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy, m, acc[r]);
}

// one row of K floats (K % 16 == 0) rounded to bfloat16 (to nearest even)
inline void round_row_bf16(const float* x, uint16_t* h, int64_t K) {
  for (int64_t k = 0; k < K; k += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(h + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + k)));
}
#endif

}  // namespace
