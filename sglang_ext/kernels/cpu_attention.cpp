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

#include "attention_rows.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

using namespace moa_attention;

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
  const RowPlan rp = plan_rows(qo_indptr, kv_indptr, kv_indices, custom_mask, T, k_pool.size(0), "tree_attention");
  const int64_t B = rp.requests;
  const int64_t* qo_p = rp.qo.data_ptr<int64_t>();
  const std::vector<int64_t>&row_ptr = rp.row_ptr, &row_keys = rp.row_keys;
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
