// Decode attention of one (sequence, KV head) read straight from the paged KV cache (float32), torch-free (the op:
// paged_attention.cpp; decode_glue.cpp's decode_layers calls it too): the head's G query heads share each key and
// value row read, and no block is gathered into a contiguous copy. Portable C++ on every build (the compiler
// vectorizes the loops over D and the softmax's exp through libmvec where -ffast-math allows it).

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace tpserve {

void paged_attention_head(const float* qbh, const float* kh, const float* vh, const int64_t* blocks, int64_t len,
                          int64_t first, int64_t G, int64_t D, int64_t BS, float fscale, std::vector<float>& scores,
                          float* obh, const float* sinks, float softcap) {
  const int64_t n = len - first;
  scores.resize(G * n);
  // scores[g][t] = q[g] . k[t] * scale, each key row read once for the group
  for (int64_t t = first; t < len; ++t) {
    const float* krow = kh + (blocks[t / BS] * BS + t % BS) * D;
    if (t + BS < len) {  // the same row of the next block: blocks are scattered, so the hardware cannot guess
      const float* next = kh + (blocks[(t + BS) / BS] * BS + t % BS) * D;
      for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(next + d);
    }
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qbh + g * D;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t d = 0; d < D; ++d) acc += qg[d] * krow[d];
      const float sc = acc * fscale;  // soft-capped (Gemma 2): tanh(s / cap) * cap
      scores[g * n + (t - first)] = softcap > 0.f ? std::tanh(sc / softcap) * softcap : sc;
    }
  }
  // softmax per query head
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores.data() + g * n;
    float m = s[0];  // (no infinities here: every key in [first, len) is attended; built with -ffast-math)
#pragma omp simd reduction(max : m)
    for (int64_t i = 1; i < n; ++i) m = std::max(m, s[i]);
    if (sinks) m = std::max(m, sinks[g]);
    float sum = sinks ? std::exp(sinks[g] - m) : 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) {
      s[i] = std::exp(s[i] - m);  // vectorized through glibc's libmvec (-ffast-math)
      sum += s[i];
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) s[i] *= inv;
  }
  // out[g] = sum_t p[g][t] v[t], each value row read once for the group
  std::fill(obh, obh + G * D, 0.f);
  for (int64_t t = first; t < len; ++t) {
    const float* vrow = vh + (blocks[t / BS] * BS + t % BS) * D;
    if (t + BS < len) {
      const float* next = vh + (blocks[(t + BS) / BS] * BS + t % BS) * D;
      for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(next + d);
    }
    for (int64_t g = 0; g < G; ++g) {
      const float w = scores[g * n + (t - first)];
      float* og = obh + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) og[d] += w * vrow[d];
    }
  }
}

}  // namespace tpserve
