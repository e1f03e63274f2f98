/* edgelin's 4-bit weight products for decoding (see q4_gemv.h).

   The AVX2 path multiplies the unsigned 4-bit weights by int8 activation blocks with vpmaddubsw (pairs summed to
   int16: 15 x 127 x 2 cannot saturate), two 32-blocks per 256-bit step, four weight rows at once (independent
   accumulator chains: one row at a time is latency-bound, 43 vs 20 us for 1676 x 384 on a Zen 3 core), and adds
   each block's zero-point term once per row through the block's activation sum (offset x c), not per element.
   The activations of a pair of blocks are stored even positions first, odd ones after, to match the nibbles
   (low = even). The 8-bit product (q8_gemv.c) shares the activation blocks, in their natural order there. */
#include "q4_gemv.h"
#include "q4_scratch.h"
#include "arm/neon.h"
#include "q8_gemv.h"

#include <math.h>
#include <string.h>

#define ROWS 4

size_t edgelin_q4_scratch_bytes(int64_t K) {
  int64_t nb = n_blocks(K);
  return (size_t)(2 * padded8(nb) * sizeof(float) + (nb + 1) / 2 * 64 + 64);
}

/* Where value j (0..31) of block b goes in the scratch: the 4-bit layout (per pair of blocks, even positions
   first, to match the nibbles), or the 8-bit one (natural: block b at 32 b, as the weight bytes are). */
static int8_t* slot(Scratch s, int64_t b, int j, int natural) {
  return natural ? s.qa + b * BLOCK + j : s.qa + (b / 2) * 64 + (j % 2) * 32 + (b % 2) * 16 + j / 2;
}

/* Block b of x (zero-padded past K): its int8 values, scale and scaled sum. */
static void quantize_portable(const float* x, int64_t K, Scratch s, int64_t b, int natural) {
  float xb[BLOCK], amax = 0.0f;
  for (int j = 0; j < BLOCK; ++j) {
    xb[j] = b * BLOCK + j < K ? x[b * BLOCK + j] : 0.0f;
    amax = fmaxf(amax, fabsf(xb[j]));
  }
  float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  int sum = 0;
  for (int j = 0; j < BLOCK; ++j) {
    int q = (int)lrintf(xb[j] * inv);
    *slot(s, b, j, natural) = (int8_t)q;
    sum += q;
  }
  s.sa[b] = amax / 127.0f;
  s.c[b] = s.sa[b] * (float)sum;
}

/* The portable path: any CPU, the same arithmetic in plain C. */
static void rows_portable(Scratch s, int64_t nb, const uint8_t* w, const float* scales, const uint8_t* zero_points,
                          int64_t n0, int64_t n1, float* y) {
  int64_t zb = (nb + 1) / 2;
  for (int64_t n = n0; n < n1; ++n) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* wb = w + (n * nb + b) * 16;
      int32_t dot = 0;
      for (int j = 0; j < BLOCK; ++j) dot += ((wb[j / 2] >> (4 * (j % 2))) & 15) * *slot(s, b, j, 0);
      float offset = -(scales[n * nb + b] * (float)q4_zero_point(zero_points ? zero_points + n * zb : NULL, b));
      acc += (float)dot * scales[n * nb + b] * s.sa[b] + offset * s.c[b];
    }
    y[n] = acc;
  }
}

#if defined(__x86_64__) || defined(_M_X64)
/* Block b's 32 int8 values (in order) into the 4-bit layout. */
AVX2 static inline void store_split(__m256i q, Scratch s, int64_t b) {
  /* even positions to each lane's low 8 bytes, odd to its high 8; then the two lanes' evens together */
  const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                         0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  q = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(q, split), 0xD8);
  int8_t* even = s.qa + (b / 2) * 64 + (b % 2) * 16;
  _mm_storeu_si128((__m128i*)even, _mm256_castsi256_si128(q));
  _mm_storeu_si128((__m128i*)(even + 32), _mm256_extracti128_si256(q, 1));
}

/* quantize_portable for a whole block: the same roundings (vcvtps2dq rounds as lrintf does, to nearest even
   under the default MXCSR), so both give the same bytes. */
AVX2 static void quantize_avx2(const float* x, Scratch s, int64_t b, int natural) {
  const float* xb = x + b * BLOCK;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8), v2 = _mm256_loadu_ps(xb + 16),
         v3 = _mm256_loadu_ps(xb + 24);
  __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                           _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  float amax = _mm_cvtss_f32(h);
  __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, inv)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, inv)),
          i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, inv)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, inv));
  /* int32 -> int8 (packs work per 128-bit lane: 4-byte groups come out as 0,2,4,6 | 1,3,5,7), back in order */
  __m256i q = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
  q = _mm256_permutevar8x32_epi32(q, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  if (natural) {
    _mm256_storeu_si256((__m256i*)(s.qa + b * BLOCK), q);
  } else {
    store_split(q, s, b);
  }
  s.sa[b] = amax / 127.0f;
  s.c[b] = s.sa[b] * (float)hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3)));
}

/* The dot product of a lone last block (16 bytes; never read past a row's end). */
AVX2 static inline int32_t lone_block(const uint8_t* w, const int8_t* even) {
  __m128i wv = _mm_loadu_si128((const __m128i*)w), low = _mm_set1_epi8(15);
  __m128i lo = _mm_and_si128(wv, low), hi = _mm_and_si128(_mm_srli_epi16(wv, 4), low);
  __m128i s32 = _mm_madd_epi16(_mm_add_epi16(_mm_maddubs_epi16(lo, _mm_loadu_si128((const __m128i*)even)),
                                             _mm_maddubs_epi16(hi, _mm_loadu_si128((const __m128i*)(even + 32)))),
                               _mm_set1_epi16(1));
  s32 = _mm_add_epi32(s32, _mm_shuffle_epi32(s32, 0x4E));
  s32 = _mm_add_epi32(s32, _mm_shuffle_epi32(s32, 0xB1));
  return _mm_cvtsi128_si32(s32);
}

/* Blocks b + 2 p0 .. b + left - 1 of R rows (b a multiple of 8, left <= 8): pairs of blocks, one 32-byte load per
   row (vpmaddubsw), then a lone last block; the products scaled by ds (the 8 blocks' weight x activation scales)
   into acc, the lone block's into tail. Always inlined (constant R: accumulators in registers); the AVX2 path's
   whole 8 blocks, and the AVX-512 path's pair and lone block after its four-block steps. */
AVX2 static inline __attribute__((always_inline)) void pairs_avx2(Scratch s, int64_t nb, const uint8_t* wr,
                                                                  const float* sr, int64_t b, int p0, int64_t left,
                                                                  int R, const __m256* ds, __m256* acc, float* tail) {
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  int64_t row_bytes = nb * 16;
  int p = p0;
  for (; 2 * p + 1 < left; ++p) {
    const int8_t* a = s.qa + (b / 2 + p) * 64;
    __m256i even = _mm256_loadu_si256((const __m256i*)a), odd = _mm256_loadu_si256((const __m256i*)(a + 32));
    __m256i idx = _mm256_setr_epi32(2 * p, 2 * p, 2 * p, 2 * p, 2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1);
    for (int r = 0; r < R; ++r) {
      __m256i wv = _mm256_loadu_si256((const __m256i*)(wr + r * row_bytes + (b + 2 * p) * 16));
      __m256i lo = _mm256_and_si256(wv, low), hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), low);
      __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, even), _mm256_maddubs_epi16(hi, odd));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones)), _mm256_permutevar8x32_ps(ds[r], idx),
                               acc[r]);
    }
  }
  if (2 * p < left) {  /* the last block of an odd count */
    int64_t bb = b + 2 * p;
    for (int r = 0; r < R; ++r)
      tail[r] += (float)lone_block(wr + r * row_bytes + bb * 16, s.qa + (bb / 2) * 64) * sr[r * nb + bb] * s.sa[bb];
  }
}

/* R rows (R <= ROWS) from row n: y[n .. n + R). Always inlined, so that a constant R unrolls the row loops and
   keeps the accumulators in registers (a runtime R: 43 instead of 20 us for 1676 x 384). */
AVX2 static inline __attribute__((always_inline)) void rows_avx2_group(Scratch s, int64_t nb, const uint8_t* w,
                                                                       const float* scales, const uint8_t* zero_points,
                                                                       int64_t n, int R, float* y) {
  __m256 acc[ROWS];
  float tail[ROWS];
  for (int r = 0; r < ROWS; ++r) {
    acc[r] = _mm256_setzero_ps();
    tail[r] = 0.0f;
  }
  const uint8_t* wr = w + n * nb * 16;
  const float* sr = scales + n * nb;
  int64_t zb = (nb + 1) / 2;
  const uint8_t* zr = zero_points ? zero_points + n * zb : NULL;
  for (int64_t b = 0; b < nb; b += 8) {
    int64_t left = nb - b < 8 ? nb - b : 8;
    __m256i mask = mask_first(left);
    __m256 sa8 = _mm256_maskload_ps(s.sa + b, mask), c8 = _mm256_maskload_ps(s.c + b, mask);
    __m256 ds[ROWS];
    for (int r = 0; r < R; ++r) {
      prefetch_next_q4(wr, sr, zr, nb, b, left, ROWS, r);
      __m256 sw = _mm256_maskload_ps(sr + r * nb + b, mask);
      ds[r] = _mm256_mul_ps(sw, sa8);
      /* + offset c, offset = -(scale x zero point): rounded as the portable path rounds it */
      acc[r] = _mm256_fnmadd_ps(_mm256_mul_ps(sw, zero_points8(zr ? zr + r * zb : NULL, zb, b)), c8, acc[r]);
    }
    pairs_avx2(s, nb, wr, sr, b, 0, left, R, ds, acc, tail);
  }
  __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  __m128 sums = _mm_add_ps(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)), _mm_loadu_ps(tail));
  float out[ROWS];
  _mm_storeu_ps(out, sums);
  for (int r = 0; r < R; ++r) y[n + r] = out[r];
}

AVX2 static void rows_avx2(Scratch s, int64_t nb, const uint8_t* w, const float* scales, const uint8_t* zero_points,
                           int64_t n0, int64_t n1, float* y) {
  int64_t n = n0;
  for (; n + ROWS <= n1; n += ROWS) rows_avx2_group(s, nb, w, scales, zero_points, n, ROWS, y);
  if (n < n1) rows_avx2_group(s, nb, w, scales, zero_points, n, (int)(n1 - n), y);
}

/* With AVX-512 VNNI (Zen 4, Ice Lake and later): vpdpbusd multiplies the unsigned nibbles by the int8 activations
   and sums each 4 into int32 in one instruction (maddubs, madd and the add in the AVX2 path), over four blocks per
   512-bit step (a pair of the AVX2 path's layout from each 256-bit half of the activations). Per 128 weights and
   row: 9 instructions where the AVX2 path takes 22. The same integer dot per block; only the float sums' order
   differs. llama.cpp's Q4_0 x Q8_0 product takes vpdpbusd on such a CPU too. */

/* Blocks b .. b + left - 1 (left <= 8) of R rows into their accumulators. Always inlined: with left = 8 (every
   8 blocks but a row's last few) the loops below unroll and the loads need no masks. */
AVX512 static inline __attribute__((always_inline)) void vnni_blocks(Scratch s, int64_t nb, const uint8_t* wr,
                                                                     const float* sr, const uint8_t* zr, int64_t b,
                                                                     int64_t left, int R, __m512* acc,
                                                                     __m256* acc256, float* tail) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  /* lane l of a four-block step holds block l / 4's partial dot */
  const __m512i quad = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  int64_t row_bytes = nb * 16, zb = (nb + 1) / 2;
  __m256i mask = mask_first(left);
  __m256 sa8 = left == 8 ? _mm256_loadu_ps(s.sa + b) : _mm256_maskload_ps(s.sa + b, mask);
  __m256 c8 = left == 8 ? _mm256_loadu_ps(s.c + b) : _mm256_maskload_ps(s.c + b, mask);
  __m256 ds[ROWS];
  for (int r = 0; r < R; ++r) {
    prefetch_next_q4(wr, sr, zr, nb, b, left, ROWS, r);
    __m256 sw = left == 8 ? _mm256_loadu_ps(sr + r * nb + b) : _mm256_maskload_ps(sr + r * nb + b, mask);
    ds[r] = _mm256_mul_ps(sw, sa8);
    acc256[r] = _mm256_fnmadd_ps(_mm256_mul_ps(sw, zero_points8(zr ? zr + r * zb : NULL, zb, b)), c8, acc256[r]);
  }
  int q = 0;
  for (; 4 * q + 3 < left; ++q) {  /* four blocks: one 64-byte load per row */
    const int8_t* a = s.qa + (b / 2 + 2 * q) * 64;
    __m512i even = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)a)),
                                      _mm256_loadu_si256((const __m256i*)(a + 64)), 1);
    __m512i odd = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(a + 32))),
                                     _mm256_loadu_si256((const __m256i*)(a + 96)), 1);
    __m512i idx = _mm512_add_epi32(quad, _mm512_set1_epi32(4 * q));
    for (int r = 0; r < R; ++r) {
      __m512i wv = _mm512_loadu_si512((const void*)(wr + r * row_bytes + (b + 4 * q) * 16));
      __m512i lo = _mm512_and_si512(wv, low), hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), low);
      __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, even), hi, odd);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(idx, _mm512_castps256_ps512(ds[r])),
                               acc[r]);
    }
  }
  /* a pair and a lone block may be left (a row's last group): the AVX2 form, the same integer dots */
  pairs_avx2(s, nb, wr, sr, b, 2 * q, left, R, ds, acc256, tail);
}

AVX512 static inline __attribute__((always_inline)) void rows_vnni_group(Scratch s, int64_t nb, const uint8_t* w,
                                                                         const float* scales,
                                                                         const uint8_t* zero_points, int64_t n, int R,
                                                                         float* y) {
  __m512 acc[ROWS];
  __m256 acc256[ROWS];
  float tail[ROWS];
  for (int r = 0; r < ROWS; ++r) {
    acc[r] = _mm512_setzero_ps();
    acc256[r] = _mm256_setzero_ps();
    tail[r] = 0.0f;
  }
  const uint8_t* wr = w + n * nb * 16;
  const float* sr = scales + n * nb;
  const uint8_t* zr = zero_points ? zero_points + n * ((nb + 1) / 2) : NULL;
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) vnni_blocks(s, nb, wr, sr, zr, b, 8, R, acc, acc256, tail);
  if (b < nb) vnni_blocks(s, nb, wr, sr, zr, b, nb - b, R, acc, acc256, tail);
  __m256 folded[ROWS];
  for (int r = 0; r < ROWS; ++r)
    folded[r] = _mm256_add_ps(_mm256_add_ps(_mm512_castps512_ps256(acc[r]),
                                            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r]), 1))),
                              acc256[r]);
  __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(folded[0], folded[1]), _mm256_hadd_ps(folded[2], folded[3]));
  __m128 sums = _mm_add_ps(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)), _mm_loadu_ps(tail));
  float out[ROWS];
  _mm_storeu_ps(out, sums);
  for (int r = 0; r < R; ++r) y[n + r] = out[r];
}

AVX512 static void rows_vnni(Scratch s, int64_t nb, const uint8_t* w, const float* scales,
                             const uint8_t* zero_points, int64_t n0, int64_t n1, float* y) {
  int64_t n = n0;
  for (; n + ROWS <= n1; n += ROWS) rows_vnni_group(s, nb, w, scales, zero_points, n, ROWS, y);
  if (n < n1) rows_vnni_group(s, nb, w, scales, zero_points, n, (int)(n1 - n), y);
}
#endif

static void quantize(const float* x, int64_t K, void* scratch, int natural) {
  Scratch s = view(scratch, K);
  int64_t nb = n_blocks(K), nb8 = padded8(nb);
  for (int64_t b = nb; b < nb8; ++b) s.sa[b] = s.c[b] = 0.0f;
  if (nb % 2 && !natural) memset(s.qa + (nb / 2) * 64, 0, 64);  /* the lone last block's unused halves */
  for (int64_t b = 0; b < nb; ++b) {
#if defined(__x86_64__) || defined(_M_X64)
    if (edgelin_avx2() && (b + 1) * BLOCK <= K) {
      quantize_avx2(x, s, b, natural);
      continue;
    }
#endif
    quantize_portable(x, K, s, b, natural);
  }
}

void edgelin_q4_quantize(const float* x, int64_t K, void* scratch) { quantize(x, K, scratch, 0); }

void edgelin_q8_quantize(const float* x, int64_t K, void* scratch) { quantize(x, K, scratch, 1); }

void edgelin_q4_rows(const void* scratch, int64_t K, const uint8_t* weights, const float* scales,
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
  EdgelinArmRows arm = edgelin_arm_rows(4, edgelin_arm());
  if (arm) {
    arm(scratch, K, weights, scales, zero_points, n0, n1, y);
    return;
  }
#endif
  rows_portable(s, nb, weights, scales, zero_points, n0, n1, y);
}
