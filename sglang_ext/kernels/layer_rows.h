// The row routines of a Llama decoder layer's glue, fp32, AVX2 + FMA: RMSNorm, RoPE of one head,
// SiLU(gate) * up. Shared by cpu_layer_ops.cpp (one op each) and the q8 decoder stack (cpu_q8.cpp), so
// both give a row the same bits. Every row is computed alone in a fixed order (8-lane partial sums, then
// avx2_math.h's hsum).
#pragma once

#include <immintrin.h>

#include "avx2_math.h"

#include <cmath>
#include <cstdint>
#include <vector>

namespace moa_layer {

// y = x * rsqrt(mean(x^2) + eps) * w over one row of n floats (n % 8 == 0)
inline void norm_row(const float* x, const float* w, float* y, int64_t n, float eps) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  const float r = 1.0f / std::sqrt(hsum(acc) / static_cast<float>(n) + eps);
  const __m256 rv = _mm256_set1_ps(r);
  for (int64_t i = 0; i < n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), rv), _mm256_loadu_ps(w + i)));
}

// out = x * cos + rotate_half(x) * sin for one head (HF convention: halves duplicated in cos/sin)
inline void rope_head(const float* x, const float* c, const float* s, float* out, int64_t d) {
  const int64_t h = d / 2;
  for (int64_t i = 0; i < h; i += 8) {
    const __m256 lo = _mm256_loadu_ps(x + i), hi = _mm256_loadu_ps(x + h + i);
    // rounding as torch's x * cos + rot * sin: two products, then one add
    _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_mul_ps(lo, _mm256_loadu_ps(c + i)), _mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), hi), _mm256_loadu_ps(s + i))));
    _mm256_storeu_ps(out + h + i, _mm256_add_ps(_mm256_mul_ps(hi, _mm256_loadu_ps(c + h + i)), _mm256_mul_ps(lo, _mm256_loadu_ps(s + h + i))));
  }
}

// silu(g) * u = g * sigmoid(g) * u, with e = exp(-|g|) <= 1 so nothing overflows:
// sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) for g < 0. n % 8 == 0 (checked by the caller).
inline void silu_mul_row(const float* g, const float* u, float* out, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 e = exp_nonpositive(_mm256_or_ps(gv, sign));  // exp(-|g|)
    const __m256 num = _mm256_blendv_ps(one, e, gv);  // sign bit of g selects e
    const __m256 sig = _mm256_div_ps(num, _mm256_add_ps(one, e));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + i)));
  }
}

// A one-level search's row: the k largest of the n logits l as softmax probabilities, descending (ties: the
// lower index first), p [k] and ids [k]; finite = every logit finite. p = exp(l - max) / sum(exp(l - max)), the
// sum over 8 lanes (torch's softmax may differ in the last bit). A row with a NaN or +inf logit (a faulty
// drafter) gets NaN probabilities and ids 0 .. k - 1.
inline void softmax_top_row(const float* l, int64_t n, int64_t k, float* p, int64_t* ids, bool* finite) {
  bool nan_or_inf = false, all_finite = true;
  float top = -INFINITY;
  for (int64_t i = 0; i < n; ++i) {
    const float v = l[i];
    if (!std::isfinite(v)) {
      all_finite = false;
      nan_or_inf |= !(v == -INFINITY);
    }
    top = std::max(top, v);
  }
  *finite = all_finite;
  if (nan_or_inf || top == -INFINITY) {
    for (int64_t j = 0; j < k; ++j) p[j] = NAN, ids[j] = j;
    return;
  }
  // the k largest in one pass: a value enters when larger than the k-th kept (earlier indices win ties)
  std::vector<float> val(k, -INFINITY);
  for (int64_t j = 0; j < k; ++j) ids[j] = -1;
  for (int64_t i = 0; i < n; ++i) {
    const float v = l[i];
    if (!(v > val[k - 1]) && ids[k - 1] >= 0) continue;
    int64_t j = k - 1;
    while (j > 0 && (v > val[j - 1] || ids[j - 1] < 0)) {
      val[j] = val[j - 1], ids[j] = ids[j - 1];
      --j;
    }
    val[j] = v, ids[j] = i;
  }
  const __m256 mv = _mm256_set1_ps(top);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_add_ps(acc, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(l + i), mv)));
  float sum = hsum(acc);
  for (; i < n; ++i) sum += std::exp(l[i] - top);
  for (int64_t j = 0; j < k; ++j) p[j] = std::exp(val[j] - top) / sum;
}

}  // namespace moa_layer
