// The normal CDF Phi(x) for 8 floats in AVX2 registers, and the e^(-x^2/2) it is built from: shared by
// the exact GELU of training (ops/activation_cpu.cpp: y = x Phi, dy/dx = Phi + x phi, phi = e^(-x^2/2) /
// sqrt(2 pi)) and of the whole-layer call (fused/layers.cpp: y = x Phi).
//
// Abramowitz & Stegun 7.1.26 for the tail: with z = |x| / sqrt 2 and t = 1 / (1 + p z),
// erfc(z) = t (a1 + t (a2 + t (a3 + t (a4 + t a5)))) e^(-z^2), absolute error <= 1.5e-7; the tail mass
// q = erfc(z) / 2 is Phi(x) for x < 0 and 1 - Phi(x) for x >= 0, so the left tail keeps its relative
// accuracy (no 1 + erf(x) cancellation). e^(-z^2) = e^(-x^2/2) is phi's exponential.
#pragma once
#include <immintrin.h>

#include "vec_exp.h"

namespace vec_erf {

// Phi(x); *e = e^(-x^2/2)
__attribute__((target("avx2,fma"))) inline __m256 phi_cdf8(__m256 x, __m256* e) {
  const __m256 az = _mm256_mul_ps(_mm256_set1_ps(0.7071067811865476f), _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x));
  const __m256 t = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_fmadd_ps(_mm256_set1_ps(0.3275911f), az, _mm256_set1_ps(1.0f)));
  __m256 poly = _mm256_fmadd_ps(_mm256_set1_ps(1.061405429f), t, _mm256_set1_ps(-1.453152027f));
  poly = _mm256_fmadd_ps(poly, t, _mm256_set1_ps(1.421413741f));
  poly = _mm256_fmadd_ps(poly, t, _mm256_set1_ps(-0.284496736f));
  poly = _mm256_fmadd_ps(poly, t, _mm256_set1_ps(0.254829592f));
  poly = _mm256_mul_ps(poly, t);
  *e = vec_exp::exp8(_mm256_mul_ps(_mm256_set1_ps(-0.5f), _mm256_mul_ps(x, x)));
  const __m256 q = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), poly), *e);       // the tail mass
  const __m256 right = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ);
  return _mm256_blendv_ps(q, _mm256_sub_ps(_mm256_set1_ps(1.0f), q), right);
}

}  // namespace vec_erf
