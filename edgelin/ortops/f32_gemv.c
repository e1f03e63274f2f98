/* edgelin's float32 weight products for decoding (see f32_gemv.h).

   ONNX Runtime's MatMul for one row of activations runs MLAS's M=1 kernel over the unpacked weights, its columns
   split across threads: 16.6 GB/s on one core of this 2-core EPYC VM (12 x 384x1676 + 12 x 768x384 weights, 45 MB;
   21 GB/s prepacked, at the cost of a second copy of the weights). Here a task takes a slice of W's rows, one
   contiguous piece of memory for the prefetchers, and adds eight rows at a time into the output row (which stays
   in L1): eight weight loads per output load and store, two accumulator chains (4 rows at a time: 15-16.8 GB/s,
   8: 18-18.7, OpenBLAS's sgemv on one thread 19-22, same process). */
#include "f32_gemv.h"

#include <string.h>

#define ROWS 8

static void rows_portable(const float* x, int64_t M, int64_t K, int64_t N, const float* w, int64_t k0, int64_t k1,
                          float* y) {
  for (int64_t m = 0; m < M; ++m) {
    float* ym = y + m * N;
    memset(ym, 0, sizeof(float) * (size_t)N);
    for (int64_t k = k0; k < k1; ++k) {
      float xk = x[m * K + k];
      const float* wk = w + k * N;
      for (int64_t n = 0; n < N; ++n) ym[n] += xk * wk[n];
    }
  }
}

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2,fma")))

/* ym += sum over r < R of xm[r] W[r, :], for R rows of W from w (R <= ROWS; a constant where inlined, so that the
   row loops unroll). */
AVX2 static inline __attribute__((always_inline)) void add_rows(const float* xm, const float* w, int64_t N, int R,
                                                                  float* ym) {
  __m256 a[ROWS];
  for (int r = 0; r < R; ++r) a[r] = _mm256_set1_ps(xm[r]);
  int64_t n = 0;
  for (; n + 16 <= N; n += 16) {
    __m256 y0 = _mm256_loadu_ps(ym + n), y1 = _mm256_loadu_ps(ym + n + 8);
    __m256 z0 = _mm256_setzero_ps(), z1 = _mm256_setzero_ps();
    for (int r = 0; r < R; r += 2) {
      y0 = _mm256_fmadd_ps(a[r], _mm256_loadu_ps(w + r * N + n), y0);
      y1 = _mm256_fmadd_ps(a[r], _mm256_loadu_ps(w + r * N + n + 8), y1);
      if (r + 1 < R) {
        z0 = _mm256_fmadd_ps(a[r + 1], _mm256_loadu_ps(w + (r + 1) * N + n), z0);
        z1 = _mm256_fmadd_ps(a[r + 1], _mm256_loadu_ps(w + (r + 1) * N + n + 8), z1);
      }
    }
    _mm256_storeu_ps(ym + n, _mm256_add_ps(y0, z0));
    _mm256_storeu_ps(ym + n + 8, _mm256_add_ps(y1, z1));
  }
  for (; n < N; ++n) {  /* the last N % 16 columns */
    float s = ym[n];
    for (int r = 0; r < R; ++r) s += xm[r] * w[r * N + n];
    ym[n] = s;
  }
}

AVX2 static void rows_avx2(const float* x, int64_t M, int64_t K, int64_t N, const float* w, int64_t k0, int64_t k1,
                           float* y) {
  for (int64_t m = 0; m < M; ++m) memset(y + m * N, 0, sizeof(float) * (size_t)N);
  int64_t k = k0;
  for (; k + ROWS <= k1; k += ROWS)
    for (int64_t m = 0; m < M; ++m) add_rows(x + m * K + k, w + k * N, N, ROWS, y + m * N);
  for (; k < k1; ++k)
    for (int64_t m = 0; m < M; ++m) add_rows(x + m * K + k, w + k * N, N, 1, y + m * N);
}
#endif

void edgelin_f32_rows(const float* x, int64_t M, int64_t K, int64_t N, const float* weights, int64_t k0, int64_t k1,
                      float* y) {
#if defined(__x86_64__) || defined(_M_X64)
  if (edgelin_avx2()) {
    rows_avx2(x, M, K, N, weights, k0, k1, y);
    return;
  }
#endif
  rows_portable(x, M, K, N, weights, k0, k1, y);
}
