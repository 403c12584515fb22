// Float32 linears on CPU from weights stored once at load in column blocks: y = x @ W^T (+ bias).
//
//   f32_linear(x [M, K] f32, w [ceil(N/32), K, 32] f32, bias [N] f32 or None, N) -> y [M, N]
//       w[b, k, j] = W[32 b + j, k] (zeros pad the last block): each block of 32 output columns is K runs of 32
//       weights, one per input.
//
// One kernel for every row count, decode and prefill alike. Each task takes a block of 32 outputs and walks its
// weights once, in order, for up to 8 activation rows at a time: per input k, two vector loads of the block's
// weights and, for each row, one broadcast of x[m, k] and two FMAs into 8 x 2 accumulators that stay in registers
// (the microkernel shape of BLAS GEMMs). Over the threads, each one's blocks are one contiguous range, so at one row
// a thread reads its weights as a single sequential stream, the pattern that reaches this host's memory bandwidth
// (BENCHMARKS.md). oneDNN's packed linears, used before, took 23.8 ms per token for SmolLM2's decode step where this
// takes 14.5, and this kernel was faster than them from 8 rows to 512 too (BENCHMARKS.md section 10).
//
// Every output is summed the same way whatever the row count or the tile: acc = fma(x[m, k], W[n, k], acc) for
// k = 0 .. K-1 from zero, then + bias. So a row's product does not depend on the rows batched with it (oneDNN picks
// its kernel by the row count).
//
// AVX2 CPUs (the x86-64-v3 build) have 16 vector registers of 8 floats, not 32 of 16: a tile of 8 rows x 32 outputs
// would spill. There a tile walks the block's weights once per 3 rows, with 3 x 4 accumulators and the weights taken
// straight from memory by the FMAs (the block's K x 128 bytes are in L2 for the second and third pass). Each output
// is still the same chain of FMAs over k, so the AVX2 and AVX-512 builds agree bit for bit.
//
// Other CPUs get the same loops in portable C++ (auto-vectorized). Built by sharding/cpu/kernels.py with the others.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "tpserve_kernels.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

constexpr int64_t BW = tpserve::F32_BLOCK;  // output columns per block
constexpr int64_t MR = 8;   // activation rows per tile (8 x 2 accumulators)

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// R (1-3) rows x 32 outputs of one block: 4R accumulators, R broadcasts, weights as memory operands
template <int R>
inline void f32_tile_avx2(const float* x, int64_t ldx, const float* w, int64_t K, const float* bias, float* y,
                          int64_t ldy, int64_t ncols) {
  __m256 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = w + k * BW;
    __m256 xb[R];
    for (int r = 0; r < R; ++r) xb[r] = _mm256_broadcast_ss(x + r * ldx + k);
    for (int c = 0; c < 4; ++c) {
      const __m256 wc = _mm256_loadu_ps(wk + 8 * c);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(xb[r], wc, acc[r][c]);
    }
  }
  // out through a local buffer at constant indices: with the stores (and a ragged block's copy) indexing `acc` by
  // variable, GCC kept every accumulator in memory and stored all 12 on every k (2.5x slower)
  alignas(32) float out[R][BW];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) _mm256_store_ps(out[r] + 8 * c, acc[r][c]);
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < ncols; ++j) y[r * ldy + j] = bias ? out[r][j] + bias[j] : out[r][j];
}
#endif

template <int R>
inline void f32_tile(const float* x, int64_t ldx, const float* w, int64_t K, const float* bias, float* y, int64_t ldy,
                     int64_t ncols) {
#if defined(__AVX512F__)
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 w0 = _mm512_loadu_ps(w + k * BW), w1 = _mm512_loadu_ps(w + k * BW + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + k]);
      acc[r][0] = _mm512_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xb, w1, acc[r][1]);
    }
  }
  const __mmask16 m0 = ncols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << ncols) - 1);
  const __mmask16 m1 = ncols >= 32 ? 0xFFFF : ncols <= 16 ? 0 : static_cast<__mmask16>((1u << (ncols - 16)) - 1);
  for (int r = 0; r < R; ++r) {
    __m512 a0 = acc[r][0], a1 = acc[r][1];
    if (bias) {
      a0 = _mm512_add_ps(a0, _mm512_maskz_loadu_ps(m0, bias));
      a1 = _mm512_add_ps(a1, _mm512_maskz_loadu_ps(m1, bias + 16));
    }
    _mm512_mask_storeu_ps(y + r * ldy, m0, a0);
    _mm512_mask_storeu_ps(y + r * ldy + 16, m1, a1);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  int r0 = 0;
  for (; r0 + 3 <= R; r0 += 3) f32_tile_avx2<3>(x + r0 * ldx, ldx, w, K, bias, y + r0 * ldy, ldy, ncols);
  if (R - r0 == 2) f32_tile_avx2<2>(x + r0 * ldx, ldx, w, K, bias, y + r0 * ldy, ldy, ncols);
  if (R - r0 == 1) f32_tile_avx2<1>(x + r0 * ldx, ldx, w, K, bias, y + r0 * ldy, ldy, ncols);
#else
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
#endif
}

}  // namespace

namespace tpserve {

void f32_range(const float* x, int64_t M, int64_t K, const float* w, const float* bias, int64_t N, float* y, int64_t b0,
               int64_t b1) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n0 = b * BW, ncols = std::min<int64_t>(BW, N - n0);
    const float* wb = w + b * K * BW;
    for (int64_t m0 = 0; m0 < M; m0 += MR)
      with_rows<MR>(std::min<int64_t>(MR, M - m0), [&](auto r) {
        f32_tile<decltype(r)::value>(x + m0 * K, K, wb, K, bias ? bias + n0 : nullptr, y + m0 * N + n0, N, ncols);
      });
  }
}

at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
              "f32_linear: float32 x [M, K] and w [N/32, K, 32]");
  const int64_t M = x.size(0), K = x.size(1), blocks = w.size(0);
  TORCH_CHECK(w.size(1) == K && w.size(2) == BW && blocks == (N + BW - 1) / BW && w.is_contiguous(),
              "f32_linear: w must be [ceil(N/32), K, 32], contiguous");
  const float* bp = nullptr;
  at::Tensor bc;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat, "f32_linear: bias [N]");
    bc = bias->contiguous();
    bp = bc.data_ptr<float>();
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = xc.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // one block is K * 128 bytes of weights: a split per block keeps 2 threads even on the smallest linears
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) { f32_range(xp, M, K, wp, bp, N, yp, b0, b1); });
  return y;
}

}  // namespace tpserve

TORCH_LIBRARY_FRAGMENT(tpserve, m) {
  m.def("f32_linear(Tensor x, Tensor w, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(tpserve, CPU, m) {
  m.impl("f32_linear", &tpserve::f32_linear);
}
