// bfloat16 <-> float32 for 8 values in AVX2 registers: shared by the training kernels that read and write
// bfloat16 under autocast (ops/attention_cpu.cpp: attention and RoPE; ops/activation_cpu.cpp: the MLP
// activations). A bfloat16 is a float32's top 16 bits, so widening is exact (a shift); narrowing rounds
// to nearest even as c10::BFloat16 and Tensor.to(torch.bfloat16) do: add 0x7FFF plus the lowest kept bit,
// keep the top half; a NaN becomes 0x7FC0 (the carry could otherwise turn one into an infinity).
#pragma once
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <cstdint>

namespace vec_bf16 {

// 8 bfloat16 at p as float32
__attribute__((target("avx2,fma"))) inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 8 float32 rounded to bfloat16, to nearest even, at p
__attribute__((target("avx2,fma"))) inline void store8(c10::BFloat16* p, __m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

}  // namespace vec_bf16
