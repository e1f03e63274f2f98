/* edgelin's 8-bit weight products (one-token decoding, and the prefill's pieces), on ONNX Runtime's MatMulNBits
   layout as it is stored (bits 8, block 32; no repacking, no second copy of the weights): weights [N, nb, 32]
   bytes, nb = ceil(K / 32) blocks per row, one unsigned code per byte; scales [N, nb]; zero points [N, nb], one
   byte per block (NULL: 128). W[n, k] = (q[n, k] - zero point[n, b]) * scale[n, b].

   ONNX Runtime's own 8-bit MatMulNBits prepacks a private copy of these weights in every session that holds them
   (the step's and the prefill's); this one reads the mapped weights file, so both graphs share one copy. The
   activations are rounded to int8 per 32-block as MatMulNBits' accuracy level 4 does (edgelin_q8_quantize: the
   4-bit product's blocks, in natural order); the scratch is edgelin_q4_scratch_bytes(K) bytes per token. */
#ifndef EDGELIN_Q8_GEMV_H
#define EDGELIN_Q8_GEMV_H
#include <stddef.h>
#include <stdint.h>

#include "cpu.h"

EDGELIN_API void edgelin_q8_quantize(const float* x, int64_t K, void* scratch);
/* y[n0:n1] = x . W[n] for rows n0 <= n < n1 (any slice of rows reads the same scratch). */
EDGELIN_API void edgelin_q8_rows(const void* scratch, int64_t K, const uint8_t* weights, const float* scales,
                                 const uint8_t* zero_points, int64_t n0, int64_t n1, float* y);
/* M tokens (a prefill piece, or a batch; q8_gemm.c): edgelin_q8_quantize_tokens fills `scratch`
   (edgelin_q8_tokens_scratch_bytes(M, K) bytes; the layout is the kernel's) from x [M, K] (the same int8 blocks as
   edgelin_q8_quantize); then y [M, N] gets rows n0 <= n < n1 of every token, any slice of rows from the same
   scratch. The same integer dots as edgelin_q8_rows; the float sums may run in another order. */
EDGELIN_API size_t edgelin_q8_tokens_scratch_bytes(int64_t M, int64_t K);
/* 1: M tokens take the 16-token tiles (AVX-512 VNNI, M > 1), whose scratch layout the 4-bit product shares. */
int edgelin_token_tiles(int64_t M);
EDGELIN_API void edgelin_q8_quantize_tokens(const float* x, int64_t M, int64_t K, void* scratch);
EDGELIN_API int edgelin_q8_rows_tokens(const void* scratch, int64_t M, int64_t K, const uint8_t* weights,
                                        const float* scales, const uint8_t* zero_points, int64_t n0, int64_t n1,
                                        float* y, int64_t N);
#endif
