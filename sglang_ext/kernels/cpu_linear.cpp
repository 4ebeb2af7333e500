// Small-batch fp32 linear for x86-64 CPUs with AVX2 + FMA: y[m, n] = sum_k x[m, k] * w[n, k].
//
// Why: decode and tree-verify forwards multiply 1-128 rows by every weight matrix. MKL's sgemm
// reaches 5-10 GB/s of weight traffic at those shapes on an AVX2 machine (memory allows ~20),
// and an 8-row verify costs 2x a 1-row decode. Here each weight row is read from memory once and
// reused from L1/L2 for every input row.
//
// Every output element is one fixed sequence of 8-wide FMAs over k (then a fixed horizontal
// sum), whatever M is and whichever thread computes it: results are bit-identical across batch
// compositions (a decode row equals the same row inside a verify block).
//
// M <= 12 (decode, tree verify of small trees):
//   rows of w:  super-blocks of 24 (split across torch's intra-op threads), tiles of J inside
//   rows of x:  one group for M <= 8, else groups of at most 6 (10: 5+5, 12: 6+6); a group of R
//               rows uses tiles of J = 8, 6, 4, 3, 2, 2, 1, 1 weight rows for R = 1..8
//               (R*J <= 12 accumulators)
//   Up to 8 input rows take one pass over each weight tile, so the FMAs overlap the weight
//   stream from memory instead of following it (with groups of 3, a 6-row verify cost ~1.2x
//   what it costs now). Later groups re-read the super-block from L1/L2.
// M > 12 (big batches, where FMAs dominate): blocks of 4 weight rows, groups of at most 3 input
//   rows, 4 x 3 tiles re-read from L1 (10 % faster than the above from M = 24 on).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

#include "avx2_math.h"

namespace {

constexpr int64_t WIDE_M = 12;  // up to this many input rows: super-blocks of 24, groups of <= 6

// The accumulators of an R x J tile start at zero and end as one fixed horizontal sum each
// (shared by tile and packed_tile: the same sums in both).
template <int R, int J>
inline void zero_acc(__m256 (&acc)[R][J]) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < J; ++j) acc[r][j] = _mm256_setzero_ps();
}

template <int R, int J>
inline void store_acc(const __m256 (&acc)[R][J], float* y, int64_t N) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < J; ++j) y[r * N + j] = hsum(acc[r][j]);
}

// R input rows x J weight rows: R*J accumulators. Registers: with R <= J the R input vectors stay
// in registers and weights are loaded one at a time (R + 1 + RJ <= 16); otherwise the J weight
// vectors stay and inputs are loaded one at a time (J + 1 + RJ <= 16). `next` (the same tile of
// the next super-block, or null) is prefetched while this one computes.
template <int R, int J>
inline void tile(const float* x, const float* w, float* y, int64_t N, int64_t K, const float* next) {
  __m256 acc[R][J];
  zero_acc<R, J>(acc);
  for (int64_t k = 0; k < K; k += 8) {
    if (next && (k & 15) == 0) {
#pragma GCC unroll 8
      for (int j = 0; j < J; ++j) _mm_prefetch(reinterpret_cast<const char*>(next + j * K + k), _MM_HINT_T0);
    }
    if constexpr (R <= J) {
      __m256 xv[R];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(x + r * K + k);
#pragma GCC unroll 8
      for (int j = 0; j < J; ++j) {
        const __m256 wv = _mm256_loadu_ps(w + j * K + k);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[r][j] = _mm256_fmadd_ps(xv[r], wv, acc[r][j]);
      }
    } else {
      __m256 wv[J];
#pragma GCC unroll 8
      for (int j = 0; j < J; ++j) wv[j] = _mm256_loadu_ps(w + j * K + k);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_loadu_ps(x + r * K + k);
#pragma GCC unroll 8
        for (int j = 0; j < J; ++j) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
      }
    }
  }
  store_acc<R, J>(acc, y, N);
}

// One group of R input rows against a block of `rows` weight rows (w, stride K; outputs y[r * N + j]):
// tiles of J weight rows (`wide`: the J(R) above, else 4), then single rows. `next`: the same rows
// of the next block, to prefetch.
template <int R>
void group(bool wide, const float* x, const float* w, float* y, int64_t N, int64_t K, int64_t rows, const float* next) {
  constexpr int J = R == 1 ? 8 : R == 2 ? 6 : R == 3 ? 4 : R == 4 ? 3 : R <= 6 ? 2 : 1;
  int64_t j = 0;
  if (wide)
    for (; j + J <= rows; j += J) tile<R, J>(x, w + j * K, y + j, N, K, next ? next + j * K : nullptr);
  if constexpr (R <= 3)
    for (; j + 4 <= rows; j += 4) tile<R, 4>(x, w + j * K, y + j, N, K, next ? next + j * K : nullptr);
  for (; j < rows; ++j) tile<R, 1>(x, w + j * K, y + j, N, K, nullptr);
}

// The tiles are compiled per input-row count: with_rows_in<LO, HI> calls f.template operator()<R>()
// for the runtime R in [LO, HI] (HI for anything above); with_rows covers R = 1..8.
template <int LO, int HI, class F>
void with_rows_in(int64_t R, F&& f) {
  if constexpr (LO == HI) {
    f.template operator()<HI>();
  } else {
    if (R <= LO) return f.template operator()<LO>();
    with_rows_in<LO + 1, HI>(R, f);
  }
}

template <class F>
void with_rows(int64_t R, F&& f) {
  with_rows_in<1, 8>(R, f);
}

void group_any(int64_t R, bool wide, const float* x, const float* w, float* y, int64_t N, int64_t K, int64_t rows, const float* next) {
  with_rows(R, [&]<int RR>() { group<RR>(wide, x, w, y, N, K, rows, next); });
}

inline int64_t block_rows(int64_t M) { return M <= WIDE_M ? 24 : 4; }

// Output columns [n0, n1), one block of weight rows at a time. `weights(n, size)` gives rows
// [n, n + size) as fp32 (the weights themselves, or a buffer it dequantized them into);
// `prefetch(n)` the rows to prefetch for the next block (or nullptr).
template <class Weights, class Prefetch>
void rows(const float* x, float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1, Weights weights, Prefetch prefetch) {
  const bool wide = M <= WIDE_M;
  const int64_t block = block_rows(M), max_group = wide ? (M <= 8 ? 8 : 6) : 3;
  const int64_t groups = (M + max_group - 1) / max_group;  // as even as possible: 10 = 5+5, 16 = 3+3+3+3+2+2
  for (int64_t n = n0; n < n1; n += block) {
    const int64_t size = std::min(block, n1 - n);
    const float* w = weights(n, size);
    // the next block streams in from memory while the first group computes on this one
    const float* next = (size == block && n + 2 * block <= n1) ? prefetch(n + block) : nullptr;
    for (int64_t g = 0, m = 0; g < groups; ++g) {
      const int64_t r = (M - m) / (groups - g);
      group_any(r, wide, x + m * K, w, y + m * N + n, N, K, size, g == 0 ? next : nullptr);
      m += r;
    }
  }
}

at::Tensor linear_small(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "linear_small: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "linear_small: fp32 only");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear_small: x [M, K], w [N, K]");
  TORCH_CHECK(x.size(1) % 8 == 0, "linear_small: K must be a multiple of 8");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
  at::Tensor y = at::empty({M, N}, xc.options());
  if (M == 0 || N == 0) return y;
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t block = block_rows(M), blocks = (N + block - 1) / block;
  at::parallel_for(0, blocks, 64 / block, [&](int64_t b0, int64_t b1) {
    const auto in_place = [&](int64_t n, int64_t = 0) { return wp + n * K; };
    rows(xp, yp, M, N, K, b0 * block, std::min(N, b1 * block), in_place, in_place);
  });
  return y;
}

// --- GGUF block weights -------------------------------------------------------------------------
// The default target ships as GGUF with Q4_1 linear weights and a Q8_0 embedding / lm_head. Read as
// fp32, a decode step streams 540 MB of weights; the blocks are 96 MB. linear_packed keeps the blocks
// and dequantizes each block of weight rows into a small buffer just before the tiles above consume
// it (for <= 16 input rows, 24 on AVX-512: in registers, packed_tile or, on AVX-512, packed_tile_pairs), so every output is the same sequence of
// FMAs as in linear_small on the dequantized fp32 weights, hence bit-identical to it:
//   Q4_1 (20 bytes per 32 weights): fp16 d, fp16 m, 16 bytes; weight i = d * (byte[i % 16] >> 4*(i >= 16) & 15) + m
//   Q8_0 (34 bytes per 32 weights): fp16 d, 32 int8;       weight i = d * q[i]
// d * q is exact in fp32 (an 11-bit mantissa times a <= 8-bit integer), so one FMA rounds exactly
// like gguf's numpy dequantizer (d * q, then + m).
//   BF16 (64 bytes per 32 weights): the upper halves of fp32 values; weight = bits << 16, exact. A
//   drafter checkpoint saved in bf16 runs on fp32 copies of those values: reading the bf16 halves
//   gives the same sums from half the bytes.
enum PackedKind : int64_t { Q4_1 = 0, Q8_0 = 1, BF16 = 2 };

inline int64_t packed_block_bytes(int64_t kind) { return kind == Q4_1 ? 20 : kind == Q8_0 ? 34 : 64; }
inline bool valid_kind(int64_t kind) { return kind == Q4_1 || kind == Q8_0 || kind == BF16; }

inline float fp16_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// One block of 32 weights as four vectors: w[i] = weights 8i .. 8i + 7.
template <int KIND>
__attribute__((always_inline)) inline void dequant_block(const uint8_t* src, __m256 w[4]) {
  if constexpr (KIND == Q4_1) {
    const __m256 d = _mm256_set1_ps(fp16_at(src));
    // bytes 0-7 hold weights 0-7 (low nibbles) and 16-23 (high), bytes 8-15 weights 8-15 and 24-31;
    // widened to 32 bits first, a nibble is one AND or one shift away
    const __m256 m = _mm256_set1_ps(fp16_at(src + 2));
    const __m256i low = _mm256_set1_epi32(0x0F);
    for (int half = 0; half < 2; ++half) {
      const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 4 + 8 * half)));
      w[half] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(q, low)), m);
      w[2 + half] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), m);
    }
  } else if constexpr (KIND == BF16) {
    for (int i = 0; i < 4; ++i) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16 * i));
      w[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
  } else {
    const __m256 d = _mm256_set1_ps(fp16_at(src));
    for (int i = 0; i < 4; ++i) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 2 + 8 * i));
      w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    }
  }
}

template <int KIND>
void dequant_row_as(const uint8_t* src, float* dst, int64_t K) {
  for (int64_t b = 0; b < K / 32; ++b, src += packed_block_bytes(KIND), dst += 32) {
    __m256 w[4];
    dequant_block<KIND>(src, w);
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(dst + 8 * i, w[i]);
  }
}

// Calls f.template operator()<KIND>() for a runtime kind (checked by valid_kind).
template <class F>
void with_kind(int64_t kind, F&& f) {
  if (kind == Q4_1)
    f.template operator()<Q4_1>();
  else if (kind == Q8_0)
    f.template operator()<Q8_0>();
  else
    f.template operator()<BF16>();
}

void dequant_row(int64_t kind, const uint8_t* src, float* dst, int64_t K) {
  with_kind(kind, [&]<int KIND>() { dequant_row_as<KIND>(src, dst, K); });
}

// R <= FUSED_GROUP input rows (decode, verifies, a pass of a larger one) x J packed weight rows, dequantized in
// registers (no buffer): each output is the same sequence of FMAs over k as in tile(), so the same
// sums. R*J accumulators + 4 weight vectors fit the 16 registers up to R = 6 with J = 2.
// NOTE: always_inline: with the R = 5..8 instances GCC stopped inlining these into the 1-row path
// (its unit growth limit) and a decode step got 20 % slower.
constexpr int64_t FUSED_GROUP = 8;  // input rows per pass
constexpr int64_t FUSED_M = 16;     // in registers up to this many input rows, in passes of <= FUSED_GROUP (AVX-512: WIDE_GROUP, one pass)

template <int KIND, int R, int J>
__attribute__((always_inline)) inline void packed_tile(const float* x, const uint8_t* b, int64_t row_bytes, float* y, int64_t N, int64_t K) {
  __m256 acc[R][J];
  zero_acc<R, J>(acc);
  for (int64_t k = 0; k < K; k += 32) {
    const uint8_t* src = b + k / 32 * packed_block_bytes(KIND);
#pragma GCC unroll 8
    for (int j = 0; j < J; ++j) {
      __m256 w[4];
      dequant_block<KIND>(src + j * row_bytes, w);
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i)
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[r][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k + 8 * i), w[i], acc[r][j]);
    }
  }
  store_acc<R, J>(acc, y, N);
}

// Output columns [n0, n1) for R input rows: tiles of J weight rows, then single rows.
template <int KIND, int R>
void packed_rows(const float* x, const uint8_t* b, int64_t row_bytes, float* y, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  constexpr int J = R <= 2 ? 4 : R <= 6 ? 2 : 1;
  int64_t n = n0;
  for (; n + J <= n1; n += J) packed_tile<KIND, R, J>(x, b + n * row_bytes, row_bytes, y + n, N, K);
  for (; n < n1; ++n) packed_tile<KIND, R, 1>(x, b + n * row_bytes, row_bytes, y + n, N, K);
}

// --- the same tiles on AVX-512, two weight rows per register ------------------------------------
// A 16-lane register holds the 8-lane accumulators of two weight rows side by side (lanes 0-7 row a,
// 8-15 row b), and the input vector is the same 8 floats in both halves. Every lane sees exactly the
// FMAs it sees in packed_tile, in the same order, and each half is reduced by the same hsum: the
// results are bit-identical to the AVX2 tiles, with half the FMA and dequantization instructions
// (a verify row costs what its FMAs cost). Used when the CPU has AVX-512 F/DQ/BW/VL.
#define MOA_AVX512 __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl")))

MOA_AVX512 inline __m512 pair_of(float a, float b) { return _mm512_insertf32x8(_mm512_set1_ps(a), _mm256_set1_ps(b), 1); }

// One block of 32 weights of rows a and b as four 16-lane vectors: w[i] = weights 8i .. 8i + 7 of a | of b.
template <int KIND>
MOA_AVX512 __attribute__((always_inline)) inline void dequant_block_pair(const uint8_t* a, const uint8_t* b, __m512 w[4]) {
  if constexpr (KIND == Q4_1) {
    const __m512 d = pair_of(fp16_at(a), fp16_at(b)), m = pair_of(fp16_at(a + 2), fp16_at(b + 2));
    const __m512i low = _mm512_set1_epi32(0x0F);
    for (int half = 0; half < 2; ++half) {
      const __m128i qa = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(a + 4 + 8 * half));
      const __m128i qb = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 4 + 8 * half));
      const __m512i q = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(qa, qb));
      w[half] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(q, low)), m);
      w[2 + half] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), m);
    }
  } else if constexpr (KIND == BF16) {
    for (int i = 0; i < 4; ++i) {
      const __m128i ha = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + 16 * i));
      const __m128i hb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * i));
      const __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(ha), hb, 1);
      w[i] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
  } else {
    const __m512 d = pair_of(fp16_at(a), fp16_at(b));
    for (int i = 0; i < 4; ++i) {
      const __m128i qa = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(a + 2 + 8 * i));
      const __m128i qb = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * i));
      w[i] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi64(qa, qb))));
    }
  }
}

// R input rows x 2*JP weight rows (JP pairs): outputs y[r * N + 2 * jp] (low half) and + 1 (high half).
template <int KIND, int R, int JP>
MOA_AVX512 __attribute__((always_inline)) inline void packed_tile_pairs(const float* x, const uint8_t* b, int64_t row_bytes, float* y, int64_t N, int64_t K) {
  __m512 acc[R][JP];
#pragma GCC unroll 24
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < JP; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const uint8_t* src = b + k / 32 * packed_block_bytes(KIND);
#pragma GCC unroll 8
    for (int j = 0; j < JP; ++j) {
      __m512 w[4];
      dequant_block_pair<KIND>(src + 2 * j * row_bytes, src + (2 * j + 1) * row_bytes, w);
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i)
#pragma GCC unroll 24  // R up to WIDE_GROUP: fully unrolled, or the accumulators go to memory
        for (int r = 0; r < R; ++r)
          acc[r][j] = _mm512_fmadd_ps(_mm512_broadcast_f32x8(_mm256_loadu_ps(x + r * K + k + 8 * i)), w[i], acc[r][j]);
    }
  }
#pragma GCC unroll 24
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < JP; ++j) {
      y[r * N + 2 * j] = hsum(_mm512_castps512_ps256(acc[r][j]));
      y[r * N + 2 * j + 1] = hsum(_mm512_extractf32x8_ps(acc[r][j], 1));
    }
}

// R = 9-24 (WIDE_GROUP): one pair of weight rows per tile, R accumulators + 4 weight vectors in the 32
// registers, so the weights are dequantized once for all R rows (passes of <= 8 rows did it per pass:
// a 13-row verify cost ~1.7x an 8-row one on a 2-core AVX-512 Xeon)
constexpr int64_t WIDE_GROUP = 24;

template <int KIND, int R>
MOA_AVX512 void packed_rows_pairs(const float* x, const uint8_t* b, int64_t row_bytes, float* y, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  constexpr int JP = R <= 2 ? 4 : R <= 8 ? 2 : 1;
  int64_t n = n0;
  for (; n + 2 * JP <= n1; n += 2 * JP) packed_tile_pairs<KIND, R, JP>(x, b + n * row_bytes, row_bytes, y + n, N, K);
  for (; n + 2 <= n1; n += 2) packed_tile_pairs<KIND, R, 1>(x, b + n * row_bytes, row_bytes, y + n, N, K);
  // an odd last row: the AVX2 tile (16 registers: at most 8 input rows at a time), the same sums
  for (int64_t m = 0; n < n1 && m < R; m += FUSED_GROUP)
    with_rows(std::min<int64_t>(FUSED_GROUP, R - m), [&]<int RR>() { packed_rows<KIND, RR>(x + m * K, b, row_bytes, y + m * N, N, K, n, n1); });
}

// For 1-2 rows the dequantization dominates, and on 16 lanes it only shares two ports (Intel runs
// 512-bit ops on ports 0 and 5, 256-bit ones on 0, 1 and 5): 0.87-0.95x for 1 row, ~1.0x for 2;
// from 3 rows the halved FMAs win (1.1-1.3x for 3-8 rows; scripts/kernel-ab.py on a 2-core Xeon).
constexpr int64_t WIDE_FROM_ROWS = 3;

inline bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl");
  return yes;
}

// Whether 3-16-row matmuls may use the AVX-512 tiles; set once, on the kernels' first use (MOA_SERVE_AVX512=0 keeps the
// AVX2 tiles: the same results, to measure what AVX-512 buys and to test both). Returns whether they are used.
std::atomic<bool> avx512_allowed{true};

bool set_avx512(bool on) {
  avx512_allowed.store(on, std::memory_order_relaxed);
  return on && has_avx512();
}

inline bool use_avx512() { return avx512_allowed.load(std::memory_order_relaxed) && has_avx512(); }

template <int KIND>
void packed_rows_any(int64_t R, const float* x, const uint8_t* b, int64_t row_bytes, float* y, int64_t N, int64_t K, int64_t n0, int64_t n1, bool wide) {
  TORCH_CHECK(R <= (wide ? WIDE_GROUP : FUSED_GROUP), "packed_rows_any: too many rows for one pass");
  if (wide && R > FUSED_GROUP) {
    with_rows_in<FUSED_GROUP + 1, WIDE_GROUP>(R, [&]<int RR>() { packed_rows_pairs<KIND, RR>(x, b, row_bytes, y, N, K, n0, n1); });
    return;
  }
  with_rows(R, [&]<int RR>() {
    if (wide)
      packed_rows_pairs<KIND, RR>(x, b, row_bytes, y, N, K, n0, n1);
    else
      packed_rows<KIND, RR>(x, b, row_bytes, y, N, K, n0, n1);
  });
}

at::Tensor dequantize_packed(const at::Tensor& blocks, int64_t kind, int64_t K) {
  TORCH_CHECK(valid_kind(kind), "dequantize_packed: kind must be 0 (Q4_1), 1 (Q8_0) or 2 (BF16)");
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && K % 32 == 0 && blocks.size(1) == K / 32 * packed_block_bytes(kind),
              "dequantize_packed: blocks must be uint8 [N, K / 32 * block bytes]");
  const at::Tensor bc = blocks.contiguous();
  at::Tensor w = at::empty({bc.size(0), K}, at::kFloat);
  const uint8_t* bp = bc.data_ptr<uint8_t>();
  float* wp = w.data_ptr<float>();
  const int64_t row_bytes = bc.size(1);
  at::parallel_for(0, bc.size(0), 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) dequant_row(kind, bp + n * row_bytes, wp + n * K, K);
  });
  return w;
}

at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& blocks, int64_t kind) {
  TORCH_CHECK(x.device().is_cpu() && blocks.device().is_cpu(), "linear_packed: CPU tensors only");
  TORCH_CHECK(valid_kind(kind), "linear_packed: kind must be 0 (Q4_1), 1 (Q8_0) or 2 (BF16)");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) % 32 == 0, "linear_packed: x must be fp32 [M, K], K a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.size(1) == K / 32 * packed_block_bytes(kind),
              "linear_packed: blocks must be uint8 [N, K / 32 * block bytes] for x's K");
  const at::Tensor xc = x.contiguous(), bc = blocks.contiguous();
  const int64_t N = bc.size(0), row_bytes = bc.size(1);
  at::Tensor y = at::empty({M, N}, xc.options());
  if (M == 0 || N == 0) return y;
  const float* xp = xc.data_ptr<float>();
  const uint8_t* bp = bc.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  // dequantizing in registers beats the buffer while the FMAs are few: Q4_1 1.3-1.4x for 1-2 rows,
  // 1.05-1.2x for 4, 1.2x for 5-8; Q8_0 (the lm_head) 1.23-1.65x and bf16 halves (a
  // drafter) 1.4-3x for 1-8 rows; 9-16 rows in two passes 1.0-1.1x on AVX2, 1.15-1.2x on AVX-512
  // (same-run A/B, same outputs); on AVX-512 9-24 rows take one pass (WIDE_GROUP)
  const bool avx512 = use_avx512();
  if (M <= (avx512 ? WIDE_GROUP : FUSED_M)) {
    // groups of at most 8 input rows (12 = 6 + 6; AVX-512: one group of up to 24), each a pass over
    // the same weight rows: their x stays in L1, the weight rows in L2
    const int64_t per_pass = avx512 && M >= WIDE_FROM_ROWS ? WIDE_GROUP : FUSED_GROUP;
    const int64_t groups = (M + per_pass - 1) / per_pass;
    at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
      for (int64_t g = 0, m = 0; g < groups; ++g) {
        const int64_t r = (M - m) / (groups - g);
        const bool wide = avx512 && r >= WIDE_FROM_ROWS;
        const float* xg = xp + m * K;
        float* yg = yp + m * N;
        with_kind(kind, [&]<int KIND>() { packed_rows_any<KIND>(r, xg, bp, row_bytes, yg, N, K, n0, n1, wide); });
        m += r;
      }
    });
    return y;
  }
  const int64_t block = block_rows(M), n_blocks = (N + block - 1) / block;
  at::parallel_for(0, n_blocks, 64 / block, [&](int64_t b0, int64_t b1) {
    std::vector<float> buf(block * K);  // one block of dequantized weight rows, hot in L1/L2
    const auto dequant = [&](int64_t n, int64_t size) {
      for (int64_t j = 0; j < size; ++j) dequant_row(kind, bp + (n + j) * row_bytes, buf.data() + j * K, K);
      return static_cast<const float*>(buf.data());
    };
    rows(xp, yp, M, N, K, b0 * block, std::min(N, b1 * block), dequant, [](int64_t) { return static_cast<const float*>(nullptr); });
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(moa_cpu, m) {
  m.def("linear_small(Tensor x, Tensor w) -> Tensor");
  m.def("linear_packed(Tensor x, Tensor blocks, int kind) -> Tensor");
  m.def("dequantize_packed(Tensor blocks, int kind, int K) -> Tensor");
  m.def("set_avx512(bool on) -> bool", &set_avx512);  // no tensor arguments: a catch-all kernel
}
TORCH_LIBRARY_IMPL(moa_cpu, CPU, m) {
  m.impl("linear_small", &linear_small);
  m.impl("linear_packed", &linear_packed);
  m.impl("dequantize_packed", &dequantize_packed);
}
