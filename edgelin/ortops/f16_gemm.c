/* edgelin's float16-weight products on ONNX's [K, N] layout (see f16_gemm.h): what exports made before the packed
   panels (panels.c) store.

   ONNX Runtime's CPU provider has no float16 MatMul on x86: a graph with float16 weights runs them through Cast
   nodes, which its constant folding turns into float32 copies of every weight, per session. Here the halves are
   widened in registers (F16C) as they stream in, so a step reads half the bytes of a float32 export and the
   weights stay one mapped copy. Decoding streams slices of W's rows with the float32 product's loop
   (rows_kernel.h); a prefill piece takes 6 tokens x 16 columns register tiles (tiles_kernel.h), W's column panels
   widened into an L1-resident float32 buffer once per panel while the piece's token rows pass over it. */
#include "f16_gemm.h"

#include "arm/neon.h"
#include "tiles_kernel.h"  /* and rows_kernel.h, attention.h: edgelin_half_to_float */

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

AVX2 static void rows_avx2(const float* x, int64_t M, int64_t K, int64_t N, const uint16_t* w, int64_t k0,
                           int64_t k1, float* y) {
  edgelin_rows(x, M, K, N, w, k0, k1, 1, y);
}

AVX2 static void cols_avx2(const float* x, int64_t M, int64_t K, int64_t N, const uint16_t* w, int64_t n0,
                           int64_t n1, float* y) {
  for (int64_t n = n0; n < n1; n += TILE_N) {
    int cols = n1 - n < TILE_N ? (int)(n1 - n) : TILE_N;
    edgelin_panel_tokens(x, M, K, N, w + n, N, 1, cols == TILE_N, cols, y + n);
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
#if defined(__aarch64__)
  if (edgelin_arm() != EDGELIN_ARM_NONE) {
    edgelin_neon_rows(x, M, K, N, weights, 1, k0, k1, y);
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
