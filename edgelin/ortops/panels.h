/* edgelin's weight products on packed panels: float32 activations x [M, K] by a weight W [K, N] stored as column
   panels [P, K, 16] (P = ceil(N / 16); panel p holds columns 16p .. 16p + 15 of W, zeros past N), float32 or (`half`) IEEE
   float16 (widened as it is read: --quantize fp16), read straight from the export's mapped weights file. Each
   writes y[:, 16 p0 : min(16 p1, N)] (y [M, N], row stride N) for the panels p0 <= p < p1: a task's slice of the
   columns, whatever M (a token at a time down each panel for decoding, register tiles of 6 tokens for a prefill
   piece). */
#ifndef EDGELIN_PANELS_H
#define EDGELIN_PANELS_H
#include <stddef.h>
#include <stdint.h>

#include "cpu.h"

EDGELIN_API void edgelin_weight_panels(const float* x, int64_t M, int64_t K, int64_t N, const void* weights,
                                       int half, int64_t p0, int64_t p1, float* y);
#endif
