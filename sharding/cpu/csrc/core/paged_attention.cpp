// Decode attention of one sequence's KV head read straight from the paged KV cache (float32), torch-free (the op:
// paged_attention.cpp; decode_glue.cpp's decode_layers calls it too): the head's G query heads, of one row or of
// several rows of the same sequence (a speculative step's verification rows), share each key and value row read, and
// no block is gathered into a contiguous copy.
//
// The keys go W at a time (W: the build's float vector, 16 with AVX-512, 8 with AVX/AVX2, 4 elsewhere), W rows of a
// cache block being one contiguous stretch. Per query, W keys' dot products are W vectors of partial sums (D / W
// products each, in the compiler's portable vector extension), and one transposed reduction (log2 W levels of two
// shuffles and an add) turns them into one vector of W scores. The loop this replaced paid a horizontal sum per key
// and query: at 400 tokens of context that was about a third of SmolLM2's int4 decode step, and after 3,000 tokens a
// 5-row verification step took 18.4 ms against 8.3 now (BENCHMARKS.md section 31). Head sizes the templates do not
// cover (and cache blocks that are not a multiple of W rows) take the plain loops.
//
// The keys are cut into chunks of ATTENTION_CHUNK at fixed positions (core/kernels.h). paged_attention_chunk gives a
// chunk's partial per query: the sum over its keys, in order, of exp(s - m) v, with m the chunk's largest score, and
// the sum of those exponentials; paged_attention_combine merges a query's partials in chunk order. decode_layers hands
// chunks to its team one at a time; paged_attention_rows makes the same calls in sequence.
//
// A query's arithmetic does not depend on how many rows share the call or who computes which chunk: the same loops
// for each query, over the same absolute groups and chunks of keys, in the same order. A verification row therefore
// gets the bits a plain decode step of that position gets, and speculation stays exact
// (tests/sharding/test_kernel_harness.py: attention_rows; tests/sharding/test_perf_paths.py: long contexts).

#include "kernels.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr int W = 16;
#elif defined(__AVX__)
constexpr int W = 8;
#else
constexpr int W = 4;  // SSE2, NEON, or whatever the compiler makes of 16 bytes
#endif

typedef float fvec __attribute__((vector_size(W * 4)));
typedef float fvec_u __attribute__((vector_size(W * 4), aligned(4), may_alias));  // unaligned loads and stores
typedef int32_t ivec __attribute__((vector_size(W * 4)));

inline fvec load(const float* p) { return *reinterpret_cast<const fvec_u*>(p); }
inline void store(float* p, fvec v) { *reinterpret_cast<fvec_u*>(p) = v; }
inline fvec splat(float x) { return fvec{} + x; }

// One level of the transposed reduction. x and y each hold W / L keys' partial sums, L lanes per key; the result holds
// x's keys then y's, L / 2 lanes each (lane p of the result: segment p / (L / 2), the sum of the two halves of that
// key's segment).
constexpr int half_lane(int p, int L, int second) {
  const int h = L / 2, j = p / h, k = p % h;
  return (j < W / L ? j * L + k : W + (j - W / L) * L + k) + second * h;
}

template <int L, int... P>
inline fvec fold(fvec x, fvec y, std::integer_sequence<int, P...>) {
#if defined(__clang__)
  return __builtin_shufflevector(x, y, half_lane(P, L, 0)...) + __builtin_shufflevector(x, y, half_lane(P, L, 1)...);
#else
  return __builtin_shuffle(x, y, ivec{half_lane(P, L, 0)...}) + __builtin_shuffle(x, y, ivec{half_lane(P, L, 1)...});
#endif
}

// lane i of the result = the sum of a[i]'s lanes, for the W vectors a (overwritten): log2 W levels, L of them in
// each (L lanes per key) folded pairwise into L / 2
template <int L>
inline fvec lane_sums(fvec* a) {
  if constexpr (L == 1) {
    return a[0];
  } else {
    for (int i = 0; i < L / 2; ++i) a[i] = fold<L>(a[2 * i], a[2 * i + 1], std::make_integer_sequence<int, W>{});
    return lane_sums<L / 2>(a);
  }
}

// keys [first, len) of group [t0, t0 + W) as a lane mask
inline ivec in_range(int64_t t0, int64_t first, int64_t len) {
  ivec t;
  for (int i = 0; i < W; ++i) t[i] = static_cast<int32_t>(i);
  const int32_t lo = static_cast<int32_t>(std::max<int64_t>(first - t0, -1)),
                hi = static_cast<int32_t>(std::min<int64_t>(len - t0, W + 1));
  return (t >= lo) & (t < hi);
}

// One chunk [cs, ce) of keys for R rows x G queries: per query (r, g) whose keys [first, len) meet the chunk, its
// partial at part + r prs + g pgs: o[D] = sum over its keys t in the chunk, in order, of exp(s_t - m) v_t; then m,
// the chunk's largest score, and l = sum of exp(s_t - m). The vector kernel: head size D a multiple of W, blocks of
// BS % W == 0 rows (a chunk is a multiple of W keys, so W keys from a multiple of W are one stretch of one block).
template <int D>
void chunk_vec(const float* q, int64_t qs, const float* kh, const float* vh, const int64_t* blocks,
               const int64_t* lens, const int64_t* firsts, int64_t R, int64_t G, int64_t BS, float fscale, int64_t cs,
               int64_t ce, std::vector<float>& scratch, float* part, int64_t prs, int64_t pgs, float softcap) {
  constexpr int NV = D / W;  // vectors per row of D
  int64_t f0 = ce, l1 = cs, end = 0;  // the keys any row reads here; the last one any row reads at all
  for (int64_t r = 0; r < R; ++r) {
    end = std::max(end, lens[r]);
    if (std::max(firsts[r], cs) >= std::min(lens[r], ce)) continue;  // (a row whose keys miss the chunk)
    f0 = std::min(f0, std::max(firsts[r], cs));
    l1 = std::max(l1, std::min(lens[r], ce));
  }
  if (f0 >= l1) return;
  const int64_t k0 = f0 / W * W, ng = (l1 - k0 + W - 1) / W;  // groups of W keys from k0
  const int64_t stride = ng * W;  // floats per query's scores
  scratch.resize(R * G * stride + W);
  const uintptr_t base = reinterpret_cast<uintptr_t>(scratch.data());
  float* scores = scratch.data() + ((W * 4 - base % (W * 4)) % (W * 4)) / sizeof(float);
  auto row_of = [&](const float* pool, int64_t t) { return pool + (blocks[t / BS] * BS + t % BS) * D; };
  // row r's keys in this chunk, and whether group t0 holds any of them
  auto lo = [&](int64_t r) { return std::max(firsts[r], cs); };
  auto hi = [&](int64_t r) { return std::min(lens[r], ce); };
  auto touches = [&](int64_t r, int64_t t0) { return t0 + W > lo(r) && t0 < hi(r); };

  // scores: query (r, g)'s at scores[(r G + g) stride + t - k0]; each group's key rows read once for every query
  for (int64_t gi = 0; gi < ng; ++gi) {
    const int64_t t0 = k0 + gi * W;
    const float* kb = row_of(kh, t0);  // W rows of D, contiguous
    if (t0 + BS < end)  // the same rows of the next block (this chunk's or the next one's): blocks are scattered
      for (int64_t i = 0; i < W * D; i += 16) __builtin_prefetch(row_of(kh, t0 + BS) + i);
    for (int64_t r = 0; r < R; ++r) {
      if (!touches(r, t0)) continue;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + r * qs + g * D;
        fvec qv[NV];
        for (int v = 0; v < NV; ++v) qv[v] = load(qg + v * W);
        fvec acc[W];
        for (int i = 0; i < W; ++i) {
          fvec a = qv[0] * load(kb + i * D);
          for (int v = 1; v < NV; ++v) a += qv[v] * load(kb + i * D + v * W);
          acc[i] = a;
        }
        fvec sc = lane_sums<W>(acc) * fscale;
        if (softcap > 0.f)  // soft-capped (Gemma 2): tanh(s / cap) * cap
          for (int i = 0; i < W; ++i) sc[i] = std::tanh(sc[i] / softcap) * softcap;
        store(scores + (r * G + g) * stride + (t0 - k0), sc);
      }
    }
  }
  // per query, over its own keys: m, the exponentials in place (0 outside its keys), l
  for (int64_t r = 0; r < R; ++r) {
    if (lo(r) >= hi(r)) continue;
    const int64_t a = (lo(r) - k0) / W, b = (hi(r) - 1 - k0) / W + 1;  // its groups
    for (int64_t g = 0; g < G; ++g) {
      float* s = scores + (r * G + g) * stride;
      fvec mv = splat(-FLT_MAX);
      for (int64_t gi = a; gi < b; ++gi) {
        const fvec x = load(s + gi * W);
        const ivec in = in_range(k0 + gi * W, lo(r), hi(r));
        mv = in ? (x > mv ? x : mv) : mv;
      }
      float m = mv[0];
      for (int i = 1; i < W; ++i) m = std::max(m, mv[i]);
      fvec sum{};
      for (int64_t gi = a; gi < b; ++gi) {
        const ivec in = in_range(k0 + gi * W, lo(r), hi(r));
        fvec x = load(s + gi * W) - m;
        x = in ? x : splat(-80.f);
        float xs[W], e[W];
        store(xs, x);
#pragma omp simd
        for (int i = 0; i < W; ++i) e[i] = std::exp(xs[i]);  // vectorized through glibc's libmvec (-ffast-math)
        const fvec p = in ? load(e) : fvec{};
        store(s + gi * W, p);
        sum += p;
      }
      float l = 0.f;
      for (int i = 0; i < W; ++i) l += sum[i];
      float* pt = part + r * prs + g * pgs;
      pt[D] = m;
      pt[D + 1] = l;
      for (int v = 0; v < NV; ++v) store(pt + v * W, fvec{});
    }
  }
  // o of query (r, g) = sum over its keys t, in order, of p[t] v[t]; each group's value rows read once for every query
  for (int64_t gi = 0; gi < ng; ++gi) {
    const int64_t t0 = k0 + gi * W;
    const float* vb = row_of(vh, t0);
    if (t0 + BS < end)
      for (int64_t i = 0; i < W * D; i += 16) __builtin_prefetch(row_of(vh, t0 + BS) + i);
    for (int64_t r = 0; r < R; ++r) {
      if (!touches(r, t0)) continue;
      const int64_t i0 = std::max<int64_t>(lo(r) - t0, 0), i1 = std::min<int64_t>(hi(r) - t0, W);
      for (int64_t g = 0; g < G; ++g) {
        const float* p = scores + (r * G + g) * stride + (t0 - k0);
        float* og = part + r * prs + g * pgs;
        fvec acc[NV];
        for (int v = 0; v < NV; ++v) acc[v] = load(og + v * W);
        for (int64_t i = i0; i < i1; ++i) {
          const fvec w = splat(p[i]);
          for (int v = 0; v < NV; ++v) acc[v] += w * load(vb + i * D + v * W);
        }
        for (int v = 0; v < NV; ++v) store(og + v * W, acc[v]);
      }
    }
  }
}

// Any other head size: the same partials, one key and query at a time (a horizontal sum per score).
void chunk_plain(const float* q, int64_t qs, const float* kh, const float* vh, const int64_t* blocks,
                 const int64_t* lens, const int64_t* firsts, int64_t R, int64_t G, int64_t D, int64_t BS, float fscale,
                 int64_t cs, int64_t ce, std::vector<float>& scratch, float* part, int64_t prs, int64_t pgs,
                 float softcap) {
  auto lo = [&](int64_t r) { return std::max(firsts[r], cs); };
  auto hi = [&](int64_t r) { return std::min(lens[r], ce); };
  int64_t f0 = ce, l1 = cs;
  for (int64_t r = 0; r < R; ++r) {
    if (lo(r) >= hi(r)) continue;  // (a row whose keys miss the chunk)
    f0 = std::min(f0, lo(r));
    l1 = std::max(l1, hi(r));
  }
  if (f0 >= l1) return;
  const int64_t stride = (l1 - f0 + 15) / 16 * 16;  // floats per query's scores, a multiple of 64 bytes
  scratch.resize(R * G * stride + 16);
  const uintptr_t base = reinterpret_cast<uintptr_t>(scratch.data());
  // 64-byte aligned (malloc gives 16): a vectorized loop's split into a peeled head and a vector body, decided from
  // the address at run time, then falls alike for every query
  float* scores = scratch.data() + ((64 - base % 64) % 64) / sizeof(float);
  for (int64_t t = f0; t < l1; ++t) {
    const float* krow = kh + (blocks[t / BS] * BS + t % BS) * D;
    for (int64_t r = 0; r < R; ++r) {
      if (t < lo(r) || t >= hi(r)) continue;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + r * qs + g * D;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t d = 0; d < D; ++d) acc += qg[d] * krow[d];
        const float sc = acc * fscale;
        scores[(r * G + g) * stride + (t - lo(r))] = softcap > 0.f ? std::tanh(sc / softcap) * softcap : sc;
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = hi(r) - lo(r);
    if (n <= 0) continue;
    for (int64_t g = 0; g < G; ++g) {
      float* s = scores + (r * G + g) * stride;
      float m = s[0];
#pragma omp simd reduction(max : m)
      for (int64_t i = 1; i < n; ++i) m = std::max(m, s[i]);
      float l = 0.f;
#pragma omp simd reduction(+ : l)
      for (int64_t i = 0; i < n; ++i) {
        s[i] = std::exp(s[i] - m);
        l += s[i];
      }
      float* pt = part + r * prs + g * pgs;
      std::fill(pt, pt + D, 0.f);
      pt[D] = m;
      pt[D + 1] = l;
    }
  }
  for (int64_t t = f0; t < l1; ++t) {
    const float* vrow = vh + (blocks[t / BS] * BS + t % BS) * D;
    for (int64_t r = 0; r < R; ++r) {
      if (t < lo(r) || t >= hi(r)) continue;
      for (int64_t g = 0; g < G; ++g) {
        const float w = scores[(r * G + g) * stride + (t - lo(r))];
        float* og = part + r * prs + g * pgs;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) og[d] += w * vrow[d];
      }
    }
  }
}

}  // namespace

namespace tpserve {

void paged_attention_chunk(const float* q, int64_t qs, const float* kh, const float* vh, const int64_t* blocks,
                           const int64_t* lens, const int64_t* firsts, int64_t R, int64_t G, int64_t D, int64_t BS,
                           float fscale, int64_t c, std::vector<float>& scratch, float* part, int64_t prs,
                           int64_t pgs, float softcap) {
  const int64_t cs = c * ATTENTION_CHUNK, ce = cs + ATTENTION_CHUNK;
  if (BS % W == 0) {
    switch (D) {
#define TPSERVE_CHUNK(d)                                                                                           \
  case d:                                                                                                          \
    if constexpr (d % W == 0)                                                                                      \
      return chunk_vec<d>(q, qs, kh, vh, blocks, lens, firsts, R, G, BS, fscale, cs, ce, scratch, part, prs, pgs,  \
                          softcap);                                                                                \
    break;
      TPSERVE_CHUNK(16)
      TPSERVE_CHUNK(32)
      TPSERVE_CHUNK(64)
      TPSERVE_CHUNK(80)
      TPSERVE_CHUNK(96)
      TPSERVE_CHUNK(128)
      TPSERVE_CHUNK(256)
#undef TPSERVE_CHUNK
      default:
        break;
    }
  }
  chunk_plain(q, qs, kh, vh, blocks, lens, firsts, R, G, D, BS, fscale, cs, ce, scratch, part, prs, pgs, softcap);
}

void paged_attention_combine(const float* part, int64_t n, int64_t D, const float* sink, float* o) {
  const int64_t P = D + 2;
  float M = sink ? *sink : part[D];
  for (int64_t c = 0; c < n; ++c) M = std::max(M, part[c * P + D]);
  float den = sink ? std::exp(*sink - M) : 0.f, f[64];
  // (which of the two loops runs depends on n and D alone, so a query's bits still do not depend on its company)
  if (n <= 64 && D % W == 0) {  // up to 16K keys: in vectors
    for (int64_t c = 0; c < n; ++c) {
      f[c] = std::exp(part[c * P + D] - M);
      den += f[c] * part[c * P + D + 1];
    }
    const float inv = 1.f / den;
    for (int64_t d = 0; d < D; d += W) {
      fvec acc{};
      for (int64_t c = 0; c < n; ++c) acc += splat(f[c]) * load(part + c * P + d);  // in chunk order
      store(o + d, acc * inv);
    }
    return;
  }
  std::fill(o, o + D, 0.f);
  for (int64_t c = 0; c < n; ++c) {  // in chunk order
    const float* pt = part + c * P;
    const float e = std::exp(pt[D] - M);
    den += e * pt[D + 1];
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) o[d] += e * pt[d];
  }
  const float inv = 1.f / den;
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) o[d] *= inv;
}

// (one compiled body for every R: a copy specialised for R = 1, inlined or cloned with the constant, could compile
// differently and round differently)
__attribute__((noinline, noclone)) void paged_attention_rows(const float* q, int64_t qs, const float* kh,
                                                             const float* vh, const int64_t* blocks,
                                                             const int64_t* lens, const int64_t* firsts, int64_t R,
                                                             int64_t G, int64_t D, int64_t BS, float fscale,
                                                             std::vector<float>& scratch, float* o, int64_t os,
                                                             const float* sinks, float softcap) {
  int64_t c0 = firsts[0] / ATTENTION_CHUNK, c1 = (lens[0] - 1) / ATTENTION_CHUNK;
  for (int64_t r = 1; r < R; ++r) {
    c0 = std::min(c0, firsts[r] / ATTENTION_CHUNK);
    c1 = std::max(c1, (lens[r] - 1) / ATTENTION_CHUNK);
  }
  const int64_t nc = c1 - c0 + 1, P = D + 2;
  // query (r, g)'s partial of chunk c at ((r G + g) nc + c - c0) P (kept per thread: the loop's op calls this per
  // sequence, KV head and layer)
  thread_local std::vector<float> parts;
  parts.resize(R * G * nc * P);
  for (int64_t c = c0; c <= c1; ++c)
    paged_attention_chunk(q, qs, kh, vh, blocks, lens, firsts, R, G, D, BS, fscale, c, scratch,
                          parts.data() + (c - c0) * P, G * nc * P, nc * P, softcap);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t a = firsts[r] / ATTENTION_CHUNK, b = (lens[r] - 1) / ATTENTION_CHUNK;
    for (int64_t g = 0; g < G; ++g)
      paged_attention_combine(parts.data() + ((r * G + g) * nc + a - c0) * P, b - a + 1, D, sinks ? sinks + g : nullptr,
                              o + r * os + g * D);
  }
}

void paged_attention_head(const float* qbh, const float* kh, const float* vh, const int64_t* blocks, int64_t len,
                          int64_t first, int64_t G, int64_t D, int64_t BS, float fscale, std::vector<float>& scores,
                          float* obh, const float* sinks, float softcap) {
  paged_attention_rows(qbh, G * D, kh, vh, blocks, &len, &first, 1, G, D, BS, fscale, scores, obh, G * D, sinks,
                       softcap);
}

}  // namespace tpserve
