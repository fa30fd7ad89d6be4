// Subnormal floats flushed to zero inside tformer's training kernels, for the kernel's own work only.
//
// A float below 2^-126 (~1.2e-38) is subnormal; an x86 core that meets one as an input or a result of a
// multiply, add or FMA takes a microcode assist of ~100+ cycles instead of ~4. The kernels' formulas make
// them from ordinary inputs: e^(-x^2/2) and the erf tail at |x| > ~13 in the exact GELU, e s (1 - s) in the
// tanh GELU's derivative once x > ~9. On wide inputs that made the GELU kernels many times slower, and
// flushing gave the time of unit-scale inputs back (docs/training.md#how-the-cpu-training-step-is-made-fast);
// where no subnormal arises the time is the same. Attention's kernels take the guard too: its backward's P
// (dP - D) can underflow where a probability near e^-87 meets a small gradient (a case built for it, 16 x 6 x
// 128 x 64 with scores 8x sharper and gradients of 1e-6, showed no subnormal and the same time either way).
//
// The guard sets MXCSR's FTZ (results flush to zero) and DAZ (inputs read as zero) bits and puts the
// caller's MXCSR back when it leaves scope: each thread of a parallel_for has its own MXCSR, so the
// guard goes inside the lambda, and PyTorch's own ops on the same threads are untouched. What it changes
// in a result is below 1.2e-38 in absolute value.
#pragma once
#include <ATen/Parallel.h>
#include <xmmintrin.h>
#include <cstdint>

namespace flush_denormal {

class Scope {
 public:
  Scope() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | FTZ | DAZ); }
  ~Scope() { _mm_setcsr(saved_); }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  static constexpr unsigned FTZ = 0x8000, DAZ = 0x0040;
  unsigned saved_;
};

// at::parallel_for with the guard in every task
template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  at::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) {
    Scope scope;
    f(b, e);
  });
}

}  // namespace flush_denormal
