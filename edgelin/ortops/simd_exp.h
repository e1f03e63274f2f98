/* e^x over 8 AVX2 lanes, shared by the kernels that need it (conv.c's SiLU, attention.c's softmax). */
#ifndef EDGELIN_SIMD_EXP_H
#define EDGELIN_SIMD_EXP_H
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

/* x in [-87.3, 88.7] (clamped outside: e^-87.3 ~ 1e-38 stands in for 0), relative error ~1e-7: x = n ln2 + r,
   |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial, 2^n through the exponent bits. */
__attribute__((target("avx2,fma"))) static inline __m256 edgelin_exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f)), _MM_FROUND_TO_NEAREST_INT);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);  /* ln2 in two parts: exact n * hi */
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif
#endif
