/* The float32 and float16 weight products on NEON (see neon.h): the packed panels of panels.h (decoding streams
   each panel once per token, four chains of k for the FMA latency; a prefill piece runs 6-token x 16-column register
   tiles over each panel, KC rows at a time, a float16 panel widened once into an L1 buffer), and the [K, N] rows of
   exports made before the panels (rows_kernel.h's loop: 8 weight rows added into each output row per pass). The
   same loops as the AVX2 ones, in 4-float registers: float16 is widened with FCVTL (base ARMv8-A). */
#if defined(__aarch64__)
#include <arm_neon.h>
#include <string.h>

#include "../tiles_kernel.h" /* TILE_M, TILE_N, KC, edgelin_load1 */
#include "neon.h"

#define INLINE __attribute__((always_inline)) static inline

/* 4 weights from element i of w, as floats */
INLINE float32x4_t load4(const void* w, int64_t i, int half) {
  return half ? vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t*)w + i))) : vld1q_f32((const float*)w + i);
}

/* y[0:cols] (+)= one token's 16 sums: the slice's last columns (cols < 16) through a row of 16 */
INLINE void store16(const float32x4_t* v, int add, int cols, float* y) {
  if (cols == TILE_N) {
    for (int q = 0; q < 4; ++q) vst1q_f32(y + 4 * q, add ? vaddq_f32(v[q], vld1q_f32(y + 4 * q)) : v[q]);
    return;
  }
  float row[TILE_N];
  for (int q = 0; q < 4; ++q) vst1q_f32(row + 4 * q, v[q]);
  for (int c = 0; c < cols; ++c) y[c] = add ? y[c] + row[c] : row[c];
}

/* y[0:cols] = x P for one token and one packed panel P [K, 16]: two chains of k, 4 registers of columns each */
INLINE void panel_token(const float* x, int64_t K, const void* p, int half, int cols, float* y) {
  float32x4_t acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = vdupq_n_f32(0.0f);
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) {
    float32x4_t xk = vld1q_f32(x + k);
    for (int q = 0; q < 4; ++q) {
      acc[q] = vfmaq_laneq_f32(acc[q], load4(p, k * TILE_N + 4 * q, half), xk, 0);
      acc[4 + q] = vfmaq_laneq_f32(acc[4 + q], load4(p, (k + 1) * TILE_N + 4 * q, half), xk, 1);
      acc[q] = vfmaq_laneq_f32(acc[q], load4(p, (k + 2) * TILE_N + 4 * q, half), xk, 2);
      acc[4 + q] = vfmaq_laneq_f32(acc[4 + q], load4(p, (k + 3) * TILE_N + 4 * q, half), xk, 3);
    }
  }
  for (; k < K; ++k)
    for (int q = 0; q < 4; ++q) acc[q] = vfmaq_n_f32(acc[q], load4(p, k * TILE_N + 4 * q, half), x[k]);
  for (int q = 0; q < 4; ++q) acc[q] = vaddq_f32(acc[q], acc[4 + q]);
  store16(acc, 0, cols, y);
}

/* y[r, 0:cols] (+)= x[r, 0:kc] P for R tokens (R <= TILE_M, a constant where inlined: 4 R accumulators in
   registers), P a float32 panel [kc, 16] */
INLINE void tile(const float* x, int64_t K, int64_t kc, const float* panel, int R, int add, int cols, int64_t N,
                 float* y) {
  float32x4_t acc[TILE_M][4];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < 4; ++q) acc[r][q] = vdupq_n_f32(0.0f);
  for (int64_t k = 0; k < kc; ++k) {
    float32x4_t b[4];
    for (int q = 0; q < 4; ++q) b[q] = vld1q_f32(panel + k * TILE_N + 4 * q);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      float a = x[r * K + k];
      for (int q = 0; q < 4; ++q) acc[r][q] = vfmaq_n_f32(acc[r][q], b[q], a);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) store16(acc[r], add, cols, y + r * N);
}

/* y[:, 0:cols] = x P for one packed panel (first row at src) and all M tokens (M >= TILE_M) */
static void panel_tokens(const float* x, int64_t M, int64_t K, int64_t N, const void* src, int half, int cols,
                         float* y) {
  float buffer[KC * TILE_N] __attribute__((aligned(16)));
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    int64_t kc = K - k0 < KC ? K - k0 : KC;
    const float* panel = (const float*)src + k0 * TILE_N;
    if (half) {  /* widened once per panel, not once per token tile */
      for (int64_t i = 0; i < kc * TILE_N; i += 4) vst1q_f32(buffer + i, load4(src, k0 * TILE_N + i, 1));
      panel = buffer;
    }
    int add = k0 > 0;
    int64_t m = 0;
    for (; m + TILE_M <= M; m += TILE_M) tile(x + m * K + k0, K, kc, panel, TILE_M, add, cols, N, y + m * N);
    const float* xm = x + m * K + k0;
    float* ym = y + m * N;
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

INLINE void panels(const float* x, int64_t M, int64_t K, int64_t N, const void* w, int half, int64_t p0, int64_t p1,
                   float* y) {
  for (int64_t p = p0; p < p1; ++p) {
    int64_t n = p * TILE_N;
    int cols = N - n < TILE_N ? (int)(N - n) : TILE_N;
    const char* panel = (const char*)w + p * K * TILE_N * (half ? 2 : 4);
    if (M >= TILE_M) {
      panel_tokens(x, M, K, N, panel, half, cols, y + n);
    } else {
      for (int64_t m = 0; m < M; ++m) panel_token(x + m * K, K, panel, half, cols, y + m * N + n);
    }
  }
}

void edgelin_neon_panels(const float* x, int64_t M, int64_t K, int64_t N, const void* w, int half, int64_t p0,
                         int64_t p1, float* y) {
  if (half) {  /* each width its own specialisation of the inlined loops */
    panels(x, M, K, N, w, 1, p0, p1, y);
  } else {
    panels(x, M, K, N, w, 0, p0, p1, y);
  }
}

/* ym += sum over r < R of xm[r] W[k + r, :] (R <= 8, a constant where inlined) */
INLINE void add_rows(const float* xm, const void* w, int64_t k, int64_t N, int R, int half, float* ym) {
  int64_t n = 0;
  for (; n + 8 <= N; n += 8) {
    float32x4_t y0 = vld1q_f32(ym + n), y1 = vld1q_f32(ym + n + 4);
    float32x4_t z0 = vdupq_n_f32(0.0f), z1 = vdupq_n_f32(0.0f);
    for (int r = 0; r < R; r += 2) {
      int64_t i = (k + r) * N + n;
      y0 = vfmaq_n_f32(y0, load4(w, i, half), xm[r]);
      y1 = vfmaq_n_f32(y1, load4(w, i + 4, half), xm[r]);
      if (r + 1 < R) {
        z0 = vfmaq_n_f32(z0, load4(w, i + N, half), xm[r + 1]);
        z1 = vfmaq_n_f32(z1, load4(w, i + N + 4, half), xm[r + 1]);
      }
    }
    vst1q_f32(ym + n, vaddq_f32(y0, z0));
    vst1q_f32(ym + n + 4, vaddq_f32(y1, z1));
  }
  for (; n < N; ++n) { /* the last N % 8 columns */
    float s = ym[n];
    for (int r = 0; r < R; ++r) s += xm[r] * edgelin_load1(w, (k + r) * N + n, half);
    ym[n] = s;
  }
}

INLINE void rows(const float* x, int64_t M, int64_t K, int64_t N, const void* w, int half, int64_t k0, int64_t k1,
                 float* y) {
  for (int64_t m = 0; m < M; ++m) memset(y + m * N, 0, sizeof(float) * (size_t)N);
  int64_t k = k0;
  for (; k + 8 <= k1; k += 8)
    for (int64_t m = 0; m < M; ++m) add_rows(x + m * K + k, w, k, N, 8, half, y + m * N);
  for (; k < k1; ++k)
    for (int64_t m = 0; m < M; ++m) add_rows(x + m * K + k, w, k, N, 1, half, y + m * N);
}

void edgelin_neon_rows(const float* x, int64_t M, int64_t K, int64_t N, const void* w, int half, int64_t k0,
                       int64_t k1, float* y) {
  if (half) {
    rows(x, M, K, N, w, 1, k0, k1, y);
  } else {
    rows(x, M, K, N, w, 0, k0, k1, y);
  }
}
#endif
