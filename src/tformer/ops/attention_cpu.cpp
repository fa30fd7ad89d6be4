// Attention over short sequences on a CPU, forward and backward, for training (and RoPE's rotation, at the
// end of the file): out = softmax(s Q K^T) V
// per head, causal (bottom-right aligned) or not, grouped-query heads sharing their key/value head.
//
// Why a kernel of its own: at a training step of tformer's CPU shapes (context 64, head size 32, 48
// heads a layer) a head's whole score matrix is 64 x 64 floats, 16 KB: it fits in L1 next to the
// head's Q, K and V. So nothing needs tiling: one task per (batch, key/value head) computes every
// score row of its heads in full, and the backward recomputes them from the saved log-sum-exp
// (FlashAttention-2's backward without the blocks). What costs at this size is everything around the
// arithmetic (tile bookkeeping, head transposes, the per-call set-up of a general kernel); here the
// keys are transposed once per task so a score row is a run of FMAs over 8-key vectors, two query
// rows at a time share every load, and outputs are written straight into (batch, position, head, d)
// memory, the layout the output projection reads, so no transpose copies follow.
//
// Per query row i with visible keys j < lim_i (lim_i = i + 1 + m - n when causal, m otherwise):
//   forward:  s_j = scale q_i . k_j;  p_j = e^(s_j - max) / l;  out_i = sum_j p_j v_j;  lse_i = max + ln l
//   backward: p_j = e^(s_j - lse_i);  D_i = dout_i . out_i;  ds_j = scale p_j (dout_i . v_j - D_i)
//             dq_i = sum_j ds_j k_j;  dk_j += ds_j q_i;  dv_j += p_j dout_i
// A row with no visible key (causal, n > m) gets out = 0 and lse = -inf, and no gradient.
// Accumulation is float32 throughout; inputs float32, or bfloat16 (widened per task, results rounded
// once: see "bfloat16 in and out"), with unit stride in the head dimension (any other strides), head
// size a multiple of 8; lse is float32 either way. Built at first use by tformer/ops/attention_cpu.py;
// AVX2 + FMA only (the x86 baseline of this project: every kernel here must be fast without AVX-512).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "flush_denormal.h"
#include "vec_bf16.h"
#include "vec_exp.h"

namespace {

#define T_256 __attribute__((target("avx2,fma")))
using at::Tensor;
using vec_exp::exp8;

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

T_256 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

T_256 inline float dot(const float* a, const float* b, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
  return hsum(acc);
}

// The register tile both products below use: two rows of 32 float32 accumulators, a += x r[0:32] and
// b += y r[0:32] per step, so each load of r feeds two FMAs and eight chains cover the FMA latency.
struct Tile2x32 {
  __m256 a[4], b[4];
  T_256 Tile2x32() { for (int i = 0; i < 4; ++i) a[i] = b[i] = _mm256_setzero_ps(); }
  T_256 void fma(const float* r, const float* x, const float* y) {
    const __m256 xv = _mm256_broadcast_ss(x), yv = _mm256_broadcast_ss(y);
    for (int i = 0; i < 4; ++i) {
      const __m256 m = _mm256_loadu_ps(r + 8 * i);
      a[i] = _mm256_fmadd_ps(xv, m, a[i]);
      b[i] = _mm256_fmadd_ps(yv, m, b[i]);
    }
  }
  T_256 void store(float* oa, float* ob) const {
    for (int i = 0; i < 4; ++i) { _mm256_storeu_ps(oa + 8 * i, a[i]); _mm256_storeu_ps(ob + 8 * i, b[i]); }
  }
};

// Two rows a, b against the columns j < m8 (a multiple of 8) of mt (D, ld): sa[j] = a . mt[:, j],
// sb[j] = b . mt[:, j]. Four 8-column groups per row, two rows: eight independent FMA chains (enough
// to cover the FMA latency, Tile2x32) sharing each load of mt.
T_256 void dots2(const float* a, const float* b, const float* mt, int64_t ld, int64_t D, int64_t m8,
                 float* sa, float* sb) {
  int64_t j = 0;
  for (; j + 32 <= m8; j += 32) {
    Tile2x32 t;
    for (int64_t d = 0; d < D; ++d) t.fma(mt + d * ld + j, a + d, b + d);
    t.store(sa + j, sb + j);
  }
  for (; j < m8; j += 8) {                       // the last < 32 columns: even and odd d apart, 4 chains
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
    for (int64_t d = 0; d < D; d += 2) {         // D is a multiple of 8
      const __m256 m0 = _mm256_loadu_ps(mt + d * ld + j), m1 = _mm256_loadu_ps(mt + (d + 1) * ld + j);
      a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(a + d), m0, a0);
      a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(a + d + 1), m1, a1);
      b0 = _mm256_fmadd_ps(_mm256_broadcast_ss(b + d), m0, b0);
      b1 = _mm256_fmadd_ps(_mm256_broadcast_ss(b + d + 1), m1, b1);
    }
    _mm256_storeu_ps(sa + j, _mm256_add_ps(a0, a1));
    _mm256_storeu_ps(sb + j, _mm256_add_ps(b0, b1));
  }
}

// oa = sum_{j < lim} pa[j ps] rows[j], ob likewise with pb: rows (lim, D) with row stride ldr; ps = 1 for
// a row of weights, the row length for a column of a (rows, m8) matrix (dK, dV from dS and P).
T_256 void combine2(const float* pa, const float* pb, int64_t ps, const float* rows, int64_t ldr, int64_t D,
                    int64_t lim, float* oa, float* ob) {
  int64_t d = 0;
  for (; d + 32 <= D; d += 32) {
    Tile2x32 t;
    for (int64_t j = 0; j < lim; ++j) t.fma(rows + j * ldr + d, pa + j * ps, pb + j * ps);
    t.store(oa + d, ob + d);
  }
  for (; d < D; d += 8) {                        // the last < 32 of d: even and odd j apart, 4 chains
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
    int64_t j = 0;
    for (; j + 2 <= lim; j += 2) {
      const __m256 m0 = _mm256_loadu_ps(rows + j * ldr + d), m1 = _mm256_loadu_ps(rows + (j + 1) * ldr + d);
      a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(pa + j * ps), m0, a0);
      a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(pa + (j + 1) * ps), m1, a1);
      b0 = _mm256_fmadd_ps(_mm256_broadcast_ss(pb + j * ps), m0, b0);
      b1 = _mm256_fmadd_ps(_mm256_broadcast_ss(pb + (j + 1) * ps), m1, b1);
    }
    if (j < lim) {
      const __m256 m0 = _mm256_loadu_ps(rows + j * ldr + d);
      a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(pa + j * ps), m0, a0);
      b0 = _mm256_fmadd_ps(_mm256_broadcast_ss(pb + j * ps), m0, b0);
    }
    _mm256_storeu_ps(oa + d, _mm256_add_ps(a0, a1));
    _mm256_storeu_ps(ob + d, _mm256_add_ps(b0, b1));
  }
}

// s[j] <- e^(s[j] - shift) for j < lim, 0 for lim <= j < m8; returns the sum (shift = the row's max
// when `shift` is NaN on entry, which is then written back). Lanes past lim are masked in registers,
// so the row is read twice at most (max, then exp and sum together).
T_256 float exp_row(float* s, int64_t lim, int64_t m8, float& shift) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  if (std::isnan(shift)) {
    __m256 mv = _mm256_set1_ps(NEG_INF);
    int64_t j = 0;
    for (; j + 8 <= lim; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + j));
    if (j < lim) {
      const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(int(lim - j)), lane));
      mv = _mm256_max_ps(mv, _mm256_blendv_ps(_mm256_set1_ps(NEG_INF), _mm256_loadu_ps(s + j), keep));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    shift = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  }
  const __m256 sh = _mm256_set1_ps(shift);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t j = 0; j < m8; j += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), sh));
    if (j + 8 > lim)                                             // masked keys weigh exactly nothing
      e = _mm256_and_ps(e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(int(lim - j)), lane)));
    _mm256_storeu_ps(s + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  return hsum(acc);
}

// out[d] = r x[d] for d < D (a multiple of 8)
T_256 void scale_row(float* out, const float* x, float r, int64_t D) {
  const __m256 rv = _mm256_set1_ps(r);
  for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(out + d, _mm256_mul_ps(rv, _mm256_loadu_ps(x + d)));
}

// t[j] <- scale p[j] (t[j] - Di) for j < m8: dS of one row from dP (in t), P and D_i = dout_i . out_i.
T_256 void ds_row(float* t, const float* p, float Di, float scale, int64_t m8) {
  const __m256 sc = _mm256_set1_ps(scale), dv = _mm256_set1_ps(Di);
  for (int64_t j = 0; j < m8; j += 8)
    _mm256_storeu_ps(t + j, _mm256_mul_ps(_mm256_mul_ps(sc, _mm256_loadu_ps(p + j)), _mm256_sub_ps(_mm256_loadu_ps(t + j), dv)));
}

struct Shape {
  int64_t B, Hq, Hkv, n, m, D, m8;
  bool causal;
  int64_t lim(int64_t i) const { return causal ? std::clamp<int64_t>(i + 1 + m - n, 0, m) : m; }
};

void check(const Tensor& q, const Tensor& k, const Tensor& v) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "attend: q, k, v must be (B, H, T, D)");
  TORCH_CHECK((q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) && k.scalar_type() == q.scalar_type()
              && v.scalar_type() == q.scalar_type(), "attend: q, k, v all float32 or all bfloat16");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "attend: unit stride in the head dimension");
  TORCH_CHECK(q.size(3) % 8 == 0 && k.size(3) == q.size(3) && v.size(3) == q.size(3), "attend: head size a multiple of 8");
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "attend: query heads a multiple of key heads");
}

Shape shape_of(const Tensor& q, const Tensor& k, bool causal) {
  const int64_t m = k.size(2);
  return Shape{q.size(0), q.size(1), k.size(1), q.size(2), m, q.size(3), (m + 7) / 8 * 8, causal};
}

// ---------------------------------------------------------------- bfloat16 in and out
// The maths below reads float32 rows (a pointer and a row stride). A float32 tensor's rows are read
// where they are; a bfloat16 tensor's (a training step under autocast) are widened by each task into a
// float32 buffer first (exact: a bfloat16 is a float32's top half), and its results are rounded once,
// to nearest even, as they are stored. So the floats are those of the kernel run on float32 copies and
// rounded after, without the copies (eight casts a layer, four each way, on strided views). The
// conversions are ops/vec_bf16.h's.
struct Rows {
  const float* p;
  int64_t ld;
};

T_256 void widen_rows(const at::BFloat16* src, int64_t ld, int64_t rows, int64_t D, float* dst) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(dst + r * D + d, vec_bf16::load8(src + r * ld + d));   // D = 8k
}

T_256 void narrow_rows(const float* src, int64_t rows, int64_t D, at::BFloat16* dst, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d = 0; d < D; d += 8) vec_bf16::store8(dst + r * ld + d, _mm256_loadu_ps(src + r * D + d));
}

// head h of batch b of t (B, H, rows, D) as float32 rows: its own (float32) or widened into buf (bfloat16)
template <class T>
Rows rows_of(const Tensor& t, int64_t b, int64_t h, int64_t rows, std::vector<float>& buf) {
  const T* p = t.data_ptr<T>() + b * t.stride(0) + h * t.stride(1);
  if constexpr (std::is_same_v<T, float>) {
    return {p, t.stride(2)};
  } else {
    const int64_t D = t.size(3);
    buf.resize(rows * D);
    widen_rows(p, t.stride(2), rows, D, buf.data());
    return {buf.data(), D};
  }
}

// Where a head's float32 results go: rows of the output tensor at `at` (row stride ld) for float32; for
// bfloat16 a float32 buffer (row stride D) that `store` rounds into the tensor.
template <class T>
struct Out {
  T* at;
  int64_t ld, D;
  std::vector<float>& buf;
  float* rows(int64_t n) {
    if constexpr (std::is_same_v<T, float>) return at;
    buf.resize(n * D);
    return buf.data();
  }
  int64_t stride() const { return std::is_same_v<T, float> ? ld : D; }
  void store(int64_t n) {
    if constexpr (!std::is_same_v<T, float>) narrow_rows(buf.data(), n, D, at, ld);
  }
};

// kt[d][j] = mult * rows[j][d] for j < m, 0 up to m8: a (D, m8) transposed copy of one head's keys/values
// (rows (m, D) with row stride ld), by 8 x 8 blocks in registers.
T_256 void transpose_into(float* kt, const float* rows, int64_t ld, const Shape& s, float mult) {
  const __m256 mv = _mm256_set1_ps(mult);
  const int64_t full = s.m / 8 * 8;
  for (int64_t d = 0; d < s.D; d += 8) {
    for (int64_t j = 0; j < full; j += 8) {
      __m256 r[8], t[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_mul_ps(mv, _mm256_loadu_ps(rows + (j + i) * ld + d));
      for (int i = 0; i < 8; i += 2) {                 // pairs of rows interleaved
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
      }
      for (int i = 0; i < 8; i += 4) {                 // then quadruples
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
      }
      for (int i = 0; i < 4; ++i) {                    // then the 128-bit halves: column i and i + 4
        _mm256_storeu_ps(kt + (d + i) * s.m8 + j, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_storeu_ps(kt + (d + i + 4) * s.m8 + j, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
      }
    }
    for (int64_t c = d; c < d + 8; ++c) {
      float* t = kt + c * s.m8;
      for (int64_t j = full; j < s.m; ++j) t[j] = mult * rows[j * ld + c];
      for (int64_t j = s.m; j < s.m8; ++j) t[j] = 0.0f;
    }
  }
}

// (out, lse): out (B, Hq, n, D) stored as (B, n, Hq, D), q's type; lse (B, Hq, n) float32.
template <class T>
std::tuple<Tensor, Tensor> attend_as(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale) {
  const Shape s = shape_of(q, k, causal);
  Tensor out = at::empty({s.B, s.n, s.Hq, s.D}, q.options());
  Tensor lse = at::empty({s.B, s.Hq, s.n}, q.options().dtype(at::kFloat));
  T* op = out.data_ptr<T>(); float* lp = lse.data_ptr<float>();
  const int64_t G = s.Hq / s.Hkv, ldo = s.Hq * s.D;
  flush_denormal::parallel_for(0, s.B * s.Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kt(s.D * s.m8), sa(s.m8), sb(s.m8), oa(s.D), ob(s.D), zeros(s.D, 0.0f);
    std::vector<float> kw, vw, qw, ow;                 // bfloat16's float32 rows
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / s.Hkv, kh = task % s.Hkv;
      const Rows kr = rows_of<T>(k, b, kh, s.m, kw), vr = rows_of<T>(v, b, kh, s.m, vw);
      transpose_into(kt.data(), kr.p, kr.ld, s, float(scale));
      for (int64_t h = kh * G; h < (kh + 1) * G; ++h) {
        const Rows qh = rows_of<T>(q, b, h, s.n, qw);
        Out<T> dst{op + b * s.n * ldo + h * s.D, ldo, s.D, ow};
        float* orow = dst.rows(s.n);
        const int64_t ldw = dst.stride();
        for (int64_t i = 0; i < s.n; i += 2) {
          const bool two = i + 1 < s.n;
          const int64_t la = s.lim(i), lb = two ? s.lim(i + 1) : 0, L = std::max(la, lb);
          float* o0 = orow + i * ldw;
          float* o1 = two ? o0 + ldw : ob.data();
          float mx[2] = {NEG_INF, NEG_INF}, sum[2] = {0.0f, 0.0f};
          if (L > 0) {
            const int64_t L8 = (L + 7) / 8 * 8;
            dots2(qh.p + i * qh.ld, two ? qh.p + (i + 1) * qh.ld : zeros.data(), kt.data(), s.m8, s.D, L8,
                  sa.data(), sb.data());
            mx[0] = mx[1] = std::numeric_limits<float>::quiet_NaN();
            sum[0] = la > 0 ? exp_row(sa.data(), la, L8, mx[0]) : (std::fill(sa.begin(), sa.begin() + L8, 0.0f), 0.0f);
            sum[1] = lb > 0 ? exp_row(sb.data(), lb, L8, mx[1]) : (std::fill(sb.begin(), sb.begin() + L8, 0.0f), 0.0f);
            combine2(sa.data(), sb.data(), 1, vr.p, vr.ld, s.D, L, oa.data(), o1);
          } else {
            std::fill(oa.begin(), oa.end(), 0.0f);
            std::fill(o1, o1 + s.D, 0.0f);
          }
          const float r0 = sum[0] > 0 ? 1.0f / sum[0] : 0.0f, r1 = sum[1] > 0 ? 1.0f / sum[1] : 0.0f;
          scale_row(o0, oa.data(), r0, s.D);
          scale_row(o1, o1, r1, s.D);
          float* l = lp + (b * s.Hq + h) * s.n + i;
          l[0] = la > 0 ? mx[0] + std::log(sum[0]) : NEG_INF;
          if (two) l[1] = lb > 0 ? mx[1] + std::log(sum[1]) : NEG_INF;
        }
        dst.store(s.n);
      }
    }
  });
  return {out.permute({0, 2, 1, 3}), lse};
}

std::tuple<Tensor, Tensor> attend(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale) {
  check(q, k, v);
  return q.scalar_type() == at::kFloat ? attend_as<float>(q, k, v, causal, scale)
                                       : attend_as<at::BFloat16>(q, k, v, causal, scale);
}

// (dq, dk, dv) of attend's output gradient dout; dq stored as (B, n, Hq, D), dk and dv as (B, m, Hkv, D).
// Per head, first the query rows: P and dS rows into (n, m8) buffers, dq_i = sum_j dS_ij k_j; then the
// key rows: dk_j = sum_i dS_ij q_i and dv_j = sum_i P_ij dout_i, reading columns of those buffers, so
// every sum runs in registers. The heads of a group add into their key head's dk and dv (in float32:
// a bfloat16 result is rounded once, after the group).
template <class T>
std::tuple<Tensor, Tensor, Tensor> attend_backward_as(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                                      const Tensor& out, const Tensor& lse, bool causal, double scale) {
  const Shape s = shape_of(q, k, causal);
  Tensor dq = at::empty({s.B, s.n, s.Hq, s.D}, q.options());
  Tensor dk = at::empty({s.B, s.m, s.Hkv, s.D}, q.options());
  Tensor dv = at::empty({s.B, s.m, s.Hkv, s.D}, q.options());
  const float* lp = lse.data_ptr<float>();
  T* dqp = dq.data_ptr<T>(); T* dkp = dk.data_ptr<T>(); T* dvp = dv.data_ptr<T>();
  const int64_t G = s.Hq / s.Hkv, ldq = s.Hq * s.D, ldk = s.Hkv * s.D;
  const float fscale = float(scale);
  flush_denormal::parallel_for(0, s.B * s.Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kt(s.D * s.m8), vt(s.D * s.m8), P(s.n * s.m8), dS(s.n * s.m8);
    std::vector<float> zeros(s.D, 0.0f), scratch(s.D), ka(s.D), kb(s.D), va(s.D), vb(s.D);
    std::vector<float> kw, vw, qw, gw, ow, dqw, dkw, dvw;      // bfloat16's float32 rows
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / s.Hkv, kh = task % s.Hkv;
      const Rows kr = rows_of<T>(k, b, kh, s.m, kw), vr = rows_of<T>(v, b, kh, s.m, vw);
      transpose_into(kt.data(), kr.p, kr.ld, s, fscale);
      transpose_into(vt.data(), vr.p, vr.ld, s, 1.0f);
      Out<T> dkd{dkp + b * s.m * ldk + kh * s.D, ldk, s.D, dkw}, dvd{dvp + b * s.m * ldk + kh * s.D, ldk, s.D, dvw};
      float* dkr = dkd.rows(s.m);
      float* dvr = dvd.rows(s.m);
      const int64_t ldkw = dkd.stride();
      for (int64_t h = kh * G; h < (kh + 1) * G; ++h) {
        const Rows qh = rows_of<T>(q, b, h, s.n, qw), gh = rows_of<T>(dout, b, h, s.n, gw), oh = rows_of<T>(out, b, h, s.n, ow);
        const float* lh = lp + (b * s.Hq + h) * s.n;
        Out<T> dqd{dqp + b * s.n * ldq + h * s.D, ldq, s.D, dqw};
        float* dqr = dqd.rows(s.n);
        const int64_t ldqw = dqd.stride();
        for (int64_t i = 0; i < s.n; i += 2) {                                   // query rows
          const bool two = i + 1 < s.n;
          const int64_t la = s.lim(i), lb = two ? s.lim(i + 1) : 0, L = std::max(la, lb);
          const int64_t L8 = (L + 7) / 8 * 8;
          float *pa = P.data() + i * s.m8, *pb = two ? pa + s.m8 : nullptr;
          float *ta = dS.data() + i * s.m8, *tb = two ? ta + s.m8 : nullptr;
          float* dq0 = dqr + i * ldqw;
          float* dq1 = two ? dq0 + ldqw : scratch.data();
          if (L == 0) {
            std::fill(pa, pa + (two ? 2 : 1) * s.m8, 0.0f);
            std::fill(ta, ta + (two ? 2 : 1) * s.m8, 0.0f);
            std::fill(dq0, dq0 + s.D, 0.0f);
            std::fill(dq1, dq1 + s.D, 0.0f);
            continue;
          }
          float rowb[2][1024 + 8];                                               // the missing second row's
          if (!two) { pb = rowb[0]; tb = rowb[1]; }                              // scores land here (m8 <= 1032)
          const float* q0 = qh.p + i * qh.ld;
          const float* q1 = two ? q0 + qh.ld : zeros.data();
          const float* g0 = gh.p + i * gh.ld;
          const float* g1 = two ? g0 + gh.ld : zeros.data();
          const float* o0 = oh.p + i * oh.ld;
          const float* o1 = two ? o0 + oh.ld : zeros.data();
          dots2(q0, q1, kt.data(), s.m8, s.D, L8, pa, pb);                       // scores
          dots2(g0, g1, vt.data(), s.m8, s.D, L8, ta, tb);                       // dout . v_j
          float sh0 = lh[i], sh1 = two ? lh[i + 1] : 0.0f;
          if (la > 0) exp_row(pa, la, L8, sh0); else std::fill(pa, pa + L8, 0.0f);
          if (lb > 0) exp_row(pb, lb, L8, sh1); else std::fill(pb, pb + L8, 0.0f);
          ds_row(ta, pa, dot(g0, o0, s.D), fscale, L8);                          // ds = scale p (dp - D)
          ds_row(tb, pb, dot(g1, o1, s.D), fscale, L8);
          std::fill(pa + L8, pa + s.m8, 0.0f); std::fill(pb + L8, pb + s.m8, 0.0f);    // keys no row here sees
          std::fill(ta + L8, ta + s.m8, 0.0f); std::fill(tb + L8, tb + s.m8, 0.0f);
          combine2(ta, tb, 1, kr.p, kr.ld, s.D, L, dq0, dq1);                     // dq = sum ds_j k_j
        }
        dqd.store(s.n);
        for (int64_t j = 0; j < s.m; j += 2) {                                   // key rows
          const bool two = j + 1 < s.m;
          // the first query that sees key j (causal: i + 1 + m - n > j); rows before it hold zeros
          const int64_t i0 = s.causal ? std::max<int64_t>(0, j - (s.m - s.n)) : 0;
          float* dk0 = dkr + j * ldkw;
          float* dv0 = dvr + j * ldkw;
          float* dk1 = two ? dk0 + ldkw : scratch.data();
          float* dv1 = two ? dv0 + ldkw : scratch.data();
          const bool first = h == kh * G;                                        // later heads of the group add
          float *ka0 = first ? dk0 : ka.data(), *kb0 = first ? dk1 : kb.data();
          float *va0 = first ? dv0 : va.data(), *vb0 = first ? dv1 : vb.data();
          if (i0 >= s.n) {
            std::fill(ka0, ka0 + s.D, 0.0f); std::fill(kb0, kb0 + s.D, 0.0f);
            std::fill(va0, va0 + s.D, 0.0f); std::fill(vb0, vb0 + s.D, 0.0f);
          } else {
            // columns j and j + 1 of dS and P from row i0 (a lone last key: column j twice, the copy unused)
            const float* ds0 = dS.data() + i0 * s.m8 + j;
            const float* p0 = P.data() + i0 * s.m8 + j;
            combine2(ds0, two ? ds0 + 1 : ds0, s.m8, qh.p + i0 * qh.ld, qh.ld, s.D, s.n - i0, ka0, kb0);
            combine2(p0, two ? p0 + 1 : p0, s.m8, gh.p + i0 * gh.ld, gh.ld, s.D, s.n - i0, va0, vb0);
          }
          if (!first) {
            for (int64_t d = 0; d < s.D; ++d) { dk0[d] += ka0[d]; dk1[d] += kb0[d]; dv0[d] += va0[d]; dv1[d] += vb0[d]; }
          }
        }
      }
      dkd.store(s.m);
      dvd.store(s.m);
    }
  });
  return {dq.permute({0, 2, 1, 3}), dk.permute({0, 2, 1, 3}), dv.permute({0, 2, 1, 3})};
}

std::tuple<Tensor, Tensor, Tensor> attend_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                                   const Tensor& out, const Tensor& lse, bool causal, double scale) {
  check(q, k, v);
  check(dout, out, out);
  TORCH_CHECK(dout.scalar_type() == q.scalar_type(), "attend_backward: dout and out in q's type");
  TORCH_CHECK(dout.sizes() == q.sizes() && out.sizes() == q.sizes() && lse.is_contiguous()
              && lse.scalar_type() == at::kFloat, "attend_backward: shapes");
  return q.scalar_type() == at::kFloat ? attend_backward_as<float>(dout, q, k, v, out, lse, causal, scale)
                                       : attend_backward_as<at::BFloat16>(dout, q, k, v, out, lse, causal, scale);
}

// RoPE's rotation (the "rotate half" pairing): each pair (a, b) = (x[i], x[i + D/2]) of a row at
// position t becomes (a c - b s, b c + a s), c, s = cos and sin of the row's angle i (the tables hold
// them twice, (T, D) like tformer's RotaryEmbedding, or (B, T, D) for per-row positions). A rotation's
// transpose is the rotation by -angle, so the backward is this with `inverse` (s -> -s).
// x (B, H, T, D) with unit stride in D, float32 or bfloat16 (each row widened, rotated in float32 with the
// float32 tables, rounded once); the result is contiguous, in x's type.
T_256 void rotate_row(const float* x, const float* c, const float* sn, float* out, int64_t half, float sign) {
  const __m256 sg = _mm256_set1_ps(sign);
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) {
    const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + half + i);
    const __m256 cv = _mm256_loadu_ps(c + i), sv = _mm256_mul_ps(sg, _mm256_loadu_ps(sn + i));
    _mm256_storeu_ps(out + i, _mm256_fnmadd_ps(b, sv, _mm256_mul_ps(a, cv)));
    _mm256_storeu_ps(out + half + i, _mm256_fmadd_ps(a, sv, _mm256_mul_ps(b, cv)));
  }
  for (; i < half; ++i) {
    const float a = x[i], b = x[half + i], cv = c[i], sv = sign * sn[i];
    out[i] = a * cv - b * sv;
    out[half + i] = b * cv + a * sv;
  }
}

// rotate's loop over the rows of x (B, H, T, D) in its type T: float32 rows rotated where they are,
// bfloat16 rows widened into a buffer, rotated, rounded once into out
template <class T>
void rotate_as(const Tensor& x, const float* cp, const float* sp, int64_t per_b, float sign, Tensor& out) {
  const int64_t H = x.size(1), T_ = x.size(2), D = x.size(3);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, x.size(0) * H, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> in, res;
    if constexpr (!std::is_same_v<T, float>) { in.resize(D); res.resize(D); }
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      for (int64_t t = 0; t < T_; ++t) {
        const T* row = xp + b * x.stride(0) + h * x.stride(1) + t * x.stride(2);
        const float* c = cp + b * per_b + t * D; const float* sn = sp + b * per_b + t * D;
        T* dst = op + (bh * T_ + t) * D;
        if constexpr (std::is_same_v<T, float>) {
          rotate_row(row, c, sn, dst, D / 2, sign);
        } else {
          widen_rows(row, 0, 1, D, in.data());
          rotate_row(in.data(), c, sn, res.data(), D / 2, sign);
          narrow_rows(res.data(), 1, D, dst, 0);
        }
      }
    }
  });
}

Tensor rotate(const Tensor& x, const Tensor& cos, const Tensor& sin, bool inverse) {
  TORCH_CHECK(x.dim() == 4 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.stride(3) == 1
              && x.size(3) % 2 == 0, "rotate: x must be float32 or bfloat16 (B, H, T, D) with unit stride in D, D even");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.scalar_type() == at::kFloat
              && (cos.dim() == 2 || cos.dim() == 3) && cos.size(-1) == x.size(3) && cos.size(-2) == x.size(2),
              "rotate: cos and sin must be contiguous float32 (T, D) or (B, T, D)");
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3);
  TORCH_CHECK(cos.dim() == 2 || cos.size(0) == B, "rotate: (B, T, D) tables need the batch size of x");
  TORCH_CHECK(x.scalar_type() == at::kFloat || D % 8 == 0, "rotate: bfloat16 rows need D a multiple of 8");
  Tensor out = at::empty({B, H, T, D}, x.options());
  const int64_t per_b = cos.dim() == 3 ? T * D : 0;
  const float sign = inverse ? -1.0f : 1.0f;
  if (x.scalar_type() == at::kFloat) rotate_as<float>(x, cos.data_ptr<float>(), sin.data_ptr<float>(), per_b, sign, out);
  else rotate_as<at::BFloat16>(x, cos.data_ptr<float>(), sin.data_ptr<float>(), per_b, sign, out);
  return out;
}

}  // namespace

TORCH_LIBRARY(tformer_attention, m) {
  m.def("attend(Tensor q, Tensor k, Tensor v, bool causal, float scale) -> (Tensor, Tensor)");
  m.def("attend_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal, "
        "float scale) -> (Tensor, Tensor, Tensor)");
  m.def("rotate(Tensor x, Tensor cos, Tensor sin, bool inverse) -> Tensor");
}

TORCH_LIBRARY_IMPL(tformer_attention, CPU, m) {
  m.impl("attend", &attend);
  m.impl("attend_backward", &attend_backward);
  m.impl("rotate", &rotate);
}
