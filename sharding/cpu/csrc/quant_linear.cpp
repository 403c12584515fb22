// Quantized linears for CPU: y = x @ dequant(W)^T, x float32 [M, K], int8, int4 or bf16 weights, decode and prefill.
//
//   int8_linear(x, w, scale [blocks, K/32, rows] f16, N)         W[n,k] = q[n,k] * s[n, k/32]    (llama.cpp's Q8_0)
//   int4_linear(x, w, scale [blocks, K/G, rows] f16, G, N)       W[n,k] = (nibble - 8) * s[n, k/G] (Q4_0; G % 32 == 0)
//   bf16_linear(x, w, N)                                         W[n,k] = w[n,k], a bfloat16
//
// Two layouts of w (quant.py's pack_rows; int_rows() / bf16_rows() say which this build reads):
//
// With AVX-512 VNNI or AVX2 (int8, int4) and AVX-512 BF16 (bf16), the kernels multiply small types, as llama.cpp does:
// the activations are quantized once per input to int8 per row and block of 32 inputs (scale max|x| / 127, Q8_0's;
// quantize_rows) or rounded to bfloat16 (round_rows_bf16). Weights are in blocks of 16 output rows; each 64-byte line
// holds 4 bytes of each of the 16 rows (4 int8 inputs, 8 int4 inputs, 2 bf16 inputs), so one vpdpbusd (vdpbf16ps)
// multiplies a line by 4 activation bytes (2 bfloat16) broadcast to every lane and each lane accumulates one output
// row: no reduction across lanes at the end. Per block of 32 inputs and activation row, int8 and int4 take 8 vpdpbusd
// started from the block's correction (weights stored or flipped to unsigned: nibble = w + 8, w ^ 0x80 = w + 128), one
// conversion to float32 and one FMA by the weights' scales (a vector, one per row) times the activation's block scale.
// The lines are loaded (and unpacked) once per block and used by up to 8 activation rows. SmolLM2's int8 gate_up at 32
// rows: 669 us with float32 activations (BENCHMARKS.md section 10), 365-408 us with int8 ones in the 4-row layout,
// 210-251 us in this one; at one row it still reads the weights (in cache) at ~100 GB/s, faster than memory delivers
// them (section 11). AVX2 without VNNI (Zen 2 and 3, Intel client cores) runs the same layout with vpmaddubsw and
// vpmaddwd in two 256-bit halves of each line (TPSERVE_AVX2_DOT below).
//
// Elsewhere (no AVX2), float32 activations: weights in blocks of 4 output rows, interleaved in runs of 16 bytes (32 for
// bf16), the block's 4 rows computed together so that they are read as one sequential stream (2 threads, SmolLM2's int8
// linears at one row: 17 -> 26-32 GB/s against 4 plain rows side by side); each converted weight vector feeds up to 6
// activation rows x 4 output rows of float32 accumulators (AVX-512), or the same loops in portable C++.
//
// Either way each output is one fixed sum, the same whatever the rows batched with it. Output blocks are split over
// torch's intra-op threads (the ops) or over decode_layers' team (decode_glue.cpp). Built by sharding/cpu/kernels.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "tpserve_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include <type_traits>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define TPSERVE_AVX512 1
#endif
#if defined(__AVX2__) || defined(TPSERVE_AVX512)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t NB = 4;    // output rows per block
constexpr int64_t MB = 6;    // activation rows per pass (6 x 4 accumulators + 4 weight vectors fit 32 registers)
constexpr int64_t RUN = 16;  // bytes of one row stored together (int8, int4; bf16: 16 weights, RUN * 2 bytes)

#ifdef TPSERVE_AVX512

// w: the block's bytes. Row j's bytes [i, i + 16) are at w + i * NB + j * RUN.
template <int R>
inline void int8_block(const float* x, int64_t ldx, const int8_t* w, int64_t K, int64_t nrows, const at::Half* scale,
                       float* y, int64_t ldy) {
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const int8_t* c = w + k * NB;
    __m512 wf[NB];
    for (int j = 0; j < NB; ++j)
      wf[j] = _mm512_mul_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + j * RUN)))),
          _mm512_set1_ps(static_cast<float>(scale[(k / 32) * NB + j])));
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * ldx + k);
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wf[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < nrows; ++j) y[r * ldy + j] = _mm512_reduce_add_ps(acc[r][j]);
}

template <int R>
inline void int4_block(const float* x, int64_t ldx, const uint8_t* w, int64_t K, int64_t nrows, const at::Half* scale,
                       int64_t G, float* y, int64_t ldy) {
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  // the 16 values a nibble stands for, (n - 8), looked up by vpermps from each int32 lane's low 4 bits
  const __m512 values = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t k = 0; k < K; k += 32) {
    const uint8_t* c = w + (k / 2) * NB;
    __m512 lo[NB], hi[NB];
    for (int j = 0; j < NB; ++j) {
      const __m512 table = _mm512_mul_ps(values, _mm512_set1_ps(static_cast<float>(scale[(k / G) * NB + j])));
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

#else  // portable loops, in the AVX-512 loops' shape so that the compiler vectorizes them (AVX2, NEON): a block's
        // weights converted to float32 once per 16 inputs and used by every activation row, 16 lanes of partial sums
        // per (activation row, output row), summed at the end

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
inline void int8_block(const float* x, int64_t ldx, const int8_t* w, int64_t K, int64_t nrows, const at::Half* scale,
                       float* y, int64_t ldy) {
  float acc[R][NB][16] = {};
  for (int64_t k = 0; k < K; k += 16) {
    const int8_t* c = w + k * NB;
    float wf[NB][16];
    for (int j = 0; j < NB; ++j) {
      const float s = static_cast<float>(scale[(k / 32) * NB + j]);
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
inline void int4_block(const float* x, int64_t ldx, const uint8_t* w, int64_t K, int64_t nrows, const at::Half* scale,
                       int64_t G, float* y, int64_t ldy) {
  float acc[R][NB][16] = {};
  for (int64_t k = 0; k < K; k += 32) {
    const uint8_t* c = w + (k / 2) * NB;
    float lo[NB][16], hi[NB][16];
    for (int j = 0; j < NB; ++j) {
      const float s = static_cast<float>(scale[(k / G) * NB + j]);
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

#endif

#ifdef TPSERVE_AVX512
// the 16-row layout's kernels (VNNI, BF16)
constexpr int64_t NV = tpserve::VNNI_BLOCK;  // output rows per block: one 32-bit lane each
constexpr int64_t MB_VNNI = 8;  // activation rows per pass: one accumulator each (the block's 16 rows share it)
#endif

#if defined(TPSERVE_AVX512) && defined(__AVX512VNNI__)
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

inline __m512 row_scales16(const at::Half* s) {  // the block's 16 float16 scales of one group
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
}

inline void store_rows16(const __m512* acc, int R, float* y, int64_t ldy, int64_t nrows) {
  const __mmask16 m = nrows >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << nrows) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy, m, acc[r]);
}

// One block b of 32 inputs for R activation rows: 8 vpdpbusd of the block's unsigned weight lines (w + offset) by each
// row's activation bytes, started from -offset * the row's block sum, then scaled and added in float32.
template <int R>
inline void dot_rows(const tpserve::Int8Rows& xq, int64_t m0, int64_t b, const __m512i* lines, __m512 sw,
                     int32_t offset, __m512* acc) {
  const int64_t K = xq.K, nb = K / 32;
  for (int r = 0; r < R; ++r) {
    const int64_t row = m0 + r;
    const int32_t* xr = reinterpret_cast<const int32_t*>(xq.q.data() + row * K + b * 32);
    __m512i dot = _mm512_set1_epi32(-offset * xq.sum[row * nb + b]);
    for (int i = 0; i < 8; ++i) dot = _mm512_dpbusd_epi32(dot, lines[i], _mm512_set1_epi32(xr[i]));
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(sw, _mm512_set1_ps(xq.scale[row * nb + b])),
                             acc[r]);
  }
}

template <int R>
inline void int8_dot_block(const tpserve::Int8Rows& xq, int64_t m0, const int8_t* w, int64_t K, int64_t nrows,
                            const at::Half* scale, float* y, int64_t ldy) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t nb = K / 32;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < nb; ++b) {
    __m512i line[8];
    for (int i = 0; i < 8; ++i) line[i] = _mm512_xor_si512(_mm512_loadu_si512(w + (b * 8 + i) * 64), flip);
    dot_rows<R>(xq, m0, b, line, row_scales16(scale + b * NV), 128, acc);  // the bytes flipped to w + 128
  }
  store_rows16(acc, R, y, ldy, nrows);
}

// int4: a row's byte i of each run of 8 inputs holds input i (low nibble) and input i + 4 (high nibble)
template <int R>
inline void int4_dot_block(const tpserve::Int8Rows& xq, int64_t m0, const uint8_t* w, int64_t K, int64_t nrows,
                            const at::Half* scale, int64_t G, float* y, int64_t ldy) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t nb = K / 32;
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    __m512i half[8];  // inputs 8i..8i+3 (low nibbles), 8i+4..8i+7 (high), i = 0..3
    for (int i = 0; i < 4; ++i) {
      const __m512i line = _mm512_loadu_si512(w + (b * 4 + i) * 64);
      half[2 * i] = _mm512_and_si512(line, low);
      half[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(line, 4), low);
    }
    dot_rows<R>(xq, m0, b, half, row_scales16(scale + (b * 32 / G) * NV), 8, acc);  // the nibbles are w + 8
  }
  store_rows16(acc, R, y, ldy, nrows);
}
#endif

#if !defined(TPSERVE_AVX512) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TPSERVE_AVX2_DOT 1
#define TPSERVE_INT8_DOT 1
// AVX2 without AVX-512 (AMD Zen 2 and 3, Intel client cores): the VNNI kernels' layout and int8 activations, with
// llama.cpp's AVX2 way of multiplying bytes (vpmaddubsw: unsigned by signed bytes, pairs summed to int16; vpmaddwd by
// ones: pairs of those to int32). A 64-byte line of the 16-row block is two 256-bit halves (rows 0-7, rows 8-15),
// each lane of a half one output row, so there is still no reduction across lanes. int8: |x| times the weights with
// x's sign (vpsignb), which keeps every pair within int16 (|w|, |x| <= 127); int4: the unsigned nibbles (w + 8) by x,
// whose int16 pair sums stay below 2 * 15 * 127, so a block's 8 products add up in int16 before one vpmaddwd, then
// less 8 * the block's sum of x. The int32 dot products are exact, and the float32 steps after them are the VNNI
// kernels': the same outputs bit for bit.
constexpr int64_t NV = tpserve::VNNI_BLOCK;  // output rows per block: one 32-bit lane each (of two halves)
constexpr int64_t MB_VNNI = 4;  // activation rows per pass

inline void row_scales16(const at::Half* s, __m256 (&sw)[2]) {  // the block's 16 float16 scales of one group
  sw[0] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  sw[1] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 8)));
}

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

template <int R>
inline void add_scaled(__m256 (&acc)[R][2], int r, const __m256i (&dot)[2], const __m256 (&sw)[2], float xs) {
  const __m256 s = _mm256_set1_ps(xs);
  for (int h = 0; h < 2; ++h)
    acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[h]), _mm256_mul_ps(sw[h], s), acc[r][h]);
}

template <int R>
inline void int8_dot_block(const tpserve::Int8Rows& xq, int64_t m0, const int8_t* w, int64_t K, int64_t nrows,
                           const at::Half* scale, float* y, int64_t ldy) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const int64_t nb = K / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* wb = w + b * 8 * 64;
    __m256 sw[2];
    row_scales16(scale + b * NV, sw);
    for (int r = 0; r < R; ++r) {
      const int64_t row = m0 + r;
      const int32_t* xr = reinterpret_cast<const int32_t*>(xq.q.data() + row * K + b * 32);
      __m256i dot[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
      for (int i = 0; i < 8; ++i) {
        const __m256i xb = _mm256_set1_epi32(xr[i]);
        const __m256i ax = _mm256_abs_epi8(xb);
        for (int h = 0; h < 2; ++h) {
          const __m256i line = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + i * 64 + h * 32));
          dot[h] = _mm256_add_epi32(dot[h], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(line, xb)),
                                                              ones));
        }
      }
      add_scaled<R>(acc, r, dot, sw, xq.scale[row * nb + b]);
    }
  }
  store_rows16<R>(acc, y, ldy, nrows);
}

// int4: a row's byte i of each run of 8 inputs holds input i (low nibble) and input i + 4 (high nibble)
template <int R>
inline void int4_dot_block(const tpserve::Int8Rows& xq, int64_t m0, const uint8_t* w, int64_t K, int64_t nrows,
                           const at::Half* scale, int64_t G, float* y, int64_t ldy) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const int64_t nb = K / 32;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = w + b * 4 * 64;
    __m256i half[2][8];  // per 8-row half: inputs 8i..8i+3 (low nibbles), 8i+4..8i+7 (high), i = 0..3
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < 4; ++i) {
        const __m256i line = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + i * 64 + h * 32));
        half[h][2 * i] = _mm256_and_si256(line, low);
        half[h][2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16(line, 4), low);
      }
    __m256 sw[2];
    row_scales16(scale + (b * 32 / G) * NV, sw);
    for (int r = 0; r < R; ++r) {
      const int64_t row = m0 + r;
      const int32_t* xr = reinterpret_cast<const int32_t*>(xq.q.data() + row * K + b * 32);
      const __m256i fix = _mm256_set1_epi32(-8 * xq.sum[row * nb + b]);  // the nibbles are w + 8
      __m256i dot[2];
      for (int h = 0; h < 2; ++h) {
        __m256i p = _mm256_setzero_si256();
        for (int i = 0; i < 8; ++i)
          p = _mm256_add_epi16(p, _mm256_maddubs_epi16(half[h][i], _mm256_set1_epi32(xr[i])));
        dot[h] = _mm256_add_epi32(_mm256_madd_epi16(p, ones), fix);
      }
      add_scaled<R>(acc, r, dot, sw, xq.scale[row * nb + b]);
    }
  }
  store_rows16<R>(acc, y, ldy, nrows);
}
#endif

#if defined(TPSERVE_AVX512) && defined(__AVX512BF16__)
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
    for (int i = 0; i < 8; ++i) line[i] = (__m512bh)_mm512_loadu_si512(w + (c + i) * 32);
    for (int r = 0; r < R; ++r) {
      const int32_t* xr = reinterpret_cast<const int32_t*>(xq.h.data() + (m0 + r) * K) + c;
      for (int i = 0; i < 8; ++i) acc[r] = _mm512_dpbf16_ps(acc[r], line[i], (__m512bh)_mm512_set1_epi32(xr[i]));
    }
  }
  const __mmask16 m = nrows >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << nrows) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy, m, acc[r]);
}
#endif

bool has_bf16_dot() {
#ifdef TPSERVE_BF16_DOT
  return true;
#else
  return false;
#endif
}

bool has_vnni() {  // the int8 and int4 kernels take int8 activations and 16-row blocks (AVX-512 VNNI or AVX2)
#ifdef TPSERVE_INT8_DOT
  return true;
#else
  return false;
#endif
}

}  // namespace

namespace tpserve {

bool vnni_layout() { return has_vnni(); }
int64_t int_rows() { return has_vnni() ? VNNI_BLOCK : QUANT_BLOCK; }
bool bf16_dot_layout() { return has_bf16_dot(); }
int64_t bf16_rows() { return has_bf16_dot() ? VNNI_BLOCK : QUANT_BLOCK; }

void round_rows_bf16(const float* x, Int8Rows& r, int64_t m0, int64_t m1) {
  const int64_t K = r.K;
#ifdef TPSERVE_BF16_DOT
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t k = 0; k < K; k += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.h.data() + m * K + k),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + m * K + k)));
#else
  (void)x, (void)r, (void)m0, (void)m1, (void)K;
#endif
}

void resize_rows(Int8Rows& r, int64_t M, int64_t K) {
  r.M = M, r.K = K;
  r.q.resize(M * K);
  r.scale.resize(M * (K / 32));
  r.sum.resize(M * (K / 32));
}

void resize_bf16_rows(Int8Rows& r, int64_t M, int64_t K) {
  r.M = M, r.K = K;
  r.h.resize(M * K);
}

// Activations quantized per row and block of 32 inputs: q = round(x / s), s = max|x| / 127 (llama.cpp's Q8_0).
void quantize_rows(const float* x, Int8Rows& r, int64_t m0, int64_t m1, int64_t kb0, int64_t kb1) {
  const int64_t K = r.K, nb = K / 32;
  for (int64_t m = m0; m < m1; ++m)
    for (int64_t b = kb0; b < kb1; ++b) {
      const float* xb = x + m * K + b * 32;
      float amax = 0.f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::abs(xb[i]));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int8_t* qb = r.q.data() + m * K + b * 32;
      for (int i = 0; i < 32; ++i) qb[i] = static_cast<int8_t>(std::nearbyint(xb[i] * inv));
      r.scale[m * nb + b] = amax / 127.f;
      int32_t sum = 0;
      for (int i = 0; i < 32; ++i) sum += qb[i];
      r.sum[m * nb + b] = sum;
    }
}

namespace {

// the bias of rows [n0, n0 + nrows) added to the M outputs of a block, after the product (as torch's y + bias)
inline void add_bias(const float* bias, int64_t M, int64_t n0, int64_t nrows, float* y, int64_t N) {
  if (!bias) return;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < nrows; ++j) y[m * N + n0 + j] += bias[n0 + j];
}

}  // namespace

void int8_range(const float* x, const Int8Rows* xq, int64_t M, int64_t K, const int8_t* w, const at::Half* scale,
                const float* bias, int64_t N, float* y, int64_t b0, int64_t b1) {
  if (amx_int_range(xq, M, K, w, false, scale, 32, bias, N, y, b0, b1)) return;  // AMX builds, prefill
#ifdef TPSERVE_INT8_DOT
  (void)x;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n0 = b * NV, nrows = std::min<int64_t>(NV, N - n0);
    for (int64_t m0 = 0; m0 < M; m0 += MB_VNNI)
      with_rows<MB_VNNI>(std::min<int64_t>(MB_VNNI, M - m0), [&](auto r) {
        int8_dot_block<decltype(r)::value>(*xq, m0, w + n0 * K, K, nrows, scale + b * (K / 32) * NV,
                                            y + m0 * N + n0, N);
      });
    add_bias(bias, M, n0, nrows, y, N);
  }
#else
  (void)xq;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n0 = b * NB, nrows = std::min<int64_t>(NB, N - n0);
    const at::Half* sb = scale + b * (K / 32) * NB;
    for (int64_t m0 = 0; m0 < M; m0 += MB)
      with_rows<MB>(std::min<int64_t>(MB, M - m0), [&](auto r) {
        int8_block<decltype(r)::value>(x + m0 * K, K, w + n0 * K, K, nrows, sb, y + m0 * N + n0, N);
      });
    add_bias(bias, M, n0, nrows, y, N);
  }
#endif
}

void bf16_range(const float* x, const Int8Rows* xq, int64_t M, int64_t K, const uint16_t* w, const float* bias,
                int64_t N, float* y, int64_t b0, int64_t b1) {
  if (amx_bf16_range(xq, M, K, w, bias, N, y, b0, b1)) return;  // AMX builds, prefill
#ifdef TPSERVE_BF16_DOT
  (void)x;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n0 = b * NV, nrows = std::min<int64_t>(NV, N - n0);
    for (int64_t m0 = 0; m0 < M; m0 += MB_VNNI)
      with_rows<MB_VNNI>(std::min<int64_t>(MB_VNNI, M - m0), [&](auto r) {
        bf16_dot_block<decltype(r)::value>(*xq, m0, w + n0 * K, K, nrows, y + m0 * N + n0, N);
      });
    add_bias(bias, M, n0, nrows, y, N);
  }
#else
  (void)xq;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n0 = b * NB, nrows = std::min<int64_t>(NB, N - n0);
    for (int64_t m0 = 0; m0 < M; m0 += MB)
      with_rows<MB>(std::min<int64_t>(MB, M - m0), [&](auto r) {
        bf16_block<decltype(r)::value>(x + m0 * K, K, w + n0 * K, K, nrows, y + m0 * N + n0, N);
      });
    add_bias(bias, M, n0, nrows, y, N);
  }
#endif
}

void int4_range(const float* x, const Int8Rows* xq, int64_t M, int64_t K, const uint8_t* w, const at::Half* scale,
                int64_t G, const float* bias, int64_t N, float* y, int64_t b0, int64_t b1) {
  if (amx_int_range(xq, M, K, w, true, scale, G, bias, N, y, b0, b1)) return;  // AMX builds, prefill
  const int64_t ng = K / G;
#ifdef TPSERVE_INT8_DOT
  (void)x;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n0 = b * NV, nrows = std::min<int64_t>(NV, N - n0);
    for (int64_t m0 = 0; m0 < M; m0 += MB_VNNI)
      with_rows<MB_VNNI>(std::min<int64_t>(MB_VNNI, M - m0), [&](auto r) {
        int4_dot_block<decltype(r)::value>(*xq, m0, w + n0 * (K / 2), K, nrows, scale + n0 * ng, G, y + m0 * N + n0, N);
      });
    add_bias(bias, M, n0, nrows, y, N);
  }
#else
  (void)xq;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n0 = b * NB, nrows = std::min<int64_t>(NB, N - n0);
    for (int64_t m0 = 0; m0 < M; m0 += MB)
      with_rows<MB>(std::min<int64_t>(MB, M - m0), [&](auto r) {
        int4_block<decltype(r)::value>(x + m0 * K, K, w + n0 * (K / 2), K, nrows, scale + n0 * ng, G, y + m0 * N + n0,
                                       N);
      });
    add_bias(bias, M, n0, nrows, y, N);
  }
#endif
}

// x quantized for the int8 and int4 kernels where they take int8 activations (else left empty)
void quantize_all(const float* x, Int8Rows& xq, int64_t M, int64_t K) {
  if (!vnni_layout()) return;
  resize_rows(xq, M, K);
  at::parallel_for(0, M, std::max<int64_t>(1, 8192 / K), [&](int64_t m0, int64_t m1) {  // threads for prefill only
    quantize_rows(x, xq, m0, m1, 0, K / 32);
  });
}

// The ops: output blocks split over torch's intra-op threads, ~64 output rows per task at least (an even split on few
// cores without fine-grained scheduling).
constexpr int64_t GRAIN = 16;  // blocks of 4 rows
const int64_t INT_GRAIN = 64 / int_rows();  // blocks of the int8 / int4 layout

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, int64_t N) {
  const int64_t RB = int_rows();
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && scale.dim() == 3,
              "int8_linear: x [M, K], w [N/RB, RB K], scale [N/RB, K/32, RB]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kChar && scale.scalar_type() == at::kHalf,
              "int8_linear: float32 x, int8 w, float16 scale");
  const int64_t M = x.size(0), K = x.size(1), blocks = (N + RB - 1) / RB;
  TORCH_CHECK(K % 32 == 0 && w.size(0) == blocks && w.size(1) == RB * K && scale.size(0) == blocks &&
                  scale.size(1) == K / 32 && scale.size(2) == RB,
              "int8_linear: shapes (K % 32 == 0, blocks of ", RB, " rows)");
  TORCH_CHECK(w.is_contiguous() && scale.is_contiguous(), "int8_linear: contiguous weights");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const at::Half* sp = scale.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  Int8Rows xq;
  quantize_all(xp, xq, M, K);
  at::parallel_for(0, blocks, INT_GRAIN, [&](int64_t b0, int64_t b1) {
    int8_range(xp, &xq, M, K, wp, sp, nullptr, N, yp, b0, b1);
  });
  return y;
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, int64_t G, int64_t N) {
  const int64_t RB = int_rows();
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && scale.dim() == 3,
              "int4_linear: x [M, K], w [N/RB, RB K/2], scale [N/RB, K/G, RB]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kByte && scale.scalar_type() == at::kHalf,
              "int4_linear: float32 x, uint8 w, float16 scale");
  const int64_t M = x.size(0), K = x.size(1), blocks = (N + RB - 1) / RB;
  TORCH_CHECK(G % 32 == 0 && K % G == 0 && w.size(0) == blocks && w.size(1) == RB * K / 2 &&
                  scale.size(0) == blocks && scale.size(1) == K / G && scale.size(2) == RB,
              "int4_linear: shapes (G % 32 == 0, K % G == 0, blocks of ", RB, " rows)");
  TORCH_CHECK(w.is_contiguous() && scale.is_contiguous(), "int4_linear: contiguous weights");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const at::Half* sp = scale.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
  Int8Rows xq;
  quantize_all(xp, xq, M, K);
  at::parallel_for(0, blocks, INT_GRAIN, [&](int64_t b0, int64_t b1) {
    int4_range(xp, &xq, M, K, wp, sp, G, nullptr, N, yp, b0, b1);
  });
  return y;
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w, int64_t N) {
  const int64_t RB = bf16_rows();
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "bf16_linear: x [M, K], w [N/RB, 2 RB K] bytes");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kByte, "bf16_linear: float32 x, uint8 w");
  const int64_t M = x.size(0), K = x.size(1), blocks = (N + RB - 1) / RB;
  TORCH_CHECK(w.size(0) == blocks && w.size(1) == RB * K * 2 && K % 16 == 0,
              "bf16_linear: shapes (K % 16 == 0, blocks of ", RB, " rows)");
  TORCH_CHECK(w.is_contiguous(), "bf16_linear: contiguous weights");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<uint8_t>());
  float* yp = y.data_ptr<float>();
  Int8Rows xq;
  if (bf16_dot_layout()) {
    resize_bf16_rows(xq, M, K);
    at::parallel_for(0, M, std::max<int64_t>(1, 8192 / K), [&](int64_t m0, int64_t m1) {
      round_rows_bf16(xp, xq, m0, m1);
    });
  }
  at::parallel_for(0, blocks, 64 / RB, [&](int64_t b0, int64_t b1) {
    bf16_range(xp, &xq, M, K, wp, nullptr, N, yp, b0, b1);
  });
  return y;
}

}  // namespace tpserve

TORCH_LIBRARY_FRAGMENT(tpserve, m) {
  m.def("int8_linear(Tensor x, Tensor w, Tensor scale, int n) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor w, Tensor scale, int group, int n) -> Tensor");
  // int8_linear and int4_linear quantize their activations (VNNI), and take weights in blocks of 16 rows
  m.def("quant_int8_activations() -> bool", &has_vnni);
  m.def("bf16_linear(Tensor x, Tensor w, int n) -> Tensor");
  // bf16_linear rounds its activations to bfloat16 (AVX-512 BF16), and takes weights in blocks of 16 rows
  m.def("quant_bf16_activations() -> bool", &has_bf16_dot);
}

TORCH_LIBRARY_IMPL(tpserve, CPU, m) {
  m.impl("int8_linear", &tpserve::int8_linear);
  m.impl("int4_linear", &tpserve::int4_linear);
  m.impl("bf16_linear", &tpserve::bf16_linear);
}
