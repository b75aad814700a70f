// The kernels' operators as C++ functions (defined in lowbit_kernels.cpp and layer_ops.cpp, registered
// there as torch operators), for decode_layer.cpp to call directly: a decode layer of ~40 operators
// through torch's dispatcher from Python cost more than its small operators' work (decode_layer.cpp).
#pragma once
#include <ATen/ATen.h>

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros,
                       const c10::optional<at::Tensor>& pqs, int64_t group_size, int64_t gemv_max_rows,
                       int64_t tile_bytes, bool prefill_bf16, bool prefill_int8, bool tiles8);
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t gemv_max_rows,
                       int64_t tile_bytes, bool prefill_bf16, bool prefill_int8);
at::Tensor fp16_linear(const at::Tensor& x, const at::Tensor& weight, int64_t gemv_max_rows, int64_t tile_bytes,
                       bool prefill_bf16);
at::Tensor attention_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& allowed,
                          double scale);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void rope_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up);
