// One-row float products, y[0 : n1-n0] = W[n0:n1] . x over K floats: the loops tformer's decode
// GEMV (gemv.cpp) and the whole-layer call (fused/layers.cpp, float weights) share. Each weight type is
// widened to float32 in registers (bf16: the 16 bits become the high half of a float32; f16:
// vcvtph2ps; int8: sign-extend and convert) and multiplied into float32 accumulators. Two widths, each
// with its own target attribute (the including file is compiled for the baseline ISA): rows512
// (AVX-512 F/BW, 16 lanes; four rows at a time keep four streams of loads in flight, with software
// prefetch) and rows256 (AVX2 + FMA + F16C, 8 lanes; one row at a time, measured faster on Zen 3).
// Include after <immintrin.h> and <c10/util/Half.h>, <c10/util/BFloat16.h>; x86 only.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>

namespace float_rows {

#define FR_512 __attribute__((target("avx512f,avx512bw,avx2,fma,f16c")))
#define FR_256 __attribute__((target("avx2,fma,f16c")))
// Software prefetch into L2 (_MM_HINT_T1), PREFETCH_GROUPS four-row groups ahead of the group being
// read: a decode matrix's rows are short (768-3072 weights) and a group reads four of them side by
// side, streams too short for the hardware prefetcher to reach its full distance (what it gained,
// and the distances tried: docs/inference.md, "The GPT-2 124M shape and float weights").
// Past the matrix's end it touches nothing it could fault on (a prefetch never faults).
constexpr int64_t PREFETCH_GROUPS = 4;

// Rows per task of a product over rows of K weights of `bytes` each: ~64 KB of weight, small enough
// to balance two threads, large enough to amortise a task; a multiple of the four-row group.
inline int64_t task_rows(int64_t K, int64_t bytes) {
  return std::max<int64_t>(4, (65536 / std::max<int64_t>(1, K * bytes)) & ~int64_t(3));
}

template <typename T>
inline void prefetch_group(const T* w0, int64_t K, int64_t k) {
  const T* p = w0 + PREFETCH_GROUPS * 4 * K + k;
  for (int r = 0; r < 4; ++r) _mm_prefetch(reinterpret_cast<const char*>(p + r * K), _MM_HINT_T1);
}

inline float scalar(float v) { return v; }
inline float scalar(at::BFloat16 v) { return static_cast<float>(v); }
inline float scalar(at::Half v) { return static_cast<float>(v); }
inline float scalar(int8_t v) { return static_cast<float>(v); }

// AVX-512: 16 lanes
// 16 weights at w -> 16 float32 lanes.
FR_512 inline __m512 load16(const float* w) { return _mm512_loadu_ps(w); }
FR_512 inline __m512 load16(const at::BFloat16* w) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
FR_512 inline __m512 load16(const at::Half* w) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
}
FR_512 inline __m512 load16(const int8_t* w) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
}

// y[0:n1-n0] = W[n0:n1] . x, x already float32 (K floats, in L1). K need not be a multiple of 16.
template <typename T>
FR_512 void rows512(const T* W, const float* x, float* y, int64_t K, int64_t n0, int64_t n1) {
  const int64_t K16 = K - K % 16;
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    const T* w0 = W + n * K; const T* w1 = w0 + K; const T* w2 = w1 + K; const T* w3 = w2 + K;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t k = 0; k < K16; k += 16) {
      prefetch_group(w0, K, k);
      __m512 xv = _mm512_loadu_ps(x + k);
      a0 = _mm512_fmadd_ps(load16(w0 + k), xv, a0);
      a1 = _mm512_fmadd_ps(load16(w1 + k), xv, a1);
      a2 = _mm512_fmadd_ps(load16(w2 + k), xv, a2);
      a3 = _mm512_fmadd_ps(load16(w3 + k), xv, a3);
    }
    float s0 = _mm512_reduce_add_ps(a0), s1 = _mm512_reduce_add_ps(a1);
    float s2 = _mm512_reduce_add_ps(a2), s3 = _mm512_reduce_add_ps(a3);
    for (int64_t k = K16; k < K; ++k) {
      s0 += scalar(w0[k]) * x[k]; s1 += scalar(w1[k]) * x[k];
      s2 += scalar(w2[k]) * x[k]; s3 += scalar(w3[k]) * x[k];
    }
    y[n - n0] = s0; y[n - n0 + 1] = s1; y[n - n0 + 2] = s2; y[n - n0 + 3] = s3;
  }
  for (; n < n1; ++n) {
    const T* w = W + n * K;
    __m512 a = _mm512_setzero_ps();
    for (int64_t k = 0; k < K16; k += 16) a = _mm512_fmadd_ps(load16(w + k), _mm512_loadu_ps(x + k), a);
    float s = _mm512_reduce_add_ps(a);
    for (int64_t k = K16; k < K; ++k) s += scalar(w[k]) * x[k];
    y[n - n0] = s;
  }
}

// AVX2: 8 lanes
FR_256 inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
FR_256 inline __m256 load8(const at::BFloat16* w) {        // bf16 bits -> the high half of float32
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
FR_256 inline __m256 load8(const at::Half* w) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
}
FR_256 inline __m256 load8(const int8_t* w) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}

FR_256 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The AVX2 loop goes one row at a time, 32 weights a step into four accumulators, with no software prefetch:
// each thread then reads one sequential stream, which the hardware prefetcher follows on its own. On Zen 3 it
// measured as fast as or faster than the loop before it (rows512's four-row groups and prefetch at 8 lanes)
// at every type, and two rows at a time slower
// (docs/inference.md#speed-against-llamacpp-and-hf-in-the-same-run). K need not be a multiple of 8.
template <typename T>
FR_256 void rows256(const T* W, const float* x, float* y, int64_t K, int64_t n0, int64_t n1) {
  const int64_t K32 = K - K % 32, K8 = K - K % 8;
  for (int64_t n = n0; n < n1; ++n) {
    const T* w = W + n * K;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t k = 0;
    for (; k < K32; k += 32) {
      a0 = _mm256_fmadd_ps(load8(w + k), _mm256_loadu_ps(x + k), a0);
      a1 = _mm256_fmadd_ps(load8(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);
      a2 = _mm256_fmadd_ps(load8(w + k + 16), _mm256_loadu_ps(x + k + 16), a2);
      a3 = _mm256_fmadd_ps(load8(w + k + 24), _mm256_loadu_ps(x + k + 24), a3);
    }
    for (; k < K8; k += 8) a0 = _mm256_fmadd_ps(load8(w + k), _mm256_loadu_ps(x + k), a0);
    float s = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; k < K; ++k) s += scalar(w[k]) * x[k];
    y[n - n0] = s;
  }
}

}  // namespace float_rows
