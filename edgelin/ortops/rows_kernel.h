/* The decoding loop the float32 and float16 weight products share (f32_gemv.c, f16_gemm.c): a task takes a slice of
   W's rows ([K, N] row-major, as ONNX's MatMul stores it), one contiguous piece of memory for the prefetchers, and adds
   eight rows at a time into each output row (which stays in L1): eight weight loads per output load and store, two
   accumulator chains (4 rows at a time: 15-16.8 GB/s on this 2-core EPYC, 8: 18-18.7, OpenBLAS's sgemv on one thread
   19-22, same process). `half` says W's element type (0: float32, 1: IEEE float16, widened with F16C as it is
   read); each caller passes a constant, so the always-inlined functions specialise. The portable loop (any CPU,
   the AVX2 one's tested reference) first, then the AVX2 one (x86-64). */
#ifndef EDGELIN_ROWS_KERNEL_H
#define EDGELIN_ROWS_KERNEL_H
#include <stdint.h>
#include <string.h>

#include "attention.h" /* edgelin_half_to_float */

static inline float edgelin_load1(const void* w, int64_t i, int half) {
  return half ? edgelin_half_to_float(((const uint16_t*)w)[i]) : ((const float*)w)[i];
}

/* y[m, :] = sum over k0 <= k < k1 of x[m, k] W[k, :] for M rows of x ([M, K]) into y ([M, N]), written. */
static inline void edgelin_rows_portable(const float* x, int64_t M, int64_t K, int64_t N, const void* w, int64_t k0,
                                         int64_t k1, int half, float* y) {
  for (int64_t m = 0; m < M; ++m) {
    float* ym = y + m * N;
    memset(ym, 0, sizeof(float) * (size_t)N);
    for (int64_t k = k0; k < k1; ++k) {
      float xk = x[m * K + k];
      for (int64_t n = 0; n < N; ++n) ym[n] += xk * edgelin_load1(w, k * N + n, half);
    }
  }
}

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#define EDGELIN_ROWS 8 /* weight rows per step */
#define EDGELIN_INLINE_AVX2 __attribute__((target("avx2,fma,f16c"), always_inline)) static inline

/* 8 weights from element i of w, as floats */
EDGELIN_INLINE_AVX2 __m256 edgelin_load8(const void* w, int64_t i, int half) {
  return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)w + i)))
              : _mm256_loadu_ps((const float*)w + i);
}

/* ym += sum over r < R of xm[r] W[k + r, :], for R rows of W from row k (R <= EDGELIN_ROWS; a constant where
   inlined, so that the row loops unroll). */
EDGELIN_INLINE_AVX2 void edgelin_add_rows(const float* xm, const void* w, int64_t k, int64_t N, int R, int half,
                                          float* ym) {
  __m256 a[EDGELIN_ROWS];
  for (int r = 0; r < R; ++r) a[r] = _mm256_set1_ps(xm[r]);
  int64_t n = 0;
  for (; n + 16 <= N; n += 16) {
    __m256 y0 = _mm256_loadu_ps(ym + n), y1 = _mm256_loadu_ps(ym + n + 8);
    __m256 z0 = _mm256_setzero_ps(), z1 = _mm256_setzero_ps();
    for (int r = 0; r < R; r += 2) {
      int64_t i = (k + r) * N + n;
      y0 = _mm256_fmadd_ps(a[r], edgelin_load8(w, i, half), y0);
      y1 = _mm256_fmadd_ps(a[r], edgelin_load8(w, i + 8, half), y1);
      if (r + 1 < R) {
        z0 = _mm256_fmadd_ps(a[r + 1], edgelin_load8(w, i + N, half), z0);
        z1 = _mm256_fmadd_ps(a[r + 1], edgelin_load8(w, i + N + 8, half), z1);
      }
    }
    _mm256_storeu_ps(ym + n, _mm256_add_ps(y0, z0));
    _mm256_storeu_ps(ym + n + 8, _mm256_add_ps(y1, z1));
  }
  for (; n < N; ++n) { /* the last N % 16 columns */
    float s = ym[n];
    for (int r = 0; r < R; ++r) s += xm[r] * edgelin_load1(w, (k + r) * N + n, half);
    ym[n] = s;
  }
}

/* y[m, :] = sum over k0 <= k < k1 of x[m, k] W[k, :] for M rows of x ([M, K]) into y ([M, N]), written. */
EDGELIN_INLINE_AVX2 void edgelin_rows(const float* x, int64_t M, int64_t K, int64_t N, const void* w, int64_t k0,
                                      int64_t k1, int half, float* y) {
  for (int64_t m = 0; m < M; ++m) memset(y + m * N, 0, sizeof(float) * (size_t)N);
  int64_t k = k0;
  for (; k + EDGELIN_ROWS <= k1; k += EDGELIN_ROWS)
    for (int64_t m = 0; m < M; ++m) edgelin_add_rows(x + m * K + k, w, k, N, EDGELIN_ROWS, half, y + m * N);
  for (; k < k1; ++k)
    for (int64_t m = 0; m < M; ++m) edgelin_add_rows(x + m * K + k, w, k, N, 1, half, y + m * N);
}
#endif
#endif
