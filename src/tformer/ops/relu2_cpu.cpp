// ReLU(x)^2 and its derivative in one pass each, for training on a CPU (tformer/ops/relu2_cpu.py).
//
//   forward:  y = max(x, 0)^2                 (read x, write y)
//   backward: dx = 2 max(x, 0) g              (read x and g, write dx)
//
// PyTorch's ops take two passes forward (relu, then the square) and two backward, each over an
// activation of batch x context x 4d floats that has left the cache by then: at tformer's CPU training
// shape (768 x 512 floats, 1.5 MB a layer) the passes, not the arithmetic, are the cost. float32,
// contiguous; AVX2 (8 lanes, every x86 CPU this project runs on), split over torch's threads.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <cstdint>

namespace {

#define T_256 __attribute__((target("avx2,fma")))
using at::Tensor;
constexpr int64_t GRAIN = 1 << 15;        // floats per task: 128 KB, enough to pay for a thread's wake-up

T_256 void forward_range(const float* x, float* y, int64_t begin, int64_t end) {
  const __m256 zero = _mm256_setzero_ps();
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m256 r = _mm256_max_ps(_mm256_loadu_ps(x + i), zero);
    _mm256_storeu_ps(y + i, _mm256_mul_ps(r, r));
  }
  for (; i < end; ++i) { const float r = x[i] > 0.0f ? x[i] : 0.0f; y[i] = r * r; }
}

T_256 void backward_range(const float* g, const float* x, float* dx, int64_t begin, int64_t end) {
  const __m256 zero = _mm256_setzero_ps(), two = _mm256_set1_ps(2.0f);
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m256 r = _mm256_max_ps(_mm256_loadu_ps(x + i), zero);
    _mm256_storeu_ps(dx + i, _mm256_mul_ps(_mm256_mul_ps(two, r), _mm256_loadu_ps(g + i)));
  }
  for (; i < end; ++i) dx[i] = 2.0f * (x[i] > 0.0f ? x[i] : 0.0f) * g[i];
}

void check(const Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(), "relu2: ", name, " must be contiguous float32");
}

Tensor relu2(const Tensor& x) {
  check(x, "x");
  Tensor y = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, x.numel(), GRAIN, [&](int64_t b, int64_t e) { forward_range(xp, yp, b, e); });
  return y;
}

Tensor relu2_backward(const Tensor& g, const Tensor& x) {
  check(g, "g");
  check(x, "x");
  TORCH_CHECK(g.sizes() == x.sizes(), "relu2_backward: g and x must have one shape");
  Tensor dx = at::empty_like(x);
  const float* gp = g.data_ptr<float>(); const float* xp = x.data_ptr<float>();
  float* dp = dx.data_ptr<float>();
  at::parallel_for(0, x.numel(), GRAIN, [&](int64_t b, int64_t e) { backward_range(gp, xp, dp, b, e); });
  return dx;
}

}  // namespace

TORCH_LIBRARY(tformer_relu2, m) {
  m.def("relu2(Tensor x) -> Tensor");
  m.def("relu2_backward(Tensor g, Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(tformer_relu2, CPU, m) {
  m.impl("relu2", &relu2);
  m.impl("relu2_backward", &relu2_backward);
}
