// A decode step's attention metadata in one call (sharding/layers/attention.py AttentionMetadata._build_decode): from
// the step's sequence table and the runner's block table, each row's position, KV slot and key count, the batch's
// block table, and the rotary rows of its positions. The same numbers take ~30 torch and numpy ops in Python; each
// costs 1-3 us when the caches are warm, but rank 0 runs them right after a step has streamed the weights through
// the caches, where each is 13-30 us (BENCHMARKS.md section 34). One op is one dispatch.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

namespace {

// seq_table [B, 4] int64: (block table row, tokens (1), start position, flags) per decode row; block_table [rows,
// blocks per sequence] int64; cos, sin: the rotary tables [positions, D] (empty tensors: no rotary rows).
// Returns (positions, slots, lens, table [B, nblk], cos rows, sin rows, arange(B), decode_len, first) where lens is
// each row's position + 1, decode_len their maximum, nblk the blocks decode_len keys take, and first the first block
// when the table's blocks, row after row, are exactly first, first + 1, ... (-1 otherwise).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t, int64_t>
decode_metadata(const at::Tensor& seq_table, const at::Tensor& block_table, int64_t block_size, const at::Tensor& cos,
                const at::Tensor& sin) {
  TORCH_CHECK(seq_table.dim() == 2 && seq_table.size(1) == 4 && seq_table.scalar_type() == at::kLong &&
                  seq_table.is_contiguous(), "decode_metadata: seq_table [B, 4] int64, contiguous");
  TORCH_CHECK(block_table.dim() == 2 && block_table.scalar_type() == at::kLong && block_table.is_contiguous(),
              "decode_metadata: block_table [rows, blocks] int64, contiguous");
  TORCH_CHECK(block_size > 0 && seq_table.size(0) > 0, "decode_metadata: a block size and at least one row");
  const int64_t B = seq_table.size(0), rows = block_table.size(0), W = block_table.size(1);
  const int64_t* st = seq_table.data_ptr<int64_t>();
  const int64_t* bt = block_table.data_ptr<int64_t>();
  at::Tensor ints = at::empty({4, B}, at::kLong);  // positions, slots, lens, arange: one allocation
  int64_t* pos = ints.data_ptr<int64_t>();
  int64_t *slots = pos + B, *lens = pos + 2 * B, *idx = pos + 3 * B;
  int64_t decode_len = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t row = st[b * 4], start = st[b * 4 + 2];
    TORCH_CHECK(row >= 0 && row < rows && start >= 0 && start / block_size < W,
                "decode_metadata: row ", b, " (table row ", row, ", position ", start, ") is outside the block table");
    pos[b] = start;
    slots[b] = bt[row * W + start / block_size] * block_size + start % block_size;
    lens[b] = start + 1;
    idx[b] = b;
    decode_len = std::max(decode_len, start + 1);
  }
  const int64_t nblk = (decode_len + block_size - 1) / block_size;
  at::Tensor table = at::empty({B, nblk}, at::kLong);
  int64_t* tp = table.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) std::copy(bt + st[b * 4] * W, bt + st[b * 4] * W + nblk, tp + b * nblk);
  int64_t first = tp[0];
  for (int64_t i = 1; i < B * nblk && first >= 0; ++i)
    if (tp[i] != first + i) first = -1;
  at::Tensor positions = ints.select(0, 0);
  at::Tensor cos_rows, sin_rows;
  if (cos.numel()) {
    TORCH_CHECK(decode_len <= cos.size(0) && decode_len <= sin.size(0),
                "decode_metadata: a position past the rotary tables");
    cos_rows = cos.index_select(0, positions);
    sin_rows = sin.index_select(0, positions);
  } else {
    cos_rows = sin_rows = at::empty({0});
  }
  return {positions, ints.select(0, 1), ints.select(0, 2), table, cos_rows, sin_rows, ints.select(0, 3), decode_len,
          first};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tpserve, m) {
  m.def("decode_metadata(Tensor seq_table, Tensor block_table, int block_size, Tensor cos, Tensor sin) -> (Tensor, "
        "Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, int, int)");
}

TORCH_LIBRARY_IMPL(tpserve, CPU, m) { m.impl("decode_metadata", &decode_metadata); }
