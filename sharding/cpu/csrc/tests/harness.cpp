// The kernels' own correctness harness: every torch-free kernel of one build (core/*.cpp, compiled with a variant's
// flags) against a plain scalar reference written here, on random shapes with tails: N not a multiple of the block,
// M of 1, 2, 3, 5, 9, 17 (every tile height and its remainders), K of odd group counts, int4 groups of 32, 64, 128.
// No torch: it runs natively for the x86 variants and, cross-compiled (-static), under qemu-aarch64 for the ARM64
// ones. tests/sharding/test_kernel_harness.py builds and runs it for each variant (see there for the commands).
//
// One line per case:   ok   <kernel> <shape> | scheme=<what the build computes> [exact] err=<max error> hash=<bits>
// and a summary line; the exit status is 1 if any case failed. `exact` cases must equal the reference bit for bit
// (the same float operations in the same order: the int8 / int4 linears over int8 activations, whose int32 dot
// products are exact, and the GGUF block types' (kq: Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, MXFP4, Q4_Z, over int8
// activations on every build); the float32 linear on builds with FMA; rotary); the others are held to a tolerance (the
// kernels sum in another order, with -ffast-math). `hash` is an FNV-1a hash of the output's bits: the same exact case
// must hash the same on every build of the same scheme, x86 or ARM (the Python driver compares them).
// `shares` cases check how the linears' output blocks are claimed by a team (team_split.h), not a kernel.
//
// The inputs come from a fixed-seed generator of integers (splitmix64), turned into floats by exact operations, so
// every build, on every architecture, sees the same inputs. This file is compiled without -ffast-math and with
// -ffp-contract=off: the reference means what it says.

#include "../core/kernels.h"
#include "../team_split.h"

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

using tpserve::fp16_t;

namespace {

// ---- inputs ---------------------------------------------------------------------------------------------------------
struct Rng {
  uint64_t s;
  uint64_t next() {  // splitmix64
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  int64_t below(int64_t n) { return static_cast<int64_t>(next() % static_cast<uint64_t>(n)); }
  float sym(float a) {  // uniform in [-a, a), on a grid of 2^-23 a
    return static_cast<float>(static_cast<int32_t>(next() >> 40) - (1 << 23)) * (a / 8388608.f);
  }
};

std::vector<float> floats(Rng& g, int64_t n, float a) {
  std::vector<float> v(n);
  for (auto& f : v) f = g.sym(a);
  return v;
}

// a float16 scale: a normal half in [2^-10, 2^-2), random mantissa (built from its bits: no conversion needed)
fp16_t random_scale(Rng& g) { return static_cast<fp16_t>(((5 + g.below(8)) << 10) | g.below(1024)); }

// ---- plain conversions, for the reference ---------------------------------------------------------------------------
float half_value(fp16_t h) {  // finite halves: normal ones (the scales above), zero (the padding rows), subnormal ones
  const int e = (h >> 10) & 0x1F, m = h & 0x3FF;
  const double v = e == 0 ? std::ldexp(static_cast<double>(m), -24) : std::ldexp(1.0 + m / 1024.0, e - 15);
  return static_cast<float>(v) * ((h & 0x8000) ? -1.f : 1.f);
}

uint16_t bf16_round(float f) {  // to nearest, ties to even (finite values)
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

float bf16_value(uint16_t h) {
  const uint32_t b = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

// ---- the layouts (sharding/layers/quant.py's pack_rows and block_scales) -----------------------------------------
// [N rows of R bytes] -> blocks of `rows` rows (zero rows pad the last), each holding its rows' first `run` bytes in
// turn, then their next `run` bytes, ...
std::vector<uint8_t> pack_rows(const std::vector<uint8_t>& q, int64_t N, int64_t R, int64_t run, int64_t rows) {
  const int64_t blocks = (N + rows - 1) / rows;
  std::vector<uint8_t> out(blocks * rows * R, 0);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t b = n / rows, r = n % rows;
    for (int64_t c = 0; c < R / run; ++c)
      for (int64_t j = 0; j < run; ++j) out[b * rows * R + c * rows * run + r * run + j] = q[n * R + c * run + j];
  }
  return out;
}

// [N, groups] -> [blocks, groups, rows], zeros for the padding rows
std::vector<fp16_t> block_scales(const std::vector<fp16_t>& s, int64_t N, int64_t groups, int64_t rows) {
  const int64_t blocks = (N + rows - 1) / rows;
  std::vector<fp16_t> out(blocks * groups * rows, 0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t g = 0; g < groups; ++g) out[((n / rows) * groups + g) * rows + n % rows] = s[n * groups + g];
  return out;
}

// ---- reporting ------------------------------------------------------------------------------------------------------
int cases = 0, failures = 0;

uint64_t fnv(const void* p, size_t n, uint64_t h = 0xCBF29CE484222325ull) {
  const auto* b = static_cast<const uint8_t*>(p);
  for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 0x100000001B3ull;
  return h;
}

// got against ref: bit for bit if exact, else |got - ref| <= tol * scale[i] (scale: the sum of the magnitudes that
// make the output, so the bound follows the rounding a float32 sum of them may take)
void report(const std::string& name, const std::string& scheme, bool exact, const std::vector<float>& got,
            const std::vector<double>& ref, const std::vector<double>& scale, double tol) {
  double worst = 0.;
  bool ok = got.size() == ref.size();
  for (size_t i = 0; ok && i < got.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - ref[i]);
    if (exact) {
      const float r = static_cast<float>(ref[i]);
      if (std::memcmp(&got[i], &r, sizeof r) != 0) ok = false;
    } else if (!(err <= tol * scale[i] + 1e-30)) {  // (a NaN fails)
      ok = false;
    }
    worst = std::max(worst, scale[i] > 0 ? err / scale[i] : err);
  }
  ++cases;
  failures += !ok;
  std::printf("%s %s | scheme=%s%s err=%.3g hash=%016" PRIx64 "\n", ok ? "ok  " : "FAIL", name.c_str(),
              scheme.c_str(), exact ? " exact" : "", worst, fnv(got.data(), got.size() * sizeof(float)));
}

std::string shape(const char* kernel, int64_t M, int64_t N, int64_t K, const char* more = "") {
  char b[160];
  std::snprintf(b, sizeof b, "%s M=%" PRId64 " N=%" PRId64 " K=%" PRId64 "%s", kernel, M, N, K, more);
  return b;
}

// the output blocks [0, blocks) in two ranges, as two threads would take them
template <typename F>
void two_ranges(int64_t blocks, const F& f) {
  f(int64_t{0}, blocks / 2);
  f(blocks / 2, blocks);
}

// ---- quantize_rows: Q8_0's activations ------------------------------------------------------------------------------
void check_quantize(Rng& g, int64_t M, int64_t K) {
  std::vector<float> x = floats(g, M * K, 3.f);
  for (int64_t i = 0; i < 32 && M * K >= 64; ++i) x[32 + i] = 0.f;  // a block of zeros: scale 0, q 0
  tpserve::Int8Rows xq;
  tpserve::resize_rows(xq, M, K);
  const int64_t nb = K / 32;
  // in pieces, as the decode step's threads take them: rows [0, M/2) then the rest, blocks in two halves
  const int64_t row_cuts[] = {0, M / 2, M}, block_cuts[] = {0, nb / 2, nb};
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j)
      tpserve::quantize_rows(x.data(), xq, row_cuts[i], row_cuts[i + 1], block_cuts[j], block_cuts[j + 1]);
  bool ok = true;
  int64_t off = 0;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x.data() + m * K + b * 32;
      float amax = 0.f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int32_t sum = 0;
      for (int i = 0; i < 32; ++i) {
        const int q = static_cast<int>(std::nearbyint(xb[i] * inv));
        sum += q;
        if (xq.q[m * K + b * 32 + i] != q) ok = false, ++off;
      }
      // the scale: amax / 127 (the build's -ffast-math may take amax * (1 / 127.f): one rounding apart at most)
      const float s = amax / 127.f, got = xq.scale[m * nb + b];
      if (got != s && std::fabs(got - s) > std::fabs(s) * 1.2e-7f) ok = false;
      if (xq.sum[m * nb + b] != sum) ok = false;
    }
  ++cases;
  failures += !ok;
  std::printf("%s %s | scheme=q8_0 exact err=%" PRId64 " hash=%016" PRIx64 "\n", ok ? "ok  " : "FAIL",
              shape("quantize_rows", M, 0, K).c_str(), off,
              fnv(xq.scale.data(), xq.scale.size() * 4, fnv(xq.q.data(), xq.q.size())));
}

// ---- int8 and int4 linears ------------------------------------------------------------------------------------------
// w: [N, K] integer weights (int8: -127..127; int4: -8..7), s: [N, K / G] scales. Returns the build's y [M, N].
// With int8 activations (tpserve::vnni_layout()) the reference is the kernels' scheme step by step: per block of 32
// inputs the exact int32 dot product with the quantized x, acc = fma(float(dot), w_scale * x_scale, acc), then + bias.
// Else x stays float32: the reference is the plain sum in double.
void check_int(Rng& g, bool int4, int64_t M, int64_t N, int64_t K, int64_t G, bool with_bias) {
  const int64_t groups = K / G, rows = tpserve::int_rows();
  const bool act8 = tpserve::vnni_layout();
  std::vector<int8_t> w(N * K);
  for (auto& v : w) v = static_cast<int8_t>(int4 ? g.below(16) - 8 : g.below(255) - 127);
  std::vector<fp16_t> s(N * groups);
  for (auto& v : s) v = random_scale(g);
  const std::vector<float> x = floats(g, M * K, 2.f);
  std::vector<float> bias;
  if (with_bias) bias = floats(g, N, 1.f);

  // the weights as the build reads them
  std::vector<uint8_t> bytes;
  int64_t row_bytes = K;
  if (!int4) {
    bytes.assign(reinterpret_cast<const uint8_t*>(w.data()), reinterpret_cast<const uint8_t*>(w.data()) + N * K);
  } else {  // nibbles w + 8; byte j of a run of `span` inputs holds inputs j (low) and j + span / 2 (high)
    const int64_t span = rows == 16 ? 8 : 32;
    row_bytes = K / 2;
    bytes.assign(N * row_bytes, 0);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t c = 0; c < K / span; ++c)
        for (int64_t j = 0; j < span / 2; ++j) {
          const int lo = w[n * K + c * span + j] + 8, hi = w[n * K + c * span + j + span / 2] + 8;
          bytes[n * row_bytes + c * (span / 2) + j] = static_cast<uint8_t>(lo | (hi << 4));
        }
  }
  const std::vector<uint8_t> packed = pack_rows(bytes, N, row_bytes, rows == 16 ? 4 : 16, rows);
  const std::vector<fp16_t> scales = block_scales(s, N, groups, rows);

  tpserve::Int8Rows xq;
  if (act8) {
    tpserve::resize_rows(xq, M, K);
    tpserve::quantize_rows(x.data(), xq, 0, M, 0, K / 32);
  }
  std::vector<float> y(M * N, -1.f);
  const int64_t blocks = (N + rows - 1) / rows;
  two_ranges(blocks, [&](int64_t b0, int64_t b1) {
    if (int4)
      tpserve::int4_range(x.data(), &xq, M, K, packed.data(), scales.data(), G, with_bias ? bias.data() : nullptr, N,
                          y.data(), b0, b1);
    else
      tpserve::int8_range(x.data(), &xq, M, K, reinterpret_cast<const int8_t*>(packed.data()), scales.data(),
                          with_bias ? bias.data() : nullptr, N, y.data(), b0, b1);
  });

  std::vector<double> ref(M * N), mag(M * N);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double sum = 0., abs_sum = 0.;
      float acc = 0.f;
      for (int64_t b = 0; b < K / 32; ++b) {
        const float sw = half_value(s[n * groups + b * 32 / G]);
        int32_t dot = 0;
        for (int64_t i = 0; i < 32; ++i) {
          const int64_t k = b * 32 + i;
          if (act8) dot += static_cast<int32_t>(xq.q[m * K + k]) * w[n * K + k];
          sum += static_cast<double>(x[m * K + k]) * w[n * K + k] * sw;
          abs_sum += std::fabs(static_cast<double>(x[m * K + k]) * w[n * K + k] * sw);
        }
        if (act8) acc = std::fma(static_cast<float>(dot), sw * xq.scale[m * (K / 32) + b], acc);
      }
      if (act8) {
        ref[m * N + n] = with_bias ? acc + bias[n] : acc;
      } else {
        ref[m * N + n] = with_bias ? sum + bias[n] : sum;
        abs_sum += with_bias ? std::fabs(bias[n]) : 0.;
      }
      mag[m * N + n] = abs_sum;
    }
  char more[64];
  std::snprintf(more, sizeof more, "%s bias=%d", int4 ? (" G=" + std::to_string(G)).c_str() : "", with_bias ? 1 : 0);
  report(shape(int4 ? "int4" : "int8", M, N, K, more), act8 ? "int8-act-16-rows" : "f32-act-4-rows", act8, y, ref,
         mag, 2e-5);
}

// ---- GGUF block types: Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, MXFP4, and Q4_Z (core/kquant_linear.cpp) ----------------
// Random file blocks (random bytes for the values and sub-scales, normal float16 d / m / dmin of either sign; MXFP4's
// e8m0 e mostly in [100, 160], one in 16 either 0 or 1, the two served as d = 0), read here as ggml's dequantize_row_* reads them
// (ggml-quants.c); Q4_Z, which has no file form, from a record of the harness's own (d, then z, then 16 bytes of
// nibbles as Q4_0's). The reference is the kernels' scheme step by step, from those fields: per block of 32 inputs the
// exact int32 dot product of the signed values with the int8 activations (Q4_1, Q5_1, Q4_K, Q5_K: the unsigned q,
// whose offset is the m / dmin term; MXFP4: kvalues_mxfp4[q], straight from the table), then
//   Q4_1, Q5_1   t = fma(m, float(sum x), float(dot) * d)
//   Q5_0         t = float(dot of q - 16) * d
//   MXFP4        t = float(dot of kvalues_mxfp4[q]) * d
//   Q4_Z         t = float(dot of q - z) * d
//   Q4_K, Q5_K   t = fma(-(dmin * mn), float(sum x), float(dot) * (d * sc))
//   Q6_K         t = fma(float(dot of q - 32, inputs 16..31), d * sc_b, float(dot, inputs 0..15) * (d * sc_a))
//   acc = fma(t, x_scale, acc), then + bias
// exact on every build (the products of halves and 6-bit / int8 scales are exact in float32). The weights are packed
// here from the layout kquant_linear.cpp's top describes (sharding/layers/gguf_quant.py's pack); the library's own
// packer (kq_pack_blocks, core/kquant_pack.cpp) must write the same bytes from the file's blocks.
struct KqType {
  const char* name;
  int64_t code;
  int bits, block, block_bytes, scale_bytes;  // block: inputs per file block (and per block of scales)
  bool file;  // block_bytes is the file's block (kq_pack_blocks reads it); else the harness's own record (Q4_Z)
};
constexpr KqType KQ_TYPES[] = {
    {"Q4_1", tpserve::KQ_Q4_1, 4, 32, 20, 64, true},     {"Q5_0", tpserve::KQ_Q5_0, 5, 32, 22, 32, true},
    {"Q5_1", tpserve::KQ_Q5_1, 5, 32, 24, 64, true},     {"Q4_K", tpserve::KQ_Q4_K, 4, 256, 144, 320, true},
    {"Q5_K", tpserve::KQ_Q5_K, 5, 256, 176, 320, true},  {"Q6_K", tpserve::KQ_Q6_K, 6, 256, 210, 288, true},
    {"MXFP4", tpserve::KQ_MXFP4, 4, 32, 17, 16, true},   {"Q4_Z", tpserve::KQ_Q4_Z, 4, 32, 19, 48, false}};

// ggml-common.h's kvalues_mxfp4: the e2m1 values doubled
constexpr int MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// one file block's fields: the unsigned values q (Q5_0 and Q6_K less 16 / 32 are the signed ones; MXFP4's are codes)
// and the scales
struct KqBlock {
  uint8_t q[256];
  fp16_t d = 0, m = 0;          // m: Q4_1 / Q5_1's m, Q4_K / Q5_K's dmin
  uint8_t sc[16] = {}, mn[8] = {};  // Q4_K / Q5_K: 6-bit sc, mn per 32 inputs; Q6_K: int8 sc per 16 inputs
  uint8_t z = 0;                // Q4_Z's zero point
  uint8_t e = 0;                // MXFP4's e8m0 scale: d = 2^(e - 128)
};

uint16_t le16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }

void scale_min_k4(int j, const uint8_t* q, uint8_t& d, uint8_t& m) {  // ggml's get_scale_min_k4
  if (j < 4) {
    d = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4);
  }
}

KqBlock read_block(const KqType& t, const uint8_t* b) {
  KqBlock k;
  const std::string n = t.name;
  if (n == "MXFP4" || n == "Q4_Z") {  // MXFP4: e, qs[16]; Q4_Z (the harness's record): d, z, qs[16]
    if (n == "MXFP4") {
      k.e = b[0];
    } else {
      k.d = le16(b);
      k.z = b[2] & 0x0F;
    }
    const uint8_t* qs = b + (n == "MXFP4" ? 1 : 3);
    for (int j = 0; j < 16; ++j) {
      k.q[j] = qs[j] & 0x0F;
      k.q[j + 16] = qs[j] >> 4;
    }
  } else if (n == "Q4_1" || n == "Q5_0" || n == "Q5_1") {
    k.d = le16(b);
    if (n != "Q5_0") k.m = le16(b + 2);
    const int o = n == "Q5_0" ? 2 : 4;
    const uint32_t qh = n == "Q4_1" ? 0 : static_cast<uint32_t>(b[o] | (b[o + 1] << 8) | (b[o + 2] << 16)) |
                                              (static_cast<uint32_t>(b[o + 3]) << 24);
    const uint8_t* qs = b + (n == "Q4_1" ? 4 : o + 4);
    for (int j = 0; j < 16; ++j) {
      k.q[j] = static_cast<uint8_t>((qs[j] & 0x0F) | (((qh >> j) << 4) & 0x10));
      k.q[j + 16] = static_cast<uint8_t>((qs[j] >> 4) | ((qh >> (j + 12)) & 0x10));
    }
  } else if (n == "Q4_K" || n == "Q5_K") {
    k.d = le16(b);
    k.m = le16(b + 2);
    for (int j = 0; j < 8; ++j) scale_min_k4(j, b + 4, k.sc[j], k.mn[j]);
    const uint8_t* qh = b + 16;  // Q5_K
    const uint8_t* ql = b + (n == "Q5_K" ? 48 : 16);
    uint8_t u1 = 1, u2 = 2;
    for (int j = 0; j < 256; j += 64, ql += 32, u1 <<= 2, u2 <<= 2)
      for (int l = 0; l < 32; ++l) {
        k.q[j + l] = static_cast<uint8_t>((ql[l] & 0xF) + (n == "Q5_K" && (qh[l] & u1) ? 16 : 0));
        k.q[j + 32 + l] = static_cast<uint8_t>((ql[l] >> 4) + (n == "Q5_K" && (qh[l] & u2) ? 16 : 0));
      }
  } else {  // Q6_K: ql[128], qh[64], scales[16], d
    const uint8_t *ql = b, *qh = b + 128;
    for (int j = 0; j < 16; ++j) k.sc[j] = b[192 + j];
    k.d = le16(b + 208);
    for (int j = 0; j < 256; j += 128, ql += 64, qh += 32)
      for (int l = 0; l < 32; ++l) {
        k.q[j + l] = static_cast<uint8_t>((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4));
        k.q[j + l + 32] = static_cast<uint8_t>((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4));
        k.q[j + l + 64] = static_cast<uint8_t>((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
        k.q[j + l + 96] = static_cast<uint8_t>((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
      }
  }
  return k;
}

void check_kq(Rng& g, const KqType& t, int64_t M, int64_t N, int64_t K, bool with_bias, bool extreme = false) {
  const int64_t nfb = K / t.block, nb = K / 32, blocks = (N + 15) / 16;
  const bool q6 = t.code == tpserve::KQ_Q6_K, q50 = t.code == tpserve::KQ_Q5_0;
  const bool kq = t.code == tpserve::KQ_Q4_K || t.code == tpserve::KQ_Q5_K;
  const bool mx = t.code == tpserve::KQ_MXFP4, qz = t.code == tpserve::KQ_Q4_Z;
  const bool with_m = !q6 && !q50 && !mx && !qz;  // an m (Q4_1, Q5_1) or dmin (Q4_K, Q5_K)
  // the file's blocks, [N, nfb, block_bytes]
  std::vector<uint8_t> file(N * nfb * t.block_bytes);
  for (auto& v : file) v = extreme ? 0xFF : static_cast<uint8_t>(g.next() >> 56);
  auto sane_half = [&](uint8_t* p) {
    const fp16_t h = static_cast<fp16_t>(random_scale(g) | (g.below(2) << 15));
    p[0] = static_cast<uint8_t>(h & 0xFF), p[1] = static_cast<uint8_t>(h >> 8);
  };
  for (int64_t i = 0; i < N * nfb; ++i) {
    uint8_t* b = file.data() + i * t.block_bytes;
    if (q6) {
      sane_half(b + 208);
    } else if (mx) {  // e: d = 2^(e - 128) from 2^-28 to 2^32, or 0; extreme: codes 7, the largest value (12, unsigned 24)
      b[0] = static_cast<uint8_t>(g.below(16) == 0 ? g.below(2) : 100 + g.below(61));
      if (extreme) std::memset(b + 1, 0x77, 16);
    } else if (qz) {  // d, z (any: the extreme case's values 15 against zero points of 0 to 15)
      sane_half(b);
      b[2] = static_cast<uint8_t>(g.below(16));
    } else {
      sane_half(b);
      if (with_m) sane_half(b + 2);
    }
  }
  std::vector<KqBlock> fb(N * nfb);
  for (int64_t i = 0; i < N * nfb; ++i) fb[i] = read_block(t, file.data() + i * t.block_bytes);
  std::vector<float> x = floats(g, M * K, 2.f);
  if (extreme)  // every value its type's largest, every activation +-127 (by row): the SIMD kernels' integer bounds
    for (int64_t i = 0; i < M * K; ++i) x[i] = (i / K) % 2 ? -2.f : 2.f;
  std::vector<float> bias;
  if (with_bias) bias = floats(g, N, 1.f);

  // the layout: per 16-row block, per 32 inputs 4 nibble lines (byte 4 row + p of line i: input 8i + p low, 8i + 4 + p
  // high), then Q5's line of bit 4 (bit t: input 4t + p) or Q6's two lines of bits 4-5 (line h, bits 2u: input
  // 4 (4h + u) + p); the scales per block of `t.block` inputs: d [16 rows] f16 (MXFP4: [16] bytes, d's float32
  // exponent field), m / dmin [16], then sc [8][16] and mn [8][16] (Q4_K, Q5_K) or sc [16][16] (Q6_K)
  const int64_t cb = 256 + 64 * (t.bits - 4);
  std::vector<uint8_t> w(blocks * nb * cb, 0), s(blocks * nfb * t.scale_bytes, 0);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t blk = n / 16, row = n % 16;
    for (int64_t c = 0; c < nb; ++c) {
      uint8_t* line = w.data() + (blk * nb + c) * cb;
      for (int u = 0; u < 8; ++u)
        for (int p = 0; p < 4; ++p) {
          const int64_t k = c * 32 + 4 * u + p;
          const uint8_t v = fb[n * nfb + k / t.block].q[k % t.block];
          line[(u / 2) * 64 + 4 * row + p] |= static_cast<uint8_t>((v & 0x0F) << (4 * (u & 1)));
          if (t.bits == 5) line[256 + 4 * row + p] |= static_cast<uint8_t>(((v >> 4) & 1) << u);
          if (t.bits == 6)
            line[256 + (u / 4) * 64 + 4 * row + p] |= static_cast<uint8_t>(((v >> 4) & 3) << (2 * (u % 4)));
        }
    }
    for (int64_t f = 0; f < nfb; ++f) {
      const KqBlock& k = fb[n * nfb + f];
      uint8_t* sp = s.data() + (blk * nfb + f) * t.scale_bytes;
      if (mx)
        sp[row] = static_cast<uint8_t>(k.e > 0 ? k.e - 1 : 0);  // d's float32 exponent field
      else
        std::memcpy(sp + 2 * row, &k.d, 2);
      if (with_m) std::memcpy(sp + 32 + 2 * row, &k.m, 2);
      if (qz) sp[32 + row] = k.z;
      if (kq)
        for (int j = 0; j < 8; ++j) sp[64 + j * 16 + row] = k.sc[j], sp[192 + j * 16 + row] = k.mn[j];
      if (q6)
        for (int j = 0; j < 16; ++j) sp[32 + j * 16 + row] = k.sc[j];
    }
  }
  const bool sizes = tpserve::kq_valid(t.code) && tpserve::kq_chunk_bytes(t.code) == cb &&
                     tpserve::kq_super(t.code) == t.block && tpserve::kq_scale_bytes(t.code) == t.scale_bytes &&
                     tpserve::kq_block_bytes(t.code) == (t.file ? t.block_bytes : 0);
  bool packer = true;  // the library's packer writes these bytes from the file's blocks
  if (t.file && sizes) {
    std::vector<uint8_t> w2(w.size(), 0xAA), s2(s.size(), 0xAA);
    two_ranges(blocks, [&](int64_t b0, int64_t b1) {
      tpserve::kq_pack_blocks(t.code, file.data(), N, K, w2.data(), s2.data(), b0, b1);
    });
    packer = w2 == w && s2 == s;
  }

  tpserve::Int8Rows xq;
  tpserve::resize_rows(xq, M, K);
  tpserve::quantize_rows(x.data(), xq, 0, M, 0, nb);
  std::vector<float> y(M * N, -1.f);
  two_ranges(blocks, [&](int64_t b0, int64_t b1) {
    tpserve::kq_range(t.code, &xq, M, K, w.data(), s.data(), with_bias ? bias.data() : nullptr, N, y.data(), b0, b1);
  });

  std::vector<double> ref(M * N), mag(M * N, 0.);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const KqBlock& k = fb[n * nfb + b * 32 / t.block];
        const int64_t j = (b * 32 % t.block) / 32;  // the 32 inputs within the file block
        const int8_t* xb = xq.q.data() + m * K + b * 32;
        const uint8_t* q = k.q + j * 32;
        int32_t sum = 0, dot = 0, dot_a = 0, dot_b = 0;
        for (int i = 0; i < 32; ++i) {
          sum += xb[i];
          dot += (q50 ? q[i] - 16 : mx ? MXFP4_VALUES[q[i]] : qz ? q[i] - k.z : q6 ? 0 : q[i]) * xb[i];
          (i < 16 ? dot_a : dot_b) += (q[i] - 32) * xb[i];
        }
        const float d = mx ? (k.e >= 2 ? std::ldexp(1.f, k.e - 128) : 0.f) : half_value(k.d);
        float tv;
        if (q6) {
          const float sa = d * static_cast<float>(static_cast<int8_t>(k.sc[2 * j]));
          const float sb = d * static_cast<float>(static_cast<int8_t>(k.sc[2 * j + 1]));
          tv = std::fma(static_cast<float>(dot_b), sb, static_cast<float>(dot_a) * sa);
        } else if (kq) {
          const float nm = -(half_value(k.m) * static_cast<float>(k.mn[j]));
          tv = std::fma(nm, static_cast<float>(sum), static_cast<float>(dot) * (d * static_cast<float>(k.sc[j])));
        } else if (q50 || mx || qz) {
          tv = static_cast<float>(dot) * d;
        } else {
          tv = std::fma(half_value(k.m), static_cast<float>(sum), static_cast<float>(dot) * d);
        }
        acc = std::fma(tv, xq.scale[m * nb + b], acc);
      }
      ref[m * N + n] = with_bias ? acc + bias[n] : acc;
    }
  if (!sizes || !packer) ref[0] = NAN;  // the library's idea of the layout (sizes, packer) is not this one: fail
  char more[64];
  std::snprintf(more, sizeof more, " type=%s bias=%d%s", t.name, with_bias ? 1 : 0, extreme ? " extreme=1" : "");
  report(shape("kq", M, N, K, more), "int8-act-kq", true, y, ref, mag, 0.);
}

// ---- bf16 linear ----------------------------------------------------------------------------------------------------
void check_bf16(Rng& g, int64_t M, int64_t N, int64_t K, bool with_bias) {
  const int64_t rows = tpserve::bf16_rows();
  const bool dot = tpserve::bf16_dot_layout();
  std::vector<uint16_t> w(N * K);
  for (auto& v : w) v = bf16_round(g.sym(1.f));
  const std::vector<float> x = floats(g, M * K, 2.f);
  std::vector<float> bias;
  if (with_bias) bias = floats(g, N, 1.f);
  std::vector<uint8_t> bytes(N * K * 2);
  std::memcpy(bytes.data(), w.data(), bytes.size());  // little-endian values, as torch stores them
  const std::vector<uint8_t> packed = pack_rows(bytes, N, 2 * K, rows == 16 ? 4 : 32, rows);
  tpserve::Int8Rows xq;
  bool rounded = true;
  if (dot) {  // x rounded to bfloat16 by the build: to nearest, ties to even
    tpserve::resize_bf16_rows(xq, M, K);
    tpserve::round_rows_bf16(x.data(), xq, 0, M);
    for (int64_t i = 0; i < M * K; ++i) rounded &= xq.h[i] == bf16_round(x[i]);
  }
  std::vector<float> y(M * N, -1.f);
  two_ranges((N + rows - 1) / rows, [&](int64_t b0, int64_t b1) {
    tpserve::bf16_range(x.data(), &xq, M, K, reinterpret_cast<const uint16_t*>(packed.data()),
                        with_bias ? bias.data() : nullptr, N, y.data(), b0, b1);
  });
  std::vector<double> ref(M * N), mag(M * N);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double sum = with_bias ? bias[n] : 0., abs_sum = with_bias ? std::fabs(bias[n]) : 0.;
      for (int64_t k = 0; k < K; ++k) {
        const double xv = dot ? bf16_value(bf16_round(x[m * K + k])) : x[m * K + k];
        sum += xv * bf16_value(w[n * K + k]);
        abs_sum += std::fabs(xv * bf16_value(w[n * K + k]));
      }
      ref[m * N + n] = sum;
      mag[m * N + n] = abs_sum;
    }
  if (!rounded) ref[0] = NAN;  // the rounding of x is wrong: fail the case
  report(shape("bf16", M, N, K, with_bias ? " bias=1" : " bias=0"), dot ? "bf16-act-16-rows" : "f32-act-4-rows",
         false, y, ref, mag, 2e-5);
}

// ---- float32 linear -------------------------------------------------------------------------------------------------
// The kernels' sum: acc = fma(x[m, k], W[n, k], acc) for k = 0 .. K-1, then + bias. Exact on every build with FMAs
// (AVX-512, AVX2, NEON); the portable loops (no FMA instruction) are held to a tolerance.
#if defined(__FMA__) || defined(__aarch64__)
constexpr bool F32_FMA = true;
#else
constexpr bool F32_FMA = false;
#endif

void check_f32(Rng& g, int64_t M, int64_t N, int64_t K, bool with_bias) {
  const int64_t BW = tpserve::F32_BLOCK, blocks = (N + BW - 1) / BW;
  const std::vector<float> W = floats(g, N * K, 1.f), x = floats(g, M * K, 2.f);
  std::vector<float> bias;
  if (with_bias) bias = floats(g, N, 1.f);
  std::vector<float> wb(blocks * K * BW, 0.f);  // kernels.block_f32: w[b, k, j] = W[32 b + j, k]
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) wb[((n / BW) * K + k) * BW + n % BW] = W[n * K + k];
  std::vector<float> y(M * N, -1.f);
  two_ranges(blocks, [&](int64_t b0, int64_t b1) {
    tpserve::f32_range(x.data(), M, K, wb.data(), with_bias ? bias.data() : nullptr, N, y.data(), b0, b1);
  });
  std::vector<double> ref(M * N), mag(M * N);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float acc = 0.f;
      double abs_sum = with_bias ? std::fabs(bias[n]) : 0.;
      for (int64_t k = 0; k < K; ++k) {
        acc = std::fma(x[m * K + k], W[n * K + k], acc);
        abs_sum += std::fabs(static_cast<double>(x[m * K + k]) * W[n * K + k]);
      }
      ref[m * N + n] = with_bias ? acc + bias[n] : acc;
      mag[m * N + n] = abs_sum;
    }
  report(shape("f32", M, N, K, with_bias ? " bias=1" : " bias=0"), F32_FMA ? "fma-chain" : "mul-add", F32_FMA, y, ref,
         mag, 2e-5);
}

// ---- the rest of a decode layer -------------------------------------------------------------------------------------
void check_rms_norm(Rng& g, int64_t M, int64_t D) {
  const std::vector<float> x = floats(g, M * D, 3.f), w = floats(g, D, 1.f);
  const float eps = 1e-6f;
  std::vector<float> y(M * D, -1.f);
  tpserve::rms_norm_rows(x.data(), w.data(), eps, y.data(), D, 0, M / 2);
  tpserve::rms_norm_rows(x.data(), w.data(), eps, y.data(), D, M / 2, M);
  std::vector<double> ref(M * D), mag(M * D);
  for (int64_t m = 0; m < M; ++m) {
    double ss = 0.;
    for (int64_t i = 0; i < D; ++i) ss += static_cast<double>(x[m * D + i]) * x[m * D + i];
    const double inv = 1. / std::sqrt(ss / D + eps);
    for (int64_t i = 0; i < D; ++i) {
      ref[m * D + i] = w[i] * (x[m * D + i] * inv);
      mag[m * D + i] = std::fabs(ref[m * D + i]);
    }
  }
  report(shape("rms_norm", M, 0, D), "float32", false, y, ref, mag, 1e-5);
}

// transformers' formula, product by product, no FMA (as the kernel is compiled): exact
void check_rotary(Rng& g, int64_t H, int64_t D) {
  const std::vector<float> src = floats(g, H * D, 2.f), c = floats(g, D, 1.f), s = floats(g, D, 1.f);
  std::vector<float> y(src);
  for (int64_t h = 0; h < H; ++h) tpserve::rotate_head(y.data() + h * D, y.data() + h * D, c.data(), s.data(), D);
  std::vector<double> ref(H * D), mag(H * D, 0.);
  const int64_t half = D / 2;
  for (int64_t h = 0; h < H; ++h)
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = src[h * D + i], x2 = src[h * D + i + half];
      const float a1 = x1 * c[i], b1 = x2 * s[i], a2 = x2 * c[i + half], b2 = x1 * s[i + half];
      ref[h * D + i] = a1 - b1;
      ref[h * D + i + half] = a2 + b2;
    }
  report(shape("rotary", H, 0, D), "float32-no-fma", true, y, ref, mag, 0.);
}

// one (sequence, KV head) of paged decode attention: G query heads over keys [first, len) in scattered blocks
void check_attention(Rng& g, int64_t G, int64_t D, int64_t len, int64_t window, bool sinks_and_cap = false) {
  const int64_t BS = 16, nblocks = (len + BS - 1) / BS + 3;
  const std::vector<float> q = floats(g, G * D, 1.f), kp = floats(g, nblocks * BS * D, 1.f),
                           vp = floats(g, nblocks * BS * D, 1.f);
  std::vector<int64_t> table(nblocks);
  for (int64_t i = 0; i < nblocks; ++i) table[i] = i;
  for (int64_t i = nblocks - 1; i > 0; --i) std::swap(table[i], table[g.below(i + 1)]);  // scattered blocks
  const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  // gpt-oss's sinks (a logit per query head that joins the denominator) and Gemma 2's soft-capping, together
  const std::vector<float> sinks = floats(g, G, 2.f);
  const float cap = sinks_and_cap ? 3.f : 0.f;
  std::vector<float> scores, y(G * D, -1.f);
  tpserve::paged_attention_head(q.data(), kp.data(), vp.data(), table.data(), len, first, G, D, BS, scale, scores,
                                y.data(), sinks_and_cap ? sinks.data() : nullptr, cap);
  std::vector<double> ref(G * D, 0.), mag(G * D, 0.);
  for (int64_t h = 0; h < G; ++h) {
    std::vector<double> p(len - first);
    double mx = sinks_and_cap ? sinks[h] : -1e300, total = 0.;
    for (int64_t t = first; t < len; ++t) {
      const float* k = kp.data() + (table[t / BS] * BS + t % BS) * D;
      double dotp = 0.;
      for (int64_t d = 0; d < D; ++d) dotp += static_cast<double>(q[h * D + d]) * k[d];
      p[t - first] = sinks_and_cap ? std::tanh(dotp * scale / cap) * cap : dotp * scale;
      mx = std::max(mx, p[t - first]);
    }
    if (sinks_and_cap) total = std::exp(sinks[h] - mx);
    for (auto& v : p) total += v = std::exp(v - mx);
    for (int64_t t = first; t < len; ++t) {
      const float* v = vp.data() + (table[t / BS] * BS + t % BS) * D;
      for (int64_t d = 0; d < D; ++d) {
        ref[h * D + d] += p[t - first] / total * v[d];
        mag[h * D + d] += p[t - first] / total * std::fabs(v[d]);
      }
    }
  }
  char more[64];
  std::snprintf(more, sizeof more, " len=%" PRId64 " window=%" PRId64 "%s", len, window,
                sinks_and_cap ? " sinks softcap" : "");
  report(shape("attention", G, 0, D, more), "float32", false, y, ref, mag, 1e-5);
}

// R rows of one sequence at consecutive positions (a speculative step's verification rows) in one call: each row
// must get exactly the bits it gets alone (so speculation stays exact), with the rows' queries at a stride
void check_attention_rows(Rng& g, int64_t R, int64_t G, int64_t D, int64_t len0, int64_t window) {
  const int64_t BS = 16, nblocks = (len0 + R + BS - 1) / BS + 3, qs = 3 * G * D;  // (row stride: 3 KV heads' worth)
  const std::vector<float> q = floats(g, R * qs, 1.f), kp = floats(g, nblocks * BS * D, 1.f),
                           vp = floats(g, nblocks * BS * D, 1.f);
  std::vector<int64_t> table(nblocks), lens(R), firsts(R);
  for (int64_t i = 0; i < nblocks; ++i) table[i] = i;
  for (int64_t i = nblocks - 1; i > 0; --i) std::swap(table[i], table[g.below(i + 1)]);
  for (int64_t r = 0; r < R; ++r) {
    lens[r] = len0 + r;
    firsts[r] = window > 0 ? std::max<int64_t>(0, lens[r] - window) : 0;
  }
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  std::vector<float> scratch, y(R * qs, -1.f), alone(R * qs, -1.f);
  tpserve::paged_attention_rows(q.data(), qs, kp.data(), vp.data(), table.data(), lens.data(), firsts.data(), R, G, D,
                                BS, scale, scratch, y.data(), qs);
  for (int64_t r = 0; r < R; ++r) {
    std::vector<float> fresh;
    tpserve::paged_attention_head(q.data() + r * qs, kp.data(), vp.data(), table.data(), lens[r], firsts[r], G, D, BS,
                                  scale, fresh, alone.data() + r * qs);
  }
  std::vector<float> got;
  std::vector<double> ref, mag;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < G * D; ++i) {
      got.push_back(y[r * qs + i]);
      ref.push_back(alone[r * qs + i]);
      mag.push_back(std::fabs(alone[r * qs + i]));
    }
  char more[80];
  std::snprintf(more, sizeof more, " rows=%" PRId64 " len0=%" PRId64 " window=%" PRId64, R, len0, window);
  // (tolerance 0 against this build's own per-row results: bit for bit, but not an "exact" case, whose bits every
  // build would have to share; float32 attention rounds differently per instruction set)
  report(shape("attention_rows", G, 0, D, more), "float32", false, got, ref, mag, 0.);
}

// argmax: the first maximal value; a NaN wins (its first one)
void check_argmax(Rng& g, int64_t V, int where, bool nan) {
  std::vector<float> row = floats(g, V, 5.f);
  const int64_t at = where == 0 ? 0 : where == 1 ? V - 1 : V / 2;  // the maximum at the start, the end, the middle
  row[at] = 7.f;
  if (V > 2) row[V - 2] = 7.f;  // a tie later on: the first one counts
  if (nan && V > 3) row[V / 3] = NAN, row[V - 1] = NAN;
  const int64_t got = tpserve::argmax_row(row.data(), V);
  int64_t want = 0;
  if (nan && V > 3) {
    want = V / 3;
  } else {
    for (int64_t i = 1; i < V; ++i)
      if (row[i] > row[want]) want = i;
  }
  std::vector<float> gv{static_cast<float>(got)};
  std::vector<double> rv{static_cast<double>(want)}, mv{0.};
  char more[64];
  std::snprintf(more, sizeof more, " at=%d nan=%d", where, nan ? 1 : 0);
  report(shape("argmax", 1, V, 0, more), "index", true, gv, rv, mv, 0.);
}

}  // namespace

// ---- Shares (team_split.h): how the linears' output blocks are shared over a team -----------------------------------
// A team of T threads claims n items. The last thread starts only once every other thread has returned, so the others
// must have taken its whole share. Every item must be claimed exactly once. The result per item is its claim count,
// plus 10 where the late thread claimed it.
void check_shares(int T, int64_t n, int64_t chunk) {
  std::vector<std::atomic<int>> hits(n);
  std::vector<int> late_hit(n, 0);
  std::vector<tpserve::ShareSlot> slots(T);
  tpserve::Shares shares;
  shares.reset(slots.data(), n, T, chunk);
  std::atomic<int> returned{0};
  int team = 0;
#pragma omp parallel num_threads(T)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const bool late = nt > 1 && t == nt - 1;
    if (t == 0) team = nt;
    while (late && returned.load() < nt - 1) {
    }
    shares.run(t, [&](int64_t b0, int64_t b1) {
      for (int64_t i = b0; i < b1; ++i) {
        hits[i].fetch_add(1);
        if (late) late_hit[i] = 1;
      }
    });
    returned.fetch_add(1);
  }
  std::vector<float> got(n);
  for (int64_t i = 0; i < n; ++i) got[i] = static_cast<float>(hits[i].load() + 10 * late_hit[i]);
  char name[96];
  std::snprintf(name, sizeof name, "shares T=%d n=%" PRId64 " chunk=%" PRId64 "%s", T, n, chunk,
                team == T ? "" : " (a smaller team)");
  report(name, "claims", true, got, std::vector<double>(n, 1.0), std::vector<double>(n, 1.0), 0.);
}

int main(int argc, char** argv) {
  Rng g{argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 20240601ull};
  const int64_t Ms[] = {1, 2, 3, 5, 9, 17};
  std::printf("harness: kernels %s, int8/int4 rows per block %" PRId64 " (int8 activations: %s), bf16 rows %" PRId64
              "\n", tpserve::kernels_isa(), tpserve::int_rows(), tpserve::vnni_layout() ? "yes" : "no",
              tpserve::bf16_rows());

  for (int64_t M : {1, 3, 17})
    for (int64_t K : {32, 96, 800}) check_quantize(g, M, K);

  // int8: K of 1, 3, 5, 7 blocks of 32; N: one block, ragged tails of either layout
  int bias = 0;
  for (int64_t M : Ms)
    for (int64_t N : {16, 37, 100})
      for (int64_t K : {32, 96, 160, 224}) check_int(g, false, M, N, K, 32, (bias++ % 2) == 1);
  // int4: groups of 32, 64, 128, each with an odd number of groups; N: one block each side, a pair of full blocks, a
  // pair with a ragged second block beside a single block (AVX-512 VNNI takes two blocks a call)
  for (int64_t M : Ms)
    for (int64_t G : {32, 64, 128})
      for (int64_t odd : {1, 3, 5})
        for (int64_t N : {20, 48, 100}) check_int(g, true, M, N, G * odd, G, (bias++ % 2) == 1);
  for (int64_t M : Ms)
    for (int64_t N : {16, 37})
      for (int64_t K : {16, 48, 272}) check_bf16(g, M, N, K, (bias++ % 2) == 1);
  for (int64_t M : {1, 2, 3, 4, 5, 8, 9, 11, 17})
    for (int64_t N : {7, 32, 45, 100})
      for (int64_t K : {1, 7, 33, 128}) check_f32(g, M, N, K, (bias++ % 2) == 1);

  for (int64_t M : {1, 2, 5})
    for (int64_t D : {6, 64, 100, 576}) check_rms_norm(g, M, D);
  for (int64_t H : {1, 3})
    for (int64_t D : {2, 6, 64, 128}) check_rotary(g, H, D);
  // head sizes of the vector kernel (16-256) and of the plain loops (40), contexts within one block and across several
  for (int64_t G : {1, 3})
    for (int64_t D : {16, 32, 40, 64, 128})
      for (int64_t len : {1, 17, 37, 64, 150}) {
        check_attention(g, G, D, len, 0);
        check_attention(g, G, D, len, 20);
        check_attention_rows(g, 5, G, D, len, 0);
        check_attention_rows(g, 3, G, D, len, 20);
      }
  for (int64_t D : {40, 64, 256})
    for (int64_t len : {5, 70}) check_attention(g, 4, D, len, len > 40 ? 33 : 0, true);
  // several chunks of keys (tpserve::ATTENTION_CHUNK), windows that start inside one
  for (int64_t D : {40, 64})
    for (int64_t len : {tpserve::ATTENTION_CHUNK + 1, 3 * tpserve::ATTENTION_CHUNK - 7}) {
      check_attention(g, 3, D, len, 0);
      check_attention(g, 3, D, len, tpserve::ATTENTION_CHUNK + 9, true);
      check_attention_rows(g, 5, 3, D, len - 3, 0);
      check_attention_rows(g, 5, 3, D, len - 3, tpserve::ATTENTION_CHUNK - 2);
    }
  for (int64_t V : {1, 2, 7, 16, 17, 1000, 1001})
    for (int where : {0, 1, 2})
      for (bool nan : {false, true}) check_argmax(g, V, where, nan);
  for (int T : {2, 3, 4})
    for (int64_t n : {1, 7, 100, 1000})
      for (int64_t chunk : {1, 3, 64}) check_shares(T, n, chunk);
  // GGUF block types (last: the cases above keep their inputs): K of 1 and 3 blocks of 256, and 3 blocks of 32 for
  // the types of 32
  for (const KqType& t : KQ_TYPES)
    for (int64_t M : Ms)
      for (int64_t N : {16, 37, 100})
        for (int64_t K : {96, 256, 768})
          if (K % t.block == 0) check_kq(g, t, M, N, K, (bias++ % 2) == 1);
  for (const KqType& t : KQ_TYPES)
    for (int64_t M : {1, 2, 5}) check_kq(g, t, M, 37, 256, false, true);

  std::printf("harness: %s: %d cases, %d failed\n", tpserve::kernels_isa(), cases, failures);
  return failures ? 1 : 0;
}
