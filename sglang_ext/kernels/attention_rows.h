// Tree attention rows, fp32, AVX2 + FMA: the per-task routine of cpu_attention.cpp's tree_attention,
// shared with the q8 decoder stack (cpu_q8.cpp), so both give a row the same bits.
//
// Per query row and head: scores over the keys the row may see (in kv order), max, exp, sum, then
// sum_j p_j v_j / sum. Every step is a fixed sequence for the row and head, whatever else is in the
// batch or the task and whichever thread runs it.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include "avx2_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace moa_attention {

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

constexpr int64_t BLOCK = 64;  // keys per block: a block's K (V) rows stay in L1 while every query of the task uses them

// Scores of one query for compact keys [j0, j1) (j0 a multiple of 8), 8 keys at a time: 8
// independent FMA chains, then one transposing reduction. Every score takes the same reduction
// tree whatever its place in the group; a short last group repeats its first key in the spare
// lanes and drops their scores.
template <int DQ>
void score_block(const float* q, const float* k_base, int64_t k_stride, const int64_t* keys, int64_t nkeys, int64_t j0, int64_t j1,
                 float scale, float* scores) {
  __m256 qv[DQ];
#pragma GCC unroll 16
  for (int c = 0; c < DQ; ++c) qv[c] = _mm256_loadu_ps(q + 8 * c);
  for (int64_t j = j0; j < j1; j += 8) {
    const float* k[8];
    for (int l = 0; l < 8; ++l) k[l] = k_base + keys[j + l < nkeys ? j + l : j] * k_stride;
    __m256 acc[8];
#pragma GCC unroll 8
    for (int l = 0; l < 8; ++l) acc[l] = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k[l]));
#pragma GCC unroll 16
    for (int c = 1; c < DQ; ++c)
#pragma GCC unroll 8
      for (int l = 0; l < 8; ++l) acc[l] = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(k[l] + 8 * c), acc[l]);
    const __m256 s01 = _mm256_hadd_ps(acc[0], acc[1]), s23 = _mm256_hadd_ps(acc[2], acc[3]);
    const __m256 s45 = _mm256_hadd_ps(acc[4], acc[5]), s67 = _mm256_hadd_ps(acc[6], acc[7]);
    const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    // s0123 lanes: keys 0-3 summed over the low half of d | keys 0-3 over the high half; s4567 likewise
    const __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20), hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
    const __m256 sc = _mm256_mul_ps(_mm256_add_ps(lo, hi), _mm256_set1_ps(scale));
    if (j + 8 <= nkeys) {
      _mm256_storeu_ps(scores + j, sc);
    } else {
      alignas(32) float tmp[8];
      _mm256_store_ps(tmp, sc);
      for (int64_t l = 0; l < nkeys - j; ++l) scores[j + l] = tmp[l];
    }
  }
}

// scores[0:n] -> exp(scores - max) in place (8 lanes at a time, padding lanes zero); returns 1 / sum.
inline float exp_scores(float* scores, int64_t n) {
  const int64_t padded = (n + 7) & ~int64_t(7);
  for (int64_t j = n; j < padded; ++j) scores[j] = -INFINITY;
  __m256 mx = _mm256_set1_ps(-INFINITY);
  for (int64_t j = 0; j < padded; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(scores + j));
  const __m256 m = _mm256_set1_ps(hmax(mx));
  __m256 sum = _mm256_setzero_ps();
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t j = 0; j < padded; j += 8) {
    __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + j), m));
    const __m256i valid = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - j)), lane);
    p = _mm256_and_ps(p, _mm256_castsi256_ps(valid));
    _mm256_storeu_ps(scores + j, p);
    sum = _mm256_add_ps(sum, p);
  }
  return 1.0f / hsum(sum);
}

// acc[0:8*DV] += sum_{j in [j0, j1)} p[j] * V[keys[j]], keys in order.
template <int DV>
void value_block(const float* p, const float* v_base, int64_t v_stride, const int64_t* keys, int64_t j0, int64_t j1, float* acc_mem) {
  __m256 acc[DV];
#pragma GCC unroll 16
  for (int c = 0; c < DV; ++c) acc[c] = _mm256_loadu_ps(acc_mem + 8 * c);
  for (int64_t j = j0; j < j1; ++j) {
    const float* v = v_base + keys[j] * v_stride;
    const __m256 pj = _mm256_set1_ps(p[j]);
#pragma GCC unroll 16
    for (int c = 0; c < DV; ++c) acc[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8 * c), acc[c]);
  }
#pragma GCC unroll 16
  for (int c = 0; c < DV; ++c) _mm256_storeu_ps(acc_mem + 8 * c, acc[c]);
}

// One task: some query rows of one request x the `rep` query heads of one kv head. Each row
// sees its own compact key list (the kv positions its mask allows, in kv order); rows of a tree
// share the prefix, so walking every list block by block reads each K/V block from memory once
// for all rows x heads of the task. A row's result depends only on its own list: the same
// whichever other rows or requests share the task or the batch.
template <int D>
void attend_task(const float* q, int64_t q_row_stride, const float* k_base, const float* v_base, int64_t ks, int64_t vs,
                 const int64_t* row_ptr, const int64_t* row_keys, int64_t R, int64_t rep, float scale, float* out, int64_t out_row_stride) {
  // row r sees row_keys[row_ptr[r] : row_ptr[r + 1]]
  constexpr int DC = D / 8;
  int64_t nmax = 0;
  for (int64_t r = 0; r < R; ++r) nmax = std::max(nmax, row_ptr[r + 1] - row_ptr[r]);
  const int64_t width = nmax + 8;
  std::vector<float> scores(R * rep * width), acc(R * rep * D, 0.0f), inv(R * rep);
  for (int64_t j0 = 0; j0 < nmax; j0 += BLOCK)
    for (int64_t r = 0; r < R; ++r) {
      const int64_t n = row_ptr[r + 1] - row_ptr[r];
      if (j0 >= n) continue;
      for (int64_t h = 0; h < rep; ++h)
        score_block<DC>(q + r * q_row_stride + h * D, k_base, ks, row_keys + row_ptr[r], n, j0, std::min(j0 + BLOCK, n), scale,
                        scores.data() + (r * rep + h) * width);
    }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < rep; ++h) {
      const int64_t n = row_ptr[r + 1] - row_ptr[r];
      inv[r * rep + h] = n == 0 ? 0.0f : exp_scores(scores.data() + (r * rep + h) * width, n);
    }
  for (int64_t j0 = 0; j0 < nmax; j0 += BLOCK)
    for (int64_t r = 0; r < R; ++r) {
      const int64_t n = row_ptr[r + 1] - row_ptr[r];
      if (j0 >= n) continue;
      for (int64_t h = 0; h < rep; ++h)
        value_block<DC>(scores.data() + (r * rep + h) * width, v_base, vs, row_keys + row_ptr[r], j0, std::min(j0 + BLOCK, n),
                        acc.data() + (r * rep + h) * D);
    }
  // a row that sees nothing gets zeros (torch would give NaN)
  for (int64_t r = 0; r < R; ++r)
    for (int64_t h = 0; h < rep; ++h) {
      const float s = inv[r * rep + h];
      for (int64_t c = 0; c < D; ++c) out[r * out_row_stride + h * D + c] = acc[(r * rep + h) * D + c] * s;
    }
}

// A batch's attention plan (FlashInfer's ragged layout: qo_indptr, kv_indptr, kv_indices, custom_mask)
// as the slots each query row may see, in kv order (row CSR), built once and shared by the row's heads
// (and by every layer of a stack): row t sees row_keys[row_ptr[t] : row_ptr[t + 1]].
struct RowPlan {
  at::Tensor qo;  // int64 [requests + 1]
  int64_t requests = 0;
  std::vector<int64_t> row_ptr, row_keys;
};

inline RowPlan plan_rows(const at::Tensor& qo_indptr, const at::Tensor& kv_indptr, const at::Tensor& kv_indices, const at::Tensor& custom_mask,
                         int64_t T, int64_t S, const char* op) {
  // (a tensor of the right dtype is taken as it is: no dispatch, which a step of few rows pays for)
  const auto as = [](const at::Tensor& t, at::ScalarType type) { return (t.scalar_type() == type ? t : t.to(type)).contiguous(); };
  RowPlan rp;
  rp.qo = as(qo_indptr, at::kLong);
  auto kvp = as(kv_indptr, at::kLong);
  auto idx = as(kv_indices, at::kLong);
  auto mask = as(custom_mask, at::kBool);
  const int64_t B = rp.qo.numel() - 1;
  rp.requests = B;
  TORCH_CHECK(B >= 1 && kvp.numel() == B + 1, op, ": qo_indptr and kv_indptr must have batch + 1 entries");
  const int64_t* qo_p = rp.qo.data_ptr<int64_t>();
  const int64_t* kv_p = kvp.data_ptr<int64_t>();
  TORCH_CHECK(qo_p[0] == 0 && kv_p[0] == 0, op, ": indptr must start at 0");
  TORCH_CHECK(qo_p[B] == T, op, ": qo_indptr[-1] must equal the number of query rows");
  TORCH_CHECK(kv_p[B] == idx.numel(), op, ": kv_indptr[-1] must equal len(kv_indices)");
  const int64_t* idx_p = idx.data_ptr<int64_t>();
  for (int64_t j = 0; j < idx.numel(); ++j) TORCH_CHECK(idx_p[j] >= 0 && idx_p[j] < S, op, ": kv index out of the pool");
  const bool* mp = mask.data_ptr<bool>();
  int64_t off = 0;
  std::vector<int64_t> row_req(T), mask_row(T);  // per query row: its request, where its mask row starts
  for (int64_t b = 0; b < B; ++b) {
    const int64_t nq = qo_p[b + 1] - qo_p[b], nk = kv_p[b + 1] - kv_p[b];
    TORCH_CHECK(nq >= 0 && nk >= 0, op, ": indptr must be non-decreasing");
    for (int64_t i = 0; i < nq; ++i) row_req[qo_p[b] + i] = b, mask_row[qo_p[b] + i] = off + i * nk;
    off += nq * nk;
  }
  TORCH_CHECK(mask.numel() == off, op, ": custom_mask must hold sum(q_len * kv_len) entries");
  rp.row_ptr.assign(T + 1, 0);
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t nk = kv_p[row_req[t] + 1] - kv_p[row_req[t]];
      rp.row_ptr[t + 1] = std::count(mp + mask_row[t], mp + mask_row[t] + nk, true);
    }
  });
  for (int64_t t = 0; t < T; ++t) rp.row_ptr[t + 1] += rp.row_ptr[t];
  rp.row_keys.resize(rp.row_ptr[T]);
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = row_req[t], nk = kv_p[b + 1] - kv_p[b];
      int64_t* k = rp.row_keys.data() + rp.row_ptr[t];
      for (int64_t j = 0; j < nk; ++j)
        if (mp[mask_row[t] + j]) *k++ = idx_p[kv_p[b] + j];
    }
  });
  return rp;
}

}  // namespace moa_attention
