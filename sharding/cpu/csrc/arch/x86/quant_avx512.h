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

// The VNNI kernels: R activation rows (int8, per row and block of 32 inputs) against one block of 16 weight rows (two
// side by side from 8 rows: dot_blocks, dot_run) stored as quant.py's pack_rows(rows=16, run=4) lays them out: per 4
// inputs (int8) or 8 inputs (int4), the block's 16 rows' 4 bytes side by side, one 64-byte line. vpdpbusd multiplies a
// line (unsigned bytes) by 4 activation bytes broadcast to every lane (signed), so each int32 lane accumulates one
// output row, with no reduction across lanes at the end. Per block of 32 inputs and activation row: 8 vpdpbusd started
// from the block's correction (the weights are stored or flipped to unsigned: w + 8, w + 128), then one conversion to
// float32 and one FMA by the weights' scales (a vector: one per row) times the activations' block scale. The weight
// lines are loaded (and unpacked) once per block and used by every activation row.

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

// P blocks of 16 weight rows (side by side in memory) against R activation rows, one block b of 32 inputs at a time.
// Per unit of 4 inputs each row's 4 activation bytes are broadcast once, into a register, and multiplied into the P
// blocks' lines: the broadcasts are loads, and a load per vpdpbusd (the form with the broadcast in the instruction)
// bounded the loop at several rows. With P = 2 a 5-row pass of a 4096 x 4096 int4 weight in cache, one Zen 5 core, took
// 12.5 us a 512 KB share against 18.0 (one block a call), near vpdpbusd's own rate (BENCHMARKS.md section 32). Each
// row's int32 sum of a block starts from its correction (-offset * the block's activation sum: the weights are stored
// or flipped to unsigned, w + offset), then one conversion to float32 and one FMA by the weights' scales (a vector: one
// per output row) times the row's block scale; the same integers and float steps whatever P. W supplies the weights:
// W::prefetch(p, b, P), W::units(p, b, i, u0, u1) (the lines of inputs 8i..8i+3 and 8i+4..8i+7 as unsigned bytes) and
// W::scales(p) (the 16 rows' scales of block b's group; W::next() after each block).
template <int R, int P, class W>
inline void dot_blocks(const RowsAt<R>& rows, int64_t nb, W& wt, float* y, int64_t ldy, int64_t nrows) {
  __m512 acc[P][R];
  for (int p = 0; p < P; ++p)
    for (int r = 0; r < R; ++r) acc[p][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    for (int p = 0; p < P; ++p) wt.prefetch(p, b, P);
    __m512i d[P][R];
    for (int r = 0; r < R; ++r) {
      const __m512i f = _mm512_set1_epi32(rows.fix[r][b]);
      for (int p = 0; p < P; ++p) d[p][r] = f;
    }
    for (int i = 0; i < 4; ++i) {
      __m512i u0[P], u1[P];
      for (int p = 0; p < P; ++p) wt.units(p, b, i, u0[p], u1[p]);
      for (int r = 0; r < R; ++r) {
        const int32_t* xr = rows.x[r] + b * 8 + 2 * i;
        const __m512i x0 = _mm512_set1_epi32(xr[0]), x1 = _mm512_set1_epi32(xr[1]);
        for (int p = 0; p < P; ++p) d[p][r] = _mm512_dpbusd_epi32(d[p][r], u0[p], x0);
        for (int p = 0; p < P; ++p) d[p][r] = _mm512_dpbusd_epi32(d[p][r], u1[p], x1);
      }
    }
    for (int p = 0; p < P; ++p) {
      const __m512 sw = wt.scales(p);
      for (int r = 0; r < R; ++r)
        acc[p][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[p][r]), _mm512_mul_ps(sw, _mm512_set1_ps(rows.scale[r][b])),
                                    acc[p][r]);
    }
    wt.next();
  }
  const int64_t last = nrows - (P - 1) * NV;  // rows of the last block (a weight's last block may have fewer)
  for (int p = 0; p < P; ++p) store_rows16(acc[p], R, y + p * NV, ldy, p == P - 1 ? last : NV);
}

// One block of 16 weight rows against R activation rows: per block b of 32 inputs and row, 8 vpdpbusd with the
// activation bytes broadcast from memory (in the instruction), in two chains of 4 (even and odd lines: half the latency
// of one chain), the rest as dot_blocks. What decode's 1-7 rows run: there the weights' reads bound the loop.
template <int R, class W>
inline void dot_rows(const RowsAt<R>& rows, int64_t nb, W& wt, float* y, int64_t ldy, int64_t nrows) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    wt.prefetch(0, b, 1);
    __m512i u[8];
    for (int i = 0; i < 4; ++i) wt.units(0, b, i, u[2 * i], u[2 * i + 1]);
    const __m512 sw = wt.scales(0);
    for (int r = 0; r < R; ++r) {
      const int32_t* xr = rows.x[r] + b * 8;
      __m512i d0 = _mm512_set1_epi32(rows.fix[r][b]), d1 = _mm512_setzero_si512();
      for (int i = 0; i < 8; i += 2) {
        d0 = dpbusd_bcst(d0, u[i], xr + i);
        d1 = dpbusd_bcst(d1, u[i + 1], xr + i + 1);
      }
      d0 = _mm512_add_epi32(d0, d1);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), _mm512_mul_ps(sw, _mm512_set1_ps(rows.scale[r][b])), acc[r]);
    }
    wt.next();
  }
  store_rows16(acc, R, y, ldy, nrows);
}

// R rows against the one or two blocks of nrows output rows at w. quant_linear.cpp hands a call DOT_BLOCKS blocks where
// the linear has DOT_BLOCKS_ROWS activation rows or more, one block otherwise: with the weights streamed from memory,
// two blocks side by side read slower than one (two streams: 5 rows of a 134 MB int4 weight took 3.4-3.9 ms against
// 3.2-3.5 on Zen 5), and at fewer than 8 rows the arithmetic of one block at a time already keeps up with memory; from
// 8 rows it does not, and from 9 the later passes of 8 read the block from cache (BENCHMARKS.md section 32).
constexpr int64_t DOT_BLOCKS = 2, DOT_BLOCKS_ROWS = 8;
template <int R, class W>
inline void dot_run(const tpserve::Int8Rows& xq, int64_t m0, const std::vector<int32_t>& fix, W wt, int64_t K,
                    int64_t nrows, float* y, int64_t ldy) {
  const RowsAt<R> rows(xq, m0, fix);
  if (nrows > NV) return dot_blocks<R, DOT_BLOCKS>(rows, K / 32, wt, y, ldy, nrows);
  dot_rows<R>(rows, K / 32, wt, y, ldy, nrows);
}

// int8 weights as 8 lines a block of 32 inputs, flipped to unsigned (w ^ 0x80 = w + 128); block p's at w + p * stride
struct Int8Lines {
  const int8_t* w;
  int64_t stride;
  const tpserve::fp16_t* s;  // block b's scales, of block p at s + p * sstride
  int64_t sstride;
  __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  void prefetch(int p, int64_t b, int P) const { prefetch_block_ahead(w + p * stride, b * 512, 512, stride, P); }
  void units(int p, int64_t b, int i, __m512i& u0, __m512i& u1) const {
    const int8_t* c = w + p * stride + (b * 8 + 2 * i) * 64;
    u0 = _mm512_xor_si512(_mm512_loadu_si512(c), flip);
    u1 = _mm512_xor_si512(_mm512_loadu_si512(c + 64), flip);
  }
  __m512 scales(int p) const { return row_scales16(s + p * sstride); }
  void next() { s += NV; }
};

template <int R>
inline void int8_dot_block(const tpserve::Int8Rows& xq, int64_t m0, const int8_t* w, int64_t K, int64_t nrows,
                            const tpserve::fp16_t* scale, float* y, int64_t ldy) {
  dot_run<R>(xq, m0, xq.fix128, Int8Lines{w, NV * K, scale, (K / 32) * NV}, K, nrows, y, ldy);
}

// int4: a row's byte i of each run of 8 inputs holds input i (low nibble) and input i + 4 (high nibble), stored as
// the nibble w + 8; the scales per group of G inputs (G / 32 blocks, counted instead of divided)
struct Int4Lines {
  const uint8_t* w;
  int64_t stride;
  const tpserve::fp16_t* s;  // the scales of block b's group, of block p at s + p * sstride
  int64_t sstride, per_group, in_group = 0;
  __m512i low = _mm512_set1_epi8(0x0F);
  void prefetch(int p, int64_t b, int P) const { prefetch_block_ahead(w + p * stride, b * 256, 256, stride, P); }
  void units(int p, int64_t b, int i, __m512i& u0, __m512i& u1) const {
    const __m512i line = _mm512_loadu_si512(w + p * stride + (b * 4 + i) * 64);
    u0 = _mm512_and_si512(line, low);
    u1 = _mm512_and_si512(_mm512_srli_epi16(line, 4), low);
  }
  __m512 scales(int p) const { return row_scales16(s + p * sstride); }
  void next() {
    if (++in_group == per_group) in_group = 0, s += NV;
  }
};

template <int R>
inline void int4_dot_block(const tpserve::Int8Rows& xq, int64_t m0, const uint8_t* w, int64_t K, int64_t nrows,
                            const tpserve::fp16_t* scale, int64_t G, float* y, int64_t ldy) {
  dot_run<R>(xq, m0, xq.fix8, Int4Lines{w, NV * (K / 2), scale, (K / G) * NV, G / 32}, K, nrows, y, ldy);
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
