// GGUF blocks -> the layout core/kquant_linear.cpp reads (described there), at load: each file block's values and
// scales decoded (as ggml-common.h stores them) and scattered into the 16-row block they belong to. The same bytes as
// sharding/layers/gguf_quant.py's pack (the tests compare them), at memory speed instead of torch's ~100 uint8 ops
// per tensor. Torch-free; the op (kq_pack) is in quant_linear.cpp. (Q4_Z has no file form: only gguf_quant.py's
// pack makes it.)

#include "kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t NR = tpserve::VNNI_BLOCK;

struct Decoded {  // one file block of one row
  uint8_t q[256];
  uint8_t d[2], m[2];   // float16 bits: d (MXFP4: d[0] its exponent byte), and m (Q4_1, Q5_1) or dmin (Q4_K, Q5_K)
  uint8_t sc[16], mn[8];  // Q4_K / Q5_K: 8 6-bit scales and mins; Q6_K: 16 int8 scales
};

inline uint32_t le32(const uint8_t* p) { return p[0] | (p[1] << 8) | (p[2] << 16) | (static_cast<uint32_t>(p[3]) << 24); }

// MXFP4's e8m0 scale e (W = kvalues_mxfp4[q] * 2^(e - 128): ggml's ggml_e8m0_to_fp32_half) as the layout keeps it:
// the float32 exponent field of d = 2^(e - 128), max(e - 1, 0). Exact for e from 2 to 254; e = 0 and 1 (2^-128,
// 2^-127, below float32's normal range) give d = 0. (e = 255 is e8m0's NaN: loaders/gguf_file.py refuses it.)
inline uint8_t e8m0_exponent(uint8_t e) { return e > 0 ? static_cast<uint8_t>(e - 1) : 0; }

void decode(int64_t type, const uint8_t* b, Decoded& o) {
  using namespace tpserve;
  switch (type) {
    case KQ_Q4_1:
      std::memcpy(o.d, b, 2), std::memcpy(o.m, b + 2, 2);
      for (int i = 0; i < 16; ++i) o.q[i] = b[4 + i] & 15, o.q[i + 16] = b[4 + i] >> 4;
      return;
    case KQ_MXFP4:  // e, then Q4_0's nibbles (the codes: the kernels map them to values)
      o.d[0] = e8m0_exponent(b[0]), o.d[1] = 0;
      for (int i = 0; i < 16; ++i) o.q[i] = b[1 + i] & 15, o.q[i + 16] = b[1 + i] >> 4;
      return;
    case KQ_Q5_0:
    case KQ_Q5_1: {
      const int off = type == KQ_Q5_0 ? 2 : 4;
      std::memcpy(o.d, b, 2);
      if (type == KQ_Q5_1) std::memcpy(o.m, b + 2, 2);
      const uint32_t qh = le32(b + off);
      const uint8_t* qs = b + off + 4;
      for (int i = 0; i < 16; ++i) {
        o.q[i] = (qs[i] & 15) | (((qh >> i) & 1) << 4);
        o.q[i + 16] = (qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
      }
      return;
    }
    case KQ_Q4_K:
    case KQ_Q5_K: {
      std::memcpy(o.d, b, 2), std::memcpy(o.m, b + 2, 2);
      const uint8_t* s = b + 4;
      for (int j = 0; j < 4; ++j) o.sc[j] = s[j] & 63, o.mn[j] = s[j + 4] & 63;
      for (int j = 4; j < 8; ++j) {
        o.sc[j] = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        o.mn[j] = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
      }
      const uint8_t* qs = b + (type == KQ_Q4_K ? 16 : 48);
      for (int c = 0; c < 4; ++c)
        for (int i = 0; i < 32; ++i) o.q[64 * c + i] = qs[32 * c + i] & 15, o.q[64 * c + 32 + i] = qs[32 * c + i] >> 4;
      if (type == KQ_Q5_K) {
        const uint8_t* qh = b + 16;
        for (int j = 0; j < 8; ++j)
          for (int l = 0; l < 32; ++l) o.q[32 * j + l] |= ((qh[l] >> j) & 1) << 4;
      }
      return;
    }
    default: {  // Q6_K
      const uint8_t *ql = b, *qh = b + 128;
      for (int h = 0; h < 2; ++h) {
        for (int i = 0; i < 64; ++i) {
          o.q[128 * h + i] = ql[64 * h + i] & 15;
          o.q[128 * h + 64 + i] = ql[64 * h + i] >> 4;
        }
        for (int sh = 0; sh < 4; ++sh)
          for (int l = 0; l < 32; ++l) o.q[128 * h + 32 * sh + l] |= ((qh[32 * h + l] >> (2 * sh)) & 3) << 4;
      }
      std::memcpy(o.sc, b + 192, 16);
      std::memcpy(o.d, b + 208, 2);
    }
  }
}

}  // namespace

namespace tpserve {

int64_t kq_block_bytes(int64_t type) {  // bytes per block in the file
  switch (type) {
    case KQ_Q4_1: return 20;
    case KQ_Q5_0: return 22;
    case KQ_Q5_1: return 24;
    case KQ_Q4_K: return 144;
    case KQ_Q5_K: return 176;
    case KQ_Q6_K: return 210;
    case KQ_MXFP4: return 17;
    default: return 0;  // Q4_Z: no file form
  }
}

void kq_pack_blocks(int64_t type, const uint8_t* raw, int64_t rows, int64_t K, uint8_t* w, uint8_t* s, int64_t b0,
                    int64_t b1) {
  const int64_t super = kq_super(type), nsup = K / super, fb = kq_block_bytes(type);
  if (fb == 0) return;  // Q4_Z: no file blocks to read (quant_linear.cpp's kq_pack refuses it)
  const int64_t cb = kq_chunk_bytes(type), wb = (K / 32) * cb, sbytes = kq_scale_bytes(type), sb = nsup * sbytes;
  const int bits = type == KQ_Q6_K ? 6 : (type == KQ_Q5_0 || type == KQ_Q5_1 || type == KQ_Q5_K) ? 5 : 4;
  for (int64_t b = b0; b < b1; ++b) {
    uint8_t* wblk = w + b * wb;
    uint8_t* sblk = s + b * sb;
    std::memset(wblk, 0, wb);
    std::memset(sblk, 0, sb);
    for (int64_t l = 0; l < NR; ++l) {
      const int64_t n = b * NR + l;
      if (n >= rows) break;  // padding rows stay zero
      for (int64_t g = 0; g < nsup; ++g) {
        Decoded o;
        decode(type, raw + (n * nsup + g) * fb, o);
        for (int64_t i = 0; i < super; ++i) {  // the values
          const int64_t k = g * super + i, c = k / 32, t = (k % 32) / 4, p = k % 4;
          uint8_t* chunk = wblk + c * cb;
          const uint8_t v = o.q[i];
          chunk[(t / 2) * 64 + 4 * l + p] |= (t & 1) ? (v & 15) << 4 : (v & 15);
          if (bits == 5) chunk[256 + 4 * l + p] |= ((v >> 4) & 1) << t;
          if (bits == 6) chunk[256 + (t / 4) * 64 + 4 * l + p] |= ((v >> 4) & 3) << (2 * (t % 4));
        }
        uint8_t* sp = sblk + g * sbytes;  // the scales
        if (type == KQ_MXFP4)
          sp[l] = o.d[0];  // one byte per row
        else
          std::memcpy(sp + 2 * l, o.d, 2);
        if (type == KQ_Q4_1 || type == KQ_Q5_1 || type == KQ_Q4_K || type == KQ_Q5_K) std::memcpy(sp + 32 + 2 * l, o.m, 2);
        if (type == KQ_Q4_K || type == KQ_Q5_K)
          for (int j = 0; j < 8; ++j) sp[64 + j * NR + l] = o.sc[j], sp[192 + j * NR + l] = o.mn[j];
        if (type == KQ_Q6_K)
          for (int j = 0; j < 16; ++j) sp[32 + j * NR + l] = o.sc[j];
      }
    }
  }
}

}  // namespace tpserve
