/* edgelin's 4-bit weight products for several tokens at once: a prefill piece, or a batch (see q4_gemv.h).

   With AVX-512 VNNI and whole groups of four blocks (K a multiple of 128), four weight rows times four tokens per
   step: each 64-byte load of a row's four blocks is unpacked to nibbles once and multiplied (vpdpbusd) by every
   token's activations, so the unpacking is shared by four tokens. The tokens' activation blocks are laid out for
   one 64-byte load per four blocks (edgelin_q4_quantize_tokens swaps the middle halves of each 128 bytes), read
   straight from L1 by vpdpbusd. Per 128 weights, row and token: the two dot products, the int -> float conversion
   and its scaling (~7.5 instructions), where the one-token path takes ~11. Otherwise each token goes through the
   one-token path (edgelin_q4_rows), slice by slice of weight rows. */
#include <stdlib.h>

#include "q4_gemv.h"
#include "q4_scratch.h"

#define ROWS 4
#define TOKENS 4
/* Weight rows per pass over the tokens: 16 rows of K = 768 are 6 KB of 4-bit weights, read from L1 by every token
   after the first. One token after another over all N rows would stream the whole matrix once per token. */
#define TOKEN_ROWS 16

/* The 4 x 4 path's condition; edgelin_q4_quantize_tokens and edgelin_q4_rows_tokens agree on it. */
static int quads(int64_t M, int64_t K) {
#if defined(__x86_64__) || defined(_M_X64)
  return M > 1 && n_blocks(K) % 4 == 0 && edgelin_avx512_vnni();
#else
  (void)M;
  (void)K;
  return 0;
#endif
}

void edgelin_q4_quantize_tokens(const float* x, int64_t M, int64_t K, void* scratch) {
  size_t stride = edgelin_q4_scratch_bytes(K);
  int swap = quads(M, K);
  for (int64_t m = 0; m < M; ++m) {
    char* own = (char*)scratch + (size_t)m * stride;
    edgelin_q4_quantize(x + m * K, K, own);
    if (!swap) continue;
    Scratch s = view(own, K);
    for (int64_t q = 0; q < n_blocks(K) / 4; ++q) {  /* [E0 O0 E1 O1] -> [E0 E1 O0 O1], 32 bytes each */
      int8_t t[32], *quad = s.qa + q * 128;
      memcpy(t, quad + 32, 32);
      memcpy(quad + 32, quad + 64, 32);
      memcpy(quad + 64, t, 32);
    }
  }
}

#if defined(__x86_64__) || defined(_M_X64)
/* Rows n .. n + R - 1 of tokens m .. m + T - 1 (R <= ROWS, T <= TOKENS; nb a multiple of 4). Always inlined, so that
   constant R and T unroll the loops and keep the 16 accumulators in registers. */
AVX512 static inline __attribute__((always_inline)) void quads_group(const char* scratch, size_t stride, int64_t K,
                                                                     const uint8_t* w, const float* scales,
                                                                     const uint8_t* zero_points, int64_t n, int R,
                                                                     int64_t m, int T, float* y, int64_t N) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  /* lane l holds block l / 4's partial dot: its scales repeated four times */
  const __m512i quad = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  int64_t nb = n_blocks(K), zb = (nb + 1) / 2, row_bytes = nb * 16;
  Scratch s[TOKENS];
  for (int t = 0; t < T; ++t) s[t] = view(scratch + (size_t)(m + t) * stride, K);
  const uint8_t* wr = w + n * row_bytes;
  const float* sr = scales + n * nb;
  const uint8_t* zr = zero_points ? zero_points + n * zb : NULL;
  __m512 acc[ROWS][TOKENS];
  for (int r = 0; r < ROWS; ++r)
    for (int t = 0; t < TOKENS; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b += 8) {
    int64_t left = nb - b < 8 ? nb - b : 8;  /* 8, or 4 in a row's last group */
    __m256i mask = mask_first(left);
    /* the zero points' term, -(scale x zero point) x c per block, into the accumulators' low 8 lanes */
    __m512 c[TOKENS];
    for (int t = 0; t < T; ++t) c[t] = _mm512_zextps256_ps512(_mm256_maskload_ps(s[t].c + b, mask));
    for (int r = 0; r < R; ++r) {
      __m256 sw = _mm256_maskload_ps(sr + r * nb + b, mask);
      __m512 offset = _mm512_zextps256_ps512(_mm256_mul_ps(sw, zero_points8(zr ? zr + r * zb : NULL, zb, b)));
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_fnmadd_ps(offset, c[t], acc[r][t]);
    }
    for (int64_t bq = b; bq < b + left; bq += 4) {
      __m512 sa[TOKENS];
      for (int t = 0; t < T; ++t)
        sa[t] = _mm512_permutexvar_ps(quad, _mm512_castps128_ps512(_mm_loadu_ps(s[t].sa + bq)));
      for (int r = 0; r < R; ++r) {
        __m512 sw = _mm512_permutexvar_ps(quad, _mm512_castps128_ps512(_mm_loadu_ps(sr + r * nb + bq)));
        __m512i wv = _mm512_loadu_si512((const void*)(wr + r * row_bytes + bq * 16));
        __m512i lo = _mm512_and_si512(wv, low), hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), low);
        for (int t = 0; t < T; ++t) {
          const int8_t* a = s[t].qa + bq * 32;  /* 64 even-position values, then 64 odd ones */
          __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(a)),
                                            hi, _mm512_loadu_si512(a + 64));
          acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(sw, sa[t]), acc[r][t]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {  /* each row's four tokens: 512 -> 256 bits, then the one-token path's hadd tree */
    __m256 f[TOKENS];
    for (int t = 0; t < TOKENS; ++t)
      f[t] = _mm256_add_ps(_mm512_castps512_ps256(acc[r][t]),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r][t]), 1)));
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(f[0], f[1]), _mm256_hadd_ps(f[2], f[3]));
    float out[TOKENS];
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    for (int t = 0; t < T; ++t) y[(m + t) * N + n + r] = out[t];
  }
}

/* Every token for rows n .. n + R - 1, four at a time. */
AVX512 static inline __attribute__((always_inline)) void quads_rows(const char* scratch, size_t stride, int64_t M,
                                                                    int64_t K, const uint8_t* w, const float* scales,
                                                                    const uint8_t* zero_points, int64_t n, int R,
                                                                    float* y, int64_t N) {
  int64_t m = 0;
  for (; m + TOKENS <= M; m += TOKENS) quads_group(scratch, stride, K, w, scales, zero_points, n, R, m, TOKENS, y, N);
  switch (M - m) {  /* constant T for each: unrolled */
    case 3: quads_group(scratch, stride, K, w, scales, zero_points, n, R, m, 3, y, N); break;
    case 2: quads_group(scratch, stride, K, w, scales, zero_points, n, R, m, 2, y, N); break;
    case 1: quads_group(scratch, stride, K, w, scales, zero_points, n, R, m, 1, y, N); break;
    default: break;
  }
}

AVX512 static void rows_quads(const char* scratch, size_t stride, int64_t M, int64_t K, const uint8_t* w,
                              const float* scales, const uint8_t* zero_points, int64_t n0, int64_t n1, float* y,
                              int64_t N) {
  int64_t n = n0;
  for (; n + ROWS <= n1; n += ROWS) quads_rows(scratch, stride, M, K, w, scales, zero_points, n, ROWS, y, N);
  switch (n1 - n) {
    case 3: quads_rows(scratch, stride, M, K, w, scales, zero_points, n, 3, y, N); break;
    case 2: quads_rows(scratch, stride, M, K, w, scales, zero_points, n, 2, y, N); break;
    case 1: quads_rows(scratch, stride, M, K, w, scales, zero_points, n, 1, y, N); break;
    default: break;
  }
}
#endif

void edgelin_q4_rows_tokens(const void* scratch, int64_t M, int64_t K, const uint8_t* weights, const float* scales,
                            const uint8_t* zero_points, int64_t n0, int64_t n1, float* y, int64_t N) {
  size_t stride = edgelin_q4_scratch_bytes(K);
#if defined(__x86_64__) || defined(_M_X64)
  if (quads(M, K)) {
    rows_quads(scratch, stride, M, K, weights, scales, zero_points, n0, n1, y, N);
    return;
  }
#endif
  for (int64_t n = n0; n < n1; n += TOKEN_ROWS) {
    int64_t end = n + TOKEN_ROWS < n1 ? n + TOKEN_ROWS : n1;
    for (int64_t m = 0; m < M; ++m)
      edgelin_q4_rows((const char*)scratch + (size_t)m * stride, K, weights, scales, zero_points, n, end, y + m * N);
  }
}
