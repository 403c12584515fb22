// Rotary position embedding applied in place to a step's queries and keys (CPU, float32), in one dispatch: torch's
// `x * cos + rotate_half(x) * sin` is ~10 ops per layer (slices, neg, cat, muls, add, and the cat/split that pairs q
// with k). The kernel (core/rotary.cpp, torch-free) is transformers' formula, product by product, without contraction
// into FMAs, so the result is bitwise the formula's (tests/sharding/test_perf_paths.py).
//
//   q [N, Hq, D], k [N, Hk, D]   float32, last dim contiguous (views into the fused qkv output are fine)
//   cos, sin [N, D]              float32, contiguous (full rotary: D == head_dim)

#include <ATen/ATen.h>
#include <torch/library.h>

#include "tpserve_kernels.h"

namespace {

void rotate(at::Tensor& x, const float* cp, const float* sp) {
  const int64_t N = x.size(0), H = x.size(1), D = x.size(2);
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  float* base = x.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h) {
      float* v = base + n * s0 + h * s1;
      tpserve::rotate_head(v, v, cp + n * D, sp + n * D, D);
    }
}

void rotary_qk_(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && cos.dim() == 2 && sin.dim() == 2, "rotary_qk_: shapes");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat, "rotary_qk_: float32 only");
  const int64_t D = q.size(2);
  TORCH_CHECK(k.size(2) == D && cos.size(1) == D && sin.size(1) == D && D % 2 == 0 && q.size(0) == cos.size(0) &&
                  k.size(0) == cos.size(0), "rotary_qk_: full rotary over an even head_dim");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && cos.is_contiguous() && sin.is_contiguous(),
              "rotary_qk_: layout");
  rotate(q, cos.data_ptr<float>(), sin.data_ptr<float>());
  rotate(k, cos.data_ptr<float>(), sin.data_ptr<float>());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tpserve, m) { m.def("rotary_qk_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()"); }

TORCH_LIBRARY_IMPL(tpserve, CPU, m) { m.impl("rotary_qk_", &rotary_qk_); }
