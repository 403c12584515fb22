// The work between the linears of a decode layer, as a few ops (CPU, float32), for the CPU decode plan
// (sharding/cpu/decode_plan.py); and, further down, the whole step in one call (decode_layers) and an MoE layer in
// one call (MoeExperts). In torch it is ~40 small ops per layer, each a dispatch of a few microseconds on a decode
// batch of a few rows; here it is a few calls, with the same arithmetic:
//
//   decode_attention(qkv, cos, sin, pool, slots, table, lens, q_index, heads, kv_heads, scale, window[, q_norm,
//                    k_norm, qk_eps, sinks, softcap]) -> [B, P * D]
//       qkv [B, (heads + 2 kv_heads) * D]: the fused projection's output. With q_norm / k_norm ([D]), each query
//       and key head first takes its RMSNorm (Qwen 3); sinks ([heads], gpt-oss) join each head's softmax; softcap
//       (Gemma 2) caps the scores. Rotary on the first cos.size(1) dims of q and k (rotary.cpp's rotate_head:
//       transformers' formula, product by product), k and v stored at their slots in the paged cache
//       (pool [2, kv_heads, blocks, block_size, D]), then paged_decode_attention. q_index (optional, [P]): the local
//       query head of each of the P = kv_heads * group padded positions when GQA groups are uneven (attention.py
//       GroupedHeads); the caller drops the padding from the output.
//   add_rms_norm_(h, delta, w, eps) -> rms_norm(h += delta, w, eps): the residual add, in place, and the next norm.
//   silu_mul(gate_up [B, 2I], act) -> silu(gate) * up [B, I] (act 1: GELU-tanh(gate) * up, Gemma's).
//   whole_qk_norm_(qkv, q_w, k_w, heads, kv_heads, eps, clip): OLMoE's norms over the whole q and k projections.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "team_split.h"
#include "tpserve_kernels.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <omp.h>
#include <sys/mman.h>
#include <optional>
#include <vector>

namespace tpserve {  // f32_linear.cpp: the op the fast path's Python loop calls too
at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias, int64_t N);
}  // namespace tpserve

namespace {

using tpserve::rotate_head;

// rotary over the first R of a head's D dims (R < D: partial rotary, Phi-3's partial_rotary_factor, as transformers
// rotates q[..., :R] and passes the rest), the rest copied
inline void rotate_part(float* dst, const float* src, const float* c, const float* s, int64_t R, int64_t D) {
  rotate_head(dst, src, c, s, R);
  if (R < D) std::copy(src + R, src + D, dst + R);
}

// a query or key head before rotary: as it is (w null), or its RMSNorm over the head (Qwen 3's q_norm / k_norm, the
// rms_norm op's own rows: bitwise what the module computes) written to `tmp`
inline const float* norm_head(const float* head, const float* w, float eps, float* tmp, int64_t D) {
  if (w == nullptr) return head;
  tpserve::rms_norm_rows(head, w, eps, tmp, D, 0, 1);
  return tmp;
}

// OLMoE's q/k norms over one row of q|k|v: an RMSNorm over the whole query projection (heads * D, weight q_w) and one
// over the whole key projection (kv_heads * D, k_w), in place; then, with clip > 0, q, k and v clamped to
// [-clip, clip] (clip_qkv)
inline void whole_qk_norm_row(float* row, const float* q_w, const float* k_w, float eps, float clip, int64_t heads,
                              int64_t kv_heads, int64_t D) {
  tpserve::rms_norm_rows(row, q_w, eps, row, heads * D, 0, 1);
  tpserve::rms_norm_rows(row + heads * D, k_w, eps, row + heads * D, kv_heads * D, 0, 1);
  if (clip > 0.f) {
    const int64_t n = (heads + 2 * kv_heads) * D;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) row[i] = row[i] > clip ? clip : row[i] < -clip ? -clip : row[i];
  }
}

// whole_qk_norm_(qkv [B, (heads + 2 kv_heads) * D], q_w [heads * D], k_w [kv_heads * D], ...) -> qkv, in place
at::Tensor whole_qk_norm_(at::Tensor qkv, const at::Tensor& q_w, const at::Tensor& k_w, int64_t heads,
                          int64_t kv_heads, double eps, double clip) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.is_contiguous() && heads > 0 && kv_heads > 0 &&
                  qkv.size(1) % (heads + 2 * kv_heads) == 0,
              "whole_qk_norm_: qkv [B, (heads + 2 kv_heads) * head_dim] float32, contiguous");
  const int64_t D = qkv.size(1) / (heads + 2 * kv_heads);
  TORCH_CHECK(q_w.scalar_type() == at::kFloat && k_w.scalar_type() == at::kFloat && q_w.is_contiguous() &&
                  k_w.is_contiguous() && q_w.numel() == heads * D && k_w.numel() == kv_heads * D,
              "whole_qk_norm_: float32 weights [heads * head_dim] and [kv_heads * head_dim]");
  float* p = qkv.data_ptr<float>();
  for (int64_t b = 0; b < qkv.size(0); ++b)
    whole_qk_norm_row(p + b * qkv.size(1), q_w.data_ptr<float>(), k_w.data_ptr<float>(), static_cast<float>(eps),
                      static_cast<float>(clip), heads, kv_heads, D);
  return qkv;
}

at::Tensor decode_attention(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor pool,
                            const at::Tensor& slots, const at::Tensor& table, const at::Tensor& lens,
                            const std::optional<at::Tensor>& q_index, int64_t heads, int64_t kv_heads, double scale,
                            int64_t window, const std::optional<at::Tensor>& q_norm,
                            const std::optional<at::Tensor>& k_norm, double qk_eps,
                            const std::optional<at::Tensor>& sinks, double softcap) {
  TORCH_CHECK(qkv.dim() == 2 && pool.dim() == 5 && cos.dim() == 2 && sin.dim() == 2 && slots.dim() == 1,
              "decode_attention: shapes");
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && pool.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && slots.scalar_type() == at::kLong,
              "decode_attention: float32 activations and cache, int64 slots");
  const int64_t B = qkv.size(0), D = pool.size(4), per_head = pool.size(2) * pool.size(3);
  TORCH_CHECK(pool.size(0) == 2 && pool.size(1) == kv_heads && qkv.size(1) == (heads + 2 * kv_heads) * D &&
                  cos.size(0) == B && cos.size(1) <= D && cos.size(1) % 2 == 0 && sin.sizes() == cos.sizes() &&
                  slots.size(0) == B && D % 2 == 0,
              "decode_attention: sizes do not match");
  const int64_t R = cos.size(1);  // the rotated dims of each head
  TORCH_CHECK(qkv.is_contiguous() && pool.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() &&
                  slots.is_contiguous(),
              "decode_attention: layout");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value() &&
                  (!q_norm.has_value() ||
                   (q_norm->dim() == 1 && q_norm->size(0) == D && q_norm->scalar_type() == at::kFloat &&
                    q_norm->is_contiguous() && k_norm->sizes() == q_norm->sizes() &&
                    k_norm->scalar_type() == at::kFloat && k_norm->is_contiguous())),
              "decode_attention: q_norm and k_norm both or neither, float32 [head_dim]");
  const float* qn = q_norm.has_value() ? q_norm->data_ptr<float>() : nullptr;
  const float* kn = k_norm.has_value() ? k_norm->data_ptr<float>() : nullptr;
  const float eps = static_cast<float>(qk_eps);
  std::vector<float> normed(qn ? D : 0);
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
    const float* c = cp + b * R;
    const float* s = sp + b * R;
    for (int64_t p = 0; p < P; ++p) {
      const int64_t h = qi ? qi[p] : p;
      TORCH_CHECK(h >= 0 && h < heads, "decode_attention: q_index out of range");
      rotate_part(qp + (b * P + p) * D, norm_head(row + h * D, qn, eps, normed.data(), D), c, s, R, D);
    }
    TORCH_CHECK(slot[b] >= 0 && slot[b] < per_head, "decode_attention: slot out of range");
    for (int64_t h = 0; h < kv_heads; ++h) {
      rotate_part(kc + (h * per_head + slot[b]) * D, norm_head(row + (heads + h) * D, kn, eps, normed.data(), D), c, s,
                  R, D);
      const float* v = row + (heads + kv_heads + h) * D;
      std::copy(v, v + D, vc + (h * per_head + slot[b]) * D);
    }
  }
  std::optional<at::Tensor> sk;  // per padded query position [P] -> laid out as the grouped queries
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == heads && sinks->scalar_type() == at::kFloat,
                "decode_attention: sinks float32 [heads]");
    sk = qi ? sinks->index_select(0, qic) : sinks->contiguous();
  }
  return tpserve::paged_decode_attention(q, pool, table, lens, scale, window, sk, softcap).view({B, P * D});
}

// exp(z) with z capped at 88 (exp(88) ~ 1.7e38): the build's -ffast-math assumes no infinities, and the vectorized
// exp of a larger z (a gate below -88 in a sigmoid) gave NaN where torch gives 0; capped, x / (1 + exp(z)) is a
// vanishing number instead, and nothing changes below the cap
inline float exp_capped(float z) { return std::exp(z < 88.f ? z : 88.f); }

// the residual add and SiLU(gate) * up of one row: one definition for the ops and decode_layers (bitwise the same)
inline void add_row(float* h, const float* d, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) h[i] += d[i];
}

inline void silu_mul_row(const float* gate, const float* up, float* o, int64_t I) {
#pragma omp simd
  for (int64_t i = 0; i < I; ++i) o[i] = gate[i] / (1.f + exp_capped(-gate[i])) * up[i];
}

// GELU (tanh approximation: transformers' gelu_pytorch_tanh and gelu_new) of the gate times up, one row (Gemma)
inline void gelu_tanh_mul_row(const float* gate, const float* up, float* o, int64_t I) {
  constexpr float k0 = 0.7978845608028654f, k1 = 0.044715f;  // sqrt(2 / pi)
#pragma omp simd
  for (int64_t i = 0; i < I; ++i) {
    const float g = gate[i];
    o[i] = 0.5f * g * (1.f + std::tanh(k0 * (g + k1 * g * g * g))) * up[i];
  }
}

// the dense MLP's activation of one row of gate|up: 0 SiLU(gate) * up, 1 GELU-tanh(gate) * up
inline void act_mul_row(int64_t act, const float* gate, const float* up, float* o, int64_t I) {
  if (act == 1)
    gelu_tanh_mul_row(gate, up, o, I);
  else
    silu_mul_row(gate, up, o, I);
}

// gpt-oss's expert activation (transformers' GptOssExperts._apply_gate) of one row
inline void clamped_swiglu_row(const float* gate, const float* up, float* o, int64_t I, float alpha, float limit) {
#pragma omp simd
  for (int64_t i = 0; i < I; ++i) {
    const float g = gate[i] > limit ? limit : gate[i];
    const float u = up[i] > limit ? limit : up[i] < -limit ? -limit : up[i];
    o[i] = (u + 1.f) * (g / (1.f + exp_capped(-g * alpha)));
  }
}

at::Tensor add_rms_norm_(at::Tensor h, const at::Tensor& delta, const at::Tensor& w, double eps) {
  TORCH_CHECK(h.dim() == 2 && delta.sizes() == h.sizes() && h.scalar_type() == at::kFloat &&
                  delta.scalar_type() == at::kFloat && h.is_contiguous(),
              "add_rms_norm_: h and delta [M, D] float32, h contiguous");
  const at::Tensor dc = delta.contiguous();
  float* hp = h.data_ptr<float>();
  const float* dp = dc.data_ptr<float>();
  const int64_t D = h.size(1);
  for (int64_t r = 0; r < h.size(0); ++r) add_row(hp + r * D, dp + r * D, D);
  return tpserve::rms_norm(h, w, eps);
}

at::Tensor silu_mul(const at::Tensor& gate_up, int64_t act) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.scalar_type() == at::kFloat,
              "silu_mul: gate_up [M, 2I] float32");
  TORCH_CHECK(act == 0 || act == 1, "silu_mul: act 0 (SiLU) or 1 (GELU, tanh approximation)");
  const at::Tensor g = gate_up.contiguous();
  const int64_t M = g.size(0), I = g.size(1) / 2;
  at::Tensor out = at::empty({M, I}, g.options());
  const float* gp = g.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) act_mul_row(act, gp + m * 2 * I, gp + m * 2 * I + I, op + m * I, I);
  return out;
}


// argmax_rows(logits [B, V] float32) -> [B] int64: torch.argmax(logits, -1) (the first maximal value; a NaN counts as
// the maximum, as torch's does), for greedy sampling. torch's CPU argmax reads a 49,152-wide row at ~4.5 GB/s (44 us
// per decode step); this is one vectorized max pass and one compare pass over the row (core/argmax.cpp).
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.size(1) > 0,
              "argmax_rows: float32 logits [B, V], V > 0");
  const at::Tensor lc = logits.contiguous();
  const int64_t B = lc.size(0), V = lc.size(1);
  at::Tensor out = at::empty({B}, lc.options().dtype(at::kLong));
  const float* lp = lc.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) op[b] = tpserve::argmax_row(lp + b * V, V);
  return out;
}

// ---- the whole decode step of a model's layers in one call (TP=1) ---------------------------------------------------
// DecodeLayers holds, once, what each layer needs (its four linears with their kernels, norms, cache pool, heads);
// decode_layers(plan, h, x, ...) then runs every layer in one OpenMP team: each thread takes its share of each phase
// (the output blocks of a linear, the (sequence, KV head) pairs of attention, the rows of a norm) and the team meets
// at a barrier between phases. Against one op per phase (fork-join of the thread team, a tensor allocated, the
// dispatcher, and the Python loop between ops), the other threads no longer idle through the single-threaded glue
// and a linear starts without waking a team. The residual stream h is updated in place; the result is the final
// norm's output. The kernels are the ops' own (tpserve_kernels.h): the same arithmetic, bitwise.

struct PlanLinear {
  int64_t kind;  // 0 float32 (f32_linear.cpp), 1 int8, 2 int4, 3 bf16 (quant_linear.cpp), 4 GGUF blocks (`group`:
                 // the KQuant type; core/kquant_linear.cpp), 5 parts of several kinds side by side (`parts`)
  at::Tensor w, scale;
  std::optional<at::Tensor> bias;
  int64_t n, group, k, blocks;
  // kind 5 (a fused linear whose pieces are stored in different types, e.g. a GGUF file's Q4_K q/k and Q6_K v): the
  // parts in output order, each with its own blocks; block b of the whole is block b - first[p] of part p
  std::vector<PlanLinear> parts;
  std::vector<int64_t> first, col;  // per part: its first block in the whole, its first output column
};

// One LoRA adapter of one linear (sharding/layers/lora.py): A^T [K, R] and B^T * scale [R, N], float32 or bfloat16
// (as sharding/layers/lora.py holds them: bfloat16 over a quantized base), copied into the
// order the step reads them: A^T as panels of 16 of its R columns ([ceil(R/16)][K][16], zero-padded), so the shrink
// streams each panel in order; B^T by chunks of 16 output columns, each chunk holding only the rows of B^T that can
// be nonzero there ([j0, j1): a fused linear's B^T is block-diagonal over its pieces, and its zero blocks are neither
// stored nor read), [j1 - j0][16] contiguous.
// Memory for the adapters' panels and chunks (DecodeLayers::set_lora), in 2 MiB-aligned anonymous mappings advised
// MADV_HUGEPAGE. A step reads each linear's adapters as a few short streams of a few KiB per thread, and in 4 KiB
// pages (std::vector's) the hardware prefetchers stop at every page boundary and each page costs a TLB walk; the base
// weights are in huge pages for the same reason (sharding/cpu/hugepages.py). Measured with the tiles below on SmolLM2
// int8, rank-16 adapters on every linear, Zen 5: ~0.5 -> ~0.43 ms a token over the base. Freed with the plan.
class LoraArena {
 public:
  LoraArena() = default;
  LoraArena(const LoraArena&) = delete;
  LoraArena& operator=(const LoraArena&) = delete;
  ~LoraArena() {
    for (const auto& [p, n] : maps_) munmap(p, n);
  }

  bool huge = true;  // advise huge pages (off: TPSERVE_HUGE_PAGES=0, or a host without them; sharding/cpu/hugepages.py)

  template <typename W>
  W* take(int64_t n) {  // n zeroed elements, 64-byte aligned
    const size_t bytes = (static_cast<size_t>(n) * sizeof(W) + 63) / 64 * 64;
    if (bytes > left_) {
      constexpr size_t HUGE = size_t{2} << 20;
      const size_t want = std::max(bytes, size_t{16} << 20) / HUGE * HUGE + HUGE;
      void* p = mmap(nullptr, want + HUGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      TORCH_CHECK(p != MAP_FAILED, "set_lora: could not map ", want >> 20, " MiB for the adapters");
      maps_.emplace_back(p, want + HUGE);
      char* start = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(p) + HUGE - 1) / HUGE * HUGE);
#ifdef MADV_HUGEPAGE
      if (huge) madvise(start, want, MADV_HUGEPAGE);  // (advice: where huge pages are off, 4 KiB pages serve)
#endif
      cur_ = start;
      left_ = want;
    }
    W* out = reinterpret_cast<W*>(cur_);
    cur_ += bytes;
    left_ -= bytes;
    return out;  // (fresh anonymous memory reads as zeros)
  }

 private:
  std::vector<std::pair<void*, size_t>> maps_;
  char* cur_ = nullptr;
  size_t left_ = 0;
};

constexpr int64_t LORA_W = 16;

inline float lora_w(float v) { return v; }
inline float lora_w(uint16_t v) { return std::bit_cast<float>(static_cast<uint32_t>(v) << 16); }  // bfloat16

struct PlanLora {
  const float *ap = nullptr, *bp = nullptr;        // A^T in panels, B^T in chunks: float32 (over a float32 base)
  const uint16_t *aph = nullptr, *bph = nullptr;   // or in bfloat16 (over a quantized or bfloat16 base: half the bytes)
  bool half = false;                               // which of the two
  int64_t r = 0, rp = 0;            // rank (sum of the pieces' ranks) and rank padded to a multiple of 16
  std::vector<int32_t> cj0, cj1;  // per chunk of 16 output columns: the rows of B^T that can be nonzero there
  std::vector<int64_t> coff;      // per chunk: where its rows start in bp
};


// A linear as the compiled steps run it (kind 0 float32 in blocks of 32 columns, 1 int8, 2 int4, 3 bf16), checked
PlanLinear make_plan_linear(int64_t kind, at::Tensor w, at::Tensor scale, std::optional<at::Tensor> bias, int64_t n,
                            int64_t group) {
  TORCH_CHECK(w.dim() >= 2 && w.is_contiguous() && n > 0, "add_linear: a contiguous weight");
  int64_t k = 0, blocks = w.size(0);
  if (kind == 0) {
    TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kFloat && w.size(2) == tpserve::F32_BLOCK &&
                    blocks == (n + tpserve::F32_BLOCK - 1) / tpserve::F32_BLOCK,
                "add_linear: float32 weights [ceil(n/32), K, 32]");
    k = w.size(1);
  } else if (kind == 4) {  // GGUF block types (core/kquant_linear.cpp): `group` is the KQuant type
    TORCH_CHECK(tpserve::kq_valid(group) && w.dim() == 2 && w.scalar_type() == at::kByte &&
                    scale.scalar_type() == at::kByte && scale.dim() == 2 && scale.is_contiguous() &&
                    blocks == (n + tpserve::VNNI_BLOCK - 1) / tpserve::VNNI_BLOCK && scale.size(0) == blocks &&
                    w.size(1) % tpserve::kq_chunk_bytes(group) == 0,
                "add_linear: GGUF block weights [ceil(n/16), K/32 chunks], scales [ceil(n/16), ...]");
    k = w.size(1) / tpserve::kq_chunk_bytes(group) * 32;
    TORCH_CHECK(k % tpserve::kq_super(group) == 0 &&
                    scale.size(1) == k / tpserve::kq_super(group) * tpserve::kq_scale_bytes(group),
                "add_linear: GGUF block scales");
  } else {
    const int64_t rb = kind == 3 ? tpserve::bf16_rows() : tpserve::int_rows();  // rows per block
    TORCH_CHECK(w.dim() == 2 && blocks == (n + rb - 1) / rb,
                "add_linear: packed weights [ceil(n/rows), rows x row bytes]");
    if (kind == 1) {
      k = w.size(1) / rb;
      TORCH_CHECK(w.scalar_type() == at::kChar && scale.scalar_type() == at::kHalf && k % 32 == 0 &&
                      scale.dim() == 3 && scale.size(0) == blocks && scale.size(1) == k / 32 &&
                      scale.size(2) == rb && scale.is_contiguous(),
                  "add_linear: int8 weights with float16 scales [ceil(n/rows), K/32, rows]");
    } else if (kind == 2) {
      k = w.size(1) * 2 / rb;
      TORCH_CHECK(w.scalar_type() == at::kByte && scale.scalar_type() == at::kHalf && group > 0 && group % 32 == 0 &&
                      k % group == 0 && scale.dim() == 3 && scale.size(0) == blocks &&
                      scale.size(1) == k / group && scale.size(2) == rb && scale.is_contiguous(),
                  "add_linear: int4 weights with float16 scales [ceil(n/rows), K/group, rows]");
    } else {
      TORCH_CHECK(kind == 3 && w.scalar_type() == at::kByte, "add_linear: kind 0-3");
      k = w.size(1) / (2 * rb);
      TORCH_CHECK(k % 16 == 0, "add_linear: bf16 inputs a multiple of 16");
    }
  }
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n && bias->is_contiguous(),
                "add_linear: float32 bias [n]");
  return PlanLinear{kind, std::move(w), std::move(scale), std::move(bias), n, group, k, blocks};
}

// A linear made of parts of different kinds, concatenated by output rows (kind 5)
PlanLinear make_mixed_linear(const std::vector<int64_t>& kinds, const std::vector<at::Tensor>& ws,
                             const std::vector<at::Tensor>& scales, const std::vector<int64_t>& ns,
                             const std::vector<int64_t>& groups, std::optional<at::Tensor> bias) {
  const size_t P = kinds.size();
  TORCH_CHECK(P >= 1 && ws.size() == P && scales.size() == P && ns.size() == P && groups.size() == P,
              "add_mixed_linear: one kind, weight, scale, size and group per part");
  PlanLinear l{5, at::Tensor(), at::Tensor(), std::move(bias), 0, 0, 0, 0, {}, {}, {}};
  for (size_t p = 0; p < P; ++p) {
    TORCH_CHECK(kinds[p] >= 0 && kinds[p] <= 4, "add_mixed_linear: parts of kinds 0-4");
    l.parts.push_back(make_plan_linear(kinds[p], ws[p], scales[p], std::nullopt, ns[p], groups[p]));
    TORCH_CHECK(l.parts[p].k == l.parts[0].k, "add_mixed_linear: parts of one input size");
    l.first.push_back(l.blocks);
    l.col.push_back(l.n);
    l.blocks += l.parts[p].blocks;
    l.n += ns[p];
  }
  l.k = l.parts[0].k;
  if (l.bias.has_value())
    TORCH_CHECK(l.bias->scalar_type() == at::kFloat && l.bias->numel() == l.n && l.bias->is_contiguous(),
                "add_mixed_linear: float32 bias [n]");
  return l;
}

// the bytes of weights (and scales) in one output block of a linear
int64_t block_bytes(const PlanLinear& l) {
  if (l.blocks == 0) return 1;
  int64_t bytes = 0;
  for (const PlanLinear& p : l.parts) bytes += p.w.nbytes() + (p.scale.defined() ? p.scale.nbytes() : 0);
  if (l.w.defined()) bytes += l.w.nbytes() + (l.scale.defined() ? l.scale.nbytes() : 0);
  return std::max<int64_t>(1, bytes / l.blocks);
}

// ---- the grouped experts of an MoE layer (sharding/layers/moe.py) ---------------------------------------------------
// MoeExperts holds one MoE layer's experts on this rank (their gate/up and down linears with their kernels, the
// activation) and, optionally, its router and routing. Three ways to run it, all through the same functions below
// (moe_route, moe_group, moe_run):
// - moe_experts(plan, x [M, H], ids [M, k], weights [M, k]) -> out [M, H]: routed elsewhere (torch);
// - moe_forward(plan, x [M, H], counts) -> out [M, H]: the router and routing too (the plan's set_router);
// - inside decode_layers, as an MoE layer's feed-forward (DecodeLayers.add_moe_layer).
// For each expert of the plan that a row was routed to: gate/up -> SiLU(gate) * up (or the plan's clamped SwiGLU)
// -> down over the rows routed to it (each expert's weights read once per call, whatever its row count), then
// out[m] = sum over m's experts, in expert order, of weight * expert(x[m]). Experts not in the plan (another rank's,
// under expert parallelism) are skipped. One OpenMP team through every phase: the rows gathered, each phase's work
// (the active experts' output blocks) split over the threads, barriers between.

struct MoeExperts : torch::CustomClassHolder {
  std::vector<int64_t> index;  // the global expert id of each local expert, ascending
  std::vector<PlanLinear> gate_up, down;
  // the activation of gate|up: 0 SiLU(gate) * up; 1 gpt-oss's clamped SwiGLU, gate clamped above at `limit`, up to
  // [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate)
  int64_t act = 0;
  float alpha = 1.f, limit = 0.f;
  // the router (float32 logits over every expert: moe.py's ReplicatedLinear) and its routing (moe.py's Routing):
  // the top_k experts by logit; their weights a softmax over all experts (renormalised to sum 1 over the k when
  // `renormalize`), or, `topk_softmax`, a softmax over the k logits alone
  std::optional<PlanLinear> router;
  int64_t top_k = 0;
  bool renormalize = false, topk_softmax = false;
  // a shared expert (Qwen 2-MoE: set_shared): a dense SiLU MLP over every row (this rank's slice of it), its output
  // scaled by sigmoid(shared_gate(x)) where it has that gate (float32, one output), added after the routed sum
  std::optional<PlanLinear> shared_gate_up, shared_down, shared_gate;

  void set_activation(int64_t kind, double alpha_, double limit_) {
    TORCH_CHECK(kind == 0 || kind == 1, "MoeExperts.set_activation: kind 0 (SiLU) or 1 (clamped SwiGLU)");
    act = kind;
    alpha = static_cast<float>(alpha_);
    limit = static_cast<float>(limit_);
  }

  void add_expert(int64_t id, int64_t kind, at::Tensor w, at::Tensor scale, std::optional<at::Tensor> bias, int64_t n,
                  int64_t group, int64_t kind2, at::Tensor w2, at::Tensor scale2, std::optional<at::Tensor> bias2,
                  int64_t n2, int64_t group2) {
    TORCH_CHECK(index.empty() || id > index.back(), "MoeExperts.add_expert: ascending expert ids");
    TORCH_CHECK(id >= 0 && (!router.has_value() || id < router->n), "MoeExperts.add_expert: an id the router scores");
    PlanLinear gu = make_plan_linear(kind, std::move(w), std::move(scale), std::move(bias), n, group);
    PlanLinear dn = make_plan_linear(kind2, std::move(w2), std::move(scale2), std::move(bias2), n2, group2);
    TORCH_CHECK(gu.n % 2 == 0 && dn.k == gu.n / 2 && dn.n == gu.k, "MoeExperts.add_expert: shapes do not chain");
    TORCH_CHECK(gate_up.empty() || (gu.k == gate_up[0].k && gu.n == gate_up[0].n),
                "MoeExperts.add_expert: experts of one shape");
    index.push_back(id);
    gate_up.push_back(std::move(gu));
    down.push_back(std::move(dn));
  }

  // after the experts: the router, a float32 linear (kind 0) with one output per expert of the model
  void set_router(int64_t kind, at::Tensor w, at::Tensor scale, std::optional<at::Tensor> bias, int64_t n,
                  int64_t group, int64_t k, bool renormalize_, bool topk_softmax_) {
    TORCH_CHECK(kind == 0, "MoeExperts.set_router: a float32 router");
    TORCH_CHECK(!index.empty(), "MoeExperts.set_router: add the experts first");
    PlanLinear r = make_plan_linear(kind, std::move(w), std::move(scale), std::move(bias), n, group);
    TORCH_CHECK(r.k == gate_up[0].k && index.back() < r.n, "MoeExperts.set_router: one logit per expert of the inputs");
    TORCH_CHECK(k >= 1 && k <= r.n, "MoeExperts.set_router: top_k between 1 and the expert count");
    router = std::move(r);
    top_k = k;
    renormalize = renormalize_;
    topk_softmax = topk_softmax_;
  }

  // after the experts: the shared expert's gate/up and down linears, and its gate (kind 0, one output) or None
  void set_shared(int64_t kind, at::Tensor w, at::Tensor scale, std::optional<at::Tensor> bias, int64_t n,
                  int64_t group, int64_t kind2, at::Tensor w2, at::Tensor scale2, std::optional<at::Tensor> bias2,
                  int64_t n2, int64_t group2, std::optional<at::Tensor> gate_w, std::optional<at::Tensor> gate_bias) {
    TORCH_CHECK(!index.empty(), "MoeExperts.set_shared: add the experts first");
    PlanLinear gu = make_plan_linear(kind, std::move(w), std::move(scale), std::move(bias), n, group);
    PlanLinear dn = make_plan_linear(kind2, std::move(w2), std::move(scale2), std::move(bias2), n2, group2);
    TORCH_CHECK(gu.k == hidden() && gu.n % 2 == 0 && dn.k == gu.n / 2 && dn.n == hidden(),
                "MoeExperts.set_shared: a dense MLP of the experts' hidden size");
    if (gate_w.has_value()) {
      PlanLinear g = make_plan_linear(0, std::move(*gate_w), at::empty({0}), std::move(gate_bias), 1, 0);
      TORCH_CHECK(g.k == hidden(), "MoeExperts.set_shared: a gate over the hidden size");
      shared_gate = std::move(g);
    }
    shared_gate_up = std::move(gu);
    shared_down = std::move(dn);
  }

  int64_t size() const { return static_cast<int64_t>(index.size()); }
  int64_t hidden() const { return gate_up[0].k; }
  int64_t shared_inter() const { return shared_gate_up.has_value() ? shared_gate_up->n / 2 : 0; }
  int64_t inter() const { return gate_up[0].n / 2; }
};

struct PlanLayer {
  PlanLinear qkv, o, gate_up, down;
  at::Tensor pool, post_w, next_w;
  int64_t heads, kv_heads;
  double scale, post_eps, next_eps;
  std::vector<PlanLora> lora[4];  // per linear (qkv, o, gate_up, down), by adapter slot (r == 0: none)
  std::optional<at::Tensor> q_norm, k_norm;  // per-head RMSNorms of queries and keys before rotary (Qwen 3), or none
  double qk_eps = 0.0;
  // an MoE layer's feed-forward (add_moe_layer: gate_up and down unused), and the expert-token counts to add to
  c10::intrusive_ptr<MoeExperts> moe;
  std::optional<at::Tensor> counts;
  int64_t window = 0;                // the layer's own sliding window (0: the step's)
  std::optional<at::Tensor> sinks;   // one logit per query head in each softmax's denominator (gpt-oss), or none
  double softcap = 0.0;              // tanh soft-capping of the attention scores (Gemma 2), 0: none
  int64_t act = 0;                   // the dense MLP's activation (act_mul_row): 0 SiLU, 1 GELU-tanh (Gemma)
  // RMSNorms of the attention's and the feed-forward's outputs before each residual add (Gemma 2), or none
  std::optional<at::Tensor> attn_out_w, ffn_out_w;
  double attn_out_eps = 0.0, ffn_out_eps = 0.0;
  // RMSNorms over the whole query and key projections, and clip_qkv (OLMoE: whole_qk_norm_row), or none
  std::optional<at::Tensor> q_whole_w, k_whole_w;
  double whole_eps = 0.0, clip = 0.0;
};

struct DecodeLayers : torch::CustomClassHolder {
  std::vector<PlanLinear> pending;
  std::vector<PlanLayer> layers;
  int64_t lora_rp = 0;  // the widest padded adapter rank set (the shrink's scratch per row)
  LoraArena arena;      // the adapters' panels and chunks

  void add_linear(int64_t kind, at::Tensor w, at::Tensor scale, std::optional<at::Tensor> bias, int64_t n,
                  int64_t group) {
    TORCH_CHECK(pending.size() < 4, "DecodeLayers.add_linear: 4 per layer");
    pending.push_back(make_plan_linear(kind, std::move(w), std::move(scale), std::move(bias), n, group));
  }

  void add_mixed_linear(std::vector<int64_t> kinds, std::vector<at::Tensor> ws, std::vector<at::Tensor> scales,
                        std::vector<int64_t> ns, std::vector<int64_t> groups, std::optional<at::Tensor> bias) {
    TORCH_CHECK(pending.size() < 4, "DecodeLayers.add_mixed_linear: 4 per layer");
    pending.push_back(make_mixed_linear(kinds, ws, scales, ns, groups, std::move(bias)));
  }

  // after the layer's four linears, in order: qkv, o, gate_up, down (uniform GQA groups: query head p reads KV head
  // p / (heads / kv_heads))
  void add_layer(at::Tensor pool, int64_t heads, int64_t kv_heads, double scale, at::Tensor post_w, double post_eps,
                 at::Tensor next_w, double next_eps) {
    TORCH_CHECK(pending.size() == 4, "DecodeLayers.add_layer: add the layer's 4 linears first");
    const PlanLinear &gu = pending[2], &down = pending[3];
    const int64_t hidden = pending[0].k;
    TORCH_CHECK(gu.k == hidden && gu.n % 2 == 0 && down.k == gu.n / 2 && down.n == hidden,
                "DecodeLayers.add_layer: the linears' shapes do not chain");
    push(std::move(pool), heads, kv_heads, scale, std::move(post_w), post_eps, std::move(next_w), next_eps);
  }

  // an MoE layer, after its two attention linears (qkv, o): its feed-forward is `moe` (with its router: set_router),
  // `counts` ([experts] int64, or None) counts every routed token's experts
  void add_moe_layer(c10::intrusive_ptr<MoeExperts> moe, std::optional<at::Tensor> counts, at::Tensor pool,
                     int64_t heads, int64_t kv_heads, double scale, at::Tensor post_w, double post_eps,
                     at::Tensor next_w, double next_eps) {
    TORCH_CHECK(pending.size() == 2, "DecodeLayers.add_moe_layer: add the layer's 2 attention linears first");
    TORCH_CHECK(moe->size() > 0 && moe->router.has_value() && moe->hidden() == pending[0].k,
                "DecodeLayers.add_moe_layer: experts of the layer's hidden size, with their router");
    TORCH_CHECK(!counts.has_value() || (counts->dim() == 1 && counts->size(0) == moe->router->n &&
                                        counts->scalar_type() == at::kLong && counts->is_contiguous()),
                "DecodeLayers.add_moe_layer: counts [experts] int64");
    pending.resize(4);  // (gate_up and down unused)
    push(std::move(pool), heads, kv_heads, scale, std::move(post_w), post_eps, std::move(next_w), next_eps);
    layers.back().moe = std::move(moe);
    layers.back().counts = std::move(counts);
  }

  void push(at::Tensor pool, int64_t heads, int64_t kv_heads, double scale, at::Tensor post_w, double post_eps,
            at::Tensor next_w, double next_eps) {
    const PlanLinear &qkv = pending[0], &o = pending[1];
    TORCH_CHECK(pool.dim() == 5 && pool.scalar_type() == at::kFloat && pool.is_contiguous() && pool.size(0) == 2 &&
                    pool.size(1) == kv_heads && kv_heads > 0 && heads % kv_heads == 0,
                "DecodeLayers.add_layer: cache pool [2, kv_heads, blocks, block_size, head_dim], even groups");
    const int64_t D = pool.size(4), hidden = qkv.k;
    TORCH_CHECK(D % 2 == 0 && qkv.n == (heads + 2 * kv_heads) * D && o.k == heads * D && o.n == hidden,
                "DecodeLayers.add_layer: the attention linears' shapes do not chain");
    TORCH_CHECK(post_w.scalar_type() == at::kFloat && next_w.scalar_type() == at::kFloat && post_w.is_contiguous() &&
                    next_w.is_contiguous() && post_w.numel() == hidden && next_w.numel() == hidden,
                "DecodeLayers.add_layer: float32 norm weights [hidden]");
    TORCH_CHECK(layers.empty() || layers[0].qkv.k == hidden, "DecodeLayers.add_layer: one hidden size");
    layers.push_back(PlanLayer{pending[0], pending[1], pending[2], pending[3], std::move(pool), std::move(post_w),
                               std::move(next_w), heads, kv_heads, scale, post_eps, next_eps});
    pending.clear();
  }

  // the per-head RMSNorms (weights [head_dim] float32) of the last added layer's queries and keys, before rotary
  void set_qk_norm(at::Tensor q_w, at::Tensor k_w, double eps) {
    TORCH_CHECK(!layers.empty(), "DecodeLayers.set_qk_norm: add the layer first");
    PlanLayer& l = layers.back();
    const int64_t D = l.pool.size(4);
    TORCH_CHECK(q_w.dim() == 1 && q_w.size(0) == D && q_w.scalar_type() == at::kFloat && q_w.is_contiguous() &&
                    k_w.sizes() == q_w.sizes() && k_w.scalar_type() == at::kFloat && k_w.is_contiguous(),
                "DecodeLayers.set_qk_norm: float32 weights [head_dim]");
    l.q_norm = std::move(q_w);
    l.k_norm = std::move(k_w);
    l.qk_eps = eps;
  }

  // the last added layer's own sliding window (> 0; 0: the step's) and attention sinks (float32 [heads], or None)
  void set_attention(int64_t window, std::optional<at::Tensor> sinks, double softcap) {
    TORCH_CHECK(!layers.empty(), "DecodeLayers.set_attention: add the layer first");
    PlanLayer& l = layers.back();
    TORCH_CHECK(window >= 0 && softcap >= 0.0, "DecodeLayers.set_attention: a window >= 0, a softcap >= 0");
    TORCH_CHECK(!sinks.has_value() || (sinks->dim() == 1 && sinks->size(0) == l.heads &&
                                       sinks->scalar_type() == at::kFloat && sinks->is_contiguous()),
                "DecodeLayers.set_attention: sinks float32 [heads]");
    l.window = window;
    l.sinks = std::move(sinks);
    l.softcap = softcap;
  }

  // The step's two ends, for decode_step: the token embedding table ([vocab, hidden] float32, bfloat16 or float16;
  // its rows widened to float32, exactly, as the embedding module's lookup and cast do; none: the step is given the
  // looked-up rows), the first layer's input RMSNorm (float32 [hidden]), and the LM head: the one linear added after
  // the last layer (add_linear or add_mixed_linear), over the hidden size
  at::Tensor embedding, first_w;
  double first_eps = 0.0;
  std::optional<PlanLinear> head;

  void set_ends(std::optional<at::Tensor> table, at::Tensor first_norm_w, double first_norm_eps) {
    TORCH_CHECK(!layers.empty() && pending.size() == 1,
                "DecodeLayers.set_ends: add the layers, then the LM head's linear");
    const int64_t hidden = layers[0].qkv.k;
    const auto dt = table.has_value() ? table->scalar_type() : at::kFloat;
    TORCH_CHECK(!table.has_value() ||
                    (table->dim() == 2 && table->size(0) > 0 && table->size(1) == hidden && table->is_contiguous() &&
                     (dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf)),
                "DecodeLayers.set_ends: an embedding table [vocab, hidden] of float32, bfloat16 or float16, or None");
    TORCH_CHECK(first_norm_w.dim() == 1 && first_norm_w.size(0) == hidden &&
                    first_norm_w.scalar_type() == at::kFloat && first_norm_w.is_contiguous(),
                "DecodeLayers.set_ends: a float32 norm weight [hidden]");
    TORCH_CHECK(pending[0].k == hidden, "DecodeLayers.set_ends: an LM head over the hidden size");
    head = std::move(pending[0]);
    pending.clear();
    embedding = table.has_value() ? std::move(*table) : at::Tensor();
    first_w = std::move(first_norm_w);
    first_eps = first_norm_eps;
  }

  bool has_ends() const { return head.has_value(); }

  // the last added layer's RMSNorms over its whole query and key projections (float32 [heads * head_dim] and
  // [kv_heads * head_dim]) and the clamp of q, k, v after them (clip > 0; 0: none)
  void set_whole_qk_norm(at::Tensor q_w, at::Tensor k_w, double eps, double clip) {
    TORCH_CHECK(!layers.empty(), "DecodeLayers.set_whole_qk_norm: add the layer first");
    PlanLayer& l = layers.back();
    const int64_t D = l.pool.size(4);
    TORCH_CHECK(q_w.scalar_type() == at::kFloat && k_w.scalar_type() == at::kFloat && q_w.is_contiguous() &&
                    k_w.is_contiguous() && q_w.numel() == l.heads * D && k_w.numel() == l.kv_heads * D && clip >= 0.0,
                "DecodeLayers.set_whole_qk_norm: float32 weights [heads * head_dim], [kv_heads * head_dim]; clip >= 0");
    l.q_whole_w = std::move(q_w);
    l.k_whole_w = std::move(k_w);
    l.whole_eps = eps;
    l.clip = clip;
  }

  // the last added layer's dense MLP activation (act_mul_row) and the RMSNorms of its attention's and feed-forward's
  // outputs (float32 weights [hidden], or None)
  void set_ffn(int64_t act, std::optional<at::Tensor> attn_out_w, double attn_out_eps, std::optional<at::Tensor> ffn_out_w,
               double ffn_out_eps) {
    TORCH_CHECK(!layers.empty(), "DecodeLayers.set_ffn: add the layer first");
    PlanLayer& l = layers.back();
    TORCH_CHECK(act == 0 || act == 1, "DecodeLayers.set_ffn: act 0 (SiLU) or 1 (GELU-tanh)");
    TORCH_CHECK(!l.moe || act == 0, "DecodeLayers.set_ffn: an MoE layer's activation is its experts'");
    for (const auto* w : {&attn_out_w, &ffn_out_w})
      TORCH_CHECK(!w->has_value() || ((*w)->dim() == 1 && (*w)->size(0) == l.qkv.k &&
                                      (*w)->scalar_type() == at::kFloat && (*w)->is_contiguous()),
                  "DecodeLayers.set_ffn: float32 norm weights [hidden]");
    l.act = act;
    l.attn_out_w = std::move(attn_out_w);
    l.attn_out_eps = attn_out_eps;
    l.ffn_out_w = std::move(ffn_out_w);
    l.ffn_out_eps = ffn_out_eps;
  }

  // the adapter in `slot` of linear `which` (0 qkv, 1 o, 2 gate_up, 3 down) of layer `layer`: A^T [K, R] and
  // B^T * scale [R, N], both float32 or both bfloat16 (copied in the step's order), or none (at/bt None)
  void set_lora(int64_t layer, int64_t which, int64_t slot, std::optional<at::Tensor> at,
                std::optional<at::Tensor> bt) {
    TORCH_CHECK(layer >= 0 && layer < size() && which >= 0 && which < 4 && slot > 0, "set_lora: no such linear");
    PlanLayer& l = layers[layer];
    TORCH_CHECK(!l.moe || which < 2, "set_lora: an MoE layer's feed-forward takes no adapter");
    const PlanLinear& lin = which == 0 ? l.qkv : which == 1 ? l.o : which == 2 ? l.gate_up : l.down;
    auto& slots = l.lora[which];
    if (static_cast<int64_t>(slots.size()) <= slot) slots.resize(slot + 1);
    if (!at.has_value() || !bt.has_value()) {
      slots[slot] = PlanLora{};
      return;
    }
    const auto dt = at->scalar_type();
    TORCH_CHECK(at->dim() == 2 && bt->dim() == 2 && at->size(0) == lin.k && at->size(1) == bt->size(0) &&
                    bt->size(1) == lin.n && at->size(1) > 0 && (dt == at::kFloat || dt == at::kBFloat16) &&
                    bt->scalar_type() == dt && at->is_contiguous() && bt->is_contiguous(),
                "set_lora: A^T [K, R] and B^T [R, N], both float32 or both bfloat16, contiguous, matching the linear");
    PlanLora p;
    p.half = dt == at::kBFloat16;
    p.r = at->size(1);
    p.rp = (p.r + LORA_W - 1) / LORA_W * LORA_W;
    if (p.half)
      fill_lora(p, reinterpret_cast<const uint16_t*>(at->data_ptr()), reinterpret_cast<const uint16_t*>(bt->data_ptr()),
                lin.k, lin.n, p.aph, p.bph);
    else
      fill_lora(p, at->data_ptr<float>(), bt->data_ptr<float>(), lin.k, lin.n, p.ap, p.bp);
    lora_rp = std::max(lora_rp, p.rp);
    slots[slot] = std::move(p);
  }

  // p's A^T panels and B^T chunks (ap, bp: float or uint16_t bfloat16, as a and b) from A^T [K, R] and B^T [R, N]
  template <typename W>
  void fill_lora(PlanLora& p, const W* a, const W* b, int64_t K, int64_t N, const W*& ap_out, const W*& bp_out) {
    const int64_t R = p.r;
    W* ap = arena.take<W>(p.rp * K);  // (zeros: the padding columns)
    ap_out = ap;
    for (int64_t k = 0; k < K; ++k)
      for (int64_t j = 0; j < R; ++j) ap[((j / LORA_W) * K + k) * LORA_W + j % LORA_W] = a[k * R + j];
    const int64_t chunks = (N + LORA_W - 1) / LORA_W;
    p.cj0.assign(chunks, 0);
    p.cj1.assign(chunks, 0);
    for (int64_t j = 0; j < R; ++j) {
      int64_t lo = 0, hi = N;  // row j's nonzero columns lie in [lo, hi)
      while (lo < hi && lora_w(b[j * N + lo]) == 0.0f) ++lo;
      while (hi > lo && lora_w(b[j * N + hi - 1]) == 0.0f) --hi;
      if (lo == hi) continue;
      for (int64_t ci = lo / LORA_W; ci <= (hi - 1) / LORA_W; ++ci) {
        if (p.cj0[ci] == p.cj1[ci]) p.cj0[ci] = static_cast<int32_t>(j);
        p.cj1[ci] = static_cast<int32_t>(j + 1);
      }
    }
    p.coff.assign(chunks, 0);
    int64_t total = 0;
    for (int64_t ci = 0; ci < chunks; ++ci) {
      p.coff[ci] = total;
      total += (p.cj1[ci] - p.cj0[ci]) * LORA_W;
    }
    W* bp = arena.take<W>(total);
    bp_out = bp;
    for (int64_t ci = 0; ci < chunks; ++ci)
      for (int64_t j = p.cj0[ci]; j < p.cj1[ci]; ++j)
        for (int64_t c = ci * LORA_W; c < std::min(N, (ci + 1) * LORA_W); ++c)
          bp[p.coff[ci] + (j - p.cj0[ci]) * LORA_W + c % LORA_W] = b[j * N + c];
  }

  int64_t size() const { return static_cast<int64_t>(layers.size()); }

  void set_huge_pages(bool on) { arena.huge = on; }  // (before the first set_lora)
};

// The LoRA delta of the compiled step, y[m] += (x[m] @ A^T) @ B^T for every row m with an adapter, in two phases
// split over the team, rows grouped by adapter slot (each slot's A and B read once per step, whatever its rows):
// - shrink: thread t takes its share of the K inputs and writes, per row, its partial x[m, k0..k1) @ A^T[k0..k1)
//   (tiles of up to 4 rows of one slot against a 16-column panel of A^T, two accumulators over k);
// - (a barrier), expand: each thread sums the partials of its rows and adds u @ B^T over its own output columns,
//   in chunks of 16 columns accumulated in registers over the rows of B^T that can be nonzero there.

// 16 lanes of float32, in GCC/Clang's portable vector extension: one zmm with AVX-512, two ymm with AVX2, four q
// registers on NEON. The tiles below keep their accumulators in these registers (the auto-vectorised loops over
// float[16] arrays kept them on the stack). That measured no faster by itself: the adapters' time is their reads'
// latency (docs/lora.md, Performance), and the bfloat16 loads convert in the same registers.
typedef float LoraVec __attribute__((vector_size(LORA_W * sizeof(float))));
typedef uint16_t LoraHalf __attribute__((vector_size(LORA_W * sizeof(uint16_t))));
typedef uint32_t LoraBits __attribute__((vector_size(LORA_W * sizeof(uint32_t))));

// how far ahead the tiles ask for their next lines: 64 rows of 16 (2 KiB of bfloat16, 4 KiB of float32)
constexpr int64_t LORA_AHEAD = 64;
inline LoraVec lora_load(const float* p) {
  LoraVec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline LoraVec lora_load(const uint16_t* p) {  // 16 bfloat16 -> float32 (the high halves)
  LoraHalf h;
  std::memcpy(&h, p, sizeof h);
  return std::bit_cast<LoraVec>(__builtin_convertvector(h, LoraBits) << 16);
}

// rows[0..NR) (all of one slot): part[m][0..rp) = x[m, k0..k1) @ A^T[k0..k1, :]
template <typename W, int NR>
void lora_shrink_tile(const W* panels, int64_t rp, const int64_t* rows, const float* x, int64_t K, int64_t k0,
                      int64_t k1, float* part, int64_t stride) {
  const float* xr[NR];
  for (int r = 0; r < NR; ++r) xr[r] = x + rows[r] * K;
  for (int64_t pi = 0; pi < rp / LORA_W; ++pi) {
    const W* ap = panels + pi * K * LORA_W;
    LoraVec acc0[NR], acc1[NR];  // two chains over k
    for (int r = 0; r < NR; ++r) acc0[r] = acc1[r] = LoraVec{};
    int64_t k = k0;
    for (; k + 1 < k1; k += 2) {
      __builtin_prefetch(ap + (k + LORA_AHEAD) * LORA_W);
      const LoraVec a0 = lora_load(ap + k * LORA_W), a1 = lora_load(ap + (k + 1) * LORA_W);
      for (int r = 0; r < NR; ++r) {
        acc0[r] += xr[r][k] * a0;
        acc1[r] += xr[r][k + 1] * a1;
      }
    }
    if (k < k1) {
      const LoraVec a0 = lora_load(ap + k * LORA_W);
      for (int r = 0; r < NR; ++r) acc0[r] += xr[r][k] * a0;
    }
    for (int r = 0; r < NR; ++r) {
      const LoraVec sum = acc0[r] + acc1[r];
      std::memcpy(part + rows[r] * stride + pi * LORA_W, &sum, sizeof sum);
    }
  }
}

// rows[0..NR) (all of one slot): y[m, c0..c1) += u[m] @ B^T[:, c0..c1)
template <typename W, int NR>
void lora_expand_tile(const PlanLora& p, const W* chunks, const int64_t* rows, const float* u, int64_t stride,
                      float* y, int64_t N, int64_t c0, int64_t c1) {
  const float* ur[NR];
  for (int r = 0; r < NR; ++r) ur[r] = u + rows[r] * stride;
  for (int64_t c = c0; c < c1;) {
    const int64_t ci = c / LORA_W, ce = std::min(c1, (ci + 1) * LORA_W), w = ce - c;
    const int64_t j0 = p.cj0[ci], j1 = p.cj1[ci];
    if (j0 < j1) {
      const W* chunk = chunks + p.coff[ci];  // row j0's 16 columns of this chunk, then row j0 + 1's, ...
      LoraVec acc[NR];
      for (int r = 0; r < NR; ++r) acc[r] = LoraVec{};
      __builtin_prefetch(chunk + LORA_AHEAD * LORA_W);  // (a few chunks on)
      for (int64_t j = j0; j < j1; ++j) {
        const LoraVec bj = lora_load(chunk + (j - j0) * LORA_W);
        for (int r = 0; r < NR; ++r) acc[r] += ur[r][j] * bj;
      }
      const int64_t lane = c - ci * LORA_W;  // (a range that starts or ends inside a chunk: only its columns)
      for (int r = 0; r < NR; ++r) {
        float* yr = y + rows[r] * N + c;
        if (w == LORA_W) {
          LoraVec v;
          std::memcpy(&v, yr, sizeof v);
          v += acc[r];
          std::memcpy(yr, &v, sizeof v);
        } else {
          for (int64_t i = 0; i < w; ++i) yr[i] += acc[r][lane + i];
        }
      }
    }
    c = ce;
  }
}

// n (1..4) rows of one slot: the tile of that many rows
template <typename W>
void lora_shrink_rows(int64_t n, const W* panels, int64_t rp, const int64_t* rows, const float* x, int64_t K,
                      int64_t k0, int64_t k1, float* part, int64_t stride) {
  switch (n) {
    case 1: lora_shrink_tile<W, 1>(panels, rp, rows, x, K, k0, k1, part, stride); break;
    case 2: lora_shrink_tile<W, 2>(panels, rp, rows, x, K, k0, k1, part, stride); break;
    case 3: lora_shrink_tile<W, 3>(panels, rp, rows, x, K, k0, k1, part, stride); break;
    default: lora_shrink_tile<W, 4>(panels, rp, rows, x, K, k0, k1, part, stride);
  }
}

template <typename W>
void lora_expand_rows(int64_t n, const PlanLora& p, const W* chunks, const int64_t* rows, const float* u,
                      int64_t stride, float* y, int64_t N, int64_t c0, int64_t c1) {
  switch (n) {
    case 1: lora_expand_tile<W, 1>(p, chunks, rows, u, stride, y, N, c0, c1); break;
    case 2: lora_expand_tile<W, 2>(p, chunks, rows, u, stride, y, N, c0, c1); break;
    case 3: lora_expand_tile<W, 3>(p, chunks, rows, u, stride, y, N, c0, c1); break;
    default: lora_expand_tile<W, 4>(p, chunks, rows, u, stride, y, N, c0, c1);
  }
}

// a step's rows grouped by adapter slot: rows[first[g] .. first[g + 1]) have slot slot[g] (> 0)
struct LoraGroups {
  std::vector<int64_t> slot, first, rows;
  explicit LoraGroups(const int64_t* rs, int64_t B) {
    if (rs == nullptr) return;
    std::vector<int64_t> order;
    for (int64_t m = 0; m < B; ++m)
      if (rs[m] > 0) order.push_back(m);
    std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return rs[x] < rs[y]; });
    for (size_t i = 0; i < order.size(); ++i) {
      if (i == 0 || rs[order[i]] != rs[order[i - 1]]) {
        slot.push_back(rs[order[i]]);
        first.push_back(static_cast<int64_t>(i));
      }
      rows.push_back(order[i]);
    }
    first.push_back(static_cast<int64_t>(rows.size()));
  }
  size_t size() const { return slot.size(); }
};

// the adapter of group g's slot in this linear, or nullptr
inline const PlanLora* group_lora(const std::vector<PlanLora>& lo, const LoraGroups& g, size_t i) {
  const int64_t s = g.slot[i];
  return s < static_cast<int64_t>(lo.size()) && lo[s].r > 0 ? &lo[s] : nullptr;
}

// thread t of T: its partial shrinks of every adapted row (part [B, stride])
void lora_shrink(const std::vector<PlanLora>& lo, const LoraGroups& g, const float* x, int64_t K, int t, int T,
                 float* part, int64_t stride) {
  const int64_t k0 = K * t / T, k1 = K * (t + 1) / T;
  for (size_t i = 0; i < g.size(); ++i) {
    const PlanLora* p = group_lora(lo, g, i);
    if (p == nullptr) continue;
    for (int64_t f = g.first[i]; f < g.first[i + 1]; f += 4) {
      const int64_t* rows = g.rows.data() + f;
      const int64_t n = std::min<int64_t>(4, g.first[i + 1] - f);
      if (p->half)
        lora_shrink_rows(n, p->aph, p->rp, rows, x, K, k0, k1, part, stride);
      else
        lora_shrink_rows(n, p->ap, p->rp, rows, x, K, k0, k1, part, stride);
    }
  }
}

// after every thread's lora_shrink: the partials summed into u (this thread's own [B, stride] scratch), then the
// expand over output columns [c0, c1)
void lora_expand(const std::vector<PlanLora>& lo, const LoraGroups& g, const float* parts, int T, int64_t B,
                 int64_t stride, float* u, float* y, int64_t N, int64_t c0, int64_t c1) {
  if (c0 >= c1) return;
  for (size_t i = 0; i < g.size(); ++i) {
    const PlanLora* p = group_lora(lo, g, i);
    if (p == nullptr) continue;
    for (int64_t f = g.first[i]; f < g.first[i + 1]; ++f) {
      const int64_t m = g.rows[f];
      float* um = u + m * stride;
      std::copy(parts + m * stride, parts + m * stride + p->rp, um);
      for (int q = 1; q < T; ++q) {
        const float* pq = parts + (q * B + m) * stride;
        for (int64_t j = 0; j < p->rp; ++j) um[j] += pq[j];
      }
    }
    for (int64_t f = g.first[i]; f < g.first[i + 1]; f += 4) {
      const int64_t* rows = g.rows.data() + f;
      const int64_t n = std::min<int64_t>(4, g.first[i + 1] - f);
      if (p->half)
        lora_expand_rows(n, *p, p->bph, rows, u, stride, y, N, c0, c1);
      else
        lora_expand_rows(n, *p, p->bp, rows, u, stride, y, N, c0, c1);
    }
  }
}

// the output column where block b of linear l starts (b == l.blocks: l.n)
int64_t block_column(const PlanLinear& l, int64_t b);

// output columns [c0, c1) of linear l's output blocks [b0, b1)
void block_columns(const PlanLinear& l, int64_t b0, int64_t b1, int64_t& c0, int64_t& c1) {
  c0 = block_column(l, b0);
  c1 = block_column(l, b1);
}

int64_t block_column(const PlanLinear& l, int64_t b) {
  if (l.kind == 5) {
    if (b >= l.blocks) return l.n;
    const size_t p = std::upper_bound(l.first.begin(), l.first.end(), b) - l.first.begin() - 1;
    return l.col[p] + block_column(l.parts[p], b - l.first[p]);
  }
  const int64_t per = l.kind == 0   ? tpserve::F32_BLOCK
                      : l.kind == 3 ? tpserve::bf16_rows()
                      : l.kind == 4 ? tpserve::VNNI_BLOCK
                                    : tpserve::int_rows();
  return std::min(b * per, l.n);
}

// whether linear l multiplies its input quantized to int8 (int8 and int4 weights on CPUs with AVX-512 VNNI, AVX2 or
// NEON; GGUF block types everywhere)
// whether linear l multiplies its input rounded to bfloat16 (bf16 weights on CPUs with AVX-512 BF16)
bool takes_rows(const PlanLinear& l) {
  if (l.kind == 5) return std::any_of(l.parts.begin(), l.parts.end(), [](const PlanLinear& p) { return takes_rows(p); });
  return ((l.kind == 1 || l.kind == 2) && tpserve::vnni_layout()) || l.kind == 4;
}
bool takes_bf16(const PlanLinear& l) {
  if (l.kind == 5) return std::any_of(l.parts.begin(), l.parts.end(), [](const PlanLinear& p) { return takes_bf16(p); });
  return l.kind == 3 && tpserve::bf16_dot_layout();
}

// rows [r0, r1) of linear l's input src (l.k floats a row) into the copy l multiplies: int8 (takes_rows) or bfloat16
// (takes_bf16); nothing for a linear that takes float32
void copy_input(const PlanLinear& l, const float* src, tpserve::Int8Rows& rows, int64_t r0, int64_t r1) {
  if (takes_rows(l)) tpserve::quantize_rows(src, rows, r0, r1, 0, l.k / 32);
  if (takes_bf16(l)) tpserve::round_rows_bf16(src, rows, r0, r1);
}

// y[:, output blocks b0..b1) of linear l over the M rows of x (xq: x quantized, see takes_rows)
void linear_range(const PlanLinear& l, const float* x, const tpserve::Int8Rows* xq, int64_t M, float* y, int64_t b0,
                  int64_t b1) {
  const float* bias = l.bias.has_value() ? l.bias->data_ptr<float>() : nullptr;
  if (l.kind == 5) {  // each part over its share of [b0, b1), into a scratch of its own width, then its columns
    thread_local std::vector<float> scratch;
    for (size_t p = 0; p < l.parts.size(); ++p) {
      const PlanLinear& part = l.parts[p];
      const int64_t a = std::max(b0, l.first[p]) - l.first[p], b = std::min(b1, l.first[p] + part.blocks) - l.first[p];
      if (a >= b) continue;
      scratch.resize(M * part.n);
      linear_range(part, x, xq, M, scratch.data(), a, b);
      const int64_t c0 = block_column(part, a), c1 = block_column(part, b);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t c = c0; c < c1; ++c)
          y[m * l.n + l.col[p] + c] = scratch[m * part.n + c] + (bias ? bias[l.col[p] + c] : 0.f);
    }
    return;
  }
  switch (l.kind) {
    case 0:
      tpserve::f32_range(x, M, l.k, l.w.data_ptr<float>(), bias, l.n, y, b0, b1);
      break;
    case 1:
      tpserve::int8_range(x, xq, M, l.k, l.w.data_ptr<int8_t>(), tpserve::half_data(l.scale), bias, l.n, y, b0, b1);
      break;
    case 2:
      tpserve::int4_range(x, xq, M, l.k, l.w.data_ptr<uint8_t>(), tpserve::half_data(l.scale), l.group, bias, l.n, y,
                          b0, b1);
      break;
    case 4:
      tpserve::kq_range(l.group, xq, M, l.k, l.w.data_ptr<uint8_t>(), l.scale.data_ptr<uint8_t>(), bias, l.n, y, b0,
                        b1);
      break;
    default:
      tpserve::bf16_range(x, xq, M, l.k, reinterpret_cast<const uint16_t*>(l.w.data_ptr<uint8_t>()), bias, l.n, y, b0,
                          b1);
  }
}

// ---- running an MoE layer's experts (MoeExperts, above) ---------------------------------------------------------------

// What one MoE call works in, sized before the team (moe_reserve) for M rows of k experts each: inside the team only
// the per-expert activation copies are resized, on one thread (moe_group).
struct MoeScratch {
  std::vector<int64_t> ids;             // [M, k]: each row's experts (global ids)
  std::vector<float> wts, logits;       // [M, k]: their weights; [M, experts]: the router's logits
  std::vector<int64_t> local;           // global id -> local expert, -1: not this plan's
  std::vector<int64_t> start, fill;     // [E + 1]: each local expert's first pair
  std::vector<int64_t> row, row_start, row_pairs, active, gu_items, dn_items;
  std::vector<float> pw;                // each pair's weight
  at::Tensor xg, gu, act, y;            // [P, H], [P, 2I], [P, I], [P, H] with P <= M * k pairs
  std::vector<tpserve::Int8Rows> xq, aq;  // int8 / bfloat16 copies of each active expert's input rows, per linear
  int64_t M = 0, P = 0, A = 0;  // rows, (row, expert) pairs of this plan, active experts
  // the shared expert's: gate/up [M, 2Is], activation [M, Is], output [M, H], gate logits [M], input copies
  at::Tensor sgu, sact, sy;
  std::vector<float> sg;
  tpserve::Int8Rows sxq, saq;
  bool with_shared = false;  // this call adds the shared expert
};

// sizes for up to M rows of k experts each, experts of hidden size H and intermediate size I, `experts` router logits
void moe_reserve(MoeScratch& s, int64_t M, int64_t k, int64_t H, int64_t I, int64_t experts, int64_t local,
                 int64_t shared_inter, const at::TensorOptions& opts) {
  const int64_t P = M * k;
  s.ids.resize(P);
  s.wts.resize(P);
  s.logits.resize(M * experts);
  s.row.resize(P);
  s.pw.resize(P);
  s.row_pairs.resize(P);
  s.row_start.resize(M + 1);
  s.xg = at::empty({P, H}, opts);
  s.gu = at::empty({P, 2 * I}, opts);
  s.act = at::empty({P, I}, opts);
  s.y = at::empty({P, H}, opts);
  s.xq.resize(std::min(local, P));
  s.aq.resize(std::min(local, P));
  if (shared_inter > 0) {
    s.sgu = at::empty({M, 2 * shared_inter}, opts);
    s.sact = at::empty({M, shared_inter}, opts);
    s.sy = at::empty({M, H}, opts);
    s.sg.resize(M);
  }
}

// one row's routing (moe.py's Routing): its k experts by logit (descending; ties: the lower id first) and their weights
void route_row(const float* l, int64_t E, int64_t k, bool renormalize, bool topk_softmax, int64_t* ids, float* w) {
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e) {
      bool taken = false;
      for (int64_t i = 0; i < j && !taken; ++i) taken = ids[i] == e;
      if (!taken && (best < 0 || l[e] > l[best])) best = e;
    }
    ids[j] = best;
  }
  const float top = l[ids[0]];
  float z = 0.f;
  if (topk_softmax) {  // a softmax over the k logits
    for (int64_t j = 0; j < k; ++j) z += std::exp(l[ids[j]] - top);
    for (int64_t j = 0; j < k; ++j) w[j] = std::exp(l[ids[j]] - top) / z;
    return;
  }
  for (int64_t e = 0; e < E; ++e) z += std::exp(l[e] - top);  // a softmax over every expert, its k taken
  for (int64_t j = 0; j < k; ++j) w[j] = std::exp(l[ids[j]] - top) / z;
  if (renormalize) {
    float sum = 0.f;
    for (int64_t j = 0; j < k; ++j) sum += w[j];
    for (int64_t j = 0; j < k; ++j) w[j] /= sum;
  }
}

void moe_group(const MoeExperts& p, MoeScratch& s, int64_t M, int64_t k, int64_t* counts);

// inside a team: the router's logits over x's M rows, each row's experts and weights into s.ids / s.wts, then the
// pairs grouped by expert (moe_group, on thread 0; `counts` as there), a barrier after each phase. Up to
// ROUTE_ALONE rows thread 0 routes them all itself and groups them without a barrier between: routing a row is a few
// microseconds, about what a barrier costs (at one row the other threads had nothing to route anyway).
constexpr int64_t ROUTE_ALONE = 4;
void moe_route(const MoeExperts& p, MoeScratch& s, const float* x, int64_t M, int t, int T, int64_t* counts) {
  const PlanLinear& r = *p.router;
  linear_range(r, x, nullptr, M, s.logits.data(), r.blocks * t / T, r.blocks * (t + 1) / T);
#pragma omp barrier
  const auto route = [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      route_row(s.logits.data() + m * r.n, r.n, p.top_k, p.renormalize, p.topk_softmax, s.ids.data() + m * p.top_k,
                s.wts.data() + m * p.top_k);
  };
  if (M <= ROUTE_ALONE) {
    if (t == 0) route(0, M);
  } else {
    route(M * t / T, M * (t + 1) / T);
#pragma omp barrier
  }
  if (t == 0) moe_group(p, s, M, p.top_k, counts);
#pragma omp barrier
}

// one thread: the (row, expert) pairs of s.ids that are this plan's, grouped by expert (ascending), rows ascending
// within; each row's pairs in expert order (for the sum); the active experts and their phases' work items; the
// activation copies sized. `counts` (or null): every pair's expert counted, this plan's or not (the metric).
void moe_group(const MoeExperts& p, MoeScratch& s, int64_t M, int64_t k, int64_t* counts) {
  const int64_t E = p.size(), first_id = p.index.front(), last_id = p.index.back(), H = p.hidden(), I = p.inter();
  s.M = M;
  s.local.assign(last_id - first_id + 1, -1);
  for (int64_t e = 0; e < E; ++e) s.local[p.index[e] - first_id] = e;
  const auto local = [&](int64_t g) { return g < first_id || g > last_id ? -1 : s.local[g - first_id]; };
  s.start.assign(E + 1, 0);
  for (int64_t i = 0; i < M * k; ++i) {
    if (counts != nullptr) ++counts[s.ids[i]];
    const int64_t e = local(s.ids[i]);
    if (e >= 0) ++s.start[e + 1];
  }
  for (int64_t e = 0; e < E; ++e) s.start[e + 1] += s.start[e];
  s.P = s.start[E];
  s.fill.assign(s.start.begin(), s.start.end() - 1);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = local(s.ids[m * k + j]);
      if (e < 0) continue;
      const int64_t q = s.fill[e]++;
      s.row[q] = m;
      s.pw[q] = s.wts[m * k + j];
    }
  std::fill(s.row_start.begin(), s.row_start.begin() + M + 1, 0);
  for (int64_t q = 0; q < s.P; ++q) ++s.row_start[s.row[q] + 1];
  for (int64_t m = 0; m < M; ++m) s.row_start[m + 1] += s.row_start[m];
  s.fill.assign(s.row_start.begin(), s.row_start.begin() + M);
  for (int64_t q = 0; q < s.P; ++q) s.row_pairs[s.fill[s.row[q]]++] = q;
  s.active.clear();
  for (int64_t e = 0; e < E; ++e)
    if (s.start[e + 1] > s.start[e]) s.active.push_back(e);
  s.A = static_cast<int64_t>(s.active.size());
  s.with_shared = s.with_shared && p.shared_gate_up.has_value();
  if (s.with_shared) {
    const PlanLinear &gu = *p.shared_gate_up, &dn = *p.shared_down;
    if (takes_rows(gu)) tpserve::resize_rows(s.sxq, M, H);
    if (takes_bf16(gu)) tpserve::resize_bf16_rows(s.sxq, M, H);
    if (takes_rows(dn)) tpserve::resize_rows(s.saq, M, dn.k);
    if (takes_bf16(dn)) tpserve::resize_bf16_rows(s.saq, M, dn.k);
  }
  s.gu_items.assign(s.A + 1, 0);  // prefix sums of output blocks per active expert
  s.dn_items.assign(s.A + 1, 0);
  for (int64_t a = 0; a < s.A; ++a) {
    const int64_t e = s.active[a], c = s.start[e + 1] - s.start[e];
    s.gu_items[a + 1] = s.gu_items[a] + p.gate_up[e].blocks;
    s.dn_items[a + 1] = s.dn_items[a] + p.down[e].blocks;
    if (takes_rows(p.gate_up[e])) tpserve::resize_rows(s.xq[a], c, H);
    if (takes_bf16(p.gate_up[e])) tpserve::resize_bf16_rows(s.xq[a], c, H);
    if (takes_rows(p.down[e])) tpserve::resize_rows(s.aq[a], c, I);
    if (takes_bf16(p.down[e])) tpserve::resize_bf16_rows(s.aq[a], c, I);
  }
}

// inside a team, after moe_group: out[m] (M rows of H) = the weighted sum of row m's experts of this plan (zero for a
// row with none); no barrier after the last phase (each thread writes its own rows)
void moe_run(const MoeExperts& p, MoeScratch& s, const float* x, float* out, int t, int T) {
  const int64_t H = p.hidden(), I = p.inter(), A = s.A, P = s.P, M = s.M;
  float *xgp = s.xg.data_ptr<float>(), *gup = s.gu.data_ptr<float>(), *actp = s.act.data_ptr<float>();
  float* yp = s.y.data_ptr<float>();
  const auto share = [&](int64_t n, int64_t& lo, int64_t& hi) {
    lo = n * t / T;
    hi = n * (t + 1) / T;
  };
  // runs f(active expert a, its first pair, its pair count, blocks [b0, b1)) over this thread's share of the work
  // items (the active experts' output blocks, laid end to end)
  const auto blocks = [&](const std::vector<int64_t>& items, const auto& f) {
    int64_t lo, hi;
    share(items[A], lo, hi);
    for (int64_t a = 0; a < A && lo < hi; ++a) {
      const int64_t b0 = std::max(lo, items[a]) - items[a], b1 = std::min(hi, items[a + 1]) - items[a];
      const int64_t e = s.active[a];
      if (b0 < b1) f(a, s.start[e], s.start[e + 1] - s.start[e], b0, b1);
    }
  };
  // a linear's input rows of active expert a as int8 / bfloat16 copies
  const auto quantize = [&](const PlanLinear& lin, const float* src, int64_t width, int64_t a,
                            tpserve::Int8Rows& rows) {
    const int64_t e = s.active[a], s0 = s.start[e], c = s.start[e + 1] - s0;
    copy_input(lin, src + s0 * width, rows, 0, c);
  };
  int64_t lo, hi;
  if (P > 0) {
    // per active expert of this thread's share: its pairs' rows gathered, then their copies for gate/up (one phase:
    // the thread that writes an expert's rows reads them); the same below for the activation and the down copies
    int64_t a0, a1;
    share(A, a0, a1);
    for (int64_t a = a0; a < a1; ++a) {
      const int64_t e = s.active[a];
      for (int64_t q = s.start[e]; q < s.start[e + 1]; ++q)
        std::copy(x + s.row[q] * H, x + s.row[q] * H + H, xgp + q * H);
      quantize(p.gate_up[e], xgp, H, a, s.xq[a]);
    }
#pragma omp barrier
    blocks(s.gu_items, [&](int64_t a, int64_t s0, int64_t c, int64_t b0, int64_t b1) {
      linear_range(p.gate_up[s.active[a]], xgp + s0 * H, &s.xq[a], c, gup + s0 * 2 * I, b0, b1);
    });
#pragma omp barrier
    for (int64_t a = a0; a < a1; ++a) {
      const int64_t e = s.active[a];
      for (int64_t q = s.start[e]; q < s.start[e + 1]; ++q) {
        if (p.act == 1)
          clamped_swiglu_row(gup + q * 2 * I, gup + q * 2 * I + I, actp + q * I, I, p.alpha, p.limit);
        else
          silu_mul_row(gup + q * 2 * I, gup + q * 2 * I + I, actp + q * I, I);
      }
      quantize(p.down[e], actp, I, a, s.aq[a]);
    }
#pragma omp barrier
    blocks(s.dn_items, [&](int64_t a, int64_t s0, int64_t c, int64_t b0, int64_t b1) {
      linear_range(p.down[s.active[a]], actp + s0 * I, &s.aq[a], c, yp + s0 * H, b0, b1);
    });
#pragma omp barrier
  }
  float* syp = nullptr;
  if (s.with_shared) {  // the shared expert over every row: gate/up (and its gate) -> SiLU(gate) * up -> down
    const PlanLinear &sgu = *p.shared_gate_up, &sdn = *p.shared_down;
    const int64_t Is = sgu.n / 2;
    float *sgup = s.sgu.data_ptr<float>(), *sactp = s.sact.data_ptr<float>();
    syp = s.sy.data_ptr<float>();
    share(M, lo, hi);
    copy_input(sgu, x, s.sxq, lo, hi);
#pragma omp barrier
    share(sgu.blocks, lo, hi);
    linear_range(sgu, x, &s.sxq, M, sgup, lo, hi);
    if (p.shared_gate.has_value() && t == T - 1) linear_range(*p.shared_gate, x, nullptr, M, s.sg.data(), 0, 1);
#pragma omp barrier
    share(M, lo, hi);
    for (int64_t m = lo; m < hi; ++m) silu_mul_row(sgup + m * 2 * Is, sgup + m * 2 * Is + Is, sactp + m * Is, Is);
    copy_input(sdn, sactp, s.saq, lo, hi);
#pragma omp barrier
    share(sdn.blocks, lo, hi);
    linear_range(sdn, sactp, &s.saq, M, syp, lo, hi);
#pragma omp barrier
  }
  share(M, lo, hi);  // each row: its experts' weighted outputs, summed in expert order (then the shared expert's)
  for (int64_t m = lo; m < hi; ++m) {
    float* o = out + m * H;
    std::fill(o, o + H, 0.f);
    for (int64_t r = s.row_start[m]; r < s.row_start[m + 1]; ++r) {
      const int64_t q = s.row_pairs[r];
      const float w = s.pw[q];
      const float* yr = yp + q * H;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) o[i] += yr[i] * w;
    }
    if (syp != nullptr) {
      const float g = p.shared_gate.has_value() ? 1.f / (1.f + exp_capped(-s.sg[m])) : 1.f;
      const float* sr = syp + m * H;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) o[i] += g * sr[i];
    }
  }
}

// A one-row step's MoE feed-forward inside decode_layers' team (its `solo` form), where every expert is this plan's
// (decode_layers runs at TP 1) and the row's k experts split evenly over the team (moe_solo_fits): the router over this
// thread's share of its blocks, a barrier, then every thread routes the row itself (route_row: the same bits in each)
// and runs whole experts through gate/up -> activation -> down, with no barrier between (its own k / T first, then
// those the others have not reached, by `experts`: team_split.h's Shares over the k, in claims of at least 128 KB of
// weights); a barrier, and every thread sums the k outputs, in expert order as moe_run does, into its own `out`.
// Against moe_route + moe_run at one row, five barriers fewer and no phase on one thread while the others wait
// (routing, the sum). x: the row; xq: its int8 / bfloat16 copy, as the experts' gate/up take it (every expert's, the
// same row).
constexpr int64_t SOLO_MAX_K = 32;
bool moe_solo_fits(const MoeExperts& p, int T) {
  return p.router.has_value() && !p.shared_gate_up.has_value() && p.size() == p.router->n && p.index.front() == 0 &&
         p.index.back() == p.router->n - 1 && p.top_k <= SOLO_MAX_K && p.top_k % T == 0;  // (ids ascending: 0..n-1)
}

void moe_solo(const MoeExperts& p, MoeScratch& s, const float* x, const tpserve::Int8Rows& xq, float* out, int t,
              int T, int64_t* counts, const tpserve::Shares& experts) {
  const PlanLinear& r = *p.router;
  const int64_t H = p.hidden(), I = p.inter(), k = p.top_k;
  linear_range(r, x, nullptr, 1, s.logits.data(), r.blocks * t / T, r.blocks * (t + 1) / T);
#pragma omp barrier
  int64_t ids[SOLO_MAX_K], order[SOLO_MAX_K];
  float w[SOLO_MAX_K];
  route_row(s.logits.data(), r.n, k, p.renormalize, p.topk_softmax, ids, w);
  if (t == 0 && counts != nullptr)
    for (int64_t j = 0; j < k; ++j) ++counts[ids[j]];
  for (int64_t j = 0; j < k; ++j) order[j] = j;
  std::sort(order, order + k, [&](int64_t i, int64_t j) { return ids[i] < ids[j]; });  // (k distinct experts)
  float *gup = s.gu.data_ptr<float>(), *actp = s.act.data_ptr<float>(), *yp = s.y.data_ptr<float>();
  experts.run(t, [&](int64_t a0, int64_t a1) {
    for (int64_t a = a0; a < a1; ++a) {  // (every expert local: its id is its index)
      const PlanLinear &gu = p.gate_up[ids[order[a]]], &dn = p.down[ids[order[a]]];
      float *g = gup + a * 2 * I, *act = actp + a * I;
      linear_range(gu, x, &xq, 1, g, 0, gu.blocks);
      if (p.act == 1)
        clamped_swiglu_row(g, g + I, act, I, p.alpha, p.limit);
      else
        silu_mul_row(g, g + I, act, I);
      tpserve::Int8Rows& aq = s.aq[a];  // (sized once: no allocation after the first step)
      if (takes_rows(dn)) tpserve::resize_rows(aq, 1, I);
      if (takes_bf16(dn)) tpserve::resize_bf16_rows(aq, 1, I);
      copy_input(dn, act, aq, 0, 1);
      linear_range(dn, act, &aq, 1, yp + a * H, 0, dn.blocks);
    }
  });
#pragma omp barrier
  std::fill(out, out + H, 0.f);
  for (int64_t a = 0; a < k; ++a) {
    const float wa = w[order[a]];
    const float* ya = yp + a * H;
#pragma omp simd
    for (int64_t i = 0; i < H; ++i) out[i] += ya[i] * wa;
  }
}

void check_moe_input(const MoeExperts& p, const at::Tensor& x, const char* op) {
  TORCH_CHECK(p.size() > 0, op, ": an empty plan");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == p.hidden() && x.scalar_type() == at::kFloat && x.is_contiguous(), op,
              ": x [M, hidden] float32, contiguous");
}

at::Tensor moe_experts(const c10::intrusive_ptr<MoeExperts>& plan, const at::Tensor& x, const at::Tensor& ids,
                       const at::Tensor& weights) {
  check_moe_input(*plan, x, "moe_experts");
  const int64_t M = x.size(0), K = ids.size(1);
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == M && ids.scalar_type() == at::kLong && ids.is_contiguous() &&
                  weights.sizes() == ids.sizes() && weights.scalar_type() == at::kFloat && weights.is_contiguous(),
              "moe_experts: ids [M, k] int64 and weights [M, k] float32, contiguous");
  MoeScratch s;
  moe_reserve(s, M, K, plan->hidden(), plan->inter(), 0, plan->size(), 0, x.options());
  std::copy(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + M * K, s.ids.begin());
  std::copy(weights.data_ptr<float>(), weights.data_ptr<float>() + M * K, s.wts.begin());
  moe_group(*plan, s, M, K, nullptr);
  at::Tensor out = at::empty({M, plan->hidden()}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int nt = std::max(1, at::get_num_threads());
#pragma omp parallel num_threads(nt)
  moe_run(*plan, s, xp, op, omp_get_thread_num(), omp_get_num_threads());
  return out;
}

at::Tensor moe_forward(const c10::intrusive_ptr<MoeExperts>& plan, const at::Tensor& x,
                       const std::optional<at::Tensor>& counts, bool shared) {
  check_moe_input(*plan, x, "moe_forward");
  TORCH_CHECK(plan->router.has_value(), "moe_forward: a plan with its router (set_router)");
  TORCH_CHECK(!counts.has_value() || (counts->dim() == 1 && counts->size(0) == plan->router->n &&
                                      counts->scalar_type() == at::kLong && counts->is_contiguous()),
              "moe_forward: counts [experts] int64");
  const int64_t M = x.size(0), K = plan->top_k;
  MoeScratch s;
  moe_reserve(s, M, K, plan->hidden(), plan->inter(), plan->router->n, plan->size(),
              shared ? plan->shared_inter() : 0, x.options());
  s.with_shared = shared;
  at::Tensor out = at::empty({M, plan->hidden()}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  int64_t* cp = counts.has_value() ? counts->data_ptr<int64_t>() : nullptr;
  const int nt = std::max(1, at::get_num_threads());
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num(), T = omp_get_num_threads();
    moe_route(*plan, s, xp, M, t, T, cp);
    moe_run(*plan, s, xp, op, t, T);
  }
  return out;
}

// The attention phase's pieces: runs of consecutive rows that read the same blocks (a speculative step's
// verification rows of one sequence: each KV block is then read once for all of them), cut into pieces of at most
// ATTENTION_PIECE rows and few enough rows that the pieces times the KV heads times the chunks of the longest context
// still give every thread about two units (attention_units). Other rows are pieces of one. (Which rows share a piece
// changes no result: each row's attention has the same bits alone or with others.)
constexpr int64_t ATTENTION_PIECE = 16;

std::vector<std::pair<int64_t, int64_t>> attention_pieces(const int64_t* tp, const int64_t* lp, int64_t B,
                                                          int64_t MAXB, int64_t BS, int64_t kv_heads, int T) {
  int64_t longest = 1;
  for (int64_t b = 0; b < B; ++b) longest = std::max(longest, lp[b]);
  const int64_t chunks = (longest - 1) / tpserve::ATTENTION_CHUNK + 1;  // (without a window)
  const int64_t most = std::clamp<int64_t>(B * kv_heads * chunks / (2 * T), 1, ATTENTION_PIECE);
  std::vector<std::pair<int64_t, int64_t>> pieces;
  for (int64_t s = 0; s < B;) {
    int64_t e = s + 1;  // rows [s, e) read the same blocks
    for (; e < B && e - s < most; ++e) {
      const int64_t blocks = (std::max(lp[e], lp[s]) + BS - 1) / BS;
      if (!std::equal(tp + e * MAXB, tp + e * MAXB + blocks, tp + s * MAXB)) break;
    }
    pieces.emplace_back(s, e - s);
    s = e;
  }
  return pieces;
}

// Attention's units of work for one window (a layer's own, or the step's; 0: none): the rows of a piece that start in
// the same chunk of keys (all of them unless the window cuts differently per row), times each chunk their keys meet
// (ATTENTION_CHUNK keys at fixed positions, so that a long context spreads over the team and every row's bits stay its
// own), largest first. Built once per step and window, before the team starts; each layer takes its window's.
struct AttentionUnit {
  int64_t row, rows, chunk, work;  // work: keys times rows, for the order units are taken in
};

struct AttentionUnits {
  int64_t win = 0;
  std::vector<AttentionUnit> units;
  std::vector<int64_t> firsts, chunk0;  // each row's first key and first chunk
  int64_t chunks = 1;                   // the most chunks a row's keys meet
  bool single = true;                   // every row's keys in one chunk: no combine phase
};

AttentionUnits attention_units(const std::vector<std::pair<int64_t, int64_t>>& pieces, const int64_t* lp, int64_t B,
                               int64_t win) {
  constexpr int64_t C = tpserve::ATTENTION_CHUNK;
  AttentionUnits a;
  a.win = win;
  a.firsts.resize(B);
  a.chunk0.resize(B);
  for (int64_t r = 0; r < B; ++r) {
    a.firsts[r] = win > 0 ? std::max<int64_t>(0, lp[r] - win) : 0;
    a.chunk0[r] = a.firsts[r] / C;
    a.chunks = std::max(a.chunks, (lp[r] - 1) / C - a.chunk0[r] + 1);
  }
  a.single = a.chunks == 1;
  for (const auto& [s, n] : pieces)
    for (int64_t b = s; b < s + n;) {
      int64_t e = b + 1, last = (lp[b] - 1) / C;
      for (; e < s + n && a.chunk0[e] == a.chunk0[b]; ++e) last = std::max(last, (lp[e] - 1) / C);
      for (int64_t c = a.chunk0[b]; c <= last; ++c) {
        int64_t keys = 0;  // the most keys a row of the unit reads in the chunk
        for (int64_t r = b; r < e; ++r)
          keys = std::max(keys, std::min(lp[r], (c + 1) * C) - std::max(a.firsts[r], c * C));
        a.units.push_back({b, e - b, c, keys * (e - b)});
      }
      b = e;
    }
  std::stable_sort(a.units.begin(), a.units.end(),
                   [](const AttentionUnit& x, const AttentionUnit& y) { return x.work > y.work; });
  return a;
}

// row `id` of an embedding table (float32, bfloat16 or float16) as float32: the exact widening torch's cast does
void embed_row(const at::Tensor& table, int64_t id, float* out) {
  const int64_t H = table.size(1);
  if (table.scalar_type() == at::kFloat) {
    const float* p = table.data_ptr<float>() + id * H;
    std::copy(p, p + H, out);
  } else if (table.scalar_type() == at::kBFloat16) {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(table.data_ptr()) + id * H;
    for (int64_t j = 0; j < H; ++j) out[j] = std::bit_cast<float>(static_cast<uint32_t>(p[j]) << 16);
  } else {
    const at::Half* p = table.data_ptr<at::Half>() + id * H;
    for (int64_t j = 0; j < H; ++j) out[j] = static_cast<float>(p[j]);
  }
}

// The layers of decode_layers and decode_step. Without `ends` (decode_layers) h and x come filled and the final
// norm's output is returned. With them (decode_step) the team fills h, from `ids` looked up in the plan's table or
// (ids nullptr) as given, and norms it into x by the plan's first norm; at the end the plan's LM head turns HR rows of
// the final norm's output, `head_rows` (nullptr with HR == B: every row), into the returned logits [HR, vocab].
at::Tensor run_layers(const DecodeLayers* plan, at::Tensor h, const at::Tensor& x, const at::Tensor& cos,
                      const at::Tensor& sin, const at::Tensor& slots, const at::Tensor& table, const at::Tensor& lens,
                      int64_t window, const std::optional<at::Tensor>& lora_slots, bool ends, const int64_t* ids,
                      const int64_t* head_rows, int64_t HR) {
  // every check before the team starts: an exception inside an OpenMP region cannot be caught
  const auto& layers = plan->layers;
  TORCH_CHECK(!layers.empty(), "decode_layers: an empty plan");
  const int64_t B = h.size(0), hidden = layers[0].qkv.k, D = layers[0].pool.size(4);
  TORCH_CHECK(h.dim() == 2 && h.size(1) == hidden && h.scalar_type() == at::kFloat && h.is_contiguous() &&
                  x.sizes() == h.sizes() && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "decode_layers: h and x [B, hidden] float32, contiguous");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == B && cos.size(1) <= D && cos.size(1) % 2 == 0 &&
                  sin.sizes() == cos.sizes() && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous(),
              "decode_layers: cos/sin [B, rotated dims <= head_dim] float32");
  const int64_t R = cos.size(1);  // the rotated dims of each head
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == B && lens.dim() == 1 && lens.size(0) == B && table.dim() == 2 &&
                  table.size(0) == B && slots.scalar_type() == at::kLong && lens.scalar_type() == at::kLong &&
                  table.scalar_type() == at::kLong && slots.is_contiguous() && lens.is_contiguous() &&
                  table.is_contiguous(),
              "decode_layers: slots [B], lens [B], table [B, blocks] int64");
  TORCH_CHECK(!lora_slots.has_value() || (lora_slots->dim() == 1 && lora_slots->size(0) == B &&
                                           lora_slots->scalar_type() == at::kLong && lora_slots->is_contiguous()),
              "decode_layers: lora_slots [B] int64");
  const int64_t* rs = lora_slots.has_value() ? lora_slots->data_ptr<int64_t>() : nullptr;  // rows' adapter slots
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t MAXB = table.size(1);
  const int64_t max_q = layers[0].qkv.n, max_att = layers[0].o.k;
  int64_t max_gu = 0;  // the dense layers' widest gate|up
  int64_t moe_k = 0, moe_h = 0, moe_i = 0, moe_e = 0, moe_local = 0, moe_si = 0;  // the MoE layers' widest
  for (const PlanLayer& l : layers) {
    if (!l.moe) {
      max_gu = std::max(max_gu, l.gate_up.n);
      continue;
    }
    moe_k = std::max(moe_k, l.moe->top_k);
    moe_h = std::max(moe_h, l.moe->hidden());
    moe_i = std::max(moe_i, l.moe->inter());
    moe_e = std::max(moe_e, l.moe->router->n);
    moe_local = std::max(moe_local, l.moe->size());
    moe_si = std::max(moe_si, l.moe->shared_inter());
  }
  const int64_t NB = layers[0].pool.size(2), BS = layers[0].pool.size(3);
  for (int64_t b = 0; b < B; ++b) {  // one block table for every layer's pool (all of one geometry, checked below)
    TORCH_CHECK(sp[b] >= 0 && sp[b] < NB * BS && lp[b] >= 1 && lp[b] <= MAXB * BS,
                "decode_layers: slot or length out of range");
    for (int64_t i = 0; i < (lp[b] + BS - 1) / BS; ++i)
      TORCH_CHECK(tp[b * MAXB + i] >= 0 && tp[b * MAXB + i] < NB, "decode_layers: block out of range");
  }
  const int nt = std::max(1, at::get_num_threads());
  const std::vector<std::pair<int64_t, int64_t>> pieces = attention_pieces(tp, lp, B, MAXB, BS, layers[0].kv_heads, nt);
  const PlanLinear* head = ends ? &*plan->head : nullptr;  // the LM head, in decode_step
  bool int8_rows = head != nullptr && takes_rows(*head);  // whether any linear takes its input as int8 (VNNI)
  bool bf16_rows = head != nullptr && takes_bf16(*head);  // or as bfloat16
  for (const PlanLayer& l : layers) {
    TORCH_CHECK(l.pool.size(2) == NB && l.pool.size(3) == BS && l.pool.size(4) == D,
                "decode_layers: every layer's cache of one geometry");
    TORCH_CHECK(l.qkv.n == layers[0].qkv.n && l.o.k == layers[0].o.k, "decode_layers: layers of one attention shape");
    for (const PlanLinear* lin : {&l.qkv, &l.o, &l.gate_up, &l.down}) {
      if (l.moe && (lin == &l.gate_up || lin == &l.down)) continue;  // (the experts quantize their own rows)
      int8_rows |= takes_rows(*lin);
      bf16_rows |= takes_bf16(*lin);
    }
  }
  const auto opts = h.options();
  at::Tensor qkv = at::empty({B, max_q}, opts), q = at::empty({B, max_att}, opts), att = at::empty({B, max_att}, opts);
  at::Tensor ob = at::empty({B, hidden}, opts), gu = at::empty({B, max_gu}, opts), act = at::empty({B, max_gu / 2}, opts);
  at::Tensor dd = at::empty({B, hidden}, opts), out = at::empty({B, hidden}, opts);
  float *qkvp = qkv.data_ptr<float>(), *qp = q.data_ptr<float>(), *attp = att.data_ptr<float>();
  float *obp = ob.data_ptr<float>(), *gup = gu.data_ptr<float>(), *actp = act.data_ptr<float>();
  float *ddp = dd.data_ptr<float>(), *outp = out.data_ptr<float>(), *hp = h.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *snp = sin.data_ptr<float>();
  // int8 (int8, int4 through VNNI) or bfloat16 (bf16 through AVX-512 BF16) copies of each linear's input, one per
  // input kind: x/out (qkv, gate_up), att (o), act (down)
  tpserve::Int8Rows xq_x, xq_att, xq_act;
  if (int8_rows) {
    tpserve::resize_rows(xq_x, B, hidden);
    tpserve::resize_rows(xq_att, B, max_att);
    tpserve::resize_rows(xq_act, B, max_gu / 2);
  }
  if (bf16_rows) {
    tpserve::resize_bf16_rows(xq_x, B, hidden);
    tpserve::resize_bf16_rows(xq_att, B, max_att);
    tpserve::resize_bf16_rows(xq_act, B, max_gu / 2);
  }
  std::vector<std::vector<float>> scores(nt), lora_u(nt), normed(nt, std::vector<float>(D));
  // attention's units, per distinct window, and their partials (paged_attention_chunk): per (row, query head),
  // max_chunks of D + 2 floats from the row's first chunk
  std::vector<AttentionUnits> windows;
  std::vector<int64_t> window_of(layers.size());  // each layer's entry in `windows`
  int64_t max_chunks = 1;
  for (size_t li = 0; li < layers.size(); ++li) {
    const int64_t win = layers[li].window > 0 ? layers[li].window : window;
    size_t i = 0;
    while (i < windows.size() && windows[i].win != win) ++i;
    if (i == windows.size()) {
      windows.push_back(attention_units(pieces, lp, B, win));
      max_chunks = std::max(max_chunks, windows.back().chunks);
    }
    window_of[li] = static_cast<int64_t>(i);
  }
  const int64_t PART = D + 2;
  at::Tensor parts = at::empty({B * layers[0].heads * max_chunks * PART}, opts);
  float* partp = parts.data_ptr<float>();
  std::unique_ptr<std::atomic<int64_t>[]> next_unit(new std::atomic<int64_t>[layers.size()]);  // per layer
  for (size_t i = 0; i < layers.size(); ++i) next_unit[i].store(0);
  const LoraGroups groups(rs, B);  // the adapter rows by slot (none: the base-only step, untouched)
  const int64_t lstride = plan->lora_rp;
  std::vector<float> lora_parts(groups.size() > 0 ? nt * B * lstride : 0);
  if (groups.size() > 0)
    for (auto& u : lora_u) u.assign(B * lstride, 0.0f);
  float* x0 = x.data_ptr<float>();  // (decode_step: filled by the team)
  MoeScratch moe;  // the MoE layers' (one at a time)
  if (moe_k > 0) moe_reserve(moe, B, moe_k, moe_h, moe_i, moe_e, moe_local, moe_si, opts);
  // One row (batch 1, the commonest decode step): every thread keeps its own copy of the row's residual stream h, of
  // its normed input x and of x's int8 / bfloat16 copy, and computes them itself: the same arithmetic on the same data,
  // so the same bits in every thread. The phases that a one-row step ran on one thread while the rest of the team
  // waited (the residual add and norm, the input's copy, an MoE layer's routing and sum) then need no barrier after
  // them; an MoE layer whose experts split evenly over the team runs as moe_solo. h and the result are written back
  // at the end. Where one row's keys are in one attention chunk, each thread attends the KV heads it rotated, without
  // a barrier between.
  const bool solo = B == 1;
  std::vector<std::vector<float>> solo_h(solo ? nt : 0), solo_x(solo ? nt : 0), solo_d(solo ? nt : 0);
  std::vector<tpserve::Int8Rows> solo_q(solo ? nt : 0);
  std::vector<char> solo_moe(layers.size(), 0), moe_rows(layers.size(), 0), moe_bf16(layers.size(), 0);
  for (size_t li = 0; li < layers.size(); ++li)
    if (layers[li].moe) {
      const MoeExperts& m = *layers[li].moe;
      solo_moe[li] = solo && moe_solo_fits(m, nt);
      for (const PlanLinear& g : m.gate_up) {
        moe_rows[li] |= takes_rows(g);
        moe_bf16[li] |= takes_bf16(g);
      }
    }
  for (int i = 0; i < (solo ? nt : 0); ++i) {
    solo_h[i].resize(hidden);
    solo_x[i].resize(hidden);
    solo_d[i].resize(hidden);
    tpserve::resize_rows(solo_q[i], 1, hidden);
    tpserve::resize_bf16_rows(solo_q[i], 1, hidden);
  }

  // every linear's output blocks (and moe_solo's experts): each thread its own share first, then what the others have
  // not reached (team_split.h); one Shares per layer and linear (q/k/v, o, gate/up, down), set before the team starts
  // (and, last, the LM head's)
  std::unique_ptr<tpserve::ShareSlot[]> share_slots(new tpserve::ShareSlot[(layers.size() * 4 + 1) * nt]);
  std::vector<tpserve::Shares> shares(layers.size() * 4 + 1);
  tpserve::Shares& head_shares = shares.back();
  at::Tensor logits, head_in;  // decode_step's result, and the head's input rows where it takes some of them
  if (head != nullptr) {
    head_shares.reset(share_slots.get() + layers.size() * 4 * nt, HR > 0 ? head->blocks : 0, nt,
                      tpserve::Shares::chunk_for(block_bytes(*head)));
    logits = at::empty({HR, head->n}, opts);
    if (head_rows != nullptr && !solo) head_in = at::empty({HR, hidden}, opts);
  }
  for (size_t li = 0; li < layers.size(); ++li) {
    const PlanLinear* lins[4] = {&layers[li].qkv, &layers[li].o, &layers[li].gate_up, &layers[li].down};
    for (int w = 0; w < 4; ++w)
      shares[li * 4 + w].reset(share_slots.get() + (li * 4 + w) * nt, lins[w]->blocks, nt,
                               tpserve::Shares::chunk_for(block_bytes(*lins[w])));
    if (solo_moe[li]) {  // (an MoE layer has no gate/up of its own: that Shares holds moe_solo's k experts)
      const MoeExperts& m = *layers[li].moe;
      const int64_t expert = block_bytes(m.gate_up[0]) * m.gate_up[0].blocks + block_bytes(m.down[0]) * m.down[0].blocks;
      shares[li * 4 + 2].reset(share_slots.get() + (li * 4 + 2) * nt, m.top_k, nt, tpserve::Shares::chunk_for(expert));
    }
  }
#pragma omp parallel num_threads(nt)
  {
    const float* xin = x0;  // this layer's input: x, then the previous layer's output
    const int t = omp_get_thread_num(), T = omp_get_num_threads();
    const auto share = [&](int64_t n, int64_t& a, int64_t& b) {  // this thread's part of n work items
      a = n * t / T;
      b = n * (t + 1) / T;
    };
    int64_t a, b, c0, c1;
    // linear `which` of layer l: without adapters, the output blocks this thread claims (its own share [a, b) first,
    // then what the others have not reached: team_split.h); with them, its share [a, b): the base product, then the
    // adapters' deltas over those blocks' columns (their shrink first, over this thread's share of the inputs, and a
    // barrier: the expand needs every share)
    const auto linear = [&](const PlanLayer& l, int which, const PlanLinear& lin, const float* in,
                            const tpserve::Int8Rows* inq, float* y) {
      if (groups.size() == 0 || l.lora[which].empty()) {
        shares[(&l - layers.data()) * 4 + which].run(
            t, [&](int64_t b0, int64_t b1) { linear_range(lin, in, inq, B, y, b0, b1); });
        return;
      }
      lora_shrink(l.lora[which], groups, in, lin.k, t, T, lora_parts.data() + t * B * lstride, lstride);
#pragma omp barrier
      linear_range(lin, in, inq, B, y, a, b);
      block_columns(lin, a, b, c0, c1);
      lora_expand(l.lora[which], groups, lora_parts.data(), T, B, lstride, lora_u[t].data(), y, lin.n, c0, c1);
    };
    // h += delta (first normed in place by `pre`, where the layer has that norm) and out = rms_norm(h), over this
    // thread's rows (which stay a, b for the input copy after it)
    const auto residual_norm = [&](float* delta, const std::optional<at::Tensor>& pre, double pre_eps,
                                   const at::Tensor& w, double eps) {
      share(B, a, b);
      for (int64_t r = a; r < b; ++r) {
        if (pre.has_value())
          tpserve::rms_norm_rows(delta, pre->data_ptr<float>(), static_cast<float>(pre_eps), delta, hidden, r, r + 1);
        add_row(hp + r * hidden, delta + r * hidden, hidden);
        tpserve::rms_norm_rows(hp, w.data_ptr<float>(), static_cast<float>(eps), outp, hidden, r, r + 1);
      }
    };
    // solo: this thread's h, x (and delta, where it norms or sums one itself) and x's copy
    float *hs = solo ? solo_h[t].data() : nullptr, *xs = solo ? solo_x[t].data() : nullptr;
    float* ds = solo ? solo_d[t].data() : nullptr;
    tpserve::Int8Rows& xq_in = solo ? solo_q[t] : xq_x;  // the copy qkv and gate/up read
    // solo: h += delta (first normed by `pre` into ds, where the layer has that norm) and x = rms_norm(h), this
    // thread's own
    const auto residual_norm_solo = [&](const float* delta, const std::optional<at::Tensor>& pre, double pre_eps,
                                        const at::Tensor& w, double eps) {
      if (pre.has_value()) {
        tpserve::rms_norm_rows(delta, pre->data_ptr<float>(), static_cast<float>(pre_eps), ds, hidden, 0, 1);
        delta = ds;
      }
      add_row(hs, delta, hidden);
      tpserve::rms_norm_rows(hs, w.data_ptr<float>(), static_cast<float>(eps), xs, hidden, 0, 1);
    };
    // decode_step's start: row r of h looked up (or given) and normed into x, by whoever owns the row
    const auto first_rows = [&](float* hrows, float* xrows, int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        if (ids != nullptr) embed_row(plan->embedding, ids[r], hrows + (r - r0) * hidden);
        tpserve::rms_norm_rows(hrows, plan->first_w.data_ptr<float>(), static_cast<float>(plan->first_eps), xrows,
                               hidden, r - r0, r - r0 + 1);
      }
    };
    if (solo) {  // (every thread its own copy: the same bits)
      if (ids == nullptr) std::copy(hp, hp + hidden, hs);
      if (ends) {
        first_rows(hs, xs, 0, 1);
        xin = xs;
      }
      copy_input(layers[0].qkv, xin, xq_in, 0, 1);
    } else {
      share(B, a, b);
      if (ends) first_rows(hp + a * hidden, x0 + a * hidden, a, b);
      copy_input(layers[0].qkv, xin, xq_x, a, b);
#pragma omp barrier
    }
    for (size_t li = 0; li < layers.size(); ++li) {
      const PlanLayer& l = layers[li];
      const int64_t heads = l.heads, kvh = l.kv_heads, G = heads / kvh, width = l.qkv.n;
      const int64_t NB = l.pool.size(2), BS = l.pool.size(3), per_head = NB * BS;
      float* kc = l.pool.data_ptr<float>();
      float* vc = kc + kvh * per_head * D;
      // q, k, v
      share(l.qkv.blocks, a, b);
      linear(l, 0, l.qkv, xin, &xq_in, qkvp);
#pragma omp barrier
      if (l.q_whole_w.has_value()) {  // OLMoE: norms over the whole projections, per row
        share(B, a, b);
        for (int64_t r = a; r < b; ++r)
          whole_qk_norm_row(qkvp + r * width, l.q_whole_w->data_ptr<float>(), l.k_whole_w->data_ptr<float>(),
                            static_cast<float>(l.whole_eps), static_cast<float>(l.clip), heads, kvh, D);
#pragma omp barrier
      }
      // rotary, the cache write and attention, per (sequence, KV head)
      const AttentionUnits& au = windows[window_of[li]];
      const bool fused = solo && au.units.size() == 1;  // one row, one chunk: each thread attends what it rotated
      share(B * kvh, a, b);
      const float* qn = l.q_norm.has_value() ? l.q_norm->data_ptr<float>() : nullptr;
      const float* kn = l.k_norm.has_value() ? l.k_norm->data_ptr<float>() : nullptr;
      const float qk_eps = static_cast<float>(l.qk_eps);
      float* tmp = normed[t].data();
      for (int64_t task = a; task < b; ++task) {
        const int64_t s = task / kvh, kh = task % kvh;
        const float* row = qkvp + s * width;
        const float *c = cp + s * R, *sn = snp + s * R;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t p = kh * G + g;
          rotate_part(qp + (s * heads + p) * D, norm_head(row + p * D, qn, qk_eps, tmp, D), c, sn, R, D);
        }
        rotate_part(kc + (kh * per_head + sp[s]) * D, norm_head(row + (heads + kh) * D, kn, qk_eps, tmp, D), c, sn, R,
                    D);
        const float* v = row + (heads + kvh + kh) * D;
        std::copy(v, v + D, vc + (kh * per_head + sp[s]) * D);
      }
      if (!fused) {
#pragma omp barrier
      }
      // every row's K/V is in the cache before any row attends (several rows of one sequence: speculation)
      const float* sk = l.sinks.has_value() ? l.sinks->data_ptr<float>() : nullptr;
      // units of (rows that read the same blocks and start in the same chunk, one chunk of keys), times the KV heads
      const bool single = au.single;
      const int64_t* fr = au.firsts.data();
      const int64_t* cf = au.chunk0.data();
      // taken one at a time, the largest first (a team that splits the list evenly would leave one thread the full
      // chunks and the other the short last ones); who computes a unit changes no bit
      const int64_t total = static_cast<int64_t>(au.units.size()) * kvh;
      // the o projection's int8 copy of its input, made by whoever completes a (row, head)'s output: a head's D
      // outputs are whole blocks of 32 (D % 32 == 0) and a block's quantization reads only its own 32, so the copy
      // needs no phase (and barrier) of its own; the same bits as quantizing each row at once
      const bool o_quantized = takes_rows(l.o) && !takes_bf16(l.o) && D % 32 == 0;
      const auto quantize_head = [&](int64_t r, int64_t h) {
        if (o_quantized) tpserve::quantize_rows(attp, xq_att, r, r + 1, h * D / 32, (h + 1) * D / 32);
      };
      const auto attend = [&](int64_t task) {
        const AttentionUnit& u = au.units[task / kvh];
        const int64_t kh = task % kvh, s = u.row;
        float* part = partp + ((s * heads + kh * G) * max_chunks + (u.chunk - cf[s])) * PART;
        tpserve::paged_attention_chunk(qp + (s * heads + kh * G) * D, heads * D, kc + kh * per_head * D,
                                       vc + kh * per_head * D, tp + s * MAXB, lp + s, fr + s, u.rows, G, D, BS,
                                       static_cast<float>(l.scale), u.chunk, scores[t], part,
                                       heads * max_chunks * PART, max_chunks * PART, static_cast<float>(l.softcap));
        if (single)  // every row's keys are in one chunk: its partials are complete
          for (int64_t r = s; r < s + u.rows; ++r)
            for (int64_t h = kh * G; h < (kh + 1) * G; ++h) {
              tpserve::paged_attention_combine(partp + (r * heads + h) * max_chunks * PART, 1, D,
                                               sk ? sk + h : nullptr, attp + (r * heads + h) * D);
              quantize_head(r, h);
            }
      };
      if (fused)  // unit 0 of the KV heads [a, b) this thread rotated
        for (int64_t task = a; task < b; ++task) attend(task);
      else
        for (int64_t task; (task = next_unit[li].fetch_add(1, std::memory_order_relaxed)) < total;) attend(task);
      if (!single) {
#pragma omp barrier
        share(B * heads, a, b);
        for (int64_t task = a; task < b; ++task) {  // (row, query head): its chunks' partials, in order
          const int64_t r = task / heads, h = task % heads;
          tpserve::paged_attention_combine(partp + task * max_chunks * PART,
                                           (lp[r] - 1) / tpserve::ATTENTION_CHUNK - cf[r] + 1, D,
                                           sk ? sk + h : nullptr, attp + task * D);
          quantize_head(r, h);
        }
      }
#pragma omp barrier
      if (!o_quantized && (takes_rows(l.o) || takes_bf16(l.o))) {
        share(B, a, b);
        copy_input(l.o, attp, xq_att, a, b);
#pragma omp barrier
      }
      share(l.o.blocks, a, b);
      linear(l, 1, l.o, attp, &xq_att, obp);
#pragma omp barrier
      if (solo)
        residual_norm_solo(obp, l.attn_out_w, l.attn_out_eps, l.post_w, l.post_eps);
      else
        residual_norm(obp, l.attn_out_w, l.attn_out_eps, l.post_w, l.post_eps);  // the post-attention norm
      const float* ffn_in = solo ? xs : outp;  // the feed-forward's input row(s)
      float* ffn_out = ddp;                    // and output (solo MoE: this thread's own)
      int64_t* counts = l.counts.has_value() ? l.counts->data_ptr<int64_t>() : nullptr;
      if (solo_moe[li]) {
        if (moe_rows[li]) tpserve::quantize_rows(xs, xq_in, 0, 1, 0, hidden / 32);
        if (moe_bf16[li]) tpserve::round_rows_bf16(xs, xq_in, 0, 1);
        moe_solo(*l.moe, moe, xs, xq_in, ds, t, T, counts, shares[li * 4 + 2]);
        ffn_out = ds;
      } else if (l.moe) {  // an MoE feed-forward: router, routing, the grouped experts (moe_forward's phases)
        if (solo && t == 0) std::copy(xs, xs + hidden, outp);  // (the phases read the row from outp)
#pragma omp barrier
        if (t == 0) moe.with_shared = true;  // (where this layer has one; read after moe_route's barriers)
        moe_route(*l.moe, moe, outp, B, t, T, counts);
        moe_run(*l.moe, moe, outp, ddp, t, T);
        // no barrier (but solo: every thread reads the row): moe_run ends with each thread summing its own share of
        // the rows, share(B) as below
        if (solo) {
#pragma omp barrier
        }
      } else {
        if (solo) {
          copy_input(l.gate_up, xs, xq_in, 0, 1);
        } else {
          copy_input(l.gate_up, outp, xq_x, a, b);
#pragma omp barrier
        }
        share(l.gate_up.blocks, a, b);
        linear(l, 2, l.gate_up, ffn_in, &xq_in, gup);
#pragma omp barrier
        const int64_t I = l.gate_up.n / 2;
        share(B, a, b);
        for (int64_t r = a; r < b; ++r) act_mul_row(l.act, gup + r * 2 * I, gup + r * 2 * I + I, actp + r * I, I);
        copy_input(l.down, actp, xq_act, a, b);
#pragma omp barrier
        share(l.down.blocks, a, b);
        linear(l, 3, l.down, actp, &xq_act, ddp);
#pragma omp barrier
      }
      if (solo) {
        residual_norm_solo(ffn_out, l.ffn_out_w, l.ffn_out_eps, l.next_w, l.next_eps);
        if (li + 1 < layers.size()) copy_input(layers[li + 1].qkv, xs, xq_in, 0, 1);
        xin = xs;
        continue;
      }
      residual_norm(ddp, l.ffn_out_w, l.ffn_out_eps, l.next_w, l.next_eps);  // the next layer's input norm (or the final)
      if (li + 1 < layers.size()) copy_input(layers[li + 1].qkv, outp, xq_x, a, b);
      xin = outp;
#pragma omp barrier
    }
    if (head != nullptr && HR > 0) {  // the LM head over the final norm's rows (all, or head_rows), into the logits
      const float* in = solo ? xs : outp;
      tpserve::Int8Rows& inq = solo ? solo_q[t] : xq_x;  // (the last layer made no copy of its output)
      if (solo) {
        copy_input(*head, xs, inq, 0, 1);  // (this thread's own: no barrier)
      } else {
        share(HR, a, b);
        if (head_rows != nullptr) {
          float* rows = head_in.data_ptr<float>();
          for (int64_t r = a; r < b; ++r) std::copy(outp + head_rows[r] * hidden, outp + (head_rows[r] + 1) * hidden,
                                                    rows + r * hidden);
          in = rows;
        }
        copy_input(*head, in, inq, a, b);
#pragma omp barrier
      }
      float* y = logits.data_ptr<float>();
      head_shares.run(t, [&](int64_t b0, int64_t b1) { linear_range(*head, in, &inq, HR, y, b0, b1); });
    }
    if (solo && t == 0) {  // (every thread's copies are the same)
      std::copy(hs, hs + hidden, hp);
      std::copy(xs, xs + hidden, outp);
    }
  }
  return head != nullptr ? logits : out;
}

at::Tensor decode_layers(const c10::intrusive_ptr<DecodeLayers>& plan, at::Tensor h, const at::Tensor& x,
                         const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                         const at::Tensor& table, const at::Tensor& lens, int64_t window,
                         const std::optional<at::Tensor>& lora_slots) {
  return run_layers(plan.get(), std::move(h), x, cos, sin, slots, table, lens, window, lora_slots, false, nullptr,
                    nullptr, 0);
}

// A whole step of decode rows (or prompt tokens as rows) in one call: the token ids looked up in the plan's embedding
// table (or, where the plan has none, the rows `h` the model looked up: [B, hidden] float32, updated in place as the
// residual stream), its first norm, every layer, the final norm and the LM head over `rows` (the tokens whose logits
// the step returns; None: every token), on one team (set_ends). Returns the float32 logits [rows, vocab]: the same
// bits as decode_layers between the embedding module's lookup and the head's linear op.
at::Tensor decode_step(const c10::intrusive_ptr<DecodeLayers>& plan, const at::Tensor& ids, const at::Tensor& cos,
                       const at::Tensor& sin, const at::Tensor& slots, const at::Tensor& table, const at::Tensor& lens,
                       int64_t window, const std::optional<at::Tensor>& lora_slots,
                       const std::optional<at::Tensor>& rows, const std::optional<at::Tensor>& h) {
  TORCH_CHECK(plan->has_ends(), "decode_step: a plan without its LM head (set_ends)");
  TORCH_CHECK(ids.dim() == 1 && ids.size(0) > 0 && ids.scalar_type() == at::kLong && ids.is_contiguous(),
              "decode_step: ids [B] int64");
  const int64_t B = ids.size(0), hidden = plan->layers[0].qkv.k;
  const bool looked_up = !plan->embedding.defined();  // the caller's rows, not the plan's table
  TORCH_CHECK(looked_up == h.has_value(), "decode_step: the looked-up rows h exactly where the plan has no table");
  const int64_t* ip = ids.data_ptr<int64_t>();
  if (looked_up) {
    TORCH_CHECK(h->dim() == 2 && h->size(0) == B && h->size(1) == hidden && h->scalar_type() == at::kFloat &&
                    h->is_contiguous(),
                "decode_step: h [B, hidden] float32, contiguous");
  } else {
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(ip[b] >= 0 && ip[b] < plan->embedding.size(0), "decode_step: a token id out of range");
  }
  const int64_t* rp = nullptr;
  int64_t R = B;
  if (rows.has_value()) {
    TORCH_CHECK(rows->dim() == 1 && rows->scalar_type() == at::kLong && rows->is_contiguous(),
                "decode_step: rows [R] int64");
    rp = rows->data_ptr<int64_t>();
    R = rows->size(0);
    for (int64_t r = 0; r < R; ++r) TORCH_CHECK(rp[r] >= 0 && rp[r] < B, "decode_step: a row out of range");
  }
  TORCH_CHECK(B > 1 || rp == nullptr || (R == 1 && rp[0] == 0) || R == 0, "decode_step: rows of a one-row step");
  const auto opts = at::TensorOptions().dtype(at::kFloat);
  return run_layers(plan.get(), looked_up ? *h : at::empty({B, hidden}, opts), at::empty({B, hidden}, opts), cos, sin,
                    slots, table, lens, window, lora_slots, true, looked_up ? nullptr : ip, B == 1 ? nullptr : rp, R);
}


}  // namespace

TORCH_LIBRARY_FRAGMENT(tpserve, m) {
  m.def("decode_attention(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) pool, Tensor slots, Tensor table, "
        "Tensor lens, Tensor? q_index, int heads, int kv_heads, float scale, int window, Tensor? q_norm=None, "
        "Tensor? k_norm=None, float qk_eps=0., Tensor? sinks=None, float softcap=0.) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) h, Tensor delta, Tensor w, float eps) -> Tensor");
  m.def("whole_qk_norm_(Tensor(a!) qkv, Tensor q_w, Tensor k_w, int heads, int kv_heads, float eps, float clip) -> "
        "Tensor(a!)");
  m.def("silu_mul(Tensor gate_up, int act=0) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.class_<MoeExperts>("MoeExperts")
      .def(torch::init<>())
      .def("add_expert", &MoeExperts::add_expert)
      .def("set_activation", &MoeExperts::set_activation)
      .def("set_router", &MoeExperts::set_router)
      .def("set_shared", &MoeExperts::set_shared)
      .def("size", &MoeExperts::size);
  m.class_<DecodeLayers>("DecodeLayers")
      .def(torch::init<>())
      .def("add_linear", &DecodeLayers::add_linear)
      .def("add_mixed_linear", &DecodeLayers::add_mixed_linear)
      .def("add_layer", &DecodeLayers::add_layer)
      .def("add_moe_layer", &DecodeLayers::add_moe_layer)
      .def("set_lora", &DecodeLayers::set_lora)
      .def("set_huge_pages", &DecodeLayers::set_huge_pages)
      .def("set_qk_norm", &DecodeLayers::set_qk_norm)
      .def("set_attention", &DecodeLayers::set_attention)
      .def("set_ffn", &DecodeLayers::set_ffn)
      .def("set_whole_qk_norm", &DecodeLayers::set_whole_qk_norm)
      .def("set_ends", &DecodeLayers::set_ends)
      .def("has_ends", &DecodeLayers::has_ends)
      .def("size", &DecodeLayers::size);
  m.def("decode_layers(__torch__.torch.classes.tpserve.DecodeLayers plan, Tensor(a!) h, Tensor x, Tensor cos, "
        "Tensor sin, Tensor slots, Tensor table, Tensor lens, int window, Tensor? lora_slots=None) -> Tensor");
  m.def("decode_step(__torch__.torch.classes.tpserve.DecodeLayers plan, Tensor ids, Tensor cos, Tensor sin, "
        "Tensor slots, Tensor table, Tensor lens, int window, Tensor? lora_slots=None, Tensor? rows=None, "
        "Tensor(a!)? h=None) -> Tensor");
  m.def("moe_experts(__torch__.torch.classes.tpserve.MoeExperts plan, Tensor x, Tensor ids, Tensor weights) -> "
        "Tensor");
  m.def("moe_forward(__torch__.torch.classes.tpserve.MoeExperts plan, Tensor x, Tensor(a!)? counts=None, "
        "bool shared=True) -> Tensor");
}

TORCH_LIBRARY_IMPL(tpserve, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("add_rms_norm_", &add_rms_norm_);
  m.impl("whole_qk_norm_", &whole_qk_norm_);
  m.impl("silu_mul", &silu_mul);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("decode_layers", &decode_layers);
  m.impl("decode_step", &decode_step);
  m.impl("moe_experts", &moe_experts);
  m.impl("moe_forward", &moe_forward);
}
