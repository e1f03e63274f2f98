/* edgelin's float32 weight products for one-token decoding (M small), on ONNX's MatMul layout as stored: weights
   [K, N] row-major, read straight from the export's mapped weights file (no packed second copy). */
#ifndef EDGELIN_F32_GEMV_H
#define EDGELIN_F32_GEMV_H
#include <stddef.h>
#include <stdint.h>

#include "cpu.h"

/* y[m, :] = sum over k0 <= k < k1 of x[m, k] W[k, :] for M rows of x ([M, K], row stride K) into y ([M, N], row
   stride N), written (not accumulated): one slice of K's rows, so that a task streams one contiguous piece of W. */
EDGELIN_API void edgelin_f32_rows(const float* x, int64_t M, int64_t K, int64_t N, const float* weights,
                                  int64_t k0, int64_t k1, float* y);
#endif
