// Products of GGUF block-quantised weights (Q8_0, Q4_0, Q4_1; Q5_0, Q5_1 as tiles) with activations quantised to 8-bit
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
// The activation rounding and the tile kernels are tiles.h's (shared with fused/layers.cpp).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>
#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#define TFORMER_ARENA 1
#endif
#include "tiles.h"
#include "kquants.h"

namespace {

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

T_AVX2 inline float h2f_avx2(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
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


// The paths this CPU can run, fastest last.
std::vector<int64_t> paths() {
  std::vector<int64_t> out;
  for (int64_t p : {SCALAR, AVX2, AVX512VNNI})
    if (supports(p)) out.push_back(p);
  return out;
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
// Their layout and kernels: tiles.h.

// Where tiles live: arenas of 2 MB pages, filled in the order repack is called. A decode step
// streams every weight once, ~60-110 MB for SmolLM2, from memory: on 4 KB pages each page is a TLB
// miss and the hardware prefetcher stops at every page boundary, and each matrix (0.2-0.6 MB) is
// its own allocation, too small for a huge page. Tiles repacked one after another (BlockLinear at
// its first call, the whole-layer plan layer by layer: decode order) lie end to end on 2 MB pages
// instead. An arena (ARENA bytes, or one tensor's if larger) is mapped fresh, asked for huge pages
// (madvise: a hint; where the kernel refuses, 4 KB pages and the same bytes), handed out front to
// back, and unmapped when the last tensor in it dies (the open one starts again at its front).
// Asked before the first write, not after: the first write is faster so in the median, though now
// and then a virtual machine makes it wait far longer for its 2 MB pages
// (benchmarks/results/quant/first_touch-epyc-zen4.md).
#ifdef TFORMER_ARENA
constexpr size_t HUGE_PAGE = size_t(2) << 20, ARENA = size_t(64) << 20;

struct Arena {
  uint8_t* base = nullptr;     // HUGE_PAGE aligned
  size_t size = 0, used = 0, live = 0;
  size_t dirty = 0;            // bytes from the front ever handed out: beyond them the pages are still mmap's zeros
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
  const size_t start = a->used;
  a->used += want;
  ++a->live;
  if (start < a->dirty) std::memset(p, 0, std::min(want, a->dirty - start));   // a reused front is not zero any more
  a->dirty = std::max(a->dirty, a->used);                           // fresh pages are: no second write before repack's
  return at::from_blob(p, {rows, cols}, [a](void*) { release_tiles(a); }, opts);
}
#else
at::Tensor arena_zeros(int64_t rows, int64_t cols, const at::TensorOptions& opts) { return at::zeros({rows, cols}, opts); }
#endif

// Hand back the whole pages of [begin, end) (a mapped file's, never written: they are read again from
// the page cache if ever touched); the pages it shares with its neighbours stay.
void release_pages(const uint8_t* begin, const uint8_t* end) {
#ifdef TFORMER_ARENA
  static const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
  const uintptr_t a = (reinterpret_cast<uintptr_t>(begin) + page - 1) / page * page,
                  e = reinterpret_cast<uintptr_t>(end) / page * page;
  if (e > a) madvise(reinterpret_cast<void*>(a), e - a, MADV_DONTNEED);
#endif
}

// release: blocks are a mapped file's pages (tformer.quant.pages says so), handed back as each run of
// tiles is copied, so the weights never sit in memory twice (the whole copy at once would double the peak)
at::Tensor repack(const at::Tensor& blocks, int64_t fmt, int64_t R, bool release) {
  TORCH_CHECK(is_tiled(fmt) && (R == 8 || R == 16), "repack: fmt 0..2, 9 or 10 and R 8 or 16");
  const int64_t bytes = block_bytes(fmt);
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  blocks.size(1) % bytes == 0, "repack: blocks must be contiguous (N, G*bytes) uint8");
  const int64_t N = blocks.size(0), G = blocks.size(1) / bytes;
  const int64_t T = (N + R - 1) / R, tb = tile_block_bytes(fmt, R);
  at::Tensor out = arena_zeros(T, G * tb, blocks.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const bool offset = fmt == Q8_0 && R == 16;
  const int64_t qh_at = fmt == Q5_1 ? 4 : 2;                          // q5: d [m] qh qs
  // tiles are independent: split them between torch's threads (opening a model repacks all of its matrices)
  constexpr int64_t RUN = 32;                                          // tiles copied between releases
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
   for (int64_t c0 = t0; c0 < t1; c0 += RUN) {
    const int64_t n0 = c0 * R, n1 = std::min(N, std::min(t1, c0 + RUN) * R);
    for (int64_t n = n0; n < n1; ++n) {
      const int64_t t = n / R, r = n % R;
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* b = src + (n * G + g) * bytes;
        uint8_t* o = dst + (t * G + g) * tb;
        std::memcpy(o + 2 * r, b, 2);                                       // d
        int64_t off = 2 * R;
        if (has_min(fmt)) { std::memcpy(o + off + 2 * r, b + 2, 2); off += 2 * R; }
        if (has_fifth(fmt)) {                  // nibble i of qh -> bits 4r .. 4r + 3 of mask i (tiles.h)
          uint32_t qh;
          std::memcpy(&qh, b + qh_at, 4);
          for (int i = 0; i < 8; ++i) o[off + i * R / 2 + r / 2] |= uint8_t(((qh >> (4 * i)) & 15) << (4 * (r % 2)));
          off += 4 * R;
        }
        const uint8_t* qs = b + (fmt == Q8_0 ? 2 : bytes - 16);
        const int quads = fmt == Q8_0 ? 8 : 4;
        for (int j = 0; j < quads; ++j) {                                   // 4 quants at a time
          uint32_t q;
          std::memcpy(&q, qs + 4 * j, 4);
          if (offset) q ^= 0x80808080u;
          std::memcpy(o + off + (j * R + r) * 4, &q, 4);
        }
      }
    }
    if (release) release_pages(src + n0 * G * bytes, src + n1 * G * bytes);
   }
  });
  return out;
}

// The op on tiles: tiles (T, G * R * bytes) from repack(), N <= T R outputs, path avx2 (R 8) or
// avx512vnni (R 16). x (M, K) -> y (M, N) in x's dtype.
at::Tensor qgemm_tiles(const at::Tensor& tiles, int64_t fmt, int64_t N, const at::Tensor& x,
                       const c10::optional<at::Tensor>& bias, int64_t path) {
  TORCH_CHECK(is_tiled(fmt), "qgemm_tiles: fmt must be 0, 1, 2, 9 or 10");
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
// columns of x (M, Kmax) float32, quantised before the clock starts (a whole layer quantises once per
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
    TORCH_CHECK(is_tiled(fmts[i]), "tile_passes: a format must be 0, 1, 2, 9 or 10");
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

int64_t product_ns(bool reset) { return reset ? PRODUCT_NS.exchange(0) : PRODUCT_NS.load(); }

// The op of the formats read in the file layout (kquants.h): blocks (N, S * bytes) uint8, fmt 6 q4_k |
// 7 q5_k | 8 q6_k | 9 q5_0 | 10 q5_1 (scalar path only: the SIMD paths read q5 as tiles, qgemm_tiles),
// x (M, K) float32|bf16|f16 -> y (M, N) in x's dtype, path 0|1|2.
at::Tensor kqgemm(const at::Tensor& blocks, int64_t fmt, const at::Tensor& x, const c10::optional<at::Tensor>& bias,
                  int64_t path) {
  TORCH_CHECK(is_kquant(fmt), "kqgemm: fmt must be 6 (q4_k), 7 (q5_k), 8 (q6_k), 9 (q5_0) or 10 (q5_1)");
  TORCH_CHECK(!is_q5(fmt) || path == SCALAR, "kqgemm: q5_0 / q5_1 on a SIMD path are tiles (qgemm_tiles)");
  TORCH_CHECK(path >= 0 && path <= 2 && supports(path), "kqgemm: this CPU cannot run path ", path);
  const int64_t bytes = kquant_bytes(fmt);
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  blocks.device().is_cpu() && blocks.size(1) % bytes == 0,
              "kqgemm: blocks must be a contiguous CPU (N, S*", bytes, ") uint8 matrix");
  const int64_t N = blocks.size(0), K = kquant_values(fmt) * (blocks.size(1) / bytes);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "kqgemm: x must be (M, ", K, ")");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N),
              "kqgemm: bias must be contiguous float32 (N,)");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "kqgemm: x must be float32, bfloat16 or float16");
  at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor yf = at::empty({x.size(0), N}, xf.options());
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  if (is_q5(fmt)) {
    QAct a;
    a.quantize(xf.data_ptr<float>(), x.size(0), K);
    kquant_product(fmt, path, blocks.data_ptr<uint8_t>(), N, a, bp, yf.data_ptr<float>());
  } else {
    Q8K a;
    a.quantize(xf.data_ptr<float>(), x.size(0), K);
    kquant_product(fmt, path, blocks.data_ptr<uint8_t>(), N, a, bp, yf.data_ptr<float>());
  }
  return x.scalar_type() == at::kFloat ? yf : yf.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY(tformer_qgemv, m) {
  m.def("qgemm(Tensor blocks, int fmt, Tensor x, Tensor? bias, int path) -> Tensor");
  m.def("paths() -> int[]");
  m.def("repack(Tensor blocks, int fmt, int R, bool release=False) -> Tensor");
  m.def("qgemm_tiles(Tensor tiles, int fmt, int N, Tensor x, Tensor? bias, int path) -> Tensor");
  m.def("tile_passes(Tensor[] mats, int[] fmts, int[] ns, Tensor x, int path, int reps) -> float");
  m.def("product_ns(bool reset) -> int");
  m.def("kqgemm(Tensor blocks, int fmt, Tensor x, Tensor? bias, int path) -> Tensor");
}

TORCH_LIBRARY_IMPL(tformer_qgemv, CPU, m) {
  m.impl("qgemm", &qgemm);
  m.impl("repack", &repack);
  m.impl("qgemm_tiles", &qgemm_tiles);
  m.impl("tile_passes", &tile_passes);
  m.impl("kqgemm", &kqgemm);
}
TORCH_LIBRARY_IMPL(tformer_qgemv, CompositeExplicitAutograd, m) { m.impl("paths", &paths); m.impl("product_ns", &product_ns); }
