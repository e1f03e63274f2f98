/* edgelin's depthwise causal conv with its carried state, SiLU fused: one decoding step of a short conv (Mamba2,
   Gated DeltaNet), what com.microsoft::CausalConvWithState computes for ndim 1, activation silu. */
#ifndef EDGELIN_CONV_H
#define EDGELIN_CONV_H
#include <stddef.h>
#include <stdint.h>

#include "cpu.h"

/* For each of B sequences and C channels, with the window xs = (state[b, c, 0:W-1], x[b, c, 0:T]):
   y[b, c, t] = silu(bias[c] + sum_j weight[c, j] xs[t + j]), new_state[b, c] = xs[T:T+W-1].
   x, y [B, C, T]; weight [C, W]; bias [C] or NULL; state, new_state [B, C, W-1] (may be one buffer: each
   channel's window is read before its new state is written). W <= 64. */
EDGELIN_API void edgelin_conv_silu(const float* x, const float* weight, const float* bias, const float* state,
                                   int64_t B, int64_t C, int64_t T, int64_t W, float* y, float* new_state);
/* z = silu(z) over n values in place: the conv's SiLU (AVX2: 8 lanes of a polynomial exp), also SiluGate's. */
void edgelin_silu(float* z, int64_t n);
#endif
