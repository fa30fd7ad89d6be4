// One-row matrix-vector products for decoding: y (N) = W (N, K) . x (K) [* scales (N)] [+ bias (N)].
//
// Decoding one token reads every weight once, so the speed of a decode step is the speed at which
// these loops stream W from memory. Each weight type is widened to float32 in registers (bf16: the
// 16 bits become the high half of a float32; f16: vcvtph2ps; int8: sign-extend and convert) and
// multiplied into float32 accumulators, so the only difference from a float64 reference is the
// order of the float32 sums. Rows are split between torch's intra-op threads (at::parallel_for,
// the same OpenMP pool every other torch op uses); the AVX-512 loop takes four rows at a time (four
// streams of loads in flight), the AVX2 loop one (the loops live in float_rows.h, shared with the
// whole-layer call of fused/layers.cpp, where each is said why).
// Built at first use by tformer/quant/gemv.py (torch.utils.cpp_extension.load).
//
// Two implementations of the same loops, picked per call (the `path` argument; 0: the best this CPU
// runs): 1 avx2 (AVX2 + FMA + F16C, 8 lanes: every x86 CPU since 2013, the AMD EPYC included) and
// 2 avx512 (AVX-512 F/BW, 16 lanes). The file is compiled for the baseline ISA and each loop carries
// its own target attribute, so one build serves both and __builtin_cpu_supports says which run here.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "float_rows.h"

namespace {

using float_rows::hsum8;
using float_rows::rows256;
using float_rows::rows512;

enum Path : int64_t { AUTO = 0, AVX2 = 1, AVX512 = 2 };
#define T_512 __attribute__((target("avx512f,avx512bw,avx2,fma,f16c")))
#define T_256 __attribute__((target("avx2,fma,f16c")))

bool runs(int64_t path) {
  if (path == AVX512) return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  if (path == AVX2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return false;
}

int64_t resolve(int64_t path) {
  if (path == AUTO) path = runs(AVX512) ? AVX512 : AVX2;
  TORCH_CHECK((path == AVX2 || path == AVX512) && runs(path), "gemv: this CPU cannot run path ", path,
              " (1 avx2, 2 avx512)");
  return path;
}

// y[n0:n1] -> out in the output dtype, after the optional per-row scale and bias (float32).
template <typename O>
void epilogue(const float* acc, O* out, const float* scales, const float* bias, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    float v = acc[n - n0];
    if (scales) v *= scales[n];
    if (bias) v += bias[n];
    out[n] = static_cast<O>(v);
  }
}

// The op: weight (N, K) f32|bf16|f16|int8 contiguous, x (K,) float, optional float32 scales (N,)
// and bias (N,). Returns y (N,) in x's dtype, computed in float32.
at::Tensor gemv(const at::Tensor& weight, const at::Tensor& x, const c10::optional<at::Tensor>& scales,
                const c10::optional<at::Tensor>& bias, int64_t path) {
  path = resolve(path);
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.device().is_cpu(),
              "gemv: weight must be a contiguous CPU (N, K) matrix");
  TORCH_CHECK(x.dim() == 1 && x.size(0) == weight.size(1), "gemv: x must be (K,)");
  const int64_t N = weight.size(0), K = weight.size(1);
  for (const auto* t : {&scales, &bias})
    TORCH_CHECK(!t->has_value() || ((*t)->scalar_type() == at::kFloat && (*t)->is_contiguous() && (*t)->numel() == N),
                "gemv: scales and bias must be contiguous float32 (N,)");
  at::Tensor xf = x.scalar_type() == at::kFloat ? x.contiguous() : x.to(at::kFloat);
  at::Tensor y = at::empty({N}, x.options());
  const float* xp = xf.data_ptr<float>();
  const float* sp = scales.has_value() ? scales->data_ptr<float>() : nullptr;
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const int64_t grain = float_rows::task_rows(K, weight.element_size());
  auto run = [&](auto* W, auto* out) {
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
      std::vector<float> acc(n1 - n0);
      if (path == AVX512) rows512(W, xp, acc.data(), K, n0, n1);
      else rows256(W, xp, acc.data(), K, n0, n1);
      epilogue(acc.data(), out, sp, bp, n0, n1);
    });
  };
  auto with_out = [&](auto* W) {
    switch (x.scalar_type()) {
      case at::kFloat: run(W, y.data_ptr<float>()); break;
      case at::kBFloat16: run(W, y.data_ptr<at::BFloat16>()); break;
      case at::kHalf: run(W, y.data_ptr<at::Half>()); break;
      default: TORCH_CHECK(false, "gemv: x must be float32, bfloat16 or float16");
    }
  };
  switch (weight.scalar_type()) {
    case at::kFloat: with_out(weight.data_ptr<float>()); break;
    case at::kBFloat16: with_out(weight.data_ptr<at::BFloat16>()); break;
    case at::kHalf: with_out(weight.data_ptr<at::Half>()); break;
    case at::kChar: with_out(weight.data_ptr<int8_t>()); break;
    default: TORCH_CHECK(false, "gemv: weight dtype must be float32, bfloat16, float16 or int8");
  }
  return y;
}

// One row of int4 weights: groups of 32 along K in 16 bytes (byte j: weight j in the low nibble,
// weight j + 16 in the high one), w = q * s_g + c_g with q in 0..15. Per group the 32 products q x
// are summed in a vector, scaled by s_g once; the offsets add c_g * (sum of x over the group).
T_512 void q4_row512(const uint8_t* w, const float* s, const float* c, const float* x, const float* xsum,
                     int64_t G, float* out) {
  const __m512i low = _mm512_set1_epi32(0xF);
  __m512 acc = _mm512_setzero_ps();
  float off = 0;
  for (int64_t g = 0; g < G; ++g) {
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * g)));
    __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, low)), _mm512_loadu_ps(x + 32 * g));
    t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), _mm512_loadu_ps(x + 32 * g + 16), t);
    acc = _mm512_fmadd_ps(t, _mm512_set1_ps(s[g]), acc);
    off += c[g] * xsum[g];
  }
  *out = _mm512_reduce_add_ps(acc) + off;
}

// The same with 8 lanes: each group's 16 bytes as two halves of 8 (weights 0..7 | 8..15 in the low
// nibbles, 16..23 | 24..31 in the high ones).
T_256 void q4_row256(const uint8_t* w, const float* s, const float* c, const float* x, const float* xsum,
                     int64_t G, float* out) {
  const __m256i low = _mm256_set1_epi32(0xF);
  __m256 acc = _mm256_setzero_ps();
  float off = 0;
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* b = w + 16 * g;
    const float* xg = x + 32 * g;
    __m256i v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
    __m256i v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 8)));
    __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v0, low)), _mm256_loadu_ps(xg));
    t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v1, low)), _mm256_loadu_ps(xg + 8), t);
    t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4)), _mm256_loadu_ps(xg + 16), t);
    t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4)), _mm256_loadu_ps(xg + 24), t);
    acc = _mm256_fmadd_ps(t, _mm256_set1_ps(s[g]), acc);
    off += c[g] * xsum[g];
  }
  *out = hsum8(acc) + off;
}

// y (N,) = W x + bias for int4 W given as packed (N, K/2) uint8, scales and offsets (N, K/32) float32.
at::Tensor gemv_q4(const at::Tensor& packed, const at::Tensor& x, const at::Tensor& scales, const at::Tensor& offsets,
                   const c10::optional<at::Tensor>& bias, int64_t path) {
  path = resolve(path);
  TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous() && packed.scalar_type() == at::kByte,
              "gemv_q4: packed must be a contiguous (N, K/2) uint8 matrix");
  const int64_t N = packed.size(0), K = 2 * packed.size(1), G = K / 32;
  TORCH_CHECK(K % 32 == 0 && x.dim() == 1 && x.size(0) == K, "gemv_q4: x must be (K,), K a multiple of 32");
  for (const auto* t : {&scales, &offsets})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == N * G,
                "gemv_q4: scales and offsets must be contiguous float32 (N, K/32)");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->numel() == N), "gemv_q4: bias must be float32 (N,)");
  at::Tensor xf = x.scalar_type() == at::kFloat ? x.contiguous() : x.to(at::kFloat);
  const float* xp = xf.data_ptr<float>();
  std::vector<float> xsum(G);
  for (int64_t g = 0; g < G; ++g) { float a = 0; for (int64_t k = 0; k < 32; ++k) a += xp[32 * g + k]; xsum[g] = a; }
  at::Tensor y = at::empty({N}, x.options());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>(); const float* cp = offsets.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  auto run = [&](auto* out) {
    at::parallel_for(0, N, std::max<int64_t>(4, 65536 / (K / 2)), [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        float v;
        if (path == AVX512) q4_row512(wp + n * (K / 2), sp + n * G, cp + n * G, xp, xsum.data(), G, &v);
        else q4_row256(wp + n * (K / 2), sp + n * G, cp + n * G, xp, xsum.data(), G, &v);
        out[n] = static_cast<std::remove_pointer_t<decltype(out)>>(v + (bp ? bp[n] : 0.0f));
      }
    });
  };
  switch (x.scalar_type()) {
    case at::kFloat: run(y.data_ptr<float>()); break;
    case at::kBFloat16: run(y.data_ptr<at::BFloat16>()); break;
    case at::kHalf: run(y.data_ptr<at::Half>()); break;
    default: TORCH_CHECK(false, "gemv_q4: x must be float32, bfloat16 or float16");
  }
  return y;
}

// Several rows at once (a prompt): y (M, N) = x (M, K) . W (N, K)^T [+ bias], W float32, bfloat16 or
// float16 as stored, widened in registers as the one-row loops do, x float32. A register tile of RM
// rows of x by RN rows of W keeps RM x RN eight-lane accumulators along K (4 x 3 = 12 of AVX2's 16
// registers, with three for W and one for x): per eight k, RM + RN loads feed RM x RN FMAs, so the
// loop is bound by the FMA units, not by loads, and W is never copied (a widened copy of a
// 768 x 3072 float16 matrix is 9.4 MB written and read again per product). Each tile runs the whole of
// K at once, so its horizontal sums and its write of y come once: blocks of 512 k (4 x 512 floats of x, 8 KB,
// kept in L1) measured slower, blocks of 768 or 1536 in between
// (docs/inference.md#speed-against-llamacpp-and-hf-in-the-same-run). Each thread takes a contiguous range of
// W rows, walked in panels of about 192 KB (in L2, reused by every tile of x rows). The same products in
// float32 as F.linear up to the order of the sums.
template <int RM, int RN, typename T>
T_256 void tile256(const float* x, const T* w, int64_t K, float* y, int64_t ldy) {   // x, w: rows K apart
  __m256 acc[RM][RN];
  for (int i = 0; i < RM; ++i)
    for (int j = 0; j < RN; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t k8 = K / 8 * 8;
  for (int64_t k = 0; k < k8; k += 8) {
    __m256 wv[RN];
    for (int j = 0; j < RN; ++j) wv[j] = float_rows::load8(w + j * K + k);
    for (int i = 0; i < RM; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * K + k);
      for (int j = 0; j < RN; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < RM; ++i)
    for (int j = 0; j < RN; ++j) {
      float s = hsum8(acc[i][j]);
      for (int64_t k = k8; k < K; ++k) s += x[i * K + k] * float_rows::scalar(w[j * K + k]);
      y[i * ldy + j] += s;
    }
}

// Rows [n0, n1) of W against all M rows of x, RN at a time (fewer at the end); y's columns n0..n1.
template <int RM, typename T>
T_256 void rows_of_x(const float* x, const T* W, int64_t K, int64_t n0, int64_t n1, float* y, int64_t N) {
  int64_t n = n0;
  for (; n + 3 <= n1; n += 3) tile256<RM, 3>(x, W + n * K, K, y + n, N);
  if (n1 - n == 2) tile256<RM, 2>(x, W + n * K, K, y + n, N);
  else if (n1 - n == 1) tile256<RM, 1>(x, W + n * K, K, y + n, N);
}

template <typename T>
void gemm256(const float* x, int64_t M, const T* W, int64_t N, int64_t K, float* y) {
  const int64_t panel = std::max<int64_t>(3, (196608 / std::max<int64_t>(1, K * int64_t(sizeof(T)))) / 3 * 3);
  at::parallel_for(0, (N + 2) / 3, 1, [&](int64_t g0, int64_t g1) {
    const int64_t lo = 3 * g0, hi = std::min(N, 3 * g1);
    for (int64_t p0 = lo; p0 < hi; p0 += panel) {
      const int64_t p1 = std::min(hi, p0 + panel);
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) rows_of_x<4>(x + m * K, W, K, p0, p1, y + m * N, N);
      const float* xr = x + m * K;
      float* yr = y + m * N;
      if (M - m == 3) rows_of_x<3>(xr, W, K, p0, p1, yr, N);
      else if (M - m == 2) rows_of_x<2>(xr, W, K, p0, p1, yr, N);
      else if (M - m == 1) rows_of_x<1>(xr, W, K, p0, p1, yr, N);
    }
  });
}

// The op: weight (N, K) float32 | bfloat16 | float16 contiguous, x (M, K) (any float dtype; computed
// in float32), optional float32 bias (N,). Returns y (M, N) in x's dtype. AVX2 + FMA + F16C only.
at::Tensor gemm(const at::Tensor& weight, const at::Tensor& x, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(runs(AVX2), "gemm: this CPU lacks AVX2, FMA or F16C");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.device().is_cpu(),
              "gemm: weight must be a contiguous CPU (N, K) matrix");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == weight.size(1), "gemm: x must be (M, K)");
  const int64_t M = x.size(0), N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N),
              "gemm: bias must be contiguous float32 (N,)");
  at::Tensor xf = x.scalar_type() == at::kFloat ? x.contiguous() : x.to(at::kFloat).contiguous();
  // the tiles add into y: it starts as a fresh copy of the bias (clone: expand + contiguous hands back the
  // bias itself when M == 1), or zeros
  at::Tensor y = bias.has_value() ? bias->expand({M, N}).clone(at::MemoryFormat::Contiguous)
                                  : at::zeros({M, N}, xf.options());
  const float* xp = xf.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  switch (weight.scalar_type()) {
    case at::kFloat: gemm256(xp, M, weight.data_ptr<float>(), N, K, yp); break;
    case at::kBFloat16: gemm256(xp, M, weight.data_ptr<at::BFloat16>(), N, K, yp); break;
    case at::kHalf: gemm256(xp, M, weight.data_ptr<at::Half>(), N, K, yp); break;
    default: TORCH_CHECK(false, "gemm: weight dtype must be float32, bfloat16 or float16");
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// The paths this CPU runs (1 avx2, 2 avx512), best last.
std::vector<int64_t> paths() {
  std::vector<int64_t> out;
  for (int64_t p : {AVX2, AVX512})
    if (runs(p)) out.push_back(p);
  return out;
}

}  // namespace

TORCH_LIBRARY(tformer_gemv, m) {
  m.def("gemv(Tensor weight, Tensor x, Tensor? scales=None, Tensor? bias=None, int path=0) -> Tensor");
  m.def("gemv_q4(Tensor packed, Tensor x, Tensor scales, Tensor offsets, Tensor? bias=None, int path=0) -> Tensor");
  m.def("gemm(Tensor weight, Tensor x, Tensor? bias=None) -> Tensor");
  m.def("paths() -> int[]");
}

TORCH_LIBRARY_IMPL(tformer_gemv, CPU, m) {
  m.impl("gemv", &gemv);
  m.impl("gemv_q4", &gemv_q4);
  m.impl("gemm", &gemm);
}
TORCH_LIBRARY_IMPL(tformer_gemv, CompositeExplicitAutograd, m) { m.impl("paths", &paths); }
