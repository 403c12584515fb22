// Float32 linears from weights stored once at load in column blocks: y = x @ W^T (+ bias), torch-free (the op:
// f32_linear.cpp).
//
//   w[b, k, j] = W[32 b + j, k] (zeros pad the last block): each block of 32 output columns is K runs of 32
//   weights, one per input.
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
// its kernel by the row count), and every build with FMAs (AVX-512, AVX2, NEON) gives the same bits.
//
// AVX2 CPUs (the x86-64-v3 build) have 16 vector registers of 8 floats, not 32 of 16: a tile of 8 rows x 32 outputs
// would spill. There a tile walks the block's weights once per 3 rows, with 3 x 4 accumulators and the weights taken
// straight from memory by the FMAs (the block's K x 128 bytes are in L2 for the second and third pass)
// (arch/x86/f32.h). NEON has 32 registers of 4 floats: 3 rows x 8 accumulators (arch/arm/f32.h).
//
// Other CPUs get the same loops in portable C++ (core/portable_f32.h, auto-vectorized).

#include "kernels.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace {

constexpr int64_t BW = tpserve::F32_BLOCK;  // output columns per block
constexpr int64_t MR = 8;   // activation rows per tile (8 x 2 accumulators)

}  // namespace

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include "../arch/x86/f32.h"
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include "../arch/arm/f32.h"
#endif
#ifndef TPSERVE_F32_TILE
#include "portable_f32.h"
#endif

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

}  // namespace tpserve
