// Decode attention read straight from the paged KV cache (CPU, float32): no gather of the blocks into a contiguous
// copy. One (sequence, KV head) pair per task; a KV head's `group` query heads share each key and value row read.
//
//   q      [B, H, G, D]             float32: the decode tokens' queries, grouped by KV head (G per head)
//   pool   [2, H, NB, BS, D]        float32: K and V of every block (sharding/layers/attention.py, PagedKVCache)
//   table  [B, MAXB]                int64:   the blocks of each sequence, in position order
//   lens   [B]                      int64:   keys each sequence sees (its position + 1)
//   window                          keys within the last `window` positions only (0: all)
//   out    [B, H, G, D]             float32
//
// The kernel of one (sequence, KV head): core/paged_attention.cpp (torch-free). Built with the others
// (sharding/cpu/variants.py); a pure-torch path stands in without them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "tpserve_kernels.h"

#include <algorithm>
#include <vector>

namespace tpserve {

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& pool, const at::Tensor& table,
                                  const at::Tensor& lens, double scale, int64_t window,
                                  const std::optional<at::Tensor>& sinks, double softcap) {
  TORCH_CHECK(q.dim() == 4 && pool.dim() == 5 && table.dim() == 2 && lens.dim() == 1, "paged_decode_attention: shapes");
  TORCH_CHECK(q.scalar_type() == at::kFloat && pool.scalar_type() == at::kFloat, "paged_decode_attention: float32 only");
  TORCH_CHECK(table.scalar_type() == at::kLong && lens.scalar_type() == at::kLong, "paged_decode_attention: int64 indices");
  TORCH_CHECK(pool.is_contiguous() && table.is_contiguous() && lens.is_contiguous(), "paged_decode_attention: layout");
  const at::Tensor qc = q.contiguous();
  const int64_t B = qc.size(0), H = qc.size(1), G = qc.size(2), D = qc.size(3);
  const int64_t NB = pool.size(2), BS = pool.size(3), MAXB = table.size(1);
  TORCH_CHECK(pool.size(0) == 2 && pool.size(1) == H && pool.size(4) == D && table.size(0) == B && lens.size(0) == B,
              "paged_decode_attention: shapes do not match");
  TORCH_CHECK(!sinks.has_value() || (sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                                      sinks->numel() == H * G),
              "paged_decode_attention: sinks float32 [kv_heads, group]");
  const float* sk = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  at::Tensor out = at::empty_like(qc);
  const float* qp = qc.data_ptr<float>();
  const float* kp = pool.data_ptr<float>();
  const float* vp = kp + H * NB * BS * D;
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);
  TORCH_CHECK(softcap >= 0.0, "paged_decode_attention: softcap >= 0 (0: none)");

  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const int64_t len = lp[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      paged_attention_head(qp + bh * G * D, kp + h * NB * BS * D, vp + h * NB * BS * D, tp + b * MAXB, len, first, G, D,
                           BS, fscale, scores, op + bh * G * D, sk ? sk + h * G : nullptr, cap);
    }
  });
  return out;
}

}  // namespace tpserve

TORCH_LIBRARY_FRAGMENT(tpserve, m) {
  m.def("paged_decode_attention(Tensor q, Tensor pool, Tensor table, Tensor lens, float scale, int window, "
        "Tensor? sinks=None, float softcap=0.) -> Tensor");
}

TORCH_LIBRARY_IMPL(tpserve, CPU, m) { m.impl("paged_decode_attention", &tpserve::paged_decode_attention); }
