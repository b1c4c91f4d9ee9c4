// 8-lane fp32 helpers the kernels built with -mavx2 -mfma share (attention.cpp, layer.cpp): a fixed-order
// lane sum and a vectorised exp, each the same sequence of operations for every lane and every call, so
// a number computed with them does not depend on what else shares the call.
// native.py rebuilds every library when a header changes (the headers' hash is one of the build's flags).
#pragma once

#include <immintrin.h>

namespace specstack_vec {

// the 8 lanes summed in one fixed order
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp(x) of 8 lanes, the same sequence of operations for every lane (Cephes' expf: x = n ln 2 + r with
// |r| <= ln 2 / 2, a degree-7 polynomial for e^r, n added to the exponent): within 2 ulp of expf, exact
// 0 below -87 (where expf is denormal or 0) and for -inf. The attention's softmax takes one exp per visible key
// and query head (a call of the C library's expf each was most of a one-token step's attention), the
// SiLU one per gate.
inline __m256 exp8(__m256 x) {
  const __m256 zero_below = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.3762626647949f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), zero_below);
}

}  // namespace specstack_vec
