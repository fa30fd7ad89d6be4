// Whole pre-norm decoder layers, each for N new tokens in one call (a prompt, a decode step or a
// speculative check, on block-quantised or float weights; fused/run.py drives them): the Llama
// shape (RMSNorm, GQA attention with rotate-half RoPE, SwiGLU, no biases) or the GPT-2 shape
// (LayerNorm with biases, learned positions added before the first layer, so no rotation here, a
// GELU MLP, biases on every product), with the Gemma 2 / 3 switches: (1 + w) gains (given as 1 + w),
// a GELU-gated feed-forward, a score scale and soft-cap, norms after the sub-layers, a per-layer sliding
// window and the windowed layers' own rotary tables. Embedding scale and logit soft-cap are run.py's.
// Token i belongs to cache row r_i = rows[i] (r_i = i without `rows`: one token per row, a decode
// step), writes its key and value at cache index w_i = write_index[i], is rotated at position
// p_i = positions[i] and attends over the keys j <= w_i of its row that valid[r_i, j] marks real (all
// of them without `valid`): an eager cache has w_i = p_i = the length held (+ t for the t-th of
// several new tokens of a row); a static one (the server's pool) its per-row index and count.
//   h = norm_attn(x)       RMSNorm x / sqrt(mean(x^2) + eps) g, or LayerNorm (x - mean) / sqrt(var + eps) g + b
//   [q | k | v] = h . Wqkv^T (+ b)                              (one product)
//   q_h <- RMSNorm(q_h) gq, k_h <- RMSNorm(k_h) gk               (QK-norm with gains, Qwen3: each head, eps)
//   q, k <- q cos[p_i] + rot(q) sin[p_i], rot(u) = [-u_hi, u_lo]   (with RoPE: each head, hs/2 halves)
//   K[r_i, w_i] <- k, V[r_i, w_i] <- v                          (the cache buffers (rows, nkv, L, hs),
//                                                                float32, bfloat16 or float16)
//   s_j = q_h . K_j scale (scale 1/sqrt(hs) unless given), s_j <- cap tanh(s_j / cap) (with a soft-cap)
//   o_h = sum_j softmax_j(s_j) V_j over the real j <= w_i, and w_i - j < window in a windowed layer
//                                          (zero if there is none; head h reads kv head h / (nh/nkv))
//   x <- x + o . Wo^T (+ b)                 (with post norms: x <- x + norm_post(o . Wo^T))
//   h = norm_ffn(x);  x <- x + (silu(h Wg^T) * (h Wu^T)) . Wd^T        (SwiGLU; GeGLU: gelu for silu)
//                 or  x <- x + act(h Wu^T + b) . Wd^T + b,  act GELU (tanh or erf form), ReLU, ReLU^2 or SiLU
//                                          (with post norms, the product normalised before the add)
// Every token's key and value is written before any token attends, so several new tokens of one
// row (a speculative check, a prompt) see each other causally through the cache: token i reads the
// row's keys up to its own index, which holds the earlier new tokens and not the later ones.
// A product is either block tiles (formats 0-2: the tile kernels of qgemm_tiles on activations
// quantised once per input, so the arithmetic equals the module path's BlockLinear) or a float
// (N, K) matrix (3 float32, 4 bfloat16, 5 float16: float_rows.h's loops, as tformer's GEMV), so
// a layer differs from the module path only in float summation order, except that the
// residual stream stays float32 here whatever the weights' type (the module path of a bf16 model
// rounds it to bf16 after every op; llama.cpp keeps it float32 too).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#include "../quant/tiles.h"
#include "../quant/kquants.h"
#ifdef TFORMER_X86
#include "../quant/float_rows.h"
#include "../ops/vec_erf.h"
#include "../ops/vec_exp.h"
#endif

namespace {

constexpr int64_t F32 = 3, BF16 = 4, F16 = 5;
enum Mlp : int64_t { SWIGLU = 0, GELU_TANH = 1, RELU = 2, RELU2 = 3, GELU = 4, SILU = 5,   // the plain MLP's activation
                     GEGLU_TANH = 6, GEGLU = 7 };                                        // gated by GELU (Gemma: tanh form)
bool gated(int64_t mlp) { return mlp == SWIGLU || mlp >= GEGLU_TANH; }

void rms_norm_rows(const float* x, const float* g, double eps, int64_t M, int64_t C, float* out) {
  for (int64_t m = 0; m < M; ++m) {
    const float* r = x + m * C;
    double ss = 0.0;
    for (int64_t c = 0; c < C; ++c) ss += double(r[c]) * r[c];
    const float inv = float(1.0 / std::sqrt(ss / double(C) + eps));
    for (int64_t c = 0; c < C; ++c) out[m * C + c] = (r[c] * inv) * g[c];
  }
}

// QK-norm with gains (Qwen3): each q head and k head of every token's projection row, in place (hs,)
void qk_norm_heads(float* proj, int64_t N, int64_t NQKV, int64_t nh, int64_t nkv, int64_t hs, const float* gq,
                   const float* gk, double eps) {
  for (int64_t i = 0; i < N; ++i) {
    rms_norm_rows(proj + i * NQKV, gq, eps, nh, hs, proj + i * NQKV);
    rms_norm_rows(proj + i * NQKV + nh * hs, gk, eps, nkv, hs, proj + i * NQKV + nh * hs);
  }
}

// LayerNorm: mean and variance (biased, as torch's) in double
void layer_norm_rows(const float* x, const float* g, const float* b, double eps, int64_t M, int64_t C, float* out) {
  for (int64_t m = 0; m < M; ++m) {
    const float* r = x + m * C;
    double s = 0.0;
    for (int64_t c = 0; c < C; ++c) s += r[c];
    const double mean = s / double(C);
    double ss = 0.0;
    for (int64_t c = 0; c < C; ++c) ss += (r[c] - mean) * (r[c] - mean);
    const double inv = 1.0 / std::sqrt(ss / double(C) + eps);
    for (int64_t c = 0; c < C; ++c) out[m * C + c] = float((r[c] - mean) * inv) * g[c] + b[c];
  }
}

void rope_head(float* u, const float* cos, const float* sin, int64_t hs) {
  const int64_t half = hs / 2;
  float tmp[512];
  for (int64_t i = 0; i < hs; ++i) tmp[i] = u[i];
  for (int64_t i = 0; i < half; ++i) u[i] = tmp[i] * cos[i] - tmp[i + half] * sin[i];
  for (int64_t i = half; i < hs; ++i) u[i] = tmp[i] * cos[i] + tmp[i - half] * sin[i];
}

// a head's key or value into the cache, rounded to its type as torch's conversion rounds (to nearest even)
template <typename T>
void store_head(T* dst, const float* src, int64_t n) {
  if constexpr (std::is_same_v<T, float>) std::memcpy(dst, src, n * sizeof(float));
  else for (int64_t e = 0; e < n; ++e) dst[e] = static_cast<T>(src[e]);
}

// One element of the activations below (their vector loops' tails, and the portable build)
inline float gelu_tanh1(float v) { return v / (1.0f + std::exp(-2.0f * 0.7978845608028654f * (v + 0.044715f * v * v * v))); }
inline float gelu_erf1(float v) { return 0.5f * v * (1.0f + std::erf(v * 0.7071067811865476f)); }
inline float silu1(float v) { return v / (1.0f + std::exp(-v)); }

// q . k and y += a x over one head's hs floats, 8 lanes at a time, keys and values of the cache's
// type widened in registers (float_rows.h's load8) (a layer runs only on the SIMD paths, which
// all have AVX2 + FMA + F16C; elsewhere plain loops, so the file still builds); two accumulators
// hide the FMA latency.
#ifdef TFORMER_X86
#define T_ATT T_AVX2
using float_rows::load8;

template <typename T>
T_ATT float dot_f32(const float* a, const T* b, int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t e = 0;
  for (; e + 16 <= n; e += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + e), load8(b + e), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + e + 8), load8(b + e + 8), s1);
  }
  for (; e + 8 <= n; e += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + e), load8(b + e), s0);
  float s = hsum256(_mm256_add_ps(s0, s1));
  for (; e < n; ++e) s += a[e] * float(b[e]);
  return s;
}

template <typename T>
T_ATT void axpy_f32(float* y, float a, const T* x, int64_t n) {
  const __m256 av = _mm256_set1_ps(a);
  int64_t e = 0;
  for (; e + 8 <= n; e += 8) _mm256_storeu_ps(y + e, _mm256_fmadd_ps(av, load8(x + e), _mm256_loadu_ps(y + e)));
  for (; e < n; ++e) y[e] += a * float(x[e]);
}

// e^x for 8 floats (a decode step takes ~10^5 of them: softmax over the cache, SiLU): vec_exp.h
using vec_exp::exp8;

// v[i] <- e^(v[i] - m), and their sum
T_ATT float exp_shifted(float* v, float m, int64_t n) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(v + i), mv));
    _mm256_storeu_ps(v + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  float sum = hsum256(acc);
  for (; i < n; ++i) sum += (v[i] = std::exp(v[i] - m));
  return sum;
}

// out[i] = silu(g[i]) u[i] = g[i] / (1 + e^-g[i]) u[i]
T_ATT void silu_mul(const float* g, const float* u, float* out, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 den = _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv)));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(gv, den), _mm256_loadu_ps(u + i)));
  }
  for (; i < n; ++i) out[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

// v <- GELU's tanh form 0.5 v (1 + tanh(u)), u = sqrt(2/pi) (v + 0.044715 v^3) (GPT-2), in place;
// since 1 + tanh(u) = 2 / (1 + e^-2u), that is v / (1 + e^-2u), one exponential and no cancellation
T_ATT void gelu_tanh(float* v, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), c = _mm256_set1_ps(-2.0f * 0.7978845608028654f);
  const __m256 a = _mm256_set1_ps(0.044715f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(v + i);
    const __m256 inner = _mm256_fmadd_ps(_mm256_mul_ps(a, x), _mm256_mul_ps(x, x), x);   // x + a x^3
    _mm256_storeu_ps(v + i, _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_mul_ps(c, inner)))));
  }
  for (; i < n; ++i) v[i] = gelu_tanh1(v[i]);
}

// v <- silu(v) = v / (1 + e^-v), in place (a plain SiLU MLP)
T_ATT void silu(float* v, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(v + i);
    _mm256_storeu_ps(v + i, _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x)))));
  }
  for (; i < n; ++i) v[i] = silu1(v[i]);
}

// v <- GELU's exact form v Phi(v), in place (Phi by Abramowitz & Stegun 7.1.26: ../ops/vec_erf.h)
T_ATT void gelu_erf(float* v, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(v + i);
    __m256 e;
    _mm256_storeu_ps(v + i, _mm256_mul_ps(x, vec_erf::phi_cdf8(x, &e)));
  }
  for (; i < n; ++i) v[i] = gelu_erf1(v[i]);
}

// p[j] = scale q . K_j for j < n, four keys at a time (four independent FMA chains over the head's
// hs floats, then one horizontal reduction for the four), hs a multiple of 8; the rest one by one.
template <typename T>
T_ATT void scores(const float* q, const T* K, int64_t s2, int64_t n, int64_t hs, float scale, float* p) {
  int64_t j = 0;
  if (hs % 8 == 0) {
    const __m128 sc = _mm_set1_ps(scale);
    for (; j + 4 <= n; j += 4) {
      const T* k0 = K + j * s2;
      const T* k1 = k0 + s2;
      const T* k2 = k1 + s2;
      const T* k3 = k2 + s2;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t e = 0; e < hs; e += 8) {
        const __m256 qv = _mm256_loadu_ps(q + e);
        a0 = _mm256_fmadd_ps(qv, load8(k0 + e), a0);
        a1 = _mm256_fmadd_ps(qv, load8(k1 + e), a1);
        a2 = _mm256_fmadd_ps(qv, load8(k2 + e), a2);
        a3 = _mm256_fmadd_ps(qv, load8(k3 + e), a3);
      }
      const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));   // per 128-bit half
      _mm_storeu_ps(p + j, _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)), sc));
    }
  }
  for (; j < n; ++j) p[j] = dot_f32(q, K + j * s2, hs) * scale;
}

// o = sum_j p[j] inv V_j over the keys with p[j] != 0, o held in H registers (hs = 8 H) across the keys
template <int H, typename T>
T_ATT void weighted_sum_regs(const float* p, float inv, const T* V, int64_t s2, int64_t n, float* o) {
  __m256 acc[H];
  for (int h = 0; h < H; ++h) acc[h] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    if (p[j] == 0.0f) continue;
    const __m256 w = _mm256_set1_ps(p[j] * inv);
    const T* v = V + j * s2;
    for (int h = 0; h < H; ++h) acc[h] = _mm256_fmadd_ps(w, load8(v + 8 * h), acc[h]);
  }
  for (int h = 0; h < H; ++h) _mm256_storeu_ps(o + 8 * h, acc[h]);
}

template <typename T>
T_ATT void weighted_sum(const float* p, float inv, const T* V, int64_t s2, int64_t n, int64_t hs, float* o) {
  switch (hs) {                                  // the common head widths in registers (same sums, in order)
    case 32: return weighted_sum_regs<4>(p, inv, V, s2, n, o);
    case 64: return weighted_sum_regs<8>(p, inv, V, s2, n, o);
    case 128: return weighted_sum_regs<16>(p, inv, V, s2, n, o);
    default: break;
  }
  std::fill(o, o + hs, 0.0f);
  for (int64_t j = 0; j < n; ++j)
    if (p[j] != 0.0f) axpy_f32(o, p[j] * inv, V + j * s2, hs);
}
#else
#define T_ATT
template <typename T>
float dot_f32(const float* a, const T* b, int64_t n) {
  float s = 0.0f;
  for (int64_t e = 0; e < n; ++e) s += a[e] * float(b[e]);
  return s;
}

template <typename T>
void axpy_f32(float* y, float a, const T* x, int64_t n) {
  for (int64_t e = 0; e < n; ++e) y[e] += a * float(x[e]);
}

float exp_shifted(float* v, float m, int64_t n) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += (v[i] = std::exp(v[i] - m));
  return sum;
}

void silu_mul(const float* g, const float* u, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

void gelu_tanh(float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) v[i] = gelu_tanh1(v[i]);
}

void silu(float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) v[i] = silu1(v[i]);
}

void gelu_erf(float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) v[i] = gelu_erf1(v[i]);
}

template <typename T>
void scores(const float* q, const T* K, int64_t s2, int64_t n, int64_t hs, float scale, float* p) {
  for (int64_t j = 0; j < n; ++j) p[j] = dot_f32(q, K + j * s2, hs) * scale;
}

template <typename T>
void weighted_sum(const float* p, float inv, const T* V, int64_t s2, int64_t n, int64_t hs, float* o) {
  std::fill(o, o + hs, 0.0f);
  for (int64_t j = 0; j < n; ++j)
    if (p[j] != 0.0f) axpy_f32(o, p[j] * inv, V + j * s2, hs);
}
#endif

// One query head of one token over keys 0 .. n-1 of its row (K, V: key j at + j s2), the keys
// `real` marks (all without it): o = softmax(cap(q K^T scale)) V, zero if no key is real, cap(s) =
// softcap tanh(s / softcap) with softcap > 0 (Gemma 2), else s. p: n floats.
template <typename T>
T_ATT void attend_head(const float* q, const T* K, const T* V, int64_t s2, int64_t n, const bool* real,
                       float scale, float softcap, int64_t hs, float* p, float* o) {
  scores(q, K, s2, n, hs, scale, p);                                    // padding keys too (finite), masked next
  if (softcap > 0.0f)
    for (int64_t j = 0; j < n; ++j) p[j] = softcap * std::tanh(p[j] / softcap);   // before the mask, as the module path
  float mx = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    if (real && !real[j]) p[j] = -INFINITY;
    mx = std::max(mx, p[j]);
  }
  if (mx == -INFINITY) { std::fill(o, o + hs, 0.0f); return; }         // no real key
  float sum = exp_shifted(p, mx, n);                                    // a padding key's -inf gives ~1e-38
  if (real) {
    for (int64_t j = 0; j < n; ++j)
      if (!real[j]) { sum -= p[j]; p[j] = 0.0f; }                       // exactly nothing from padding
  }
  weighted_sum(p, 1.0f / sum, V, s2, n, hs, o);
}

// One of a layer's matrices, N outputs of K inputs: block tiles (fmt 0-2, 9, 10), a float (N, K) matrix
// (F32, BF16, F16) or K-quant blocks as the file stores them (fmt 6-8, kquants.h), with an
// optional float32 bias (N).
struct Product {
  int64_t fmt = 0, N = 0, K = 0;
  TileMatrix tiles{};
  const void* w = nullptr;
  const float* bias = nullptr;
  bool blocks() const { return is_tiled(fmt); }
};

// The width K of a K-quant matrix m (N, S * bytes) uint8, checked.
int64_t kquant_matrix(const at::Tensor& m, int64_t fmt, int64_t N, const char* what) {
  TORCH_CHECK(m.dim() == 2 && m.scalar_type() == at::kByte && m.is_contiguous() && m.size(0) == N &&
                  m.size(1) % kquant_bytes(fmt) == 0,
              what, ": K-quant blocks must be contiguous (", N, ", S * ", kquant_bytes(fmt), ") uint8");
  return kquant_values(fmt) * (m.size(1) / kquant_bytes(fmt));
}

Product make_product(const at::Tensor& m, const c10::optional<at::Tensor>& bias, int64_t fmt, int64_t N,
                     int64_t path, const char* what) {
  Product P;
  P.fmt = fmt, P.N = N;
  if (P.blocks()) {
    P.tiles = tile_matrix(m, fmt, N, path, what);
    P.K = 32 * P.tiles.G;
  } else if (is_kquant(fmt)) {                                          // Q4_K .. Q6_K here
    P.K = kquant_matrix(m, fmt, N, what);
    P.w = m.data_ptr();
  } else {
    static const at::ScalarType types[3] = {at::kFloat, at::kBFloat16, at::kHalf};
    TORCH_CHECK(m.dim() == 2 && m.is_contiguous() && m.size(0) == N && m.scalar_type() == types[fmt - F32], what,
                ": a float matrix must be contiguous (", N, ", K) in its format's dtype (3 float32, 4 bfloat16, 5 float16)");
    P.K = m.size(1), P.w = m.data_ptr();
  }
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, what,
                ": a bias must be contiguous float32 (", N, ",)");
    P.bias = bias->data_ptr<float>();
  }
  return P;
}

// y (M, N) = x (M, K) . W^T (+ bias), W float: weight rows split between torch's threads, each
// task's rows (~64 KB, in L2) passed once per token. For the few rows of a decode step or a check.
template <typename T>
void float_product(const T* W, const Product& P, const float* x, int64_t M, float* y, bool wide) {
  const int64_t N = P.N, K = P.K;
#ifdef TFORMER_X86
  const int64_t grain = float_rows::task_rows(K, sizeof(T));
#else
  const int64_t grain = 64;
#endif
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    std::vector<float> acc(n1 - n0);
    for (int64_t m = 0; m < M; ++m) {
#ifdef TFORMER_X86
      if (wide) float_rows::rows512(W, x + m * K, acc.data(), K, n0, n1);
      else float_rows::rows256(W, x + m * K, acc.data(), K, n0, n1);
#else
      for (int64_t n = n0; n < n1; ++n) acc[n - n0] = dot_f32(x + m * K, W + n * K, K);
#endif
      float* out = y + m * N;
      for (int64_t n = n0; n < n1; ++n) out[n] = acc[n - n0] + (P.bias ? P.bias[n] : 0.0f);
    }
  });
}

// One input quantised both ways, each made at its first use: 8-bit blocks of 32 for tiles (Q5_0 / Q5_1 too),
// Q8_K for the K-quants (gate and up, or q, k and v, read one quantisation of h).
struct Acts {
  QAct a;
  Q8K k;
  bool has_a = false, has_k = false;
  void fresh() { has_a = has_k = false; }      // a new input: both made again (their buffers kept)
  const QAct& blocks32(const float* x, int64_t M, int64_t K) {
    if (!has_a) a.quantize(x, M, K), has_a = true;
    return a;
  }
  const Q8K& q8k(const float* x, int64_t M, int64_t K) {
    if (!has_k) k.quantize(x, M, K), has_k = true;
    return k;
  }
};

// y = x . W^T (+ b) for x (M, P.K): a block product quantises x into `acts` unless it holds that
// quantisation of x already
void apply(const Product& P, const float* x, int64_t M, Acts& acts, float* y, int64_t path) {
  const auto* w = static_cast<const uint8_t*>(P.w);
  if (P.blocks()) return tile_product(P.tiles, acts.blocks32(x, M, P.K), P.bias, y);
  if (is_kquant(P.fmt)) return kquant_product(P.fmt, path, w, P.N, acts.q8k(x, M, P.K), P.bias, y);
  const bool wide = path == AVX512VNNI;
  if (P.fmt == F32) float_product(static_cast<const float*>(P.w), P, x, M, y, wide);
  else if (P.fmt == BF16) float_product(static_cast<const at::BFloat16*>(P.w), P, x, M, y, wide);
  else float_product(static_cast<const at::Half*>(P.w), P, x, M, y, wide);
}

// A layer call's buffers, kept from call to call by the thread that makes the call (thread_scratch; the
// server may call from several threads, each then has its own): a later call writes into pages already touched instead
// of fresh zeroed ones (the first prompt's page faults, docs/inference.md), grown when a larger call comes.
// Every element a call reads it has written first in that call, so what an earlier call left there is never read.
struct Scratch {
  std::vector<float> h, proj, att, y;
  Acts acts;
  static float* at_least(std::vector<float>& v, size_t n) {
    if (v.size() < n) {
      std::vector<float>().swap(v);          // not resize: the old contents need no copy
      v.resize(n);
    }
    return v.data();
  }
};

Scratch& thread_scratch() {
  thread_local Scratch scratch;
  return scratch;
}

// proj (N, NQKV) = h . [Wq | Wk | Wv]^T: one product, or three (q, k and v stored in different formats)
// whose outputs are laid side by side (through y, (N, the widest part))
void project_qkv(const Product* W, int64_t parts, const float* h, int64_t N, Acts& acts, float* proj, int64_t NQKV,
                 int64_t path, std::vector<float>& y_buf) {
  if (parts == 1) return apply(W[0], h, N, acts, proj, path);
  float* y = Scratch::at_least(y_buf, size_t(N * W[0].N));
  int64_t at = 0;
  for (int64_t p = 0; p < parts; ++p) {
    apply(W[p], h, N, acts, y, path);
    for (int64_t i = 0; i < N; ++i) std::memcpy(proj + i * NQKV + at, y + i * W[p].N, W[p].N * sizeof(float));
    at += W[p].N;
  }
}

// The attention of every (token, query head), over caches of element type T
// (a window > 0: token i reads the keys j with w_i - j < window only, the module path's sliding window,
// measured on cache indices)
template <typename T>
void attend_all(const float* proj, int64_t N, int64_t NQKV, int64_t nh, int64_t group, int64_t hs, const T* kc,
                const T* vc, int64_t s0, int64_t s1, int64_t s2, int64_t L, const int64_t* wi, const int64_t* ri,
                const bool* vp, int64_t vs, float scale, float softcap, int64_t window, float* att) {
  const int64_t Q = nh * hs;
  at::parallel_for(0, N * nh, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> p(L);
    for (int64_t t = i0; t < i1; ++t) {
      const int64_t i = t / nh, hd = t % nh, kvh = hd / group, row = ri ? ri[i] : i;
      const int64_t j0 = window > 0 ? std::max<int64_t>(0, wi[i] + 1 - window) : 0;   // the first key read
      const int64_t at = row * s0 + kvh * s1 + j0 * s2;
      attend_head(proj + i * NQKV + hd * hs, kc + at, vc + at, s2, wi[i] + 1 - j0,
                  vp ? vp + row * vs + j0 : nullptr, scale, softcap, hs, p.data(), att + i * Q + hd * hs);
    }
  });
}

template <typename T>
void write_kv(const float* proj, int64_t N, int64_t NQKV, int64_t Q, int64_t KV, int64_t nkv, int64_t hs, T* kc,
              T* vc, int64_t s0, int64_t s1, int64_t s2, const int64_t* wi, const int64_t* ri) {
  for (int64_t i = 0; i < N; ++i) {
    const float* r = proj + i * NQKV;
    const int64_t row = ri ? ri[i] : i;
    for (int64_t j = 0; j < nkv; ++j) {
      store_head(kc + row * s0 + j * s1 + wi[i] * s2, r + Q + j * hs, hs);
      store_head(vc + row * s0 + j * s1 + wi[i] * s2, r + Q + KV + j * hs, hs);
    }
  }
}

// norms: (g_attn, g_ffn) for RMSNorm, (g_attn, b_attn, g_ffn, b_ffn) for LayerNorm, float32 (C,); with post
// norms (RMSNorm only) (g_attn, g_ffn, g_attn_post, g_ffn_post). A gain applied as (1 + w) (Gemma) comes
// here as 1 + w (the plan adds the 1).
// mats / biases / fmts: (qkv, o, gate, up, down) for SwiGLU and GeGLU, (qkv, o, up, down) for a plain MLP
// (GELU, ReLU, ReLU², SiLU).
// dims: (nh, nkv, hs, d_ff, mlp[, qkv parts[, qk[, post]]]); parts 1 (one qkv matrix) or 3 (q, k, v apart);
// qk = 1: QK-norm with gains, whose (hs,) gains follow the norms (gq, gk); post = 1: each sub-layer's output
// normalised before the residual add (Gemma 2 and 3: x <- x + norm_post(f(norm(x)))).
// cos / sin: the layer's rotary tables, absent for a model without RoPE.
// window > 0: the layer attends over the keys j with w_i - j < window only; scale: the factor on q . k
// (0: 1 / sqrt(hs)); softcap > 0: the scores capped to softcap tanh(s / softcap) before the softmax.
void run_layer(const at::Tensor& x, at::TensorList norms, double eps, at::TensorList mats,
               const c10::List<c10::optional<at::Tensor>>& biases, at::IntArrayRef fmts, at::IntArrayRef dims,
               const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& write_index,
               const at::Tensor& positions, const c10::optional<at::Tensor>& valid,
               const c10::optional<at::Tensor>& rows, const c10::optional<at::Tensor>& cos,
               const c10::optional<at::Tensor>& sin, int64_t path, int64_t window, double score_scale,
               double softcap) {
  TORCH_CHECK((path == AVX2 || path == AVX512VNNI) && supports(path), "layer: this CPU cannot run path ", path);
  TORCH_CHECK(dims.size() >= 5 && dims.size() <= 8 && dims[4] >= SWIGLU && dims[4] <= GEGLU,
              "layer: dims (nh, nkv, hs, d_ff, mlp 0 swiglu | 1 gelu_tanh | 2 relu | 3 relu2 | 4 gelu | 5 silu | "
              "6 geglu_tanh | 7 geglu[, qkv parts[, qk[, post]]])");
  const bool qk = dims.size() >= 7 && dims[6] != 0;
  const bool post = dims.size() == 8 && dims[7] != 0;
  const int64_t nh = dims[0], nkv = dims[1], hs = dims[2], F = dims[3], mlp = dims[4];
  const int64_t parts = dims.size() >= 6 ? dims[5] : 1;               // qkv as one matrix, or q, k, v apart
  TORCH_CHECK(parts == 1 || parts == 3, "layer: qkv comes as 1 matrix or 3 (q, k, v)");
  TORCH_CHECK(window >= 0 && score_scale >= 0.0 && softcap >= 0.0, "layer: window, scale and softcap must be >= 0");
  const size_t n_mats = (gated(mlp) ? 5 : 4) + (parts - 1);
  TORCH_CHECK(mats.size() == n_mats && biases.size() == n_mats && fmts.size() == n_mats,
              "layer: mats, biases and fmts: (qkv, o, gate, up, down) for SwiGLU and GeGLU, (qkv, o, up, down) "
              "otherwise, qkv as (q, k, v) with 3 parts");
  for (auto f : fmts)
    TORCH_CHECK((f >= Q8_0 && f <= F16) || is_kquant(f),
                "layer: a format must be 0-2 (blocks), 3-5 (float32, bfloat16, float16) or 6-10 (q4_k, q5_k, q6_k, q5_0, q5_1)");
  TORCH_CHECK(nh > 0 && nkv > 0 && nh % nkv == 0 && hs % 2 == 0 && hs <= 512, "layer: bad head layout");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "layer: x must be contiguous float32 (N, C)");
  const int64_t N = x.size(0), C = x.size(1), Q = nh * hs, KV = nkv * hs, NQKV = Q + 2 * KV;
  const auto cache_type = k_cache.scalar_type();
  const int64_t Bc = k_cache.dim() == 4 ? k_cache.size(0) : 0;          // cache rows
  for (const at::Tensor* c : {&k_cache, &v_cache})
    TORCH_CHECK(c->dim() == 4 && c->scalar_type() == cache_type && c->stride(3) == 1 && c->size(0) == Bc &&
                    c->size(1) == nkv && c->size(3) == hs && c->strides() == k_cache.strides() &&
                    (cache_type == at::kFloat || cache_type == at::kBFloat16 || cache_type == at::kHalf),
                "layer: the caches must be float32, bfloat16 or float16 (rows, nkv, L, hs), each head's vector contiguous");
  TORCH_CHECK(rows.has_value() || Bc == N, "layer: without rows, the caches hold one row per token");
  // the caches may be views (a row range and a key prefix of the server's pool): strided access
  const int64_t s0 = k_cache.stride(0), s1 = k_cache.stride(1), s2 = k_cache.stride(2);
  const int64_t L = k_cache.size(2);
  for (const at::Tensor* t : {&write_index, &positions})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == N,
                "layer: write_index and positions must be contiguous int64 (N,)");
  TORCH_CHECK(!valid.has_value() || (valid->scalar_type() == at::kBool && valid->stride(1) == 1 &&
                                     valid->dim() == 2 && valid->size(0) == Bc && valid->size(1) == L),
              "layer: valid must be bool (rows, L), rows contiguous");
  TORCH_CHECK(!rows.has_value() || (rows->scalar_type() == at::kLong && rows->is_contiguous() && rows->numel() == N),
              "layer: rows must be contiguous int64 (N,)");
  const int64_t vs = valid.has_value() ? valid->stride(0) : 0;
  const size_t n_norms = norms.size() - (qk ? 2 : 0);                 // the QK-norm's gains come last
  TORCH_CHECK(norms.size() >= (qk ? 4 : 2) && (n_norms == 2 || n_norms == 4),
              "layer: norms (g, g) for RMSNorm, (g, b, g, b) for LayerNorm or (g, g, g_post, g_post) with post, "
              "then (gq, gk) with qk");
  TORCH_CHECK(!post || n_norms == 4, "layer: post norms need (g_attn, g_ffn, g_attn_post, g_ffn_post)");
  for (size_t i = 0; i < norms.size(); ++i)
    TORCH_CHECK(norms[i].scalar_type() == at::kFloat && norms[i].is_contiguous() && norms[i].numel() == (i < n_norms ? C : hs),
                "layer: norm weights (C,) float32, QK-norm gains (hs,)");
  const bool layer_norm = n_norms == 4 && !post;
  const bool rope = cos.has_value();
  TORCH_CHECK(rope == sin.has_value(), "layer: give both rotary tables or neither");
  if (rope)
    for (const at::Tensor* t : {&*cos, &*sin})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(1) == hs,
                  "layer: cos/sin tables (P, hs) float32");
  const int64_t* wi = write_index.data_ptr<int64_t>();
  const int64_t* pi = positions.data_ptr<int64_t>();
  const int64_t* ri = rows.has_value() ? rows->data_ptr<int64_t>() : nullptr;
  const int64_t P_max = rope ? cos->size(0) : std::numeric_limits<int64_t>::max();
  for (int64_t i = 0; i < N; ++i)
    TORCH_CHECK(wi[i] >= 0 && wi[i] < L && pi[i] >= 0 && pi[i] < P_max && (!ri || (ri[i] >= 0 && ri[i] < Bc)),
                "layer: a write index past the cache, a position past the rotary table or a row past the caches");
  const bool* vp = valid.has_value() ? valid->data_ptr<bool>() : nullptr;
  const char* names[5] = {"layer qkv", "layer out", "layer gate", "layer up", "layer down"};
  const int64_t outs[5] = {NQKV, C, F, F, C};
  const int64_t part_outs[3] = {Q, KV, KV};
  std::vector<Product> W;
  for (size_t i = 0; i < n_mats; ++i) {
    if (int64_t(i) < parts) {                                           // qkv, or q, k, v
      W.push_back(make_product(mats[i], biases.get(i), fmts[i], parts == 1 ? NQKV : part_outs[i], path, names[0]));
      continue;
    }
    const size_t j = i - (parts - 1);                                   // its place with one qkv matrix
    const size_t role = gated(mlp) || j < 2 ? j : j + 1;                // a plain MLP has no gate
    W.push_back(make_product(mats[i], biases.get(i), fmts[i], outs[role], path, names[role]));
  }
  const Product &Wo = W[parts], &Wd = W.back();
  const Product& Wu = W[n_mats - 2];
  for (int64_t i = 0; i < parts; ++i) TORCH_CHECK(W[i].K == C, "layer: the qkv weights' width does not match x");
  TORCH_CHECK(Wo.K == Q && Wu.K == C && (!gated(mlp) || W[parts + 1].K == C) && Wd.K == F,
              "layer: the weights' widths do not match x and the head layout");
  for (const Product& p : W)
    TORCH_CHECK(!p.blocks() || p.K % 32 == 0, "layer: a block product's input width must be a multiple of 32");

  float* xp = x.data_ptr<float>();
  const int64_t group = nh / nkv;
  const float scale = score_scale > 0.0 ? float(score_scale) : 1.0f / std::sqrt(float(hs));
  Scratch& scratch = thread_scratch();                                // this thread's, kept between calls
  float* const h = Scratch::at_least(scratch.h, size_t(N * C));           // (N, C): a norm's or a product's output
  float* const proj = Scratch::at_least(scratch.proj, size_t(N * std::max(NQKV, 2 * F)));
  float* const att = Scratch::at_least(scratch.att, size_t(N * Q));
  Acts& acts = scratch.acts;
  acts.fresh();
  auto norm = [&](int which) {                                         // h = norm_which(x)
    if (layer_norm) layer_norm_rows(xp, norms[2 * which].data_ptr<float>(), norms[2 * which + 1].data_ptr<float>(), eps, N, C, h);
    else rms_norm_rows(xp, norms[which].data_ptr<float>(), eps, N, C, h);
  };

  // attention sub-layer: every token's key and value into the cache first, then every token attends
  norm(0);
  project_qkv(W.data(), parts, h, N, acts, proj, NQKV, path, scratch.y);   // (N, NQKV): q heads, k heads, v heads
  if (qk) qk_norm_heads(proj, N, NQKV, nh, nkv, hs, norms[n_norms].data_ptr<float>(),
                        norms[n_norms + 1].data_ptr<float>(), eps);
  if (rope) {
    const float* cp = cos->data_ptr<float>();
    const float* sp = sin->data_ptr<float>();
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j = 0; j < nh + nkv; ++j)                              // q, k rotated
        rope_head(proj + i * NQKV + j * hs, cp + pi[i] * hs, sp + pi[i] * hs, hs);
  }
  auto attention = [&](auto* kc, auto* vc) {
    write_kv(proj, N, NQKV, Q, KV, nkv, hs, kc, vc, s0, s1, s2, wi, ri);
    attend_all(proj, N, NQKV, nh, group, hs, kc, vc, s0, s1, s2, L, wi, ri, vp, vs, scale, float(softcap),
               window, att);
  };
  if (cache_type == at::kFloat) attention(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  else if (cache_type == at::kBFloat16) attention(k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>());
  else attention(k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>());
  acts.fresh();
  apply(Wo, att, N, acts, h, path);                     // (N, C)
  if (post) rms_norm_rows(h, norms[2].data_ptr<float>(), eps, N, C, h);   // in place: row by row
  for (int64_t i = 0; i < N * C; ++i) xp[i] += h[i];

  // feed-forward sub-layer
  norm(1);
  acts.fresh();
  float* g = proj;
  float* u = proj + N * F;
  const float* act = g;                                                // (N, F): the down product's input
  if (gated(mlp)) {
    apply(W[parts + 1], h, N, acts, g, path);
    apply(Wu, h, N, acts, u, path);                             // h quantised once for both
    if (mlp == SWIGLU) {
      silu_mul(g, u, u, N * F);                                         // silu(g) * u
    } else {                                                            // GeGLU: gelu(g) * u
      if (mlp == GEGLU_TANH) gelu_tanh(g, N * F);
      else gelu_erf(g, N * F);
      for (int64_t i = 0; i < N * F; ++i) u[i] *= g[i];
    }
    act = u;
  } else {
    apply(Wu, h, N, acts, g, path);
    switch (mlp) {
      case GELU_TANH: gelu_tanh(g, N * F); break;
      case GELU: gelu_erf(g, N * F); break;
      case SILU: silu(g, N * F); break;
      case RELU2: for (int64_t i = 0; i < N * F; ++i) { const float r = std::max(g[i], 0.0f); g[i] = r * r; } break;
      default: for (int64_t i = 0; i < N * F; ++i) g[i] = std::max(g[i], 0.0f);               // RELU
    }
  }
  acts.fresh();
  apply(Wd, act, N, acts, h, path);                            // (N, C)
  if (post) rms_norm_rows(h, norms[3].data_ptr<float>(), eps, N, C, h);
  for (int64_t i = 0; i < N * C; ++i) xp[i] += h[i];
}

// Every layer of a call in one call (one dispatch and no Python loop instead of one call per layer;
// what that saved: docs/inference.md): norms / mats / biases / fmts hold each layer's lists one
// layer after another, and
// k_caches / v_caches one cache per layer; x, the indices, the mask and the rotary tables are shared.
// windows: each layer's window (0: none; an empty list: none anywhere); a windowed layer rotates with the
// local tables where they are given (Gemma 3's local RoPE base), every other layer with cos / sin.
void run_layers(const at::Tensor& x, at::TensorList norms, double eps, at::TensorList mats,
                const c10::List<c10::optional<at::Tensor>>& biases, at::IntArrayRef fmts, at::IntArrayRef dims,
                at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& write_index,
                const at::Tensor& positions, const c10::optional<at::Tensor>& valid,
                const c10::optional<at::Tensor>& rows, const c10::optional<at::Tensor>& cos,
                const c10::optional<at::Tensor>& sin, int64_t path, at::IntArrayRef windows, double score_scale,
                double softcap, const c10::optional<at::Tensor>& local_cos,
                const c10::optional<at::Tensor>& local_sin) {
  const size_t layers = k_caches.size();
  TORCH_CHECK(layers > 0 && v_caches.size() == layers && norms.size() % layers == 0 && mats.size() % layers == 0 &&
                  biases.size() == mats.size() && fmts.size() == mats.size() &&
                  (windows.empty() || windows.size() == layers),
              "layers: one k and v cache per layer, the same count of norms and of products in every layer, "
              "and one window per layer or none");
  TORCH_CHECK(local_cos.has_value() == local_sin.has_value() && (!local_cos.has_value() || cos.has_value()),
              "layers: give both local rotary tables or neither, and the global ones with them");
  const size_t nn = norms.size() / layers, nm = mats.size() / layers;
  for (size_t l = 0; l < layers; ++l) {
    c10::List<c10::optional<at::Tensor>> b;
    for (size_t i = 0; i < nm; ++i) b.push_back(biases.get(l * nm + i));
    const int64_t window = windows.empty() ? 0 : windows[l];
    const bool local = window > 0 && local_cos.has_value();
    run_layer(x, norms.slice(l * nn, nn), eps, mats.slice(l * nm, nm), b, fmts.slice(l * nm, nm), dims,
              k_caches[l], v_caches[l], write_index, positions, valid, rows, local ? local_cos : cos,
              local ? local_sin : sin, path, window, score_scale, softcap);
  }
}

int64_t product_ns(bool reset) { return reset ? PRODUCT_NS.exchange(0) : PRODUCT_NS.load(); }

}  // namespace

TORCH_LIBRARY(tformer_fused, m) {
  m.def("layer(Tensor(a!) x, Tensor[] norms, float eps, Tensor[] mats, Tensor?[] biases, int[] fmts, "
        "int[] dims, Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor write_index, Tensor positions, Tensor? valid, "
        "Tensor? rows, Tensor? cos, Tensor? sin, int path, int window=0, float scale=0., float softcap=0.) -> ()");
  m.def("layers(Tensor(a!) x, Tensor[] norms, float eps, Tensor[] mats, Tensor?[] biases, int[] fmts, "
        "int[] dims, Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, Tensor write_index, Tensor positions, Tensor? valid, "
        "Tensor? rows, Tensor? cos, Tensor? sin, int path, int[] windows=[], float scale=0., float softcap=0., "
        "Tensor? local_cos=None, Tensor? local_sin=None) -> ()");
  m.def("product_ns(bool reset) -> int");
}

TORCH_LIBRARY_IMPL(tformer_fused, CPU, m) {
  m.impl("layer", &run_layer);
  m.impl("layers", &run_layers);
}
TORCH_LIBRARY_IMPL(tformer_fused, CompositeExplicitAutograd, m) { m.impl("product_ns", &product_ns); }
