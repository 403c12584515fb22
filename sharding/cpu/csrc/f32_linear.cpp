// Float32 linears on CPU from weights stored once at load in column blocks, as a torch op: y = x @ W^T (+ bias).
//
//   f32_linear(x [M, K] f32, w [ceil(N/32), K, 32] f32, bias [N] f32 or None, N) -> y [M, N]
//       w[b, k, j] = W[32 b + j, k] (zeros pad the last block): each block of 32 output columns is K runs of 32
//       weights, one per input.
//
// The kernel (f32_range) and why it is shaped as it is: core/f32_linear.cpp (torch-free). Built by
// sharding/cpu/kernels.py with the others.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "team_split.h"
#include "tpserve_kernels.h"

#include <cstdint>
#include <optional>

namespace tpserve {

constexpr int64_t BW = F32_BLOCK;  // output columns per block

at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
              "f32_linear: float32 x [M, K] and w [N/32, K, 32]");
  const int64_t M = x.size(0), K = x.size(1), blocks = w.size(0);
  TORCH_CHECK(w.size(1) == K && w.size(2) == BW && blocks == (N + BW - 1) / BW && w.is_contiguous(),
              "f32_linear: w must be [ceil(N/32), K, 32], contiguous");
  const float* bp = nullptr;
  at::Tensor bc;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat, "f32_linear: bias [N]");
    bc = bias->contiguous();
    bp = bc.data_ptr<float>();
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = xc.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // one block is K * 128 bytes of weights: a split per block keeps 2 threads even on the smallest linears
  shared_for(blocks, 1, Shares::chunk_for(K * BW * 4), at::get_num_threads(),
             [&](int64_t b0, int64_t b1) { f32_range(xp, M, K, wp, bp, N, yp, b0, b1); });
  return y;
}

}  // namespace tpserve

TORCH_LIBRARY_FRAGMENT(tpserve, m) {
  m.def("f32_linear(Tensor x, Tensor w, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(tpserve, CPU, m) {
  m.impl("f32_linear", &tpserve::f32_linear);
}
