/* edgelin's float16-weight products (see f16_gemm.h).

   ONNX Runtime's CPU provider has no float16 MatMul on x86: a graph with float16 weights runs them through Cast
   nodes, which its constant folding turns into float32 copies of every weight, per session. Here the halves are
   widened in registers (F16C) as they stream in, so a step reads half the bytes of a float32 export and the
   weights stay one mapped copy. Decoding streams slices of W's rows with the float32 product's loop
   (rows_kernel.h); a prefill piece takes 6 tokens x 16 columns register tiles, W's column panels
   widened into an L1-resident float32 buffer once per panel while the piece's token rows pass over it. */
#include "f16_gemm.h"

#include "rows_kernel.h"  /* and attention.h: edgelin_half_to_float */

#define TILE_M 6   /* tokens per register tile of the prefill loop */
#define TILE_N 16  /* columns per register tile (two 8-float registers) */
#define KC 256     /* rows of W per packed panel (16 KiB of float32) */

static void cols_portable(const float* x, int64_t M, int64_t K, int64_t N, const uint16_t* w, int64_t n0,
                          int64_t n1, float* y) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = n0; n < n1; ++n) {
      float s = 0.0f;
      for (int64_t k = 0; k < K; ++k) s += x[m * K + k] * edgelin_half_to_float(w[k * N + n]);
      y[m * N + n] = s;
    }
}

#if defined(__x86_64__) || defined(_M_X64)
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define INLINE_AVX2 __attribute__((target("avx2,fma,f16c"), always_inline)) static inline

AVX2 static void rows_avx2(const float* x, int64_t M, int64_t K, int64_t N, const uint16_t* w, int64_t k0,
                           int64_t k1, float* y) {
  edgelin_rows(x, M, K, N, w, k0, k1, 1, y);
}

/* y[0:cols] (+)= one token's 16 sums (lo, hi): the slice's last columns (cols < 16) through a row of 16. */
INLINE_AVX2 void store_row(__m256 lo, __m256 hi, int add, int cols, float* y) {
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
   that the 2 R accumulators stay in registers), P a packed float32 panel [kc, 16] of W (columns past `cols`
   zero): one 64-byte panel row per k. */
INLINE_AVX2 void tile(const float* x, int64_t K, int64_t kc, const float* panel, int R, int add, int cols,
                      int64_t N, float* y) {
  __m256 lo[TILE_M], hi[TILE_M];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    __m256 b0 = _mm256_load_ps(panel + k * TILE_N), b1 = _mm256_load_ps(panel + k * TILE_N + 8);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      __m256 a = _mm256_broadcast_ss(x + r * K + k);
      lo[r] = _mm256_fmadd_ps(a, b0, lo[r]);
      hi[r] = _mm256_fmadd_ps(a, b1, hi[r]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) store_row(lo[r], hi[r], add, cols, y + r * N);
}

AVX2 static void cols_avx2(const float* x, int64_t M, int64_t K, int64_t N, const uint16_t* w, int64_t n0,
                           int64_t n1, float* y) {
  /* W's panel (KC rows x 16 columns) widened once into L1-resident float32, then every token passes over it:
     the halves are converted once per panel instead of once per token tile, and the tiles read one contiguous
     64-byte row per k (W's own rows are N halves apart). */
  float panel[KC * TILE_N] __attribute__((aligned(32)));
  for (int64_t n = n0; n < n1; n += TILE_N) {
    int cols = n1 - n < TILE_N ? (int)(n1 - n) : TILE_N;
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
      int64_t kc = K - k0 < KC ? K - k0 : KC;
      for (int64_t k = 0; k < kc; ++k) {
        const uint16_t* wk = w + (k0 + k) * N + n;
        if (cols == TILE_N) {
          _mm256_store_ps(panel + k * TILE_N, edgelin_load8(wk, 0, 1));
          _mm256_store_ps(panel + k * TILE_N + 8, edgelin_load8(wk, 8, 1));
        } else {
          for (int c = 0; c < TILE_N; ++c) panel[k * TILE_N + c] = c < cols ? edgelin_half_to_float(wk[c]) : 0.0f;
        }
      }
      int add = k0 > 0;
      int64_t m = 0;
      for (; m + TILE_M <= M; m += TILE_M)
        tile(x + m * K + k0, K, kc, panel, TILE_M, add, cols, N, y + m * N + n);
      const float* xm = x + m * K + k0;
      float* ym = y + m * N + n;
      switch (M - m) {  /* the last M % 6 tokens, each count its own unrolled tile */
        case 5: tile(xm, K, kc, panel, 5, add, cols, N, ym); break;
        case 4: tile(xm, K, kc, panel, 4, add, cols, N, ym); break;
        case 3: tile(xm, K, kc, panel, 3, add, cols, N, ym); break;
        case 2: tile(xm, K, kc, panel, 2, add, cols, N, ym); break;
        case 1: tile(xm, K, kc, panel, 1, add, cols, N, ym); break;
        default: break;
      }
    }
  }
}
#endif

void edgelin_f16_rows(const float* x, int64_t M, int64_t K, int64_t N, const uint16_t* weights, int64_t k0,
                      int64_t k1, float* y) {
#if defined(__x86_64__) || defined(_M_X64)
  if (edgelin_avx2()) {
    rows_avx2(x, M, K, N, weights, k0, k1, y);
    return;
  }
#endif
  edgelin_rows_portable(x, M, K, N, weights, k0, k1, 1, y);
}

void edgelin_f16_cols(const float* x, int64_t M, int64_t K, int64_t N, const uint16_t* weights, int64_t n0,
                      int64_t n1, float* y) {
#if defined(__x86_64__) || defined(_M_X64)
  if (edgelin_avx2()) {
    cols_avx2(x, M, K, N, weights, n0, n1, y);
    return;
  }
#endif
  cols_portable(x, M, K, N, weights, n0, n1, y);
}
