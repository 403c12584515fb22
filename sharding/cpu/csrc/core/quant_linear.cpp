// Quantized linears for CPU: y = x @ dequant(W)^T, x float32 [M, K], int8, int4 or bf16 weights, decode and prefill;
// torch-free (the ops: quant_linear.cpp).
//
//   int8_linear(x, w, scale [blocks, K/32, rows] f16, N)         W[n,k] = q[n,k] * s[n, k/32]    (llama.cpp's Q8_0)
//   int4_linear(x, w, scale [blocks, K/G, rows] f16, G, N)       W[n,k] = (nibble - 8) * s[n, k/G] (Q4_0; G % 32 == 0)
//   bf16_linear(x, w, N)                                         W[n,k] = w[n,k], a bfloat16
//
// Two layouts of w (quant.py's pack_rows; int_rows() / bf16_rows() say which this build reads):
//
// With AVX-512 VNNI, AVX2 or NEON (int8, int4) and AVX-512 BF16 (bf16), the kernels multiply small types, as llama.cpp
// does: the activations are quantized once per input to int8 per row and block of 32 inputs (scale max|x| / 127,
// Q8_0's; quantize_rows) or rounded to bfloat16 (round_rows_bf16). Weights are in blocks of 16 output rows; each
// 64-byte line holds 4 bytes of each of the 16 rows (4 int8 inputs, 8 int4 inputs, 2 bf16 inputs), so one vpdpbusd
// (vdpbf16ps) multiplies a line by 4 activation bytes (2 bfloat16) broadcast to every lane and each lane accumulates
// one output row: no reduction across lanes at the end. Per block of 32 inputs and activation row, int8 and int4 take
// 8 vpdpbusd started from the block's correction (weights stored or flipped to unsigned: nibble = w + 8,
// w ^ 0x80 = w + 128), one conversion to float32 and one FMA by the weights' scales (a vector, one per row) times the
// activation's block scale. The lines are loaded (and unpacked) once per block and used by up to 8 activation rows.
// SmolLM2's int8 gate_up at 32 rows: 669 us with float32 activations (BENCHMARKS.md section 10), 365-408 us with int8
// ones in the 4-row layout, 210-251 us in this one; at one row it still reads the weights (in cache) at ~100 GB/s,
// faster than memory delivers them (section 11). AVX2 without VNNI (Zen 2 and 3, Intel client cores) runs the same
// layout with vpmaddubsw and vpmaddwd in two 256-bit halves of each line (arch/x86/quant_avx2.h); ARM64 with sdot
// (the dot product extension) or smull + sadalp, a line as four 128-bit quarters (arch/arm/quant_neon.h). The int32
// dot products are exact and the float steps after them the same, so all of these builds give the same outputs, bit
// for bit.
//
// Elsewhere (x86-64-v4 without VNNI, x86 below AVX2; bf16 weights everywhere but AVX-512 BF16), float32 activations:
// weights in blocks of 4 output rows, interleaved in runs of 16 bytes (32 for bf16), the block's 4 rows computed
// together so that they are read as one sequential stream (2 threads, SmolLM2's int8 linears at one row: 17 -> 26-32
// GB/s against 4 plain rows side by side); each converted weight vector feeds up to 6 activation rows x 4 output rows
// of float32 accumulators (AVX-512, arch/x86/quant_avx512.h), or the same loops in portable C++
// (core/portable_quant.h).
//
// Either way each output is one fixed sum, the same whatever the rows batched with it. Output blocks are split over
// torch's intra-op threads (the ops) or over decode_layers' team (decode_glue.cpp). Built by sharding/cpu/kernels.py.

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t NB = 4;    // output rows per block
constexpr int64_t MB = 6;    // activation rows per pass (6 x 4 accumulators + 4 weight vectors fit 32 registers)
constexpr int64_t RUN = 16;  // bytes of one row stored together (int8, int4; bf16: 16 weights, RUN * 2 bytes)

}  // namespace

// The inner loops of this build's ISA: each header defines what it has (TPSERVE_INT8_DOT: int8_dot_block and
// int4_dot_block over the 16-row layout, with NV and MB_VNNI; TPSERVE_BF16_DOT: bf16_dot_block and round_row_bf16;
// TPSERVE_AVX512: the 4-row layout's float32-activation blocks); the portable loops stand in for the rest.
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include "../arch/x86/quant_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "../arch/x86/quant_avx2.h"
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include "../arch/arm/quant_neon.h"
#endif
#ifndef TPSERVE_AVX512
#include "portable_quant.h"
#endif

namespace {

bool has_bf16_dot() {
#ifdef TPSERVE_BF16_DOT
  return true;
#else
  return false;
#endif
}

bool has_vnni() {  // the int8 and int4 kernels take int8 activations and 16-row blocks (VNNI, AVX2, NEON)
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
  for (int64_t m = m0; m < m1; ++m) round_row_bf16(x + m * K, r.h.data() + m * K, K);
#else
  (void)x, (void)r, (void)m0, (void)m1, (void)K;
#endif
}

void resize_rows(Int8Rows& r, int64_t M, int64_t K) {
  r.M = M, r.K = K;
  r.q.resize(M * K);
  r.scale.resize(M * (K / 32));
  r.sum.resize(M * (K / 32));
  r.sum16.resize(M * (K / 16));
  r.fix8.resize(M * (K / 32));
  r.fix128.resize(M * (K / 32));
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
#pragma omp simd reduction(max : amax)
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::abs(xb[i]));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      // the rounded values as int32 first, so that the stores and the sums below vectorize (summing the int8 bytes
      // back from memory compiled to a scalar chain: most of this function's time at 5 rows)
      int32_t qi[32];
#pragma omp simd
      for (int i = 0; i < 32; ++i) qi[i] = static_cast<int32_t>(std::nearbyint(xb[i] * inv));
      int8_t* qb = r.q.data() + m * K + b * 32;
#pragma omp simd
      for (int i = 0; i < 32; ++i) qb[i] = static_cast<int8_t>(qi[i]);
      r.scale[m * nb + b] = amax / 127.f;
      int32_t lo = 0, hi = 0;
#pragma omp simd reduction(+ : lo)
      for (int i = 0; i < 16; ++i) lo += qi[i];
#pragma omp simd reduction(+ : hi)
      for (int i = 16; i < 32; ++i) hi += qi[i];
      r.sum[m * nb + b] = lo + hi;
      r.fix8[m * nb + b] = -8 * (lo + hi);
      r.fix128[m * nb + b] = -128 * (lo + hi);
      r.sum16[m * 2 * nb + 2 * b] = lo;
      r.sum16[m * 2 * nb + 2 * b + 1] = hi;
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

void int8_range(const float* x, const Int8Rows* xq, int64_t M, int64_t K, const int8_t* w, const fp16_t* scale,
                const float* bias, int64_t N, float* y, int64_t b0, int64_t b1) {
  if (amx_int_range(xq, M, K, w, false, scale, 32, bias, N, y, b0, b1)) return;  // AMX builds, prefill
#ifdef TPSERVE_INT8_DOT
  (void)x;
  const int64_t per_call = M >= DOT_BLOCKS_ROWS ? DOT_BLOCKS : 1;  // blocks a call
  for (int64_t b = b0, nb; b < b1; b += nb) {
    nb = std::min<int64_t>(per_call, b1 - b);
    const int64_t n0 = b * NV, nrows = std::min<int64_t>(nb * NV, N - n0);
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
    const fp16_t* sb = scale + b * (K / 32) * NB;
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

void int4_range(const float* x, const Int8Rows* xq, int64_t M, int64_t K, const uint8_t* w, const fp16_t* scale,
                int64_t G, const float* bias, int64_t N, float* y, int64_t b0, int64_t b1) {
  if (amx_int_range(xq, M, K, w, true, scale, G, bias, N, y, b0, b1)) return;  // AMX builds, prefill
  const int64_t ng = K / G;
#ifdef TPSERVE_INT8_DOT
  (void)x;
  const int64_t per_call = M >= DOT_BLOCKS_ROWS ? DOT_BLOCKS : 1;  // blocks a call
  for (int64_t b = b0, nb; b < b1; b += nb) {
    nb = std::min<int64_t>(per_call, b1 - b);
    const int64_t n0 = b * NV, nrows = std::min<int64_t>(nb * NV, N - n0);
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

const char* kernels_isa() {
#if defined(TPSERVE_AVX512) && defined(TPSERVE_VNNI) && defined(TPSERVE_BF16_DOT)
  return "avx512-vnni-bf16";
#elif defined(TPSERVE_AVX512) && defined(TPSERVE_VNNI)
  return "avx512-vnni";
#elif defined(TPSERVE_AVX512)
  return "avx512";
#elif defined(TPSERVE_AVX2_DOT)
  return "avx2";
#elif defined(TPSERVE_NEON) && defined(__ARM_FEATURE_DOTPROD)
  return "neon-dotprod";
#elif defined(TPSERVE_NEON)
  return "neon";
#else
  return "portable";
#endif
}

}  // namespace tpserve
