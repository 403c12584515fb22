// The AMX path of the int8, int4 and bf16 linears (arch/x86/amx_tiles.h's kernels on the real tiles), taken by
// core/quant_linear.cpp's range functions for prefill-sized batches in the x86-64-v4-amx build. Every other build compiles the entry points to
// `return false`, and the VNNI / AVX2 / portable kernels run.
//
// NOT RUN ON AMX HARDWARE (see arch/x86/amx_tiles.h): the loop order is tested on emulated tiles; this file is only built.
//
// Linux gives a process the tile registers only on request (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, once per
// process, for all its threads): amx_ready() asks on first use, and without the grant the build's VNNI kernels run.
// sharding/cpu/variants.py makes the same request before it chooses this build at all.

#include "kernels.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__)
#include "../arch/x86/amx_tiles.h"
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace tpserve {

bool amx_ready() {
#ifdef TPSERVE_AMX
  static const bool granted = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return granted;
#else
  return false;
#endif
}

#ifdef TPSERVE_AMX
namespace {

constexpr int64_t NV = VNNI_BLOCK;

inline void add_bias(const float* bias, int64_t M, int64_t n0, int64_t nrows, float* y, int64_t N) {
  if (!bias) return;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < nrows; ++j) y[m * N + n0 + j] += bias[n0 + j];
}

struct Scratch {  // per thread: a block's scales in float32, an int4 block unpacked, the kernels' tiles out
  std::vector<float> sw, acc;
  std::vector<int8_t> w8;
  std::vector<int32_t> ci;
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

}  // namespace
#endif

bool amx_int_range(const Int8Rows* xq, int64_t M, int64_t K, const void* w, bool int4, const fp16_t* scale,
                   int64_t G, const float* bias, int64_t N, float* y, int64_t b0, int64_t b1) {
#ifdef TPSERVE_AMX
  if (M < AMX_MIN_ROWS || !amx_ready()) return false;
  Scratch& s = scratch();
  const int64_t ng = K / G;
  s.sw.resize(ng * NV);
  s.acc.resize(amx::MTILES * amx::MT * amx::NR);
  s.ci.resize(amx::MT * amx::NR);
  if (int4) s.w8.resize(NV * K);
  amx::AmxTiles tiles;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n0 = b * NV, nrows = std::min<int64_t>(NV, N - n0);
    const fp16_t* sb = scale + b * ng * NV;
    for (int64_t i = 0; i < ng * NV; ++i) s.sw[i] = fp16_to_float(sb[i]);
    const int8_t* wb;
    if (int4) {
      amx::unpack_int4_block(static_cast<const uint8_t*>(w) + n0 * (K / 2), K, s.w8.data());
      wb = s.w8.data();
    } else {
      wb = static_cast<const int8_t*>(w) + n0 * K;
    }
    amx::int8_block(tiles, xq->q.data(), xq->scale.data(), M, K, wb, s.sw.data(), G, y + n0, N, nrows, s.acc.data(),
                    s.ci.data());
    add_bias(bias, M, n0, nrows, y, N);
  }
  return true;
#else
  (void)xq, (void)M, (void)K, (void)w, (void)int4, (void)scale, (void)G, (void)bias, (void)N, (void)y, (void)b0, (void)b1;
  return false;
#endif
}

bool amx_bf16_range(const Int8Rows* xq, int64_t M, int64_t K, const uint16_t* w, const float* bias, int64_t N, float* y,
                    int64_t b0, int64_t b1) {
#ifdef TPSERVE_AMX
  if (M < AMX_MIN_ROWS || K % amx::KB != 0 || !amx_ready()) return false;
  Scratch& s = scratch();
  s.acc.resize(amx::MT * amx::NR);
  amx::AmxTiles tiles;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n0 = b * NV, nrows = std::min<int64_t>(NV, N - n0);
    amx::bf16_block(tiles, xq->h.data(), M, K, w + n0 * K, y + n0, N, nrows, s.acc.data());
    add_bias(bias, M, n0, nrows, y, N);
  }
  return true;
#else
  (void)xq, (void)M, (void)K, (void)w, (void)bias, (void)N, (void)y, (void)b0, (void)b1;
  return false;
#endif
}

}  // namespace tpserve
