// GGUF block types served in their own blocks: y = x @ dequant(W)^T for llama.cpp's Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and
// Q6_K weights (Q8_0 and Q4_0 are the int8 and int4 kernels of quant_linear.cpp); torch-free.
//
// What each type stores (ggml-common.h; q unsigned, of `bits` bits; x the activations):
//   Q4_1, Q5_1   per 32 inputs: d, m (float16)                              W = d * q + m
//   Q5_0         per 32 inputs: d                                           W = d * (q - 16)
//   Q4_K, Q5_K   per 256: d, dmin (float16); per 32: sc, mn (6 bits)        W = d * sc * q - dmin * mn
//   Q6_K         per 256: d; per 16: sc (int8)                              W = d * sc * (q - 32)
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
// 4h + u). `s` holds per 16-row block, for each `kq_super` inputs: the 16 rows' d (float16), then dmin (K types) or m
// (Q4_1, Q5_1), then the 6-bit sc and mn unpacked to bytes [8][16] each (Q4_K, Q5_K) or Q6_K's int8 sc [16][16].
// Bytes against the file: Q4_K 148 per 256 inputs and row (file 144), Q5_K 180 (176), Q6_K 210 (210), the others
// equal.
//
// The float steps per block of 32 and row lane, the same on every build (the SIMD loops do them lane by lane, so
// every build's outputs are the same bits; tests/harness.cpp):
//   t = float(dot) * sa          (sa = d * sc, exact in float32; Q4_1 / Q5_x: d; dot from -16 * sum for Q5_0)
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

template <int64_t T>
struct Traits;
template <>
struct Traits<tpserve::KQ_Q4_1> {
  static constexpr int bits = 4, super = 32, scale_bytes = 64;
};
template <>
struct Traits<tpserve::KQ_Q5_0> {
  static constexpr int bits = 5, super = 32, scale_bytes = 32;
};
template <>
struct Traits<tpserve::KQ_Q5_1> {
  static constexpr int bits = 5, super = 32, scale_bytes = 64;
};
template <>
struct Traits<tpserve::KQ_Q4_K> {
  static constexpr int bits = 4, super = 256, scale_bytes = 64 + 2 * 8 * 16;
};
template <>
struct Traits<tpserve::KQ_Q5_K> {
  static constexpr int bits = 5, super = 256, scale_bytes = 64 + 2 * 8 * 16;
};
template <>
struct Traits<tpserve::KQ_Q6_K> {
  static constexpr int bits = 6, super = 256, scale_bytes = 32 + 16 * 16;
};

template <int64_t T>
constexpr int64_t chunk_bytes() {
  return 256 + 64 * (Traits<T>::bits - 4);
}

inline float half_at(const uint8_t* p, int64_t i) {
  tpserve::fp16_t h;
  std::memcpy(&h, p + 2 * i, 2);
  return tpserve::fp16_to_float(h);
}

// The per-lane scale terms of 32-input block b (see the top): sa, nm, sb for the block's 16 rows.
template <int64_t T>
inline void block_scales(const uint8_t* s, int64_t b, float (&sa)[NR], float (&nm)[NR], float (&sb)[NR]) {
  using Tr = Traits<T>;
  const uint8_t* sp = s + (b * 32 / Tr::super) * Tr::scale_bytes;
  const int64_t j = (b * 32 % Tr::super) / 32;  // the 32-input block within its super-block
  for (int64_t l = 0; l < NR; ++l) {
    const float d = half_at(sp, l);
    if constexpr (T == tpserve::KQ_Q4_1 || T == tpserve::KQ_Q5_1) {
      sa[l] = d;
      nm[l] = half_at(sp + 32, l);
    } else if constexpr (T == tpserve::KQ_Q5_0) {
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

// The 16 rows' unsigned values of one 32-input chunk, q[row][input]
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
          int32_t dot = T == tpserve::KQ_Q5_0 ? -16 * sum : 0;
          for (int i = 0; i < 32; ++i) dot += q[l][i] * x[i];
          t = static_cast<float>(dot) * sa[l];
          if constexpr (T != tpserve::KQ_Q5_0) t = std::fma(nm[l], static_cast<float>(sum), t);
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

bool kq_valid(int64_t type) { return type >= KQ_Q4_1 && type <= KQ_Q6_K; }

int64_t kq_chunk_bytes(int64_t type) {
  switch (type) {
    case KQ_Q4_1: return chunk_bytes<KQ_Q4_1>();
    case KQ_Q5_0: return chunk_bytes<KQ_Q5_0>();
    case KQ_Q5_1: return chunk_bytes<KQ_Q5_1>();
    case KQ_Q4_K: return chunk_bytes<KQ_Q4_K>();
    case KQ_Q5_K: return chunk_bytes<KQ_Q5_K>();
    default: return chunk_bytes<KQ_Q6_K>();
  }
}

int64_t kq_super(int64_t type) { return type >= KQ_Q4_K ? 256 : 32; }

int64_t kq_scale_bytes(int64_t type) {
  switch (type) {
    case KQ_Q4_1: return Traits<KQ_Q4_1>::scale_bytes;
    case KQ_Q5_0: return Traits<KQ_Q5_0>::scale_bytes;
    case KQ_Q5_1: return Traits<KQ_Q5_1>::scale_bytes;
    case KQ_Q4_K: return Traits<KQ_Q4_K>::scale_bytes;
    case KQ_Q5_K: return Traits<KQ_Q5_K>::scale_bytes;
    default: return Traits<KQ_Q6_K>::scale_bytes;
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
    default: return range_of<KQ_Q6_K>(*xq, M, K, w, s, bias, N, y, b0, b1);
  }
}

}  // namespace tpserve
