// The work between the linears of a Llama-family decode layer, as three ops (CPU, float32), for the decode fast path
// of sharding/models/llama.py. In torch it is ~40 small ops per layer, each a dispatch of a few microseconds on a
// decode batch of a few rows; here it is three calls, with the same arithmetic:
//
//   decode_attention(qkv, cos, sin, pool, slots, table, lens, q_index, heads, kv_heads, scale, window) -> [B, P * D]
//       qkv [B, (heads + 2 kv_heads) * D]: the fused projection's output. Rotary on q and k (rotary.cpp's
//       rotate_head: transformers' formula, product by product), k and v stored at their slots in the paged cache
//       (pool [2, kv_heads, blocks, block_size, D]), then paged_decode_attention. q_index (optional, [P]): the local
//       query head of each of the P = kv_heads * group padded positions when GQA groups are uneven (attention.py
//       GroupedHeads); the caller drops the padding from the output.
//   add_rms_norm_(h, delta, w, eps) -> rms_norm(h += delta, w, eps): the residual add, in place, and the next norm.
//   silu_mul(gate_up [B, 2I]) -> silu(gate) * up [B, I].

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <optional>

namespace tpserve {
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& pool, const at::Tensor& table,
                                  const at::Tensor& lens, double scale, int64_t window);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
void rotate_head(float* dst, const float* src, const float* c, const float* s, int64_t D);  // rotary.cpp
}  // namespace tpserve

namespace {

using tpserve::rotate_head;

at::Tensor decode_attention(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor pool,
                            const at::Tensor& slots, const at::Tensor& table, const at::Tensor& lens,
                            const std::optional<at::Tensor>& q_index, int64_t heads, int64_t kv_heads, double scale,
                            int64_t window) {
  TORCH_CHECK(qkv.dim() == 2 && pool.dim() == 5 && cos.dim() == 2 && sin.dim() == 2 && slots.dim() == 1,
              "decode_attention: shapes");
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && pool.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && slots.scalar_type() == at::kLong,
              "decode_attention: float32 activations and cache, int64 slots");
  const int64_t B = qkv.size(0), D = pool.size(4), per_head = pool.size(2) * pool.size(3);
  TORCH_CHECK(pool.size(0) == 2 && pool.size(1) == kv_heads && qkv.size(1) == (heads + 2 * kv_heads) * D &&
                  cos.size(0) == B && cos.size(1) == D && sin.sizes() == cos.sizes() && slots.size(0) == B &&
                  D % 2 == 0,
              "decode_attention: sizes do not match");
  TORCH_CHECK(qkv.is_contiguous() && pool.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() &&
                  slots.is_contiguous(),
              "decode_attention: layout");
  const int64_t P = q_index.has_value() ? q_index->size(0) : heads;
  TORCH_CHECK(P % kv_heads == 0, "decode_attention: query positions must group evenly over the KV heads");
  const int64_t* qi = nullptr;
  at::Tensor qic;
  if (q_index.has_value()) {
    qic = q_index->to(at::kLong).contiguous();
    qi = qic.data_ptr<int64_t>();
  }
  at::Tensor q = at::empty({B, kv_heads, P / kv_heads, D}, qkv.options());
  const float* src = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  float* qp = q.data_ptr<float>();
  float* kc = pool.data_ptr<float>();
  float* vc = kc + kv_heads * per_head * D;
  const int64_t width = (heads + 2 * kv_heads) * D;
  for (int64_t b = 0; b < B; ++b) {
    const float* row = src + b * width;
    const float* c = cp + b * D;
    const float* s = sp + b * D;
    for (int64_t p = 0; p < P; ++p) {
      const int64_t h = qi ? qi[p] : p;
      TORCH_CHECK(h >= 0 && h < heads, "decode_attention: q_index out of range");
      rotate_head(qp + (b * P + p) * D, row + h * D, c, s, D);
    }
    TORCH_CHECK(slot[b] >= 0 && slot[b] < per_head, "decode_attention: slot out of range");
    for (int64_t h = 0; h < kv_heads; ++h) {
      rotate_head(kc + (h * per_head + slot[b]) * D, row + (heads + h) * D, c, s, D);
      const float* v = row + (heads + kv_heads + h) * D;
      std::copy(v, v + D, vc + (h * per_head + slot[b]) * D);
    }
  }
  return tpserve::paged_decode_attention(q, pool, table, lens, scale, window).view({B, P * D});
}

at::Tensor add_rms_norm_(at::Tensor h, const at::Tensor& delta, const at::Tensor& w, double eps) {
  TORCH_CHECK(h.dim() == 2 && delta.sizes() == h.sizes() && h.scalar_type() == at::kFloat &&
                  delta.scalar_type() == at::kFloat && h.is_contiguous(),
              "add_rms_norm_: h and delta [M, D] float32, h contiguous");
  const at::Tensor dc = delta.contiguous();
  float* hp = h.data_ptr<float>();
  const float* dp = dc.data_ptr<float>();
  const int64_t n = h.numel();
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) hp[i] += dp[i];
  return tpserve::rms_norm(h, w, eps);
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.scalar_type() == at::kFloat,
              "silu_mul: gate_up [M, 2I] float32");
  const at::Tensor g = gate_up.contiguous();
  const int64_t M = g.size(0), I = g.size(1) / 2;
  at::Tensor out = at::empty({M, I}, g.options());
  const float* gp = g.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float* gate = gp + m * 2 * I;
    const float* up = gate + I;
    float* o = op + m * I;
#pragma omp simd
    for (int64_t i = 0; i < I; ++i) o[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tpserve, m) {
  m.def("decode_attention(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) pool, Tensor slots, Tensor table, "
        "Tensor lens, Tensor? q_index, int heads, int kv_heads, float scale, int window) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) h, Tensor delta, Tensor w, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(tpserve, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("silu_mul", &silu_mul);
}
