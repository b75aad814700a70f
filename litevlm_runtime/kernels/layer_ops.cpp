// The decoder layer's small operators as one call each, for eager runs on the CPU (models/decoder.py
// calls them where lowbit_kernels.py loaded this library): RMSNorm with its weight, RoPE of q and k in
// place, and SwiGLU's silu(gate) * up. Built into the same library as lowbit_kernels.cpp (its
// operators' namespace, TORCH_LIBRARY_FRAGMENT), with the same flags.
//
// Why: a decode step's work outside the weight matmuls is microseconds per operator, and torch spends
// more than that dispatching each one. At InternVL3-2B shapes (28 layers, int4, 2 threads, Zen 4) a step
// ran 1,564 operators; RMSNorm alone was seven of them (to float, pow, mean, add, rsqrt, mul, the weight)
// at 35 us a call, RoPE of q and k ten. Each of these is one pass over a few KB here.
//
// Numerics: rope_ computes what models/rope.py's apply_rope computes, in the same order with every
// product and sum rounded to float32 (no FMA contraction: bit-identical); rms_norm sums the squares in
// float32 in a different order than torch (within 1e-6 relative of float64); silu_mul's exponential
// is simd_avx2.h's, within 2 ulp of float32's (tests/kernels/test_layer_ops.py: both against float64).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include "kernel_ops.h"
#include "simd_avx2.h"
#include <algorithm>
#include <cmath>

namespace {

constexpr int64_t GRAIN_ELEMENTS = 1 << 15;   // elements a thread takes at least (a decode step's rows run inline)

int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, GRAIN_ELEMENTS / std::max<int64_t>(width, 1)); }

// ------------------------------------------------------------------------------------------ RMSNorm
// out = weight * (x * rsqrt(mean(x^2) + eps)), upstream's order (normalise, then the weight), rows of x
// [..., D] with unit stride over D.
void rms_norm_row(const float* x, const float* w, float* y, int64_t D, float eps) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    const __m256 x0 = _mm256_loadu_ps(x + d), x1 = _mm256_loadu_ps(x + d + 8);
    a0 = _mm256_fmadd_ps(x0, x0, a0);
    a1 = _mm256_fmadd_ps(x1, x1, a1);
  }
  float sum = hsum(_mm256_add_ps(a0, a1));
  for (; d < D; ++d) sum += x[d] * x[d];
  const float r = 1.0f / std::sqrt(sum / static_cast<float>(D) + eps);
  for (d = 0; d < D; ++d) y[d] = w[d] * (x[d] * r);
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t D = x.size(-1);
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && weight.dim() == 1 &&
              weight.size(0) == D, "rms_norm: float32 x [..., D] and weight [D]; got ", x.sizes(), " ",
              x.scalar_type(), ", ", weight.sizes(), " ", weight.scalar_type());
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor out = at::empty_like(xc);
  const int64_t rows = D ? xc.numel() / D : 0;
  const float *xp = xc.data_ptr<float>(), *wp = wc.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, grain_rows(D), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rms_norm_row(xp + r * D, wp, yp + r * D, D, e);
  });
  return out;
}

namespace {

// --------------------------------------------------------------------------------------------- RoPE
// x [T, H, D] <- x * cos + [x2, x1] * sin (sin signed: rotate_half's minus folded in, models/rope.py),
// cos, sin [T, D] (any leading shape of T rows). Each product and the sum rounded apart, as torch's
// three operators round them: the compiler must not contract them into an FMA here.
__attribute__((optimize("fp-contract=off"))) void rope_rows(float* x, int64_t T, int64_t H, int64_t st,
                                                            int64_t sh, const float* cos, const float* sin,
                                                            int64_t D) {
  const int64_t half = D / 2;
  float buf[1024];
  for (int64_t t = 0; t < T; ++t) {
    const float *c = cos + t * D, *s = sin + t * D;
    for (int64_t h = 0; h < H; ++h) {
      float* r = x + t * st + h * sh;
      for (int64_t d = 0; d < half; ++d) buf[d] = r[d] * c[d] + r[d + half] * s[d];
      for (int64_t d = half; d < D; ++d) buf[d] = r[d] * c[d] + r[d - half] * s[d];
      std::copy(buf, buf + D, r);
    }
  }
}

void check_rope_operand(const at::Tensor& x, const at::Tensor& cos, const char* name) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1 && x.size(2) % 2 == 0 &&
              x.size(2) <= 1024 && x.size(0) * x.size(2) == cos.numel(),
              "rope_: ", name, " [T, H, D] float32 with unit stride over D (D even, <= 1024) and cos, sin of T x D; got ",
              x.sizes(), " strides ", x.strides(), ", cos ", cos.sizes());
}

}  // namespace

void rope_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.sizes() == sin.sizes(), "rope_: contiguous float32 cos and sin of one shape");
  check_rope_operand(q, cos, "q");
  check_rope_operand(k, cos, "k");
  const float *c = cos.data_ptr<float>(), *s = sin.data_ptr<float>();
  for (const at::Tensor* x : {&q, &k}) {
    const int64_t T = x->size(0), H = x->size(1), D = x->size(2);
    float* p = x->data_ptr<float>();
    at::parallel_for(0, T, grain_rows(H * D), [&](int64_t t0, int64_t t1) {
      rope_rows(p + t0 * x->stride(0), t1 - t0, H, x->stride(0), x->stride(1), c + t0 * D, s + t0 * D, D);
    });
  }
}

namespace {

// ------------------------------------------------------------------------------------------- SwiGLU
void silu_mul_row(const float* g, const float* u, float* y, int64_t F) {
  int64_t f = 0;
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; f + 8 <= F; f += 8) {
    const __m256 gv = _mm256_loadu_ps(g + f);
    const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), gv));
    _mm256_storeu_ps(y + f, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + f)));
  }
  for (; f < F; ++f) y[f] = g[f] / (1.0f + std::exp(-g[f])) * u[f];
}

}  // namespace

at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.dim() == 2 && gate.sizes() == up.sizes() && gate.scalar_type() == at::kFloat &&
              up.scalar_type() == at::kFloat && gate.stride(1) == 1 && up.stride(1) == 1,
              "silu_mul: float32 gate and up [T, F] of one shape, unit stride over F; got ", gate.sizes(), " ",
              up.sizes());
  const int64_t T = gate.size(0), F = gate.size(1);
  at::Tensor out = at::empty({T, F}, gate.options());
  const float *gp = gate.data_ptr<float>(), *up_ = up.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  at::parallel_for(0, T, grain_rows(F), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) silu_mul_row(gp + t * gate.stride(0), up_ + t * up.stride(0), yp + t * F, F);
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(litevlm_lowbit, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
}

TORCH_LIBRARY_IMPL(litevlm_lowbit, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rope_", &rope_);
  m.impl("silu_mul", &silu_mul);
}
