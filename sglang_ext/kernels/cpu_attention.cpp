// Tree attention for few queries per request (decode, tree verify, draft steps), fp32, AVX2 + FMA.
//
// Why: the torch path gathers each request's K/V into a padded batch and runs ~12 ops per layer
// (index, transpose, copy, matmul, mask, softmax, matmul, permute ...). At batch 1 with a few
// hundred cached tokens that is ~0.35 ms per layer of almost pure per-op overhead, a fifth of a
// SmolLM2 decode step on the 2-core CI machine. Here one call reads the pool in place through
// the plan's ragged view (FlashInfer's layout: qo_indptr, kv_indptr, kv_indices, custom_mask).
//
// Per query row and head: scores over the keys the row may see (in kv order), max, exp, sum, then
// sum_j p_j v_j / sum. Every step is a fixed sequence for the row, whatever else is in the batch
// and whichever thread runs it, so a decode row and the same row inside a verify tree give
// bit-identical outputs (the engine's greedy identity relies on that). A task takes the rows of
// one request and the query heads of one kv head together, so K/V are read once for all of them
// (the first version, one task per row x head, was bound by re-reading K/V from L3).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "avx2_math.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

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

at::Tensor tree_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& qo_indptr,
                          const at::Tensor& kv_indptr, const at::Tensor& kv_indices, const at::Tensor& custom_mask, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3 && v_pool.dim() == 3, "tree_attention: q [T,Hq,D], k/v pools [S,Hkv,D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_pool.scalar_type() == at::kFloat && v_pool.scalar_type() == at::kFloat, "tree_attention: fp32 only");
  TORCH_CHECK(k_pool.size(1) == v_pool.size(1) && k_pool.size(0) == v_pool.size(0), "tree_attention: k and v pools differ in shape");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = k_pool.size(1), Dv = v_pool.size(2);
  TORCH_CHECK(k_pool.size(2) == D, "tree_attention: q and k head dims differ");
  TORCH_CHECK(D == Dv && (D == 64 || D == 128), "tree_attention: head dims 64 or 128 (q, k and v alike)");
  TORCH_CHECK(Hq % Hkv == 0, "tree_attention: query heads must be a multiple of kv heads");
  TORCH_CHECK(k_pool.stride(2) == 1 && v_pool.stride(2) == 1, "tree_attention: pools must be contiguous in the head dim");
  auto qc = q.contiguous();
  auto qo = qo_indptr.to(at::kLong).contiguous(), kvp = kv_indptr.to(at::kLong).contiguous();
  auto idx = kv_indices.to(at::kLong).contiguous();
  auto mask = custom_mask.to(at::kBool).contiguous();
  const int64_t B = qo.numel() - 1;
  TORCH_CHECK(B >= 1 && kvp.numel() == B + 1, "tree_attention: qo_indptr and kv_indptr must have batch + 1 entries");
  const int64_t* qo_p = qo.data_ptr<int64_t>();
  const int64_t* kv_p = kvp.data_ptr<int64_t>();
  TORCH_CHECK(qo_p[B] == T, "tree_attention: qo_indptr[-1] must equal the number of query rows");
  TORCH_CHECK(kv_p[B] == idx.numel(), "tree_attention: kv_indptr[-1] must equal len(kv_indices)");
  const int64_t S = k_pool.size(0);
  const int64_t* idx_p = idx.data_ptr<int64_t>();
  for (int64_t j = 0; j < idx.numel(); ++j) TORCH_CHECK(idx_p[j] >= 0 && idx_p[j] < S, "tree_attention: kv index out of the pool");
  const bool* mp = mask.data_ptr<bool>();
  int64_t off = 0;
  std::vector<int64_t> row_req(T), mask_row(T);  // per query row: its request, where its mask row starts
  for (int64_t b = 0; b < B; ++b) {
    const int64_t nq = qo_p[b + 1] - qo_p[b], nk = kv_p[b + 1] - kv_p[b];
    TORCH_CHECK(nq >= 0 && nk >= 0, "tree_attention: indptr must be non-decreasing");
    for (int64_t i = 0; i < nq; ++i) row_req[qo_p[b] + i] = b, mask_row[qo_p[b] + i] = off + i * nk;
    off += nq * nk;
  }
  TORCH_CHECK(mask.numel() == off, "tree_attention: custom_mask must hold sum(q_len * kv_len) entries");
  // the slots each row may see, in kv order (row CSR), built once and shared by the row's kv heads
  std::vector<int64_t> row_ptr(T + 1, 0);
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t nk = kv_p[row_req[t] + 1] - kv_p[row_req[t]];
      row_ptr[t + 1] = std::count(mp + mask_row[t], mp + mask_row[t] + nk, true);
    }
  });
  for (int64_t t = 0; t < T; ++t) row_ptr[t + 1] += row_ptr[t];
  std::vector<int64_t> row_keys(row_ptr[T]);
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = row_req[t], nk = kv_p[b + 1] - kv_p[b];
      int64_t* k = row_keys.data() + row_ptr[t];
      for (int64_t j = 0; j < nk; ++j)
        if (mp[mask_row[t] + j]) *k++ = idx_p[kv_p[b] + j];
    }
  });
  // tasks: (request, kv head, block of rows); rows are split only to give every thread work
  // (results do not depend on the split)
  const int64_t want = 2 * at::get_num_threads();
  const int64_t splits = std::max<int64_t>(1, (want + B * Hkv - 1) / (B * Hkv));
  struct Task { int64_t g, row0, rows; };
  std::vector<Task> tasks;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t nq = qo_p[b + 1] - qo_p[b];
    const int64_t per = std::max<int64_t>(1, std::min<int64_t>(8, (nq + splits - 1) / splits));
    for (int64_t r0 = 0; r0 < nq; r0 += per)
      for (int64_t g = 0; g < Hkv; ++g) tasks.push_back({g, qo_p[b] + r0, std::min(per, nq - r0)});
  }
  auto out = at::empty({T, Hq, Dv}, q.options());
  const float* qp = qc.data_ptr<float>();
  const float* kp = k_pool.data_ptr<float>();
  const float* vp = v_pool.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t rep = Hq / Hkv, ks = k_pool.stride(0), vs = v_pool.stride(0), kh = k_pool.stride(1), vh = v_pool.stride(1);
  const float sc = static_cast<float>(scale);
  auto attend = D == 64 ? attend_task<64> : attend_task<128>;
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t t0, int64_t t1) {
    for (int64_t ti = t0; ti < t1; ++ti) {
      const Task& t = tasks[ti];
      attend(qp + (t.row0 * Hq + t.g * rep) * D, Hq * D, kp + t.g * kh, vp + t.g * vh, ks, vs, row_ptr.data() + t.row0, row_keys.data(),
             t.rows, rep, sc, op + (t.row0 * Hq + t.g * rep) * Dv, Hq * Dv);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moa_cpu, m) {
  m.def("tree_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor qo_indptr, Tensor kv_indptr, Tensor kv_indices, Tensor custom_mask, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(moa_cpu, CPU, m) { m.impl("tree_attention", &tree_attention); }
