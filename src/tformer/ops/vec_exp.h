// e^x for 8 floats in AVX2 registers: shared by the whole-layer call (fused/layers.cpp: softmax over
// the cache, SiLU, GELU), the short-context attention kernel (ops/attention_cpu.cpp) and the training
// tanh GELU (ops/activation_cpu.cpp).
//
// x = n ln2 + r, |r| <= ln2 / 2, with n = round(x / ln2), ln2 split in two parts so n ln2 is exact
// enough; e^r by its degree-7 Taylor-like polynomial 1 + r + r^2 (c2 + c3 r + ...) with Cephes'
// minimax coefficients for expf (relative error ~1e-7 on the interval); 2^n built in the exponent bits.
// x is clamped to [-87.3, 88.3], where e^x and 2^n stay normal floats (e^-87.3 ~ 1e-38 stands for 0,
// and -inf, a masked score, becomes that).
#pragma once
#include <immintrin.h>

namespace vec_exp {

__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);           // x - n ln2_hi
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);               //   - n ln2_lo
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));   // 1 + r + r^2 p
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));                                    // * 2^n
}

}  // namespace vec_exp
