// Weight-only quantized linears for CPU decode: y = x @ dequant(W)^T, float32 activations, int8 or int4 weights.
// Decode is bound by streaming the weights, so the kernel reads each weight byte once per call and converts it to
// float32 in registers; the activations (a few rows) stay in L1.
//
//   int8_linear(x [M, K] f32, w [N, K] int8, scale [N] f32)                 per output channel: W[n,k] = w[n,k]*scale[n]
//   int4_linear(x [M, K] f32, w [N, K/2] uint8, scale [N, K/G] f32, G)      per group of G inputs (G % 32 == 0):
//       within each run of 32 inputs, byte j holds input j in its low nibble and input j+16 in its high nibble;
//       W[n,k] = (nibble - 8) * scale[n, k/G]   (llama.cpp's Q4_0 scheme)
//
// Output rows are split over torch's intra-op threads in blocks of 4; each block keeps up to 4 rows of x x 4 output
// rows of float32 accumulators in registers (AVX-512), so every converted weight vector feeds up to 4 FMAs. Other CPUs
// get the same loops in portable C++ (auto-vectorized). Built by sharding/kernels.py with the paged attention kernel.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define TPSERVE_AVX512 1
#endif

namespace {

constexpr int64_t NB = 4;  // output rows per block
constexpr int64_t MB = 6;  // activation rows per pass (6 x 4 accumulators + 4 weight vectors fit 32 registers)
// Software prefetch distance, in blocks of rows: the 4 rows of a block are read side by side, short strided streams
// the hardware prefetcher ramps up on too late (2 threads, SmolLM2's 3072 x 576 int8 weights from memory: 14 -> 17 GB/s)
constexpr int64_t PREFETCH_BLOCKS = 8;

#ifdef TPSERVE_AVX512

template <int R>
inline void int8_block(const float* x, int64_t ldx, const int8_t* w, int64_t K, int64_t nrows, const float* scale,
                       float* y, int64_t ldy) {
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  const int8_t* wr[NB];
  for (int j = 0; j < NB; ++j) wr[j] = w + (j < nrows ? j : 0) * K;
  const int64_t ahead = PREFETCH_BLOCKS * NB * K;
  for (int64_t k = 0; k < K; k += 16) {
    __m512 wf[NB];
    if (k % 64 == 0)
      for (int j = 0; j < NB; ++j) _mm_prefetch(reinterpret_cast<const char*>(wr[j] + ahead + k), _MM_HINT_T0);
    for (int j = 0; j < NB; ++j)
      wf[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr[j] + k))));
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
  const uint8_t* wr[NB];
  const float* sr[NB];
  const int64_t ng = K / G;
  for (int j = 0; j < NB; ++j) {
    wr[j] = w + (j < nrows ? j : 0) * (K / 2);
    sr[j] = scale + (j < nrows ? j : 0) * ng;
  }
  const __m128i low = _mm_set1_epi8(0x0F);
  const int64_t ahead = PREFETCH_BLOCKS * NB * (K / 2);
  for (int64_t k = 0; k < K; k += 32) {
    __m512 lo[NB], hi[NB];
    for (int j = 0; j < NB; ++j) {
      if (k % 128 == 0) _mm_prefetch(reinterpret_cast<const char*>(wr[j] + ahead + k / 2), _MM_HINT_T0);
      const __m512 s = _mm512_set1_ps(sr[j][k / G]);
      const __m512 off = _mm512_set1_ps(-8.0f * sr[j][k / G]);
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr[j] + k / 2));
      const __m128i bl = _mm_and_si128(b, low);
      const __m128i bh = _mm_and_si128(_mm_srli_epi16(b, 4), low);
      lo[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bl)), s, off);
      hi[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bh)), s, off);
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
      const int8_t* wr = w + j * K;
      const float* xr = x + r * ldx;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t k = 0; k < K; ++k) acc += xr[k] * static_cast<float>(wr[k]);
      y[r * ldy + j] = acc * scale[j];
    }
}

template <int R>
inline void int4_block(const float* x, int64_t ldx, const uint8_t* w, int64_t K, int64_t nrows, const float* scale,
                       int64_t G, float* y, int64_t ldy) {
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < nrows; ++j) {
      const uint8_t* wr = w + j * (K / 2);
      const float* sr = scale + j * (K / G);
      const float* xr = x + r * ldx;
      float acc = 0.f;
      for (int64_t k = 0; k < K; k += 32) {
        float part = 0.f;
#pragma omp simd reduction(+ : part)
        for (int64_t i = 0; i < 16; ++i) {
          const uint8_t b = wr[k / 2 + i];
          part += xr[k + i] * static_cast<float>((b & 0x0F) - 8) + xr[k + 16 + i] * static_cast<float>((b >> 4) - 8);
        }
        acc += part * sr[k / G];
      }
      y[r * ldy + j] = acc;
    }
}

#endif

#if defined(TPSERVE_AVX512) && defined(__AVX512VNNI__)
#define TPSERVE_VNNI 1

// Activations quantized like llama.cpp's Q8_0 dot products: per row and block of 32 inputs, xq = round(x / sx) with
// sx = max|x| / 127. vpdpbusd multiplies unsigned by signed bytes, so the weights are the unsigned side (int8 with the
// sign bit flipped = w + 128; int4 nibbles = w + 8) and each 4-byte lane starts from -offset * (its 4 xq summed):
// the int32 lanes then hold exact sums of w * xq, which are scaled per block (sx) and per row or group (sw) in float.
struct QuantX {
  std::vector<int8_t> q;       // [M, K]
  std::vector<float> scale;    // [M, K/4]: the block's sx repeated for each 4-byte lane
  std::vector<int32_t> corr;   // [M, K/4]: -offset * sum of the lane's 4 xq
};

inline QuantX quantize_rows(const float* x, int64_t M, int64_t K, int32_t offset) {
  QuantX r{std::vector<int8_t>(M * K), std::vector<float>(M * K / 4), std::vector<int32_t>(M * K / 4)};
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < K; b += 32) {
      const float* xb = x + m * K + b;
      float amax = 0.f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::abs(xb[i]));
      const float sx = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      int8_t* qb = r.q.data() + m * K + b;
      for (int i = 0; i < 32; ++i) qb[i] = static_cast<int8_t>(std::nearbyint(xb[i] * inv));
      for (int l = 0; l < 8; ++l) {
        r.scale[(m * K + b) / 4 + l] = sx;
        r.corr[(m * K + b) / 4 + l] = -offset * (qb[4 * l] + qb[4 * l + 1] + qb[4 * l + 2] + qb[4 * l + 3]);
      }
    }
  return r;
}

// 64 weights of one row as unsigned bytes in input order.
inline __m512i int8_u8(const int8_t* w) {
  return _mm512_xor_si512(_mm512_loadu_si512(w), _mm512_set1_epi8(static_cast<char>(0x80)));
}
inline __m512i int4_u8(const uint8_t* w) {  // 32 bytes: two runs of 32 inputs (low nibbles j, high nibbles j + 16)
  const __m512i v = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  const __m512i d = _mm512_shuffle_i64x2(v, v, 0x50);  // 128-bit lanes [run0, run0, run1, run1]
  const __m512i hi = _mm512_srli_epi16(d, 4);
  return _mm512_and_si512(_mm512_mask_blend_epi64(0xCC, d, hi), _mm512_set1_epi8(0x0F));
}

template <int R, bool INT4>
inline void vnni_block(const QuantX& xq, int64_t m0, const uint8_t* w, int64_t K, int64_t nrows, const float* scale,
                       int64_t G, float* y, int64_t ldy) {
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t row_bytes = INT4 ? K / 2 : K, ng = INT4 ? K / G : 1;
  const uint8_t* wr[NB];
  const float* sr[NB];
  for (int j = 0; j < NB; ++j) {
    wr[j] = w + (j < nrows ? j : 0) * row_bytes;
    sr[j] = scale + (j < nrows ? j : 0) * ng;
  }
  const int64_t ahead = PREFETCH_BLOCKS * NB * row_bytes;  // the rows a few blocks on, read later by this thread
  for (int64_t k = 0; k < K; k += 64) {
    __m512i wv[NB];
    __m512 sw[NB];
    for (int j = 0; j < NB; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(wr[j] + ahead + (INT4 ? k / 2 : k)), _MM_HINT_T0);
      if constexpr (INT4) {
        wv[j] = int4_u8(wr[j] + k / 2);
        sw[j] = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(sr[j][k / G]), _mm512_set1_ps(sr[j][(k + 32) / G]));
      } else {
        wv[j] = int8_u8(reinterpret_cast<const int8_t*>(wr[j]) + k);
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t at = (m0 + r) * K + k;
      const __m512i xv = _mm512_loadu_si512(xq.q.data() + at);
      const __m512i c = _mm512_loadu_si512(xq.corr.data() + at / 4);
      const __m512 sx = _mm512_loadu_ps(xq.scale.data() + at / 4);
      for (int j = 0; j < NB; ++j) {
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(c, wv[j], xv));
        acc[r][j] = _mm512_fmadd_ps(dot, INT4 ? _mm512_mul_ps(sx, sw[j]) : sx, acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < nrows; ++j)
      y[r * ldy + j] = _mm512_reduce_add_ps(acc[r][j]) * (INT4 ? 1.f : scale[j]);
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
void run_blocks(int64_t M, int64_t N, const Block& block, int64_t mb = MB) {
  const int64_t blocks = (N + NB - 1) / NB;
  // ~16 blocks per task keeps the split even on few cores without fine-grained scheduling.
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * NB, nrows = std::min<int64_t>(NB, N - n0);
      for (int64_t m0 = 0; m0 < M; m0 += mb) block(m0, std::min<int64_t>(mb, M - m0), n0, nrows);
    }
  });
}

bool has_vnni() {
#ifdef TPSERVE_VNNI
  return true;
#else
  return false;
#endif
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, bool quantize_x) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && scale.dim() == 1, "int8_linear: x [M, K], w [N, K], scale [N]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kChar && scale.scalar_type() == at::kFloat,
              "int8_linear: float32 x, int8 w, float32 scale");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && scale.size(0) == N && K % 16 == 0, "int8_linear: shapes (K % 16 == 0)");
  TORCH_CHECK(w.is_contiguous() && scale.is_contiguous(), "int8_linear: contiguous weights");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#ifdef TPSERVE_VNNI
  if (quantize_x && K % 64 == 0) {
    const QuantX xq = quantize_rows(xp, M, K, 128);
    const uint8_t* wu = reinterpret_cast<const uint8_t*>(wp);
    run_blocks(M, N, [&](int64_t m0, int64_t rows, int64_t n0, int64_t nrows) {
      float* yr = yp + m0 * N + n0;
      with_rows<4>(rows, [&](auto r) {
        vnni_block<decltype(r)::value, false>(xq, m0, wu + n0 * K, K, nrows, sp + n0, 0, yr, N);
      });
    }, 4);  // 4 x 4 int32 + float accumulators
    return y;
  }
#endif
  run_blocks(M, N, [&](int64_t m0, int64_t rows, int64_t n0, int64_t nrows) {
    const float* xr = xp + m0 * K;
    float* yr = yp + m0 * N + n0;
    with_rows<MB>(rows, [&](auto r) { int8_block<decltype(r)::value>(xr, K, wp + n0 * K, K, nrows, sp + n0, yr, N); });
  });
  return y;
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, int64_t G, bool quantize_x) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && scale.dim() == 2, "int4_linear: x [M, K], w [N, K/2], scale [N, K/G]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kByte && scale.scalar_type() == at::kFloat,
              "int4_linear: float32 x, uint8 w, float32 scale");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(G % 32 == 0 && K % G == 0 && w.size(1) * 2 == K && scale.size(0) == N && scale.size(1) == K / G,
              "int4_linear: shapes (G % 32 == 0, K % G == 0)");
  TORCH_CHECK(w.is_contiguous() && scale.is_contiguous(), "int4_linear: contiguous weights");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ng = K / G;
#ifdef TPSERVE_VNNI
  if (quantize_x && K % 64 == 0) {
    const QuantX xq = quantize_rows(xp, M, K, 8);
    run_blocks(M, N, [&](int64_t m0, int64_t rows, int64_t n0, int64_t nrows) {
      const uint8_t* wr = wp + n0 * (K / 2);
      float* yr = yp + m0 * N + n0;
      with_rows<4>(rows, [&](auto r) {
        vnni_block<decltype(r)::value, true>(xq, m0, wr, K, nrows, sp + n0 * ng, G, yr, N);
      });
    }, 4);  // 4 x 4 int32 + float accumulators
    return y;
  }
#endif
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
  m.def("int8_linear(Tensor x, Tensor w, Tensor scale, bool quantize_x) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor w, Tensor scale, int group, bool quantize_x) -> Tensor");
  m.def("quant_has_vnni() -> bool", &has_vnni);
}

TORCH_LIBRARY_IMPL(tpserve, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_linear", &int4_linear);
}
