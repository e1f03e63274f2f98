/* edgelin's 4-bit weight products (one-token decoding, and the prefill's pieces), on ONNX Runtime's MatMulNBits
   layout as it is stored (no repacking, no second copy of the weights): weights [N, nb, 16] bytes, nb = ceil(K / 32)
   blocks per row, element 2j in byte j's low nibble and 2j+1 in its high one. */
#ifndef EDGELIN_Q4_GEMV_H
#define EDGELIN_Q4_GEMV_H
#include <stddef.h>
#include <stdint.h>

#include "cpu.h"

/* Bytes of scratch for K inputs: the int8 activation blocks and their scales. */
EDGELIN_API size_t edgelin_q4_scratch_bytes(int64_t K);

/* One row of x into `scratch`: int8 per 32-block (scale max|x| / 127, rounded to nearest even), as MatMulNBits'
   accuracy level 4 does. Then y[n0:n1] = x . W[n] for rows n0 <= n < n1 (any slice of rows reads the same
   scratch), W[n, k] = (q[n, k] - zero point[n, b]) * scale[n, b]: zero points (NULL: 8) packed two per byte as
   MatMulNBits stores them (low nibble first, ceil(nb / 2) bytes per row), read as they are (no float offsets
   array: 4 bits per block instead of 32 read per decoded token, 1 bit per weight less of memory traffic). */
EDGELIN_API void edgelin_q4_quantize(const float* x, int64_t K, void* scratch);
EDGELIN_API void edgelin_q4_rows(const void* scratch, int64_t K, const uint8_t* weights, const float* scales,
                                 const uint8_t* zero_points, int64_t n0, int64_t n1, float* y);

/* M tokens at once (a prefill piece, or a batch; q4_gemm.c): edgelin_q4_quantize_tokens fills `scratch`
   (edgelin_q4_tokens_scratch_bytes(M, K) bytes; the layout is the kernel's: with AVX-512 VNNI the 8-bit product's
   token tiles) from x [M, K] (the same int8 blocks as edgelin_q4_quantize); then y [M, N] gets rows n0 <= n < n1
   of every token, any slice of rows from the same scratch: 0, or -1 when the buffer of unpacked codes could not be
   allocated (y then incomplete). The same integer dots as edgelin_q4_rows; the float sums may run in another
   order. */
EDGELIN_API size_t edgelin_q4_tokens_scratch_bytes(int64_t M, int64_t K);
EDGELIN_API void edgelin_q4_quantize_tokens(const float* x, int64_t M, int64_t K, void* scratch);
EDGELIN_API int edgelin_q4_rows_tokens(const void* scratch, int64_t M, int64_t K, const uint8_t* weights,
                                       const float* scales, const uint8_t* zero_points, int64_t n0, int64_t n1,
                                       float* y, int64_t N);
#endif
