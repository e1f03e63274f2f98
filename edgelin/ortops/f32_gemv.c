/* edgelin's float32 weight products for decoding (see f32_gemv.h).

   ONNX Runtime's MatMul for one row of activations runs MLAS's M=1 kernel over the unpacked weights, its columns
   split across threads: 16.6 GB/s on one core of this 2-core EPYC VM (12 x 384x1676 + 12 x 768x384 weights, 45 MB;
   21 GB/s prepacked, at the cost of a second copy of the weights). Here a task takes a slice of W's rows
   (rows_kernel.h, the loop the float16 product shares). */
#include "f32_gemv.h"

#include "arm/neon.h"
#include "rows_kernel.h"

#if defined(__x86_64__) || defined(_M_X64)
__attribute__((target("avx2,fma,f16c"))) static void rows_avx2(const float* x, int64_t M, int64_t K, int64_t N,
                                                               const float* w, int64_t k0, int64_t k1, float* y) {
  edgelin_rows(x, M, K, N, w, k0, k1, 0, y);
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
#if defined(__aarch64__)
  if (edgelin_arm() != EDGELIN_ARM_NONE) {
    edgelin_neon_rows(x, M, K, N, weights, 0, k0, k1, y);
    return;
  }
#endif
  edgelin_rows_portable(x, M, K, N, weights, k0, k1, 0, y);
}
