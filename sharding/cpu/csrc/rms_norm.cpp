// RMSNorm of float32 rows in one pass (CPU): y = w * (x * rsqrt(mean(x^2) + eps)), the order transformers uses.
// torch's CPU `F.rms_norm` runs as ~6 separate ops (pow, mean, add, rsqrt, two muls) and cost ~10 us per call on a
// decode row, called twice per layer; this is one dispatch. Rows are split over threads only when there are enough
// of them (prefill) to pay for it. The kernel: core/rms_norm.cpp (torch-free).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "tpserve_kernels.h"

#include <algorithm>

namespace tpserve {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && x.size(1) == w.size(0), "rms_norm: x [M, D], w [D]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "rms_norm: float32 only");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int64_t M = xc.size(0), D = xc.size(1);
  at::Tensor y = at::empty_like(xc);
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  auto rows = [&](int64_t r0, int64_t r1) { rms_norm_rows(xp, wp, feps, yp, D, r0, r1); };
  if (M * D >= 65536) {
    at::parallel_for(0, M, std::max<int64_t>(1, 16384 / D), rows);
  } else {
    rows(0, M);
  }
  return y;
}

}  // namespace tpserve

TORCH_LIBRARY_FRAGMENT(tpserve, m) { m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor"); }

TORCH_LIBRARY_IMPL(tpserve, CPU, m) { m.impl("rms_norm", &tpserve::rms_norm); }
