/* edgelin's 8-bit weight products (see q8_gemv.h).

   With AVX-512 VNNI (Zen 4, Ice Lake and later) vpdpbusd multiplies the unsigned 8-bit codes by the int8
   activations directly and sums each 4 into int32: two 32-blocks per 512-bit step, four weight rows at once. On
   AVX2, vpmaddubsw would saturate on 255 x 127 x 2, so the codes are read as q - 128 (one xor), multiplied by
   magnitude and sign (|q - 128| <= 128: 128 x 127 x 2 fits in int16), and 128 is added back to the zero point.
   Each block's zero-point term goes in once per row through the block's activation sum (as in q4_gemv.c). */
#include "q8_gemv.h"
#include "q4_gemv.h"
#include "q4_scratch.h"
#include "arm/neon.h"

#define ROWS 4

static int zero_point(const uint8_t* zr, int64_t b) { return zr ? zr[b] : 128; }

/* The portable path: any CPU, the same arithmetic in plain C. */
static void rows_portable(Scratch s, int64_t nb, const uint8_t* w, const float* scales, const uint8_t* zero_points,
                          int64_t n0, int64_t n1, float* y) {
  for (int64_t n = n0; n < n1; ++n) {
    float acc = 0.0f;
    const uint8_t* zr = zero_points ? zero_points + n * nb : NULL;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* wb = w + (n * nb + b) * BLOCK;
      const int8_t* a = s.qa + b * BLOCK;
      int32_t dot = 0;
      for (int j = 0; j < BLOCK; ++j) dot += wb[j] * a[j];
      float scale = scales[n * nb + b];
      acc += (float)dot * scale * s.sa[b] - scale * (float)zero_point(zr, b) * s.c[b];
    }
    y[n] = acc;
  }
}

#if defined(__x86_64__) || defined(_M_X64)
/* Blocks b .. b + left - 1's zero points (left <= 8) of one row, as floats, less `minus`; NULL: 128 each. */
AVX2 static inline __m256 byte_zero_points(const uint8_t* zr, int64_t b, int64_t left, float minus) {
  if (!zr) return _mm256_set1_ps(128.0f - minus);
  uint64_t word = 0;
  if (left == 8) {
    memcpy(&word, zr + b, 8);  /* (a fixed size: one load) */
  } else {  /* a row's last group holds fewer (a variable-size memcpy here cost 80% of the 1676 x 384 product) */
    for (int64_t i = 0; i < left; ++i) word |= (uint64_t)zr[b + i] << (8 * i);
  }
  __m256i v = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)word));
  return _mm256_sub_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(minus));
}

/* Rows n .. n + R - 1 (R <= ROWS) on AVX2. Always inlined, so that a constant R keeps the accumulators in
   registers. */
AVX2 static inline __attribute__((always_inline)) void rows_avx2_group(Scratch s, int64_t nb, const uint8_t* w,
                                                                       const float* scales,
                                                                       const uint8_t* zero_points, int64_t n, int R,
                                                                       float* y) {
  const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
  __m256 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm256_setzero_ps();
  const uint8_t* wr = w + n * nb * BLOCK;
  const float* sr = scales + n * nb;
  for (int64_t b = 0; b < nb; b += 8) {
    int64_t left = nb - b < 8 ? nb - b : 8;
    __m256i mask = mask_first(left);
    __m256 sa8 = _mm256_maskload_ps(s.sa + b, mask), c8 = _mm256_maskload_ps(s.c + b, mask);
    __m256 ds[ROWS];
    for (int r = 0; r < R; ++r) {
      const uint8_t* zr = zero_points ? zero_points + (n + r) * nb : NULL;
      prefetch_ahead(wr + ((ROWS + r) * nb + b) * BLOCK, left * BLOCK);  /* the next group's (q4_scratch.h) */
      prefetch_ahead(sr + (ROWS + r) * nb + b, 32);
      if (zr) prefetch_ahead(zr + ROWS * nb + b, 8);
      __m256 sw = _mm256_maskload_ps(sr + r * nb + b, mask);
      ds[r] = _mm256_mul_ps(sw, sa8);
      /* the codes are read as q - 128: the zero points' term with zero point - 128 */
      acc[r] = _mm256_fnmadd_ps(_mm256_mul_ps(sw, byte_zero_points(zr, b, left, 128.0f)), c8, acc[r]);
    }
    for (int64_t j = 0; j < left; ++j) {
      __m256i a = _mm256_loadu_si256((const __m256i*)(s.qa + (b + j) * BLOCK));
      __m256i lane = _mm256_set1_epi32((int)j);
      for (int r = 0; r < R; ++r) {
        __m256i q = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(wr + (r * nb + b + j) * BLOCK)), flip);
        __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(a, q)), ones);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_permutevar8x32_ps(ds[r], lane), acc[r]);
      }
    }
  }
  __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  float out[ROWS];
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  for (int r = 0; r < R; ++r) y[n + r] = out[r];
}

AVX2 static void rows_avx2(Scratch s, int64_t nb, const uint8_t* w, const float* scales, const uint8_t* zero_points,
                           int64_t n0, int64_t n1, float* y) {
  int64_t n = n0;
  for (; n + ROWS <= n1; n += ROWS) rows_avx2_group(s, nb, w, scales, zero_points, n, ROWS, y);
  switch (n1 - n) {  /* constant R for each: unrolled */
    case 3: rows_avx2_group(s, nb, w, scales, zero_points, n, 3, y); break;
    case 2: rows_avx2_group(s, nb, w, scales, zero_points, n, 2, y); break;
    case 1: rows_avx2_group(s, nb, w, scales, zero_points, n, 1, y); break;
    default: break;
  }
}

/* Rows n .. n + R - 1 with AVX-512 VNNI: a pair of blocks per 64-byte load and vpdpbusd, a lone last block in
   256 bits. */
AVX512 static inline __attribute__((always_inline)) void rows_vnni_group(Scratch s, int64_t nb, const uint8_t* w,
                                                                         const float* scales,
                                                                         const uint8_t* zero_points, int64_t n, int R,
                                                                         float* y) {
  /* lane l of a pair's dot holds block l / 8's partial sums */
  const __m512i pair = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  __m512 acc[ROWS];
  __m256 acc256[ROWS];
  for (int r = 0; r < ROWS; ++r) {
    acc[r] = _mm512_setzero_ps();
    acc256[r] = _mm256_setzero_ps();
  }
  const uint8_t* wr = w + n * nb * BLOCK;
  const float* sr = scales + n * nb;
  for (int64_t b = 0; b < nb; b += 8) {
    int64_t left = nb - b < 8 ? nb - b : 8;
    __m256i mask = mask_first(left);
    __m256 sa8 = left == 8 ? _mm256_loadu_ps(s.sa + b) : _mm256_maskload_ps(s.sa + b, mask);
    __m256 c8 = left == 8 ? _mm256_loadu_ps(s.c + b) : _mm256_maskload_ps(s.c + b, mask);
    __m256 ds[ROWS];
    for (int r = 0; r < R; ++r) {
      /* the codes 8 rows on, at this point of theirs, to L1: the prefetchers lag on four interleaved streams
         (1676 x 384 over 24 matrices, one after another: 42 -> 39 us each; 384 x 768: 18 -> 14 us) */
      prefetch_ahead(wr + ((8 + r) * nb + b) * BLOCK, left * BLOCK);
      __m256 sw = left == 8 ? _mm256_loadu_ps(sr + r * nb + b) : _mm256_maskload_ps(sr + r * nb + b, mask);
      ds[r] = _mm256_mul_ps(sw, sa8);
      const uint8_t* zr = zero_points ? zero_points + (n + r) * nb : NULL;
      acc256[r] = _mm256_fnmadd_ps(_mm256_mul_ps(sw, byte_zero_points(zr, b, left, 0.0f)), c8, acc256[r]);
    }
    int64_t j = 0;
    for (; j + 1 < left; j += 2) {
      __m512i a = _mm512_loadu_si512((const void*)(s.qa + (b + j) * BLOCK));
      __m512i idx = _mm512_add_epi32(pair, _mm512_set1_epi32((int)j));
      for (int r = 0; r < R; ++r) {
        __m512i q = _mm512_loadu_si512((const void*)(wr + (r * nb + b + j) * BLOCK));
        __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, a);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(idx, _mm512_castps256_ps512(ds[r])),
                                 acc[r]);
      }
    }
    if (j < left) {  /* the last block of an odd count */
      __m256i a = _mm256_loadu_si256((const __m256i*)(s.qa + (b + j) * BLOCK));
      __m256i lane = _mm256_set1_epi32((int)j);
      for (int r = 0; r < R; ++r) {
        __m256i q = _mm256_loadu_si256((const __m256i*)(wr + (r * nb + b + j) * BLOCK));
        __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, a);
        acc256[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_permutevar8x32_ps(ds[r], lane), acc256[r]);
      }
    }
  }
  __m256 folded[ROWS];
  for (int r = 0; r < ROWS; ++r)
    folded[r] = _mm256_add_ps(_mm256_add_ps(_mm512_castps512_ps256(acc[r]),
                                            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r]), 1))),
                              acc256[r]);
  __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(folded[0], folded[1]), _mm256_hadd_ps(folded[2], folded[3]));
  float out[ROWS];
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  for (int r = 0; r < R; ++r) y[n + r] = out[r];
}

AVX512 static void rows_vnni(Scratch s, int64_t nb, const uint8_t* w, const float* scales,
                             const uint8_t* zero_points, int64_t n0, int64_t n1, float* y) {
  int64_t n = n0;
  for (; n + ROWS <= n1; n += ROWS) rows_vnni_group(s, nb, w, scales, zero_points, n, ROWS, y);
  switch (n1 - n) {
    case 3: rows_vnni_group(s, nb, w, scales, zero_points, n, 3, y); break;
    case 2: rows_vnni_group(s, nb, w, scales, zero_points, n, 2, y); break;
    case 1: rows_vnni_group(s, nb, w, scales, zero_points, n, 1, y); break;
    default: break;
  }
}
#endif

void edgelin_q8_rows(const void* scratch, int64_t K, const uint8_t* weights, const float* scales,
                     const uint8_t* zero_points, int64_t n0, int64_t n1, float* y) {
  Scratch s = view(scratch, K);
  int64_t nb = n_blocks(K);
#if defined(__x86_64__) || defined(_M_X64)
  if (edgelin_avx512_vnni()) {
    rows_vnni(s, nb, weights, scales, zero_points, n0, n1, y);
    return;
  }
  if (edgelin_avx2()) {
    rows_avx2(s, nb, weights, scales, zero_points, n0, n1, y);
    return;
  }
#endif
#if defined(__aarch64__)
  EdgelinArmRows arm = edgelin_arm_rows(8, edgelin_arm());
  if (arm) {
    arm(scratch, K, weights, scales, zero_points, n0, n1, y);
    return;
  }
#endif
  rows_portable(s, nb, weights, scales, zero_points, n0, n1, y);
}
