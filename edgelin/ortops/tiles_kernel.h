/* The register tiles and packed-panel loops the float32 and float16 weight products share (f16_gemm.c, panels.c).
   A panel is 16 columns of W [K, N]: K rows of 16 values. Exports store W packed as [ceil(N / 16), K, 16] (panels.h),
   each panel one contiguous piece of memory (one stream for the hardware prefetchers); ONNX's [K, N] layout, which
   exports made before the panels keep, reaches a panel's rows N values apart. `half` says W's element type
   (0: float32, 1: IEEE float16, widened with F16C as it is read); each caller passes a constant, so the
   always-inlined functions specialise. The portable loop (any CPU; the AVX2 loops' tested reference) first. */
#ifndef EDGELIN_TILES_KERNEL_H
#define EDGELIN_TILES_KERNEL_H
#include "rows_kernel.h" /* edgelin_load1, edgelin_load8 */

#define TILE_M 6   /* tokens per register tile of the prefill loop */
#define TILE_N 16  /* columns per register tile (two 8-float registers) and per packed panel */
#define KC 256     /* a panel's rows per pass of the tokens (16 KiB of float32: stays in L1) */

/* y[:, 16 p0 : min(16 p1, N)] = x W for the packed panels p0 <= p < p1 of W, M rows of x ([M, K]), y [M, N] */
static inline void edgelin_panels_portable(const float* x, int64_t M, int64_t K, int64_t N, const void* w, int half,
                                           int64_t p0, int64_t p1, float* y) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = p0 * TILE_N; n < p1 * TILE_N && n < N; ++n) {
      int64_t first = (n / TILE_N) * K * TILE_N + n % TILE_N;
      float s = 0.0f;
      for (int64_t k = 0; k < K; ++k) s += x[m * K + k] * edgelin_load1(w, first + k * TILE_N, half);
      y[m * N + n] = s;
    }
}

#if defined(__x86_64__) || defined(_M_X64)
/* y[0:cols] (+)= one token's 16 sums (lo, hi): the slice's last columns (cols < 16) through a row of 16. */
EDGELIN_INLINE_AVX2 void edgelin_store16(__m256 lo, __m256 hi, int add, int cols, float* y) {
  if (cols == TILE_N) {
    if (add) {
      lo = _mm256_add_ps(lo, _mm256_loadu_ps(y));
      hi = _mm256_add_ps(hi, _mm256_loadu_ps(y + 8));
    }
    _mm256_storeu_ps(y, lo);
    _mm256_storeu_ps(y + 8, hi);
    return;
  }
  float row[TILE_N];
  _mm256_storeu_ps(row, lo);
  _mm256_storeu_ps(row + 8, hi);
  for (int c = 0; c < cols; ++c) y[c] = add ? y[c] + row[c] : row[c];
}

/* y[r, 0:cols] (+)= x[r, 0:kc] P for R tokens (R <= TILE_M; a constant where inlined, the token loops unrolled so
   that the 2 R accumulators stay in registers), P a float32 panel [kc, 16] (columns past `cols` zero): one 64-byte
   panel row per k. */
EDGELIN_INLINE_AVX2 void edgelin_tile(const float* x, int64_t K, int64_t kc, const float* panel, int R, int add,
                                      int cols, int64_t N, float* y) {
  __m256 lo[TILE_M], hi[TILE_M];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    __m256 b0 = _mm256_loadu_ps(panel + k * TILE_N), b1 = _mm256_loadu_ps(panel + k * TILE_N + 8);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      __m256 a = _mm256_broadcast_ss(x + r * K + k);
      lo[r] = _mm256_fmadd_ps(a, b0, lo[r]);
      hi[r] = _mm256_fmadd_ps(a, b1, hi[r]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) edgelin_store16(lo[r], hi[r], add, cols, y + r * N);
}

/* y[:, 0:cols] = x W for one panel of 16 columns of W, all M tokens (M >= TILE_M): `src` the panel's first row,
   `stride` values between its rows (N: ONNX's [K, N]; TILE_N: a packed panel), `full` when all 16 columns are read
   (a packed panel's columns past N are zeros). A packed float32 panel is read in place, KC rows per pass of the
   tokens; any other is first widened, KC rows at a time, into an L1-resident float32 buffer, so that the halves
   are converted once per panel instead of once per token tile. */
EDGELIN_INLINE_AVX2 void edgelin_panel_tokens(const float* x, int64_t M, int64_t K, int64_t N, const void* src,
                                              int64_t stride, int half, int full, int cols, float* y) {
  float buffer[KC * TILE_N] __attribute__((aligned(32)));
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    int64_t kc = K - k0 < KC ? K - k0 : KC;
    const float* panel = buffer;
    if (!half && stride == TILE_N) {
      panel = (const float*)src + k0 * TILE_N;
    } else {
      for (int64_t k = 0; k < kc; ++k) {
        int64_t row = (k0 + k) * stride;
        if (full) {
          _mm256_store_ps(buffer + k * TILE_N, edgelin_load8(src, row, half));
          _mm256_store_ps(buffer + k * TILE_N + 8, edgelin_load8(src, row + 8, half));
        } else {
          for (int c = 0; c < TILE_N; ++c) buffer[k * TILE_N + c] = c < cols ? edgelin_load1(src, row + c, half) : 0.0f;
        }
      }
    }
    int add = k0 > 0;
    int64_t m = 0;
    for (; m + TILE_M <= M; m += TILE_M) edgelin_tile(x + m * K + k0, K, kc, panel, TILE_M, add, cols, N, y + m * N);
    const float* xm = x + m * K + k0;
    float* ym = y + m * N;
    switch (M - m) {  /* the last M % 6 tokens, each count its own unrolled tile */
      case 5: edgelin_tile(xm, K, kc, panel, 5, add, cols, N, ym); break;
      case 4: edgelin_tile(xm, K, kc, panel, 4, add, cols, N, ym); break;
      case 3: edgelin_tile(xm, K, kc, panel, 3, add, cols, N, ym); break;
      case 2: edgelin_tile(xm, K, kc, panel, 2, add, cols, N, ym); break;
      case 1: edgelin_tile(xm, K, kc, panel, 1, add, cols, N, ym); break;
      default: break;
    }
  }
}

/* y[0:cols] = x P for one token and one packed panel P [K, 16] at `p`: one sequential stream of W, four chains of k
   for the FMA latency. */
EDGELIN_INLINE_AVX2 void edgelin_panel_token(const float* x, int64_t K, const void* p, int half, int cols, float* y) {
  __m256 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) {
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      __m256 a = _mm256_broadcast_ss(x + k + j);
      acc[2 * j] = _mm256_fmadd_ps(a, edgelin_load8(p, (k + j) * TILE_N, half), acc[2 * j]);
      acc[2 * j + 1] = _mm256_fmadd_ps(a, edgelin_load8(p, (k + j) * TILE_N + 8, half), acc[2 * j + 1]);
    }
  }
  for (; k < K; ++k) {
    __m256 a = _mm256_broadcast_ss(x + k);
    acc[0] = _mm256_fmadd_ps(a, edgelin_load8(p, k * TILE_N, half), acc[0]);
    acc[1] = _mm256_fmadd_ps(a, edgelin_load8(p, k * TILE_N + 8, half), acc[1]);
  }
  __m256 lo = _mm256_add_ps(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[4], acc[6]));
  __m256 hi = _mm256_add_ps(_mm256_add_ps(acc[1], acc[3]), _mm256_add_ps(acc[5], acc[7]));
  edgelin_store16(lo, hi, 0, cols, y);
}

/* edgelin_panels_portable's sums: a token at a time down each panel's stream for decoding (M < TILE_M), else the
   register tiles */
EDGELIN_INLINE_AVX2 void edgelin_panels(const float* x, int64_t M, int64_t K, int64_t N, const void* w, int half,
                                        int64_t p0, int64_t p1, float* y) {
  for (int64_t p = p0; p < p1; ++p) {
    int64_t n = p * TILE_N;
    int cols = N - n < TILE_N ? (int)(N - n) : TILE_N;
    const char* panel = (const char*)w + p * K * TILE_N * (half ? 2 : 4);
    if (M >= TILE_M) {
      edgelin_panel_tokens(x, M, K, N, panel, TILE_N, half, 1, cols, y + n);
    } else {
      for (int64_t m = 0; m < M; ++m) edgelin_panel_token(x + m * K, K, panel, half, cols, y + m * N + n);
    }
  }
}
#endif
#endif
