// Products of GGUF K-quant weights (Q4_K, Q5_K, Q6_K: super-blocks of 256, read as the file stores
// them) with activations quantised to ggml's Q8_K, as llama.cpp multiplies them: per super-block an
// exact integer sum with the sub-block scales applied in integers, then one or two float multiply-adds
// (tformer/quant/kblocks.py has the formats and the formulas).
//   q4_k, q5_k: (d dx) sum_j sc_j sum_{e in j} q_e qx_e  -  (dmin dx) sum_j m_j (bsum_2j + bsum_2j+1)
//   q6_k:       (d dx) sum_g sc_g (sum_{e in g} q_e qx_e - 32 bsum_g)          (q_e the unsigned 6 bits)
// Three implementations of that arithmetic, as the 32-blocks have them (tiles.h's paths):
//   scalar       portable C++;
//   avx2         maddubs (u8 codes x s8 activations -> s16 pairs) then madd with the sub-block scales;
//   avx512vnni   the same at 512 bits, the scale step as one dpwssd (s16 pairs x s16 scales, added).
// Codes are unsigned (q6_k's -32 goes through bsums), so no sign tricks; maddubs cannot saturate
// (2 * 63 * 127 < 2^15). Each row of W is read once per activation row, in the file layout: a weight
// row (a few KB) stays in L1 while the rows pass; from WIDEN_ROWS rows (a prompt) the SIMD paths run
// kprefill.h's widened tiles instead. Rows lie end to end, so the SIMD paths prefetch PREFETCH bytes ahead
// as the tile kernels do (tiles.h). Included after tiles.h (its paths, ISA
// attributes and supports()); internal linkage, like tiles.h.
// Also here, the scalar path's reading of Q5_0 / Q5_1 in the file layout (blocks of 32, a fifth bit per code in
// 4 bytes qh: llama.cpp's fallback where a row is no multiple of 256; the SIMD paths read them as tiles.h's
// tiles), on tiles.h's 8-bit activation blocks of 32 (QAct):
//   q5_0: d dx (sum q qx - 16 s)        q5_1: d dx sum q qx + m dx s        (s = sum qx of the block)
#pragma once
#include <c10/util/Half.h>
#include <type_traits>
#include "tiles.h"

namespace {

enum KFmt : int64_t { Q4_K = 6, Q5_K = 7, Q6_K = 8 };   // after the 32-blocks (0-2), floats (3-5); Q5_0, Q5_1: tiles.h
constexpr int64_t KBYTES[5] = {144, 176, 210, 22, 24};  // bytes per (super-)block
constexpr int64_t KVALUES[5] = {256, 256, 256, 32, 32}; // values per (super-)block
inline bool is_kquant(int64_t fmt) { return fmt >= Q4_K && fmt <= Q5_1; }   // a format read in the file layout
inline bool is_q5(int64_t fmt) { return fmt == Q5_0 || fmt == Q5_1; }
inline int64_t kquant_bytes(int64_t fmt) { return KBYTES[fmt - Q4_K]; }
inline int64_t kquant_values(int64_t fmt) { return KVALUES[fmt - Q4_K]; }

// The SIMD kernels take MR activation rows (1..KMR) against one weight row: each block's codes are
// unpacked once and multiplied with every row (a prompt's products unpack each block once per KMR rows).
// Per row the sums and their order do not depend on MR.
constexpr int KMR = 4;

inline float k_half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

struct KRow {
  const int8_t* q;       // (K,)
  const float* d;        // (S,)
  const int16_t* bsums;  // (S, 16)
  const int16_t* psums;  // (S, 8) bsum_2j + bsum_2j+1: the sums of each 32-code sub-block (q4_k / q5_k's mins)
};

// M activation rows as Q8_K (ggml's quantize_row_q8_K_ref): per block of 256, max = the value of
// largest magnitude (the first on ties), iscale = -127 / max, q = min(127, rne(iscale x)),
// d = 1 / iscale, bsums = sums of 16 codes.
struct Q8K {
  int64_t M = 0, K = 0, S = 0;
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int16_t> bsums;   // (M, S, 16)
  std::vector<int16_t> psums;   // (M, S, 8)

  void quantize(const float* x, int64_t rows, int64_t k) {
    M = rows, K = k, S = k / 256;
    q.resize(M * K), d.resize(M * S), bsums.resize(M * S * 16), psums.resize(M * S * 8);
    for (int64_t b = 0; b < M * S; ++b) {
      const float* v = x + (b / S) * K + (b % S) * 256;
      int8_t* out = q.data() + b * 256;
      float amax = 0.0f, big = 0.0f;
      for (int e = 0; e < 256; ++e)
        if (std::fabs(v[e]) > amax) amax = std::fabs(v[e]), big = v[e];
      if (amax == 0.0f) {
        d[b] = 0.0f;
        std::fill(out, out + 256, int8_t(0));
        std::fill(bsums.data() + 16 * b, bsums.data() + 16 * b + 16, int16_t(0));
        std::fill(psums.data() + 8 * b, psums.data() + 8 * b + 8, int16_t(0));
        continue;
      }
      const float iscale = -127.0f / big;
      for (int e = 0; e < 256; ++e) {
        // round half to even by the 1.5 * 2^23 trick (exact for |t| <= 2^22; no -ffast-math here)
        const float t = iscale * v[e];
        out[e] = static_cast<int8_t>(std::min(127, static_cast<int32_t>((t + 12582912.0f) - 12582912.0f)));
      }
      for (int g = 0; g < 16; ++g) {
        int32_t s = 0;
        for (int e = 0; e < 16; ++e) s += out[16 * g + e];
        bsums[16 * b + g] = static_cast<int16_t>(s);
      }
      for (int j = 0; j < 8; ++j)                      // |sum of 32 codes| <= 4064: an int16
        psums[8 * b + j] = static_cast<int16_t>(bsums[16 * b + 2 * j] + bsums[16 * b + 2 * j + 1]);
      d[b] = 1.0f / iscale;
    }
  }
  KRow row(int64_t m) const {
    return KRow{q.data() + m * K, d.data() + m * S, bsums.data() + m * S * 16, psums.data() + m * S * 8};
  }
};

// q4_k / q5_k's 12 bytes of 6-bit scales and mins -> sc[8], m[8] (ggml's get_scale_min_k4)
// The same bytes four at a time, as 32-bit words (each mask keeps every byte's own bits: nothing
// crosses a byte): sc[0..3] = s[0..3] & 63, m[0..3] = s[4..7] & 63,
// sc[4..7] = (s[8..11] & 15) | (s[0..3] >> 6) << 4, m[4..7] = (s[8..11] >> 4) | (s[4..7] >> 6) << 4.
inline void scale_min(const uint8_t* s, uint8_t* sc, uint8_t* m) {
  constexpr uint32_t six = 0x3f3f3f3fu, four = 0x0f0f0f0fu, two = 0x03030303u;
  uint32_t u[3], out[4];
  std::memcpy(u, s, 12);
  out[0] = u[0] & six;
  out[1] = (u[2] & four) | (((u[0] >> 6) & two) << 4);
  out[2] = u[1] & six;
  out[3] = ((u[2] >> 4) & four) | (((u[1] >> 6) & two) << 4);
  std::memcpy(sc, out, 8);
  std::memcpy(m, out + 2, 8);
}

// sum_j m_j (bsum_2j + bsum_2j+1): the mins' integer term of a q4_k / q5_k super-block
inline int32_t mins_term(const uint8_t* m, const int16_t* bs) {
  int32_t s = 0;
  for (int j = 0; j < 8; ++j) s += int32_t(m[j]) * (int32_t(bs[2 * j]) + bs[2 * j + 1]);
  return s;
}

// sum_g sc_g bsum_g: q6_k's offset term (times 32)
inline int32_t q6_offset(const int8_t* sc, const int16_t* bs) {
  int32_t s = 0;
  for (int g = 0; g < 16; ++g) s += int32_t(sc[g]) * bs[g];
  return s;
}

// ---------------------------------------------------------------- scalar (portable) ----------
template <int F>
float kdot_scalar(const uint8_t* w, const KRow& x, int64_t S) {
  constexpr int64_t bytes = KBYTES[F - Q4_K];
  float sum = 0.0f;
  for (int64_t s = 0; s < S; ++s, w += bytes) {
    const int8_t* xq = x.q + 256 * s;
    const int16_t* bs = x.bsums + 16 * s;
    int32_t isum = 0;
    if (F == Q6_K) {
      const uint8_t* ql = w;
      const uint8_t* qh = w + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
      int32_t part[16] = {0};
      for (int h = 0; h < 2; ++h)
        for (int l = 0; l < 32; ++l) {
          const uint8_t lo = ql[64 * h + l], hi = ql[64 * h + 32 + l], top = qh[32 * h + l];
          const int32_t c[4] = {(lo & 15) | ((top & 3) << 4), (hi & 15) | (((top >> 2) & 3) << 4),
                                (lo >> 4) | (((top >> 4) & 3) << 4), (hi >> 4) | (((top >> 6) & 3) << 4)};
          for (int k = 0; k < 4; ++k) {
            const int e = 128 * h + 32 * k + l;
            part[e / 16] += c[k] * xq[e];
          }
        }
      for (int g = 0; g < 16; ++g) isum += sc[g] * part[g];
      isum -= 32 * q6_offset(sc, bs);
      sum += (k_half(w + 208) * x.d[s]) * float(isum);
    } else {
      uint8_t sc[8], m[8];
      scale_min(w + 4, sc, m);
      const uint8_t* qs = w + bytes - 128;
      const uint8_t* qh = w + 16;                       // q5_k only
      for (int c = 0; c < 4; ++c)
        for (int half = 0; half < 2; ++half) {
          const int j = 2 * c + half;
          int32_t part = 0;
          for (int l = 0; l < 32; ++l) {
            int32_t q = half ? qs[32 * c + l] >> 4 : qs[32 * c + l] & 15;
            if (F == Q5_K) q |= ((qh[l] >> j) & 1) << 4;
            part += q * xq[32 * j + l];
          }
          isum += int32_t(sc[j]) * part;
        }
      const float dx = x.d[s];
      sum += (k_half(w) * dx) * float(isum) - (k_half(w + 2) * dx) * float(mins_term(m, bs));
    }
  }
  return sum;
}

#ifdef TFORMER_X86
// ---------------------------------------------------------------- AVX2 -----------------------
T_AVX2 inline int32_t hsum_i32x4(__m128i v) {
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0x4E));
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0xB1));
  return _mm_cvtsi128_si32(v);
}

// mins_term from the pair sums (8 u8 mins x s16 sums, one madd): the same integer, in a few instructions
T_AVX2 inline int32_t mins_term_simd(const uint8_t* m, const int16_t* ps) {
  const __m128i mv = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(m)));
  return hsum_i32x4(_mm_madd_epi16(mv, _mm_loadu_si128(reinterpret_cast<const __m128i*>(ps))));
}

// q6_offset (16 s8 scales x s16 sums), likewise
T_AVX2 inline int32_t q6_offset_simd(const int8_t* sc, const int16_t* bs) {
  const __m256i p = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc))),
                                      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs)));
  return hsum_i32x4(_mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1)));
}

T_AVX2 inline float h2f_k(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

alignas(64) constexpr int16_t LANE_GROUP[32] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3};   // s16 lane / 8
template <int F, int MR>
T_AVX2 void kdot_avx2(const uint8_t* w, const KRow* x, int64_t S, float* out) {
  constexpr int64_t bytes = KBYTES[F - Q4_K];
  const __m256i low = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1), three = _mm256_set1_epi8(3);
  __m256 acc[MR];
  float mins[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps(), mins[r] = 0.0f;
  for (int64_t s = 0; s < S; ++s, w += bytes) {
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH + o), _MM_HINT_T1);
    __m256i isum[MR];
    for (int r = 0; r < MR; ++r) isum[r] = _mm256_setzero_si256();
    if (F == Q6_K) {
      const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
      for (int h = 0; h < 2; ++h) {
        const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * h));
        const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * h + 32));
        const __m256i top = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 128 + 32 * h));
        const __m256i q[4] = {
            _mm256_or_si256(_mm256_and_si256(l0, low), _mm256_slli_epi16(_mm256_and_si256(top, three), 4)),
            _mm256_or_si256(_mm256_and_si256(l1, low),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(top, 2), three), 4)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(top, 4), three), 4)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(top, 6), three), 4))};
        for (int k = 0; k < 4; ++k) {
          const int g = 8 * h + 2 * k;                  // q[k] holds groups g (first 16) and g + 1
          const __m256i scv = _mm256_set_m128i(_mm_set1_epi16(sc[g + 1]), _mm_set1_epi16(sc[g]));
          for (int r = 0; r < MR; ++r) {
            const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[r].q + 256 * s + 128 * h + 32 * k));
            isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(q[k], xv), scv));
          }
        }
      }
      const float dw = h2f_k(w + 208);
      for (int r = 0; r < MR; ++r) {
        isum[r] = _mm256_sub_epi32(isum[r], _mm256_setr_epi32(32 * q6_offset_simd(sc, x[r].bsums + 16 * s), 0, 0, 0, 0, 0, 0, 0));
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * x[r].d[s]), _mm256_cvtepi32_ps(isum[r]), acc[r]);
      }
    } else {
      uint8_t sc[8], m[8];
      scale_min(w + 4, sc, m);
      const uint8_t* qs = w + bytes - 128;
      const __m256i hb = F == Q5_K ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16)) : _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
        __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        if (F == Q5_K) {                                 // bit 2c (low half) and 2c + 1 (high half) of qh[l]
          lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * c), one), 4));
          hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * c + 1), one), 4));
        }
        const __m256i s0 = _mm256_set1_epi16(sc[2 * c]), s1 = _mm256_set1_epi16(sc[2 * c + 1]);
        for (int r = 0; r < MR; ++r) {
          const int8_t* xq = x[r].q + 256 * s + 64 * c;
          const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
          const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32));
          isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x0), s0));
          isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x1), s1));
        }
      }
      const float dw = h2f_k(w), mw = h2f_k(w + 2);
      for (int r = 0; r < MR; ++r) {
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * x[r].d[s]), _mm256_cvtepi32_ps(isum[r]), acc[r]);
        mins[r] += (mw * x[r].d[s]) * float(mins_term_simd(m, x[r].psums + 8 * s));
      }
    }
  }
  for (int r = 0; r < MR; ++r) out[r] = hsum256(acc[r]) - mins[r];
}

// ---------------------------------------------------------------- AVX-512 VNNI ---------------
// 64 codes a step: maddubs gives 32 s16 pair sums, one dpwssd multiplies them by their sub-block's
// scale and adds the pairs into 16 s32 lanes.
template <int F, int MR>
T_VNNI void kdot_vnni(const uint8_t* w, const KRow* x, int64_t S, float* out) {
  constexpr int64_t bytes = KBYTES[F - Q4_K];
  const __m512i low = _mm512_set1_epi8(15), one = _mm512_set1_epi8(1), three = _mm512_set1_epi8(3);
  __m512 acc[MR];
  float mins[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps(), mins[r] = 0.0f;
  for (int64_t s = 0; s < S; ++s, w += bytes) {
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH + o), _MM_HINT_T1);
    __m512i isum[MR], isum2[MR];                       // two chains of dpwssd (even / odd steps), added at the end
    for (int r = 0; r < MR; ++r) isum[r] = _mm512_setzero_si512(), isum2[r] = _mm512_setzero_si512();
    if (F == Q6_K) {
      const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
      // the 16 scales as s16, spread so that s16 lane l of a 64-code step holds group base + l / 8
      const __m512i sc16 = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc))));
      for (int h = 0; h < 2; ++h) {
        const __m512i l01 = _mm512_loadu_si512(w + 64 * h);          // ql[l] (codes 0..31 low, 64..95 high), ql[32 + l]
        const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 128 + 32 * h));
        const __m512i top = _mm512_inserti64x4(_mm512_castsi256_si512(t), _mm256_srli_epi16(t, 2), 1);
        // step 0: elements 0..63 of the half = low nibbles of l01 with top bits (0,1) | (2,3)
        const __m512i q0 = _mm512_or_si512(_mm512_and_si512(l01, low), _mm512_slli_epi16(_mm512_and_si512(top, three), 4));
        const __m512i q1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l01, 4), low),
                                           _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(top, 4), three), 4));
        const __m512i qs[2] = {q0, q1};
        for (int k = 0; k < 2; ++k) {
          const __m512i idx = _mm512_add_epi16(_mm512_set1_epi16(int16_t(8 * h + 4 * k)), _mm512_load_si512(LANE_GROUP));
          const __m512i scv = _mm512_permutexvar_epi16(idx, sc16);
          for (int r = 0; r < MR; ++r)
            (k ? isum2 : isum)[r] = _mm512_dpwssd_epi32((k ? isum2 : isum)[r], _mm512_maddubs_epi16(qs[k], _mm512_loadu_si512(x[r].q + 256 * s + 128 * h + 64 * k)), scv);
        }
      }
      const float dw = h2f_k(w + 208);
      for (int r = 0; r < MR; ++r) {
        isum[r] = _mm512_sub_epi32(_mm512_add_epi32(isum[r], isum2[r]), _mm512_maskz_set1_epi32(1, 32 * q6_offset_simd(sc, x[r].bsums + 16 * s)));
        acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(dw * x[r].d[s]), _mm512_cvtepi32_ps(isum[r]), acc[r]);
      }
    } else {
      uint8_t sc[8], m[8];
      scale_min(w + 4, sc, m);
      const uint8_t* qsp = w + bytes - 128;
      __m512i hb = _mm512_setzero_si512();
      if (F == Q5_K) {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16));
        hb = _mm512_inserti64x4(_mm512_castsi256_si512(h), _mm256_srli_epi16(h, 1), 1);   // bit 2c low half, 2c + 1 high
      }
      for (int c = 0; c < 4; ++c) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qsp + 32 * c));
        __m512i q = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1), low);
        if (F == Q5_K)
          q = _mm512_or_si512(q, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hb, 2 * c), one), 4));
        const __m512i scv = _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16(sc[2 * c]), _mm512_set1_epi16(sc[2 * c + 1]));
        for (int r = 0; r < MR; ++r)
          (c & 1 ? isum2 : isum)[r] = _mm512_dpwssd_epi32((c & 1 ? isum2 : isum)[r], _mm512_maddubs_epi16(q, _mm512_loadu_si512(x[r].q + 256 * s + 64 * c)), scv);
      }
      const float dw = h2f_k(w), mw = h2f_k(w + 2);
      for (int r = 0; r < MR; ++r) {
        acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(dw * x[r].d[s]), _mm512_cvtepi32_ps(_mm512_add_epi32(isum[r], isum2[r])), acc[r]);
        mins[r] += (mw * x[r].d[s]) * float(mins_term_simd(m, x[r].psums + 8 * s));
      }
    }
  }
  for (int r = 0; r < MR; ++r) out[r] = _mm512_reduce_add_ps(acc[r]) - mins[r];
}
#endif  // TFORMER_X86

// ---------------------------------------------------------------- Q5_0 / Q5_1 ----------------
template <int F>
float q5dot_scalar(const uint8_t* w, const XRow& x, int64_t G) {
  constexpr int64_t bytes = KBYTES[F - Q4_K], at = F == Q5_1 ? 4 : 2;
  float acc = 0.0f, mins = 0.0f;
  for (int64_t g = 0; g < G; ++g, w += bytes) {
    uint32_t qh;
    std::memcpy(&qh, w + at, 4);
    const uint8_t* qs = w + at + 4;
    const int8_t* xq = x.q + 32 * g;
    int32_t s = 0;
    for (int e = 0; e < 16; ++e)
      s += int32_t((qs[e] & 15) | (((qh >> e) & 1) << 4)) * xq[e] +
           int32_t((qs[e] >> 4) | (((qh >> (e + 16)) & 1) << 4)) * xq[e + 16];
    if (F == Q5_0) s -= 16 * x.s[g];
    acc += (k_half(w) * x.d[g]) * float(s);
    if (F == Q5_1) mins += k_half(w + 2) * x.ds[g];
  }
  return acc + mins;
}

// kernel(w, rows, n, out): activation rows x[0..MR) against one weight row of n (super-)blocks, out[MR];
// Row is KRow (K-quants, on Q8_K) or XRow (Q5_0 / Q5_1, on tiles.h's blocks of 32). fns[MR - 1].
template <typename Row>
using KDotFn = void (*)(const uint8_t*, const Row*, int64_t, float*);

template <typename Row, float (*Dot)(const uint8_t*, const Row&, int64_t), int MR>
void scalar_rows(const uint8_t* w, const Row* x, int64_t n, float* out) {
  for (int r = 0; r < MR; ++r) out[r] = Dot(w, x[r], n);
}

#define TF_ROWS(K, F) {&K<F, 1>, &K<F, 2>, &K<F, 3>, &K<F, 4>}
#define TF_SCALAR_ROWS(K, R, F) {&scalar_rows<R, &K<F>, 1>, &scalar_rows<R, &K<F>, 2>, &scalar_rows<R, &K<F>, 3>, \
                                 &scalar_rows<R, &K<F>, 4>}
const KDotFn<KRow>* kdot_fns(int64_t path, int64_t fmt) {
  static const KDotFn<KRow> scalar[3][KMR] = {TF_SCALAR_ROWS(kdot_scalar, KRow, Q4_K), TF_SCALAR_ROWS(kdot_scalar, KRow, Q5_K),
                                             TF_SCALAR_ROWS(kdot_scalar, KRow, Q6_K)};
#ifdef TFORMER_X86
  static const KDotFn<KRow> avx2[3][KMR] = {TF_ROWS(kdot_avx2, Q4_K), TF_ROWS(kdot_avx2, Q5_K), TF_ROWS(kdot_avx2, Q6_K)};
  static const KDotFn<KRow> vnni[3][KMR] = {TF_ROWS(kdot_vnni, Q4_K), TF_ROWS(kdot_vnni, Q5_K), TF_ROWS(kdot_vnni, Q6_K)};
  if (path == AVX2) return avx2[fmt - Q4_K];
  if (path == AVX512VNNI) return vnni[fmt - Q4_K];
#endif
  return scalar[fmt - Q4_K];
}

// the scalar path's: the SIMD paths read Q5_0 / Q5_1 as tiles (tiles.h)
const KDotFn<XRow>* q5dot_fns(int64_t fmt) {
  static const KDotFn<XRow> scalar[2][KMR] = {TF_SCALAR_ROWS(q5dot_scalar, XRow, Q5_0), TF_SCALAR_ROWS(q5dot_scalar, XRow, Q5_1)};
  return scalar[fmt - Q5_0];
}
#undef TF_SCALAR_ROWS
#undef TF_ROWS

}  // namespace
#include "kprefill.h"
namespace {

// y (M, N) = act (M, K) . W^T (+ bias) for W (N, n * bytes) rows in fmt (is_kquant), act's M rows quantised
// as the format reads them (Q8K for q4_k / q5_k / q6_k, QAct for q5_0 / q5_1); rows of W split between torch's
// threads, ~16 KB of them per task, each passed by the activation rows KMR at a time.
template <typename Act>
void kquant_product(int64_t fmt, int64_t path, const uint8_t* w, int64_t N, const Act& a, const float* bias, float* y) {
  const auto start = std::chrono::steady_clock::now();
  if constexpr (std::is_same_v<Act, Q8K>)                      // a K-quant prompt: kprefill.h (Q5 prompts come here on the scalar path only)
    if (path != SCALAR && a.M >= WIDEN_ROWS) return widened(fmt, path, w, N, a, bias, y, start);
  using Row = decltype(a.row(0));
  const KDotFn<Row>* fns;
  int64_t n;                                                    // (super-)blocks a row
  if constexpr (std::is_same_v<Act, Q8K>) fns = kdot_fns(path, fmt), n = a.S;
  else fns = q5dot_fns(fmt), n = a.G;
  const int64_t row_bytes = n * kquant_bytes(fmt);
  const int64_t grain = std::max<int64_t>(1, 16384 / row_bytes);
  std::vector<Row> rows(a.M);
  for (int64_t m = 0; m < a.M; ++m) rows[m] = a.row(m);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    float tmp[KMR];
    for (int64_t i = n0; i < n1; ++i)
      for (int64_t m = 0; m < a.M; m += KMR) {
        const int mr = int(std::min<int64_t>(KMR, a.M - m));
        fns[mr - 1](w + i * row_bytes, rows.data() + m, n, tmp);
        for (int r = 0; r < mr; ++r) y[(m + r) * N + i] = tmp[r] + (bias ? bias[i] : 0.0f);
      }
  });
  PRODUCT_NS.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count(),
                       std::memory_order_relaxed);
}

}  // namespace
