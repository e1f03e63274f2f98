/* The AVX2 path (no VNNI) of the 4-bit and 8-bit products for several tokens (nbits_grouped.c): private to
   q4_gemm.c and q8_gemm.c, whose scratch (each token's one-token blocks in natural order, edgelin_q8_quantize)
   it reads. */
#ifndef EDGELIN_NBITS_GROUPED_H
#define EDGELIN_NBITS_GROUPED_H
#include <stdint.h>

/* 1: M tokens take the grouped path on this CPU (AVX2, no VNNI tiles, enough tokens to pay for the packing). */
int edgelin_grouped(int64_t M);

/* y [M, N] gets rows n0 <= n < n1 of every token for `bits` 4 or 8: 0, or -1 when the buffer of packed codes could
   not be allocated (y then incomplete). */
int edgelin_rows_grouped(int bits, const void* scratch, int64_t M, int64_t K, const uint8_t* weights,
                         const float* scales, const uint8_t* zero_points, int64_t n0, int64_t n1, float* y,
                         int64_t N);
#endif
