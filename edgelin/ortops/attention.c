/* edgelin's decode attention (see attention.h). ONNX Runtime's CPU GroupQueryAttention runs each query head on its
   own (a GEMV over the keys, a softmax, a GEMV over the values), so with G query heads per kv head it reads the
   cache G times. Here one task streams a piece of one kv head's keys and values once, in chunks small enough to
   stay in L2 while the group's heads use them, with the softmax kept online (running max and sum) across chunks
   and, through edgelin_attention_merge, across pieces. */
#include "attention.h"

#include <math.h>
#include <string.h>

/* Rows per chunk: ~64 KiB of keys, at least 16. */
static int64_t chunk_rows(int64_t D) { return D >= 1024 ? 16 : 16384 / D; }

int64_t edgelin_attention_scratch_floats(int64_t G, int64_t D) { return G * D + chunk_rows(D); }

int64_t edgelin_attention_tasks(const EdgelinAttention* a) { return a->B * a->S * a->Hkv * a->splits; }

/* The chunk's softmax step for one head: s[0..n) -> e^(s - m'), with m' the new running max; the running sum and
   weighted values rescaled to m'. Returns the scale applied to the old values. */
static float rescale(float* m, float* l, float chunk_max) {
  float next = chunk_max > *m ? chunk_max : *m;
  float keep = *m == -INFINITY ? 0.0f : expf(*m - next);
  *m = next;
  *l *= keep;
  return keep;
}

static void part_portable(const float* qs, const float* K, const float* V, int64_t n_rows, int64_t G, int64_t D,
                          float* s, float* part) {
  int64_t chunk = chunk_rows(D);
  for (int64_t c0 = 0; c0 < n_rows; c0 += chunk) {
    int64_t n = n_rows - c0 < chunk ? n_rows - c0 : chunk;
    for (int64_t h = 0; h < G; ++h) {
      float *m = part + h * (D + 2), *l = m + 1, *acc = m + 2, top = -INFINITY;
      for (int64_t j = 0; j < n; ++j) {
        float dot = 0.0f;
        for (int64_t c = 0; c < D; ++c) dot += qs[h * D + c] * K[(c0 + j) * D + c];
        s[j] = dot;
        top = dot > top ? dot : top;
      }
      float keep = rescale(m, l, top);
      for (int64_t c = 0; c < D; ++c) acc[c] *= keep;
      for (int64_t j = 0; j < n; ++j) {
        float p = expf(s[j] - *m);
        *l += p;
        for (int64_t c = 0; c < D; ++c) acc[c] += p * V[(c0 + j) * D + c];
      }
    }
  }
}

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include "simd_exp.h"
#define AVX2 __attribute__((target("avx2,fma")))
#define INLINE_AVX2 __attribute__((target("avx2,fma"), always_inline)) static inline

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

/* s[j] = q . K[j] for n rows; returns their max. D a multiple of 8. */
AVX2 static float scores(const float* q, const float* K, int64_t n, int64_t D, float* s) {
  __m256 top = _mm256_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const float* r = K + j * D;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t c = 0; c < D; c += 8) {
      __m256 x = _mm256_loadu_ps(q + c);
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(r + c), x, a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(r + D + c), x, a1);
      a2 = _mm256_fmadd_ps(_mm256_loadu_ps(r + 2 * D + c), x, a2);
      a3 = _mm256_fmadd_ps(_mm256_loadu_ps(r + 3 * D + c), x, a3);
      a4 = _mm256_fmadd_ps(_mm256_loadu_ps(r + 4 * D + c), x, a4);
      a5 = _mm256_fmadd_ps(_mm256_loadu_ps(r + 5 * D + c), x, a5);
      a6 = _mm256_fmadd_ps(_mm256_loadu_ps(r + 6 * D + c), x, a6);
      a7 = _mm256_fmadd_ps(_mm256_loadu_ps(r + 7 * D + c), x, a7);
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
    for (int64_t c = 0; c < D; c += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(K + j * D + c), _mm256_loadu_ps(q + c), a);
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

/* acc[0 .. 8 groups) = keep * acc + sum_j p[j] V[j]: the groups' accumulators stay in registers over the rows. */
INLINE_AVX2 void weighted_rows(const float* p, const float* V, int64_t n, int64_t D, float keep, float* acc,
                               int groups) {
  __m256 a[8], k = _mm256_set1_ps(keep);
  for (int c = 0; c < groups; ++c) a[c] = _mm256_mul_ps(k, _mm256_loadu_ps(acc + 8 * c));
  for (int64_t j = 0; j < n; ++j) {
    __m256 w = _mm256_broadcast_ss(p + j);
    for (int c = 0; c < groups; ++c) a[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(V + j * D + 8 * c), a[c]);
  }
  for (int c = 0; c < groups; ++c) _mm256_storeu_ps(acc + 8 * c, a[c]);
}

AVX2 static void weighted(const float* p, const float* V, int64_t n, int64_t D, float keep, float* acc) {
  for (int64_t c0 = 0; c0 < D; c0 += 64) {  /* 64 columns at a time: 8 registers of accumulators */
    int64_t groups = (D - c0) / 8 < 8 ? (D - c0) / 8 : 8;
    switch (groups) {  /* constant group counts, so the accumulators stay in registers */
      case 8: weighted_rows(p, V + c0, n, D, keep, acc + c0, 8); break;
      case 7: weighted_rows(p, V + c0, n, D, keep, acc + c0, 7); break;
      case 6: weighted_rows(p, V + c0, n, D, keep, acc + c0, 6); break;
      case 5: weighted_rows(p, V + c0, n, D, keep, acc + c0, 5); break;
      case 4: weighted_rows(p, V + c0, n, D, keep, acc + c0, 4); break;
      case 3: weighted_rows(p, V + c0, n, D, keep, acc + c0, 3); break;
      case 2: weighted_rows(p, V + c0, n, D, keep, acc + c0, 2); break;
      default: weighted_rows(p, V + c0, n, D, keep, acc + c0, 1); break;
    }
  }
}

AVX2 static void part_avx2(const float* qs, const float* K, const float* V, int64_t n_rows, int64_t G, int64_t D,
                           float* s, float* part) {
  int64_t chunk = chunk_rows(D);
  for (int64_t c0 = 0; c0 < n_rows; c0 += chunk) {
    int64_t n = n_rows - c0 < chunk ? n_rows - c0 : chunk;
    for (int64_t h = 0; h < G; ++h) {  /* the chunk's keys and values stay in L2 for the group's next heads */
      float *m = part + h * (D + 2), *l = m + 1;
      float keep = rescale(m, l, scores(qs + h * D, K + c0 * D, n, D, s));
      *l += exp_sum(s, n, *m);
      weighted(s, V + c0 * D, n, D, keep, m + 2);
    }
  }
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
    const float* q = a->q + (token * a->Hq + g * G + h) * D;
    for (int64_t c = 0; c < D; ++c) qs[h * D + c] = a->scale * q[c];
  }
  if (r1 <= r0) return;  /* an empty piece: max -inf, sum 0 */
  int64_t base = ((b * a->Hkv + g) * a->capacity + r0) * D;
#if defined(__x86_64__) || defined(_M_X64)
  if (edgelin_avx2() && D % 8 == 0) {
    part_avx2(qs, a->keys + base, a->values + base, r1 - r0, G, D, qs + G * D, part);
    return;
  }
#endif
  part_portable(qs, a->keys + base, a->values + base, r1 - r0, G, D, qs + G * D, part);
}

void edgelin_attention_merge(const EdgelinAttention* a) {
  int64_t G = a->Hq / a->Hkv, D = a->D, stride = G * (D + 2);
  for (int64_t token = 0; token < a->B * a->S; ++token) {
    for (int64_t qh = 0; qh < a->Hq; ++qh) {
      int64_t g = qh / G, h = qh % G;
      const float* first = a->partial + ((token * a->Hkv + g) * a->splits) * stride + h * (D + 2);
      float top = -INFINITY, sum = 0.0f;
      for (int64_t s = 0; s < a->splits; ++s) top = first[s * stride] > top ? first[s * stride] : top;
      float* out = a->out + (token * a->Hq + qh) * D;
      memset(out, 0, sizeof(float) * (size_t)D);
      for (int64_t s = 0; s < a->splits; ++s) {
        const float* p = first + s * stride;
        if (p[0] == -INFINITY) continue;
        float w = expf(p[0] - top);
        sum += w * p[1];
        for (int64_t c = 0; c < D; ++c) out[c] += w * p[2 + c];
      }
      float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
      for (int64_t c = 0; c < D; ++c) out[c] *= inv;
    }
  }
}
