// The `q8` dtype's decoder stack: matmuls as integer dot products of the GGUF weight blocks (Q4_1 layers,
// Q8_0 head) with activations quantised to 8 bits per block of 32, and a whole forward (every layer, its
// glue and its attention) in one call. x86-64 with AVX-512 VNNI.
//
// Why: a bs-1 step of a small target is bound by instructions, not bytes, when each weight is dequantised to
// fp32 and multiplied with fp32 FMAs (~30 instructions per 32 weights and row), and ~300 op calls per step
// (four matmuls, five glue ops and the attention per layer, each a torch op and an OpenMP region) add ~2 ms.
// Here a block of 32 weights of 16 rows is 8 VNNI instructions per row, so a step streams its weight bytes at
// close to memory speed, and the step is one OpenMP region with a barrier between phases.
//
// Numbers: activation row x (fp32) -> per block of 32 values d = max|x| / 127, q = round(x / d) (int8),
// s = sum(q). Weight row w: GGUF blocks, Q4_1 (w = d_w * n + m_w, n in 0..15) or Q8_0 (w = d_w * n, n int8).
// A block's product is exact in int32 (sum of n * q), then per block, in block order:
//   acc = fma(d_w * d_x, float(sum n q), acc);  acc = fma(m_w, d_x * float(s), acc)   (Q4_1)
//   acc = fma(d_w * d_x, float(sum n q), acc)                                          (Q8_0)
// Every output is that fixed sequence for its row whatever the other rows, the tile or the thread: a tree row
// is bit-identical to the decode of its token alone (batch invariance), at every batch size.
//
// Layout (repacked once at load): GROUP = 16 weight rows interleaved, so one 16-lane register holds a value of
// each row. Per group and block of 32 weights: Q4_1 320 bytes = 4 x 64 bytes (for the 16 rows in turn, bytes
// 4c..4c+3 of the row's 16 nibble bytes: low nibbles are weights 4c..4c+3, high nibbles 16+4c..16+4c+3), then
// 16 fp16 d and 16 fp16 m; Q8_0 544 bytes = 8 x 64 bytes (16 rows x weights 4c..4c+3, stored as n + 128 so
// VNNI's unsigned x signed product applies; the block sum subtracts 128 * s), then 16 fp16 d. One broadcast of
// 4 activation bytes and one dpbusd give 4 products for each of the 16 rows.
//
// The forward keeps the residual stream, norms, RoPE, attention, SiLU and the K/V pool in fp32 (the pool is
// what the drafters read), with the glue row routines of the fp32 path (layer_rows.h) and its own attention (16
// lanes, keys in fixed chunks: see "attention" below). Phases per layer, each split over the threads, a barrier
// after each: RMSNorm + quantise; qkv + RoPE + K/V store (by head); attention (by a request's rows and chunks of
// keys, then a merge + quantise per row); o + residual; RMSNorm + quantise; gate/up + SiLU * up + quantise (by 32
// features); down + residual. Beside it: a weight on these kernels alone (Q8Matrix: a drafter's Linear), an
// EAGLE-3 draft layer in one call (Q8Stack.draft_layer), and layers each with its own plan, pools and K/V rows in
// one call (Q8Stack.forward_layers: MoA's draft pass, SA, a cross-attention CA and the target's TLI layers; its
// LSA layer on a stack of its own, without a head norm).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <immintrin.h>

#include "attention_rows.h"
#include "layer_rows.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <tuple>
#include <vector>

namespace {

#define MOA_VNNI __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

constexpr int64_t QK = 32;     // values per block (GGUF weights, q8 activations)
constexpr int64_t GROUP = 16;  // interleaved weight rows
constexpr int64_t TILE = 8;    // activation rows per pass over a group's unpacked block
constexpr int64_t KIND_Q4_1 = 0, KIND_Q8_0 = 1;  // kernels/__init__.py PACKED_KIND_IDS
constexpr int64_t SRC_BYTES[2] = {20, 34};       // GGUF bytes per block
constexpr int64_t GROUP_BYTES[2] = {320, 544};   // repacked bytes per group and block

bool vnni_supported() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return yes;
}

// --- activations --------------------------------------------------------------------------------

// T rows of K values as 8-bit blocks: row t's values q + t*K, its per-block d and s at t*K/32.
struct Q8Rows {
  at::Tensor qt, dt, st;
  int8_t* q = nullptr;
  float* d = nullptr;
  int32_t* s = nullptr;
  int64_t K = 0;

  Q8Rows() = default;
  Q8Rows(int64_t T, int64_t K_) : K(K_) {
    qt = at::empty({T, K}, at::kChar);
    dt = at::empty({T, K / QK}, at::kFloat);
    st = at::empty({T, K / QK}, at::kInt);
    q = qt.data_ptr<int8_t>();
    d = dt.data_ptr<float>();
    s = st.data_ptr<int32_t>();
  }
};

// One block of 32 values: d = max|x| / 127, q = round-to-nearest-even(x * 127 / max|x|), s = sum(q). A block
// holding a NaN or an infinity gets d = NaN, so the non-finite value reaches every output it feeds.
MOA_VNNI inline void quantize_block(const float* x, int8_t* q, float* d, int32_t* s) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const __m512 inf = _mm512_set1_ps(INFINITY);
  const __mmask16 bad = _mm512_cmp_ps_mask(_mm512_abs_ps(a), inf, _CMP_NLT_UQ) | _mm512_cmp_ps_mask(_mm512_abs_ps(b), inf, _CMP_NLT_UQ);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float id = amax > 0.0f && !bad ? 127.0f / amax : 0.0f;
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(id)));
  const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(id)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qb));
  *d = bad ? NAN : amax / 127.0f;
  *s = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
}

MOA_VNNI inline void quantize_row(const float* x, const Q8Rows& out, int64_t t) {
  const int64_t nb = out.K / QK;
  for (int64_t b = 0; b < nb; ++b) quantize_block(x + b * QK, out.q + t * out.K + b * QK, out.d + t * nb + b, out.s + t * nb + b);
}

// --- weights ------------------------------------------------------------------------------------

// A weight matrix [N, K] repacked from its GGUF blocks into groups of 16 rows (rows past N are zeros).
struct PackedMat {
  at::Tensor data;  // uint8 [groups, K / 32 * GROUP_BYTES[kind]]
  int64_t kind = 0, N = 0, K = 0, groups = 0;

  const uint8_t* group(int64_t g) const { return data.data_ptr<uint8_t>() + g * (K / QK) * GROUP_BYTES[kind]; }
};

PackedMat repack(const at::Tensor& blocks, int64_t kind, int64_t K) {
  TORCH_CHECK(kind == KIND_Q4_1 || kind == KIND_Q8_0, "q8: weight blocks must be Q4_1 (0) or Q8_0 (1), got kind ", kind);
  TORCH_CHECK(K % QK == 0 && K > 0, "q8: K must be a positive multiple of 32, got ", K);
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.size(1) == K / QK * SRC_BYTES[kind],
              "q8: blocks must be uint8 [N, K / 32 * ", SRC_BYTES[kind], "] for K = ", K);
  const at::Tensor src = blocks.contiguous();
  PackedMat m;
  m.kind = kind, m.N = src.size(0), m.K = K, m.groups = (m.N + GROUP - 1) / GROUP;
  const int64_t nb = K / QK, gb = GROUP_BYTES[kind], sb = SRC_BYTES[kind];
  m.data = at::zeros({m.groups, nb * gb}, at::kByte);
  const uint8_t* sp = src.data_ptr<uint8_t>();
  uint8_t* dp = m.data.data_ptr<uint8_t>();
  for (int64_t n = 0; n < m.N; ++n) {
    const int64_t g = n / GROUP, r = n % GROUP;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* s = sp + n * nb * sb + b * sb;
      uint8_t* blk = dp + (g * nb + b) * gb;
      if (kind == KIND_Q4_1) {  // d, m (fp16), 16 nibble bytes
        for (int c = 0; c < 4; ++c) std::memcpy(blk + 64 * c + 4 * r, s + 4 + 4 * c, 4);
        std::memcpy(blk + 256 + 2 * r, s, 2);
        std::memcpy(blk + 288 + 2 * r, s + 2, 2);
      } else {  // d (fp16), 32 int8
        for (int c = 0; c < 8; ++c)
          for (int j = 0; j < 4; ++j) blk[64 * c + 4 * r + j] = static_cast<uint8_t>(static_cast<int8_t>(s[2 + 4 * c + j]) + 128);
        std::memcpy(blk + 512 + 2 * r, s, 2);
      }
    }
  }
  return m;
}

inline int32_t load4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The weights are read once per step and there are more of them than the L3 holds: prefetched a few blocks ahead
// as non-temporal, so that streaming them does not evict what is reused from step to step (the K/V pool, the
// activations, the norms).
constexpr int64_t PREFETCH_BLOCKS = 4;

template <int64_t KIND>
MOA_VNNI __attribute__((always_inline)) inline void prefetch_ahead(const uint8_t* w) {
  const uint8_t* p = w + PREFETCH_BLOCKS * GROUP_BYTES[KIND];
#pragma GCC unroll 9
  for (int64_t line = 0; line < GROUP_BYTES[KIND]; line += 64) _mm_prefetch(reinterpret_cast<const char*>(p + line), _MM_HINT_NTA);
}

// acc[r] = the 16 outputs of group w for activation rows t0 .. t0 + R - 1 (the sequence in the header).
template <int R>
MOA_VNNI __attribute__((always_inline)) inline void q4_1_tile(const uint8_t* w, const Q8Rows& x, int64_t t0, __m512 (&acc)[R]) {
  const int64_t nb = x.K / QK;
  const __m512i low = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, w += GROUP_BYTES[KIND_Q4_1]) {
    prefetch_ahead<KIND_Q4_1>(w);
    __m512i lo[4], hi[4];
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(w + 64 * c);
      lo[c] = _mm512_and_si512(v, low);
      hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 256)));
    const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 288)));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int8_t* xb = x.q + (t0 + r) * x.K + b * QK;
      __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[0], _mm512_set1_epi32(load4(xb)));
      __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi[0], _mm512_set1_epi32(load4(xb + 16)));
#pragma GCC unroll 3
      for (int c = 1; c < 4; ++c) {
        s0 = _mm512_dpbusd_epi32(s0, lo[c], _mm512_set1_epi32(load4(xb + 4 * c)));
        s1 = _mm512_dpbusd_epi32(s1, hi[c], _mm512_set1_epi32(load4(xb + 16 + 4 * c)));
      }
      const float dx = x.d[(t0 + r) * nb + b];
      const float sx = dx * static_cast<float>(x.s[(t0 + r) * nb + b]);
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(dx)), _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), acc[r]);
      acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx), acc[r]);
    }
  }
}

template <int R>
MOA_VNNI __attribute__((always_inline)) inline void q8_0_tile(const uint8_t* w, const Q8Rows& x, int64_t t0, __m512 (&acc)[R]) {
  const int64_t nb = x.K / QK;
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b, w += GROUP_BYTES[KIND_Q8_0]) {
    prefetch_ahead<KIND_Q8_0>(w);
    __m512i v[8];
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) v[c] = _mm512_loadu_si512(w + 64 * c);
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 512)));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const int8_t* xb = x.q + (t0 + r) * x.K + b * QK;
      __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v[0], _mm512_set1_epi32(load4(xb)));
      __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v[4], _mm512_set1_epi32(load4(xb + 16)));
#pragma GCC unroll 3
      for (int c = 1; c < 4; ++c) {
        s0 = _mm512_dpbusd_epi32(s0, v[c], _mm512_set1_epi32(load4(xb + 4 * c)));
        s1 = _mm512_dpbusd_epi32(s1, v[4 + c], _mm512_set1_epi32(load4(xb + 16 + 4 * c)));
      }
      const int32_t offset = 128 * x.s[(t0 + r) * nb + b];  // the weights are stored as n + 128
      const __m512i sum = _mm512_sub_epi32(_mm512_add_epi32(s0, s1), _mm512_set1_epi32(offset));
      const float dx = x.d[(t0 + r) * nb + b];
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(dx)), _mm512_cvtepi32_ps(sum), acc[r]);
    }
  }
}

// y[t, 16g + i] = (res ? res[t, 16g + i] : 0) + (W x_t)[16g + i] for every row t < T (outputs past N are not stored)
template <int R>
MOA_VNNI inline void group_rows(const PackedMat& W, int64_t g, const Q8Rows& x, int64_t t0, float* y, int64_t ldy, const float* res, int64_t ldr) {
  __m512 acc[R];
  if (W.kind == KIND_Q4_1)
    q4_1_tile<R>(W.group(g), x, t0, acc);
  else
    q8_0_tile<R>(W.group(g), x, t0, acc);
  const int64_t n0 = g * GROUP;
  const __mmask16 keep = W.N - n0 >= GROUP ? __mmask16(0xFFFF) : __mmask16((1u << (W.N - n0)) - 1);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    __m512 v = acc[r];
    if (res) v = _mm512_add_ps(_mm512_maskz_loadu_ps(keep, res + (t0 + r) * ldr + n0), v);
    _mm512_mask_storeu_ps(y + (t0 + r) * ldy + n0, keep, v);
  }
}

template <int R = 1, class F>
inline void with_tile_rows(int64_t rows, F&& f) {
  if constexpr (R < TILE) {
    if (rows == R) return f.template operator()<R>();
    return with_tile_rows<R + 1>(rows, f);
  } else {
    f.template operator()<TILE>();
  }
}

MOA_VNNI void gemm_group(const PackedMat& W, int64_t g, const Q8Rows& x, int64_t T, float* y, int64_t ldy, const float* res = nullptr,
                         int64_t ldr = 0) {
  for (int64_t t0 = 0; t0 < T; t0 += TILE)
    with_tile_rows(std::min(TILE, T - t0), [&]<int R>() { group_rows<R>(W, g, x, t0, y, ldy, res, ldr); });
}

// --- attention ----------------------------------------------------------------------------------

// The stack's attention (fp32, 16 lanes). A row's keys (its slots in kv order) are cut into chunks of CHUNK keys
// at fixed places (key 0, CHUNK, 2 CHUNK, ...). Per chunk and query head: scores (a dot product over d as 16-lane
// FMAs, folded to 8 lanes, one fixed transposing sum per 8 keys), the chunk's max m, p = exp(s - m), l = sum p in
// 8-lane order, o = sum_j p_j v_j in key order. The chunks then merge in chunk order: M = max m_c,
// w_c = exp(m_c - M), out = (sum_c w_c o_c) / (sum_c w_c l_c). A row's numbers depend only on its keys, never on
// which thread computes a chunk or what else is in the batch; the chunks let two threads share one row (decode).
// A chunk reads each key's and value's row once for the query heads of a kv head (up to 3 at a time).
constexpr int64_t CHUNK = 128;

MOA_VNNI inline __m256 fold16(__m512 v) { return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)); }

// lane l = the sum of a[l]'s 8 lanes, in an order fixed per lane
MOA_VNNI inline __m256 sum_lanes8(const __m256 (&a)[8]) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// scores[0:n] -> exp(scores - max) in place (8 lanes at a time; lanes past n are zeroed); m = max, l = sum
inline void exp_chunk(float* scores, int64_t n, float* m, float* l) {
  const int64_t padded = (n + 7) & ~int64_t(7);
  for (int64_t j = n; j < padded; ++j) scores[j] = -INFINITY;
  __m256 mx = _mm256_set1_ps(-INFINITY);
  for (int64_t j = 0; j < padded; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(scores + j));
  const float top = moa_attention::hmax(mx);
  const __m256 mv = _mm256_set1_ps(top);
  __m256 sum = _mm256_setzero_ps();
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t j = 0; j < padded; j += 8) {
    __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + j), mv));
    p = _mm256_and_ps(p, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - j)), lane)));
    _mm256_storeu_ps(scores + j, p);
    sum = _mm256_add_ps(sum, p);
  }
  *m = top;
  *l = hsum(sum);
}

// One chunk of n keys (1 <= n <= CHUNK) for H <= 3 query heads q [H, D] of one kv head: m, l [H], o [H, D]
template <int D, int H>
MOA_VNNI void chunk_heads(const float* q, const float* kb, const float* vb, int64_t ks, int64_t vs, const int64_t* keys, int64_t n, float scale,
                          float* m, float* l, float* o, float* sc) {
  constexpr int DC = D / 16;
  constexpr int64_t STRIDE = CHUNK + 16;
  for (int64_t j = 0; j < n; j += 8) {
    __m512 acc[H][8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      const float* k = kb + keys[j + i < n ? j + i : j] * ks;  // a short last group repeats its first key
      __m512 kv[DC];
#pragma GCC unroll 8
      for (int c = 0; c < DC; ++c) kv[c] = _mm512_loadu_ps(k + 16 * c);
#pragma GCC unroll 3
      for (int h = 0; h < H; ++h) {
        acc[h][i] = _mm512_mul_ps(_mm512_loadu_ps(q + h * D), kv[0]);
#pragma GCC unroll 8
        for (int c = 1; c < DC; ++c) acc[h][i] = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * D + 16 * c), kv[c], acc[h][i]);
      }
    }
#pragma GCC unroll 3
    for (int h = 0; h < H; ++h) {
      __m256 f[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) f[i] = fold16(acc[h][i]);
      _mm256_storeu_ps(sc + h * STRIDE + j, _mm256_mul_ps(sum_lanes8(f), _mm256_set1_ps(scale)));
    }
  }
  for (int h = 0; h < H; ++h) exp_chunk(sc + h * STRIDE, n, m + h, l + h);
  __m512 acc[H][DC];
#pragma GCC unroll 3
  for (int h = 0; h < H; ++h)
#pragma GCC unroll 8
    for (int c = 0; c < DC; ++c) acc[h][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const float* v = vb + keys[j] * vs;
    __m512 vv[DC];
#pragma GCC unroll 8
    for (int c = 0; c < DC; ++c) vv[c] = _mm512_loadu_ps(v + 16 * c);
#pragma GCC unroll 3
    for (int h = 0; h < H; ++h) {
      const __m512 p = _mm512_set1_ps(sc[h * STRIDE + j]);
#pragma GCC unroll 8
      for (int c = 0; c < DC; ++c) acc[h][c] = _mm512_fmadd_ps(p, vv[c], acc[h][c]);
    }
  }
#pragma GCC unroll 3
  for (int h = 0; h < H; ++h)
#pragma GCC unroll 8
    for (int c = 0; c < DC; ++c) _mm512_storeu_ps(o + h * D + 16 * c, acc[h][c]);
}

// Where a row's attention state goes: per chunk and query head, m, l and o [D]
struct Partials {
  float *m, *l, *o;  // [chunks, Hq], [chunks, Hq], [chunks, Hq, D]
};

struct AttnGeometry {
  const float *kp, *vp;
  int64_t ks, vs, kh, vh, Hq, Hkv, D;
  float scale;
};

// Chunk c of a row (its keys from keys[0]) for every query head: into p's chunk c
template <int D>
MOA_VNNI void attend_chunk(const AttnGeometry& a, const float* q, const int64_t* keys, int64_t n, int64_t c, const Partials& p) {
  alignas(64) float sc[3 * (CHUNK + 16)];
  const int64_t j0 = c * CHUNK, len = std::min(CHUNK, n - j0), rep = a.Hq / a.Hkv;
  // each kv head reads its part of every key's and value's row: the whole rows are asked for first, in key
  // order, so that they stream in while the first head computes and the later heads find them cached
  const int64_t row_bytes = a.Hkv * a.kh * static_cast<int64_t>(sizeof(float));
  for (int64_t j = j0; j < j0 + len; ++j)
    for (int64_t b = 0; b < row_bytes; b += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(a.kp + keys[j] * a.ks) + b, _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(a.vp + keys[j] * a.vs) + b, _MM_HINT_T1);
    }
  for (int64_t g = 0; g < a.Hkv; ++g)
    for (int64_t h = g * rep; h < (g + 1) * rep; h += 3) {
      const int64_t m = std::min<int64_t>(3, (g + 1) * rep - h);
      const float *kb = a.kp + g * a.kh, *vb = a.vp + g * a.vh;
      float *pm = p.m + c * a.Hq + h, *pl = p.l + c * a.Hq + h, *po = p.o + (c * a.Hq + h) * D;
      if (m == 3)
        chunk_heads<D, 3>(q + h * D, kb, vb, a.ks, a.vs, keys + j0, len, a.scale, pm, pl, po, sc);
      else if (m == 2)
        chunk_heads<D, 2>(q + h * D, kb, vb, a.ks, a.vs, keys + j0, len, a.scale, pm, pl, po, sc);
      else
        chunk_heads<D, 1>(q + h * D, kb, vb, a.ks, a.vs, keys + j0, len, a.scale, pm, pl, po, sc);
    }
}

// A row's chunks merged in chunk order into out [Hq, D] (zeros for a row that sees nothing)
MOA_VNNI void merge_chunks(const Partials& p, int64_t chunks, int64_t Hq, int64_t D, float* out) {
  for (int64_t h = 0; h < Hq; ++h) {
    float top = -INFINITY;
    for (int64_t c = 0; c < chunks; ++c) top = std::max(top, p.m[c * Hq + h]);
    float l = 0.0f;
    for (int64_t i = 0; i < D; i += 16) {
      __m512 o = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) {
        const float w = std::exp(p.m[c * Hq + h] - top);
        if (i == 0) l += w * p.l[c * Hq + h];
        o = _mm512_fmadd_ps(_mm512_set1_ps(w), _mm512_loadu_ps(p.o + (c * Hq + h) * D + i), o);
      }
      if (i == 0) l = chunks == 0 ? 0.0f : 1.0f / l;
      _mm512_storeu_ps(out + h * D + i, _mm512_mul_ps(o, _mm512_set1_ps(l)));
    }
  }
}

// x [T, K] times W: the rows quantised, then the groups split over the threads
at::Tensor matmul_of(const at::Tensor& x, const PackedMat& W, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == W.K, op, ": x must be fp32 [T, ", W.K, "]");
  const int64_t T = x.size(0);
  const at::Tensor xc = x.contiguous();
  Q8Rows xq(T, W.K);
  at::Tensor y = at::empty({T, W.N}, x.options());
#pragma omp parallel num_threads(at::get_num_threads())
  {
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; ++t) quantize_row(xc.data_ptr<float>() + t * W.K, xq, t);
#pragma omp for schedule(dynamic, 4)
    for (int64_t g = 0; g < W.groups; ++g) gemm_group(W, g, xq, T, y.data_ptr<float>(), W.N);
  }
  return y;
}

// An fp32 weight [N, K] as GGUF Q8_0 blocks (uint8 [N, K / 32 * 34]): per 32 weights d = max|w| / 127 (fp16),
// n = round(w / d) in int8 (a drafter's matmuls on the q8 stack's kernels)
at::Tensor q8_0_blocks(const at::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 2 && w.size(1) % QK == 0, "q8_0_blocks: w must be fp32 [N, K], K % 32 == 0");
  const at::Tensor wc = w.contiguous();
  const int64_t N = wc.size(0), nb = wc.size(1) / QK;
  at::Tensor out = at::empty({N, nb * SRC_BYTES[KIND_Q8_0]}, at::kByte);
  const float* wp = wc.data_ptr<float>();
  uint8_t* op = out.data_ptr<uint8_t>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t b = 0; b < nb; ++b) {
      const float* x = wp + (n * nb + b) * QK;
      uint8_t* blk = op + (n * nb + b) * SRC_BYTES[KIND_Q8_0];
      float amax = 0.0f;
      for (int64_t i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(x[i]));
      const uint16_t dh = _cvtss_sh(amax / 127.0f, _MM_FROUND_TO_NEAREST_INT);
      const float d = _cvtsh_ss(dh);
      std::memcpy(blk, &dh, 2);
      for (int64_t i = 0; i < QK; ++i)
        blk[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(d > 0.0f ? std::clamp(std::nearbyint(x[i] / d), -127.0f, 127.0f) : 0.0f));
    }
  return out;
}

// One weight matrix on the q8 kernels (a drafter's Linear, the draft-vocab rows of the target's head)
class Q8Matrix : public torch::CustomClassHolder {
 public:
  Q8Matrix(const at::Tensor& blocks, int64_t kind, int64_t K) {
    TORCH_CHECK(vnni_supported(), "q8: this CPU lacks AVX-512 VNNI");
    w = repack(blocks, kind, K);
  }
  at::Tensor forward(const at::Tensor& x) const { return matmul_of(x, w, "q8 matrix"); }
  int64_t rows() const { return w.N; }

  // A draft head's one-level search in one call: logits = forward(RMSNorm(x) * norm) for x [T, K], then per row
  // softmax_topk of them (layer_rows.h softmax_top_row): (probs fp32 [T, k], ids int64 [T, k], finite bool [T]).
  std::vector<at::Tensor> norm_topk(const at::Tensor& x, const at::Tensor& norm, double eps, int64_t k) const {
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == w.K, "q8 norm_topk: x must be fp32 [T, ", w.K, "]");
    TORCH_CHECK(norm.device().is_cpu() && norm.scalar_type() == at::kFloat && norm.numel() == w.K, "q8 norm_topk: norm must be fp32 [", w.K, "]");
    TORCH_CHECK(k >= 1 && k <= w.N && w.K % 8 == 0, "q8 norm_topk: k must be in [1, ", w.N, "]");
    const int64_t T = x.size(0), N = w.N;
    const at::Tensor xc = x.contiguous(), nw = norm.contiguous();
    at::Tensor h = at::empty_like(xc);
    for (int64_t t = 0; t < T; ++t)
      moa_layer::norm_row(xc.data_ptr<float>() + t * w.K, nw.data_ptr<float>(), h.data_ptr<float>() + t * w.K, w.K, static_cast<float>(eps));
    const at::Tensor logits = matmul_of(h, w, "q8 norm_topk");
    at::Tensor probs = at::empty({T, k}, at::kFloat), ids = at::empty({T, k}, at::kLong), finite = at::empty({T}, at::kBool);
    for (int64_t t = 0; t < T; ++t)
      moa_layer::softmax_top_row(logits.data_ptr<float>() + t * N, N, k, probs.data_ptr<float>() + t * k, ids.data_ptr<int64_t>() + t * k, finite.data_ptr<bool>() + t);
    return {probs, ids, finite};
  }

 private:
  PackedMat w;
};

// --- the stack ----------------------------------------------------------------------------------

// A decoder layer: qkv reads RMSNorm(x) (in_norm), or for an EAGLE-3 draft layer [RMSNorm(embedding) (in_norm),
// RMSNorm(x) (in_norm2)] (qkv.K = 2H); the residual stream is x either way. A cross-attention layer (MoA's CA) has
// q only (qkv holds Hq * D rows): its keys and values are already in the pools, and it writes none.
struct Layer {
  at::Tensor in_norm, in_norm2, post_norm, qkv_bias;  // fp32; in_norm2 / qkv_bias undefined when unused
  PackedMat qkv, o, gate_up, down;
  bool cross = false;
};

// Where a forward's time goes (Q8Stack.set_profile): thread 0 adds the time since its last mark to a phase's
// total after each phase's closing barrier, so a phase's time includes its wait for the slowest thread.
enum Phase { SETUP, NORM_IN, QKV, ATTENTION, O_PROJ, NORM_POST, GATE_UP, DOWN, FINAL, PHASES };

struct PhaseClock {
  std::array<double, PHASES> ms{};
  std::chrono::steady_clock::time_point last;
  void start() { last = std::chrono::steady_clock::now(); }
  void mark(Phase p) {
    if (omp_get_thread_num() != 0) return;
    const auto now = std::chrono::steady_clock::now();
    ms[p] += std::chrono::duration<double, std::milli>(now - last).count();
    last = now;
  }
};

// One forward's buffers (made per call: the stack is shared by every caller, e.g. a drafter's TLI layers).
struct Buffers {
  int64_t T;
  // fp32: residual [T, H], qkv's input [T, K], normed [T, H], [T, Nqkv], [T, Hq * D], [T, Hq * D], [T, 2I], [T, I]
  at::Tensor x, hin, h, qkv, q, a, gu, m;
  Q8Rows xq, hq, aq, mq;  // the quantised inputs of qkv (xq), gate_up (hq), o (aq), down (mq)
  PhaseClock* clock = nullptr;        // set while profiling
  void mark(Phase p) {
    if (clock) clock->mark(p);
  }
};

// The attention of a batch: (rows of a request, chunk) tasks into partials, then a merge per row (decode and
// verify steps: threads share a row's chunks, and a tree's rows read each chunk of their common prefix once, from
// L1/L2 after the first row); or, with enough rows for every thread, one task per row (its chunks and merge in
// the task: prompt blocks). The same numbers either way.
struct AttnWork {
  std::vector<int64_t> chunk0;  // row t's chunks are chunk0[t] .. chunk0[t + 1] - 1 of the partials
  struct Task {
    int64_t row0, rows, chunk;  // chunk `chunk` of rows [row0, row0 + rows) of one request (those that have it)
  };
  std::vector<Task> tasks;
  bool by_row = false;
  at::Tensor m, l, o;             // partials of every chunk (by_row: unused)
};

class Q8Stack : public torch::CustomClassHolder {
 public:
  Q8Stack(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inter, double eps)
      : H(hidden), Hq(heads), Hkv(kv_heads), D(head_dim), I(inter), eps(static_cast<float>(eps)), uid(next_uid++) {
    TORCH_CHECK(vnni_supported(), "q8: this CPU lacks AVX-512 VNNI (F/DQ/BW/VL/VNNI)");
    TORCH_CHECK(H % QK == 0 && I % QK == 0 && (D == 64 || D == 128) && Hq % Hkv == 0 && Hq * D % QK == 0,
                "q8: needs hidden and intermediate sizes multiples of 32, head_dim 64 or 128, heads a multiple of kv heads");
    Nqkv = (Hq + 2 * Hkv) * D;
  }

  // Every layer kind's tail: o [H, Hq * D], gate_up [2I, H], down [H, I] repacked and checked; the layer appended.
  // Returns its index.
  int64_t push_layer(Layer l, const at::Tensor& o, int64_t o_kind, const at::Tensor& gate_up, int64_t gate_up_kind,
                     const at::Tensor& down, int64_t down_kind) {
    l.o = checked(repack(o, o_kind, Hq * D), H, "o");
    l.gate_up = checked(repack(gate_up, gate_up_kind, H), 2 * I, "gate_up");
    l.down = checked(repack(down, down_kind, I), H, "down");
    TORCH_CHECK(I % GROUP == 0, "q8: intermediate size must be a multiple of 16");
    layers.push_back(std::move(l));
    return num_layers() - 1;
  }

  void add_layer(const at::Tensor& in_norm, const at::Tensor& qkv, int64_t qkv_kind, const c10::optional<at::Tensor>& qkv_bias,
                 const at::Tensor& o, int64_t o_kind, const at::Tensor& post_norm, const at::Tensor& gate_up, int64_t gate_up_kind,
                 const at::Tensor& down, int64_t down_kind) {
    Layer l;
    l.in_norm = norm_weight(in_norm, H);
    l.post_norm = norm_weight(post_norm, H);
    if (qkv_bias.has_value()) {
      TORCH_CHECK(qkv_bias->numel() == Nqkv, "q8: qkv bias must have ", Nqkv, " values");
      l.qkv_bias = qkv_bias->to(at::kFloat).contiguous();
    }
    l.qkv = checked(repack(qkv, qkv_kind, H), Nqkv, "qkv");
    push_layer(std::move(l), o, o_kind, gate_up, gate_up_kind, down, down_kind);
  }

  // An EAGLE-3 draft layer (midlayer): qkv [Nqkv, 2H] over [RMSNorm(embedding) | RMSNorm(feature)] (in_norm,
  // hidden_norm), the rest a decoder layer's, its residual the feature. Returns its index (run by draft_layer).
  int64_t add_eagle3_layer(const at::Tensor& in_norm, const at::Tensor& hidden_norm, const at::Tensor& qkv, int64_t qkv_kind, const at::Tensor& o,
                           int64_t o_kind, const at::Tensor& post_norm, const at::Tensor& gate_up, int64_t gate_up_kind, const at::Tensor& down,
                           int64_t down_kind) {
    Layer l;
    l.in_norm = norm_weight(in_norm, H);
    l.in_norm2 = norm_weight(hidden_norm, H);
    l.post_norm = norm_weight(post_norm, H);
    l.qkv = checked(repack(qkv, qkv_kind, 2 * H), Nqkv, "qkv");
    return push_layer(std::move(l), o, o_kind, gate_up, gate_up_kind, down, down_kind);
  }

  // A cross-attention layer (MoA's CA): q [Hq * D, H] over RMSNorm(x) (in_norm), attention over keys and values
  // already in the pools, then o, the residual and the MLP of a decoder layer. Returns its index (run by
  // forward_layers).
  int64_t add_cross_layer(const at::Tensor& in_norm, const at::Tensor& q, int64_t q_kind, const at::Tensor& o, int64_t o_kind,
                          const at::Tensor& post_norm, const at::Tensor& gate_up, int64_t gate_up_kind, const at::Tensor& down, int64_t down_kind) {
    Layer l;
    l.cross = true;
    l.in_norm = norm_weight(in_norm, H);
    l.post_norm = norm_weight(post_norm, H);
    l.qkv = checked(repack(q, q_kind, H), Hq * D, "q");
    return push_layer(std::move(l), o, o_kind, gate_up, gate_up_kind, down, down_kind);
  }

  // An EAGLE-3 layer's T rows checked (embeddings and features [T, H], RoPE cos/sin [T, D], slots [T] in the pools)
  // and their buffers, x = the features (the layer's residual).
  Buffers eagle3_rows(const at::Tensor& embeds, const at::Tensor& feat, int64_t layer, const at::Tensor& cos, const at::Tensor& sin,
                      const at::Tensor& slots, const at::Tensor& k_pool, const at::Tensor& v_pool, const char* who) const {
    const int64_t T = check_rows(feat, cos, sin, slots);
    TORCH_CHECK(layer >= 0 && layer < num_layers() && layers[layer].in_norm2.defined(), who, ": layer ", layer, " is no EAGLE-3 layer");
    TORCH_CHECK(embeds.scalar_type() == at::kFloat && embeds.dim() == 2 && embeds.size(0) == T && embeds.size(1) == H, who, ": embeds must be fp32 [T, ", H, "]");
    check_pool(k_pool, v_pool, slots);
    Buffers buf = buffers(T, 2 * H);
    buf.x.copy_(feat);
    return buf;
  }

  // An EAGLE-3 draft layer over T rows: embeddings and features [T, H], RoPE cos/sin [T, D]; writes the rows'
  // K/V to the pools at slots, attends per the plan; returns the pre-norm outputs [T, H] (Eagle3Draft.finish's).
  at::Tensor draft_layer(const at::Tensor& embeds, const at::Tensor& feat, int64_t layer, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& slots, const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& qo_indptr,
                         const at::Tensor& kv_indptr, const at::Tensor& kv_indices, const at::Tensor& custom_mask, double scale) {
    Buffers buf = eagle3_rows(embeds, feat, layer, cos, sin, slots, k_pool, v_pool, "q8 draft_layer");
    const int64_t T = buf.T;
    const moa_attention::RowPlan rp = moa_attention::plan_rows(qo_indptr, kv_indptr, kv_indices, custom_mask, T, k_pool.size(0), "q8 draft_layer");
    AttnWork work = attention_work(rp, T, threads(T));
    const at::Tensor e = embeds.contiguous();
    const Layer& l = layers[layer];
#pragma omp parallel num_threads(threads(T))
    {
      norm_quantize_in(buf, l, e.data_ptr<float>());
      qkv_rope_store(buf, l, cos, sin, slots, k_pool, v_pool);
      attention(buf, work, rp, k_pool, v_pool, static_cast<float>(scale));
      out_ffn(buf, l);
    }
    return buf.x.clone();
  }

  // An EAGLE-3 draft layer's K/V only (its norms, k|v projection, RoPE and store; no q, attention or MLP): the
  // rows of a draft-extend before each request's last pair, whose outputs nothing reads (only the last pair's feeds
  // the search). Writes what draft_layer writes for the same rows.
  void draft_kv(const at::Tensor& embeds, const at::Tensor& feat, int64_t layer, const at::Tensor& cos, const at::Tensor& sin,
                const at::Tensor& slots, const at::Tensor& k_pool, const at::Tensor& v_pool) {
    Buffers buf = eagle3_rows(embeds, feat, layer, cos, sin, slots, k_pool, v_pool, "q8 draft_kv");
    const at::Tensor e = embeds.contiguous();
    const Layer& l = layers[layer];
#pragma omp parallel num_threads(threads(buf.T))
    {
      norm_quantize_in(buf, l, e.data_ptr<float>());
      qkv_rope_store(buf, l, cos, sin, slots, k_pool, v_pool, true);
    }
  }

  void set_head(const at::Tensor& final_norm, const at::Tensor& head, int64_t kind) {
    norm = norm_weight(final_norm, H);
    lm_head = repack(head, kind, H);
  }

  // Layers `ids` in order over x [T, H], each with its own K/V rows, pools and attention plan: layer ids[i] writes
  // row t's K/V at slots[i][t] of k_pools[i] / v_pools[i] (a cross layer writes none) and attends per plan
  // plans[i] (qo_indptr, kv_indptr, kv_indices, custom_mask: 4 tensors each, flat). Returns [the final-normed
  // hidden (x itself when no head norm is set), the outputs of the layers at positions `capture`]. Each layer
  // computes what forward computes for it (a MoA draft pass: SA, CA and the target's TLI layers in one call;
  // MoA's LSA layer over the layers' K/V of verified tokens).
  std::vector<at::Tensor> forward_layers(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const std::vector<at::Tensor>& slots,
                                         const std::vector<at::Tensor>& k_pools, const std::vector<at::Tensor>& v_pools,
                                         const std::vector<int64_t>& ids, const std::vector<at::Tensor>& plans, double scale,
                                         const std::vector<int64_t>& capture) {
    if (profiling) clock.start();
    const int64_t n = static_cast<int64_t>(ids.size());
    TORCH_CHECK(n >= 1 && static_cast<int64_t>(slots.size()) == n && static_cast<int64_t>(k_pools.size()) == n &&
                    static_cast<int64_t>(v_pools.size()) == n && static_cast<int64_t>(plans.size()) == 4 * n,
                "q8 forward_layers: one slots tensor, k and v pool and plan (4 tensors) per layer");
    const int64_t T = check_rows(x, cos, sin, slots[0]);
    std::vector<moa_attention::RowPlan> rps;
    std::vector<AttnWork> works;
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(ids[i] >= 0 && ids[i] < num_layers() && !layers[ids[i]].in_norm2.defined(), "q8 forward_layers: no decoder layer ", ids[i]);
      check_rows(x, cos, sin, slots[i]);
      check_pool(k_pools[i], v_pools[i], slots[i]);
      rps.push_back(moa_attention::plan_rows(plans[4 * i], plans[4 * i + 1], plans[4 * i + 2], plans[4 * i + 3], T, k_pools[i].size(0),
                                             "q8 forward_layers"));
    }
    std::vector<int64_t> plan_of(n);
    for (int64_t i = 0; i < n; ++i) {
      works.push_back(attention_work(rps[i], T, threads(T)));
      plan_of[i] = i;
    }
    return run_layers(x, cos, sin, slots, k_pools, v_pools, ids, rps, works, plan_of, scale, capture);
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers.size()); }

  // MoA's commit tail on its LSA stack (lsa_commit): memory = Ekv2E (mean over the layers of the LSA layer's output)
  // + bias; the CA layer's keys and values of it: [k | v] = kv (RMSNorm(memory) by kv_norm), RoPE on k.
  void set_lsa_tail(const at::Tensor& ekv2e_blocks, int64_t ekv2e_kind, const at::Tensor& ekv2e_bias, const at::Tensor& kv_norm,
                    const at::Tensor& kv_blocks, int64_t kv_kind, int64_t kv_heads, int64_t head_dim) {
    TORCH_CHECK(kv_heads > 0 && head_dim > 0 && head_dim % 16 == 0, "q8 set_lsa_tail: bad CA kv heads / head dim");
    ekv2e = repack(ekv2e_blocks, ekv2e_kind, H);
    const int64_t M = ekv2e.N;
    TORCH_CHECK(M % QK == 0, "q8 set_lsa_tail: the memory width must be a multiple of 32");
    memory_bias = norm_weight(ekv2e_bias, M);
    kv_norm_w = norm_weight(kv_norm, M);
    ca_kv = checked(repack(kv_blocks, kv_kind, M), 2 * kv_heads * head_dim, "the CA k|v");
    ca_heads = kv_heads, ca_dim = head_dim;
  }

  // MoA's commit of n verified tokens in one call (the LSA stack, its tail set): token i's L rows are its K|V at
  // every target layer (k_layers[l] / v_layers[l], fp32 [slots, Hkv_t, D_t] with 2 Hkv_t D_t == H, at slots[i];
  // per KV head its key then its value, as models/moa.py stack_layer_kv),
  // RoPE over the layer index (lsa_cos / lsa_sin [L, D]); the stack's one layer over them, each token's rows
  // attending to each other; then the tail at the tokens' positions (cos / sin [n, D_ca]). Returns the CA
  // [k, v], each [n, kv_heads, D_ca]: what MoAPieces.lsa then ca_kv compute, on the q8 kernels.
  std::vector<at::Tensor> lsa_commit(const std::vector<at::Tensor>& k_layers, const std::vector<at::Tensor>& v_layers, const at::Tensor& slots,
                                     const at::Tensor& lsa_cos, const at::Tensor& lsa_sin, const at::Tensor& cos, const at::Tensor& sin) {
    TORCH_CHECK(ca_heads > 0 && num_layers() == 1, "q8 lsa_commit: the LSA stack (one layer, set_lsa_tail) only");
    const int64_t L = static_cast<int64_t>(k_layers.size()), half = H / 2;
    TORCH_CHECK(L >= 1 && static_cast<int64_t>(v_layers.size()) == L, "q8 lsa_commit: one k and one v pool per target layer");
    TORCH_CHECK(slots.device().is_cpu() && slots.scalar_type() == at::kLong && slots.dim() == 1, "q8 lsa_commit: slots must be int64 [n]");
    const int64_t n = slots.size(0), T = n * L, S = k_layers[0].size(0), heads_t = k_layers[0].size(1), dim_t = k_layers[0].size(2);
    for (int64_t l = 0; l < L; ++l)
      for (const at::Tensor* p : {&k_layers[l], &v_layers[l]})
        TORCH_CHECK(p->device().is_cpu() && p->scalar_type() == at::kFloat && p->is_contiguous() && p->dim() == 3 && p->size(0) == S &&
                        p->size(1) == heads_t && p->size(2) == dim_t && heads_t * dim_t == half,
                    "q8 lsa_commit: target pools must be contiguous fp32 [slots, kv_heads, head_dim] with 2 kv_heads head_dim == ", H);
    auto rope_rows = [](const at::Tensor& t, int64_t rows, int64_t d, const char* name) {
      TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 2 && t.size(0) == rows && t.size(1) == d,
                  "q8 lsa_commit: ", name, " must be fp32 [", rows, ", ", d, "]");
      return t.contiguous();
    };
    const at::Tensor lc = rope_rows(lsa_cos, L, D, "lsa_cos"), ls = rope_rows(lsa_sin, L, D, "lsa_sin");
    const at::Tensor cc = rope_rows(cos, n, ca_dim, "cos"), cs = rope_rows(sin, n, ca_dim, "sin");
    const at::Tensor sl = slots.contiguous();
    const int64_t* sp = sl.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) TORCH_CHECK(sp[i] >= 0 && sp[i] < S, "q8 lsa_commit: slot ", sp[i], " outside the pools");
    at::Tensor x = at::empty({T, H}, at::kFloat), rc = at::empty({T, D}, at::kFloat), rs = at::empty({T, D}, at::kFloat);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t l = 0; l < L; ++l) {
        float* row = x.data_ptr<float>() + (i * L + l) * H;  // per KV head: its key, then its value
        for (int64_t h = 0; h < heads_t; ++h) {
          std::memcpy(row + 2 * h * dim_t, k_layers[l].data_ptr<float>() + sp[i] * half + h * dim_t, dim_t * sizeof(float));
          std::memcpy(row + (2 * h + 1) * dim_t, v_layers[l].data_ptr<float>() + sp[i] * half + h * dim_t, dim_t * sizeof(float));
        }
        std::memcpy(rc.data_ptr<float>() + (i * L + l) * D, lc.data_ptr<float>() + l * D, D * sizeof(float));
        std::memcpy(rs.data_ptr<float>() + (i * L + l) * D, ls.data_ptr<float>() + l * D, D * sizeof(float));
      }
    // the plan: token i's rows are its own request, every key visible; scratch K/V at slot 1 + row
    const at::Tensor indptr = at::arange(0, T + 1, L, at::kLong), rows = at::arange(1, T + 1, at::kLong);
    const at::Tensor pk = at::empty({T + 1, Hkv, D}, at::kFloat), pv = at::empty({T + 1, Hkv, D}, at::kFloat);
    std::vector<moa_attention::RowPlan> rps{
        moa_attention::plan_rows(indptr, indptr, rows, at::ones({n * L * L}, at::kBool), T, T + 1, "q8 lsa_commit")};
    std::vector<AttnWork> works{attention_work(rps[0], T, threads(T))};
    // the layer, its output averaged over each token's L rows in the down projection's place (out_ffn's `group`)
    const double scale = 1.0 / std::sqrt(static_cast<double>(D));
    at::Tensor mean = L == 1 ? run_layers(x, rc, rs, {rows}, {pk}, {pv}, {0}, rps, works, {0}, scale, {})[0] : at::empty({n, H}, at::kFloat);
    if (L > 1) {
      Buffers buf = buffers(T);
      buf.x.copy_(x);
      const Layer& l = layers[0];
#pragma omp parallel num_threads(threads(T))
      {
        norm_quantize_in(buf, l);
        qkv_rope_store(buf, l, rc, rs, rows, pk, pv);
        attention(buf, works[0], rps[0], pk, pv, static_cast<float>(scale));
        out_ffn(buf, l, L, mean.data_ptr<float>());
      }
    }
    const at::Tensor memory = matmul_of(mean, ekv2e, "q8 lsa_commit").add_(memory_bias);
    const int64_t M = ekv2e.N, kvw = ca_heads * ca_dim;
    at::Tensor normed = at::empty({n, M}, at::kFloat);
    for (int64_t i = 0; i < n; ++i)
      moa_layer::norm_row(memory.data_ptr<float>() + i * M, kv_norm_w.data_ptr<float>(), normed.data_ptr<float>() + i * M, M, eps);
    const at::Tensor kv = matmul_of(normed, ca_kv, "q8 lsa_commit");
    at::Tensor k = at::empty({n, ca_heads, ca_dim}, at::kFloat), v = at::empty({n, ca_heads, ca_dim}, at::kFloat);
    for (int64_t i = 0; i < n; ++i) {
      const float* row = kv.data_ptr<float>() + i * 2 * kvw;
      for (int64_t h = 0; h < ca_heads; ++h)
        moa_layer::rope_head(row + h * ca_dim, cc.data_ptr<float>() + i * ca_dim, cs.data_ptr<float>() + i * ca_dim,
                             k.data_ptr<float>() + (i * ca_heads + h) * ca_dim, ca_dim);
      std::memcpy(v.data_ptr<float>() + i * kvw, row + kvw, kvw * sizeof(float));
    }
    return {k, v};
  }


  // Profiling of forward (one caller at a time): on/off, and the ms per phase since the last read (then reset):
  // setup (checks, the plan's rows, buffers), and summed over the layers: norm + quantise, qkv + RoPE + K/V store,
  // attention + quantise, o + residual, norm + quantise, gate/up + SiLU + quantise, down + residual; then the
  // captures and the final norm. Each phase includes its barrier.
  void set_profile(bool on) { profiling = on; }
  std::vector<double> profile() {
    std::vector<double> out(clock.ms.begin(), clock.ms.end());
    clock.ms.fill(0.0);
    return out;
  }

  // The decoder stack over x [T, H] (fp32 embeddings): layers `ids` (indices into this stack) in order,
  // layer ids[i] reading and writing k_pools[i] / v_pools[i] [slots, Hkv, D] (row t's K/V at slots[t]);
  // attention per the plan (at most what tree_attention takes). Returns [final-normed hidden, the outputs of
  // the layers at positions `capture` of ids, in that order].
  std::vector<at::Tensor> forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                                  const std::vector<at::Tensor>& k_pools, const std::vector<at::Tensor>& v_pools, const std::vector<int64_t>& ids,
                                  const at::Tensor& qo_indptr, const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                                  const at::Tensor& custom_mask, double scale, const std::vector<int64_t>& capture) {
    if (profiling) clock.start();
    const int64_t T = check_rows(x, cos, sin, slots);
    TORCH_CHECK(k_pools.size() == ids.size() && v_pools.size() == ids.size(), "q8 forward: one k and one v pool per layer");
    for (size_t i = 0; i < ids.size(); ++i) {
      TORCH_CHECK(ids[i] >= 0 && ids[i] < num_layers() && !layers[ids[i]].in_norm2.defined(), "q8 forward: no decoder layer ", ids[i]);
      check_pool(k_pools[i], v_pools[i], slots);
    }
    std::vector<moa_attention::RowPlan> rps{moa_attention::plan_rows(qo_indptr, kv_indptr, kv_indices, custom_mask, T,
                                                                     k_pools.empty() ? 0 : k_pools[0].size(0), "q8 forward")};
    std::vector<AttnWork> works{attention_work(rps[0], T, threads(T))};
    return run_layers(x, cos, sin, std::vector<at::Tensor>(ids.size(), slots), k_pools, v_pools, ids, rps, works,
                      std::vector<int64_t>(ids.size(), 0), scale, capture);
  }

  // One layer's first half (the per-layer path: prompt blocks, drafters' TLI layers): RMSNorm, quantise, qkv,
  // RoPE, K/V store into the pools at slots. Returns q [T, Hq, D] for the attention.
  at::Tensor layer_qkv(const at::Tensor& x, int64_t layer, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_pool,
                       const at::Tensor& v_pool, const at::Tensor& slots) {
    Buffers buf = qkv_rows(x, layer, cos, sin, k_pool, v_pool, slots, false);
    return buf.q.view({buf.T, Hq, D}).clone();
  }

  // layer_qkv's K/V alone (no q): what a commit of verified tokens needs (MoA's SA layer), the same K/V rows.
  void layer_kv(const at::Tensor& x, int64_t layer, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_pool,
                const at::Tensor& v_pool, const at::Tensor& slots) {
    qkv_rows(x, layer, cos, sin, k_pool, v_pool, slots, true);
  }

  // The stack's attention for the layer-by-layer path: q [T, Hq, D] (layer_qkv's) over the pools per the plan
  // -> [T, Hq * D], what forward computes for the same rows.
  at::Tensor attention_of(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& qo_indptr,
                          const at::Tensor& kv_indptr, const at::Tensor& kv_indices, const at::Tensor& custom_mask, double scale) {
    TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.dim() == 3 && q.size(1) == Hq && q.size(2) == D,
                "q8 attention: q must be fp32 [T, ", Hq, ", ", D, "]");
    const int64_t T = q.size(0);
    TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.scalar_type() == at::kFloat && v_pool.scalar_type() == at::kFloat &&
                    k_pool.dim() == 3 && k_pool.size(1) == Hkv && k_pool.size(2) == D && v_pool.sizes() == k_pool.sizes(),
                "q8 attention: pools must be contiguous fp32 [slots, ", Hkv, ", ", D, "]");
    const moa_attention::RowPlan rp = moa_attention::plan_rows(qo_indptr, kv_indptr, kv_indices, custom_mask, T, k_pool.size(0), "q8 attention");
    Buffers buf;
    buf.T = T;
    buf.q = q.reshape({T, Hq * D}).contiguous();
    buf.a = at::empty({T, Hq * D}, q.options());
    AttnWork work = attention_work(rp, T, threads(T));
#pragma omp parallel num_threads(threads(T))
    attention(buf, work, rp, k_pool, v_pool, static_cast<float>(scale), false);
    return buf.a;
  }

  // The layer's second half: x [T, H] (the residual stream) and the attention output a [T, Hq * D] -> x + o(a),
  // then + down(SiLU(gate) * up) of its RMSNorm. Bit-identical to what forward computes for the same rows.
  at::Tensor layer_out(const at::Tensor& x, const at::Tensor& a, int64_t layer) {
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == H, "q8 layer_out: x must be fp32 [T, ", H, "]");
    const int64_t T = x.size(0);
    TORCH_CHECK(a.device().is_cpu() && a.scalar_type() == at::kFloat && a.numel() == T * Hq * D, "q8 layer_out: a must be fp32 [T, ", Hq * D, "]");
    TORCH_CHECK(layer >= 0 && layer < num_layers(), "q8 layer_out: layer ", layer, " outside the stack");
    Buffers buf = buffers(T);
    buf.x.copy_(x);
    const at::Tensor ac = a.reshape({T, Hq * D}).contiguous();
#pragma omp parallel num_threads(threads(T))
    {
#pragma omp for schedule(static)
      for (int64_t t = 0; t < T; ++t) quantize_row(ac.data_ptr<float>() + t * Hq * D, buf.aq, t);
      out_ffn(buf, layers[layer]);
    }
    return buf.x.clone();
  }

  // logits [T, V] of final-normed hidden states h [T, H]
  at::Tensor logits(const at::Tensor& h) {
    TORCH_CHECK(lm_head.data.defined(), "q8 logits: no head set");
    return matmul_of(h, lm_head, "q8 logits");
  }

  // x [T, K] times one of a layer's weights (which: 0 qkv, 1 o, 2 gate_up, 3 down), quantised as forward does
  at::Tensor matmul(const at::Tensor& x, int64_t layer, int64_t which) {
    TORCH_CHECK(layer >= 0 && layer < num_layers() && which >= 0 && which < 4, "q8 matmul: no such layer or weight");
    const Layer& l = layers[layer];
    const PackedMat* w[4] = {&l.qkv, &l.o, &l.gate_up, &l.down};
    return matmul_of(x, *w[which], "q8 matmul");
  }

 private:
  int64_t H, Hq, Hkv, D, I, Nqkv;
  float eps;
  uint64_t uid;  // this stack's key in buffers' cache
  static inline std::atomic<uint64_t> next_uid{0};
  static constexpr int64_t CACHED_ROWS = 8;
  bool profiling = false;
  PhaseClock clock;
  std::vector<Layer> layers;
  at::Tensor norm;
  PackedMat lm_head;
  PackedMat ekv2e, ca_kv;  // MoA's LSA tail (set_lsa_tail)
  at::Tensor memory_bias, kv_norm_w;
  int64_t ca_heads = 0, ca_dim = 0;

  static at::Tensor norm_weight(const at::Tensor& w, int64_t n) {
    TORCH_CHECK(w.numel() == n, "q8: norm weight must have ", n, " values");
    return w.to(at::kFloat).contiguous().clone();
  }

  static PackedMat checked(PackedMat m, int64_t N, const char* name) {
    TORCH_CHECK(m.N == N, "q8: ", name, " has ", m.N, " rows, expected ", N);
    return m;
  }

  static int threads(int64_t) { return at::get_num_threads(); }

  int64_t check_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots) const {
    TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) == H, "q8: x must be fp32 [T, ", H, "] on the CPU");
    const int64_t T = x.size(0);
    for (const at::Tensor* t : {&cos, &sin})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == T && t->size(1) == D && t->stride(1) == 1,
                  "q8: cos/sin must be fp32 [T, head_dim] with contiguous rows");
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.numel() == T && slots.is_contiguous(), "q8: slots must be int64 [T]");
    return T;
  }

  void check_pool(const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots) const {
    TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && k.dim() == 3 &&
                    k.size(1) == Hkv && k.size(2) == D && v.sizes() == k.sizes(),
                "q8: pools must be contiguous fp32 [slots, ", Hkv, ", ", D, "]");
    const int64_t* sl = slots.data_ptr<int64_t>();
    for (int64_t t = 0; t < slots.numel(); ++t) TORCH_CHECK(sl[t] >= 0 && sl[t] < k.size(0), "q8: slot ", sl[t], " outside the pool [0, ", k.size(0), ")");
  }

  // A call's scratch. Rows of a decode, a verify or a draft step (T <= CACHED_ROWS) reuse this thread's buffers of
  // the same shape from an earlier call of this stack: their ~20 allocations cost more than a few rows' glue, in a
  // step whose caches the weights' stream has made cold. Prompt blocks get fresh ones. Nothing a call returns is
  // one of them (copied out), and no call holds two.
  Buffers buffers(int64_t T, int64_t in_width = 0) const {
    in_width = in_width ? in_width : H;
    if (T > CACHED_ROWS) return make_buffers(T, in_width);
    thread_local std::map<std::tuple<uint64_t, int64_t, int64_t>, Buffers> cache;
    if (cache.size() > 512) cache.clear();  // (stacks come and go in tests: bounded)
    const auto key = std::make_tuple(uid, T, in_width);
    auto it = cache.find(key);
    if (it == cache.end()) it = cache.emplace(key, make_buffers(T, in_width)).first;
    return it->second;
  }

  Buffers make_buffers(int64_t T, int64_t in_width) const {
    Buffers b;
    b.T = T;
    const auto f = at::TensorOptions().dtype(at::kFloat);
    b.x = at::empty({T, H}, f);
    b.hin = at::empty({T, in_width}, f);
    b.xq = Q8Rows(T, in_width);
    b.h = at::empty({T, H}, f);
    b.qkv = at::empty({T, Nqkv}, f);
    b.q = at::empty({T, Hq * D}, f);
    b.a = at::empty({T, Hq * D}, f);
    b.gu = at::empty({T, 2 * I}, f);
    b.m = at::empty({T, I}, f);
    b.hq = Q8Rows(T, H);
    b.aq = Q8Rows(T, Hq * D);
    b.mq = Q8Rows(T, I);
    return b;
  }

  // The batch's attention work (see AttnWork): by rows when there are at least two rows per thread
  AttnWork attention_work(const moa_attention::RowPlan& rp, int64_t T, int nthreads) const {
    AttnWork w;
    w.chunk0.assign(T + 1, 0);
    for (int64_t t = 0; t < T; ++t) w.chunk0[t + 1] = w.chunk0[t] + (rp.row_ptr[t + 1] - rp.row_ptr[t] + CHUNK - 1) / CHUNK;
    w.by_row = T >= 2 * nthreads;
    if (w.by_row) return w;
    const int64_t* qo = rp.qo.data_ptr<int64_t>();
    for (int64_t b = 0; b < rp.requests; ++b)
      for (int64_t r0 = qo[b]; r0 < qo[b + 1]; r0 += 16) {
        const int64_t rows = std::min<int64_t>(16, qo[b + 1] - r0);
        int64_t most = 0;
        for (int64_t t = r0; t < r0 + rows; ++t) most = std::max(most, w.chunk0[t + 1] - w.chunk0[t]);
        for (int64_t c = 0; c < most; ++c) w.tasks.push_back({r0, rows, c});
      }
    const int64_t chunks = w.chunk0[T];
    w.m = at::empty({chunks, Hq}, at::kFloat);
    w.l = at::empty({chunks, Hq}, at::kFloat);
    w.o = at::empty({chunks, Hq, D}, at::kFloat);
    return w;
  }

  // forward's and forward_layers' body: layer ids[i] with row slots slots[i], pools i and plan rps[plan_of[i]]
  std::vector<at::Tensor> run_layers(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const std::vector<at::Tensor>& slots,
                                     const std::vector<at::Tensor>& k_pools, const std::vector<at::Tensor>& v_pools, const std::vector<int64_t>& ids,
                                     const std::vector<moa_attention::RowPlan>& rps, std::vector<AttnWork>& works, const std::vector<int64_t>& plan_of,
                                     double scale, const std::vector<int64_t>& capture) {
    const int64_t T = x.size(0);
    std::vector<bool> keep(ids.size(), false);
    for (int64_t c : capture) {
      TORCH_CHECK(c >= 0 && c < static_cast<int64_t>(ids.size()), "q8 forward: capture position ", c, " outside the layers");
      keep[c] = true;
    }
    Buffers buf = buffers(T);
    buf.x.copy_(x);
    std::vector<at::Tensor> captured(ids.size());
    for (size_t i = 0; i < ids.size(); ++i)
      if (keep[i]) captured[i] = at::empty({T, H}, x.options());
    at::Tensor out = at::empty({T, H}, x.options());
    const float sc = static_cast<float>(scale);
    if (profiling) buf.clock = &clock;
    buf.mark(SETUP);
#pragma omp parallel num_threads(threads(T))
    {
      for (size_t i = 0; i < ids.size(); ++i) {
        const Layer& l = layers[ids[i]];
        norm_quantize_in(buf, l);
        buf.mark(NORM_IN);
        qkv_rope_store(buf, l, cos, sin, slots[i], k_pools[i], v_pools[i]);
        buf.mark(QKV);
        attention(buf, works[plan_of[i]], rps[plan_of[i]], k_pools[i], v_pools[i], sc);
        buf.mark(ATTENTION);
        out_ffn(buf, l);
        if (keep[i]) {
#pragma omp for schedule(static)
          for (int64_t t = 0; t < T; ++t) std::memcpy(captured[i].data_ptr<float>() + t * H, buf.x.data_ptr<float>() + t * H, H * sizeof(float));
        }
      }
      final_norm(buf, out);
      buf.mark(FINAL);
    }
    std::vector<at::Tensor> result{out};
    for (int64_t c : capture) result.push_back(captured[c]);
    return result;
  }

  // --- phases (inside a parallel region; each ends at its worksharing loop's barrier) ---

  // qkv's input: RMSNorm(x), or [RMSNorm(embeds), RMSNorm(x)] for an EAGLE-3 layer (embeds [T, H])
  void norm_quantize_in(Buffers& b, const Layer& l, const float* embeds = nullptr) const {
    const float* x = b.x.data_ptr<float>();
    float* h = b.hin.data_ptr<float>();
    const int64_t K = b.xq.K;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < b.T; ++t) {
      if (embeds) {
        moa_layer::norm_row(embeds + t * H, l.in_norm.data_ptr<float>(), h + t * K, H, eps);
        moa_layer::norm_row(x + t * H, l.in_norm2.data_ptr<float>(), h + t * K + H, H, eps);
      } else {
        moa_layer::norm_row(x + t * H, l.in_norm.data_ptr<float>(), h + t * K, H, eps);
      }
      quantize_row(h + t * K, b.xq, t);
    }
  }

  void norm_quantize(Buffers& b, const at::Tensor& w) const {
    const float* x = b.x.data_ptr<float>();
    float* h = b.h.data_ptr<float>();
#pragma omp for schedule(static)
    for (int64_t t = 0; t < b.T; ++t) {
      moa_layer::norm_row(x + t * H, w.data_ptr<float>(), h + t * H, H, eps);
      quantize_row(h + t * H, b.hq, t);
    }
  }

  // layer_qkv / layer_kv: the layer's norm, q|k|v (k|v when kv_only), RoPE and K/V store over x [T, H]
  Buffers qkv_rows(const at::Tensor& x, int64_t layer, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_pool,
                   const at::Tensor& v_pool, const at::Tensor& slots, bool kv_only) {
    const int64_t T = check_rows(x, cos, sin, slots);
    TORCH_CHECK(layer >= 0 && layer < num_layers() && !layers[layer].in_norm2.defined(), "q8 layer_qkv: no decoder layer ", layer);
    TORCH_CHECK(!kv_only || !layers[layer].cross, "q8 layer_kv: layer ", layer, " is a cross layer (it stores no K/V)");
    check_pool(k_pool, v_pool, slots);
    Buffers buf = buffers(T);
    buf.x.copy_(x);
#pragma omp parallel num_threads(threads(T))
    {
      norm_quantize_in(buf, layers[layer]);
      qkv_rope_store(buf, layers[layer], cos, sin, slots, k_pool, v_pool, kv_only);
    }
    return buf;
  }

  // by head: the head's qkv groups for every row, then its RoPE (q into b.q, k into the pool) or v's store
  void qkv_rope_store(Buffers& b, const Layer& l, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots, const at::Tensor& k_pool,
                      const at::Tensor& v_pool, bool kv_only = false) const {
    const int64_t T = b.T, per_head = D / GROUP, kv_row = Hkv * D;
    float* qkv = b.qkv.data_ptr<float>();
    const float* bias = l.qkv_bias.defined() ? l.qkv_bias.data_ptr<float>() : nullptr;
    const int64_t* sl = slots.data_ptr<int64_t>();
    const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
    const int64_t cs = cos.stride(0), ss = sin.stride(0);
    float *kp = k_pool.data_ptr<float>(), *vp = v_pool.data_ptr<float>(), *q = b.q.data_ptr<float>();
    const int64_t units = l.cross ? Hq : Hq + 2 * Hkv;  // a cross layer: q only
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = kv_only ? Hq : 0; u < units; ++u) {
      for (int64_t g = u * per_head; g < (u + 1) * per_head; ++g) gemm_group(l.qkv, g, b.xq, T, qkv, Nqkv);
      for (int64_t t = 0; t < T; ++t) {
        float* row = qkv + t * Nqkv + u * D;
        if (bias)
          for (int64_t i = 0; i < D; ++i) row[i] = row[i] + bias[u * D + i];
        if (u < Hq)
          moa_layer::rope_head(row, cp + t * cs, sp + t * ss, q + t * Hq * D + u * D, D);
        else if (u < Hq + Hkv)
          moa_layer::rope_head(row, cp + t * cs, sp + t * ss, kp + sl[t] * kv_row + (u - Hq) * D, D);
        else
          std::memcpy(vp + sl[t] * kv_row + (u - Hq - Hkv) * D, row, D * sizeof(float));
      }
    }
  }

  // every row's attention into b.a, then quantised into b.aq when `quantise`
  void attention(Buffers& b, AttnWork& w, const moa_attention::RowPlan& rp, const at::Tensor& k_pool, const at::Tensor& v_pool, float scale,
                 bool quantise = true) const {
    const AttnGeometry geo{k_pool.data_ptr<float>(), v_pool.data_ptr<float>(), k_pool.stride(0), v_pool.stride(0), k_pool.stride(1), v_pool.stride(1),
                           Hq, Hkv, D, scale};
    const float* q = b.q.data_ptr<float>();
    float* a = b.a.data_ptr<float>();
    const auto chunk = D == 64 ? attend_chunk<64> : attend_chunk<128>;
    const auto keys_of = [&](int64_t t) { return rp.row_keys.data() + rp.row_ptr[t]; };
    const auto finish = [&](int64_t t, const Partials& p) {
      merge_chunks(p, w.chunk0[t + 1] - w.chunk0[t], Hq, D, a + t * Hq * D);
      const int64_t nb = Hq * D / QK;
      if (quantise)
        for (int64_t blk = 0; blk < nb; ++blk)
          quantize_block(a + t * Hq * D + blk * QK, b.aq.q + t * Hq * D + blk * QK, b.aq.d + t * nb + blk, b.aq.s + t * nb + blk);
    };
    if (w.by_row) {
      static thread_local std::vector<float> part;
#pragma omp for schedule(dynamic, 1)
      for (int64_t t = 0; t < b.T; ++t) {
        const int64_t chunks = w.chunk0[t + 1] - w.chunk0[t], n = rp.row_ptr[t + 1] - rp.row_ptr[t];
        part.resize(chunks * Hq * (D + 2));
        const Partials p{part.data(), part.data() + chunks * Hq, part.data() + 2 * chunks * Hq};
        for (int64_t c = 0; c < chunks; ++c) chunk(geo, q + t * Hq * D, keys_of(t), n, c, p);
        finish(t, p);
      }
      return;
    }
    const int64_t n_tasks = static_cast<int64_t>(w.tasks.size());
    float *pm = w.m.data_ptr<float>(), *pl = w.l.data_ptr<float>(), *po = w.o.data_ptr<float>();
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n_tasks; ++i) {
      const AttnWork::Task& tk = w.tasks[i];
      for (int64_t t = tk.row0; t < tk.row0 + tk.rows; ++t) {
        const int64_t c0 = w.chunk0[t];
        if (tk.chunk >= w.chunk0[t + 1] - c0) continue;
        const Partials p{pm + c0 * Hq, pl + c0 * Hq, po + c0 * Hq * D};
        chunk(geo, q + t * Hq * D, keys_of(t), rp.row_ptr[t + 1] - rp.row_ptr[t], tk.chunk, p);
      }
    }
#pragma omp for schedule(static)
    for (int64_t t = 0; t < b.T; ++t) {
      const int64_t c0 = w.chunk0[t];
      finish(t, Partials{pm + c0 * Hq, pl + c0 * Hq, po + c0 * Hq * D});
    }
  }

  // x += o(aq); then RMSNorm + quantise; gate/up + SiLU * up + quantise by 32 features; x += down(mq).
  // With `mean` [T / group, H] (MoA's LSA commit: a token's `group` >= 2 rows, one per target layer, are averaged):
  // each group's mean of x + down(m) written there as mean(x) + down(mean(m)), since down is linear: two down rows
  // a token instead of `group` (about a sixth of the LSA's multiply-adds at 30 layers).
  void out_ffn(Buffers& b, const Layer& l, int64_t group = 0, float* mean = nullptr) const {
    const int64_t T = b.T;
    float* x = b.x.data_ptr<float>();
#pragma omp for schedule(dynamic, 1)
    for (int64_t g = 0; g < l.o.groups; ++g) gemm_group(l.o, g, b.aq, T, x, H, x, H);
    b.mark(O_PROJ);
    norm_quantize(b, l.post_norm);
    b.mark(NORM_POST);
    float *gu = b.gu.data_ptr<float>(), *m = b.m.data_ptr<float>();
    const int64_t nb = I / QK, up = I / GROUP;
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < nb; ++u) {
      for (int64_t g : {2 * u, 2 * u + 1, up + 2 * u, up + 2 * u + 1}) gemm_group(l.gate_up, g, b.hq, T, gu, 2 * I);
      for (int64_t t = 0; t < T; ++t) {
        float* mt = m + t * I + u * QK;
        moa_layer::silu_mul_row(gu + t * 2 * I + u * QK, gu + t * 2 * I + I + u * QK, mt, QK);
        if (!mean) quantize_block(mt, b.mq.q + t * I + u * QK, b.mq.d + t * nb + u, b.mq.s + t * nb + u);
      }
    }
    b.mark(GATE_UP);
    if (mean) {
      const int64_t n = T / group;
      const float inv = 1.0f / static_cast<float>(group);
#pragma omp for schedule(static)
      for (int64_t i = 0; i < n; ++i) {
        float *mx = mean + i * H, *mm = gu + i * I;  // (gu's first n * I floats: free after gate/up)
        std::memcpy(mx, x + i * group * H, H * sizeof(float));
        std::memcpy(mm, m + i * group * I, I * sizeof(float));
        for (int64_t r = 1; r < group; ++r) {
          const float *xr = x + (i * group + r) * H, *mr = m + (i * group + r) * I;
          for (int64_t j = 0; j < H; ++j) mx[j] += xr[j];
          for (int64_t j = 0; j < I; ++j) mm[j] += mr[j];
        }
        for (int64_t j = 0; j < H; ++j) mx[j] *= inv;
        for (int64_t j = 0; j < I; ++j) mm[j] *= inv;
        // the mean as two 8-bit rows, the second its first's rounding error: one 8-bit row would round it
        // ~30x coarser than the rows' own roundings, which their mean averages out
        quantize_row(mm, b.mq, 2 * i);
        for (int64_t k = 0; k < I; ++k) mm[k] -= static_cast<float>(b.mq.q[2 * i * I + k]) * b.mq.d[2 * i * nb + k / QK];
        quantize_row(mm, b.mq, 2 * i + 1);
      }
      float* y = b.h.data_ptr<float>();  // [2n, H] (free after gate/up)
#pragma omp for schedule(dynamic, 1)
      for (int64_t g = 0; g < l.down.groups; ++g) gemm_group(l.down, g, b.mq, 2 * n, y, H);
#pragma omp for schedule(static)
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < H; ++j) mean[i * H + j] += y[2 * i * H + j] + y[(2 * i + 1) * H + j];
      b.mark(DOWN);
      return;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t g = 0; g < l.down.groups; ++g) gemm_group(l.down, g, b.mq, T, x, H, x, H);
    b.mark(DOWN);
  }

  void final_norm(Buffers& b, at::Tensor& out) const {
    const float* x = b.x.data_ptr<float>();
    float* y = out.data_ptr<float>();
    const float* w = norm.defined() ? norm.data_ptr<float>() : nullptr;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < b.T; ++t) {
      if (w)
        moa_layer::norm_row(x + t * H, w, y + t * H, H, eps);
      else
        std::memcpy(y + t * H, x + t * H, H * sizeof(float));
    }
  }
};

// For tests: x [T, K] fp32 -> (q int8 [T, K], d fp32 [T, K / 32], s int32 [T, K / 32]) as the stack quantises it
std::tuple<at::Tensor, at::Tensor, at::Tensor> q8_quantize(const at::Tensor& x) {
  TORCH_CHECK(vnni_supported(), "q8: this CPU lacks AVX-512 VNNI");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) % QK == 0, "q8_quantize: x must be fp32 [T, K], K % 32 == 0");
  const at::Tensor xc = x.contiguous();
  Q8Rows out(x.size(0), x.size(1));
  for (int64_t t = 0; t < x.size(0); ++t) quantize_row(xc.data_ptr<float>() + t * x.size(1), out, t);
  return {out.qt, out.dt, out.st};
}

bool q8_supported() { return vnni_supported(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(moa_cpu, m) {
  m.def("q8_supported() -> bool", &q8_supported);
  m.def("q8_quantize(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("q8_0_blocks(Tensor w) -> Tensor");
  m.class_<Q8Matrix>("Q8Matrix")
      .def(torch::init<at::Tensor, int64_t, int64_t>())
      .def("forward", &Q8Matrix::forward)
      .def("rows", &Q8Matrix::rows)
      .def("norm_topk", &Q8Matrix::norm_topk);
  m.class_<Q8Stack>("Q8Stack")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, int64_t, double>())
      .def("add_layer", &Q8Stack::add_layer)
      .def("add_eagle3_layer", &Q8Stack::add_eagle3_layer)
      .def("add_cross_layer", &Q8Stack::add_cross_layer)
      .def("forward_layers", &Q8Stack::forward_layers)
      .def("draft_layer", &Q8Stack::draft_layer)
      .def("draft_kv", &Q8Stack::draft_kv)
      .def("set_head", &Q8Stack::set_head)
      .def("num_layers", &Q8Stack::num_layers)
      .def("set_lsa_tail", &Q8Stack::set_lsa_tail)
      .def("lsa_commit", &Q8Stack::lsa_commit)
      .def("set_profile", &Q8Stack::set_profile)
      .def("profile", &Q8Stack::profile)
      .def("forward", &Q8Stack::forward)
      .def("layer_qkv", &Q8Stack::layer_qkv)
      .def("layer_kv", &Q8Stack::layer_kv)
      .def("attention", &Q8Stack::attention_of)
      .def("layer_out", &Q8Stack::layer_out)
      .def("logits", &Q8Stack::logits)
      .def("matmul", &Q8Stack::matmul);
}
TORCH_LIBRARY_IMPL(moa_cpu, CPU, m) {
  m.impl("q8_quantize", &q8_quantize);
  m.impl("q8_0_blocks", &q8_0_blocks);
}
