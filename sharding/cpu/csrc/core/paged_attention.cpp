// Decode attention of one sequence's KV head read straight from the paged KV cache (float32), torch-free (the op:
// paged_attention.cpp; decode_glue.cpp's decode_layers calls it too): the head's G query heads, of one row or of
// several rows of the same sequence (a speculative step's verification rows), share each key and value row read, and
// no block is gathered into a contiguous copy. Portable C++ on every build (the compiler vectorizes the loops over D
// and the softmax's exp through libmvec where -ffast-math allows it).
//
// A query's arithmetic does not depend on how many rows share the call: the same loops over D, and its scores at the
// start of their own 64-byte-aligned stretch of the scratch, so a vectorized loop's split into a peeled head and
// vector body (decided from the address at run time) falls alike. A verification row therefore gets the bits a plain
// decode step of that position gets, and speculation stays exact.

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace tpserve {

// (one compiled body for every R: a copy specialised for R = 1, inlined or cloned with the constant, could vectorize
// differently and round differently)
__attribute__((noinline, noclone)) void paged_attention_rows(const float* q, int64_t qs, const float* kh,
                                                             const float* vh, const int64_t* blocks,
                                                             const int64_t* lens, const int64_t* firsts, int64_t R,
                                                             int64_t G, int64_t D, int64_t BS, float fscale,
                                                             std::vector<float>& scratch, float* o, int64_t os,
                                                             const float* sinks, float softcap) {
  int64_t f0 = firsts[0], l1 = lens[0];
  for (int64_t r = 1; r < R; ++r) {
    f0 = std::min(f0, firsts[r]);
    l1 = std::max(l1, lens[r]);
  }
  const int64_t stride = (l1 - f0 + 15) / 16 * 16;  // floats per query's scores, a multiple of 64 bytes
  scratch.resize(R * G * stride + 16);
  const uintptr_t base = reinterpret_cast<uintptr_t>(scratch.data());
  float* scores = scratch.data() + ((64 - base % 64) % 64) / sizeof(float);  // 64-byte aligned (malloc gives 16)
  // scores of query (r, g) at key t: scores[(r G + g) stride + t - first_r], each key row read once for every query
  for (int64_t t = f0; t < l1; ++t) {
    const float* krow = kh + (blocks[t / BS] * BS + t % BS) * D;
    if (t + BS < l1) {  // the same row of the next block: blocks are scattered, so the hardware cannot guess
      const float* next = kh + (blocks[(t + BS) / BS] * BS + t % BS) * D;
      for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(next + d);
    }
    for (int64_t r = 0; r < R; ++r) {
      if (t < firsts[r] || t >= lens[r]) continue;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + r * qs + g * D;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t d = 0; d < D; ++d) acc += qg[d] * krow[d];
        const float sc = acc * fscale;  // soft-capped (Gemma 2): tanh(s / cap) * cap
        scores[(r * G + g) * stride + (t - firsts[r])] = softcap > 0.f ? std::tanh(sc / softcap) * softcap : sc;
      }
    }
  }
  // softmax per query
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = lens[r] - firsts[r];
    for (int64_t g = 0; g < G; ++g) {
      float* s = scores + (r * G + g) * stride;
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
  }
  // out of query (r, g) = sum_t p[t] v[t], each value row read once for every query
  for (int64_t r = 0; r < R; ++r) std::fill(o + r * os, o + r * os + G * D, 0.f);
  for (int64_t t = f0; t < l1; ++t) {
    const float* vrow = vh + (blocks[t / BS] * BS + t % BS) * D;
    if (t + BS < l1) {
      const float* next = vh + (blocks[(t + BS) / BS] * BS + t % BS) * D;
      for (int64_t d = 0; d < D; d += 16) __builtin_prefetch(next + d);
    }
    for (int64_t r = 0; r < R; ++r) {
      if (t < firsts[r] || t >= lens[r]) continue;
      for (int64_t g = 0; g < G; ++g) {
        const float w = scores[(r * G + g) * stride + (t - firsts[r])];
        float* og = o + r * os + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) og[d] += w * vrow[d];
      }
    }
  }
}

void paged_attention_head(const float* qbh, const float* kh, const float* vh, const int64_t* blocks, int64_t len,
                          int64_t first, int64_t G, int64_t D, int64_t BS, float fscale, std::vector<float>& scores,
                          float* obh, const float* sinks, float softcap) {
  paged_attention_rows(qbh, G * D, kh, vh, blocks, &len, &first, 1, G, D, BS, fscale, scores, obh, G * D, sinks,
                       softcap);
}

}  // namespace tpserve
