/* edgelin's linear-attention recurrence, one token at a time: what com.microsoft::LinearAttention computes (update
   rules linear, gated, delta, gated_delta; decay per head or per key; query heads grouped over the value heads). */
#ifndef EDGELIN_LINEAR_ATTENTION_H
#define EDGELIN_LINEAR_ATTENTION_H
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "cpu.h"

enum { EDGELIN_RULE_LINEAR = 0, EDGELIN_RULE_GATED = 1, EDGELIN_RULE_DELTA = 2, EDGELIN_RULE_GATED_DELTA = 3 };

/* q [B, T, Hq * dk], k [B, T, H * dk], v [B, T, H * dv]; decay [B, T, H * gw] (gw = 1 or dk; NULL for the
   ungated rules), beta [B, T, H] (NULL for the rules without delta); state, new_state [B, H, dk, dv] (may be one
   buffer); out [B, T, H * dv]. Value head h reads query head h / (H / Hq). For each token, in order:
   S = exp(g) S (gated rules; per key: row i scaled by exp(g_i)); u = beta (v - S^T k) (delta rules) else v;
   S += k u^T; out = scale S^T q. Only the (sequence, head) pairs first <= b * H + h < first + count: the
   heads are independent, so threads may take disjoint ranges. */
EDGELIN_API void edgelin_linear_attention(int rule, const float* q, const float* k, const float* v,
                                          const float* decay, int64_t gw, const float* beta, const float* state,
                                          int64_t B, int64_t T, int64_t Hq, int64_t H, int64_t dk, int64_t dv,
                                          float scale, float* out, float* new_state, int64_t first, int64_t count);

/* ONNX Runtime's Softplus: log1p(exp(-|x|)) + max(x, 0), exact for large x too (the fused ops' decay path). */
static inline float edgelin_softplus(float x) { return log1pf(expf(-fabsf(x))) + (x > 0.0f ? x : 0.0f); }
#endif
