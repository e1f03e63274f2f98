/* The 4-bit and 8-bit weight products for several tokens on AVX2 without VNNI (q4_gemm.c, q8_gemm.c call it):
   8 weight rows share a register (two int16 lanes each). Each group of 8 rows is first unpacked to one code per
   byte and transposed to [block][4-value group][row][4] (8 rows' 4 codes in one 32-byte load), then every token's 4
   activations of a group are broadcast to the 8 rows and one vpmaddubsw adds them to the 8 rows' int16 sums at
   once; a block's sums go to int32 (vpmaddwd) and are scaled once per 8 rows and token. TOKENS tokens at a time
   keep their sums in registers, so each load of codes serves all of them (64 tokens x 2048 x 2048 on a busy Zen 3
   core: 27 -> 48 GMAC/s at 4 bits; fewer than TOKENS_MIN tokens do not pay for the packing).

   8-bit codes (0..255) would saturate vpmaddubsw's int16 pairs (255 x 127 x 2), so they are split into their two
   nibbles, each packed as a 4-bit code is and multiplied on its own; a block's dot is 16 x the high one's plus the
   low one's, both exact in int32 (vpmaddwd by 16 and by 1): twice the 4-bit product's multiplies, none of the
   one-token path's sign steps and per-block conversions per token. Mamba2-1.3b's products ([2048 -> 8512],
   [4096 -> 2048], a [2048 -> 4096] head) at 64 tokens on a busy Zen 3 core, against ONNX Runtime's prepacked 8-bit
   MatMulNBits in the same rounds: token by token x1.27-1.52 (10-14 GMAC/s), this way x0.92-1.00 (21-27 GMAC/s)
   (bench/matmul_nbits.py --tokens 64 --shape 2048,8512,4096,4096 --layers 2; a third token register for 8 bits
   instead of a fourth: x0.99-1.04). */
#include <stdlib.h>
#include <string.h>

#include "nbits_grouped.h"
#include "q4_gemv.h"
#include "q4_scratch.h"
#include "q8_gemv.h"

#define GROUP 8       /* weight rows per register: one per int32 lane */
#define TOKENS 4      /* tokens per step: their dots and sums stay in registers */
#define TOKENS_MIN 6  /* from here on it beats the one-token path (packing each group of rows costs) */

int edgelin_grouped(int64_t M) {
#if defined(__x86_64__) || defined(_M_X64)
  return M >= TOKENS_MIN && !edgelin_token_tiles(M) && edgelin_avx2();
#else
  (void)M;
  return 0;
#endif
}

#if defined(__x86_64__) || defined(_M_X64)
/* 8 registers of 8 rows' 32 codes of one block (v[r]: row r's groups 0..7, 4 bytes each) -> out[g]: group g of
   rows 0..7 (an 8 x 8 transpose of 4-byte groups). */
AVX2 static inline __attribute__((always_inline)) void transpose_store(const __m256i* v, uint8_t* codes) {
  __m256i t0 = _mm256_unpacklo_epi32(v[0], v[1]), t1 = _mm256_unpackhi_epi32(v[0], v[1]);
  __m256i t2 = _mm256_unpacklo_epi32(v[2], v[3]), t3 = _mm256_unpackhi_epi32(v[2], v[3]);
  __m256i t4 = _mm256_unpacklo_epi32(v[4], v[5]), t5 = _mm256_unpackhi_epi32(v[4], v[5]);
  __m256i t6 = _mm256_unpacklo_epi32(v[6], v[7]), t7 = _mm256_unpackhi_epi32(v[6], v[7]);
  __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
  __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
  __m256i u4 = _mm256_unpacklo_epi64(t4, t6), u5 = _mm256_unpackhi_epi64(t4, t6);
  __m256i u6 = _mm256_unpacklo_epi64(t5, t7), u7 = _mm256_unpackhi_epi64(t5, t7);
  __m256i* out = (__m256i*)codes;
  _mm256_storeu_si256(out + 0, _mm256_permute2x128_si256(u0, u4, 0x20));
  _mm256_storeu_si256(out + 1, _mm256_permute2x128_si256(u1, u5, 0x20));
  _mm256_storeu_si256(out + 2, _mm256_permute2x128_si256(u2, u6, 0x20));
  _mm256_storeu_si256(out + 3, _mm256_permute2x128_si256(u3, u7, 0x20));
  _mm256_storeu_si256(out + 4, _mm256_permute2x128_si256(u0, u4, 0x31));
  _mm256_storeu_si256(out + 5, _mm256_permute2x128_si256(u1, u5, 0x31));
  _mm256_storeu_si256(out + 6, _mm256_permute2x128_si256(u2, u6, 0x31));
  _mm256_storeu_si256(out + 7, _mm256_permute2x128_si256(u3, u7, 0x31));
}

/* Bytes of one block's packed codes: 8 groups x GROUP rows x 4, once per nibble plane. */
#define PLANE (8 * GROUP * 4)

/* Rows n .. n + R - 1 (R <= GROUP; the rest zero) into codes [nb][planes][8 groups][GROUP rows][4] bytes (4 bits:
   one plane, the codes; 8 bits: the low nibbles, then the high ones), their scales [nb][GROUP] and zero-point terms
   [nb][GROUP] (scale x zero point). */
AVX2 static inline __attribute__((always_inline)) void pack_group(int bits, const uint8_t* w, const float* scales,
                                                                  const uint8_t* zero_points, int64_t nb, int64_t n,
                                                                  int64_t R, uint8_t* codes, float* sw, float* off) {
  const __m128i low = _mm_set1_epi8(0x0F);
  const __m256i low256 = _mm256_set1_epi8(0x0F);
  int64_t zb = bits == 4 ? (nb + 1) / 2 : nb;
  for (int64_t b = 0; b < nb; ++b) {
    __m256i v[GROUP], hi8[GROUP];
    for (int r = 0; r < GROUP; ++r) {
      if (r >= R) {
        v[r] = hi8[r] = _mm256_setzero_si256();
        sw[b * GROUP + r] = off[b * GROUP + r] = 0.0f;
        continue;
      }
      const uint8_t* zr = zero_points ? zero_points + (n + r) * zb : NULL;
      int zero;
      if (bits == 4) {
        __m128i packed = _mm_loadu_si128((const __m128i*)(w + ((n + r) * nb + b) * 16));
        __m128i lo = _mm_and_si128(packed, low), hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low);
        v[r] = _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));  /* codes 0..31 in order */
        zero = q4_zero_point(zr, b);
      } else {
        __m256i whole = _mm256_loadu_si256((const __m256i*)(w + ((n + r) * nb + b) * BLOCK));
        v[r] = _mm256_and_si256(whole, low256);
        hi8[r] = _mm256_and_si256(_mm256_srli_epi16(whole, 4), low256);
        zero = zr ? zr[b] : 128;
      }
      float scale = scales[(n + r) * nb + b];
      sw[b * GROUP + r] = scale;
      off[b * GROUP + r] = scale * (float)zero;
    }
    uint8_t* block = codes + b * (bits == 4 ? 1 : 2) * PLANE;
    transpose_store(v, block);
    if (bits == 8) transpose_store(hi8, block + PLANE);
  }
}

/* T tokens (from m0; T <= TOKENS, a constant where inlined) times one packed group of rows n .. n + R - 1:
   y[m, n + r] for each. The same integer dots as the one-token products; the float sums run in another order. */
AVX2 static inline __attribute__((always_inline)) void group_tokens(int bits, const uint8_t* codes, const float* sw,
                                                                    const float* off, const char* scratch,
                                                                    size_t stride, int64_t K, int64_t nb, int64_t m0,
                                                                    int T, int64_t R, float* y, int64_t N) {
  const __m256i ones = _mm256_set1_epi16(1), sixteen = _mm256_set1_epi16(16);
  __m256 acc[TOKENS];
  Scratch s[TOKENS];
  for (int t = 0; t < T; ++t) {
    acc[t] = _mm256_setzero_ps();
    s[t] = view(scratch + (size_t)(m0 + t) * stride, K);
  }
  for (int64_t b = 0; b < nb; ++b) {
    __m256i dot[TOKENS], high[TOKENS];
    for (int t = 0; t < T; ++t) dot[t] = high[t] = _mm256_setzero_si256();
    const uint8_t* cb = codes + b * (bits == 4 ? 1 : 2) * PLANE;
    for (int g = 0; g < 8; ++g) {
      __m256i wv = _mm256_loadu_si256((const __m256i*)(cb + g * GROUP * 4));
      __m256i wh = bits == 8 ? _mm256_loadu_si256((const __m256i*)(cb + PLANE + g * GROUP * 4)) : wv;
      for (int t = 0; t < T; ++t) {
        int32_t four;
        memcpy(&four, s[t].qa + b * BLOCK + 4 * g, 4);
        __m256i a = _mm256_set1_epi32(four);
        /* codes (0..15) x activations, pairs summed into int16 lanes (two per row): 15 x 127 x 2 per pair, so a
           block's 8 groups add up to 30,480 at most, inside int16 */
        dot[t] = _mm256_add_epi16(dot[t], _mm256_maddubs_epi16(wv, a));
        if (bits == 8) high[t] = _mm256_add_epi16(high[t], _mm256_maddubs_epi16(wh, a));
      }
    }
    __m256 scale = _mm256_loadu_ps(sw + b * GROUP), zero = _mm256_loadu_ps(off + b * GROUP);
    for (int t = 0; t < T; ++t) {
      __m256i whole = _mm256_madd_epi16(dot[t], ones);  /* each row's two lanes */
      if (bits == 8) whole = _mm256_add_epi32(whole, _mm256_madd_epi16(high[t], sixteen));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(whole), _mm256_mul_ps(scale, _mm256_set1_ps(s[t].sa[b])), acc[t]);
      acc[t] = _mm256_fnmadd_ps(zero, _mm256_set1_ps(s[t].c[b]), acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) {
    float* row = y + (m0 + t) * N;
    if (R == GROUP) {
      _mm256_storeu_ps(row, acc[t]);
    } else {
      float out[GROUP];
      _mm256_storeu_ps(out, acc[t]);
      for (int64_t r = 0; r < R; ++r) row[r] = out[r];
    }
  }
}

/* Every token times rows n0 .. n1 - 1, a group of 8 rows packed at a time (`bits` a constant where inlined). */
AVX2 static inline __attribute__((always_inline)) int rows_grouped(int bits, const void* scratch, int64_t M, int64_t K,
                                                                  const uint8_t* w, const float* scales,
                                                                  const uint8_t* zero_points, int64_t n0, int64_t n1,
                                                                  float* y, int64_t N) {
  int64_t nb = n_blocks(K), planes = bits == 4 ? 1 : 2;
  size_t stride = edgelin_q4_scratch_bytes(K);
  uint8_t* codes = malloc((size_t)nb * ((size_t)planes * PLANE + 2 * GROUP * sizeof(float)));
  if (!codes) return -1;
  float* sw = (float*)(codes + (size_t)nb * planes * PLANE);
  float* off = sw + nb * GROUP;
  for (int64_t n = n0; n < n1; n += GROUP) {
    int64_t R = n1 - n < GROUP ? n1 - n : GROUP;
    pack_group(bits, w, scales, zero_points, nb, n, R, codes, sw, off);
    int64_t m = 0;
    for (; m + TOKENS <= M; m += TOKENS)
      group_tokens(bits, codes, sw, off, scratch, stride, K, nb, m, TOKENS, R, y + n, N);
    switch (M - m) {  /* constant T for each: unrolled */
      case 3: group_tokens(bits, codes, sw, off, scratch, stride, K, nb, m, 3, R, y + n, N); break;
      case 2: group_tokens(bits, codes, sw, off, scratch, stride, K, nb, m, 2, R, y + n, N); break;
      case 1: group_tokens(bits, codes, sw, off, scratch, stride, K, nb, m, 1, R, y + n, N); break;
      default: break;
    }
  }
  free(codes);
  return 0;
}

AVX2 static int rows_grouped4(const void* scratch, int64_t M, int64_t K, const uint8_t* w, const float* scales,
                              const uint8_t* zero_points, int64_t n0, int64_t n1, float* y, int64_t N) {
  return rows_grouped(4, scratch, M, K, w, scales, zero_points, n0, n1, y, N);
}

AVX2 static int rows_grouped8(const void* scratch, int64_t M, int64_t K, const uint8_t* w, const float* scales,
                              const uint8_t* zero_points, int64_t n0, int64_t n1, float* y, int64_t N) {
  return rows_grouped(8, scratch, M, K, w, scales, zero_points, n0, n1, y, N);
}
#endif

int edgelin_rows_grouped(int bits, const void* scratch, int64_t M, int64_t K, const uint8_t* weights,
                         const float* scales, const uint8_t* zero_points, int64_t n0, int64_t n1, float* y,
                         int64_t N) {
#if defined(__x86_64__) || defined(_M_X64)
  return (bits == 8 ? rows_grouped8 : rows_grouped4)(scratch, M, K, weights, scales, zero_points, n0, n1, y, N);
#else
  (void)bits, (void)scratch, (void)M, (void)K, (void)weights, (void)scales, (void)zero_points, (void)n0, (void)n1,
      (void)y, (void)N;
  return -1;
#endif
}
