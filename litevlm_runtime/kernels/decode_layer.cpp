// A decoder layer's decode step as one call (models/decoder.DecoderLayer.forward takes it for a few rows
// over a float cache that holds them, eager on the CPU, every projection a low-bit form on the kernels):
// the same kernels in the same order as the layer's Python forward, so the same numbers to the bit.
//
// Why: the step outside its weight matmuls was ~40 operators a layer through Python and torch's
// dispatcher (norms, projections, bias, views and splits, RoPE, the cache write, attention, residuals,
// SwiGLU), 5.7 ms of a 36 ms step at InternVL3-2B shapes (int4, 2 threads, Zen 4), where llama.cpp's
// whole Q4_0 step took 33. Here they are C++ calls of the kernels' functions (kernel_ops.h) and of ATen's.
//
// A layer's parameters come as one list of tensors and one of integers (DecoderLayer.step_args builds
// them; weights/lowbit.LowBitLinear.kernel_args gives each projection's part):
//   tensors: attn_norm, ffn_norm, q_norm, k_norm (None but for Qwen3), then per projection (qkv, out,
//            gate_up, down) LINEAR_SLOTS tensors: w0, w1, w2, pre_quant_scale, bias (None where absent)
//   ints:    num_heads, num_kv_heads, head_dim, qkv layout (QKV_SIDE_BY_SIDE or QKV_GROUPED), then per
//            projection: form (4 int4, 8 int8, 16 fp16), group size, tiles8, gemv_max_rows, tile_bytes

#include <ATen/ATen.h>
#include <torch/library.h>
#include "kernel_ops.h"
#include <cmath>
#include <vector>

namespace {

constexpr int64_t LINEAR_SLOTS = 5;     // w0, w1, w2, pre_quant_scale, bias
constexpr int64_t LINEAR_INTS = 5;      // form, group size, tiles8, gemv_max_rows, tile_bytes
constexpr int64_t NORMS = 4;            // attn_norm, ffn_norm, q_norm, k_norm
constexpr int64_t HEAD_INTS = 4;        // num_heads, num_kv_heads, head_dim, layout
enum Projection { QKV, OUT, GATE_UP, DOWN, PROJECTIONS };
enum QkvLayout { QKV_SIDE_BY_SIDE = 0, QKV_GROUPED = 1 };   // [q | k | v] (Qwen2/3); per KV head [q.., k, v] (InternLM2)

struct Linear {
  const c10::optional<at::Tensor>* t;   // LINEAR_SLOTS tensors
  int64_t form, group, tiles8, gemv_max_rows, tile_bytes;
};

// x [T, K] -> [T, N]: the projection's kernel (LowBitLinear.kernel_call), then its bias in place (its forward).
at::Tensor project(const Linear& l, const at::Tensor& x) {
  at::Tensor y;
  if (l.form == 4)
    y = int4_linear(x, *l.t[0], *l.t[1], *l.t[2], l.t[3], l.group, l.gemv_max_rows, l.tile_bytes, false, false,
                    l.tiles8);
  else if (l.form == 8)
    y = int8_linear(x, *l.t[0], *l.t[1], l.gemv_max_rows, l.tile_bytes, false, false);
  else
    y = fp16_linear(x, *l.t[0], l.gemv_max_rows, l.tile_bytes, false);
  if (l.t[4].has_value()) y.add_(*l.t[4]);
  return y;
}

}  // namespace

// x [T, D] -> x [T, D] after the layer; the T rows' k, v written at the caches' last T rows (k_cache,
// v_cache [Hkv, S, D], this layer's), attended to under allowed [T, S]; cos, sin [T, 1, head_dim].
at::Tensor decode_layer(const at::Tensor& x, const std::vector<c10::optional<at::Tensor>>& tensors,
                        const std::vector<int64_t>& ints, double eps, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& allowed, const at::Tensor& cos,
                        const at::Tensor& sin) {
  TORCH_CHECK(static_cast<int64_t>(tensors.size()) == NORMS + PROJECTIONS * LINEAR_SLOTS &&
              static_cast<int64_t>(ints.size()) == HEAD_INTS + PROJECTIONS * LINEAR_INTS,
              "decode_layer: ", NORMS + PROJECTIONS * LINEAR_SLOTS, " tensors and ",
              HEAD_INTS + PROJECTIONS * LINEAR_INTS, " integers (DecoderLayer.step_args); got ", tensors.size(),
              " and ", ints.size());
  const int64_t Hq = ints[0], Hkv = ints[1], Dh = ints[2], layout = ints[3];
  TORCH_CHECK(x.dim() == 2 && k_cache.dim() == 3 && k_cache.size(0) == Hkv &&
              k_cache.size(2) == Dh && v_cache.sizes() == k_cache.sizes() && Hq % Hkv == 0 &&
              tensors[0].has_value() && tensors[1].has_value(),
              "decode_layer: x [T, D] and caches [", Hkv, ", S, ", Dh, "]; got ",
              x.sizes(), ", ", k_cache.sizes(), ", ", v_cache.sizes());
  Linear lin[PROJECTIONS];
  for (int p = 0; p < PROJECTIONS; ++p) {
    const int64_t* f = ints.data() + HEAD_INTS + p * LINEAR_INTS;
    lin[p] = {tensors.data() + NORMS + p * LINEAR_SLOTS, f[0], f[1], f[2], f[3], f[4]};
    TORCH_CHECK((lin[p].form == 4 || lin[p].form == 8 || lin[p].form == 16) && lin[p].t[0].has_value(),
                "decode_layer: projection ", p, " has no low-bit form (4, 8 or 16): ", lin[p].form);
    // (more rows would take the many-row GEMMs, whose prefill flags a decode layer does not carry)
    TORCH_CHECK(x.size(0) <= lin[p].gemv_max_rows, "decode_layer: ", x.size(0), " rows, more than projection ", p,
                "'s small calls take (", lin[p].gemv_max_rows, ")");
  }
  const int64_t T = x.size(0), S = k_cache.size(1);

  // attention: norm, q/k/v, (Qwen3's per-head norms), RoPE, the cache write, attention, out, residual
  const at::Tensor qkv = project(lin[QKV], rms_norm(x, *tensors[0], eps));
  at::Tensor q, k, v;
  if (layout == QKV_GROUPED) {            // InternLM2Layer.qkv
    const int64_t group = Hq / Hkv;
    const at::Tensor packed = qkv.view({T, Hkv, group + 2, Dh});
    q = packed.narrow(2, 0, group).reshape({T, Hq, Dh});
    k = packed.select(2, group);
    v = packed.select(2, group + 1);
  } else {                                // Qwen2Layer.qkv
    q = qkv.narrow(1, 0, Hq * Dh).view({T, Hq, Dh});
    k = qkv.narrow(1, Hq * Dh, Hkv * Dh).view({T, Hkv, Dh});
    v = qkv.narrow(1, (Hq + Hkv) * Dh, Hkv * Dh).view({T, Hkv, Dh});
  }
  if (tensors[2].has_value()) {           // Qwen3Layer.qkv
    q = rms_norm(q, *tensors[2], eps);
    k = rms_norm(k, *tensors[3], eps);
  }
  rope_(q, k, cos, sin);
  k_cache.narrow(1, S - T, T).copy_(k.transpose(0, 1));
  v_cache.narrow(1, S - T, T).copy_(v.transpose(0, 1));
  const at::Tensor attended = attention_rows(q, k_cache, v_cache, allowed, 1.0 / std::sqrt(static_cast<double>(Dh)));
  const at::Tensor h = x + project(lin[OUT], attended);

  // MLP: norm, gate and up (one stacked projection), silu(gate) * up, down, residual
  const at::Tensor gate_up = project(lin[GATE_UP], rms_norm(h, *tensors[1], eps));
  const int64_t F = gate_up.size(1) / 2;
  return h + project(lin[DOWN], silu_mul(gate_up.narrow(1, 0, F), gate_up.narrow(1, F, F)));
}

TORCH_LIBRARY_FRAGMENT(litevlm_lowbit, m) {
  m.def("decode_layer(Tensor x, Tensor?[] tensors, int[] ints, float eps, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor allowed, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(litevlm_lowbit, CPU, m) { m.impl("decode_layer", &decode_layer); }
