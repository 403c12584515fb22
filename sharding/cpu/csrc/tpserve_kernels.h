// What the CPU kernel files share: raw-pointer entry points over a range of work, so that decode_glue.cpp's
// decode_layers can run a whole decode step in one OpenMP team (each thread its share of every phase, barriers
// between phases) while the torch ops run the same code through at::parallel_for. Same code, same arithmetic: the
// two paths give bitwise the same results (tests/sharding/test_perf_paths.py).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

namespace tpserve {

// Calls f(std::integral_constant<int, R>{}) for R = rows (1 <= rows <= MAXR): the row count becomes a compile-time
// constant, so a tile's accumulators stay in registers.
template <int MAXR, typename F>
inline void with_rows(int64_t rows, const F& f) {
  if constexpr (MAXR > 1) {
    if (rows < MAXR) return with_rows<MAXR - 1>(rows, f);
  }
  f(std::integral_constant<int, MAXR>{});
}

// ---- linears: y [M, N] (row stride N) from x [M, K] contiguous, over output blocks [b0, b1) -------------------------
// quant_linear.cpp: blocks of 4 output rows (int8, int4, bf16 weights as quant.py's pack_rows stores them), or for
// int8 and int4 on CPUs with AVX-512 VNNI or AVX2 blocks of 16 (int_rows() says which)
constexpr int64_t QUANT_BLOCK = 4;
constexpr int64_t VNNI_BLOCK = 16;

// int8 and int4 on CPUs with AVX-512 VNNI or AVX2 multiply int8 activations: x quantized per row and block of 32 inputs
// (Q8_0's scheme), once per input, by quantize_rows (blocks [kb0, kb1) of every row; `rows` sized by resize_rows)
struct Int8Rows {
  std::vector<int8_t> q;        // [M, K]
  std::vector<float> scale;     // [M, K/32]
  std::vector<int32_t> sum;     // [M, K/32]: each block's sum of q (the kernels' weights are unsigned: w + offset)
  std::vector<uint16_t> h;      // [M, K]: x rounded to bfloat16, for bf16 weights (round_rows_bf16)
  int64_t M = 0, K = 0;
};
bool vnni_layout();  // whether int8_range and int4_range take x quantized and weights in blocks of 16 rows
int64_t int_rows();  // rows per block of the int8 and int4 layout: 16 with VNNI or AVX2, else 4
void resize_rows(Int8Rows& r, int64_t M, int64_t K);
void quantize_rows(const float* x, Int8Rows& r, int64_t m0, int64_t m1, int64_t kb0, int64_t kb1);
// bf16 weights on CPUs with AVX-512 BF16: x rounded to bfloat16 (xq->h, sized by resize_bf16_rows) and weights in
// blocks of 16 rows
bool bf16_dot_layout();
int64_t bf16_rows();
void resize_bf16_rows(Int8Rows& r, int64_t M, int64_t K);
void round_rows_bf16(const float* x, Int8Rows& r, int64_t m0, int64_t m1);
void bf16_range(const float* x, const Int8Rows* xq, int64_t M, int64_t K, const uint16_t* w, const float* bias,
                int64_t N, float* y, int64_t b0, int64_t b1);
// xq: the quantized x when vnni_layout(), else unused
void int8_range(const float* x, const Int8Rows* xq, int64_t M, int64_t K, const int8_t* w, const at::Half* scale,
                const float* bias, int64_t N, float* y, int64_t b0, int64_t b1);
void int4_range(const float* x, const Int8Rows* xq, int64_t M, int64_t K, const uint8_t* w, const at::Half* scale,
                int64_t G, const float* bias, int64_t N, float* y, int64_t b0, int64_t b1);

// amx_linear.cpp (the x86-64-v4-amx build; elsewhere they return false): the int8 / int4 (int4: w is the packed
// nibbles) and bf16 ranges above on AMX tiles, for AMX_MIN_ROWS activation rows or more, when the OS grants the tiles;
// false: not taken, run the other kernels
constexpr int64_t AMX_MIN_ROWS = 16;  // one A tile; below it the VNNI kernels leave no tile rows idle
bool amx_ready();
bool amx_int_range(const Int8Rows* xq, int64_t M, int64_t K, const void* w, bool int4, const at::Half* scale,
                   int64_t G, const float* bias, int64_t N, float* y, int64_t b0, int64_t b1);
bool amx_bf16_range(const Int8Rows* xq, int64_t M, int64_t K, const uint16_t* w, const float* bias, int64_t N, float* y,
                    int64_t b0, int64_t b1);

// f32_linear.cpp: blocks of 32 output columns (kernels.block_f32)
constexpr int64_t F32_BLOCK = 32;
void f32_range(const float* x, int64_t M, int64_t K, const float* w, const float* bias, int64_t N, float* y, int64_t b0,
               int64_t b1);

// ---- the rest of a decode layer --------------------------------------------------------------------------------------
// rotary.cpp: dst = rotary(src) over one head of D floats (dst may be src)
void rotate_head(float* dst, const float* src, const float* c, const float* s, int64_t D);
// rms_norm.cpp: rows [r0, r1) of y = w * (x * rsqrt(mean(x^2) + eps))
void rms_norm_rows(const float* x, const float* w, float eps, float* y, int64_t D, int64_t r0, int64_t r1);
// paged_attention.cpp: one (sequence, KV head): its G query heads qbh [G, D] against keys [first, len) of the head's
// K/V blocks (kh/vh: the head's [blocks, BS, D] pool), out obh [G, D]; scores: scratch
void paged_attention_head(const float* qbh, const float* kh, const float* vh, const int64_t* blocks, int64_t len,
                          int64_t first, int64_t G, int64_t D, int64_t BS, float scale, std::vector<float>& scores,
                          float* obh);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& pool, const at::Tensor& table,
                                  const at::Tensor& lens, double scale, int64_t window);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);

}  // namespace tpserve
