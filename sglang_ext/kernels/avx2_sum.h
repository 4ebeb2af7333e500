// Horizontal sum of 8 floats, one fixed order ((0+4)+(2+6))+((1+5)+(3+7)), shared by the CPU kernels:
// every kernel's results depend on this order being the same wherever a sum is taken.
#pragma once

#include <immintrin.h>

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
