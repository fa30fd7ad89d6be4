// MLP activations and their derivatives in one pass each, for training on a CPU
// (tformer/ops/activation_cpu.py). Each activation is a pair of 8-lane functions (value; derivative
// times the incoming gradient) with scalar twins for the tail, run over the activation tensor by one
// driver each way:
//
//   relu2      y = max(x, 0)^2                dx = 2 max(x, 0) g
//   gelu_tanh  y = x s,  s = (1 + tanh u) / 2 = 1 / (1 + e^-2u),  u = sqrt(2/pi) (x + 0.044715 x^3)
//              dx = (s + 2 x s (1 - s) sqrt(2/pi) (1 + 3 * 0.044715 x^2)) g
//
// Why: PyTorch's ops take two passes forward and two backward for ReLU^2 (relu, then the square), each
// over an activation of batch x context x 4d floats that has left the cache by then (at tformer's CPU
// training shape 768 x 512 floats, 1.5 MB a layer); and ATen's kernels for GELU's tanh form are several
// times slower than one pass when it runs its AVX2 code (benchmarks/training/cpu_kernels.py; figures:
// docs/training.md#how-the-cpu-training-step-is-made-fast). ReLU^2 gives the
// same floats bit for bit as the PyTorch Function it replaces (x2 is exact). In the tanh form 1 - s is
// computed as e^-2u s: where s rounds to 1, 1 - s in float would be 0 or 6e-8, not the e^-2u it is.
//
//   gelu       (exact, erf form) y = x Phi(x),  dy/dx = Phi(x) + x phi(x),  phi(x) = e^(-x^2/2) / sqrt(2 pi)
//              forward writes y and dy/dx together (gelu_and_grad); the backward is then g dy/dx, one
//              multiply. Why: ATen's AVX2 GELU is already one pass forward, but its backward evaluates
//              erf and e^x again; and erf's own formula (Abramowitz & Stegun 7.1.26, which ATen also
//              uses) needs e^(-z^2) at z = x / sqrt 2, which is e^(-x^2/2), phi's exponential: the
//              derivative costs the forward a multiply-add and a store. Phi and e^(-x^2/2) come from
//              ops/vec_erf.h (shared with the whole-layer call's GELU in fused/layers.cpp).
//
// float32, or bfloat16 for ReLU^2 and the tanh GELU (a training step under autocast: widened, computed in
// float32, rounded once), contiguous; AVX2 + FMA (ops/vec_exp.h for e^x), split over
// torch's threads, subnormals flushed inside each task (ops/flush_denormal.h).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <tuple>

#include "flush_denormal.h"
#include "vec_bf16.h"
#include "vec_erf.h"
#include "vec_exp.h"

namespace {

#define T_256 __attribute__((target("avx2,fma")))
using at::Tensor;
constexpr int64_t GRAIN = 1 << 14;        // floats per task: 64 KB, enough to pay for a thread's wake-up

// ---------------------------------------------------------------- ReLU^2
struct ReLU2 {
  T_256 static __m256 value(__m256 x) {
    const __m256 r = _mm256_max_ps(x, _mm256_setzero_ps());
    return _mm256_mul_ps(r, r);
  }
  T_256 static __m256 grad(__m256 x, __m256 g) {
    const __m256 r = _mm256_max_ps(x, _mm256_setzero_ps());
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(2.0f), r), g);
  }
  static float value1(float x) { const float r = x > 0.0f ? x : 0.0f; return r * r; }
  static float grad1(float x, float g) { return 2.0f * (x > 0.0f ? x : 0.0f) * g; }
};

// ---------------------------------------------------------------- GELU, tanh form
struct GELUTanh {
  static constexpr float S2PI = 0.7978845608028654f;     // sqrt(2 / pi)
  static constexpr float A = 0.044715f;

  // s = 1 / (1 + e^-2u); through *du, du/dx, and through *rest, 1 - s = e^-2u s
  T_256 static __m256 sigmoid_2u(__m256 x, __m256* du, __m256* rest) {
    const __m256 x2 = _mm256_mul_ps(x, x);
    const __m256 u = _mm256_mul_ps(_mm256_set1_ps(S2PI), _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(A), x2), x, x));
    *du = _mm256_mul_ps(_mm256_set1_ps(S2PI), _mm256_fmadd_ps(_mm256_set1_ps(3.0f * A), x2, _mm256_set1_ps(1.0f)));
    const __m256 e = vec_exp::exp8(_mm256_mul_ps(_mm256_set1_ps(-2.0f), u));
    const __m256 s = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    *rest = _mm256_mul_ps(e, s);
    return s;
  }
  T_256 static __m256 value(__m256 x) {
    __m256 du, rest;
    return _mm256_mul_ps(x, sigmoid_2u(x, &du, &rest));
  }
  T_256 static __m256 grad(__m256 x, __m256 g) {
    __m256 du, rest;
    const __m256 s = sigmoid_2u(x, &du, &rest);
    const __m256 ds = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(2.0f), s), rest);     // ds/du = 2 s (1 - s)
    return _mm256_mul_ps(_mm256_fmadd_ps(_mm256_mul_ps(x, ds), du, s), g);             // (s + x ds/du du/dx) g
  }
  // the scalar tail through libm, e^-2u's exponent clamped as exp8 clamps it (an inf would make
  // e s = inf 0 = nan)
  static float e_2u(float x) { return std::exp(std::fmin(-2.0f * S2PI * (x + A * x * x * x), 88.3f)); }
  static float value1(float x) { return x / (1.0f + e_2u(x)); }
  static float grad1(float x, float g) {
    const float e = e_2u(x), s = 1.0f / (1.0f + e);
    return (s + 2.0f * x * s * (e * s) * S2PI * (1.0f + 3.0f * A * x * x)) * g;
  }
};

// ---------------------------------------------------------------- GELU, exact (erf) form
struct GELUErf {
  static constexpr float R2 = 0.7071067811865476f;       // 1 / sqrt 2
  static constexpr float R2PI = 0.3989422804014327f;     // 1 / sqrt(2 pi)

  // y = x Phi(x) and *d = Phi(x) + x phi(x) (vec_erf.h: Phi and phi's exponential from one e^x)
  T_256 static __m256 value_and_grad(__m256 x, __m256* d) {
    __m256 e;
    const __m256 cdf = vec_erf::phi_cdf8(x, &e);
    *d = _mm256_fmadd_ps(_mm256_mul_ps(x, _mm256_set1_ps(R2PI)), e, cdf);
    return _mm256_mul_ps(x, cdf);
  }
  static float value_and_grad1(float x, float* d) {
    const float cdf = 0.5f * std::erfc(-x * R2);
    *d = cdf + x * R2PI * std::exp(-0.5f * x * x);
    return x * cdf;
  }
};

// ---------------------------------------------------------------- drivers
// 8 values (or one) in the tensor's type: float32 as they are; bfloat16 (a training step under autocast)
// widened exactly and rounded once, to nearest even, when stored (ops/vec_bf16.h), so a bfloat16 result
// is the float32 kernel's on the widened input, rounded
T_256 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
T_256 inline __m256 load8(const at::BFloat16* p) { return vec_bf16::load8(p); }
T_256 inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
T_256 inline void store8(at::BFloat16* p, __m256 v) { vec_bf16::store8(p, v); }

template <class F, class T>
T_256 void forward_range(const T* x, T* y, int64_t begin, int64_t end) {
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) store8(y + i, F::value(load8(x + i)));
  for (; i < end; ++i) y[i] = F::value1(float(x[i]));
}

template <class F, class T>
T_256 void backward_range(const T* g, const T* x, T* dx, int64_t begin, int64_t end) {
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) store8(dx + i, F::grad(load8(x + i), load8(g + i)));
  for (; i < end; ++i) dx[i] = F::grad1(float(x[i]), float(g[i]));
}

void check(const Tensor& t, const char* name) {
  TORCH_CHECK((t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16) && t.is_contiguous(),
              "activation: ", name, " must be contiguous float32 or bfloat16");
}

template <class F, class T>
Tensor forward_as(const Tensor& x) {
  Tensor y = at::empty_like(x);
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  flush_denormal::parallel_for(0, x.numel(), GRAIN, [&](int64_t b, int64_t e) { forward_range<F, T>(xp, yp, b, e); });
  return y;
}

template <class F>
Tensor forward(const Tensor& x) {
  check(x, "x");
  return x.scalar_type() == at::kFloat ? forward_as<F, float>(x) : forward_as<F, at::BFloat16>(x);
}

template <class F, class T>
Tensor backward_as(const Tensor& g, const Tensor& x) {
  Tensor dx = at::empty_like(x);
  const T* gp = g.data_ptr<T>(); const T* xp = x.data_ptr<T>();
  T* dp = dx.data_ptr<T>();
  flush_denormal::parallel_for(0, x.numel(), GRAIN, [&](int64_t b, int64_t e) { backward_range<F, T>(gp, xp, dp, b, e); });
  return dx;
}

template <class F>
Tensor backward(const Tensor& g, const Tensor& x) {
  check(g, "g");
  check(x, "x");
  TORCH_CHECK(g.sizes() == x.sizes() && g.scalar_type() == x.scalar_type(),
              "activation backward: g and x must have one shape and one type");
  return x.scalar_type() == at::kFloat ? backward_as<F, float>(g, x) : backward_as<F, at::BFloat16>(g, x);
}

// (y, dy/dx) of the exact GELU in one pass, float32 only: in bfloat16 ATen's own GELU (AVX-512 where the CPU
// has it) measured faster in whole steps than this kernel widening
// (docs/training-speed-log.md#issue-26-the-recipes-the-kernels-and-three-machines)
T_256 void gelu_range(const float* x, float* y, float* d, int64_t begin, int64_t end) {
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    __m256 dv;
    _mm256_storeu_ps(y + i, GELUErf::value_and_grad(_mm256_loadu_ps(x + i), &dv));
    _mm256_storeu_ps(d + i, dv);
  }
  for (; i < end; ++i) y[i] = GELUErf::value_and_grad1(x[i], d + i);
}

std::tuple<Tensor, Tensor> gelu_and_grad(const Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "gelu_and_grad: x must be contiguous float32");
  Tensor y = at::empty_like(x), d = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>(); float* dp = d.data_ptr<float>();
  flush_denormal::parallel_for(0, x.numel(), GRAIN, [&](int64_t b, int64_t e) { gelu_range(xp, yp, dp, b, e); });
  return {y, d};
}

}  // namespace

TORCH_LIBRARY(tformer_activation, m) {
  m.def("relu2(Tensor x) -> Tensor");
  m.def("relu2_backward(Tensor g, Tensor x) -> Tensor");
  m.def("gelu_tanh(Tensor x) -> Tensor");
  m.def("gelu_tanh_backward(Tensor g, Tensor x) -> Tensor");
  m.def("gelu_and_grad(Tensor x) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tformer_activation, CPU, m) {
  m.impl("relu2", &forward<ReLU2>);
  m.impl("relu2_backward", &backward<ReLU2>);
  m.impl("gelu_tanh", &forward<GELUTanh>);
  m.impl("gelu_tanh_backward", &backward<GELUTanh>);
  m.impl("gelu_and_grad", &gelu_and_grad);
}
