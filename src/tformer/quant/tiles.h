// Activations rounded to 8-bit blocks, and the products of GGUF block weights laid out as
// interleaved tiles: what the block products (quant/qgemv.cpp) and the whole decoder layers
// (fused/layers.cpp) both compute with, so a layer's products are BlockLinear's to the bit.
//
// Per activation row and block of 32: a = max|x|, dx = a / 127, q = rne(x * (127 / a)) in
// [-127, 127], s = sum q (integer); per weight row and block one integer dot product of the 32
// codes and one float multiply-add (qgemv.cpp's header has the formulas).
// Everything here has internal linkage (an anonymous namespace): each library that includes this
// compiles its own copy and the two share no symbols. The including file is compiled for the
// baseline ISA; each SIMD kernel carries its own target attribute.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TFORMER_X86 1
#endif

namespace {

// Q5_0 / Q5_1 (9, 10) come after the floats (3-5) and the K-quants (6-8, kquants.h)
enum Fmt : int64_t { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2, Q5_0 = 9, Q5_1 = 10 };
enum Path : int64_t { SCALAR = 0, AVX2 = 1, AVX512VNNI = 2 };
constexpr int64_t BLOCK_BYTES[3] = {34, 18, 20};
constexpr int64_t block_bytes(int64_t f) { return f == Q5_0 ? 22 : f == Q5_1 ? 24 : BLOCK_BYTES[f]; }
constexpr bool is_tiled(int64_t f) { return (f >= Q8_0 && f <= Q4_1) || f == Q5_0 || f == Q5_1; }
constexpr bool has_fifth(int64_t f) { return f == Q5_0 || f == Q5_1; }
constexpr bool has_min(int64_t f) { return f == Q4_1 || f == Q5_1; }
constexpr int tile_index(int64_t f) { return f <= Q4_1 ? int(f) : int(f) - 6; }   // 0..4 in the kernel tables

#ifdef TFORMER_X86
#define T_AVX2 __attribute__((target("avx2,fma,f16c")))
#define T_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))

T_AVX2 inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 32 bits -> 32 bytes, byte e = 16 where bit e is set (a Q5 fifth bit), else 0
T_AVX2 inline __m256i fifth_bits(uint32_t qh) {
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(int32_t(qh)),
                                             _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                               0x0101010101010101, 0x0000000000000000));
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}
#endif

bool supports(int64_t path) {
#ifdef TFORMER_X86
  if (path == AVX2)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (path == AVX512VNNI)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
#endif
  return path == SCALAR;
}

// Activation row x (K floats) -> per block g of 32: codes q (32 int8), scale d[g], the correction
// -8 s (q4_0) in lane 0 of corr's 8 int32 (the rest zero: one vector add on a SIMD path), ds[g] = d s.
void quantize_row(int64_t fmt, const float* x, int64_t K, int8_t* q, float* d, int32_t* corr, float* ds) {
  for (int64_t g = 0; g < K / 32; ++g) {
    const float* b = x + 32 * g;
    float a = 0.0f;
    for (int k = 0; k < 32; ++k) a = std::max(a, std::fabs(b[k]));
    const float inv = a != 0.0f ? 127.0f / a : 0.0f;
    int32_t s = 0;
    for (int k = 0; k < 32; ++k) {
      // round half to even: adding and subtracting 1.5 * 2^23 leaves the nearest integer (ties to
      // even, the default rounding mode) for |v| <= 127: exact in IEEE float arithmetic (the build has no -ffast-math)
      const float t = b[k] * inv;
      const int32_t v = static_cast<int32_t>((t + 12582912.0f) - 12582912.0f);
      q[32 * g + k] = static_cast<int8_t>(v);
      s += v;
    }
    d[g] = a / 127.0f;
    for (int k = 0; k < 8; ++k) corr[8 * g + k] = 0;
    if (fmt == Q4_0) corr[8 * g] = -8 * s;
    ds[g] = d[g] * static_cast<float>(s);
  }
}

// ---------------------------------------------------------------- interleaved tiles ----------
// The SIMD paths run on weights repacked R rows at a time (R = 8 for AVX2, 16 for AVX-512): tile t
// holds rows tR .. tR + R - 1 (zero rows pad the last tile), and for each block g, in order:
//   d[R] fp16 | m[R] fp16 (q4_1 only) | codes, as [quad j][row r][4 bytes]
//   d[R] fp16 | m[R] fp16 (q4_1, q5_1) | fifth bits (q5_0, q5_1) | codes, as [quad j][row r][4 bytes]
// where quad j of a row is its codes 4j .. 4j + 3: for q4 / q5 j = 0..3 and each byte holds code
// 4j + b in its low nibble and code 16 + 4j + b in its high nibble (the file's qs[4j + b], moved);
// for q8_0 j = 0..7, one code a byte (signed for AVX2; for AVX-512 plus 128, i.e. unsigned).
// q5's fifth bits (the file's qh, moved) are 8 masks of 4R bits, one per nibble vector (low nibbles
// of quads 0..3, then high nibbles): bit 4r + b of mask i is bit 4i + b of row r's qh, i.e. the
// fifth bit of the code in byte b of lane r; a masked byte add of 16 (AVX-512) or fifth_bits (AVX2)
// makes the codes 0..31. Where a q5_0 code is q - 16, the -16 goes through s, as q4_0's -8 does.
// A 32-bit lane r of one vector then holds row r's four codes of one quad: the activation's four
// codes are broadcast to every lane and one dpbusd (or maddubs + madd) adds four products to each
// row's sum: R rows' dot products with no horizontal sums, and the R scales of a block are one
// vector (cvtph). Bytes per tile and block: R * BLOCK_BYTES (the same bytes as the file, moved).
int64_t tile_block_bytes(int64_t fmt, int64_t R) { return R * block_bytes(fmt); }

// One activation row against one tile: out[R] = the R rows' products (no bias).
struct XRow {
  const int8_t* q;      // (K,)
  const float* d;       // (G,)
  const int32_t* s;     // (G,) sum of the codes
  const float* ds;      // (G,) d * s
};

// Software prefetch of the tile kernels, into L2, 12 KB ahead of the block being read. At M = 1 a
// decode step is a stream from memory and the hardware prefetcher alone keeps too few lines in
// flight; and since repack lays a model's tiles end to end in decode order (qgemv.cpp's arenas), a
// prefetch past a matrix's end fetches the start of the next product's weights while the layer's
// other work (attention, norms) runs. Into L2 rather than L1 so the lines in flight fit beside the
// activations in a 32 KB L1. The distance was measured (docs/inference.md, "GGUF block formats").
// A prefetch past the last tiles is a hint that may fetch nothing useful, never a fault.
constexpr int64_t PREFETCH = 12288;

// The kernels take MR activation rows (1..MAX_MR) against one tile: each block's weight vectors
// are loaded (and for q4 unpacked) once and used by all MR rows, so a product of M > 1 rows (a
// batch, a prefill, a multi-token step) does not redo that work per row. Per row the integer sums
// and the float32 steps are the one-row kernel's, in the same order: acc += (d * dx) * float(isum)
// per block (then + m * (dx s) for q4_1), so the result does not depend on M.
constexpr int MAX_MR = 4;

#ifdef TFORMER_X86
template <int F, int MR>
T_AVX2 void tile_avx2(const uint8_t* w, const XRow* x, int64_t G, float* out) {   // out (MR, 8)
  constexpr int64_t tb = 8 * block_bytes(F), head = (has_min(F) ? 32 : 16);   // d (and m) of 8 rows
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(15);
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g, w += tb) {
    for (int64_t o = 0; o < tb; o += 64) _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH + o), _MM_HINT_T1);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    __m256i idot[MR];
    if (F == Q8_0) {
      const uint8_t* c = w + 16;
      for (int r = 0; r < MR; ++r) idot[r] = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * j));
        const __m256i aw = _mm256_sign_epi8(wv, wv);
        for (int r = 0; r < MR; ++r) {
          const __m256i xv = _mm256_set1_epi32(reinterpret_cast<const int32_t*>(x[r].q + 32 * g)[j]);
          idot[r] = _mm256_add_epi32(idot[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, wv)), ones));
        }
      }
    } else if (has_fifth(F)) {  // codes <= 31: s16 sums of one quad's two maddubs (|.| <= 4 * 31 * 127), then s32
      uint32_t fifth[8];
      std::memcpy(fifth, w + head, 32);
      const uint8_t* c = w + head + 32;
      for (int r = 0; r < MR; ++r) idot[r] = _mm256_set1_epi32(0);
      for (int j = 0; j < 4; ++j) {
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * j));
        const __m256i lo = _mm256_or_si256(_mm256_and_si256(wv, low), fifth_bits(fifth[j]));
        const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(wv, 4), low), fifth_bits(fifth[4 + j]));
        for (int r = 0; r < MR; ++r) {
          const int32_t* xq = reinterpret_cast<const int32_t*>(x[r].q + 32 * g);
          const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(xq[j])),
                                             _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xq[4 + j])));
          idot[r] = _mm256_add_epi32(idot[r], _mm256_madd_epi16(p, ones));
        }
      }
      if (F == Q5_0)
        for (int r = 0; r < MR; ++r) idot[r] = _mm256_add_epi32(idot[r], _mm256_set1_epi32(-16 * x[r].s[g]));
    } else {
      const uint8_t* c = w + head;
      __m256i p16[MR];        // 8 maddubs of codes <= 15: |sum| <= 8 * 2 * 15 * 127 < 2^15
      for (int r = 0; r < MR; ++r) p16[r] = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * j));
        const __m256i lo = _mm256_and_si256(wv, low), hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), low);
        for (int r = 0; r < MR; ++r) {
          const int32_t* xq = reinterpret_cast<const int32_t*>(x[r].q + 32 * g);
          p16[r] = _mm256_add_epi16(p16[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xq[j])));
          p16[r] = _mm256_add_epi16(p16[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xq[4 + j])));
        }
      }
      for (int r = 0; r < MR; ++r) {
        idot[r] = _mm256_madd_epi16(p16[r], ones);
        if (F == Q4_0) idot[r] = _mm256_add_epi32(idot[r], _mm256_set1_epi32(-8 * x[r].s[g]));
      }
    }
    for (int r = 0; r < MR; ++r)
      acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(x[r].d[g])), _mm256_cvtepi32_ps(idot[r]), acc[r]);
    if (has_min(F)) {
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16)));
      for (int r = 0; r < MR; ++r) acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x[r].ds[g]), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm256_storeu_ps(out + 8 * r, acc[r]);
}

// q4 high nibbles are multiplied in place, as (byte & 0xF0) = 16 hi: a chain of those sums to
// 16 sum(hi x) exactly (|16 * 15 * 127 * 16| < 2^31), and one arithmetic shift right by 4 per
// block gives sum(hi x): one AND per 64 bytes instead of a shift and an AND. (Not for q5: a fifth
// bit would carry out of the byte.)
template <int F, int MR>
T_VNNI void tile_vnni(const uint8_t* w, const XRow* x, int64_t G, float* out) {    // out (MR, 16)
  constexpr int64_t tb = 16 * block_bytes(F), head = (has_min(F) ? 64 : 32);   // d (and m) of 16 rows
  const __m512i low = _mm512_set1_epi8(15), high = _mm512_set1_epi8(int8_t(0xF0)), sixteen = _mm512_set1_epi8(16);
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g, w += tb) {
    for (int64_t o = 0; o < tb; o += 64) _mm_prefetch(reinterpret_cast<const char*>(w + PREFETCH + o), _MM_HINT_T1);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
    __m512i a[MR], b[MR];                     // two chains of dpbusd per row (latency), added at the end
    if (F == Q8_0) {                          // codes + 128: sum (q + 128) x - 128 sum x
      const uint8_t* c = w + 32;
      for (int r = 0; r < MR; ++r) a[r] = _mm512_set1_epi32(-128 * x[r].s[g]), b[r] = _mm512_setzero_si512();
      for (int j = 0; j < 8; j += 2) {
        const __m512i w0 = _mm512_loadu_si512(c + 64 * j), w1 = _mm512_loadu_si512(c + 64 * (j + 1));
        for (int r = 0; r < MR; ++r) {
          const int32_t* xq = reinterpret_cast<const int32_t*>(x[r].q + 32 * g);
          a[r] = _mm512_dpbusd_epi32(a[r], w0, _mm512_set1_epi32(xq[j]));
          b[r] = _mm512_dpbusd_epi32(b[r], w1, _mm512_set1_epi32(xq[j + 1]));
        }
      }
    } else {
      const uint8_t* c = w + head + (has_fifth(F) ? 64 : 0);
      __mmask64 fifth[8];
      if (has_fifth(F)) std::memcpy(fifth, w + head, 64);
      const int32_t off = F == Q4_0 ? -8 : F == Q5_0 ? -16 : 0;
      for (int r = 0; r < MR; ++r)
        a[r] = off ? _mm512_set1_epi32(off * x[r].s[g]) : _mm512_setzero_si512(), b[r] = _mm512_setzero_si512();
      for (int j = 0; j < 4; ++j) {
        const __m512i wv = _mm512_loadu_si512(c + 64 * j);
        __m512i lo = _mm512_and_si512(wv, low), hi;
        if (has_fifth(F)) {
          lo = _mm512_mask_add_epi8(lo, fifth[j], lo, sixteen);
          hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), low);
          hi = _mm512_mask_add_epi8(hi, fifth[4 + j], hi, sixteen);
        } else {
          hi = _mm512_and_si512(wv, high);                      // 16 hi
        }
        for (int r = 0; r < MR; ++r) {
          const int32_t* xq = reinterpret_cast<const int32_t*>(x[r].q + 32 * g);
          a[r] = _mm512_dpbusd_epi32(a[r], lo, _mm512_set1_epi32(xq[j]));
          b[r] = _mm512_dpbusd_epi32(b[r], hi, _mm512_set1_epi32(xq[4 + j]));
        }
      }
      if (!has_fifth(F))
        for (int r = 0; r < MR; ++r) b[r] = _mm512_srai_epi32(b[r], 4);
    }
    for (int r = 0; r < MR; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(x[r].d[g])),
                               _mm512_cvtepi32_ps(_mm512_add_epi32(a[r], b[r])), acc[r]);
    if (has_min(F)) {
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32)));
      for (int r = 0; r < MR; ++r) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x[r].ds[g]), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(out + 16 * r, acc[r]);
}
#endif

// M activation rows quantised once (codes, scales, per-block sums): what every tile product reads.
// A whole layer (fused/layers.cpp) quantises the normed rows once and hands them to q/k/v (one
// matrix) and to both gate and up.
struct QAct {
  int64_t M = 0, K = 0, G = 0;
  std::vector<int8_t> q;
  std::vector<float> d, ds;
  std::vector<int32_t> corr, s;

  void quantize(const float* x, int64_t rows, int64_t k) {
    M = rows, K = k, G = k / 32;
    q.resize(M * K), d.resize(M * G), ds.resize(M * G), corr.resize(M * G * 8), s.resize(M * G);
    for (int64_t m = 0; m < M; ++m) {
      quantize_row(Q4_0, x + m * K, K, q.data() + m * K, d.data() + m * G, corr.data() + m * G * 8, ds.data() + m * G);
      for (int64_t g = 0; g < G; ++g) s[m * G + g] = corr[(m * G + g) * 8] / -8;
    }
  }
  XRow row(int64_t m) const { return XRow{q.data() + m * K, d.data() + m * G, s.data() + m * G, ds.data() + m * G}; }
};

// kernel(w, rows, G, out): rows x[0..MR) of one tile, out (MR, R) floats.
using TileFn = void (*)(const uint8_t*, const XRow*, int64_t, float*);
using TileFns = TileFn[MAX_MR];   // [MR - 1]

const TileFn* tile_fn(int64_t path, int64_t fmt) {
#ifdef TFORMER_X86
#define TF_TILE_ROWS(K, F) {&K<F, 1>, &K<F, 2>, &K<F, 3>, &K<F, 4>}
  static const TileFns avx2[5] = {TF_TILE_ROWS(tile_avx2, Q8_0), TF_TILE_ROWS(tile_avx2, Q4_0), TF_TILE_ROWS(tile_avx2, Q4_1),
                                  TF_TILE_ROWS(tile_avx2, Q5_0), TF_TILE_ROWS(tile_avx2, Q5_1)};
  static const TileFns vnni[5] = {TF_TILE_ROWS(tile_vnni, Q8_0), TF_TILE_ROWS(tile_vnni, Q4_0), TF_TILE_ROWS(tile_vnni, Q4_1),
                                  TF_TILE_ROWS(tile_vnni, Q5_0), TF_TILE_ROWS(tile_vnni, Q5_1)};
#undef TF_TILE_ROWS
  return path == AVX2 ? avx2[tile_index(fmt)] : vnni[tile_index(fmt)];
#else
  return nullptr;
#endif
}

// A weight held as tiles: T tiles of R rows, N real rows, fmt, G blocks per row.
struct TileMatrix {
  const uint8_t* w;
  int64_t T, R, N, G, row_bytes;
  const TileFn* fn;     // [MR - 1]
};

TileMatrix tile_matrix(const at::Tensor& tiles, int64_t fmt, int64_t N, int64_t path, const char* what) {
  const int64_t R = path == AVX2 ? 8 : 16, tb = tile_block_bytes(fmt, R);
  TORCH_CHECK(tiles.dim() == 2 && tiles.scalar_type() == at::kByte && tiles.is_contiguous() &&
                  tiles.size(1) % tb == 0 && N <= tiles.size(0) * R && N > (tiles.size(0) - 1) * R,
              what, ": tiles must be repack(blocks, fmt, ", R, ") of a weight with ", N, " rows");
  return TileMatrix{tiles.data_ptr<uint8_t>(), tiles.size(0), R, N, tiles.size(1) / tb, tiles.size(1), tile_fn(path, fmt)};
}

// Profiling: nanoseconds spent in tile_product, summed over calls (each library's product_ns op reads
// and may reset its own copy): a product's time where it runs, among a layer's other work.
std::atomic<int64_t> PRODUCT_NS{0};

// y (M, N) = act (M, K) . W^T (+ bias), tiles split between torch's threads; per tile the rows go
// MAX_MR at a time (the tile stays in L1 while they pass).
void tile_product(const TileMatrix& W, const QAct& a, const float* bias, float* y) {
  const auto start = std::chrono::steady_clock::now();
  std::vector<XRow> rows(a.M);
  for (int64_t m = 0; m < a.M; ++m) rows[m] = a.row(m);
  // a task: enough tiles for ~32 KB of weight (fork/join costs more than a small matrix's work)
  const int64_t grain = std::max<int64_t>(1, 32768 / W.row_bytes);
  at::parallel_for(0, W.T, grain, [&](int64_t t0, int64_t t1) {
    float tmp[MAX_MR * 16];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * W.R, n1 = std::min(W.N, n0 + W.R);
      for (int64_t m = 0; m < a.M; m += MAX_MR) {
        const int mr = int(std::min<int64_t>(MAX_MR, a.M - m));
        W.fn[mr - 1](W.w + t * W.row_bytes, rows.data() + m, W.G, tmp);
        for (int r = 0; r < mr; ++r) {
          float* out = y + (m + r) * W.N;
          const float* o = tmp + r * W.R - n0;
          for (int64_t n = n0; n < n1; ++n) out[n] = o[n] + (bias ? bias[n] : 0.0f);
        }
      }
    }
  });
  PRODUCT_NS.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count(),
                       std::memory_order_relaxed);
}

}  // namespace
