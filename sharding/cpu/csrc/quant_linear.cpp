// The quantized linears as torch ops (CPU): y = x @ dequant(W)^T, x float32 [M, K], int8, int4 or bf16 weights.
//
//   int8_linear(x, w, scale [blocks, K/32, rows] f16, N)         W[n,k] = q[n,k] * s[n, k/32]    (llama.cpp's Q8_0)
//   int4_linear(x, w, scale [blocks, K/G, rows] f16, G, N)       W[n,k] = (nibble - 8) * s[n, k/G] (Q4_0; G % 32 == 0)
//   bf16_linear(x, w, N)                                         W[n,k] = w[n,k], a bfloat16
//
// The kernels, their two layouts of w and the activations they multiply: core/quant_linear.cpp (torch-free). Here:
// checks, the activations quantized once per call, and the output blocks split over torch's intra-op threads (each
// its own share first, then what the others have not reached: team_split.h).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "team_split.h"
#include "tpserve_kernels.h"

#include <algorithm>
#include <cstdint>

namespace tpserve {

// x quantized for the int8 and int4 kernels where they take int8 activations (else left empty)
void quantize_all(const float* x, Int8Rows& xq, int64_t M, int64_t K) {
  if (!vnni_layout()) return;
  resize_rows(xq, M, K);
  at::parallel_for(0, M, std::max<int64_t>(1, 8192 / K), [&](int64_t m0, int64_t m1) {  // threads for prefill only
    quantize_rows(x, xq, m0, m1, 0, K / 32);
  });
}

// The ops: output blocks shared over torch's intra-op threads, ~64 output rows per thread at least (team_split.h).
constexpr int64_t GRAIN = 16;  // blocks of 4 rows
const int64_t INT_GRAIN = 64 / int_rows();  // blocks of the int8 / int4 layout

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, int64_t N) {
  const int64_t RB = int_rows();
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && scale.dim() == 3,
              "int8_linear: x [M, K], w [N/RB, RB K], scale [N/RB, K/32, RB]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kChar && scale.scalar_type() == at::kHalf,
              "int8_linear: float32 x, int8 w, float16 scale");
  const int64_t M = x.size(0), K = x.size(1), blocks = (N + RB - 1) / RB;
  TORCH_CHECK(K % 32 == 0 && w.size(0) == blocks && w.size(1) == RB * K && scale.size(0) == blocks &&
                  scale.size(1) == K / 32 && scale.size(2) == RB,
              "int8_linear: shapes (K % 32 == 0, blocks of ", RB, " rows)");
  TORCH_CHECK(w.is_contiguous() && scale.is_contiguous(), "int8_linear: contiguous weights");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const fp16_t* sp = half_data(scale);
  float* yp = y.data_ptr<float>();
  Int8Rows xq;
  quantize_all(xp, xq, M, K);
  shared_for(blocks, INT_GRAIN, Shares::chunk_for(w.size(1) + scale.size(1) * RB * 2), at::get_num_threads(),
             [&](int64_t b0, int64_t b1) {
    int8_range(xp, &xq, M, K, wp, sp, nullptr, N, yp, b0, b1);
  });
  return y;
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, int64_t G, int64_t N) {
  const int64_t RB = int_rows();
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && scale.dim() == 3,
              "int4_linear: x [M, K], w [N/RB, RB K/2], scale [N/RB, K/G, RB]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kByte && scale.scalar_type() == at::kHalf,
              "int4_linear: float32 x, uint8 w, float16 scale");
  const int64_t M = x.size(0), K = x.size(1), blocks = (N + RB - 1) / RB;
  TORCH_CHECK(G % 32 == 0 && K % G == 0 && w.size(0) == blocks && w.size(1) == RB * K / 2 &&
                  scale.size(0) == blocks && scale.size(1) == K / G && scale.size(2) == RB,
              "int4_linear: shapes (G % 32 == 0, K % G == 0, blocks of ", RB, " rows)");
  TORCH_CHECK(w.is_contiguous() && scale.is_contiguous(), "int4_linear: contiguous weights");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const fp16_t* sp = half_data(scale);
  float* yp = y.data_ptr<float>();
  Int8Rows xq;
  quantize_all(xp, xq, M, K);
  shared_for(blocks, INT_GRAIN, Shares::chunk_for(w.size(1) + scale.size(1) * RB * 2), at::get_num_threads(),
             [&](int64_t b0, int64_t b1) {
    int4_range(xp, &xq, M, K, wp, sp, G, nullptr, N, yp, b0, b1);
  });
  return y;
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w, int64_t N) {
  const int64_t RB = bf16_rows();
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "bf16_linear: x [M, K], w [N/RB, 2 RB K] bytes");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kByte, "bf16_linear: float32 x, uint8 w");
  const int64_t M = x.size(0), K = x.size(1), blocks = (N + RB - 1) / RB;
  TORCH_CHECK(w.size(0) == blocks && w.size(1) == RB * K * 2 && K % 16 == 0,
              "bf16_linear: shapes (K % 16 == 0, blocks of ", RB, " rows)");
  TORCH_CHECK(w.is_contiguous(), "bf16_linear: contiguous weights");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<uint8_t>());
  float* yp = y.data_ptr<float>();
  Int8Rows xq;
  if (bf16_dot_layout()) {
    resize_bf16_rows(xq, M, K);
    at::parallel_for(0, M, std::max<int64_t>(1, 8192 / K), [&](int64_t m0, int64_t m1) {
      round_rows_bf16(xp, xq, m0, m1);
    });
  }
  shared_for(blocks, 64 / RB, Shares::chunk_for(w.size(1)), at::get_num_threads(), [&](int64_t b0, int64_t b1) {
    bf16_range(xp, &xq, M, K, wp, nullptr, N, yp, b0, b1);
  });
  return y;
}

// GGUF's other block types (core/kquant_linear.cpp): x always quantized to int8 per row and block of 32
at::Tensor kq_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s, int64_t type, int64_t N) {
  TORCH_CHECK(kq_valid(type), "kq_linear: unknown block type ", type);
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && s.dim() == 2 && x.scalar_type() == at::kFloat &&
                  w.scalar_type() == at::kByte && s.scalar_type() == at::kByte,
              "kq_linear: float32 x [M, K], uint8 w [N/16, ...], uint8 s [N/16, ...]");
  const int64_t M = x.size(0), K = x.size(1), blocks = (N + VNNI_BLOCK - 1) / VNNI_BLOCK;
  TORCH_CHECK(K % kq_super(type) == 0 && w.size(0) == blocks && w.size(1) == K / 32 * kq_chunk_bytes(type) &&
                  s.size(0) == blocks && s.size(1) == K / kq_super(type) * kq_scale_bytes(type),
              "kq_linear: shapes (K a multiple of the type's block, weights in blocks of 16 rows)");
  TORCH_CHECK(w.is_contiguous() && s.is_contiguous(), "kq_linear: contiguous weights");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  Int8Rows xq;
  resize_rows(xq, M, K);
  at::parallel_for(0, M, std::max<int64_t>(1, 8192 / K), [&](int64_t m0, int64_t m1) {
    quantize_rows(xp, xq, m0, m1, 0, K / 32);
  });
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const uint8_t* sp = s.data_ptr<uint8_t>();
  shared_for(blocks, 4, Shares::chunk_for(w.size(1) + s.size(1)), at::get_num_threads(), [&](int64_t b0, int64_t b1) {
    kq_range(type, &xq, M, K, wp, sp, nullptr, N, yp, b0, b1);
  });
  return y;
}

// GGUF blocks [rows, K / block, bytes] -> (w, s) as kq_linear reads them (core/kquant_pack.cpp)
std::tuple<at::Tensor, at::Tensor> kq_pack(const at::Tensor& raw, int64_t type, int64_t K) {
  TORCH_CHECK(kq_valid(type) && kq_block_bytes(type) > 0, "kq_pack: block type ", type, " has no file blocks");
  TORCH_CHECK(raw.dim() == 3 && raw.scalar_type() == at::kByte && raw.is_contiguous() && K % kq_super(type) == 0 &&
                  raw.size(1) == K / kq_super(type) && raw.size(2) == kq_block_bytes(type),
              "kq_pack: uint8 blocks [rows, K / block, bytes per block]");
  const int64_t rows = raw.size(0), blocks = (rows + VNNI_BLOCK - 1) / VNNI_BLOCK;
  at::Tensor w = at::empty({blocks, K / 32 * kq_chunk_bytes(type)}, raw.options());
  at::Tensor s = at::empty({blocks, K / kq_super(type) * kq_scale_bytes(type)}, raw.options());
  const uint8_t* rp = raw.data_ptr<uint8_t>();
  uint8_t *wp = w.data_ptr<uint8_t>(), *sp = s.data_ptr<uint8_t>();
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) { kq_pack_blocks(type, rp, rows, K, wp, sp, b0, b1); });
  return {w, s};
}

}  // namespace tpserve

TORCH_LIBRARY_FRAGMENT(tpserve, m) {
  m.def("kq_pack(Tensor raw, int type, int k) -> (Tensor, Tensor)");
  m.def("kq_linear(Tensor x, Tensor w, Tensor s, int type, int n) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor w, Tensor scale, int n) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor w, Tensor scale, int group, int n) -> Tensor");
  // int8_linear and int4_linear quantize their activations (VNNI, AVX2, NEON), and take weights in blocks of 16 rows
  m.def("quant_int8_activations() -> bool", &tpserve::vnni_layout);
  m.def("bf16_linear(Tensor x, Tensor w, int n) -> Tensor");
  // bf16_linear rounds its activations to bfloat16 (AVX-512 BF16), and takes weights in blocks of 16 rows
  m.def("quant_bf16_activations() -> bool", &tpserve::bf16_dot_layout);
}

TORCH_LIBRARY_IMPL(tpserve, CPU, m) {
  m.impl("int8_linear", &tpserve::int8_linear);
  m.impl("int4_linear", &tpserve::int4_linear);
  m.impl("bf16_linear", &tpserve::bf16_linear);
  m.impl("kq_linear", &tpserve::kq_linear);
  m.impl("kq_pack", &tpserve::kq_pack);
}
