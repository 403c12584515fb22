// The AMX kernels' loop order (arch/x86/amx_tiles.h), run on emulated tiles against plain scalar references: exact for int8
// and int4 (integer dot products, then the same float32 steps), to float32 rounding for bf16. No torch: built and run by
// tests/sharding/test_amx.py with the extension's own flags, on any host.
//
//   amx_emulation            every case; one line per case; exit status 1 on any mismatch

#include "../arch/x86/amx_tiles.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

using namespace tpserve::amx;

namespace {

std::mt19937 rng(1234);

int rand_int(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }
float rand_float(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(rng); }

uint16_t to_bf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

// W [nrows, K] signed values -> the block's int8 layout (16 rows, padding rows zero)
std::vector<int8_t> pack_int8(const std::vector<int>& W, int64_t nrows, int64_t K) {
  std::vector<int8_t> w(NR * K, 0);
  for (int64_t n = 0; n < nrows; ++n)
    for (int64_t k = 0; k < K; ++k) w[(k / 4) * 64 + n * 4 + k % 4] = static_cast<int8_t>(W[n * K + k]);
  return w;
}

// W [nrows, K] in [-8, 7] -> the int4 layout: line j, row n, byte i = (w[8j + i] + 8) | (w[8j + 4 + i] + 8) << 4
std::vector<uint8_t> pack_int4(const std::vector<int>& W, int64_t nrows, int64_t K) {
  std::vector<uint8_t> w(NR * K / 2, 0x88);
  for (int64_t n = 0; n < nrows; ++n)
    for (int64_t j = 0; j < K / 8; ++j)
      for (int i = 0; i < 4; ++i)
        w[j * 64 + n * 4 + i] = static_cast<uint8_t>((W[n * K + 8 * j + i] + 8) | ((W[n * K + 8 * j + 4 + i] + 8) << 4));
  return w;
}

std::vector<uint16_t> pack_bf16(const std::vector<uint16_t>& W, int64_t nrows, int64_t K) {
  std::vector<uint16_t> w(NR * K, 0);
  for (int64_t n = 0; n < nrows; ++n)
    for (int64_t k = 0; k < K; ++k) w[(k / 2) * 32 + n * 2 + k % 2] = W[n * K + k];
  return w;
}

bool int_case(bool int4, int64_t M, int64_t K, int64_t nrows, int64_t G) {
  const int64_t nb = K / 32;
  std::vector<int> W(nrows * K);
  for (auto& v : W) v = int4 ? rand_int(-8, 7) : rand_int(-127, 127);
  std::vector<float> sw((K / G) * NR);
  for (auto& v : sw) v = rand_float(0.001f, 0.05f);
  std::vector<int8_t> q(M * K);
  for (auto& v : q) v = static_cast<int8_t>(rand_int(-127, 127));
  std::vector<float> xs(M * nb);
  for (auto& v : xs) v = rand_float(0.001f, 0.1f);

  std::vector<int8_t> w8 = int4 ? std::vector<int8_t>(NR * K) : pack_int8(W, nrows, K);
  if (int4) {
    const std::vector<uint8_t> w4 = pack_int4(W, nrows, K);
    unpack_int4_block(w4.data(), K, w8.data());
  }
  const int64_t ldy = nrows + 3;  // outputs beside the block's are left alone
  std::vector<float> y(M * ldy, -1.f), acc(MTILES * MT * NR);
  std::vector<int32_t> ci(MT * NR);
  EmuTiles tiles;
  int8_block(tiles, q.data(), xs.data(), M, K, w8.data(), sw.data(), G, y.data(), ldy, nrows, acc.data(), ci.data());

  int64_t bad = 0;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < nrows; ++n) {
      float ref = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t dot = 0;
        for (int64_t k = b * 32; k < b * 32 + 32; ++k) dot += int32_t(q[m * K + k]) * W[n * K + k];
        ref = std::fma(static_cast<float>(dot), sw[(b * 32 / G) * NR + n] * xs[m * nb + b], ref);
      }
      if (std::memcmp(&ref, &y[m * ldy + n], 4) != 0) ++bad;
    }
    for (int64_t n = nrows; n < ldy; ++n) bad += y[m * ldy + n] != -1.f;
  }
  std::printf("%s M=%lld K=%lld rows=%lld G=%lld: %s\n", int4 ? "int4" : "int8", (long long)M, (long long)K,
              (long long)nrows, (long long)G, bad ? "MISMATCH" : "exact");
  return bad == 0;
}

bool bf16_case(int64_t M, int64_t K, int64_t nrows) {
  std::vector<uint16_t> W(nrows * K), h(M * K);
  for (auto& v : W) v = to_bf16(rand_float(-1.f, 1.f));
  for (auto& v : h) v = to_bf16(rand_float(-1.f, 1.f));
  const std::vector<uint16_t> w = pack_bf16(W, nrows, K);
  const int64_t ldy = nrows + 1;
  std::vector<float> y(M * ldy, -1.f), cf(MT * NR);
  EmuTiles tiles;
  bf16_block(tiles, h.data(), M, K, w.data(), y.data(), ldy, nrows, cf.data());
  double worst = 0;
  int64_t bad = 0;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < nrows; ++n) {
      double ref = 0, mag = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double p = double(bf16_to_float(h[m * K + k])) * bf16_to_float(W[n * K + k]);
        ref += p, mag += std::fabs(p);
      }
      const double err = std::fabs(ref - y[m * ldy + n]) / (mag + 1e-30);
      worst = std::max(worst, err);
      bad += err > 1e-5;
    }
    bad += y[m * ldy + nrows] != -1.f;
  }
  std::printf("bf16 M=%lld K=%lld rows=%lld: worst relative error %.2e %s\n", (long long)M, (long long)K,
              (long long)nrows, worst, bad ? "MISMATCH" : "ok");
  return bad == 0;
}

}  // namespace

#ifdef TPSERVE_AMX
// Built for AMX CPUs, the same templates on the real tiles (the test disassembles them: there is no AMX CPU to run them)
template void tpserve::amx::int8_block<AmxTiles>(AmxTiles&, const int8_t*, const float*, int64_t, int64_t,
                                                 const int8_t*, const float*, int64_t, float*, int64_t, int64_t,
                                                 float*, int32_t*);
template void tpserve::amx::bf16_block<AmxTiles>(AmxTiles&, const uint16_t*, int64_t, int64_t, const uint16_t*,
                                                 float*, int64_t, int64_t, float*);
#endif

int main() {
  bool ok = true;
  // activation rows: below one tile, one tile, tiles plus a ragged tail, more than one pass of 64
  for (int64_t M : {1, 5, 16, 17, 48, 64, 70, 131})
    for (int64_t K : {32, 96, 256})
      for (int64_t nrows : {16, 7}) {
        ok &= int_case(false, M, K, nrows, 32);
        ok &= bf16_case(M, K, nrows);
        for (int64_t G : {32, 64, 128})
          if (K % G == 0) ok &= int_case(true, M, K, nrows, G);
      }
  std::printf(ok ? "ALL PASSED\n" : "FAILED\n");
  return ok ? 0 : 1;
}
