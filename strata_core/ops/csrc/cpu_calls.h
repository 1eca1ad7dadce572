// Bodies of ops in one kernel file that an op of another calls directly (no dispatcher, no Python between):
// cpu_layer.cpp's route_slot_ffn_cpu joins the router's product, the routing and a layer's slot experts.
#pragma once

#include <ATen/ATen.h>

namespace strata_cpu {
// strata::linear_cpu (cpu_linear.cpp): x [M, K] @ weight [N, K].T, float32.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight);
// strata::slot_ffn_cpu (cpu_experts.cpp): the pairs' SiLU-gated expert FFNs read in a buffer's rows.
at::Tensor slot_ffn(const at::Tensor& x, int64_t rep, const at::Tensor& buffer, const at::Tensor& slot,
                    at::IntArrayRef offsets, at::IntArrayRef qtypes, int64_t F);
}  // namespace strata_cpu
