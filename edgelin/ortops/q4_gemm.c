/* edgelin's 4-bit weight products for several tokens at once: a prefill piece, or a batch (see q4_gemv.h).

   With AVX-512 VNNI the 4-bit codes run on the 8-bit product's token tiles (q8_gemm.c: 16 tokens per register,
   each row's codes broadcast to all 16, a block's dot scaled once per 16 tokens): each slice of up to 128 weight rows
   is first unpacked to one code per byte (and its zero points to one per byte) in a buffer of its own, then
   multiplied by every tile of tokens: each code is unpacked once per piece and read by every tile (4 tiles for the
   64-token pieces a constant-memory model prefills in, onnx_runtime.CONSTANT_MEMORY_PREFILL_PIECE). The 4-bit codes
   read into registers as nibbles (the earlier layout of this file: four rows by four tokens, each 64-byte
   load unpacked per step) ran at 63-74 GMAC/s per core on the Mamba2 peer's shapes, the tiles at 126-136
   (issue 13's twenty-third session; docs/performance.md#cpu-step-latency).

   With AVX2 alone (no vpdpbusd), from TOKENS_MIN tokens, 8 weight rows share a register instead (two int16 lanes
   each): each group of 8 rows is first unpacked to one code per byte and transposed to [block][4-value group][row]
   [4] (8 rows' 4 codes in one 32-byte load), then every token's 4 activations of a group are broadcast to the 8
   rows and one vpmaddubsw adds them to the 8 rows' int16 sums at once; a block's sums go to int32 (vpmaddwd) and
   are scaled once per 8 rows and token. TOKENS tokens at a time keep their sums in registers, so each load of
   codes serves all of them (64 tokens x 2048 x 2048 on a busy Zen 3 core: 27 -> 48 GMAC/s; fewer than
   TOKENS_MIN tokens do not pay for the packing). The one-token path per token (a block's dot over 8 lanes of one
   row, scaled per 64 weights and row, the codes unpacked again for every token) had run the prefill's products
   1.4x slower than ONNX Runtime's prepacked MatMulNBits there, now 0.87x (bench/matmul_nbits.py --tokens 64).
   Otherwise (fewer tokens, or no AVX2) each token goes through the one-token path (edgelin_q4_rows), slice by
   slice of weight rows. */
#include <stdlib.h>
#include <string.h>

#include "q4_gemv.h"
#include "q4_scratch.h"
#include "q8_gemv.h"

/* Rows unpacked at once for the tiles: 128 rows of K = 768 are 96 KB of bytes, in L2. */
#define SLICE 128

#define GROUP 8       /* weight rows per register on the AVX2 path: one per int32 lane */
#define TOKENS 4      /* tokens per step of that path: their dots and sums stay in registers */
#define TOKENS_MIN 6  /* from here on it beats the one-token path (packing each group of rows costs) */

/* The tiled path's condition: the 8-bit product's, whose scratch it then uses. */
static int tiled(int64_t M) { return edgelin_token_tiles(M); }

/* The AVX2 path's: each token's scratch is the one-token one, its blocks in their natural order (the 8-bit
   product's, edgelin_q8_quantize) instead of the 4-bit product's pairs. */
static int grouped(int64_t M) {
#if defined(__x86_64__) || defined(_M_X64)
  return M >= TOKENS_MIN && !tiled(M) && edgelin_avx2();
#else
  (void)M;
  return 0;
#endif
}

size_t edgelin_q4_tokens_scratch_bytes(int64_t M, int64_t K) {
  return tiled(M) ? edgelin_q8_tokens_scratch_bytes(M, K) : (size_t)M * edgelin_q4_scratch_bytes(K);
}

void edgelin_q4_quantize_tokens(const float* x, int64_t M, int64_t K, void* scratch) {
  if (tiled(M)) {
    edgelin_q8_quantize_tokens(x, M, K, scratch);
    return;
  }
  size_t stride = edgelin_q4_scratch_bytes(K);
  void (*quantize)(const float*, int64_t, void*) = grouped(M) ? edgelin_q8_quantize : edgelin_q4_quantize;
  for (int64_t m = 0; m < M; ++m) quantize(x + m * K, K, (char*)scratch + (size_t)m * stride);
}

#if defined(__x86_64__) || defined(_M_X64)
/* rows [R, nb, 16] of packed codes (low nibble first) -> [R, nb, 32] bytes; zero points (NULL: 8) -> [R, nb]. */
AVX2 static void unpack(const uint8_t* w, const uint8_t* zero_points, int64_t nb, int64_t n, int64_t R,
                        uint8_t* codes, uint8_t* zeros) {
  const __m128i low = _mm_set1_epi8(0x0F);
  const uint8_t* src = w + n * nb * 16;
  for (int64_t i = 0; i < R * nb; ++i) {
    __m128i v = _mm_loadu_si128((const __m128i*)(src + i * 16));
    __m128i lo = _mm_and_si128(v, low), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
    _mm_storeu_si128((__m128i*)(codes + i * 32), _mm_unpacklo_epi8(lo, hi));
    _mm_storeu_si128((__m128i*)(codes + i * 32 + 16), _mm_unpackhi_epi8(lo, hi));
  }
  int64_t zb = (nb + 1) / 2;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t b = 0; b < nb; ++b)
      zeros[r * nb + b] = q4_zero_point(zero_points ? zero_points + (n + r) * zb : NULL, b);
}

/* Rows n .. n + R - 1 (R <= GROUP; the rest zero) into codes [nb][8 groups][GROUP rows][4] bytes, their scales
   [nb][GROUP] and zero-point terms [nb][GROUP] (scale x zero point): a row's 32 codes of a block per register,
   then an 8 x 8 transpose of 4-byte groups. */
AVX2 static void pack_group(const uint8_t* w, const float* scales, const uint8_t* zero_points, int64_t nb, int64_t n,
                            int64_t R, uint8_t* codes, float* sw, float* off) {
  const __m128i low = _mm_set1_epi8(0x0F);
  int64_t zb = (nb + 1) / 2;
  for (int64_t b = 0; b < nb; ++b) {
    __m256i v[GROUP];
    for (int r = 0; r < GROUP; ++r) {
      if (r >= R) {
        v[r] = _mm256_setzero_si256();
        sw[b * GROUP + r] = off[b * GROUP + r] = 0.0f;
        continue;
      }
      __m128i packed = _mm_loadu_si128((const __m128i*)(w + ((n + r) * nb + b) * 16));
      __m128i lo = _mm_and_si128(packed, low), hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low);
      v[r] = _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));  /* codes 0..31 in order */
      float scale = scales[(n + r) * nb + b];
      int zero = q4_zero_point(zero_points ? zero_points + (n + r) * zb : NULL, b);
      sw[b * GROUP + r] = scale;
      off[b * GROUP + r] = scale * (float)zero;
    }
    /* v[r] holds row r's groups 0..7 (4 bytes each); out[g] must hold group g of rows 0..7 */
    __m256i t0 = _mm256_unpacklo_epi32(v[0], v[1]), t1 = _mm256_unpackhi_epi32(v[0], v[1]);
    __m256i t2 = _mm256_unpacklo_epi32(v[2], v[3]), t3 = _mm256_unpackhi_epi32(v[2], v[3]);
    __m256i t4 = _mm256_unpacklo_epi32(v[4], v[5]), t5 = _mm256_unpackhi_epi32(v[4], v[5]);
    __m256i t6 = _mm256_unpacklo_epi32(v[6], v[7]), t7 = _mm256_unpackhi_epi32(v[6], v[7]);
    __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
    __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
    __m256i u4 = _mm256_unpacklo_epi64(t4, t6), u5 = _mm256_unpackhi_epi64(t4, t6);
    __m256i u6 = _mm256_unpacklo_epi64(t5, t7), u7 = _mm256_unpackhi_epi64(t5, t7);
    __m256i* out = (__m256i*)(codes + b * 8 * GROUP * 4);
    _mm256_storeu_si256(out + 0, _mm256_permute2x128_si256(u0, u4, 0x20));
    _mm256_storeu_si256(out + 1, _mm256_permute2x128_si256(u1, u5, 0x20));
    _mm256_storeu_si256(out + 2, _mm256_permute2x128_si256(u2, u6, 0x20));
    _mm256_storeu_si256(out + 3, _mm256_permute2x128_si256(u3, u7, 0x20));
    _mm256_storeu_si256(out + 4, _mm256_permute2x128_si256(u0, u4, 0x31));
    _mm256_storeu_si256(out + 5, _mm256_permute2x128_si256(u1, u5, 0x31));
    _mm256_storeu_si256(out + 6, _mm256_permute2x128_si256(u2, u6, 0x31));
    _mm256_storeu_si256(out + 7, _mm256_permute2x128_si256(u3, u7, 0x31));
  }
}

/* T tokens (from m0; T <= TOKENS, a constant where inlined) times one packed group of rows n .. n + R - 1:
   y[m, n + r] for each. The same integer dots as edgelin_q4_rows; the float sums run in another order. */
AVX2 static inline __attribute__((always_inline)) void group_tokens(const uint8_t* codes, const float* sw,
                                                                    const float* off, const char* scratch,
                                                                    size_t stride, int64_t K, int64_t nb, int64_t m0,
                                                                    int T, int64_t R, float* y, int64_t N, int64_t n) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[TOKENS];
  Scratch s[TOKENS];
  for (int t = 0; t < T; ++t) {
    acc[t] = _mm256_setzero_ps();
    s[t] = view(scratch + (size_t)(m0 + t) * stride, K);
  }
  for (int64_t b = 0; b < nb; ++b) {
    __m256i dot[TOKENS];
    for (int t = 0; t < T; ++t) dot[t] = _mm256_setzero_si256();
    const uint8_t* cb = codes + b * 8 * GROUP * 4;
    for (int g = 0; g < 8; ++g) {
      __m256i wv = _mm256_loadu_si256((const __m256i*)(cb + g * GROUP * 4));
      for (int t = 0; t < T; ++t) {
        int32_t four;
        memcpy(&four, s[t].qa + b * BLOCK + 4 * g, 4);
        /* codes (0..15) x activations, pairs summed into int16 lanes (two per row): 15 x 127 x 2 per pair, so a
           block's 8 groups add up to 30,480 at most, inside int16 */
        dot[t] = _mm256_add_epi16(dot[t], _mm256_maddubs_epi16(wv, _mm256_set1_epi32(four)));
      }
    }
    __m256 scale = _mm256_loadu_ps(sw + b * GROUP), zero = _mm256_loadu_ps(off + b * GROUP);
    for (int t = 0; t < T; ++t) {
      __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(dot[t], ones));  /* each row's two lanes */
      acc[t] = _mm256_fmadd_ps(sums, _mm256_mul_ps(scale, _mm256_set1_ps(s[t].sa[b])), acc[t]);
      acc[t] = _mm256_fnmadd_ps(zero, _mm256_set1_ps(s[t].c[b]), acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) {
    float* row = y + (m0 + t) * N + n;
    if (R == GROUP) {
      _mm256_storeu_ps(row, acc[t]);
    } else {
      float out[GROUP];
      _mm256_storeu_ps(out, acc[t]);
      for (int64_t r = 0; r < R; ++r) row[r] = out[r];
    }
  }
}

AVX2 static int rows_grouped(const void* scratch, int64_t M, int64_t K, const uint8_t* w, const float* scales,
                             const uint8_t* zero_points, int64_t n0, int64_t n1, float* y, int64_t N) {
  int64_t nb = n_blocks(K);
  size_t stride = edgelin_q4_scratch_bytes(K);
  uint8_t* codes = malloc((size_t)nb * (8 * GROUP * 4 + 2 * GROUP * sizeof(float)));
  if (!codes) return -1;
  float* sw = (float*)(codes + (size_t)nb * 8 * GROUP * 4);
  float* off = sw + nb * GROUP;
  for (int64_t n = n0; n < n1; n += GROUP) {
    int64_t R = n1 - n < GROUP ? n1 - n : GROUP;
    pack_group(w, scales, zero_points, nb, n, R, codes, sw, off);
    int64_t m = 0;
    for (; m + TOKENS <= M; m += TOKENS)
      group_tokens(codes, sw, off, scratch, stride, K, nb, m, TOKENS, R, y, N, n);
    switch (M - m) {  /* constant T for each: unrolled */
      case 3: group_tokens(codes, sw, off, scratch, stride, K, nb, m, 3, R, y, N, n); break;
      case 2: group_tokens(codes, sw, off, scratch, stride, K, nb, m, 2, R, y, N, n); break;
      case 1: group_tokens(codes, sw, off, scratch, stride, K, nb, m, 1, R, y, N, n); break;
      default: break;
    }
  }
  free(codes);
  return 0;
}
#endif

int edgelin_q4_rows_tokens(const void* scratch, int64_t M, int64_t K, const uint8_t* weights, const float* scales,
                           const uint8_t* zero_points, int64_t n0, int64_t n1, float* y, int64_t N) {
#if defined(__x86_64__) || defined(_M_X64)
  if (tiled(M)) {
    int64_t nb = n_blocks(K);
    uint8_t* codes = malloc((size_t)SLICE * (size_t)nb * (BLOCK + 1));
    if (!codes) return -1;
    uint8_t* zeros = codes + (size_t)SLICE * (size_t)nb * BLOCK;
    for (int64_t n = n0; n < n1; n += SLICE) {
      int64_t rows = n1 - n < SLICE ? n1 - n : SLICE;
      unpack(weights, zero_points, nb, n, rows, codes, zeros);
      edgelin_q8_rows_tokens(scratch, M, K, codes, scales + n * nb, zeros, 0, rows, y + n, N);
    }
    free(codes);
    return 0;
  }
  if (grouped(M)) return rows_grouped(scratch, M, K, weights, scales, zero_points, n0, n1, y, N);
#endif
  token_by_token(edgelin_q4_rows, scratch, edgelin_q4_scratch_bytes(K), M, K, weights, scales, zero_points, n0, n1, y,
                 N);
  return 0;
}
