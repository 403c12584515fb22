// The kernels themselves, without torch: raw-pointer entry points over a range of work, so that decode_glue.cpp's
// decode_layers can run a whole decode step in one OpenMP team (each thread its share of every phase, barriers
// between phases) while the torch ops run the same code through at::parallel_for. Same code, same arithmetic: the
// two paths give bitwise the same results (tests/sharding/test_perf_paths.py).
//
// Layout of the sources (docs/cpu-kernels.md):
//   core/*.cpp      these entry points, torch-free, with the portable C++ loops (core/portable_quant.h,
//                   core/portable_f32.h): what a build runs where its ISA has no loop of its own
//   arch/x86/*.h    the AVX-512 (VNNI, BF16) and AVX2 inner loops, chosen by the build's -march (__AVX512F__, ...)
//   arch/arm/*.h    the NEON inner loops (with the dot product extension where the build has it: __ARM_FEATURE_DOTPROD)
//   *.cpp           the torch ops over them (TORCH_LIBRARY, at::parallel_for) and decode_glue.cpp's fused steps
//   tests/harness.cpp  a torch-free program that runs every kernel of a build against a plain scalar reference
//                   (tests/sharding/test_kernel_harness.py: natively for the x86 variants, under qemu for ARM64)
// Nothing here includes a torch header: the harness compiles core/*.cpp alone, for any variant, cross-compiled too.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace tpserve {

// IEEE 754 half precision, as its bits (the int8 / int4 weights' scales: torch's float16, at::Half)
using fp16_t = uint16_t;

// Every half is a float exactly (subnormals included), so any correct conversion gives the same bits.
inline float fp16_to_float(fp16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);  // inf, nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: man * 2^-24, normalized
    int shifts = 0;
    while (!(man & 0x400u)) {
      man <<= 1;
      ++shifts;
    }
    bits = sign | (static_cast<uint32_t>(113 - shifts) << 23) | ((man & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Calls f(std::integral_constant<int, R>{}) for R = rows (1 <= rows <= MAXR): the row count becomes a compile-time
// constant, so a tile's accumulators stay in registers.
template <int MAXR, typename F>
inline void with_rows(int64_t rows, const F& f) {
  if constexpr (MAXR > 1) {
    if (rows < MAXR) return with_rows<MAXR - 1>(rows, f);
  }
  f(std::integral_constant<int, MAXR>{});
}

// What this build's kernels run, for the harness and the logs: "avx512-vnni-bf16", "avx512", "avx2", "neon-dotprod",
// "neon" or "portable"
const char* kernels_isa();

// ---- linears: y [M, N] (row stride N) from x [M, K] contiguous, over output blocks [b0, b1) -------------------------
// core/quant_linear.cpp: blocks of 4 output rows (int8, int4, bf16 weights as quant.py's pack_rows stores them), or
// for int8 and int4 where the kernels multiply int8 activations (AVX-512 VNNI, AVX2, NEON) blocks of 16 (int_rows()
// says which)
constexpr int64_t QUANT_BLOCK = 4;
constexpr int64_t VNNI_BLOCK = 16;

// int8 and int4 on CPUs with AVX-512 VNNI, AVX2 or NEON multiply int8 activations: x quantized per row and block of
// 32 inputs (Q8_0's scheme), once per input, by quantize_rows (blocks [kb0, kb1) of every row; `rows` sized by
// resize_rows)
struct Int8Rows {
  std::vector<int8_t> q;        // [M, K]
  std::vector<float> scale;     // [M, K/32]
  std::vector<int32_t> sum;     // [M, K/32]: each block's sum of q (the x86 kernels' weights are unsigned: w + offset)
  std::vector<int32_t> sum16;   // [M, K/16]: the same per half block (Q6_K's groups of 16)
  std::vector<int32_t> fix8;    // [M, K/32]: -8 sum, and -128 sum: the corrections the int4 and int8 kernels start
  std::vector<int32_t> fix128;  // from (their weights unsigned: w + 8, w + 128), read as they are
  std::vector<uint16_t> h;      // [M, K]: x rounded to bfloat16, for bf16 weights (round_rows_bf16)
  int64_t M = 0, K = 0;
};
bool vnni_layout();  // whether int8_range and int4_range take x quantized and weights in blocks of 16 rows
int64_t int_rows();  // rows per block of the int8 and int4 layout: 16 with VNNI, AVX2 or NEON, else 4
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
void int8_range(const float* x, const Int8Rows* xq, int64_t M, int64_t K, const int8_t* w, const fp16_t* scale,
                const float* bias, int64_t N, float* y, int64_t b0, int64_t b1);
void int4_range(const float* x, const Int8Rows* xq, int64_t M, int64_t K, const uint8_t* w, const fp16_t* scale,
                int64_t G, const float* bias, int64_t N, float* y, int64_t b0, int64_t b1);

// core/kquant_linear.cpp: GGUF's other block types served in their own blocks (llama.cpp's Q4_1, Q5_0, Q5_1, Q4_K,
// Q5_K, Q6_K, MXFP4; its Q8_0 and Q4_0 are int8 and int4 above), and Q4_Z (4-bit values with an integer zero point
// per 32 inputs: Hugging Face's asymmetric int4, no file form), over int8 activations on every build (quantize_rows),
// in blocks of 16 output rows (the layout: kquant_linear.cpp and sharding/layers/gguf_quant.py). `type`: a KQuant.
enum KQuant : int64_t {
  KQ_Q4_1 = 1, KQ_Q5_0 = 2, KQ_Q5_1 = 3, KQ_Q4_K = 4, KQ_Q5_K = 5, KQ_Q6_K = 6, KQ_MXFP4 = 7, KQ_Q4_Z = 8
};
bool kq_valid(int64_t type);
int64_t kq_chunk_bytes(int64_t type);  // bytes of w per 32 inputs of a 16-row block
int64_t kq_super(int64_t type);        // inputs per block of scales (32 or 256)
int64_t kq_scale_bytes(int64_t type);  // bytes of s per `kq_super` inputs of a 16-row block
// core/kquant_pack.cpp: the file's blocks (uint8 [rows, K / block, bytes per block]) -> w, s for 16-row blocks
// [b0, b1) (sized [ceil(rows / 16), K / 32 * kq_chunk_bytes] and [ceil(rows / 16), K / kq_super * kq_scale_bytes])
int64_t kq_block_bytes(int64_t type);  // bytes per block in the file; 0 for Q4_Z, which has no file form
void kq_pack_blocks(int64_t type, const uint8_t* raw, int64_t rows, int64_t K, uint8_t* w, uint8_t* s, int64_t b0,
                    int64_t b1);
void kq_range(int64_t type, const Int8Rows* xq, int64_t M, int64_t K, const uint8_t* w, const uint8_t* s,
              const float* bias, int64_t N, float* y, int64_t b0, int64_t b1);

// core/amx_linear.cpp (the x86-64-v4-amx build; elsewhere they return false): the int8 / int4 (int4: w is the packed
// nibbles) and bf16 ranges above on AMX tiles, for AMX_MIN_ROWS activation rows or more, when the OS grants the tiles;
// false: not taken, the other kernels run
constexpr int64_t AMX_MIN_ROWS = 16;  // one A tile; below it the VNNI kernels leave no tile rows idle
bool amx_ready();
bool amx_int_range(const Int8Rows* xq, int64_t M, int64_t K, const void* w, bool int4, const fp16_t* scale, int64_t G,
                   const float* bias, int64_t N, float* y, int64_t b0, int64_t b1);
bool amx_bf16_range(const Int8Rows* xq, int64_t M, int64_t K, const uint16_t* w, const float* bias, int64_t N, float* y,
                    int64_t b0, int64_t b1);

// core/f32_linear.cpp: blocks of 32 output columns (kernels.block_f32)
constexpr int64_t F32_BLOCK = 32;
void f32_range(const float* x, int64_t M, int64_t K, const float* w, const float* bias, int64_t N, float* y, int64_t b0,
               int64_t b1);

// ---- the rest of a decode layer -------------------------------------------------------------------------------------
// core/rotary.cpp: dst = rotary(src) over one head of D floats (dst may be src)
void rotate_head(float* dst, const float* src, const float* c, const float* s, int64_t D);
// core/rms_norm.cpp: rows [r0, r1) of y = w * (x * rsqrt(mean(x^2) + eps))
void rms_norm_rows(const float* x, const float* w, float eps, float* y, int64_t D, int64_t r0, int64_t r1);
// core/paged_attention.cpp: one (sequence, KV head): its G query heads qbh [G, D] against keys [first, len) of the
// head's K/V blocks (kh/vh: the head's [blocks, BS, D] pool), out obh [G, D]; scores: scratch. sinks (gpt-oss, or
// null): one logit per query head [G] that joins its softmax's denominator and attends to nothing
void paged_attention_head(const float* qbh, const float* kh, const float* vh, const int64_t* blocks, int64_t len,
                          int64_t first, int64_t G, int64_t D, int64_t BS, float scale, std::vector<float>& scores,
                          float* obh, const float* sinks = nullptr, float softcap = 0.f);
// the same for R rows of one sequence (a speculative step's verification rows): row r's G query heads at q + r qs
// against keys [firsts[r], lens[r]), out at o + r os; each key and value row is read once for every row, and each
// query's result has the bits paged_attention_head gives it alone
void paged_attention_rows(const float* q, int64_t qs, const float* kh, const float* vh, const int64_t* blocks,
                          const int64_t* lens, const int64_t* firsts, int64_t R, int64_t G, int64_t D, int64_t BS,
                          float scale, std::vector<float>& scratch, float* o, int64_t os, const float* sinks = nullptr,
                          float softcap = 0.f);
// The same in pieces, for a team of threads: a query's keys are cut into chunks of ATTENTION_CHUNK keys at fixed
// positions ([c C, (c + 1) C)); paged_attention_chunk computes chunk c for the R rows' queries whose keys meet it: the
// partial of query (r, g) at part + r prs + g pgs, D + 2 floats: o[D] = the sum of exp(s_t - m) v_t over its keys t in
// the chunk, in order, then m (its largest score there) and l (the sum of exp(s_t - m)). paged_attention_combine
// turns a query's n partials of consecutive chunks (at part, D + 2 floats apart) into its output o [D], in chunk order.
// paged_attention_rows is exactly these calls, so a row's bits do not depend on who computed which chunk.
constexpr int64_t ATTENTION_CHUNK = 256;
void paged_attention_chunk(const float* q, int64_t qs, const float* kh, const float* vh, const int64_t* blocks,
                           const int64_t* lens, const int64_t* firsts, int64_t R, int64_t G, int64_t D, int64_t BS,
                           float scale, int64_t c, std::vector<float>& scratch, float* part, int64_t prs, int64_t pgs,
                           float softcap = 0.f);
void paged_attention_combine(const float* part, int64_t n, int64_t D, const float* sink, float* o);
// core/argmax.cpp: torch.argmax of one row of V > 0 floats (the first maximal value; a NaN counts as the maximum)
int64_t argmax_row(const float* row, int64_t V);

}  // namespace tpserve
