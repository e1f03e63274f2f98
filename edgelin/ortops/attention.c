/* edgelin's decode attention (see attention.h). ONNX Runtime's CPU GroupQueryAttention runs each query head on its
   own (a GEMV over the keys, a softmax, a GEMV over the values), so with G query heads per kv head it reads the
   cache G times. Here one task streams a piece of one kv head's keys and values once, in chunks small enough to
   stay in L2 while the group's heads use them, with the softmax kept online (running max and sum) across chunks
   and, through edgelin_attention_merge, across pieces. */
#include "attention.h"
#include "arm/neon.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* IEEE binary16 <-> float, round to nearest even (the fp16 cache's query, new rows and output; the AVX2 path
   converts the cached rows 8 at a time with F16C). */
float edgelin_half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
  if (exponent == 0) {  /* zero or subnormal: mantissa * 2^-24 */
    float f = ldexpf((float)mantissa, -24);
    return sign ? -f : f;
  }
  bits = exponent == 31 ? sign | 0x7f800000u | (mantissa << 13) : sign | ((exponent + 112) << 23) | (mantissa << 13);
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

uint16_t edgelin_float_to_half(float value) {
  uint32_t x;
  memcpy(&x, &value, sizeof x);
  uint32_t sign = (x >> 16) & 0x8000u, magnitude = x & 0x7fffffffu;
  if (magnitude >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (magnitude > 0x7f800000u ? 0x200u : 0u));
  if (magnitude >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  /* >= 65520 rounds to infinity */
  if (magnitude < 0x38800000u) {  /* below 2^-14: a subnormal half, round(|x| * 2^24) (exact scaling) */
    float scaled;
    memcpy(&scaled, &magnitude, sizeof scaled);
    return (uint16_t)(sign | (uint32_t)lrintf(scaled * 16777216.0f));
  }
  uint32_t half = ((magnitude >> 23) - 112) << 10 | (magnitude & 0x7fffffu) >> 13, rest = magnitude & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) half += 1;  /* a carry into the exponent is right */
  return (uint16_t)(sign | half);
}

static float element(const void* base, int64_t index, int half) {
  return half ? edgelin_half_to_float(((const uint16_t*)base)[index]) : ((const float*)base)[index];
}

/* Rows per chunk: ~64 KiB of keys, at least 16. */
int64_t edgelin_attention_chunk_rows(int64_t D) { return D >= 1024 ? 16 : 16384 / D; }

int64_t edgelin_attention_scratch_floats(int64_t G, int64_t D) { return G * D + edgelin_attention_chunk_rows(D); }

int64_t edgelin_attention_tasks(const EdgelinAttention* a) { return a->B * a->S * a->Hkv * a->splits; }

/* The chunk's softmax step for one head: s[0..n) -> e^(s - m'), with m' the new running max; the running sum and
   weighted values rescaled to m'. Returns the scale applied to the old values. */
float edgelin_attention_rescale(float* m, float* l, float chunk_max) {
  float next = chunk_max > *m ? chunk_max : *m;
  float keep = *m == -INFINITY ? 0.0f : expf(*m - next);
  *m = next;
  *l *= keep;
  return keep;
}

static void part_portable(const float* qs, const void* K, const void* V, int half, int64_t n_rows, int64_t G,
                          int64_t D, float* s, float* part) {
  int64_t chunk = edgelin_attention_chunk_rows(D);
  for (int64_t c0 = 0; c0 < n_rows; c0 += chunk) {
    int64_t n = n_rows - c0 < chunk ? n_rows - c0 : chunk;
    for (int64_t h = 0; h < G; ++h) {
      float *m = part + h * (D + 2), *l = m + 1, *acc = m + 2, top = -INFINITY;
      for (int64_t j = 0; j < n; ++j) {
        float dot = 0.0f;
        for (int64_t c = 0; c < D; ++c) dot += qs[h * D + c] * element(K, (c0 + j) * D + c, half);
        s[j] = dot;
        top = dot > top ? dot : top;
      }
      float keep = edgelin_attention_rescale(m, l, top);
      for (int64_t c = 0; c < D; ++c) acc[c] *= keep;
      for (int64_t j = 0; j < n; ++j) {
        float p = expf(s[j] - *m);
        *l += p;
        for (int64_t c = 0; c < D; ++c) acc[c] += p * element(V, (c0 + j) * D + c, half);
      }
    }
  }
}

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include "simd_exp.h"
#define AVX2 __attribute__((target("avx2,fma,f16c")))
#define INLINE_AVX2 __attribute__((target("avx2,fma,f16c"), always_inline)) static inline

/* 8 cached values from element `index` on: float32, or float16 widened by F16C. */
INLINE_AVX2 __m256 load8(const void* base, int64_t index, int half) {
  return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)base + index)))
              : _mm256_loadu_ps((const float*)base + index);
}

/* The eight lane sums of v0 .. v7, in order, in one register. */
INLINE_AVX2 __m256 sum8(__m256 v0, __m256 v1, __m256 v2, __m256 v3, __m256 v4, __m256 v5, __m256 v6, __m256 v7) {
  __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v0, v1), _mm256_hadd_ps(v2, v3));
  __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v4, v5), _mm256_hadd_ps(v6, v7));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

INLINE_AVX2 float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

/* s[j] = q . K[j] for the n rows from element `base` on; returns their max. D a multiple of 8. */
INLINE_AVX2 float scores(const float* q, const void* K, int half, int64_t base, int64_t n, int64_t D, float* s) {
  __m256 top = _mm256_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    int64_t r = base + j * D;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t c = 0; c < D; c += 8) {
      __m256 x = _mm256_loadu_ps(q + c);
      a0 = _mm256_fmadd_ps(load8(K, r + c, half), x, a0);
      a1 = _mm256_fmadd_ps(load8(K, r + D + c, half), x, a1);
      a2 = _mm256_fmadd_ps(load8(K, r + 2 * D + c, half), x, a2);
      a3 = _mm256_fmadd_ps(load8(K, r + 3 * D + c, half), x, a3);
      a4 = _mm256_fmadd_ps(load8(K, r + 4 * D + c, half), x, a4);
      a5 = _mm256_fmadd_ps(load8(K, r + 5 * D + c, half), x, a5);
      a6 = _mm256_fmadd_ps(load8(K, r + 6 * D + c, half), x, a6);
      a7 = _mm256_fmadd_ps(load8(K, r + 7 * D + c, half), x, a7);
    }
    __m256 sums = sum8(a0, a1, a2, a3, a4, a5, a6, a7);
    _mm256_storeu_ps(s + j, sums);
    top = _mm256_max_ps(top, sums);
  }
  __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  t = _mm_max_ps(t, _mm_movehl_ps(t, t));
  float best = _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
  for (; j < n; ++j) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t c = 0; c < D; c += 8) a = _mm256_fmadd_ps(load8(K, base + j * D + c, half), _mm256_loadu_ps(q + c), a);
    s[j] = hsum(a);
    best = s[j] > best ? s[j] : best;
  }
  return best;
}

/* s[j] -> e^(s[j] - m); returns their sum. */
AVX2 static float exp_sum(float* s, int64_t n, float m) {
  __m256 total = _mm256_setzero_ps(), shift = _mm256_set1_ps(m);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m256 p = edgelin_exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), shift));
    _mm256_storeu_ps(s + j, p);
    total = _mm256_add_ps(total, p);
  }
  float sum = hsum(total);
  for (; j < n; ++j) sum += s[j] = expf(s[j] - m);
  return sum;
}

/* acc[0 .. 8 groups) = keep * acc + sum_j p[j] V[j, col ..]: the groups' accumulators stay in registers over the rows. */
INLINE_AVX2 void weighted_rows(const float* p, const void* V, int half, int64_t col, int64_t n, int64_t D,
                               float keep, float* acc, int groups) {
  __m256 a[8], k = _mm256_set1_ps(keep);
  for (int c = 0; c < groups; ++c) a[c] = _mm256_mul_ps(k, _mm256_loadu_ps(acc + 8 * c));
  for (int64_t j = 0; j < n; ++j) {
    __m256 w = _mm256_broadcast_ss(p + j);
    for (int c = 0; c < groups; ++c) a[c] = _mm256_fmadd_ps(w, load8(V, j * D + col + 8 * c, half), a[c]);
  }
  for (int c = 0; c < groups; ++c) _mm256_storeu_ps(acc + 8 * c, a[c]);
}

INLINE_AVX2 void weighted(const float* p, const void* V, int half, int64_t base, int64_t n, int64_t D, float keep,
                          float* acc) {
  for (int64_t c0 = 0; c0 < D; c0 += 64) {  /* 64 columns at a time: 8 registers of accumulators */
    int64_t groups = (D - c0) / 8 < 8 ? (D - c0) / 8 : 8;
    switch (groups) {  /* constant group counts, so the accumulators stay in registers */
      case 8: weighted_rows(p, V, half, base + c0, n, D, keep, acc + c0, 8); break;
      case 7: weighted_rows(p, V, half, base + c0, n, D, keep, acc + c0, 7); break;
      case 6: weighted_rows(p, V, half, base + c0, n, D, keep, acc + c0, 6); break;
      case 5: weighted_rows(p, V, half, base + c0, n, D, keep, acc + c0, 5); break;
      case 4: weighted_rows(p, V, half, base + c0, n, D, keep, acc + c0, 4); break;
      case 3: weighted_rows(p, V, half, base + c0, n, D, keep, acc + c0, 3); break;
      case 2: weighted_rows(p, V, half, base + c0, n, D, keep, acc + c0, 2); break;
      default: weighted_rows(p, V, half, base + c0, n, D, keep, acc + c0, 1); break;
    }
  }
}

INLINE_AVX2 void part_avx2(const float* qs, const void* K, const void* V, int half, int64_t n_rows, int64_t G,
                           int64_t D, float* s, float* part) {
  int64_t chunk = edgelin_attention_chunk_rows(D);
  for (int64_t c0 = 0; c0 < n_rows; c0 += chunk) {
    int64_t n = n_rows - c0 < chunk ? n_rows - c0 : chunk;
    for (int64_t h = 0; h < G; ++h) {  /* the chunk's keys and values stay in L2 for the group's next heads */
      float *m = part + h * (D + 2), *l = m + 1;
      float keep = edgelin_attention_rescale(m, l, scores(qs + h * D, K, half, c0 * D, n, D, s));
      *l += exp_sum(s, n, *m);
      weighted(s, V, half, c0 * D, n, D, keep, m + 2);
    }
  }
}

AVX2 static void part_avx2_float(const float* qs, const void* K, const void* V, int64_t n_rows, int64_t G, int64_t D,
                                 float* s, float* part) {
  part_avx2(qs, K, V, 0, n_rows, G, D, s, part);
}

AVX2 static void part_avx2_half(const float* qs, const void* K, const void* V, int64_t n_rows, int64_t G, int64_t D,
                                float* s, float* part) {
  part_avx2(qs, K, V, 1, n_rows, G, D, s, part);
}
#endif

void edgelin_attention_task(const EdgelinAttention* a, int64_t task) {
  int64_t G = a->Hq / a->Hkv, D = a->D;
  int64_t piece = task % a->splits, rest = task / a->splits;
  int64_t g = rest % a->Hkv, token = rest / a->Hkv;  /* token = b * S + i */
  int64_t b = token / a->S, i = token % a->S;
  int64_t rows = (int64_t)a->seqlens[b] - (a->S - 1) + i + 1;
  int64_t per = (rows + a->splits - 1) / a->splits, r0 = piece * per;
  int64_t r1 = r0 + per < rows ? r0 + per : rows;
  float* part = a->partial + task * G * (D + 2);
  float* qs = a->scratch + task * edgelin_attention_scratch_floats(G, D);
  for (int64_t h = 0; h < G; ++h) {
    float* head = part + h * (D + 2);
    head[0] = -INFINITY;
    memset(head + 1, 0, sizeof(float) * (size_t)(D + 1));
    int64_t q = (token * a->Hq + g * G + h) * D;
    for (int64_t c = 0; c < D; ++c) qs[h * D + c] = a->scale * element(a->q, q + c, a->half);
  }
  if (r1 <= r0) return;  /* an empty piece: max -inf, sum 0 */
  size_t size = a->half ? 2 : 4, base = (size_t)(((b * a->Hkv + g) * a->capacity + r0) * D) * size;
  const char *keys = (const char*)a->keys + base, *values = (const char*)a->values + base;
#if defined(__x86_64__) || defined(_M_X64)
  if (edgelin_avx2() && D % 8 == 0) {
    (a->half ? part_avx2_half : part_avx2_float)(qs, keys, values, r1 - r0, G, D, qs + G * D, part);
    return;
  }
#endif
#if defined(__aarch64__)
  if (edgelin_arm() != EDGELIN_ARM_NONE && D % 4 == 0) {
    edgelin_neon_attention_part(qs, keys, values, a->half, r1 - r0, G, D, qs + G * D, part);
    return;
  }
#endif
  part_portable(qs, keys, values, a->half, r1 - r0, G, D, qs + G * D, part);
}

int edgelin_attention_merge(const EdgelinAttention* a) {
  int64_t G = a->Hq / a->Hkv, D = a->D, stride = G * (D + 2);
  float* out = malloc(sizeof(float) * (size_t)D);
  if (!out) return -1;
  for (int64_t token = 0; token < a->B * a->S; ++token) {
    for (int64_t qh = 0; qh < a->Hq; ++qh) {
      int64_t g = qh / G, h = qh % G;
      const float* first = a->partial + ((token * a->Hkv + g) * a->splits) * stride + h * (D + 2);
      float top = -INFINITY, sum = 0.0f;
      for (int64_t s = 0; s < a->splits; ++s) top = first[s * stride] > top ? first[s * stride] : top;
      memset(out, 0, sizeof(float) * (size_t)D);
      for (int64_t s = 0; s < a->splits; ++s) {
        const float* p = first + s * stride;
        if (p[0] == -INFINITY) continue;
        float w = expf(p[0] - top);
        sum += w * p[1];
        for (int64_t c = 0; c < D; ++c) out[c] += w * p[2 + c];
      }
      float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
      int64_t row = (token * a->Hq + qh) * D;
      for (int64_t c = 0; c < D; ++c) {
        if (a->half)
          ((uint16_t*)a->out)[row + c] = edgelin_float_to_half(out[c] * inv);
        else
          ((float*)a->out)[row + c] = out[c] * inv;
      }
    }
  }
  free(out);
  return 0;
}
