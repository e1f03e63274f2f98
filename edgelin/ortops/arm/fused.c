/* The step's fused ops on NEON (see neon.h): the SiLU over a row of channels (conv.c, ops_mlp.c, ops_ssd.c), one
   head's linear-attention step (linear_attention.c: each state row read and written once, the readout accumulated
   on the way) and a piece of the static-cache decode attention (attention.c: one kv head's chunk of keys and values
   streamed once for all its query heads, the softmax kept online). The AVX2 loops, in 4-float registers; e^x by
   the same polynomial as simd_exp.h. */
#if defined(__aarch64__)
#include <arm_neon.h>
#include <math.h>
#include <string.h>

#include "../attention.h"
#include "../linear_attention.h"
#include "neon.h"

#define INLINE __attribute__((always_inline)) static inline

/* e^x, x clamped to [-87.3, 88.7], relative error ~1e-7: x = n ln2 + r, |r| <= ln2 / 2, e^r by its degree-6 Taylor
   polynomial, 2^n through the exponent bits (simd_exp.h's edgelin_exp8, 4 lanes) */
INLINE float32x4_t exp4(float32x4_t x) {
  x = vminq_f32(vmaxq_f32(x, vdupq_n_f32(-87.3f)), vdupq_n_f32(88.7f));
  float32x4_t n = vrndnq_f32(vmulq_n_f32(x, 1.44269504089f));
  float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693145751953125f));  /* ln2 in two parts: exact n * hi */
  r = vfmsq_f32(r, n, vdupq_n_f32(1.428606765330187e-06f));
  float32x4_t p = vdupq_n_f32(1.0f / 720);
  p = vfmaq_f32(vdupq_n_f32(1.0f / 120), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f / 24), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f / 6), p, r);
  p = vfmaq_f32(vdupq_n_f32(0.5f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
  int32x4_t bits = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
  return vmulq_f32(p, vreinterpretq_f32_s32(bits));
}

void edgelin_neon_silu(float* z, int64_t n) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    float32x4_t v = vld1q_f32(z + i);
    vst1q_f32(z + i, vdivq_f32(v, vaddq_f32(vdupq_n_f32(1.0f), exp4(vnegq_f32(v)))));
  }
  for (; i < n; ++i) z[i] = z[i] / (1.0f + expf(-z[i]));
}

/* Columns [4 c0, 4 (c0 + Q)) of one head's step (Q <= 4 quads, a constant where inlined: one 64-byte line of a state
   row): the state's rows streamed once with the Q quads' readout and u in registers, four rows per pass (their k,
   q and decay read as one vector each). a: the rows' decays (1 ungated), u: the head's update values. */
INLINE void head_columns(const float* q, const float* k, const float* a, const float* u, const float* src, float* dst,
                         int64_t dk, int64_t dv, int64_t c0, int Q, float scale, float* o) {
  float32x4_t uc[4], out[4];
  for (int j = 0; j < Q; ++j) {
    uc[j] = vld1q_f32(u + 4 * (c0 + j));
    out[j] = vdupq_n_f32(0.0f);
  }
  int64_t i = 0;
  for (; i + 4 <= dk; i += 4) {
    float32x4_t kv = vld1q_f32(k + i), qv = vld1q_f32(q + i), av = vld1q_f32(a + i);
#define EDGELIN_HEAD_ROW(lane)                                                                               \
    for (int j = 0; j < Q; ++j) {                                                                              \
      int64_t at = (i + lane) * dv + 4 * (c0 + j);                                                             \
      float32x4_t s = vfmaq_laneq_f32(vmulq_laneq_f32(uc[j], kv, lane), vld1q_f32(src + at), av, lane);      \
      vst1q_f32(dst + at, s);                                                                                  \
      out[j] = vfmaq_laneq_f32(out[j], s, qv, lane);                                                           \
    }
    EDGELIN_HEAD_ROW(0)
    EDGELIN_HEAD_ROW(1)
    EDGELIN_HEAD_ROW(2)
    EDGELIN_HEAD_ROW(3)
#undef EDGELIN_HEAD_ROW
  }
  for (; i < dk; ++i)
    for (int j = 0; j < Q; ++j) {
      int64_t at = i * dv + 4 * (c0 + j);
      float32x4_t s = vfmaq_n_f32(vmulq_n_f32(uc[j], k[i]), vld1q_f32(src + at), a[i]);
      vst1q_f32(dst + at, s);
      out[j] = vfmaq_n_f32(out[j], s, q[i]);
    }
  for (int j = 0; j < Q; ++j) vst1q_f32(o + 4 * (c0 + j), vmulq_n_f32(out[j], scale));
}

/* u's columns [4 c0, 4 (c0 + Q)) for the delta rules: beta (v - (a S)^T k), ak = a k per row */
INLINE void delta_columns(const float* v, const float* ak, float beta, const float* src, int64_t dk, int64_t dv,
                          int64_t c0, int Q, float* u) {
  float32x4_t acc[4];
  for (int j = 0; j < Q; ++j) acc[j] = vdupq_n_f32(0.0f);
  for (int64_t i = 0; i < dk; ++i)
    for (int j = 0; j < Q; ++j) acc[j] = vfmaq_n_f32(acc[j], vld1q_f32(src + i * dv + 4 * (c0 + j)), ak[i]);
  for (int j = 0; j < Q; ++j)
    vst1q_f32(u + 4 * (c0 + j), vmulq_n_f32(vsubq_f32(vld1q_f32(v + 4 * (c0 + j)), acc[j]), beta));
}

void edgelin_neon_linear_head(int rule, const float* q, const float* k, const float* v, const float* g, int64_t gw,
                              float beta, const float* src, float* dst, int64_t dk, int64_t dv, float scale,
                              float* o, float* u) {
  int gated = rule == EDGELIN_RULE_GATED || rule == EDGELIN_RULE_GATED_DELTA;
  int delta = rule == EDGELIN_RULE_DELTA || rule == EDGELIN_RULE_GATED_DELTA;
  float a[256], ak[256];  /* dk <= 256 (linear_attention.c's condition for this path) */
  float a_head = gated && gw == 1 ? expf(g[0]) : 1.0f;
  for (int64_t i = 0; i < dk; ++i) {
    a[i] = gated && gw != 1 ? expf(g[i]) : a_head;
    ak[i] = a[i] * k[i];
  }
  int64_t quads = dv / 4, c0 = 0;
  if (delta) {  /* u = beta (v - (a S)^T k) with the old state, all of it before any row is written */
    for (; c0 + 4 <= quads; c0 += 4) delta_columns(v, ak, beta, src, dk, dv, c0, 4, u);
    for (; c0 < quads; ++c0) delta_columns(v, ak, beta, src, dk, dv, c0, 1, u);
  } else {
    memcpy(u, v, sizeof(float) * (size_t)dv);
  }
  for (c0 = 0; c0 + 4 <= quads; c0 += 4) head_columns(q, k, a, u, src, dst, dk, dv, c0, 4, scale, o);
  for (; c0 < quads; ++c0) head_columns(q, k, a, u, src, dst, dk, dv, c0, 1, scale, o);
}

/* 4 cached values from element `index` on: float32, or float16 widened */
INLINE float32x4_t load4(const void* base, int64_t index, int half) {
  return half ? vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t*)base + index)))
              : vld1q_f32((const float*)base + index);
}

/* s[j] = q . K[j] for the n rows from element `base` on; returns their max. D a multiple of 4. */
INLINE float scores(const float* q, const void* K, int half, int64_t base, int64_t n, int64_t D, float* s) {
  float best = -INFINITY;
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    int64_t r = base + j * D;
    float32x4_t a0 = vdupq_n_f32(0.0f), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t c = 0; c < D; c += 4) {
      float32x4_t x = vld1q_f32(q + c);
      a0 = vfmaq_f32(a0, load4(K, r + c, half), x);
      a1 = vfmaq_f32(a1, load4(K, r + D + c, half), x);
      a2 = vfmaq_f32(a2, load4(K, r + 2 * D + c, half), x);
      a3 = vfmaq_f32(a3, load4(K, r + 3 * D + c, half), x);
    }
    float32x4_t sums = vpaddq_f32(vpaddq_f32(a0, a1), vpaddq_f32(a2, a3));
    vst1q_f32(s + j, sums);
    float top = vmaxvq_f32(sums);
    best = top > best ? top : best;
  }
  for (; j < n; ++j) {
    float32x4_t a = vdupq_n_f32(0.0f);
    for (int64_t c = 0; c < D; c += 4) a = vfmaq_f32(a, load4(K, base + j * D + c, half), vld1q_f32(q + c));
    s[j] = vaddvq_f32(a);
    best = s[j] > best ? s[j] : best;
  }
  return best;
}

/* s[j] -> e^(s[j] - m); returns their sum */
INLINE float exp_sum(float* s, int64_t n, float m) {
  float32x4_t total = vdupq_n_f32(0.0f), shift = vdupq_n_f32(m);
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    float32x4_t p = exp4(vsubq_f32(vld1q_f32(s + j), shift));
    vst1q_f32(s + j, p);
    total = vaddq_f32(total, p);
  }
  float sum = vaddvq_f32(total);
  for (; j < n; ++j) sum += s[j] = expf(s[j] - m);
  return sum;
}

/* acc[0 .. 4 quads) = keep * acc + sum_j p[j] V[j, col ..]: `quads` (<= 16) accumulators in registers over the rows */
INLINE void weighted_rows(const float* p, const void* V, int half, int64_t col, int64_t n, int64_t D, float keep,
                          float* acc, int quads) {
  float32x4_t a[16];
  for (int c = 0; c < quads; ++c) a[c] = vmulq_n_f32(vld1q_f32(acc + 4 * c), keep);
  for (int64_t j = 0; j < n; ++j)
    for (int c = 0; c < quads; ++c) a[c] = vfmaq_n_f32(a[c], load4(V, j * D + col + 4 * c, half), p[j]);
  for (int c = 0; c < quads; ++c) vst1q_f32(acc + 4 * c, a[c]);
}

INLINE void weighted(const float* p, const void* V, int half, int64_t base, int64_t n, int64_t D, float keep,
                     float* acc) {
  for (int64_t c0 = 0; c0 < D; c0 += 64) {  /* 64 columns at a time: 16 registers of accumulators */
    int64_t quads = (D - c0) / 4 < 16 ? (D - c0) / 4 : 16;
    if (quads == 16) {
      weighted_rows(p, V, half, base + c0, n, D, keep, acc + c0, 16);
    } else if (quads >= 8) {
      weighted_rows(p, V, half, base + c0, n, D, keep, acc + c0, 8);
      weighted_rows(p, V, half, base + c0 + 32, n, D, keep, acc + c0 + 32, (int)quads - 8);
    } else {
      weighted_rows(p, V, half, base + c0, n, D, keep, acc + c0, (int)quads);
    }
  }
}

INLINE void part(const float* qs, const void* K, const void* V, int half, int64_t n_rows, int64_t G, int64_t D,
                 float* s, float* partial) {
  int64_t chunk = edgelin_attention_chunk_rows(D);
  for (int64_t c0 = 0; c0 < n_rows; c0 += chunk) {
    int64_t n = n_rows - c0 < chunk ? n_rows - c0 : chunk;
    for (int64_t h = 0; h < G; ++h) {  /* the chunk's keys and values stay in L2 for the group's next heads */
      float *m = partial + h * (D + 2), *l = m + 1;
      float keep = edgelin_attention_rescale(m, l, scores(qs + h * D, K, half, c0 * D, n, D, s));
      *l += exp_sum(s, n, *m);
      weighted(s, V, half, c0 * D, n, D, keep, m + 2);
    }
  }
}

void edgelin_neon_attention_part(const float* qs, const void* K, const void* V, int half, int64_t n_rows, int64_t G,
                                 int64_t D, float* s, float* partial) {
  if (half) {
    part(qs, K, V, 1, n_rows, G, D, s, partial);
  } else {
    part(qs, K, V, 0, n_rows, G, D, s, partial);
  }
}
#endif
