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
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <optional>
#include <vector>

namespace tpserve {
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& pool, const at::Tensor& table,
                                  const at::Tensor& lens, double scale, int64_t window);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
void rotate_head(float* dst, const float* src, const float* c, const float* s, int64_t D);  // rotary.cpp
at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                      int64_t N);                                                            // f32_linear.cpp
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale);  // quant_linear.cpp
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale, int64_t G, int64_t N);
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& w, int64_t N);
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


// argmax_rows(logits [B, V] float32) -> [B] int64: torch.argmax(logits, -1) (the first maximal value; a NaN counts as
// the maximum, as torch's does), for greedy sampling. torch's CPU argmax reads a 49,152-wide row at ~4.5 GB/s (44 us
// per decode step); this is one vectorized max pass and one compare pass over the row.
inline bool is_nan(float v) {  // by its bits: -ffast-math folds std::isnan to false
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return (bits & 0x7FFFFFFFu) > 0x7F800000u;
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "argmax_rows: float32 logits [B, V], V > 0");
  const at::Tensor lc = logits.contiguous();
  const int64_t B = lc.size(0), V = lc.size(1);
  at::Tensor out = at::empty({B}, lc.options().dtype(at::kLong));
  const float* lp = lc.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const float* row = lp + b * V;
    float best = row[0];
    bool nan = false;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 m = _mm512_set1_ps(row[0]);
    __mmask16 unordered = 0;
    for (; i + 16 <= V; i += 16) {
      const __m512 v = _mm512_loadu_ps(row + i);
      unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      m = _mm512_max_ps(m, v);
    }
    best = _mm512_reduce_max_ps(m);
    nan = unordered != 0;
#endif
    for (; i < V; ++i) {
      nan |= is_nan(row[i]);
      best = row[i] > best ? row[i] : best;
    }
    int64_t at = 0;
    if (nan) {
      while (!is_nan(row[at])) ++at;
    } else {
      i = 0;
#if defined(__AVX512F__)
      const __m512 target = _mm512_set1_ps(best);
      for (; i + 16 <= V; i += 16) {
        const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + i), target, _CMP_EQ_OQ);
        if (eq) break;
      }
#endif
      while (row[i] != best) ++i;
      at = i;
    }
    op[b] = at;
  }
  return out;
}

// ---- the whole decode step of a model's layers in one call (TP=1) ---------------------------------------------------
// DecodeLayers holds, once, what each layer needs (its four linears with their kernels, norms, cache pool, heads);
// decode_layers(plan, h, x, ...) then runs every layer with the three ops above and the linear kernels, without a
// return to Python between them: at one row the Python loop and the dispatch of ~8 ops per layer cost ~1.5 ms of a
// ~7 ms int8 step (BENCHMARKS.md). The residual stream h is updated in place; the result is the final norm's output.

struct PlanLinear {
  int64_t kind;  // 0 float32 (f32_linear.cpp), 1 int8, 2 int4, 3 bf16 (quant_linear.cpp)
  at::Tensor w, scale;
  std::optional<at::Tensor> bias;
  int64_t n, group;
};

struct PlanLayer {
  PlanLinear qkv, o, gate_up, down;
  at::Tensor pool, post_w, next_w;
  std::optional<at::Tensor> q_index, out_index;
  int64_t heads, kv_heads;
  double scale, post_eps, next_eps;
};

at::Tensor run_linear(const PlanLinear& l, const at::Tensor& x) {
  if (l.kind == 0) return tpserve::f32_linear(x, l.w, l.bias, l.n);
  at::Tensor y = l.kind == 1   ? tpserve::int8_linear(x, l.w, l.scale)
                 : l.kind == 2 ? tpserve::int4_linear(x, l.w, l.scale, l.group, l.n)
                               : tpserve::bf16_linear(x, l.w, l.n);
  if (l.bias.has_value()) y.add_(*l.bias);
  return y;
}

struct DecodeLayers : torch::CustomClassHolder {
  std::vector<PlanLinear> pending;
  std::vector<PlanLayer> layers;

  void add_linear(int64_t kind, at::Tensor w, at::Tensor scale, std::optional<at::Tensor> bias, int64_t n,
                  int64_t group) {
    TORCH_CHECK(kind >= 0 && kind <= 3 && pending.size() < 4, "DecodeLayers.add_linear: kind 0-3, 4 per layer");
    pending.push_back(PlanLinear{kind, std::move(w), std::move(scale), std::move(bias), n, group});
  }

  // after the layer's four linears, in order: qkv, o, gate_up, down
  void add_layer(at::Tensor pool, std::optional<at::Tensor> q_index, std::optional<at::Tensor> out_index,
                 int64_t heads, int64_t kv_heads, double scale, at::Tensor post_w, double post_eps, at::Tensor next_w,
                 double next_eps) {
    TORCH_CHECK(pending.size() == 4, "DecodeLayers.add_layer: add the layer's 4 linears first");
    layers.push_back(PlanLayer{pending[0], pending[1], pending[2], pending[3], std::move(pool), std::move(post_w),
                               std::move(next_w), std::move(q_index), std::move(out_index), heads, kv_heads, scale,
                               post_eps, next_eps});
    pending.clear();
  }

  int64_t size() const { return static_cast<int64_t>(layers.size()); }
};

at::Tensor decode_layers(const c10::intrusive_ptr<DecodeLayers>& plan, at::Tensor h, at::Tensor x,
                         const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                         const at::Tensor& table, const at::Tensor& lens, int64_t window) {
  const int64_t n = h.size(0);
  for (const PlanLayer& l : plan->layers) {
    const at::Tensor qkv = run_linear(l.qkv, x);
    at::Tensor o = decode_attention(qkv, cos, sin, l.pool, slots, table, lens, l.q_index, l.heads, l.kv_heads, l.scale,
                                    window);
    if (l.out_index.has_value())  // uneven GQA groups: drop the padding positions
      o = o.view({n, -1, l.pool.size(4)}).index_select(1, *l.out_index).reshape({n, -1});
    x = add_rms_norm_(h, run_linear(l.o, o), l.post_w, l.post_eps);
    const at::Tensor d = run_linear(l.down, silu_mul(run_linear(l.gate_up, x)));
    x = add_rms_norm_(h, d, l.next_w, l.next_eps);
  }
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tpserve, m) {
  m.def("decode_attention(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) pool, Tensor slots, Tensor table, "
        "Tensor lens, Tensor? q_index, int heads, int kv_heads, float scale, int window) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) h, Tensor delta, Tensor w, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.class_<DecodeLayers>("DecodeLayers")
      .def(torch::init<>())
      .def("add_linear", &DecodeLayers::add_linear)
      .def("add_layer", &DecodeLayers::add_layer)
      .def("size", &DecodeLayers::size);
  m.def("decode_layers(__torch__.torch.classes.tpserve.DecodeLayers plan, Tensor(a!) h, Tensor x, Tensor cos, "
        "Tensor sin, Tensor slots, Tensor table, Tensor lens, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(tpserve, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("silu_mul", &silu_mul);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("decode_layers", &decode_layers);
}
