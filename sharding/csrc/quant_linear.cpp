// Weight-only quantized linears for CPU decode: y = x @ dequant(W)^T, float32 activations, int8 or int4 weights.
// Decode is bound by streaming the weights, so the kernel reads each weight byte once per call and converts it to
// float32 in registers; the activations (a few rows) stay in L1.
//
//   int8_linear(x [M, K] f32, w, scale [N] f32)                 per output channel: W[n,k] = w[n,k] * scale[n]
//   int4_linear(x [M, K] f32, w, scale [N, K/G] f32, G)         per group of G inputs (G % 32 == 0):
//       within each run of 32 inputs, byte j holds input j in its low nibble and input j+16 in its high nibble;
//       W[n,k] = (nibble - 8) * scale[n, k/G]   (llama.cpp's Q4_0 scheme)
//
// A row has R bytes (K for int8, K/2 for int4; R % 16 == 0). The weight w [ceil(N/4), 4R] is stored in blocks of 4
// output rows (zero rows pad the last), as quant.py's pack_rows lays them out: the 4 rows' first 16 bytes in turn,
// then their next 16, and so on. The kernel computes a block's 4 rows together, so it reads its weights as one
// sequential stream, where the 4 rows of the plain layout were 4 short streams side by side (2 threads, SmolLM2's
// linears at one activation row: 17 -> 26-32 GB/s; scripts/bench_quant.py --linears).
//
// Output rows are split over torch's intra-op threads in blocks of 4; each block keeps up to 6 rows of x x 4 output
// rows of float32 accumulators in registers (AVX-512), so every converted weight vector feeds up to 6 FMAs. Other CPUs
// get the same loops in portable C++ (auto-vectorized). Built by sharding/kernels.py with the other CPU kernels.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TPSERVE_AVX512 1
#endif

namespace {

constexpr int64_t NB = 4;    // output rows per block
constexpr int64_t MB = 6;    // activation rows per pass (6 x 4 accumulators + 4 weight vectors fit 32 registers)
constexpr int64_t RUN = 16;  // bytes of one row stored together

#ifdef TPSERVE_AVX512

// w: the block's bytes. Row j's bytes [i, i + 16) are at w + i * NB + j * RUN.
template <int R>
inline void int8_block(const float* x, int64_t ldx, const int8_t* w, int64_t K, int64_t nrows, const float* scale,
                       float* y, int64_t ldy) {
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const int8_t* c = w + k * NB;
    __m512 wf[NB];
    for (int j = 0; j < NB; ++j)
      wf[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + j * RUN))));
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * ldx + k);
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wf[j], acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < nrows; ++j) y[r * ldy + j] = _mm512_reduce_add_ps(acc[r][j]) * scale[j];
}

template <int R>
inline void int4_block(const float* x, int64_t ldx, const uint8_t* w, int64_t K, int64_t nrows, const float* scale,
                       int64_t G, float* y, int64_t ldy) {
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  const float* sr[NB];
  const int64_t ng = K / G;
  for (int j = 0; j < NB; ++j) sr[j] = scale + (j < nrows ? j : 0) * ng;
  // the 16 values a nibble stands for, (n - 8), looked up by vpermps from each int32 lane's low 4 bits
  const __m512 values = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t k = 0; k < K; k += 32) {
    const uint8_t* c = w + (k / 2) * NB;
    __m512 lo[NB], hi[NB];
    for (int j = 0; j < NB; ++j) {
      const __m512 table = _mm512_mul_ps(values, _mm512_set1_ps(sr[j][k / G]));  // this group's weights
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

#else  // portable loops

template <int R>
inline void int8_block(const float* x, int64_t ldx, const int8_t* w, int64_t K, int64_t nrows, const float* scale,
                       float* y, int64_t ldy) {
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < nrows; ++j) {
      const float* xr = x + r * ldx;
      float acc = 0.f;
      for (int64_t k = 0; k < K; k += 16) {
        const int8_t* wr = w + k * NB + j * RUN;
#pragma omp simd reduction(+ : acc)
        for (int64_t i = 0; i < 16; ++i) acc += xr[k + i] * static_cast<float>(wr[i]);
      }
      y[r * ldy + j] = acc * scale[j];
    }
}

template <int R>
inline void int4_block(const float* x, int64_t ldx, const uint8_t* w, int64_t K, int64_t nrows, const float* scale,
                       int64_t G, float* y, int64_t ldy) {
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < nrows; ++j) {
      const float* sr = scale + j * (K / G);
      const float* xr = x + r * ldx;
      float acc = 0.f;
      for (int64_t k = 0; k < K; k += 32) {
        const uint8_t* wr = w + (k / 2) * NB + j * RUN;
        float part = 0.f;
#pragma omp simd reduction(+ : part)
        for (int64_t i = 0; i < 16; ++i) {
          const uint8_t b = wr[i];
          part += xr[k + i] * static_cast<float>((b & 0x0F) - 8) + xr[k + 16 + i] * static_cast<float>((b >> 4) - 8);
        }
        acc += part * sr[k / G];
      }
      y[r * ldy + j] = acc;
    }
}

#endif

// Calls f(std::integral_constant<int, R>{}) for R = rows (1 <= rows <= MAXR): the row count becomes a compile-time
// constant, so each block's accumulators stay in registers.
template <int MAXR, typename F>
inline void with_rows(int64_t rows, const F& f) {
  if constexpr (MAXR > 1) {
    if (rows < MAXR) return with_rows<MAXR - 1>(rows, f);
  }
  f(std::integral_constant<int, MAXR>{});
}

template <typename Block>
void run_blocks(int64_t M, int64_t N, const Block& block) {
  const int64_t blocks = (N + NB - 1) / NB;
  // ~16 blocks per task keeps the split even on few cores without fine-grained scheduling.
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * NB, nrows = std::min<int64_t>(NB, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += MB) block(m0, std::min<int64_t>(MB, M - m0), n0, nrows);
    }
  });
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && scale.dim() == 1, "int8_linear: x [M, K], w [N/4, 4K], scale [N]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kChar && scale.scalar_type() == at::kFloat,
              "int8_linear: float32 x, int8 w, float32 scale");
  const int64_t M = x.size(0), K = x.size(1), N = scale.size(0);
  TORCH_CHECK(w.size(0) == (N + NB - 1) / NB && w.size(1) == NB * K && K % RUN == 0, "int8_linear: shapes (K % 16 == 0)");
  TORCH_CHECK(w.is_contiguous() && scale.is_contiguous(), "int8_linear: contiguous weights");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  run_blocks(M, N, [&](int64_t m0, int64_t rows, int64_t n0, int64_t nrows) {
    const float* xr = xp + m0 * K;
    float* yr = yp + m0 * N + n0;
    with_rows<MB>(rows, [&](auto r) { int8_block<decltype(r)::value>(xr, K, wp + n0 * K, K, nrows, sp + n0, yr, N); });
  });
  return y;
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, int64_t G) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && scale.dim() == 2, "int4_linear: x [M, K], w [N/4, 2K], scale [N, K/G]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kByte && scale.scalar_type() == at::kFloat,
              "int4_linear: float32 x, uint8 w, float32 scale");
  const int64_t M = x.size(0), K = x.size(1), N = scale.size(0);
  TORCH_CHECK(G % 32 == 0 && K % G == 0 && w.size(0) == (N + NB - 1) / NB && w.size(1) == NB * K / 2 &&
                  scale.size(1) == K / G,
              "int4_linear: shapes (G % 32 == 0, K % G == 0)");
  TORCH_CHECK(w.is_contiguous() && scale.is_contiguous(), "int4_linear: contiguous weights");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ng = K / G;
  run_blocks(M, N, [&](int64_t m0, int64_t rows, int64_t n0, int64_t nrows) {
    const float* xr = xp + m0 * K;
    const uint8_t* wr = wp + n0 * (K / 2);
    float* yr = yp + m0 * N + n0;
    with_rows<MB>(rows, [&](auto r) { int4_block<decltype(r)::value>(xr, K, wr, K, nrows, sp + n0 * ng, G, yr, N); });
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tpserve, m) {
  m.def("int8_linear(Tensor x, Tensor w, Tensor scale) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor w, Tensor scale, int group) -> Tensor");
}

TORCH_LIBRARY_IMPL(tpserve, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_linear", &int4_linear);
}
