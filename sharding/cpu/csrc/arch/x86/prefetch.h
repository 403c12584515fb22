// Software prefetch for the x86 kernels that stream small-type weights (quant_avx512.h, quant_avx2.h,
// kquant_avx512.h, kquant_avx2.h): each line of weights is asked for PREFETCH_AHEAD bytes before the loop loads it.
// The hardware prefetchers alone keep too few lines in flight when the loop also computes: on Zen 4 (2 threads) the
// int4 kernel read 22-25 GB/s at 5 activation rows and 36-44 GB/s at one (memory and arithmetic took turns), 40-46
// and 43-49 GB/s with 8 KiB ahead (BENCHMARKS.md section 27; 4-16 KiB measured alike). The float32 kernel (f32.h), whose loop is
// loads and FMAs only, already streams at the memory's rate: prefetching there measured no better. A prefetch never
// faults, so the lines past a weight's end cost nothing but their bandwidth.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace {

constexpr int64_t PREFETCH_AHEAD = 8192;

// every line of [p, p + bytes) (bytes a multiple of 64), PREFETCH_AHEAD ahead
inline void prefetch_lines_ahead(const void* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64)
    _mm_prefetch(static_cast<const char*>(p) + o + PREFETCH_AHEAD, _MM_HINT_T0);
}

// The same for one of P blocks of `stride` bytes read side by side (block p at its own pointer): bytes [o, o + bytes)
// of this block, ahead; past the block's end the ask continues into this block's place among the next P blocks
inline void prefetch_block_ahead(const void* block, int64_t o, int64_t bytes, int64_t stride, int P) {
  int64_t a = o + PREFETCH_AHEAD / P;
  if (a >= stride) a += (P - 1) * stride;
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(static_cast<const char*>(block) + a + i, _MM_HINT_T0);
}

}  // namespace
