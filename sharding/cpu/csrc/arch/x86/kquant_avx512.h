// AVX-512 VNNI loops of core/kquant_linear.cpp (included there, in its anonymous namespace after the portable kernel,
// where the build has AVX-512 F, BW and VNNI: the x86-64-v4-vnni-bf16 and -amx variants): the GGUF block types
// Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K and MXFP4, and Q4_Z, times int8 activations, in the layout kquant_linear.cpp
// describes.
//
// As int4_dot_block (quant_avx512.h): one 512-bit vector per 64-byte line of the 16-row block, each 32-bit lane one
// output row, so vpdpbusd multiplies a line of unsigned values by 4 activation bytes broadcast to every lane (signed)
// and each lane accumulates its row's dot product with no reduction across lanes. Per block of 32 inputs the chunk's
// lines are loaded and unpacked once into 8 vectors of unsigned values (vector t: inputs 4t..4t+3 of every row): the
// nibble lines as int4's (and, shift), then the high bits put in place with one shift and one vpternlogd each
// (v | (shifted & mask)); MXFP4's codes mapped to KV[code] + 12 with one vpshufb each (the 16-byte table MXFP4_U in
// every 128-bit lane; a code's bit 7 is clear, so no byte is zeroed). The 16 rows' scale terms (sa, nm or sb:
// kquant_linear.cpp's top) are converted once per block as vectors (vcvtph2ps, vpmovzxbd / vpmovsxbd, one multiply:
// d * sc is exact), and Q4_Z's zero points widened to int32 lanes (vpmovzxbd), and serve every activation row; then
// per row 8 vpdpbusd (Q6_K: 4 for each group of 16; the activation bytes broadcast from memory) from the block's
// correction (-16 * sum for Q5_0, -12 * sum for MXFP4, -z * sum for Q4_Z: one vpmulld of the row's zero points by
// the broadcast -sum, -32 * each half's sum for Q6_K), and the portable kernel's float steps, lane by lane, in its
// order:
//   t = float(dot) * sa; t = fma(nm, float(sum), t) | t = fma(float(dot_b), sb, t); acc = fma(t, xs, acc)
// The int32 dot products are exact (a lane's 4 products are at most 4 x 63 x 128, and vpdpbusd adds without
// saturating), so every output is the portable kernel's, bit for bit (tests/harness.cpp).
#pragma once

#include <immintrin.h>

#include "prefetch.h"
#include "vnni_bcst.h"

#define TPSERVE_KQ_DOT 1

namespace {

constexpr int64_t KQ_MR = 8;  // activation rows per pass: one accumulator each, beside the 8 unpacked vectors

// bit 4 (Q5) or bits 4-5 (Q6) of every byte of `hi` OR-ed into v: vpternlogd A | (B & C)
inline __m512i or_masked(__m512i v, __m512i hi, __m512i mask) { return _mm512_ternarylogic_epi32(v, hi, mask, 0xF8); }

// `line` shifted by s bits within its 16-bit lanes (left for s > 0, right for s < 0): the bits that land in bits 4-5
// of a byte come from the same byte for |s| <= 4 (left) or -s <= 3 (right), which is all the uses below
template <int S>
inline __m512i shift16(__m512i line) {
  if constexpr (S > 0) return _mm512_slli_epi16(line, S);
  else if constexpr (S < 0) return _mm512_srli_epi16(line, -S);
  else return line;
}

// The 8 vectors of unsigned values of one chunk (32 inputs of the block's 16 rows): v[t] holds inputs 4t..4t+3,
// byte 4 * row + p input 4t + p
template <int64_t T>
inline void kq_unpack(const uint8_t* c, __m512i (&v)[8]) {
#if defined(__AVX512VBMI__)
  if constexpr (T == tpserve::KQ_MXFP4) {  // codes -> KV[code] + 12 straight from the line: vpermb reads the low 6
    // bits of each byte, so a table of MXFP4_U repeated 4 times maps the low nibble whatever bits 4-5 hold, and the
    // 16-bit shift brings the high nibble down (bits 4-7 then hold the next byte's, ignored alike): 3 instructions a
    // line where and, shift, and, 2 vpshufb take 5 (the same values)
    const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(MXFP4_U)));
    for (int i = 0; i < 4; ++i) {
      const __m512i line = _mm512_loadu_si512(c + i * 64);
      v[2 * i] = _mm512_permutexvar_epi8(line, table);
      v[2 * i + 1] = _mm512_permutexvar_epi8(_mm512_srli_epi16(line, 4), table);
    }
    return;
  }
#endif
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int i = 0; i < 4; ++i) {
    const __m512i line = _mm512_loadu_si512(c + i * 64);
    v[2 * i] = _mm512_and_si512(line, low);
    v[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(line, 4), low);
  }
  if constexpr (Traits<T>::bits == 5) {  // bit t of the high line: bit 4 of v[t]
    const __m512i hb = _mm512_loadu_si512(c + 256), bit4 = _mm512_set1_epi8(0x10);
    v[0] = or_masked(v[0], shift16<4>(hb), bit4);
    v[1] = or_masked(v[1], shift16<3>(hb), bit4);
    v[2] = or_masked(v[2], shift16<2>(hb), bit4);
    v[3] = or_masked(v[3], shift16<1>(hb), bit4);
    v[4] = or_masked(v[4], hb, bit4);
    v[5] = or_masked(v[5], shift16<-1>(hb), bit4);
    v[6] = or_masked(v[6], shift16<-2>(hb), bit4);
    v[7] = or_masked(v[7], shift16<-3>(hb), bit4);
  } else if constexpr (Traits<T>::bits == 6) {  // bits 2u..2u+1 of high line h: bits 4-5 of v[4h + u]
    const __m512i bits45 = _mm512_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h) {
      const __m512i hb = _mm512_loadu_si512(c + 256 + 64 * h);
      v[4 * h + 0] = or_masked(v[4 * h + 0], shift16<4>(hb), bits45);
      v[4 * h + 1] = or_masked(v[4 * h + 1], shift16<2>(hb), bits45);
      v[4 * h + 2] = or_masked(v[4 * h + 2], hb, bits45);
      v[4 * h + 3] = or_masked(v[4 * h + 3], shift16<-2>(hb), bits45);
    }
  } else if constexpr (T == tpserve::KQ_MXFP4) {  // codes -> KV[code] + 12, in [0, 24]
    const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(MXFP4_U)));
    for (int t = 0; t < 8; ++t) v[t] = _mm512_shuffle_epi8(table, v[t]);
  }
}

inline __m512 kq_halves(const uint8_t* p) {  // 16 float16 -> float32
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 kq_u8(const uint8_t* p) {  // 16 unsigned bytes -> float32 (exact)
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 kq_i8(const uint8_t* p) {  // 16 signed bytes -> float32 (exact)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// block_scales' sa, nm, sb of 32-input block b, as vectors of the 16 rows (every product exact, as there)
template <int64_t T>
inline void kq_scales(const uint8_t* s, int64_t b, __m512& sa, __m512& nm, __m512& sb) {
  using Tr = Traits<T>;
  const uint8_t* sp = s + (b * 32 / Tr::super) * Tr::scale_bytes;
  const int64_t j = (b * 32 % Tr::super) / 32;
  if constexpr (T == tpserve::KQ_MXFP4) {  // d: the 16 rows' float32 exponent bytes shifted into place
    sa = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sp))), 23));
    return;
  }
  sa = kq_halves(sp);
  if constexpr (T == tpserve::KQ_Q4_1 || T == tpserve::KQ_Q5_1) {
    nm = kq_halves(sp + 32);
  } else if constexpr (T == tpserve::KQ_Q6_K) {
    const __m512 d = sa;
    sa = _mm512_mul_ps(d, kq_i8(sp + 32 + (2 * j) * NR));
    sb = _mm512_mul_ps(d, kq_i8(sp + 32 + (2 * j + 1) * NR));
  } else if constexpr (T == tpserve::KQ_Q4_K || T == tpserve::KQ_Q5_K) {
    sa = _mm512_mul_ps(sa, kq_u8(sp + 64 + j * NR));
    const __m512 m = _mm512_mul_ps(kq_halves(sp + 32), kq_u8(sp + 64 + 128 + j * NR));
    nm = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(m), _mm512_set1_epi32(INT32_MIN)));  // -(dmin mn)
  }
}

// Q4_Z's zero points of 32-input block b, as int32 lanes of the 16 rows
inline __m512i kq_zeros(const uint8_t* s, int64_t b) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block_zeros(s, b))));
}

// kq_block_portable's work with vectors: R activation rows against one block of 16 weight rows
template <int64_t T, int R>
inline void kq_block(const tpserve::Int8Rows& xq, int64_t m0, const uint8_t* w, const uint8_t* s, int64_t K,
                     int64_t nrows, float* y, int64_t ldy) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t nb = K / 32;
  for (int64_t b = 0; b < nb; ++b) {
    __m512i v[8];
    prefetch_lines_ahead(w + b * chunk_bytes<T>(), chunk_bytes<T>());
    kq_unpack<T>(w + b * chunk_bytes<T>(), v);
    __m512 sa, nm, sb;
    kq_scales<T>(s, b, sa, nm, sb);
    __m512i z;
    if constexpr (T == tpserve::KQ_Q4_Z) z = kq_zeros(s, b);
    for (int r = 0; r < R; ++r) {
      const int64_t row = m0 + r;
      const int32_t* xr = reinterpret_cast<const int32_t*>(xq.q.data() + row * K + b * 32);
      __m512 t;
      if constexpr (T == tpserve::KQ_Q6_K) {
        const int32_t* s16 = xq.sum16.data() + row * 2 * nb + 2 * b;
        __m512i da = _mm512_set1_epi32(-32 * s16[0]), db = _mm512_set1_epi32(-32 * s16[1]);
        for (int i = 0; i < 4; ++i) {
          da = dpbusd_bcst(da, v[i], xr + i);
          db = dpbusd_bcst(db, v[4 + i], xr + 4 + i);
        }
        t = _mm512_mul_ps(_mm512_cvtepi32_ps(da), sa);
        t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(db), sb, t);
      } else {
        const int32_t sum = xq.sum[row * nb + b];
        // two chains of 4 (even and odd vectors) halve the latency of a row's block; the int32 sum is the same
        __m512i d0 = _mm512_set1_epi32(-Traits<T>::offset * sum);
        if constexpr (T == tpserve::KQ_Q4_Z) d0 = _mm512_mullo_epi32(z, _mm512_set1_epi32(-sum));
        __m512i d1 = _mm512_setzero_si512();
        for (int i = 0; i < 8; i += 2) {
          d0 = dpbusd_bcst(d0, v[i], xr + i);
          d1 = dpbusd_bcst(d1, v[i + 1], xr + i + 1);
        }
        t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(d0, d1)), sa);
        if constexpr (Traits<T>::nm) t = _mm512_fmadd_ps(nm, _mm512_set1_ps(static_cast<float>(sum)), t);
      }
      acc[r] = _mm512_fmadd_ps(t, _mm512_set1_ps(xq.scale[row * nb + b]), acc[r]);
    }
  }
  const __mmask16 m = nrows >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << nrows) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy, m, acc[r]);
}

}  // namespace
