// AMX tile kernels for prefill (Intel Sapphire Rapids and later): int8 / int4 / bf16 linears over many activation rows,
// in the 16-row weight layout the VNNI kernels read (core/quant_linear.cpp), so no second copy of the weights.
//
// NOT RUN ON AMX HARDWARE. No CPU with AMX was available where this was written. What is tested is this file's loop
// order, through EmuTiles (a scalar emulation of the tile registers and of TDPBSSD / TDPBF16PS as Intel's pseudo-code
// defines them): sharding/cpu/csrc/tests/amx_emulation.cpp, run by tests/sharding/test_amx.py on any host. The build
// for AMX CPUs (the x86-64-v4-amx variant) instantiates the same templates with AmxTiles, whose methods are the tile
// intrinsics one for one.
//
// Torch-free (no ATen types): the harness compiles it alone.
//
// The layouts (quant.py's pack_rows with rows=16, the VNNI kernels'):
// - int8: a block of 16 output rows is K/4 lines of 64 bytes, line j = inputs 4j..4j+3 of each of the 16 rows (4 bytes
//   per row, rows side by side). That is exactly a B tile of TDPBSSD: 8 consecutive lines are the B operand for one
//   block of 32 inputs (8 rows of 64 bytes, stride 64).
// - int4: K/8 lines of 64 bytes, byte i of a row's 4 in line j holding input 8j+i (low nibble) and 8j+4+i (high),
//   stored as w + 8. unpack_int4_block writes the block once as signed bytes in the int8 layout; then it is int8.
// - bf16: K/2 lines of 64 bytes, line j = inputs 2j, 2j+1 of each of the 16 rows: 16 consecutive lines are the B
//   operand of TDPBF16PS for a block of 32 inputs.
// Activations: int8 per row and block of 32 inputs (q [M, K], scale [M, K/32], Q8_0's scheme: quantize_rows), or
// bfloat16 [M, K]. Both are A tiles as they lie: 16 rows x 32 inputs, stride K (bytes for int8, 2K for bf16).
//
// Arithmetic, the same as the VNNI kernels' so that an AMX build's outputs equal the VNNI build's bit for bit:
// int8 / int4, per activation row m, output row n and block b of 32 inputs, dot = the exact int32 sum of q[m] * w[n]
// (TDPBSSD: signed by signed bytes; the VNNI kernels get the same integer from unsigned weights and a correction),
// then acc = fma(float(dot), sw[n, b] * sx[m, b], acc) in block order from 0. bf16: TDPBF16PS accumulates in float32
// over all K (its rounding is the hardware's: the emulation follows Intel's pseudo-code; agreement with the VNNI
// bf16 kernel is to float32 rounding, not bitwise).
//
// Tiles: C0-C3 accumulators (16 x 16 int32 or float32), A in tile 4 (reloaded per 16 activation rows), B in tile 6:
// each B tile (one block of 32 inputs of 16 output rows) is loaded once and used for up to 64 activation rows.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__)
#include <immintrin.h>
#define TPSERVE_AMX 1
#endif

namespace tpserve::amx {

constexpr int64_t NR = 16;      // output rows per weight block (one B tile's 16 int32 / float32 columns)
constexpr int64_t MT = 16;      // activation rows per A tile
constexpr int64_t MTILES = 4;   // A tiles per pass: 64 activation rows share each B tile
constexpr int64_t KB = 32;      // inputs per B tile

// The 64-byte tile configuration LDTILECFG reads (palette 1).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// C tiles 0-3 of mrows[i] x 64 bytes, A tile 4 of mrows x `a_colsb`, B tile 6 of `b_rows` x 64. The A tile's rows
// are set per pass (a ragged last pass of activation rows loads fewer).
inline TileConfig make_config(int64_t a_rows, int64_t a_colsb, int64_t b_rows) {
  TileConfig c;
  for (int t = 0; t < 4; ++t) c.colsb[t] = 64, c.rows[t] = static_cast<uint8_t>(a_rows);
  c.colsb[4] = static_cast<uint16_t>(a_colsb), c.rows[4] = static_cast<uint8_t>(a_rows);
  c.colsb[6] = 64, c.rows[6] = static_cast<uint8_t>(b_rows);
  return c;
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ---- the tile registers, emulated: what the tests run -----------------------------------------------------------------
struct EmuTiles {
  alignas(64) uint8_t t[8][16][64];
  TileConfig cfg;

  void configure(const TileConfig& c) {
    cfg = c;
    std::memset(t, 0, sizeof(t));
  }
  void release() { cfg = TileConfig{}; }
  template <int T> void zero() { std::memset(t[T], 0, sizeof(t[T])); }
  template <int T> void load(const void* p, int64_t stride) {  // TILELOADD: rows past cfg.rows read as zero
    std::memset(t[T], 0, sizeof(t[T]));
    for (int r = 0; r < cfg.rows[T]; ++r)
      std::memcpy(t[T][r], static_cast<const uint8_t*>(p) + r * stride, cfg.colsb[T]);
  }
  template <int T> void store(void* p, int64_t stride) const {
    for (int r = 0; r < cfg.rows[T]; ++r) std::memcpy(static_cast<uint8_t*>(p) + r * stride, t[T][r], cfg.colsb[T]);
  }
  // TDPBSSD: C[m][n] += sum over k < A.colsb / 4, i < 4 of A[m][4k + i] * B[k][4n + i], signed bytes, int32
  template <int C, int A, int B> void dpbssd() {
    for (int m = 0; m < cfg.rows[C]; ++m)
      for (int n = 0; n < cfg.colsb[C] / 4; ++n) {
        int32_t acc;
        std::memcpy(&acc, t[C][m] + 4 * n, 4);
        for (int k = 0; k < cfg.colsb[A] / 4; ++k)
          for (int i = 0; i < 4; ++i)
            acc += static_cast<int32_t>(static_cast<int8_t>(t[A][m][4 * k + i])) *
                   static_cast<int32_t>(static_cast<int8_t>(t[B][k][4 * n + i]));
        std::memcpy(t[C][m] + 4 * n, &acc, 4);
      }
  }
  // TDPBF16PS: C[m][n] += A[m][2k] * B[k][2n] + A[m][2k + 1] * B[k][2n + 1] for k < A.colsb / 4, in float32
  template <int C, int A, int B> void dpbf16ps() {
    for (int m = 0; m < cfg.rows[C]; ++m)
      for (int n = 0; n < cfg.colsb[C] / 4; ++n) {
        float acc;
        std::memcpy(&acc, t[C][m] + 4 * n, 4);
        for (int k = 0; k < cfg.colsb[A] / 4; ++k) {
          uint16_t a0, a1, b0, b1;
          std::memcpy(&a0, t[A][m] + 4 * k, 2), std::memcpy(&a1, t[A][m] + 4 * k + 2, 2);
          std::memcpy(&b0, t[B][k] + 4 * n, 2), std::memcpy(&b1, t[B][k] + 4 * n + 2, 2);
          acc += bf16_to_float(a0) * bf16_to_float(b0);
          acc += bf16_to_float(a1) * bf16_to_float(b1);
        }
        std::memcpy(t[C][m] + 4 * n, &acc, 4);
      }
  }
};

#ifdef TPSERVE_AMX
// ---- the real tiles: each method is its instruction ------------------------------------------------------------------
// GCC's tile intrinsics paste their tile numbers into the instruction text, so each needs a literal: TPSERVE_TILE_CASES
// expands one call per tile these kernels use (C 0-3, A 4, B 6).
#define TPSERVE_TILE_CASES(T, CALL)      \
  if constexpr (T == 0) CALL(0);         \
  else if constexpr (T == 1) CALL(1);    \
  else if constexpr (T == 2) CALL(2);    \
  else if constexpr (T == 3) CALL(3);    \
  else if constexpr (T == 4) CALL(4);    \
  else {                                 \
    static_assert(T == 6, "tile 0-4 or 6"); \
    CALL(6);                             \
  }
struct AmxTiles {
  void configure(const TileConfig& c) { _tile_loadconfig(&c); }
  void release() { _tile_release(); }
  template <int T> void zero() {
#define TPSERVE_ZERO(t) _tile_zero(t)
    TPSERVE_TILE_CASES(T, TPSERVE_ZERO)
#undef TPSERVE_ZERO
  }
  template <int T> void load(const void* p, int64_t stride) {
#define TPSERVE_LOAD(t) _tile_loadd(t, p, stride)
    TPSERVE_TILE_CASES(T, TPSERVE_LOAD)
#undef TPSERVE_LOAD
  }
  template <int T> void store(void* p, int64_t stride) const {
#define TPSERVE_STORE(t) _tile_stored(t, p, stride)
    TPSERVE_TILE_CASES(T, TPSERVE_STORE)
#undef TPSERVE_STORE
  }
  template <int C, int A, int B> void dpbssd() {
    static_assert(A == 4 && B == 6 && C < 4, "C tiles 0-3 by A tile 4 and B tile 6");
#define TPSERVE_DPBSSD(t) _tile_dpbssd(t, 4, 6)
    TPSERVE_TILE_CASES(C, TPSERVE_DPBSSD)
#undef TPSERVE_DPBSSD
  }
  template <int C, int A, int B> void dpbf16ps() {
    static_assert(A == 4 && B == 6 && C < 4, "C tiles 0-3 by A tile 4 and B tile 6");
#define TPSERVE_DPBF16PS(t) _tile_dpbf16ps(t, 4, 6)
    TPSERVE_TILE_CASES(C, TPSERVE_DPBF16PS)
#undef TPSERVE_DPBF16PS
  }
};
#undef TPSERVE_TILE_CASES
#endif

// ---- the kernels, written once over a tile backend --------------------------------------------------------------------

// int4 block (16 rows, K inputs, w + 8 in nibbles) -> signed bytes in the int8 block layout; out: 16 K bytes
inline void unpack_int4_block(const uint8_t* w, int64_t K, int8_t* out) {
  for (int64_t j = 0; j < K / 8; ++j) {  // line j: inputs 8j..8j+7 -> int8 lines 2j (low nibbles), 2j + 1 (high)
    const uint8_t* line = w + j * 64;
    int8_t* lo = out + (2 * j) * 64;
    int8_t* hi = out + (2 * j + 1) * 64;
    for (int i = 0; i < 64; ++i) {
      lo[i] = static_cast<int8_t>((line[i] & 0x0F) - 8);
      hi[i] = static_cast<int8_t>((line[i] >> 4) - 8);
    }
  }
}

// Call f(C, A) for tile pairs (0, 4) .. (tiles - 1, 4): the C tile number must be a compile-time constant.
template <typename F>
inline void each_ctile(int64_t tiles, const F& f) {
  f(std::integral_constant<int, 0>{});
  if (tiles > 1) f(std::integral_constant<int, 1>{});
  if (tiles > 2) f(std::integral_constant<int, 2>{});
  if (tiles > 3) f(std::integral_constant<int, 3>{});
}

// y[m, n] for m < M, n < nrows (row stride ldy) of one 16-row block: int8 weights w (16 K bytes, the int8 layout,
// signed), their float32 scales sw [K/G][16] (G: inputs per scale, a multiple of 32), activations q [M, K] int8 with
// scales xs [M, K/32]. acc: scratch of MTILES * MT * NR floats; ci: of MT * NR int32.
template <class Tiles>
void int8_block(Tiles& tiles, const int8_t* q, const float* xs, int64_t M, int64_t K, const int8_t* w, const float* sw,
                int64_t G, float* y, int64_t ldy, int64_t nrows, float* acc, int32_t* ci) {
  const int64_t nb = K / KB;
  for (int64_t m0 = 0; m0 < M; m0 += MT * MTILES) {
    const int64_t rows = std::min<int64_t>(MT * MTILES, M - m0);
    const int64_t full = rows / MT, tail = rows % MT;  // full A tiles, then one of `tail` rows
    std::fill(acc, acc + rows * NR, 0.f);
    for (int pass = 0; pass < (tail ? 2 : 1); ++pass) {
      const int64_t ntiles = pass == 0 ? full : 1, arows = pass == 0 ? MT : tail, mbase = pass == 0 ? 0 : full * MT;
      if (ntiles == 0) continue;
      tiles.configure(make_config(arows, KB, KB / 4));
      for (int64_t b = 0; b < nb; ++b) {
        tiles.template load<6>(w + b * KB * NR, 64);
        const float* swb = sw + (b * KB / G) * NR;
        each_ctile(ntiles, [&](auto c) {
          constexpr int C = decltype(c)::value;
          const int64_t mt = mbase + C * MT;
          tiles.template zero<C>();
          tiles.template load<4>(q + (m0 + mt) * K + b * KB, K);
          tiles.template dpbssd<C, 4, 6>();
          tiles.template store<C>(ci, NR * 4);
          for (int64_t r = 0; r < arows; ++r) {
            const float sx = xs[(m0 + mt + r) * nb + b];
            float* ar = acc + (mt + r) * NR;
            const int32_t* cr = ci + r * NR;
#pragma omp simd
            for (int64_t n = 0; n < NR; ++n) ar[n] = std::fma(static_cast<float>(cr[n]), swb[n] * sx, ar[n]);
          }
        });
      }
      tiles.release();
    }
    for (int64_t r = 0; r < rows; ++r) std::memcpy(y + (m0 + r) * ldy, acc + r * NR, nrows * sizeof(float));
  }
}

// The same for bfloat16 weights (w: 16 K bfloat16, the bf16 layout) and activations h [M, K] bfloat16: the float32
// sums stay in the C tiles over all K.
template <class Tiles>
void bf16_block(Tiles& tiles, const uint16_t* h, int64_t M, int64_t K, const uint16_t* w, float* y, int64_t ldy,
                int64_t nrows, float* cf) {
  const int64_t nb = K / KB;
  for (int64_t m0 = 0; m0 < M; m0 += MT * MTILES) {
    const int64_t rows = std::min<int64_t>(MT * MTILES, M - m0);
    const int64_t full = rows / MT, tail = rows % MT;
    for (int pass = 0; pass < (tail ? 2 : 1); ++pass) {
      const int64_t ntiles = pass == 0 ? full : 1, arows = pass == 0 ? MT : tail, mbase = pass == 0 ? 0 : full * MT;
      if (ntiles == 0) continue;
      tiles.configure(make_config(arows, KB * 2, KB / 2));
      each_ctile(ntiles, [&](auto c) { tiles.template zero<decltype(c)::value>(); });
      for (int64_t b = 0; b < nb; ++b) {
        tiles.template load<6>(w + b * KB * NR, 64);
        each_ctile(ntiles, [&](auto c) {
          constexpr int C = decltype(c)::value;
          tiles.template load<4>(h + (m0 + mbase + C * MT) * K + b * KB, 2 * K);
          tiles.template dpbf16ps<C, 4, 6>();
        });
      }
      each_ctile(ntiles, [&](auto c) {
        constexpr int C = decltype(c)::value;
        tiles.template store<C>(cf, NR * 4);
        for (int64_t r = 0; r < arows; ++r)
          std::memcpy(y + (m0 + mbase + C * MT + r) * ldy, cf + r * NR, nrows * sizeof(float));
      });
      tiles.release();
    }
  }
}

}  // namespace tpserve::amx
