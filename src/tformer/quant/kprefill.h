// Several-row products (a prompt) of the K-quant weights read in the file layout (Q4_K, Q5_K, Q6_K;
// kquants.h; Q5_0 / Q5_1 are tiles.h's tiles on the SIMD paths, so their prompts run the tile kernels):
// each tile of R weight rows (8 AVX2, 16 AVX-512) is widened on the fly, in a per-thread
// buffer of a few ten KB, to one unsigned 8-bit code per weight and float scales per block of B codes,
// laid out as tiles.h's interleaved tiles, then every activation row passes over it MR at a time. A
// tile is widened once per product, whatever the number of rows, and no float copy of the weight is
// ever held. Every format is written as
//   w_e = scale_b q_e + mterm_b             q_e in [0, 63] unsigned, b the block of B codes holding e
//   q4_k / q5_k: B 32, scale d sc_j, mterm -dmin m_j      q6_k: B 16, scale d sc_g, mterm -32 d sc_g
// and per activation row (codes qx, block scale dx, block sum s = sum qx: ggml's Q8_K, whose sums per
// 16 / 32 codes are its bsums)
//   y += (scale_b dx_b) float(sum_e q_e qx_e + C s_b) + mterm'_b (dx_b s_b)
// with q6_k's fixed offset -32 kept in the integer sum (C = -32, mterm' = 0)
// and the others' mterm in float. The integer sums are those of the one-row kernels; the float steps
// are per block of B rather than per super-block, so the result differs from the
// one-row path in float32 rounding only. Products of dpbusd (AVX-512 VNNI) or maddubs (AVX2) of the
// u8 codes and the s8 activations: |sum| <= 32 * 63 * 127, no saturation (maddubs pairs 2 * 63 * 127).
// Included by kquants.h after its activation types; the scalar path keeps the one-row kernels.
#pragma once
#include <vector>

namespace {

// The widened tile of R rows: per block b, scale[R] float | mterm[R] float | codes [B/4 quads][R rows][4 bytes]
struct Widen {
  int64_t B;        // codes per block: 32, or 16 (q6_k)
  int32_t C;        // the integer offset per activation code (-32 q6_k, else 0)
  bool mterm;       // a float mterm per block (q4_k, q5_k)
  int64_t block_bytes(int64_t R) const { return R * (8 + B); }
};

inline Widen widen_of(int64_t fmt) {
  if (fmt == Q6_K) return {16, -32, false};
  return {32, 0, true};
}

#ifdef TFORMER_X86
// 32 consecutive codes of row r (code index e0, a multiple of 32) into a widened tile of R rows: quad i of
// them to block (e0 + 4i) / B, quad slot ((e0 + 4i) % B) / 4, row r (strides known at compile time)
template <int64_t R, int64_t B>
T_AVX2 inline void put32(uint8_t* out, int64_t r, int64_t e0, __m256i v) {
  const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
  uint8_t* c = out + (e0 / B) * (R * (8 + B)) + 8 * R + 4 * r;       // quad 0 of the block, row r
  uint8_t* c2 = B == 32 ? c + 16 * R : c + R * (8 + B);                // quad 4: the same block, or the next
  _mm_storeu_si32(c, lo);
  _mm_storeu_si32(c + 4 * R, _mm_bsrli_si128(lo, 4));
  _mm_storeu_si32(c + 8 * R, _mm_bsrli_si128(lo, 8));
  _mm_storeu_si32(c + 12 * R, _mm_bsrli_si128(lo, 12));
  _mm_storeu_si32(c2, hi);
  _mm_storeu_si32(c2 + 4 * R, _mm_bsrli_si128(hi, 4));
  _mm_storeu_si32(c2 + 8 * R, _mm_bsrli_si128(hi, 8));
  _mm_storeu_si32(c2 + 12 * R, _mm_bsrli_si128(hi, 12));
}

// Row r of a tile from one weight row (K codes) in the file layout, in Widen's form: codes, scale, mterm
template <int64_t R>
T_AVX2 void widen_row(int64_t fmt, const uint8_t* w, int64_t K, int64_t r, int64_t B, uint8_t* out) {
  const int64_t vals = kquant_values(fmt), bytes = kquant_bytes(fmt), bb = R * (8 + B);
  const __m256i low = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1), three = _mm256_set1_epi8(3);
  auto scale = [&](int64_t b) { return reinterpret_cast<float*>(out + b * bb) + r; };
  auto mterm = [&](int64_t b) { return reinterpret_cast<float*>(out + b * bb) + R + r; };
  for (int64_t s = 0; s < K / vals; ++s, w += bytes) {
    const int64_t e0 = s * vals;
    if (fmt == Q6_K) {                         // ggml's order: per half, ql low / ql+32 low / ql high / ql+32 high
      const float d = h2f_k(w + 208);
      const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
      for (int h = 0; h < 2; ++h) {
        const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * h));
        const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 128 + 32 * h));
        const __m256i t0 = _mm256_slli_epi16(_mm256_and_si256(qh, three), 4);                        // bits 0-1
        const __m256i t2 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), three), 4);  // bits 2-3
        const __m256i t4 = _mm256_and_si256(qh, _mm256_set1_epi8(0x30));                            // bits 4-5
        const __m256i t6 = _mm256_and_si256(_mm256_srli_epi16(qh, 2), _mm256_set1_epi8(0x30));       // bits 6-7
        const int64_t e = e0 + 128 * h;
        put32<R, 16>(out, r, e, _mm256_or_si256(_mm256_and_si256(l0, low), t0));
        put32<R, 16>(out, r, e + 32, _mm256_or_si256(_mm256_and_si256(l1, low), t2));
        put32<R, 16>(out, r, e + 64, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low), t4));
        put32<R, 16>(out, r, e + 96, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low), t6));
      }
      for (int g = 0; g < 16; ++g) *scale(16 * s + g) = d * float(sc[g]);   // exact: 11 x 8 bits
    } else {                                          // q4_k, q5_k: chunk c = sub-blocks 2c (low) and 2c + 1 (high)
      uint8_t sc[8], m[8];
      scale_min(w + 4, sc, m);
      const float d = h2f_k(w), dmin = h2f_k(w + 2);
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16));
      for (int c = 0; c < 4; ++c) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + bytes - 128 + 32 * c));
        __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        if (fmt == Q5_K) {
          const __m128i s0 = _mm_cvtsi32_si128(2 * c), s1 = _mm_cvtsi32_si128(2 * c + 1);
          lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, s0), one), 4));
          hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, s1), one), 4));
        }
        put32<R, 32>(out, r, e0 + 64 * c, lo);
        put32<R, 32>(out, r, e0 + 64 * c + 32, hi);
      }
      for (int j = 0; j < 8; ++j) *scale(8 * s + j) = d * float(sc[j]), *mterm(8 * s + j) = -dmin * float(m[j]);
    }
  }
}

// Rows [0, n) of W (n <= R; zero rows pad the tile) -> one widened tile of K / B blocks into out.
inline void widen_tile(int64_t fmt, const Widen& f, const uint8_t* w, int64_t row_bytes, int64_t n, int64_t R,
                       int64_t K, uint8_t* out) {
  if (n < R) std::memset(out, 0, (K / f.B) * f.block_bytes(R));
  for (int64_t r = 0; r < n; ++r)
    if (R == 8) widen_row<8>(fmt, w + r * row_bytes, K, r, f.B, out);
    else widen_row<16>(fmt, w + r * row_bytes, K, r, f.B, out);
}
#endif  // TFORMER_X86

// Q8_K rows (K-quants) seen as blocks of B (16 or 32), each row a tiles.h XRow over those blocks: dx the
// super-block's, s its bsums / psums
struct BActs {
  std::vector<float> d, ds;
  std::vector<int32_t> s;
  std::vector<XRow> rows;
  void from_q8k(const Q8K& a, int64_t B) {
    const int64_t nb = a.K / B, per = 256 / B;
    d.resize(a.M * nb), ds.resize(a.M * nb), s.resize(a.M * nb), rows.resize(a.M);
    for (int64_t m = 0; m < a.M; ++m) {
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t i = m * nb + b;
        d[i] = a.d[m * a.S + b / per];
        s[i] = B == 16 ? a.bsums[m * a.S * 16 + b] : a.psums[m * a.S * 8 + b];
        ds[i] = d[i] * float(s[i]);
      }
      rows[m] = XRow{a.q.data() + m * a.K, d.data() + m * nb, s.data() + m * nb, ds.data() + m * nb};
    }
  }
};

constexpr int WMR = 4;   // activation rows per pass over a widened tile

#ifdef TFORMER_X86
// out (MR, 16): MR activation rows against one widened tile of 16 rows
template <int B, int C, bool MT, int MR>
T_VNNI void wtile_vnni(const uint8_t* w, const XRow* x, int64_t nb, float* out) {
  constexpr int64_t bb = 16 * (8 + B);
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, w += bb) {
    const __m512 scale = _mm512_loadu_ps(reinterpret_cast<const float*>(w));
    const uint8_t* c = w + 128;
    __m512i a[MR], a2[MR];                    // two chains of dpbusd per row (latency), added at the end
    for (int r = 0; r < MR; ++r) a[r] = _mm512_set1_epi32(C * x[r].s[b]), a2[r] = _mm512_setzero_si512();
    for (int j = 0; j < B / 4; j += 2) {
      const __m512i w0 = _mm512_loadu_si512(c + 64 * j), w1 = _mm512_loadu_si512(c + 64 * (j + 1));
      for (int r = 0; r < MR; ++r) {
        const int32_t* xq = reinterpret_cast<const int32_t*>(x[r].q + B * b);
        a[r] = _mm512_dpbusd_epi32(a[r], w0, _mm512_set1_epi32(xq[j]));
        a2[r] = _mm512_dpbusd_epi32(a2[r], w1, _mm512_set1_epi32(xq[j + 1]));
      }
    }
    for (int r = 0; r < MR; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(scale, _mm512_set1_ps(x[r].d[b])),
                               _mm512_cvtepi32_ps(_mm512_add_epi32(a[r], a2[r])), acc[r]);
    if (MT) {
      const __m512 m = _mm512_loadu_ps(reinterpret_cast<const float*>(w + 64));
      for (int r = 0; r < MR; ++r) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x[r].ds[b]), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(out + 16 * r, acc[r]);
}

// out (MR, 8): the same on a widened tile of 8 rows, maddubs (u8 codes x s8 activations) then madd to s32
template <int B, int C, bool MT, int MR>
T_AVX2 void wtile_avx2(const uint8_t* w, const XRow* x, int64_t nb, float* out) {
  constexpr int64_t bb = 8 * (8 + B);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, w += bb) {
    const __m256 scale = _mm256_loadu_ps(reinterpret_cast<const float*>(w));
    const uint8_t* c = w + 64;
    __m256i a[MR];
    for (int r = 0; r < MR; ++r) a[r] = _mm256_set1_epi32(C * x[r].s[b]);
    for (int j = 0; j < B / 4; ++j) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * j));
      for (int r = 0; r < MR; ++r) {
        const __m256i xv = _mm256_set1_epi32(reinterpret_cast<const int32_t*>(x[r].q + B * b)[j]);
        a[r] = _mm256_add_epi32(a[r], _mm256_madd_epi16(_mm256_maddubs_epi16(wv, xv), ones));
      }
    }
    for (int r = 0; r < MR; ++r)
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(scale, _mm256_set1_ps(x[r].d[b])), _mm256_cvtepi32_ps(a[r]), acc[r]);
    if (MT) {
      const __m256 m = _mm256_loadu_ps(reinterpret_cast<const float*>(w + 32));
      for (int r = 0; r < MR; ++r) acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x[r].ds[b]), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm256_storeu_ps(out + 8 * r, acc[r]);
}

using WTileFn = void (*)(const uint8_t*, const XRow*, int64_t, float*);
#define TF_W(K, B, C, MT) {&K<B, C, MT, 1>, &K<B, C, MT, 2>, &K<B, C, MT, 3>, &K<B, C, MT, 4>}
inline const WTileFn* wtile_fns(int64_t path, int64_t fmt) {
  static const WTileFn vnni[2][WMR] = {TF_W(wtile_vnni, 16, -32, false), TF_W(wtile_vnni, 32, 0, true)};
  static const WTileFn avx2[2][WMR] = {TF_W(wtile_avx2, 16, -32, false), TF_W(wtile_avx2, 32, 0, true)};
  const int i = fmt == Q6_K ? 0 : 1;
  return path == AVX2 ? avx2[i] : vnni[i];
}
#undef TF_W
#endif  // TFORMER_X86

// From this many activation rows a SIMD path widens tiles (below it, the one-row kernels read the file
// layout, whose cost per row is flat): measured on the project's Zen 4 (docs/inference.md, "GGUF block formats").
constexpr int64_t WIDEN_ROWS = 32;

// y (M, N) = x . W^T (+ bias) over widened tiles (path AVX2 or AVX512VNNI); tiles split between torch's
// threads, each widening its own into a buffer it keeps for the call.
inline void widened_product(int64_t fmt, int64_t path, const uint8_t* w, int64_t N, int64_t K, const XRow* rows,
                            int64_t M, const float* bias, float* y) {
#ifdef TFORMER_X86
  const Widen f = widen_of(fmt);
  const int64_t R = path == AVX2 ? 8 : 16, nb = K / f.B, T = (N + R - 1) / R;
  const int64_t row_bytes = K / kquant_values(fmt) * kquant_bytes(fmt);
  const WTileFn* fns = wtile_fns(path, fmt);
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    std::vector<uint8_t> tile(nb * f.block_bytes(R));
    float tmp[WMR * 16];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * R, n = std::min(R, N - n0);
      widen_tile(fmt, f, w + n0 * row_bytes, row_bytes, n, R, K, tile.data());
      for (int64_t m = 0; m < M; m += WMR) {
        const int mr = int(std::min<int64_t>(WMR, M - m));
        fns[mr - 1](tile.data(), rows + m, nb, tmp);
        for (int r = 0; r < mr; ++r)
          for (int64_t i = 0; i < n; ++i) y[(m + r) * N + n0 + i] = tmp[r * R + i] + (bias ? bias[n0 + i] : 0.0f);
      }
    }
  });
#endif
}

}  // namespace

namespace {

// kquant_product's several-row case for the K-quants: the Q8_K activations as blocks of B, then
// widened_product (timed into PRODUCT_NS)
inline void widened(int64_t fmt, int64_t path, const uint8_t* w, int64_t N, const Q8K& a, const float* bias, float* y,
                    std::chrono::steady_clock::time_point start) {
  BActs b;
  b.from_q8k(a, widen_of(fmt).B);
  widened_product(fmt, path, w, N, a.K, b.rows.data(), a.M, bias, y);
  PRODUCT_NS.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count(),
                       std::memory_order_relaxed);
}

}  // namespace
