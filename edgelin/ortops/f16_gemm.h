/* edgelin's products of float32 activations by float16 weights (--quantize fp16: weight-only float16 storage,
   float32 arithmetic) on ONNX's MatMul layout as stored by exports made before the packed panels (panels.h):
   weights [K, N] row-major IEEE half, read straight from the export's mapped weights file (no float32 copy). */
#ifndef EDGELIN_F16_GEMM_H
#define EDGELIN_F16_GEMM_H
#include <stddef.h>
#include <stdint.h>

#include "cpu.h"

/* Decoding (M small): y[m, :] = sum over k0 <= k < k1 of x[m, k] W[k, :] for M rows of x ([M, K], row stride K)
   into y ([M, N], row stride N), written (not accumulated): one slice of K's rows, one contiguous piece of W. */
EDGELIN_API void edgelin_f16_rows(const float* x, int64_t M, int64_t K, int64_t N, const uint16_t* weights,
                                  int64_t k0, int64_t k1, float* y);
/* A prefill piece (M tokens): y[:, n0:n1] = x W[:, n0:n1], written, for a slice of W's columns; register tiles of
   6 tokens x 16 columns over all of K. */
EDGELIN_API void edgelin_f16_cols(const float* x, int64_t M, int64_t K, int64_t N, const uint16_t* weights,
                                  int64_t n0, int64_t n1, float* y);
#endif
