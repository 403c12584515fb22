// AVX2 loops of core/kquant_linear.cpp (included there, in its anonymous namespace after the portable kernel, where
// the build has AVX2, FMA and F16C but not AVX-512: the x86-64-v3 variant): the GGUF block types Q4_1, Q5_0, Q5_1,
// Q4_K, Q5_K, Q6_K and MXFP4, and Q4_Z, times int8 activations, in the layout kquant_linear.cpp describes.
//
// As int4_dot_block (quant_avx2.h): a 64-byte line of the 16-row block is two 256-bit halves (rows 0-7, rows 8-15),
// each 32-bit lane of a half one output row; vpmaddubsw multiplies the unsigned values by 4 activation bytes broadcast
// to every lane (signed) and sums pairs to int16, vpmaddwd by ones sums pairs of those to int32. Per block of 32
// inputs the chunk's lines are unpacked once, both halves, into 2 x 8 vectors of unsigned values (vector t: inputs
// 4t..4t+3; the high bits OR-ed in from one shift and mask each; MXFP4's codes mapped to KV[code] + 12 by one vpshufb
// each), and the 16 rows' scale terms (sa, nm or sb: kquant_linear.cpp's top) converted once (and Q4_Z's zero points
// widened to int32 lanes); then each activation row's 8 broadcasts serve both halves. (Rows outer, 8 per pass, and
// kq_block kept out of line, so that each row count gets its own register allocation: on Zen 4 that was 0.7-0.9x the
// time of halves outer with 4 rows at 2 to 128 activation rows, the same at one.)
//
// int16 bounds (|x| <= 127: quantize_rows' round(x * 127 / max|x|)): one vpmaddubsw pair is at most 2 q |x|, so
//   Q4 (q <= 15)  3810: the block's 8 products add up in int16 (8 x 3810 = 30480) before one vpmaddwd (Q4_1, Q4_K,
//                       Q4_Z)
//   MXFP4 (q <= 24, KV + 12) 6096: 5 would add up (30480), 8 would not: two vpmaddwd per block, as Q5
//   Q5 (q <= 31)  7874: 4 add up (31496), so two vpmaddwd per block (vectors 0-3, 4-7), added in int32
//   Q6 (q <= 63) 16002: 2 add up (32004), so two vpmaddwd per group of 16 (Q6_K's da: vectors 0-1, 2-3; db: 4-5, 6-7)
// (Traits' vmax decides) and no vpmaddubsw saturates. The corrections (-16 * sum for Q5_0, -12 * sum for MXFP4,
// -z * sum for Q4_Z: a vpmulld of the zero points by the broadcast -sum) are added in int32. The int32 dot products
// are then exact, and the float steps after them the portable kernel's, lane by lane, in its order:
//   t = float(dot) * sa; t = fma(nm, float(sum), t) | t = fma(float(dot_b), sb, t); acc = fma(t, xs, acc)
// so every output is the portable kernel's (and the AVX-512 VNNI build's) bit for bit (tests/harness.cpp).
#pragma once

#include <immintrin.h>

#include "avx2_rows16.h"
#include "prefetch.h"

#define TPSERVE_KQ_DOT 1

namespace {

constexpr int64_t KQ_MR = 8;  // activation rows per pass (x 2 halves of float32 accumulators)

template <int S>
inline __m256i kq_shift16(__m256i line) {  // left for S > 0, right for S < 0, within 16-bit lanes
  if constexpr (S > 0) return _mm256_slli_epi16(line, S);
  else if constexpr (S < 0) return _mm256_srli_epi16(line, -S);
  else return line;
}

// v | (hb shifted by S, masked): the high bits of one vector, from the same byte of hb (|S| small: see
// kquant_avx512.h's shift16)
template <int S>
inline __m256i kq_or_high(__m256i v, __m256i hb, __m256i mask) {
  return _mm256_or_si256(v, _mm256_and_si256(kq_shift16<S>(hb), mask));
}

// The 8 vectors of unsigned values of one chunk's half h (rows 8h..8h+7): v[t] holds inputs 4t..4t+3
template <int64_t T>
inline void kq_unpack(const uint8_t* c, int h, __m256i (&v)[8]) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int i = 0; i < 4; ++i) {
    const __m256i line = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + i * 64 + h * 32));
    v[2 * i] = _mm256_and_si256(line, low);
    v[2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16(line, 4), low);
  }
  if constexpr (Traits<T>::bits == 5) {  // bit t of the high line: bit 4 of v[t]
    const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 256 + h * 32));
    const __m256i bit4 = _mm256_set1_epi8(0x10);
    v[0] = kq_or_high<4>(v[0], hb, bit4);
    v[1] = kq_or_high<3>(v[1], hb, bit4);
    v[2] = kq_or_high<2>(v[2], hb, bit4);
    v[3] = kq_or_high<1>(v[3], hb, bit4);
    v[4] = kq_or_high<0>(v[4], hb, bit4);
    v[5] = kq_or_high<-1>(v[5], hb, bit4);
    v[6] = kq_or_high<-2>(v[6], hb, bit4);
    v[7] = kq_or_high<-3>(v[7], hb, bit4);
  } else if constexpr (Traits<T>::bits == 6) {  // bits 2u..2u+1 of high line g: bits 4-5 of v[4g + u]
    const __m256i bits45 = _mm256_set1_epi8(0x30);
    for (int g = 0; g < 2; ++g) {
      const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 256 + 64 * g + h * 32));
      v[4 * g + 0] = kq_or_high<4>(v[4 * g + 0], hb, bits45);
      v[4 * g + 1] = kq_or_high<2>(v[4 * g + 1], hb, bits45);
      v[4 * g + 2] = kq_or_high<0>(v[4 * g + 2], hb, bits45);
      v[4 * g + 3] = kq_or_high<-2>(v[4 * g + 3], hb, bits45);
    }
  } else if constexpr (T == tpserve::KQ_MXFP4) {  // codes -> KV[code] + 12, in [0, 24] (vpshufb: per 128-bit lane)
    const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(MXFP4_U)));
    for (int t = 0; t < 8; ++t) v[t] = _mm256_shuffle_epi8(table, v[t]);
  }
}

inline __m256 kq_halves8(const uint8_t* p) {  // 8 float16 -> float32
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 kq_u8x8(const uint8_t* p) {  // 8 unsigned bytes -> float32 (exact)
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 kq_i8x8(const uint8_t* p) {  // 8 signed bytes -> float32 (exact)
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// block_scales' sa, nm, sb of 32-input block b for rows 8h..8h+7 (every product exact, as there)
template <int64_t T>
inline void kq_scales(const uint8_t* s, int64_t b, int h, __m256& sa, __m256& nm, __m256& sb) {
  using Tr = Traits<T>;
  const uint8_t* sp = s + (b * 32 / Tr::super) * Tr::scale_bytes;
  const int64_t j = (b * 32 % Tr::super) / 32, o = 8 * h;
  if constexpr (T == tpserve::KQ_MXFP4) {  // d: the 8 rows' float32 exponent bytes shifted into place
    sa = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sp + o))), 23));
    return;
  }
  sa = kq_halves8(sp + 2 * o);
  if constexpr (T == tpserve::KQ_Q4_1 || T == tpserve::KQ_Q5_1) {
    nm = kq_halves8(sp + 32 + 2 * o);
  } else if constexpr (T == tpserve::KQ_Q6_K) {
    const __m256 d = sa;
    sa = _mm256_mul_ps(d, kq_i8x8(sp + 32 + (2 * j) * NR + o));
    sb = _mm256_mul_ps(d, kq_i8x8(sp + 32 + (2 * j + 1) * NR + o));
  } else if constexpr (T == tpserve::KQ_Q4_K || T == tpserve::KQ_Q5_K) {
    sa = _mm256_mul_ps(sa, kq_u8x8(sp + 64 + j * NR + o));
    const __m256 m = _mm256_mul_ps(kq_halves8(sp + 32 + 2 * o), kq_u8x8(sp + 64 + 128 + j * NR + o));
    nm = _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(m), _mm256_set1_epi32(INT32_MIN)));  // -(dmin mn)
  }
}

// Q4_Z's zero points of 32-input block b for rows 8h..8h+7, as int32 lanes
inline __m256i kq_zeros8(const uint8_t* s, int64_t b, int h) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block_zeros(s, b) + 8 * h)));
}

// int32 lanes of the sum of N vpmaddubsw products v[i] x x[i] (i = i0 .. i0 + N - 1), added in int16 (N within the
// bounds above)
template <int I0, int N>
inline __m256i kq_madd(const __m256i (&v)[8], const __m256i (&xb)[8], __m256i ones) {
  __m256i p = _mm256_maddubs_epi16(v[I0], xb[I0]);
  for (int i = I0 + 1; i < I0 + N; ++i) p = _mm256_add_epi16(p, _mm256_maddubs_epi16(v[i], xb[i]));
  return _mm256_madd_epi16(p, ones);
}

// kq_block_portable's work with vectors: R activation rows against one block of 16 weight rows (two halves of 8)
template <int64_t T, int R>
__attribute__((noinline)) void kq_block(const tpserve::Int8Rows& xq, int64_t m0, const uint8_t* w, const uint8_t* s,
                                        int64_t K, int64_t nrows, float* y, int64_t ldy) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const int64_t nb = K / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* c = w + b * chunk_bytes<T>();
    prefetch_lines_ahead(c, chunk_bytes<T>());
    __m256i v[2][8];
    __m256 sa[2], nm[2], sb[2];
    __m256i z[2];
    for (int h = 0; h < 2; ++h) {
      kq_unpack<T>(c, h, v[h]);
      kq_scales<T>(s, b, h, sa[h], nm[h], sb[h]);
      if constexpr (T == tpserve::KQ_Q4_Z) z[h] = kq_zeros8(s, b, h);
    }
    for (int r = 0; r < R; ++r) {
      const int64_t row = m0 + r;
      const int32_t* xr = reinterpret_cast<const int32_t*>(xq.q.data() + row * K + b * 32);
      __m256i xb[8];
      for (int i = 0; i < 8; ++i) xb[i] = _mm256_set1_epi32(xr[i]);
      const __m256 xs = _mm256_set1_ps(xq.scale[row * nb + b]);
      for (int h = 0; h < 2; ++h) {
        __m256 t;
        if constexpr (T == tpserve::KQ_Q6_K) {
          const int32_t* s16 = xq.sum16.data() + row * 2 * nb + 2 * b;
          const __m256i da = _mm256_add_epi32(
              _mm256_add_epi32(kq_madd<0, 2>(v[h], xb, ones), kq_madd<2, 2>(v[h], xb, ones)),
              _mm256_set1_epi32(-32 * s16[0]));
          const __m256i db = _mm256_add_epi32(
              _mm256_add_epi32(kq_madd<4, 2>(v[h], xb, ones), kq_madd<6, 2>(v[h], xb, ones)),
              _mm256_set1_epi32(-32 * s16[1]));
          t = _mm256_mul_ps(_mm256_cvtepi32_ps(da), sa[h]);
          t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(db), sb[h], t);
        } else {
          const int32_t sum = xq.sum[row * nb + b];
          __m256i dot;
          if constexpr (8 * 2 * Traits<T>::vmax * 127 <= INT16_MAX)
            dot = kq_madd<0, 8>(v[h], xb, ones);
          else
            dot = _mm256_add_epi32(kq_madd<0, 4>(v[h], xb, ones), kq_madd<4, 4>(v[h], xb, ones));
          static_assert(4 * 2 * Traits<T>::vmax * 127 <= INT16_MAX, "4 vpmaddubsw products add up in int16");
          if constexpr (Traits<T>::offset != 0)
            dot = _mm256_add_epi32(dot, _mm256_set1_epi32(-Traits<T>::offset * sum));
          if constexpr (T == tpserve::KQ_Q4_Z)
            dot = _mm256_add_epi32(dot, _mm256_mullo_epi32(z[h], _mm256_set1_epi32(-sum)));
          t = _mm256_mul_ps(_mm256_cvtepi32_ps(dot), sa[h]);
          if constexpr (Traits<T>::nm) t = _mm256_fmadd_ps(nm[h], _mm256_set1_ps(static_cast<float>(sum)), t);
        }
        acc[r][h] = _mm256_fmadd_ps(t, xs, acc[r][h]);
      }
    }
  }
  store_rows16<R>(acc, y, ldy, nrows);
}

}  // namespace
