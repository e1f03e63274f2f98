/* edgelin's aarch64 kernels: NEON (every ARMv8-A CPU), with dotprod (SDOT) and i8mm (USMMLA) where the CPU has them
   (cpu.h's levels). The generic files dispatch here when edgelin_arm() names a level (panels.c, f32_gemv.c,
   f16_gemm.c, q4_gemv.c, q8_gemv.c); each function keeps the contract of the one that calls it, and the portable C
   path beside that caller is its tested reference (tests/ortops/test_isa_paths.py, run for every level under
   qemu by the ARM tier: .ci/arm/run). Not part of the library's interface. */
#ifndef EDGELIN_ARM_NEON_H
#define EDGELIN_ARM_NEON_H
#include <stddef.h>
#include <stdint.h>

#if defined(__aarch64__)
/* panels.h's product: packed column panels [P, K, 16], float32 or (`half`) float16 weights (panels.c) */
void edgelin_neon_panels(const float* x, int64_t M, int64_t K, int64_t N, const void* w, int half, int64_t p0,
                         int64_t p1, float* y);
/* rows_kernel.h's product: W [K, N] (ONNX's layout), rows k0 <= k < k1, y [M, N] written (f32_gemv.c, f16_gemm.c) */
void edgelin_neon_rows(const float* x, int64_t M, int64_t K, int64_t N, const void* w, int half, int64_t k0,
                       int64_t k1, float* y);
/* q4_gemv.h's and q8_gemv.h's one-token products, per level (qdot.h, instantiated by qdot_neon.c and
   qdot_dotprod.c; i8mm takes dotprod's) */
typedef void (*EdgelinArmRows)(const void* scratch, int64_t K, const uint8_t* weights, const float* scales,
                               const uint8_t* zero_points, int64_t n0, int64_t n1, float* y);
void edgelin_neon_q4_rows(const void*, int64_t, const uint8_t*, const float*, const uint8_t*, int64_t, int64_t,
                          float*);
void edgelin_neon_q8_rows(const void*, int64_t, const uint8_t*, const float*, const uint8_t*, int64_t, int64_t,
                          float*);
void edgelin_dotprod_q4_rows(const void*, int64_t, const uint8_t*, const float*, const uint8_t*, int64_t, int64_t,
                             float*);
void edgelin_dotprod_q8_rows(const void*, int64_t, const uint8_t*, const float*, const uint8_t*, int64_t, int64_t,
                             float*);
/* The step's fused ops (fused.c): conv.c's SiLU over a row, linear_attention.c's one head (dv a multiple of 4, dv
   and dk at most 256), attention.c's piece of one kv head (D a multiple of 4) */
void edgelin_neon_silu(float* z, int64_t n);
void edgelin_neon_linear_head(int rule, const float* q, const float* k, const float* v, const float* g, int64_t gw,
                              float beta, const float* src, float* dst, int64_t dk, int64_t dv, float scale,
                              float* o, float* u);
void edgelin_neon_attention_part(const float* qs, const void* K, const void* V, int half, int64_t n_rows, int64_t G,
                                 int64_t D, float* s, float* partial);
/* q4_gemm.c's / q8_gemm.c's M tokens (M >= 2) with USMMLA (tokens_i8mm.c): `bits` 4 or 8, the one-token scratches
   `stride` bytes apart; 0, or -1 when its buffer could not be allocated (y then incomplete) */
int edgelin_i8mm_rows_tokens(int bits, const void* scratch, size_t stride, int64_t M, int64_t K,
                             const uint8_t* weights, const float* scales, const uint8_t* zero_points, int64_t n0,
                             int64_t n1, float* y, int64_t N);
/* The level's one-token product (bits 4 or 8), NULL below EDGELIN_ARM_NEON: the portable path. */
EdgelinArmRows edgelin_arm_rows(int bits, int level);
#endif
#endif
