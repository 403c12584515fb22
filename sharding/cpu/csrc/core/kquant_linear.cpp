// GGUF block types served in their own blocks: y = x @ dequant(W)^T for llama.cpp's Q4_1, Q5_0, Q5_1, Q4_K, Q5_K,
// Q6_K and MXFP4 weights (Q8_0 and Q4_0 are the int8 and int4 kernels of quant_linear.cpp), and for Q4_Z, 4-bit values
// with an integer zero point (Hugging Face's asymmetric int4: AWQ, GPTQ sym=false, compressed-tensors; no GGUF type
// stores it, sharding/layers/stored.py makes it); torch-free.
//
// What each type stores (ggml-common.h; q unsigned, of `bits` bits; x the activations):
//   Q4_1, Q5_1   per 32 inputs: d, m (float16)                              W = d * q + m
//   Q5_0         per 32 inputs: d                                           W = d * (q - 16)
//   Q4_K, Q5_K   per 256: d, dmin (float16); per 32: sc, mn (6 bits)        W = d * sc * q - dmin * mn
//   Q6_K         per 256: d; per 16: sc (int8)                              W = d * sc * (q - 32)
//   MXFP4        per 32 inputs: d (a float32 exponent byte)                 W = d * KV[q]
//   Q4_Z         per 32 inputs: d (float16), z (a byte, 0..15)              W = d * (q - z)
// MXFP4's q is an e2m1 code and KV llama.cpp's kvalues_mxfp4, the e2m1 values doubled (integers in [-12, 12]); the
// file's e8m0 scale e (W = KV[q] * 2^(e - 128)) is kept as a byte: d's float32 exponent field, max(e - 1, 0), so d is
// that byte shifted into place, exact for every e from 2 to 254 (e = 0, 1: d = 0, scales below 2^-126).
//
// The activations are int8 per row and block of 32 inputs (quantize_rows, Q8_0's scheme: the int8 / int4 kernels'
// own, so one quantized copy of a layer's input serves every type in it) on every build, and each block's dot
// product is exact in int32, as in llama.cpp's vec_dot (which uses q8_1 / q8_K activations for these types: per 32
// inputs here is at least as fine).
//
// Layout (sharding/layers/gguf_quant.py packs it at load, from the file's blocks, with no float copy): blocks of 16
// output rows; per block, `w` holds for each 32 inputs a chunk of 64-byte lines: 4 lines of nibbles (as int4's
// 16-row layout: line i, byte 4 * row + p holds input 8i + p in its low nibble and 8i + 4 + p in its high one; so
// unpacked vector t = 0..7 holds inputs 4t..4t+3 of every row), then the high bits: Q5 types one line (bit t of
// byte 4 * row + p: bit 4 of vector t's value), Q6_K two (line h, bits 2u..2u+1 of a byte: bits 4-5 of vector
// 4h + u). MXFP4's nibbles are its codes, which the kernels map to KV[q] + 12 as they unpack them (a byte shuffle).
// `s` holds per 16-row block, for each `kq_super` inputs: the 16 rows' d (float16), then dmin (K types) or m (Q4_1,
// Q5_1) or z (Q4_Z, one byte each), then the 6-bit sc and mn unpacked to bytes [8][16] each (Q4_K, Q5_K) or Q6_K's
// int8 sc [16][16]; MXFP4's d is one byte per row (its exponent field). Bytes against the file: Q4_K 148 per 256
// inputs and row (file 144), Q5_K 180 (176), Q6_K 210 (210), MXFP4 17 per 32 (17), Q4_Z 19 per 32 (no file), the
// others equal.
//
// The float steps per block of 32 and row lane, the same on every build (the SIMD loops do them lane by lane, so
// every build's outputs are the same bits; tests/harness.cpp):
//   t = float(dot) * sa          (sa = d * sc, exact in float32; Q4_1 / Q5_x / MXFP4 / Q4_Z: d; dot from -16 * sum
//                                 for Q5_0, from -12 * sum for MXFP4 (values KV[q] + 12), from -z * sum for Q4_Z)
//   t = fma(nm, float(sum), t)   (Q4_K, Q5_K: nm = -(dmin * mn); Q4_1, Q5_1: nm = m)
//   t = fma(float(dot_b), sb, t) (Q6_K: the block's two groups of 16, each dot from -32 * its sum)
//   acc = fma(t, xs, acc)        (xs: the activations' block scale)

#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t NR = tpserve::VNNI_BLOCK;  // output rows per block
constexpr int64_t MR = 4;                    // activation rows per pass (the portable kernel)

// Per type: bits of a value in the layout; inputs per block of scales and its bytes per 16-row block; vmax, the
// largest unsigned value the dot products multiply (the AVX2 loops' int16 bounds); offset, what the dot starts at per
// unit of the activations' sum (-offset * sum: the values' offset; Q6_K's 32 is per group of 16, on its own path);
// nm, whether t takes the fma(nm, float(sum), t) step (an m or dmin term)
template <int64_t T>
struct Traits;
template <>
struct Traits<tpserve::KQ_Q4_1> {
  static constexpr int bits = 4, super = 32, scale_bytes = 64, vmax = 15, offset = 0;
  static constexpr bool nm = true;
};
template <>
struct Traits<tpserve::KQ_Q5_0> {
  static constexpr int bits = 5, super = 32, scale_bytes = 32, vmax = 31, offset = 16;
  static constexpr bool nm = false;
};
template <>
struct Traits<tpserve::KQ_Q5_1> {
  static constexpr int bits = 5, super = 32, scale_bytes = 64, vmax = 31, offset = 0;
  static constexpr bool nm = true;
};
template <>
struct Traits<tpserve::KQ_Q4_K> {
  static constexpr int bits = 4, super = 256, scale_bytes = 64 + 2 * 8 * 16, vmax = 15, offset = 0;
  static constexpr bool nm = true;
};
template <>
struct Traits<tpserve::KQ_Q5_K> {
  static constexpr int bits = 5, super = 256, scale_bytes = 64 + 2 * 8 * 16, vmax = 31, offset = 0;
  static constexpr bool nm = true;
};
template <>
struct Traits<tpserve::KQ_Q6_K> {
  static constexpr int bits = 6, super = 256, scale_bytes = 32 + 16 * 16, vmax = 63, offset = 32;
  static constexpr bool nm = false;
};
template <>
struct Traits<tpserve::KQ_MXFP4> {  // values KV[q] + 12 (MXFP4_U below); d: one exponent byte per row
  static constexpr int bits = 4, super = 32, scale_bytes = 16, vmax = 24, offset = 12;
  static constexpr bool nm = false;
};
template <>
struct Traits<tpserve::KQ_Q4_Z> {  // scales: the 16 rows' d (32 bytes), then their z (16); the offset is z, per row
  static constexpr int bits = 4, super = 32, scale_bytes = 32 + 16, vmax = 15, offset = 0;
  static constexpr bool nm = false;
};

// MXFP4's values as the kernels multiply them: llama.cpp's kvalues_mxfp4 (the e2m1 values doubled, so integers), plus
// 12, so that every one is unsigned ([0, 24]: the x86 loops' vpdpbusd / vpmaddubsw take the weights as unsigned
// bytes); the dot starts at -12 * sum to take the 12 back off. The x86 loops map a vector of codes with one byte
// shuffle through MXFP4_U.
constexpr int8_t MXFP4_KV[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
alignas(16) constexpr uint8_t MXFP4_U[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
constexpr bool mxfp4_table_ok() {
  for (int i = 0; i < 16; ++i)
    if (MXFP4_U[i] != MXFP4_KV[i] + Traits<tpserve::KQ_MXFP4>::offset) return false;
  return true;
}
static_assert(mxfp4_table_ok(), "MXFP4_U is kvalues_mxfp4 + 12");

template <int64_t T>
constexpr int64_t chunk_bytes() {
  return 256 + 64 * (Traits<T>::bits - 4);
}

inline float half_at(const uint8_t* p, int64_t i) {
  tpserve::fp16_t h;
  std::memcpy(&h, p + 2 * i, 2);
  return tpserve::fp16_to_float(h);
}

inline float exponent_at(const uint8_t* p, int64_t i) {  // MXFP4's d: a float32 with exponent field p[i], mantissa 0
  const uint32_t bits = static_cast<uint32_t>(p[i]) << 23;
  float d;
  std::memcpy(&d, &bits, 4);
  return d;
}

// The per-lane scale terms of 32-input block b (see the top): sa, nm, sb for the block's 16 rows.
template <int64_t T>
inline void block_scales(const uint8_t* s, int64_t b, float (&sa)[NR], float (&nm)[NR], float (&sb)[NR]) {
  using Tr = Traits<T>;
  const uint8_t* sp = s + (b * 32 / Tr::super) * Tr::scale_bytes;
  const int64_t j = (b * 32 % Tr::super) / 32;  // the 32-input block within its super-block
  for (int64_t l = 0; l < NR; ++l) {
    const float d = T == tpserve::KQ_MXFP4 ? exponent_at(sp, l) : half_at(sp, l);
    if constexpr (T == tpserve::KQ_Q4_1 || T == tpserve::KQ_Q5_1) {
      sa[l] = d;
      nm[l] = half_at(sp + 32, l);
    } else if constexpr (T == tpserve::KQ_Q5_0 || T == tpserve::KQ_MXFP4 || T == tpserve::KQ_Q4_Z) {
      sa[l] = d;
    } else if constexpr (T == tpserve::KQ_Q6_K) {
      const int8_t* sc = reinterpret_cast<const int8_t*>(sp + 32);
      sa[l] = d * static_cast<float>(sc[(2 * j) * NR + l]);
      sb[l] = d * static_cast<float>(sc[(2 * j + 1) * NR + l]);
    } else {  // Q4_K, Q5_K
      const float dmin = half_at(sp + 32, l);
      sa[l] = d * static_cast<float>(sp[64 + j * NR + l]);
      nm[l] = -(dmin * static_cast<float>(sp[64 + 128 + j * NR + l]));
    }
  }
}

// Q4_Z's zero points of 32-input block b: the 16 rows' z, after their d
inline const uint8_t* block_zeros(const uint8_t* s, int64_t b) {
  return s + b * Traits<tpserve::KQ_Q4_Z>::scale_bytes + 32;
}

// The 16 rows' unsigned values of one 32-input chunk, q[row][input] (MXFP4: KV[code] + 12)
template <int64_t T>
inline void unpack_chunk(const uint8_t* c, uint8_t (&q)[NR][32]) {
  for (int64_t l = 0; l < NR; ++l)
    for (int t = 0; t < 8; ++t)
      for (int p = 0; p < 4; ++p) {
        const uint8_t byte = c[(t / 2) * 64 + 4 * l + p];
        uint8_t v = (t & 1) ? (byte >> 4) : (byte & 0x0F);
        if constexpr (Traits<T>::bits == 5) {
          v |= ((c[256 + 4 * l + p] >> t) & 1) << 4;
        } else if constexpr (Traits<T>::bits == 6) {
          v |= ((c[256 + (t / 4) * 64 + 4 * l + p] >> (2 * (t % 4))) & 3) << 4;
        }
        if constexpr (T == tpserve::KQ_MXFP4) v = MXFP4_U[v];
        q[l][4 * t + p] = v;
      }
}

// The portable kernel: R activation rows against one block of 16 weight rows, in plain C++ (every build's reference;
// the arch headers' loops do the same operations lane by lane).
template <int64_t T, int R>
void kq_block_portable(const tpserve::Int8Rows& xq, int64_t m0, const uint8_t* w, const uint8_t* s, int64_t K,
                       int64_t nrows, float* y, int64_t ldy) {
  float acc[R][NR] = {};
  const int64_t nb = K / 32;
  for (int64_t b = 0; b < nb; ++b) {
    uint8_t q[NR][32];
    unpack_chunk<T>(w + b * chunk_bytes<T>(), q);
    float sa[NR], nm[NR], sb[NR];
    block_scales<T>(s, b, sa, nm, sb);
    for (int r = 0; r < R; ++r) {
      const int64_t row = m0 + r;
      const int8_t* x = xq.q.data() + row * K + b * 32;
      const float xs = xq.scale[row * nb + b];
      const int32_t sum = xq.sum[row * nb + b];
      for (int64_t l = 0; l < NR; ++l) {
        float t;
        if constexpr (T == tpserve::KQ_Q6_K) {
          int32_t da = -32 * xq.sum16[row * 2 * nb + 2 * b], db = -32 * xq.sum16[row * 2 * nb + 2 * b + 1];
          for (int i = 0; i < 16; ++i) da += q[l][i] * x[i];
          for (int i = 16; i < 32; ++i) db += q[l][i] * x[i];
          t = static_cast<float>(da) * sa[l];
          t = std::fma(static_cast<float>(db), sb[l], t);
        } else {
          // (exact in int32: the products add up to at most 32 x 31 x 127 in magnitude, the offset's term to 16 x 4064)
          int32_t dot = -Traits<T>::offset * sum;
          if constexpr (T == tpserve::KQ_Q4_Z) dot = -static_cast<int32_t>(block_zeros(s, b)[l]) * sum;
          for (int i = 0; i < 32; ++i) dot += q[l][i] * x[i];
          t = static_cast<float>(dot) * sa[l];
          if constexpr (Traits<T>::nm) t = std::fma(nm[l], static_cast<float>(sum), t);
        }
        acc[r][l] = std::fma(t, xs, acc[r][l]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t l = 0; l < nrows; ++l) y[r * ldy + l] = acc[r][l];
}

}  // namespace

// The inner loops of this build's ISA, where it has them (TPSERVE_KQ_DOT: kq_block, the portable kernel's operations
// with vectors, and KQ_MR, its activation rows per pass): AVX-512 with VNNI (vpdpbusd), else AVX2 (vpmaddubsw /
// vpmaddwd; a plain AVX-512 build, x86-64-v4 without VNNI, runs these too: the same bits, 5-24x the portable loop's
// speed). ARM64 and the rest run the portable kernel.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include "../arch/x86/kquant_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "../arch/x86/kquant_avx2.h"
#endif

namespace {

#ifdef TPSERVE_KQ_DOT
constexpr int64_t KQ_ROWS = KQ_MR;
#else
constexpr int64_t KQ_ROWS = MR;
#endif

template <int64_t T>
void range_of(const tpserve::Int8Rows& xq, int64_t M, int64_t K, const uint8_t* w, const uint8_t* s,
              const float* bias, int64_t N, float* y, int64_t b0, int64_t b1) {
  const int64_t wb = (K / 32) * chunk_bytes<T>(), sbytes = (K / Traits<T>::super) * Traits<T>::scale_bytes;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n0 = b * NR, nrows = std::min<int64_t>(NR, N - n0);
    for (int64_t m0 = 0; m0 < M; m0 += KQ_ROWS)
      tpserve::with_rows<KQ_ROWS>(std::min<int64_t>(KQ_ROWS, M - m0), [&](auto r) {
#ifdef TPSERVE_KQ_DOT
        kq_block<T, decltype(r)::value>(xq, m0, w + b * wb, s + b * sbytes, K, nrows, y + m0 * N + n0, N);
#else
        kq_block_portable<T, decltype(r)::value>(xq, m0, w + b * wb, s + b * sbytes, K, nrows, y + m0 * N + n0, N);
#endif
      });
    if (bias)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < nrows; ++j) y[m * N + n0 + j] += bias[n0 + j];
  }
}

}  // namespace

namespace tpserve {

bool kq_valid(int64_t type) { return type >= KQ_Q4_1 && type <= KQ_Q4_Z; }

int64_t kq_chunk_bytes(int64_t type) {
  switch (type) {
    case KQ_Q4_1: return chunk_bytes<KQ_Q4_1>();
    case KQ_Q5_0: return chunk_bytes<KQ_Q5_0>();
    case KQ_Q5_1: return chunk_bytes<KQ_Q5_1>();
    case KQ_Q4_K: return chunk_bytes<KQ_Q4_K>();
    case KQ_Q5_K: return chunk_bytes<KQ_Q5_K>();
    case KQ_Q6_K: return chunk_bytes<KQ_Q6_K>();
    case KQ_MXFP4: return chunk_bytes<KQ_MXFP4>();
    default: return chunk_bytes<KQ_Q4_Z>();
  }
}

int64_t kq_super(int64_t type) { return type == KQ_Q4_K || type == KQ_Q5_K || type == KQ_Q6_K ? 256 : 32; }

int64_t kq_scale_bytes(int64_t type) {
  switch (type) {
    case KQ_Q4_1: return Traits<KQ_Q4_1>::scale_bytes;
    case KQ_Q5_0: return Traits<KQ_Q5_0>::scale_bytes;
    case KQ_Q5_1: return Traits<KQ_Q5_1>::scale_bytes;
    case KQ_Q4_K: return Traits<KQ_Q4_K>::scale_bytes;
    case KQ_Q5_K: return Traits<KQ_Q5_K>::scale_bytes;
    case KQ_Q6_K: return Traits<KQ_Q6_K>::scale_bytes;
    case KQ_MXFP4: return Traits<KQ_MXFP4>::scale_bytes;
    default: return Traits<KQ_Q4_Z>::scale_bytes;
  }
}

void kq_range(int64_t type, const Int8Rows* xq, int64_t M, int64_t K, const uint8_t* w, const uint8_t* s,
              const float* bias, int64_t N, float* y, int64_t b0, int64_t b1) {
  switch (type) {
    case KQ_Q4_1: return range_of<KQ_Q4_1>(*xq, M, K, w, s, bias, N, y, b0, b1);
    case KQ_Q5_0: return range_of<KQ_Q5_0>(*xq, M, K, w, s, bias, N, y, b0, b1);
    case KQ_Q5_1: return range_of<KQ_Q5_1>(*xq, M, K, w, s, bias, N, y, b0, b1);
    case KQ_Q4_K: return range_of<KQ_Q4_K>(*xq, M, K, w, s, bias, N, y, b0, b1);
    case KQ_Q5_K: return range_of<KQ_Q5_K>(*xq, M, K, w, s, bias, N, y, b0, b1);
    case KQ_Q6_K: return range_of<KQ_Q6_K>(*xq, M, K, w, s, bias, N, y, b0, b1);
    case KQ_MXFP4: return range_of<KQ_MXFP4>(*xq, M, K, w, s, bias, N, y, b0, b1);
    default: return range_of<KQ_Q4_Z>(*xq, M, K, w, s, bias, N, y, b0, b1);
  }
}

}  // namespace tpserve
