/* edgelin's weight products on packed panels (see panels.h).

   Decoding reads each weight once per token, so its speed is the rate the weights stream in. In ONNX's [K, N]
   layout a slice of eight rows is eight streams a few KiB long (rows_kernel.h: 14 GB/s on the Mamba2 peer's
   float16 step); a packed panel is one stream and the panels of a matrix one after the other, which the hardware
   prefetchers follow at the memory's rate (the Mamba2 peer's float16 step 2.2 -> 1.1 ms; docs/performance.md#cpu-step-latency). */
#include "panels.h"

#include "arm/neon.h"
#include "tiles_kernel.h"

#if defined(__x86_64__) || defined(_M_X64)
__attribute__((target("avx2,fma,f16c"))) static void f32_avx2(const float* x, int64_t M, int64_t K, int64_t N,
                                                              const void* w, int64_t p0, int64_t p1, float* y) {
  edgelin_panels(x, M, K, N, w, 0, p0, p1, y);
}

__attribute__((target("avx2,fma,f16c"))) static void f16_avx2(const float* x, int64_t M, int64_t K, int64_t N,
                                                              const void* w, int64_t p0, int64_t p1, float* y) {
  edgelin_panels(x, M, K, N, w, 1, p0, p1, y);
}
#endif

void edgelin_weight_panels(const float* x, int64_t M, int64_t K, int64_t N, const void* weights, int half,
                           int64_t p0, int64_t p1, float* y) {
#if defined(__x86_64__) || defined(_M_X64)
  if (edgelin_avx2()) {  /* each width its own specialisation of the inlined loops */
    if (half) {
      f16_avx2(x, M, K, N, weights, p0, p1, y);
    } else {
      f32_avx2(x, M, K, N, weights, p0, p1, y);
    }
    return;
  }
#endif
#if defined(__aarch64__)
  if (edgelin_arm() != EDGELIN_ARM_NONE) {
    edgelin_neon_panels(x, M, K, N, weights, half, p0, p1, y);
    return;
  }
#endif
  edgelin_panels_portable(x, M, K, N, weights, half, p0, p1, y);
}
