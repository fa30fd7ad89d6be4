// Products of GGUF block-quantised weights (Q8_0, Q4_0, Q4_1) with activations quantised to 8-bit
// blocks: y (M, N) = x (M, K) . W (N, K)^T [+ bias (N)], W kept as the file stores it.
//
// Per activation row and block of 32: a = max|x|, dx = a / 127, q = rne(x * (127 / a)) in
// [-127, 127], s = sum q (integer). Per weight row and block: an integer dot product of the 32
// codes, then one float multiply-add (tformer/quant/blocks.py has the formulas):
//   q8_0: d dx sum(qw qx)        q4_0: d dx (sum(qw qx) - 8 s)        q4_1: d dx sum(qw qx) + m dx s
// The integer sums are exact; only the float32 products and their sum over blocks round.
//
// Three implementations of the same arithmetic, picked at run time (path argument, see paths()):
//   0 scalar      portable C++ (any CPU; the compiler may vectorise it for the baseline ISA);
//   1 avx2        AVX2 + FMA + F16C: _mm256_maddubs_epi16 (u8 x s8 pairs -> s16) + _mm256_madd_epi16;
//   2 avx512vnni  AVX-512 BW/VL/DQ + VNNI: _mm512_dpbusd_epi32 (u8 x s8 quads -> s32), 2 blocks a step.
// The file is compiled for the baseline ISA; each SIMD path carries its own target attribute, so
// one build runs on every x86 CPU, and __builtin_cpu_supports says which paths this one can run.
// maddubs / dpbusd multiply unsigned by signed bytes: q8_0 uses |qw| times qx with qw's sign
// (|-128| = 128 fits u8; 2 * 128 * 127 < 2^15, so maddubs cannot saturate), the 4-bit codes 0..15
// are unsigned already. Output rows are split between torch's threads (at::parallel_for).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <atomic>
#include <mutex>
#include <vector>
#if defined(__linux__)
#include <sys/mman.h>
#define TFORMER_ARENA 1
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TFORMER_X86 1
#include "float_rows.h"
#include "../ops/vec_erf.h"
#include "../ops/vec_exp.h"
#endif

namespace {

enum Fmt : int64_t { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2 };
enum Path : int64_t { SCALAR = 0, AVX2 = 1, AVX512VNNI = 2 };
constexpr int64_t BLOCK_BYTES[3] = {34, 18, 20};

// One quantised activation row: K codes, G float scales, per block the correction -8 s (q4_0) in
// lane 0 of 8 int32 (so a SIMD path adds it with one vector add), and dx * s (q4_1) in float.
struct QRow {
  const int8_t* q;
  const float* d;
  const int32_t* corr;  // (G, 8)
  const float* ds;      // (G,)
};

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Every path computes R output rows (rows w, w + stride, ...) against one activation row at a time:
// the activation codes of a block are loaded once for the R rows, and R streams of weights are in
// flight. F is the format (the branches on it vanish at compile time).
using DotFn = void (*)(const uint8_t* w, int64_t stride, const QRow& x, int64_t G, float* out);

// ---------------------------------------------------------------- scalar (portable) ----------
template <int F>
void dot_scalar(const uint8_t* w, int64_t, const QRow& x, int64_t G, float* out) {
  constexpr int64_t bytes = BLOCK_BYTES[F];
  float acc = 0.0f, mins = 0.0f;
  for (int64_t g = 0; g < G; ++g, w += bytes) {
    const int8_t* xq = x.q + 32 * g;
    int32_t s = 0;
    if (F == Q8_0) {
      const int8_t* qw = reinterpret_cast<const int8_t*>(w + 2);
      for (int k = 0; k < 32; ++k) s += int32_t(qw[k]) * xq[k];
    } else {
      const uint8_t* qs = w + bytes - 16;
      for (int k = 0; k < 16; ++k) s += int32_t(qs[k] & 15) * xq[k] + int32_t(qs[k] >> 4) * xq[k + 16];
      s += x.corr[8 * g];
    }
    acc += half_to_float(w) * x.d[g] * float(s);
    if (F == Q4_1) mins += half_to_float(w + 2) * x.ds[g];
  }
  out[0] = acc + mins;
}

#ifdef TFORMER_X86
// ---------------------------------------------------------------- AVX2 -----------------------
#define T_AVX2 __attribute__((target("avx2,fma,f16c")))

T_AVX2 inline float h2f_avx2(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

T_AVX2 inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 16 bytes of nibbles -> 32 bytes: elements 0..15 (low nibbles) then 16..31 (high nibbles).
T_AVX2 inline __m256i nibbles256(const uint8_t* p) {
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m256i b = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
  return _mm256_and_si256(b, _mm256_set1_epi8(15));
}

template <int F, int R>
T_AVX2 void dot_avx2(const uint8_t* w, int64_t stride, const QRow& x, int64_t G, float* out) {
  constexpr int64_t bytes = BLOCK_BYTES[F];
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  float mins[R];
  for (int r = 0; r < R; ++r) { acc[r] = _mm256_setzero_ps(); mins[r] = 0.0f; }
  for (int64_t g = 0; g < G; ++g) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + 32 * g));
    const float xd = x.d[g];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const uint8_t* b = w + r * stride + g * bytes;
      __m256i p;
      if (F == Q8_0) {
        __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
        p = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv)), ones);
      } else {
        p = _mm256_madd_epi16(_mm256_maddubs_epi16(nibbles256(b + bytes - 16), xv), ones);
        if (F == Q4_0) p = _mm256_add_epi32(p, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.corr + 8 * g)));
        if (F == Q4_1) mins[r] += h2f_avx2(b + 2) * x.ds[g];
      }
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(h2f_avx2(b) * xd), _mm256_cvtepi32_ps(p), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum256(acc[r]) + mins[r];
}

// ---------------------------------------------------------------- AVX-512 VNNI ---------------
#define T_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))

template <int F>
T_VNNI inline __m512i codes512(const uint8_t* w0, const uint8_t* w1) {
  if (F == Q8_0)
    return _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0 + 2))),
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w1 + 2)), 1);
  constexpr int64_t off = BLOCK_BYTES[F] - 16;
  return _mm512_inserti64x4(_mm512_castsi256_si512(nibbles256(w0 + off)), nibbles256(w1 + off), 1);
}

template <int F, int R>
T_VNNI void dot_vnni(const uint8_t* w, int64_t stride, const QRow& x, int64_t G, float* out) {
  constexpr int64_t bytes = BLOCK_BYTES[F];
  const __m512i zero = _mm512_setzero_si512();
  __m512 acc[R];
  float mins[R];
  for (int r = 0; r < R; ++r) { acc[r] = _mm512_setzero_ps(); mins[r] = 0.0f; }
  int64_t g = 0;
  for (; g + 2 <= G; g += 2) {                                   // blocks g, g + 1 in one register
    const __m512i xv = _mm512_loadu_si512(x.q + 32 * g);
    const __m512i init = F == Q4_0 ? _mm512_loadu_si512(x.corr + 8 * g) : zero;
    const float xd0 = x.d[g], xd1 = x.d[g + 1];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const uint8_t* b = w + r * stride + g * bytes;
      const __m512i wv = codes512<F>(b, b + bytes);
      __m512i p;
      if (F == Q8_0) {
        __m512i sx = _mm512_mask_sub_epi8(xv, _mm512_movepi8_mask(wv), zero, xv);   // qx with qw's sign
        p = _mm512_dpbusd_epi32(zero, _mm512_abs_epi8(wv), sx);
      } else {
        p = _mm512_dpbusd_epi32(init, wv, xv);
        if (F == Q4_1) mins[r] += h2f_avx2(b + 2) * x.ds[g] + h2f_avx2(b + bytes + 2) * x.ds[g + 1];
      }
      const __m512 sc = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(h2f_avx2(b) * xd0),
                                             _mm512_set1_ps(h2f_avx2(b + bytes) * xd1));
      acc[r] = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(p), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float tail = 0.0f;
    if (g < G) {                                                  // an odd last block: 256 bits
      const uint8_t* b = w + r * stride + g * bytes;
      __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + 32 * g));
      __m256i p;
      if (F == Q8_0) {
        __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
        p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
      } else {
        p = _mm256_dpbusd_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.corr + 8 * g)),
                                nibbles256(b + bytes - 16), xv);
        if (F == Q4_1) mins[r] += h2f_avx2(b + 2) * x.ds[g];
      }
      tail = hsum256(_mm256_mul_ps(_mm256_set1_ps(h2f_avx2(b) * x.d[g]), _mm256_cvtepi32_ps(p)));
    }
    out[r] = _mm512_reduce_add_ps(acc[r]) + tail + mins[r];
  }
}
#endif  // TFORMER_X86

constexpr int ROWS = 4;   // rows per SIMD call

// The kernel for (path, format): rows at a time (ROWS for SIMD, 1 for scalar) and one row.
void kernels(int64_t path, int64_t fmt, DotFn& many, DotFn& one, int& rows) {
  static const DotFn scalar[3] = {&dot_scalar<Q8_0>, &dot_scalar<Q4_0>, &dot_scalar<Q4_1>};
  many = one = scalar[fmt];
  rows = 1;
#ifdef TFORMER_X86
  static const DotFn avx2[2][3] = {{&dot_avx2<Q8_0, ROWS>, &dot_avx2<Q4_0, ROWS>, &dot_avx2<Q4_1, ROWS>},
                                   {&dot_avx2<Q8_0, 1>, &dot_avx2<Q4_0, 1>, &dot_avx2<Q4_1, 1>}};
  static const DotFn vnni[2][3] = {{&dot_vnni<Q8_0, ROWS>, &dot_vnni<Q4_0, ROWS>, &dot_vnni<Q4_1, ROWS>},
                                   {&dot_vnni<Q8_0, 1>, &dot_vnni<Q4_0, 1>, &dot_vnni<Q4_1, 1>}};
  if (path == AVX2 || path == AVX512VNNI) {
    const auto& t = path == AVX2 ? avx2 : vnni;
    many = t[0][fmt];
    one = t[1][fmt];
    rows = ROWS;
  }
#endif
}

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

// The paths this CPU can run, fastest last.
std::vector<int64_t> paths() {
  std::vector<int64_t> out;
  for (int64_t p : {SCALAR, AVX2, AVX512VNNI})
    if (supports(p)) out.push_back(p);
  return out;
}

// Activation row x (K floats) -> codes, scales, corrections (see QRow), written into the buffers.
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

// The op: blocks (N, G * bytes) uint8, x (M, K = 32 G) float32|bf16|f16, bias (N,) float32 or
// none, path 0|1|2. Returns y (M, N) in x's dtype.
at::Tensor qgemm(const at::Tensor& blocks, int64_t fmt, const at::Tensor& x, const c10::optional<at::Tensor>& bias,
                 int64_t path) {
  TORCH_CHECK(fmt >= 0 && fmt <= 2, "qgemm: fmt must be 0 (q8_0), 1 (q4_0) or 2 (q4_1)");
  TORCH_CHECK(path >= 0 && path <= 2 && supports(path), "qgemm: this CPU cannot run path ", path);
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  blocks.device().is_cpu() && blocks.size(1) % BLOCK_BYTES[fmt] == 0,
              "qgemm: blocks must be a contiguous CPU (N, G*", BLOCK_BYTES[fmt], ") uint8 matrix");
  const int64_t N = blocks.size(0), G = blocks.size(1) / BLOCK_BYTES[fmt], K = 32 * G;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "qgemm: x must be (M, ", K, ")");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N),
              "qgemm: bias must be contiguous float32 (N,)");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "qgemm: x must be float32, bfloat16 or float16");
  const int64_t M = x.size(0);
  at::Tensor xf = x.to(at::kFloat).contiguous();
  std::vector<int8_t> q(M * K);
  std::vector<float> d(M * G), ds(M * G);
  std::vector<int32_t> corr(M * G * 8);
  const float* xp = xf.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      quantize_row(fmt, xp + m * K, K, q.data() + m * K, d.data() + m * G, corr.data() + m * G * 8, ds.data() + m * G);
  });
  at::Tensor yf = at::empty({M, N}, xf.options());
  float* yp = yf.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  const int64_t row_bytes = blocks.size(1);
  DotFn many, one;
  int rows;
  kernels(path, fmt, many, one, rows);
  // ~32 KB of weight per task (rows of one task stay in L1/L2 while every activation row passes)
  const int64_t grain = std::max<int64_t>(ROWS, (32768 / row_bytes) / ROWS * ROWS);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    float tmp[ROWS];
    for (int64_t m = 0; m < M; ++m) {
      const QRow row{q.data() + m * K, d.data() + m * G, corr.data() + m * G * 8, ds.data() + m * G};
      float* out = yp + m * N;
      int64_t n = n0;
      for (; n + rows <= n1; n += rows) {
        many(wp + n * row_bytes, row_bytes, row, G, tmp);
        for (int r = 0; r < rows; ++r) out[n + r] = tmp[r] + (bp ? bp[n + r] : 0.0f);
      }
      for (; n < n1; ++n) {
        one(wp + n * row_bytes, row_bytes, row, G, tmp);
        out[n] = tmp[0] + (bp ? bp[n] : 0.0f);
      }
    }
  });
  return x.scalar_type() == at::kFloat ? yf : yf.to(x.scalar_type());
}

// ---------------------------------------------------------------- interleaved tiles ----------
// The SIMD paths run on weights repacked R rows at a time (R = 8 for AVX2, 16 for AVX-512): tile t
// holds rows tR .. tR + R - 1 (zero rows pad the last tile), and for each block g, in order:
//   d[R] fp16 | m[R] fp16 (q4_1 only) | codes, as [quad j][row r][4 bytes]
// where quad j of a row is its codes 4j .. 4j + 3: for q4_0 / q4_1 j = 0..3 and each byte holds code
// 4j + b in its low nibble and code 16 + 4j + b in its high nibble (the file's qs[4j + b], moved);
// for q8_0 j = 0..7, one code a byte (signed for AVX2; for AVX-512 plus 128, i.e. unsigned).
// A 32-bit lane r of one vector then holds row r's four codes of one quad: the activation's four
// codes are broadcast to every lane and one dpbusd (or maddubs + madd) adds four products to each
// row's sum: R rows' dot products with no horizontal sums, and the R scales of a block are one
// vector (cvtph). Bytes per tile and block: R * BLOCK_BYTES (the same bytes as the file, moved).
int64_t tile_block_bytes(int64_t fmt, int64_t R) { return R * BLOCK_BYTES[fmt]; }

// Where tiles live: arenas of 2 MB pages, filled in the order repack is called. A decode step
// streams every weight once, ~60-110 MB for SmolLM2, from memory: on 4 KB pages each page is a TLB
// miss and the hardware prefetcher stops at every page boundary, and each matrix (0.2-0.6 MB) is
// its own allocation, too small for a huge page. Tiles repacked one after another (BlockLinear at
// its first call, the fused plan layer by layer: decode order) lie end to end on 2 MB pages
// instead. An arena (ARENA bytes, or one tensor's if larger) is mapped fresh, asked for huge pages
// (madvise: a hint; where the kernel refuses, 4 KB pages and the same bytes), handed out front to
// back, and unmapped when the last tensor in it dies (the open one starts again at its front).
#ifdef TFORMER_ARENA
constexpr size_t HUGE_PAGE = size_t(2) << 20, ARENA = size_t(64) << 20;

struct Arena {
  uint8_t* base = nullptr;     // HUGE_PAGE aligned
  size_t size = 0, used = 0, live = 0;
  void* map = nullptr;         // what mmap returned, and its length
  size_t map_len = 0;
};

std::mutex ARENA_LOCK;
Arena* OPEN_ARENA = nullptr;   // the one new tiles go into (nullptr: none yet, or it is full)

void release_tiles(Arena* a) {
  std::lock_guard<std::mutex> hold(ARENA_LOCK);
  if (--a->live > 0) return;
  if (a == OPEN_ARENA) {
    a->used = 0;          // empty: the next tiles start at its front again (one-off repacks do not pile up)
  } else {
    munmap(a->map, a->map_len);
    delete a;
  }
}

// A zero-filled uint8 (rows, cols) tensor in an arena; plain at::zeros where mmap fails.
at::Tensor arena_zeros(int64_t rows, int64_t cols, const at::TensorOptions& opts) {
  const size_t want = (size_t(rows * cols) + 63) / 64 * 64;        // 64-byte aligned slices
  std::lock_guard<std::mutex> hold(ARENA_LOCK);
  if (OPEN_ARENA == nullptr || OPEN_ARENA->size - OPEN_ARENA->used < want) {
    if (OPEN_ARENA != nullptr && OPEN_ARENA->live == 0) {             // full and unused: let it go
      munmap(OPEN_ARENA->map, OPEN_ARENA->map_len);
      delete OPEN_ARENA;
    }
    OPEN_ARENA = nullptr;
    const size_t size = std::max(ARENA, (want + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE);
    void* m = mmap(nullptr, size + HUGE_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return at::zeros({rows, cols}, opts);
    auto* a = new Arena;
    a->map = m, a->map_len = size + HUGE_PAGE, a->size = size;
    a->base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(m) + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE);
#ifdef MADV_HUGEPAGE
    madvise(a->base, size, MADV_HUGEPAGE);
#endif
    OPEN_ARENA = a;
  }
  Arena* a = OPEN_ARENA;
  uint8_t* p = a->base + a->used;
  a->used += want;
  ++a->live;
  std::memset(p, 0, want);                                          // a reused front is not zero any more
  return at::from_blob(p, {rows, cols}, [a](void*) { release_tiles(a); }, opts);
}
#else
at::Tensor arena_zeros(int64_t rows, int64_t cols, const at::TensorOptions& opts) { return at::zeros({rows, cols}, opts); }
#endif

at::Tensor repack(const at::Tensor& blocks, int64_t fmt, int64_t R) {
  TORCH_CHECK(fmt >= 0 && fmt <= 2 && (R == 8 || R == 16), "repack: fmt 0..2 and R 8 or 16");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  blocks.size(1) % BLOCK_BYTES[fmt] == 0, "repack: blocks must be contiguous (N, G*bytes) uint8");
  const int64_t N = blocks.size(0), bytes = BLOCK_BYTES[fmt], G = blocks.size(1) / bytes;
  const int64_t T = (N + R - 1) / R, tb = tile_block_bytes(fmt, R);
  at::Tensor out = arena_zeros(T, G * tb, blocks.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const bool offset = fmt == Q8_0 && R == 16;
  for (int64_t n = 0; n < N; ++n) {
    const int64_t t = n / R, r = n % R;
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* b = src + (n * G + g) * bytes;
      uint8_t* o = dst + (t * G + g) * tb;
      std::memcpy(o + 2 * r, b, 2);                                       // d
      int64_t off = 2 * R;
      if (fmt == Q4_1) { std::memcpy(o + off + 2 * r, b + 2, 2); off += 2 * R; }
      const uint8_t* qs = b + (fmt == Q8_0 ? 2 : bytes - 16);
      const int quads = fmt == Q8_0 ? 8 : 4;
      for (int j = 0; j < quads; ++j)
        for (int k = 0; k < 4; ++k) o[off + (j * R + r) * 4 + k] = offset ? uint8_t(qs[4 * j + k] ^ 0x80) : qs[4 * j + k];
    }
  }
  return out;
}

// One activation row against one tile: out[R] = the R rows' products (no bias).
struct XRow {
  const int8_t* q;      // (K,)
  const float* d;       // (G,)
  const int32_t* s;     // (G,) sum of the codes
  const float* ds;      // (G,) d * s
};

// Software prefetch of the tile kernels, into L2, 12 KB ahead of the block being read. At M = 1 a
// decode step is a stream from memory and the hardware prefetcher alone keeps too few lines in
// flight; and since repack lays a model's tiles end to end in decode order (the arenas above), a
// prefetch past a matrix's end fetches the start of the next product's weights while the layer's
// other work (attention, norms) runs. Measured on SmolLM2 Q4_1 decode steps, distances alternated in
// one process (1 and 2 threads): 12 KB into L2 1.05-1.11x 3 KB into L1, which was 1.5-2.0x none in
// isolation; 6, 8 and 16 KB, and 12 KB plus 1 KB into L1, no better. Into L2 rather than L1 so the
// lines in flight fit beside the activations in a 32 KB L1 (Zen 3) as in this Xeon's 48 KB. A
// prefetch past the last tiles is a hint that may fetch nothing useful, never a fault.
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
  constexpr int64_t tb = 8 * BLOCK_BYTES[F];
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
    } else {
      const uint8_t* c = w + (F == Q4_1 ? 32 : 16);
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
    if (F == Q4_1) {
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16)));
      for (int r = 0; r < MR; ++r) acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x[r].ds[g]), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm256_storeu_ps(out + 8 * r, acc[r]);
}

// q4 high nibbles are multiplied in place, as (byte & 0xF0) = 16 hi: a chain of those sums to
// 16 sum(hi x) exactly (|16 * 15 * 127 * 16| < 2^31), and one arithmetic shift right by 4 per
// block gives sum(hi x): one AND per 64 bytes instead of a shift and an AND.
template <int F, int MR>
T_VNNI void tile_vnni(const uint8_t* w, const XRow* x, int64_t G, float* out) {    // out (MR, 16)
  constexpr int64_t tb = 16 * BLOCK_BYTES[F];
  const __m512i low = _mm512_set1_epi8(15), high = _mm512_set1_epi8(int8_t(0xF0));
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
      const uint8_t* c = w + (F == Q4_1 ? 64 : 32);
      for (int r = 0; r < MR; ++r)
        a[r] = F == Q4_0 ? _mm512_set1_epi32(-8 * x[r].s[g]) : _mm512_setzero_si512(), b[r] = _mm512_setzero_si512();
      for (int j = 0; j < 4; ++j) {
        const __m512i wv = _mm512_loadu_si512(c + 64 * j);
        const __m512i lo = _mm512_and_si512(wv, low), hi16 = _mm512_and_si512(wv, high);
        for (int r = 0; r < MR; ++r) {
          const int32_t* xq = reinterpret_cast<const int32_t*>(x[r].q + 32 * g);
          a[r] = _mm512_dpbusd_epi32(a[r], lo, _mm512_set1_epi32(xq[j]));
          b[r] = _mm512_dpbusd_epi32(b[r], hi16, _mm512_set1_epi32(xq[4 + j]));
        }
      }
      for (int r = 0; r < MR; ++r) b[r] = _mm512_srai_epi32(b[r], 4);
    }
    for (int r = 0; r < MR; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(x[r].d[g])),
                               _mm512_cvtepi32_ps(_mm512_add_epi32(a[r], b[r])), acc[r]);
    if (F == Q4_1) {
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32)));
      for (int r = 0; r < MR; ++r) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x[r].ds[g]), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(out + 16 * r, acc[r]);
}
#endif

// M activation rows quantised once (codes, scales, per-block sums): what every tile product reads.
// A fused decode layer quantises the normed row once and hands it to q/k/v (one matrix) and to
// both gate and up.
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
  static const TileFns avx2[3] = {
      {&tile_avx2<Q8_0, 1>, &tile_avx2<Q8_0, 2>, &tile_avx2<Q8_0, 3>, &tile_avx2<Q8_0, 4>},
      {&tile_avx2<Q4_0, 1>, &tile_avx2<Q4_0, 2>, &tile_avx2<Q4_0, 3>, &tile_avx2<Q4_0, 4>},
      {&tile_avx2<Q4_1, 1>, &tile_avx2<Q4_1, 2>, &tile_avx2<Q4_1, 3>, &tile_avx2<Q4_1, 4>}};
  static const TileFns vnni[3] = {
      {&tile_vnni<Q8_0, 1>, &tile_vnni<Q8_0, 2>, &tile_vnni<Q8_0, 3>, &tile_vnni<Q8_0, 4>},
      {&tile_vnni<Q4_0, 1>, &tile_vnni<Q4_0, 2>, &tile_vnni<Q4_0, 3>, &tile_vnni<Q4_0, 4>},
      {&tile_vnni<Q4_1, 1>, &tile_vnni<Q4_1, 2>, &tile_vnni<Q4_1, 3>, &tile_vnni<Q4_1, 4>}};
  return path == AVX2 ? avx2[fmt] : vnni[fmt];
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

// Profiling: nanoseconds spent in tile_product, summed over calls (product_ns reads and may reset
// it): a product's time where it runs, among a layer's other work (smollm2_step_profile.py).
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

// The op on tiles: tiles (T, G * R * bytes) from repack(), N <= T R outputs, path avx2 (R 8) or
// avx512vnni (R 16). x (M, K) -> y (M, N) in x's dtype.
at::Tensor qgemm_tiles(const at::Tensor& tiles, int64_t fmt, int64_t N, const at::Tensor& x,
                       const c10::optional<at::Tensor>& bias, int64_t path) {
  TORCH_CHECK(fmt >= 0 && fmt <= 2, "qgemm_tiles: fmt must be 0, 1 or 2");
  TORCH_CHECK((path == AVX2 || path == AVX512VNNI) && supports(path), "qgemm_tiles: this CPU cannot run path ", path);
  const TileMatrix W = tile_matrix(tiles, fmt, N, path, "qgemm_tiles");
  const int64_t K = 32 * W.G;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "qgemm_tiles: x must be (M, ", K, ")");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N),
              "qgemm_tiles: bias must be contiguous float32 (N,)");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "qgemm_tiles: x must be float32, bfloat16 or float16");
  const int64_t M = x.size(0);
  at::Tensor xf = x.to(at::kFloat).contiguous();
  QAct a;
  a.quantize(xf.data_ptr<float>(), M, K);
  at::Tensor yf = at::empty({M, N}, xf.options());
  tile_product(W, a, bias.has_value() ? bias->data_ptr<float>() : nullptr, yf.data_ptr<float>());
  return x.scalar_type() == at::kFloat ? yf : yf.to(x.scalar_type());
}

// For benchmarks: seconds per pass of the tile products over `mats` (the tiles of weight i, N_i =
// ns[i] rows, format fmts[i]), in order, as a decode step makes them: each against the first K_i
// columns of x (M, Kmax) float32, quantised before the clock starts (decode_layer quantises once per
// width). One untimed pass, then `reps` timed: the kernels' streaming rate without Python, dispatch
// or allocation.
double tile_passes(at::TensorList mats, at::IntArrayRef fmts, at::IntArrayRef ns, const at::Tensor& x, int64_t path,
                   int64_t reps) {
  TORCH_CHECK((path == AVX2 || path == AVX512VNNI) && supports(path), "tile_passes: this CPU cannot run path ", path);
  TORCH_CHECK(mats.size() == fmts.size() && mats.size() == ns.size() && reps > 0, "tile_passes: one fmt and N per matrix");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "tile_passes: x (M, K) float32");
  const int64_t M = x.size(0), Kx = x.size(1);
  std::vector<TileMatrix> W;
  std::vector<QAct> acts(mats.size());
  int64_t most = 0;
  for (size_t i = 0; i < mats.size(); ++i) {
    TORCH_CHECK(fmts[i] >= 0 && fmts[i] <= 2, "tile_passes: a format must be 0, 1 or 2");
    W.push_back(tile_matrix(mats[i], fmts[i], ns[i], path, "tile_passes"));
    const int64_t K = 32 * W.back().G;
    TORCH_CHECK(K <= Kx, "tile_passes: x is narrower than a matrix");
    std::vector<float> cols(M * K);
    for (int64_t m = 0; m < M; ++m) std::memcpy(cols.data() + m * K, x.data_ptr<float>() + m * Kx, K * sizeof(float));
    acts[i].quantize(cols.data(), M, K);
    most = std::max(most, ns[i]);
  }
  std::vector<float> y(M * most);
  auto pass = [&] { for (size_t i = 0; i < W.size(); ++i) tile_product(W[i], acts[i], nullptr, y.data()); };
  pass();
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < reps; ++r) pass();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / double(reps);
}

// ---------------------------------------------------------------- one fused decode layer -----
// A pre-norm decoder block for N new tokens, all in one call: the Llama shape (RMSNorm, GQA attention
// with rotate-half RoPE, SwiGLU, no biases) or the GPT-2 shape (LayerNorm with biases, learned
// positions added before the first layer, so no rotation here, a GELU MLP, biases on every product).
// Token i belongs to cache row r_i = rows[i] (r_i = i without `rows`: one token per row, the decode
// step), writes its key and value at cache index w_i = write_index[i], is rotated at position
// p_i = positions[i] and attends over the keys j <= w_i of its row that valid[r_i, j] marks real (all
// of them without `valid`): an eager cache has w_i = p_i = the length held (+ t for the t-th of
// several new tokens of a row); a static one (the server's pool) its per-row index and count.
//   h = norm_attn(x)       RMSNorm x / sqrt(mean(x^2) + eps) g, or LayerNorm (x - mean) / sqrt(var + eps) g + b
//   [q | k | v] = h . Wqkv^T (+ b)                              (one product)
//   q, k <- q cos[p_i] + rot(q) sin[p_i], rot(u) = [-u_hi, u_lo]   (with RoPE: each head, hs/2 halves)
//   K[r_i, w_i] <- k, V[r_i, w_i] <- v                          (the cache buffers (rows, nkv, L, hs),
//                                                                float32, bfloat16 or float16)
//   o_h = sum_j softmax_j(q_h . K_j / sqrt(hs)) V_j over the real j <= w_i (zero if there is none;
//                                                                head h reads kv head h / (nh/nkv))
//   x <- x + o . Wo^T (+ b)
//   h = norm_ffn(x);  x <- x + (silu(h Wg^T) * (h Wu^T)) . Wd^T        (SwiGLU)
//                 or  x <- x + act(h Wu^T + b) . Wd^T + b,  act GELU (tanh or erf form), ReLU, ReLU^2 or SiLU
// Every token's key and value is written before any token attends, so several new tokens of one
// row (a speculative check, a prompt) see each other causally through the cache: token i reads the
// row's keys up to its own index, which holds the earlier new tokens and not the later ones.
// A product is either block tiles (formats 0-2: the tile kernels of qgemm_tiles on activations
// quantised once per input, so the arithmetic equals the module path's BlockLinear) or a float
// (N, K) matrix (3 float32, 4 bfloat16, 5 float16: float_rows.h's loops, as tformer's GEMV), so
// the fused layer differs from the module path only in float summation order, except that the
// residual stream stays float32 here whatever the weights' type (the module path of a bf16 model
// rounds it to bf16 after every op; llama.cpp keeps it float32 too).
constexpr int64_t F32 = 3, BF16 = 4, F16 = 5;
enum Mlp : int64_t { SWIGLU = 0, GELU_TANH = 1, RELU = 2, RELU2 = 3, GELU = 4, SILU = 5 };   // the plain MLP's activation

void rms_norm_rows(const float* x, const float* g, double eps, int64_t M, int64_t C, float* out) {
  for (int64_t m = 0; m < M; ++m) {
    const float* r = x + m * C;
    double ss = 0.0;
    for (int64_t c = 0; c < C; ++c) ss += double(r[c]) * r[c];
    const float inv = float(1.0 / std::sqrt(ss / double(C) + eps));
    for (int64_t c = 0; c < C; ++c) out[m * C + c] = (r[c] * inv) * g[c];
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
// type widened in registers (float_rows.h's load8) (decode_layer runs only on the SIMD paths, which
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
// `real` marks (all without it): o = softmax(q K^T scale) V, zero if no key is real. p: n floats.
template <typename T>
T_ATT void attend_head(const float* q, const T* K, const T* V, int64_t s2, int64_t n, const bool* real,
                       float scale, int64_t hs, float* p, float* o) {
  scores(q, K, s2, n, hs, scale, p);                                    // padding keys too (finite), masked next
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

// One of a layer's matrices, N outputs of K inputs: block tiles (fmt 0-2) or a float (N, K) matrix
// (F32, BF16, F16), with an optional float32 bias (N).
struct Product {
  int64_t fmt = 0, N = 0, K = 0;
  TileMatrix tiles{};
  const void* w = nullptr;
  const float* bias = nullptr;
  bool blocks() const { return fmt <= Q4_1; }
};

Product make_product(const at::Tensor& m, const c10::optional<at::Tensor>& bias, int64_t fmt, int64_t N,
                     int64_t path, const char* what) {
  Product P;
  P.fmt = fmt, P.N = N;
  if (P.blocks()) {
    P.tiles = tile_matrix(m, fmt, N, path, what);
    P.K = 32 * P.tiles.G;
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

// y = x . W^T (+ b) for x (M, P.K): a block product quantises x into `a` unless `quantised` says
// `a` holds it already (gate and up read one quantisation of h)
void apply(const Product& P, const float* x, int64_t M, QAct& a, bool& quantised, float* y, int64_t path) {
  if (P.blocks()) {
    if (!quantised) a.quantize(x, M, P.K);
    quantised = true;
    tile_product(P.tiles, a, P.bias, y);
    return;
  }
  const bool wide = path == AVX512VNNI;
  if (P.fmt == F32) float_product(static_cast<const float*>(P.w), P, x, M, y, wide);
  else if (P.fmt == BF16) float_product(static_cast<const at::BFloat16*>(P.w), P, x, M, y, wide);
  else float_product(static_cast<const at::Half*>(P.w), P, x, M, y, wide);
}

// The attention of every (token, query head), over caches of element type T
template <typename T>
void attend_all(const float* proj, int64_t N, int64_t NQKV, int64_t nh, int64_t group, int64_t hs, const T* kc,
                const T* vc, int64_t s0, int64_t s1, int64_t s2, int64_t L, const int64_t* wi, const int64_t* ri,
                const bool* vp, int64_t vs, float* att) {
  const float scale = 1.0f / std::sqrt(float(hs));
  const int64_t Q = nh * hs;
  at::parallel_for(0, N * nh, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> p(L);
    for (int64_t t = i0; t < i1; ++t) {
      const int64_t i = t / nh, hd = t % nh, kvh = hd / group, row = ri ? ri[i] : i;
      attend_head(proj + i * NQKV + hd * hs, kc + row * s0 + kvh * s1, vc + row * s0 + kvh * s1, s2,
                  wi[i] + 1, vp ? vp + row * vs : nullptr, scale, hs, p.data(), att + i * Q + hd * hs);
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

// norms: (g_attn, g_ffn) for RMSNorm, (g_attn, b_attn, g_ffn, b_ffn) for LayerNorm, float32 (C,).
// mats / biases / fmts: (qkv, o, gate, up, down) for SwiGLU, (qkv, o, up, down) for a plain MLP (GELU, ReLU, ReLU², SiLU).
// dims: (nh, nkv, hs, d_ff, mlp). cos / sin: the rotary tables, absent for a model without RoPE.
void decode_layer(const at::Tensor& x, at::TensorList norms, double eps, at::TensorList mats,
                  const c10::List<c10::optional<at::Tensor>>& biases, at::IntArrayRef fmts, at::IntArrayRef dims,
                  const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& write_index,
                  const at::Tensor& positions, const c10::optional<at::Tensor>& valid,
                  const c10::optional<at::Tensor>& rows, const c10::optional<at::Tensor>& cos,
                  const c10::optional<at::Tensor>& sin, int64_t path) {
  TORCH_CHECK((path == AVX2 || path == AVX512VNNI) && supports(path), "decode_layer: this CPU cannot run path ", path);
  TORCH_CHECK(dims.size() == 5 && dims[4] >= SWIGLU && dims[4] <= SILU,
              "decode_layer: dims (nh, nkv, hs, d_ff, mlp 0 swiglu | 1 gelu_tanh | 2 relu | 3 relu2 | 4 gelu | 5 silu)");
  const int64_t nh = dims[0], nkv = dims[1], hs = dims[2], F = dims[3], mlp = dims[4];
  const size_t n_mats = mlp == SWIGLU ? 5 : 4;
  TORCH_CHECK(mats.size() == n_mats && biases.size() == n_mats && fmts.size() == n_mats,
              "decode_layer: mats, biases and fmts: (qkv, o, gate, up, down) for SwiGLU, (qkv, o, up, down) otherwise");
  for (auto f : fmts) TORCH_CHECK(f >= Q8_0 && f <= F16, "decode_layer: a format must be 0-2 (blocks) or 3-5 (float32, bfloat16, float16)");
  TORCH_CHECK(nh > 0 && nkv > 0 && nh % nkv == 0 && hs % 2 == 0 && hs <= 512, "decode_layer: bad head layout");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "decode_layer: x must be contiguous float32 (N, C)");
  const int64_t N = x.size(0), C = x.size(1), Q = nh * hs, KV = nkv * hs, NQKV = Q + 2 * KV;
  const auto cache_type = k_cache.scalar_type();
  const int64_t Bc = k_cache.dim() == 4 ? k_cache.size(0) : 0;          // cache rows
  for (const at::Tensor* c : {&k_cache, &v_cache})
    TORCH_CHECK(c->dim() == 4 && c->scalar_type() == cache_type && c->stride(3) == 1 && c->size(0) == Bc &&
                    c->size(1) == nkv && c->size(3) == hs && c->strides() == k_cache.strides() &&
                    (cache_type == at::kFloat || cache_type == at::kBFloat16 || cache_type == at::kHalf),
                "decode_layer: the caches must be float32, bfloat16 or float16 (rows, nkv, L, hs), each head's vector contiguous");
  TORCH_CHECK(rows.has_value() || Bc == N, "decode_layer: without rows, the caches hold one row per token");
  // the caches may be views (a row range and a key prefix of the server's pool): strided access
  const int64_t s0 = k_cache.stride(0), s1 = k_cache.stride(1), s2 = k_cache.stride(2);
  const int64_t L = k_cache.size(2);
  for (const at::Tensor* t : {&write_index, &positions})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == N,
                "decode_layer: write_index and positions must be contiguous int64 (N,)");
  TORCH_CHECK(!valid.has_value() || (valid->scalar_type() == at::kBool && valid->stride(1) == 1 &&
                                     valid->dim() == 2 && valid->size(0) == Bc && valid->size(1) == L),
              "decode_layer: valid must be bool (rows, L), rows contiguous");
  TORCH_CHECK(!rows.has_value() || (rows->scalar_type() == at::kLong && rows->is_contiguous() && rows->numel() == N),
              "decode_layer: rows must be contiguous int64 (N,)");
  const int64_t vs = valid.has_value() ? valid->stride(0) : 0;
  TORCH_CHECK(norms.size() == 2 || norms.size() == 4, "decode_layer: norms (g, g) for RMSNorm or (g, b, g, b) for LayerNorm");
  for (const at::Tensor& t : norms)
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == C, "decode_layer: norm weights (C,) float32");
  const bool layer_norm = norms.size() == 4;
  const bool rope = cos.has_value();
  TORCH_CHECK(rope == sin.has_value(), "decode_layer: give both rotary tables or neither");
  if (rope)
    for (const at::Tensor* t : {&*cos, &*sin})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(1) == hs,
                  "decode_layer: cos/sin tables (P, hs) float32");
  const int64_t* wi = write_index.data_ptr<int64_t>();
  const int64_t* pi = positions.data_ptr<int64_t>();
  const int64_t* ri = rows.has_value() ? rows->data_ptr<int64_t>() : nullptr;
  const int64_t P_max = rope ? cos->size(0) : std::numeric_limits<int64_t>::max();
  for (int64_t i = 0; i < N; ++i)
    TORCH_CHECK(wi[i] >= 0 && wi[i] < L && pi[i] >= 0 && pi[i] < P_max && (!ri || (ri[i] >= 0 && ri[i] < Bc)),
                "decode_layer: a write index past the cache, a position past the rotary table or a row past the caches");
  const bool* vp = valid.has_value() ? valid->data_ptr<bool>() : nullptr;
  const char* names[5] = {"decode_layer qkv", "decode_layer out", "decode_layer gate", "decode_layer up", "decode_layer down"};
  const int64_t outs[5] = {NQKV, C, F, F, C};
  std::vector<Product> W;
  for (size_t i = 0; i < n_mats; ++i) {
    const size_t role = mlp == SWIGLU || i < 2 ? i : i + 1;              // a plain MLP has no gate
    W.push_back(make_product(mats[i], biases.get(i), fmts[i], outs[role], path, names[role]));
  }
  const Product &Wqkv = W[0], &Wo = W[1], &Wd = W.back();
  const Product& Wu = W[n_mats - 2];
  TORCH_CHECK(Wqkv.K == C && Wo.K == Q && Wu.K == C && (mlp != SWIGLU || W[2].K == C) && Wd.K == F,
              "decode_layer: the weights' widths do not match x and the head layout");
  for (const Product& p : W)
    TORCH_CHECK(!p.blocks() || p.K % 32 == 0, "decode_layer: a block product's input width must be a multiple of 32");

  float* xp = x.data_ptr<float>();
  const int64_t group = nh / nkv;
  std::vector<float> h(N * std::max(C, F)), proj(N * std::max(NQKV, 2 * F)), att(N * Q);
  QAct a;
  auto norm = [&](int which) {                                         // h = norm_which(x)
    if (layer_norm) layer_norm_rows(xp, norms[2 * which].data_ptr<float>(), norms[2 * which + 1].data_ptr<float>(), eps, N, C, h.data());
    else rms_norm_rows(xp, norms[which].data_ptr<float>(), eps, N, C, h.data());
  };

  // attention sub-layer: every token's key and value into the cache first, then every token attends
  norm(0);
  bool quantised = false;
  apply(Wqkv, h.data(), N, a, quantised, proj.data(), path);           // (N, NQKV): q heads, k heads, v heads
  if (rope) {
    const float* cp = cos->data_ptr<float>();
    const float* sp = sin->data_ptr<float>();
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j = 0; j < nh + nkv; ++j)                              // q, k rotated
        rope_head(proj.data() + i * NQKV + j * hs, cp + pi[i] * hs, sp + pi[i] * hs, hs);
  }
  auto attention = [&](auto* kc, auto* vc) {
    write_kv(proj.data(), N, NQKV, Q, KV, nkv, hs, kc, vc, s0, s1, s2, wi, ri);
    attend_all(proj.data(), N, NQKV, nh, group, hs, kc, vc, s0, s1, s2, L, wi, ri, vp, vs, att.data());
  };
  if (cache_type == at::kFloat) attention(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  else if (cache_type == at::kBFloat16) attention(k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>());
  else attention(k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>());
  quantised = false;
  apply(Wo, att.data(), N, a, quantised, h.data(), path);              // (N, C)
  for (int64_t i = 0; i < N * C; ++i) xp[i] += h[i];

  // feed-forward sub-layer
  norm(1);
  quantised = false;
  float* g = proj.data();
  float* u = proj.data() + N * F;
  const float* act = g;                                                // (N, F): the down product's input
  if (mlp == SWIGLU) {
    apply(W[2], h.data(), N, a, quantised, g, path);
    apply(Wu, h.data(), N, a, quantised, u, path);                     // h quantised once for both
    silu_mul(g, u, u, N * F);                                           // silu(g) * u
    act = u;
  } else {
    apply(Wu, h.data(), N, a, quantised, g, path);
    switch (mlp) {
      case GELU_TANH: gelu_tanh(g, N * F); break;
      case GELU: gelu_erf(g, N * F); break;
      case SILU: silu(g, N * F); break;
      case RELU2: for (int64_t i = 0; i < N * F; ++i) { const float r = std::max(g[i], 0.0f); g[i] = r * r; } break;
      default: for (int64_t i = 0; i < N * F; ++i) g[i] = std::max(g[i], 0.0f);               // RELU
    }
  }
  quantised = false;
  apply(Wd, act, N, a, quantised, h.data(), path);                     // (N, C)
  for (int64_t i = 0; i < N * C; ++i) xp[i] += h[i];
}

// Every layer of a step in one call (one dispatch and no Python loop instead of one call per layer: a
// 12-layer model of width 64, caches hot, spent 0.19 instead of 0.25 ms a token in its layers):
// norms / mats / biases / fmts hold each layer's decode_layer lists one layer after another, and
// k_caches / v_caches one cache per layer; x, the indices, the mask and the rotary tables are shared.
void decode_layers(const at::Tensor& x, at::TensorList norms, double eps, at::TensorList mats,
                   const c10::List<c10::optional<at::Tensor>>& biases, at::IntArrayRef fmts, at::IntArrayRef dims,
                   at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& write_index,
                   const at::Tensor& positions, const c10::optional<at::Tensor>& valid,
                   const c10::optional<at::Tensor>& rows, const c10::optional<at::Tensor>& cos,
                   const c10::optional<at::Tensor>& sin, int64_t path) {
  const size_t layers = k_caches.size();
  TORCH_CHECK(layers > 0 && v_caches.size() == layers && norms.size() % layers == 0 && mats.size() % layers == 0 &&
                  biases.size() == mats.size() && fmts.size() == mats.size(),
              "decode_layers: one k and v cache per layer, and the same count of norms and of products in every layer");
  const size_t nn = norms.size() / layers, nm = mats.size() / layers;
  for (size_t l = 0; l < layers; ++l) {
    c10::List<c10::optional<at::Tensor>> b;
    for (size_t i = 0; i < nm; ++i) b.push_back(biases.get(l * nm + i));
    decode_layer(x, norms.slice(l * nn, nn), eps, mats.slice(l * nm, nm), b, fmts.slice(l * nm, nm), dims,
                 k_caches[l], v_caches[l], write_index, positions, valid, rows, cos, sin, path);
  }
}

int64_t product_ns(bool reset) { return reset ? PRODUCT_NS.exchange(0) : PRODUCT_NS.load(); }

}  // namespace

TORCH_LIBRARY(tformer_qgemv, m) {
  m.def("qgemm(Tensor blocks, int fmt, Tensor x, Tensor? bias, int path) -> Tensor");
  m.def("paths() -> int[]");
  m.def("repack(Tensor blocks, int fmt, int R) -> Tensor");
  m.def("qgemm_tiles(Tensor tiles, int fmt, int N, Tensor x, Tensor? bias, int path) -> Tensor");
  m.def("decode_layer(Tensor(a!) x, Tensor[] norms, float eps, Tensor[] mats, Tensor?[] biases, int[] fmts, "
        "int[] dims, Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor write_index, Tensor positions, Tensor? valid, "
        "Tensor? rows, Tensor? cos, Tensor? sin, int path) -> ()");
  m.def("decode_layers(Tensor(a!) x, Tensor[] norms, float eps, Tensor[] mats, Tensor?[] biases, int[] fmts, "
        "int[] dims, Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, Tensor write_index, Tensor positions, Tensor? valid, "
        "Tensor? rows, Tensor? cos, Tensor? sin, int path) -> ()");
  m.def("tile_passes(Tensor[] mats, int[] fmts, int[] ns, Tensor x, int path, int reps) -> float");
  m.def("product_ns(bool reset) -> int");
}

TORCH_LIBRARY_IMPL(tformer_qgemv, CPU, m) {
  m.impl("qgemm", &qgemm);
  m.impl("repack", &repack);
  m.impl("qgemm_tiles", &qgemm_tiles);
  m.impl("decode_layer", &decode_layer);
  m.impl("decode_layers", &decode_layers);
  m.impl("tile_passes", &tile_passes);
}
TORCH_LIBRARY_IMPL(tformer_qgemv, CompositeExplicitAutograd, m) { m.impl("paths", &paths); m.impl("product_ns", &product_ns); }
