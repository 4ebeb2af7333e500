// The non-matmul glue of a Llama decoder layer, fp32, one op each: RMSNorm, residual add + RMSNorm,
// RoPE on q/k with the K/V store into the pool, SiLU(gate) * up; and a one-level search's softmax top-k.
//
// Why: at batch 1 the four matmuls of a SmolLM2 layer read their GGUF blocks in ~0.35 ms, while the
// ~30 small torch ops around them (float casts, pow, mean, rsqrt, cat for rotate_half, index_put
// into the pool, ...) cost ~0.2 ms more in dispatch alone: about a third of a decode step. Each op
// here does one pass over its rows.
//
// Every row is computed alone in a fixed order (8-lane partial sums, then avx2_math.h's hsum), so a
// row gives the same bits whatever else is in the batch and whichever thread runs it: decode, tree
// verify and batched serving stay bit-identical to each other (the engine's greedy identity).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "layer_rows.h"

#include <algorithm>
#include <cmath>
#include <tuple>

namespace {

using namespace moa_layer;

constexpr int64_t GRAIN = 16;  // rows per task: a decode row is ~1 us of work, not worth a thread

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, name, ": fp32 CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, ": expects a [rows, features] tensor with contiguous rows");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "rms_norm");
  const int64_t T = x.size(0), n = x.size(1);
  TORCH_CHECK(n % 8 == 0 && w.numel() == n && w.is_contiguous() && w.scalar_type() == at::kFloat, "rms_norm: weight must be fp32 [", n, "], n % 8 == 0");
  auto y = at::empty({T, n}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, T, GRAIN, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) norm_row(xp + t * xs, wp, yp + t * n, n, static_cast<float>(eps));
  });
  return y;
}

// s = x + r (the residual stream after a sublayer) and rms_norm(s): one pass instead of two
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& r, const at::Tensor& w, double eps) {
  check_rows(x, "add_rms_norm");
  check_rows(r, "add_rms_norm");
  const int64_t T = x.size(0), n = x.size(1);
  TORCH_CHECK(r.size(0) == T && r.size(1) == n, "add_rms_norm: x and r differ in shape");
  TORCH_CHECK(n % 8 == 0 && w.numel() == n && w.is_contiguous() && w.scalar_type() == at::kFloat, "add_rms_norm: weight must be fp32 [", n, "], n % 8 == 0");
  auto s = at::empty({T, n}, x.options());
  auto y = at::empty({T, n}, x.options());
  const float *xp = x.data_ptr<float>(), *rp = r.data_ptr<float>(), *wp = w.data_ptr<float>();
  float *sp = s.data_ptr<float>(), *yp = y.data_ptr<float>();
  const int64_t xs = x.stride(0), rs = r.stride(0);
  at::parallel_for(0, T, GRAIN, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* st = sp + t * n;
      for (int64_t i = 0; i < n; i += 8)
        _mm256_storeu_ps(st + i, _mm256_add_ps(_mm256_loadu_ps(xp + t * xs + i), _mm256_loadu_ps(rp + t * rs + i)));
      norm_row(st, wp, yp + t * n, n, static_cast<float>(eps));
    }
  });
  return {s, y};
}

// qkv [T, (Hq + 2 Hkv) D] -> RoPE'd q [T, Hq, D]; RoPE'd k and v are written to the pools' rows `slots`
at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_pool, at::Tensor v_pool, const at::Tensor& slots,
                      int64_t num_heads, int64_t num_kv_heads) {
  check_rows(qkv, "rope_store");
  check_rows(cos, "rope_store");
  check_rows(sin, "rope_store");
  const int64_t T = qkv.size(0), d = cos.size(1);
  TORCH_CHECK(d % 16 == 0, "rope_store: head_dim must be a multiple of 16");
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * d, "rope_store: qkv width ", qkv.size(1), " != (", num_heads, " + 2 x ", num_kv_heads, ") x ", d);
  TORCH_CHECK(cos.size(0) == T && sin.size(0) == T && sin.size(1) == d, "rope_store: cos/sin must be [T, head_dim]");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.scalar_type() == at::kFloat && v_pool.scalar_type() == at::kFloat, "rope_store: pools must be contiguous fp32");
  TORCH_CHECK(k_pool.dim() == 3 && k_pool.size(1) == num_kv_heads && k_pool.size(2) == d && v_pool.sizes() == k_pool.sizes(), "rope_store: pools must be [slots, num_kv_heads, head_dim]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.numel() == T && slots.is_contiguous(), "rope_store: slots must be int64 [T]");
  const int64_t num_slots = k_pool.size(0);
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sl[t] >= 0 && sl[t] < num_slots, "rope_store: slot ", sl[t], " outside the pool [0, ", num_slots, ")");
  auto q = at::empty({T, num_heads, d}, qkv.options());
  const float *xp = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *kp = k_pool.data_ptr<float>(), *vp = v_pool.data_ptr<float>();
  const int64_t xs = qkv.stride(0), cs = cos.stride(0), ss = sin.stride(0), kv_row = num_kv_heads * d;
  at::parallel_for(0, T, GRAIN, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* row = xp + t * xs;
      const float *c = cp + t * cs, *s = sp + t * ss;
      for (int64_t hh = 0; hh < num_heads; ++hh) rope_head(row + hh * d, c, s, qp + (t * num_heads + hh) * d, d);
      float* kd = kp + sl[t] * kv_row;
      for (int64_t hh = 0; hh < num_kv_heads; ++hh) rope_head(row + (num_heads + hh) * d, c, s, kd + hh * d, d);
      std::copy(row + (num_heads + num_kv_heads) * d, row + (num_heads + 2 * num_kv_heads) * d, vp + sl[t] * kv_row);
    }
  });
  return q;
}

at::Tensor silu_mul(const at::Tensor& gu) {
  check_rows(gu, "silu_mul");
  const int64_t T = gu.size(0), n = gu.size(1) / 2;
  TORCH_CHECK(gu.size(1) % 16 == 0, "silu_mul: width must be gate | up, each a multiple of 8");
  auto y = at::empty({T, n}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t gs = gu.stride(0);
  at::parallel_for(0, T, GRAIN, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) silu_mul_row(gp + t * gs, gp + t * gs + n, yp + t * n, n);
  });
  return y;
}

// A one-level search over logits [T, n]: per row the k largest softmax probabilities, descending, their ids,
// whether every logit was finite (softmax_top_row): (fp32 [T, k], int64 [T, k], bool [T])
std::tuple<at::Tensor, at::Tensor, at::Tensor> softmax_topk(const at::Tensor& logits, int64_t k) {
  check_rows(logits, "softmax_topk");
  const int64_t T = logits.size(0), n = logits.size(1);
  TORCH_CHECK(k >= 1 && k <= n, "softmax_topk: k must be in [1, ", n, "]");
  auto p = at::empty({T, k}, logits.options());
  auto ids = at::empty({T, k}, logits.options().dtype(at::kLong));
  auto finite = at::empty({T}, logits.options().dtype(at::kBool));
  const float* lp = logits.data_ptr<float>();
  const int64_t ls = logits.stride(0);
  for (int64_t t = 0; t < T; ++t)
    softmax_top_row(lp + t * ls, n, k, p.data_ptr<float>() + t * k, ids.data_ptr<int64_t>() + t * k, finite.data_ptr<bool>() + t);
  return {p, ids, finite};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moa_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor r, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("rope_store(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor slots, int num_heads, int num_kv_heads) -> Tensor");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def("softmax_topk(Tensor logits, int k) -> (Tensor, Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(moa_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_store", &rope_store);
  m.impl("silu_mul", &silu_mul);
  m.impl("softmax_topk", &softmax_topk);
}
