/* edgelin's linear-attention step (see linear_attention.h). ONNX Runtime's LinearAttention takes ~18 us per
   Mamba2 peer layer (12 heads of 64 x 64 float32 state, 384 KiB read and written) on a Zen 3 core, ~21 GB/s;
   here each state row is read once and written once in the same pass (twice read for the delta rules, whose
   S^T k needs the whole old state first), 8 columns per AVX2 lane group, the readout accumulated on the way. */
#include "linear_attention.h"
#include "arm/neon.h"

#include <math.h>
#include <string.h>

/* One head, one token: S [dk, dv] (src -> dst, which may be the same memory). */
static void head_portable(int rule, const float* q, const float* k, const float* v, const float* g, int64_t gw,
                          float beta, const float* src, float* dst, int64_t dk, int64_t dv, float scale, float* o,
                          float* u) {
  int gated = rule == EDGELIN_RULE_GATED || rule == EDGELIN_RULE_GATED_DELTA;
  int delta = rule == EDGELIN_RULE_DELTA || rule == EDGELIN_RULE_GATED_DELTA;
  for (int64_t j = 0; j < dv; ++j) u[j] = v[j];
  if (delta) {  /* u = beta (v - (a S)^T k) with the old state */
    for (int64_t j = 0; j < dv; ++j) {
      float acc = 0.0f;
      for (int64_t i = 0; i < dk; ++i) acc += (gated ? expf(g[gw == 1 ? 0 : i]) : 1.0f) * src[i * dv + j] * k[i];
      u[j] = beta * (v[j] - acc);
    }
  }
  for (int64_t j = 0; j < dv; ++j) o[j] = 0.0f;
  for (int64_t i = 0; i < dk; ++i) {
    float a = gated ? expf(g[gw == 1 ? 0 : i]) : 1.0f;
    for (int64_t j = 0; j < dv; ++j) {
      float s = a * src[i * dv + j] + k[i] * u[j];
      dst[i * dv + j] = s;
      o[j] += q[i] * s;
    }
  }
  for (int64_t j = 0; j < dv; ++j) o[j] *= scale;
}

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2,fma")))

/* dv a multiple of 8, at most 256 (32 lane groups) */
AVX2 static void head_avx2(int rule, const float* q, const float* k, const float* v, const float* g, int64_t gw,
                           float beta, const float* src, float* dst, int64_t dk, int64_t dv, float scale, float* o,
                           float* u) {
  int gated = rule == EDGELIN_RULE_GATED || rule == EDGELIN_RULE_GATED_DELTA;
  int delta = rule == EDGELIN_RULE_DELTA || rule == EDGELIN_RULE_GATED_DELTA;
  int64_t groups = dv / 8;
  float a_head = gated && gw == 1 ? expf(g[0]) : 1.0f;
  if (delta) {
    __m256 acc[32];
    for (int64_t c = 0; c < groups; ++c) acc[c] = _mm256_setzero_ps();
    for (int64_t i = 0; i < dk; ++i) {
      float a = gated ? (gw == 1 ? a_head : expf(g[i])) : 1.0f;
      __m256 ak = _mm256_set1_ps(a * k[i]);
      for (int64_t c = 0; c < groups; ++c) acc[c] = _mm256_fmadd_ps(ak, _mm256_loadu_ps(src + i * dv + 8 * c), acc[c]);
    }
    __m256 b = _mm256_set1_ps(beta);
    for (int64_t c = 0; c < groups; ++c)
      _mm256_storeu_ps(u + 8 * c, _mm256_mul_ps(b, _mm256_sub_ps(_mm256_loadu_ps(v + 8 * c), acc[c])));
  } else {
    memcpy(u, v, sizeof(float) * (size_t)dv);
  }
  __m256 out[32];
  for (int64_t c = 0; c < groups; ++c) out[c] = _mm256_setzero_ps();
  for (int64_t i = 0; i < dk; ++i) {
    __m256 a = _mm256_set1_ps(gated ? (gw == 1 ? a_head : expf(g[i])) : 1.0f);
    __m256 ki = _mm256_set1_ps(k[i]), qi = _mm256_set1_ps(q[i]);
    for (int64_t c = 0; c < groups; ++c) {
      __m256 s = _mm256_fmadd_ps(a, _mm256_loadu_ps(src + i * dv + 8 * c), _mm256_mul_ps(ki, _mm256_loadu_ps(u + 8 * c)));
      _mm256_storeu_ps(dst + i * dv + 8 * c, s);
      out[c] = _mm256_fmadd_ps(qi, s, out[c]);
    }
  }
  __m256 sc = _mm256_set1_ps(scale);
  for (int64_t c = 0; c < groups; ++c) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(sc, out[c]));
}

#endif

void edgelin_linear_attention(int rule, const float* q, const float* k, const float* v, const float* decay,
                              int64_t gw, const float* beta, const float* state, int64_t B, int64_t T, int64_t Hq,
                              int64_t H, int64_t dk, int64_t dv, float scale, float* out, float* new_state,
                              int64_t first, int64_t count) {
  float u[1024];  /* dv <= 1024 (checked by the caller) */
  int64_t group = H / Hq, size = dk * dv;
#if defined(__x86_64__) || defined(_M_X64)
  int vector = edgelin_avx2() && dv % 8 == 0 && dv <= 256;
#endif
#if defined(__aarch64__)
  int neon = edgelin_arm() != EDGELIN_ARM_NONE && dv % 4 == 0 && dv <= 256 && dk <= 256;
#endif
  for (int64_t pair = first; pair < first + count && pair < B * H; ++pair) {
    int64_t b = pair / H, h = pair % H;
    for (int64_t t = 0; t < T; ++t) {
      int64_t row = b * T + t;
      const float* qh = q + (row * Hq + h / group) * dk;
      const float* kh = k + (row * H + h) * dk;
      const float* vh = v + (row * H + h) * dv;
      const float* gh = decay ? decay + (row * H + h) * gw : NULL;
      float rate = beta ? beta[row * H + h] : 1.0f;
      const float* src = t == 0 ? state + pair * size : new_state + pair * size;
      float* dst = new_state + pair * size;
      float* oh = out + (row * H + h) * dv;
#if defined(__x86_64__) || defined(_M_X64)
      if (vector) {
        head_avx2(rule, qh, kh, vh, gh, gw, rate, src, dst, dk, dv, scale, oh, u);
        continue;
      }
#endif
#if defined(__aarch64__)
      if (neon) {
        edgelin_neon_linear_head(rule, qh, kh, vh, gh, gw, rate, src, dst, dk, dv, scale, oh, u);
        continue;
      }
#endif
      head_portable(rule, qh, kh, vh, gh, gw, rate, src, dst, dk, dv, scale, oh, u);
    }
  }
}
