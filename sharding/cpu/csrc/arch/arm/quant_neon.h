// NEON inner loops of core/quant_linear.cpp (included there, in its anonymous namespace, on ARM64: the armv8-a and
// armv8.2-a+dotprod variants): int8 and int4 weights times int8 activations, in the layout and with the activations
// the x86 VNNI and AVX2 builds use (quant.py's pack_rows(rows=16, run=4): per 4 inputs, one 64-byte line holding the
// 4 bytes of each of the block's 16 rows; the activations quantized per row and block of 32 inputs by quantize_rows).
//
// A line is four 128-bit registers of 4 rows x 4 bytes. With the dot product extension (ARMv8.2 FEAT_DotProd, every
// ARM64 server core since Neoverse N1 / Graviton 2: `asimddp`), sdot multiplies a register by the row's 4 activation
// bytes broadcast to its 4 lanes, and each int32 lane accumulates one output row: the vpdpbusd of the VNNI kernels,
// 4 rows at a time, with both operands signed (no offset to correct). Without it (plain ARMv8.0: Cortex-A53/A72,
// Graviton 1), smull multiplies the low or high half of a register (2 rows x 4 bytes) by the 4 activation bytes twice
// over into int16, smlal adds a second line's products on top (|w x| <= 128 x 127, so two fit in int16), and sadalp
// adds pairs of those into int32 lanes, two per row, which one addp per block folds into one lane per row.
//
// int4: the block's nibbles are unpacked once per block of 32 inputs into the int8 lines' layout (low nibbles of a
// line are inputs 8i..8i+3, high ones 8i+4..8i+7, each less 8), then multiplied by every activation row exactly as
// int8 weights are.
//
// Either way the int32 dot product of each (row, block of 32 inputs) is exact, and the float steps after it are the
// x86 kernels' (acc = fma(float(dot), w_scale * x_scale, acc), block by block, then + bias): the outputs equal the
// x86-64-v4-vnni-bf16 and x86-64-v3 builds' bit for bit (tests/sharding/test_kernel_harness.py compares them, under
// qemu-aarch64: no ARM hardware ran this).
//
// SVE is not used: the layout's 16 rows per block fix the work per instruction at 128-bit granules (SVE's indexed
// sdot works within 128-bit segments too), so a 256-bit SVE (Neoverse V1 / Graviton 3) would need a layout packed by
// the vector length, and its two 256-bit pipes have the same int8 dot throughput as V1's four 128-bit NEON pipes;
// Neoverse V2 / N2 implement SVE2 at 128 bits. Decode reads every weight once per step and is bound by memory, not by
// these instructions. Nothing here could be measured (emulation only), so no SVE path that would have to be.
#pragma once

#include <arm_neon.h>

#include <cstring>

#define TPSERVE_INT8_DOT 1
#define TPSERVE_NEON 1

namespace {

constexpr int64_t NV = tpserve::VNNI_BLOCK;  // output rows per block: one int32 lane each (in 4 registers)
constexpr int64_t MB_VNNI = 4;  // activation rows per pass: 4 x 4 float32 accumulators
constexpr int64_t DOT_BLOCKS = 1, DOT_BLOCKS_ROWS = 1;  // blocks of 16 output rows a call (quant_linear.cpp)

// the block's 16 float16 scales of one group, as 4 vectors of 4 rows
inline void row_scales16(const tpserve::fp16_t* s, float32x4_t (&sw)[4]) {
  for (int g = 0; g < 4; ++g) sw[g] = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(s + 4 * g)));
}

// dot[g] = the int32 dot products of rows 4g..4g+3 of one block of 32 inputs (lines: 8 x 64 bytes, the int8 layout)
// with one activation row's 32 bytes xb
inline int32_t bytes4(const int8_t* p) {  // 4 activation bytes as one 32-bit lane
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void dot16(const int8_t* lines, const int8_t* xb, int32x4_t (&dot)[4]) {
#ifdef __ARM_FEATURE_DOTPROD
  for (int g = 0; g < 4; ++g) dot[g] = vdupq_n_s32(0);
  for (int i = 0; i < 8; ++i) {
    const int8x16_t xv = vreinterpretq_s8_s32(vdupq_n_s32(bytes4(xb + 4 * i)));  // inputs 4i..4i+3 in every lane
    for (int g = 0; g < 4; ++g) dot[g] = vdotq_s32(dot[g], vld1q_s8(lines + i * 64 + g * 16), xv);
  }
#else
  int32x4_t lo[4], hi[4];  // rows 4g, 4g+1 (two lanes each) and 4g+2, 4g+3
  for (int g = 0; g < 4; ++g) lo[g] = hi[g] = vdupq_n_s32(0);
  for (int i = 0; i < 8; i += 2) {
    const int8x8_t xa = vreinterpret_s8_s32(vdup_n_s32(bytes4(xb + 4 * i)));  // x[4i..4i+3] twice
    const int8x8_t xb2 = vreinterpret_s8_s32(vdup_n_s32(bytes4(xb + 4 * i + 4)));
    for (int g = 0; g < 4; ++g) {
      const int8x16_t la = vld1q_s8(lines + i * 64 + g * 16), lb = vld1q_s8(lines + (i + 1) * 64 + g * 16);
      const int16x8_t pl = vmlal_s8(vmull_s8(vget_low_s8(la), xa), vget_low_s8(lb), xb2);
      const int16x8_t ph = vmlal_s8(vmull_s8(vget_high_s8(la), xa), vget_high_s8(lb), xb2);
      lo[g] = vpadalq_s16(lo[g], pl);
      hi[g] = vpadalq_s16(hi[g], ph);
    }
  }
  for (int g = 0; g < 4; ++g) dot[g] = vpaddq_s32(lo[g], hi[g]);
#endif
}

// acc += float(dot) * (w_scale * x_scale): the VNNI and AVX2 kernels' float steps, in their order
inline void add_scaled(float32x4_t (&acc)[4], const int32x4_t (&dot)[4], const float32x4_t (&sw)[4], float xs) {
  const float32x4_t s = vdupq_n_f32(xs);
  for (int g = 0; g < 4; ++g) acc[g] = vfmaq_f32(acc[g], vcvtq_f32_s32(dot[g]), vmulq_f32(sw[g], s));
}

template <int R>
inline void store_rows16(const float32x4_t (&acc)[R][4], float* y, int64_t ldy, int64_t nrows) {
  for (int r = 0; r < R; ++r) {
    if (nrows >= 16) {
      for (int g = 0; g < 4; ++g) vst1q_f32(y + r * ldy + 4 * g, acc[r][g]);
    } else {
      float tmp[16];
      for (int g = 0; g < 4; ++g) vst1q_f32(tmp + 4 * g, acc[r][g]);
      std::memcpy(y + r * ldy, tmp, nrows * sizeof(float));
    }
  }
}

template <int R>
inline void int8_dot_block(const tpserve::Int8Rows& xq, int64_t m0, const int8_t* w, int64_t K, int64_t nrows,
                           const tpserve::fp16_t* scale, float* y, int64_t ldy) {
  float32x4_t acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < 4; ++g) acc[r][g] = vdupq_n_f32(0.f);
  const int64_t nb = K / 32;
  for (int64_t b = 0; b < nb; ++b) {
    float32x4_t sw[4];
    row_scales16(scale + b * NV, sw);
    for (int r = 0; r < R; ++r) {
      const int64_t row = m0 + r;
      int32x4_t dot[4];
      dot16(w + b * 8 * 64, xq.q.data() + row * K + b * 32, dot);
      add_scaled(acc[r], dot, sw, xq.scale[row * nb + b]);
    }
  }
  store_rows16<R>(acc, y, ldy, nrows);
}

// int4: a row's byte i of each run of 8 inputs holds input i (low nibble) and input i + 4 (high nibble), stored + 8
template <int R>
inline void int4_dot_block(const tpserve::Int8Rows& xq, int64_t m0, const uint8_t* w, int64_t K, int64_t nrows,
                           const tpserve::fp16_t* scale, int64_t G, float* y, int64_t ldy) {
  float32x4_t acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < 4; ++g) acc[r][g] = vdupq_n_f32(0.f);
  const int64_t nb = K / 32;
  const uint8x16_t low = vdupq_n_u8(0x0F);
  const int8x16_t eight = vdupq_n_s8(8);
  alignas(16) int8_t lines[8 * 64];  // the block's weights in the int8 layout, w - 8
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = w + b * 4 * 64;
    for (int i = 0; i < 4; ++i)
      for (int g = 0; g < 4; ++g) {
        const uint8x16_t v = vld1q_u8(wb + i * 64 + g * 16);
        vst1q_s8(lines + (2 * i) * 64 + g * 16, vsubq_s8(vreinterpretq_s8_u8(vandq_u8(v, low)), eight));
        vst1q_s8(lines + (2 * i + 1) * 64 + g * 16, vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(v, 4)), eight));
      }
    float32x4_t sw[4];
    row_scales16(scale + (b * 32 / G) * NV, sw);
    for (int r = 0; r < R; ++r) {
      const int64_t row = m0 + r;
      int32x4_t dot[4];
      dot16(lines, xq.q.data() + row * K + b * 32, dot);
      add_scaled(acc[r], dot, sw, xq.scale[row * nb + b]);
    }
  }
  store_rows16<R>(acc, y, ldy, nrows);
}

}  // namespace
