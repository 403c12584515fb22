// What the torch op files share: the torch-free kernels (core/kernels.h: raw-pointer entry points over a range of
// work, also what tests/harness.cpp runs without torch) and the tensor ops one op file calls from another.
#pragma once

#include <ATen/ATen.h>

#include "core/kernels.h"

#include <cstdint>
#include <optional>
#include <vector>

namespace tpserve {

static_assert(sizeof(at::Half) == sizeof(fp16_t), "at::Half is IEEE half precision");

// a float16 tensor's data as the kernels take it
inline const fp16_t* half_data(const at::Tensor& t) { return reinterpret_cast<const fp16_t*>(t.data_ptr<at::Half>()); }

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& pool, const at::Tensor& table,
                                  const at::Tensor& lens, double scale, int64_t window,
                                  const std::optional<at::Tensor>& sinks = std::nullopt, double softcap = 0.0);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);

}  // namespace tpserve
