/* The 4-bit and 8-bit products' private layout (q4_gemv.c, q4_gemm.c, q8_gemv.c): one token's int8 activation
   blocks, and the AVX2 helpers the files read them with. Not part of the library's interface. */
#ifndef EDGELIN_Q4_SCRATCH_H
#define EDGELIN_Q4_SCRATCH_H
#include <stdint.h>
#include <string.h>

#define BLOCK 32

typedef struct {
  float* sa;    /* [nb8] activation block scales */
  float* c;     /* [nb8] scale * sum of the block's int8 values */
  int8_t* qa;   /* 4-bit: per pair of blocks (b, b+1), 32 even-position values, then 32 odd ones;
                   8-bit: block b's 32 values at 32 b */
} Scratch;

static inline int64_t n_blocks(int64_t K) { return (K + BLOCK - 1) / BLOCK; }
static inline int64_t padded8(int64_t n) { return (n + 7) / 8 * 8; }

static inline Scratch view(const void* scratch, int64_t K) {
  Scratch s;
  int64_t nb8 = padded8(n_blocks(K));
  s.sa = (float*)scratch;
  s.c = s.sa + nb8;
  s.qa = (int8_t*)(s.c + nb8);
  return s;
}

/* Block b's 4-bit zero point of a row whose packed zero points start at zr (two per byte, low nibble first, as
   MatMulNBits stores them; NULL: 8, its default). */
static inline int q4_zero_point(const uint8_t* zr, int64_t b) { return zr ? (zr[b / 2] >> (4 * (b % 2))) & 15 : 8; }

/* A one-token product's signature (edgelin_q4_rows, edgelin_q8_rows: q4_gemv.h, q8_gemv.h). */
typedef void (*TokenRows)(const void* scratch, int64_t K, const uint8_t* weights, const float* scales,
                          const uint8_t* zero_points, int64_t n0, int64_t n1, float* y);

/* M tokens' scratches (one after another, `stride` bytes each) through a one-token product, 16 weight rows at a time:
   a slice of K = 768 is 6 KB of 4-bit (12 KB of 8-bit) codes, read from L1 by every token after the first; one token
   after another over all N rows would stream the whole matrix once per token. y [M, N], rows n0 <= n < n1. */
static inline void token_by_token(TokenRows rows, const void* scratch, size_t stride, int64_t M, int64_t K,
                                  const uint8_t* weights, const float* scales, const uint8_t* zero_points, int64_t n0,
                                  int64_t n1, float* y, int64_t N) {
  for (int64_t n = n0; n < n1; n += 16) {
    int64_t end = n + 16 < n1 ? n + 16 : n1;
    for (int64_t m = 0; m < M; ++m)
      rows((const char*)scratch + (size_t)m * stride, K, weights, scales, zero_points, n, end, y + m * N);
  }
}

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2,fma")))
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")))

AVX2 static inline __m256i mask_first(int64_t count) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* The sum of v's eight int32 lanes. */
AVX2 static inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

/* `bytes` from p towards L1, a prefetch per 64-byte line. The one-token products read ROWS weight rows at once:
   as many interleaved streams of codes, scales and zero points, which the hardware prefetchers follow late (and
   never across a 4 KB page: four rows of 1 KB are one page each group). Each 8-block step therefore asks for the
   same blocks of the rows one group on (Zen 3, 4-bit [2048 -> 8512] from memory: 3.1 -> 7.0 GB/s of a read rate of
   9.1; docs/benchmarks.md, "The 4- and 8-bit products from memory").
   Always inlined: GCC 12 takes a called prefetch-only function for one without effects and drops its calls. */
AVX2 static inline __attribute__((always_inline)) void prefetch_ahead(const void* p, int64_t bytes) {
  for (int64_t j = 0; j < bytes; j += 64) _mm_prefetch((const char*)p + j, _MM_HINT_T0);
}

/* The 4-bit one-token paths' prefetch at block b (a multiple of 8, `left` blocks on): row r of the next group of
   ROWS rows (wr, sr, zr: this group's first row's codes, scales and packed zero points). */
AVX2 static inline __attribute__((always_inline)) void prefetch_next_q4(const uint8_t* wr, const float* sr,
                                                                        const uint8_t* zr, int64_t nb, int64_t b,
                                                                        int64_t left, int rows, int r) {
  prefetch_ahead(wr + ((rows + r) * nb + b) * 16, left * 16);
  prefetch_ahead(sr + (rows + r) * nb + b, 32);
  if (zr) prefetch_ahead(zr + (rows + r) * ((nb + 1) / 2) + b / 2, 4);
}

/* Blocks b .. b + 7's zero points (b a multiple of 8) of a row whose packed zero points (zb bytes) start at zr, as
   floats; NULL: 8 each. Two per byte, low nibble first: 4 bytes, shifted per lane. */
AVX2 static inline __m256 zero_points8(const uint8_t* zr, int64_t zb, int64_t b) {
  if (!zr) return _mm256_set1_ps(8.0f);
  uint32_t word = 0;
  if (b / 2 + 4 <= zb) {
    memcpy(&word, zr + b / 2, 4);  /* (a fixed size: one load) */
  } else {  /* a row's last group holds fewer */
    for (int64_t i = b / 2; i < zb; ++i) word |= (uint32_t)zr[i] << (8 * (i - b / 2));
  }
  __m256i v = _mm256_srlv_epi32(_mm256_set1_epi32((int)word), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
  return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
}

#endif
#endif
