/* edgelin's 8-bit weight products for several tokens at once: a prefill piece, or a batch (see q8_gemv.h).

   With AVX-512 VNNI, 16 tokens share a 512-bit register: lane t holds token t. The activations of a tile of 16
   tokens are stored transposed, per block and per 4 values: [block][4-value group][token][4 bytes], with their
   scales and sums as [block][token]. Each weight row's 4 bytes of a group are broadcast to all 16 lanes as part of
   vpdpbusd, which then adds that group to all 16 tokens' dots at once; after a block's 8 groups each lane holds its
   token's whole block dot, scaled once (the int -> float conversion, one multiply and one FMA per block, row and 16
   tokens). The one-token layout (two blocks per register, a block's dot spread over 8 lanes) converts and scales
   every 64 weights per row and token: 1676 x 384 weights by 128 tokens ran at 41 GMAC/s on one Zen 4 core that
   way, 129 GMAC/s this way (issue 13's twenty-third session; docs/performance.md#cpu-step-latency). With AVX2 alone,
   from 6 tokens, 8 weight rows share a register, each code's two nibbles multiplied as 4-bit codes are
   (nbits_grouped.c). Otherwise (fewer tokens, or no AVX2) each token goes through the one-token path
   (edgelin_q8_rows), slice by slice of weight rows. */
#include <string.h>

#include "nbits_grouped.h"
#include "q4_gemv.h"
#include "q4_scratch.h"
#include "q8_gemv.h"
#include "arm/neon.h"

#define TILE 16    /* tokens per tile: one per 32-bit lane of a 512-bit register */
#define ROWS 8     /* weight rows per step: 8 independent vpdpbusd chains */
#define GROUPS 8   /* 4-value groups per 32-value block */

/* The tiled path's condition; the scratch size, the quantisation and the products (8-bit and 4-bit) agree on it. */
int edgelin_token_tiles(int64_t M) {
#if defined(__x86_64__) || defined(_M_X64)
  return M > 1 && edgelin_avx512_vnni();
#else
  (void)M;
  return 0;
#endif
}

static int tiled(int64_t M) { return edgelin_token_tiles(M); }

/* One tile's bytes: scales and sums [nb][TILE] floats, values [nb][GROUPS][TILE][4]. */
static size_t tile_bytes(int64_t nb) { return (size_t)nb * (2 * TILE * sizeof(float) + GROUPS * TILE * 4); }

typedef struct {
  float* sa;   /* [nb][TILE] activation block scales */
  float* c;    /* [nb][TILE] scale * sum of the block's int8 values */
  int8_t* qa;  /* [nb][GROUPS][TILE][4] */
} Tile;

static Tile tile_at(const void* scratch, int64_t nb, int64_t index) {
  char* base = (char*)scratch + (size_t)index * tile_bytes(nb);
  Tile t = {(float*)base, (float*)base + nb * TILE, (int8_t*)(base + 2 * nb * TILE * sizeof(float))};
  return t;
}

size_t edgelin_q8_tokens_scratch_bytes(int64_t M, int64_t K) {
  if (!tiled(M)) return (size_t)M * edgelin_q4_scratch_bytes(K);
  /* the tiles, then one token's scratch to quantise into before it is spread over its tile */
  return (size_t)((M + TILE - 1) / TILE) * tile_bytes(n_blocks(K)) + edgelin_q4_scratch_bytes(K);
}

void edgelin_q8_quantize_tokens(const float* x, int64_t M, int64_t K, void* scratch) {
  if (!tiled(M)) {
    size_t stride = edgelin_q4_scratch_bytes(K);
    for (int64_t m = 0; m < M; ++m) edgelin_q8_quantize(x + m * K, K, (char*)scratch + (size_t)m * stride);
    return;
  }
  int64_t nb = n_blocks(K), tiles = (M + TILE - 1) / TILE;
  memset(scratch, 0, (size_t)tiles * tile_bytes(nb));  /* a last tile's missing tokens: zero dots, zero sums */
  void* one = (char*)scratch + (size_t)tiles * tile_bytes(nb);
  for (int64_t m = 0; m < M; ++m) {
    edgelin_q8_quantize(x + m * K, K, one);
    Scratch s = view(one, K);
    Tile t = tile_at(scratch, nb, m / TILE);
    int64_t lane = m % TILE;
    for (int64_t b = 0; b < nb; ++b) {
      t.sa[b * TILE + lane] = s.sa[b];
      t.c[b * TILE + lane] = s.c[b];
      for (int g = 0; g < GROUPS; ++g) memcpy(t.qa + ((b * GROUPS + g) * TILE + lane) * 4, s.qa + b * BLOCK + 4 * g, 4);
    }
  }
}

#if defined(__x86_64__) || defined(_M_X64)
/* Rows n .. n + R - 1 (R <= ROWS) of one tile's `count` tokens (m0 the first). Always inlined: a constant R keeps
   the 2 R accumulators in registers. */
AVX512 static inline __attribute__((always_inline)) void tile_rows(Tile t, int64_t nb, const uint8_t* w,
                                                                   const float* scales, const uint8_t* zero_points,
                                                                   int64_t n, int R, int64_t m0, int64_t count,
                                                                   float* y, int64_t N) {
  __m512 acc[ROWS];
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i dot[ROWS];
    for (int r = 0; r < ROWS; ++r) dot[r] = _mm512_setzero_si512();
    const int8_t* qb = t.qa + b * GROUPS * TILE * 4;
    for (int g = 0; g < GROUPS; ++g) {
      __m512i a = _mm512_loadu_si512((const void*)(qb + g * TILE * 4));
      for (int r = 0; r < R; ++r) {
        int32_t codes;
        memcpy(&codes, w + ((n + r) * nb + b) * BLOCK + 4 * g, 4);
        dot[r] = _mm512_dpbusd_epi32(dot[r], _mm512_set1_epi32(codes), a);
      }
    }
    __m512 sa = _mm512_loadu_ps(t.sa + b * TILE), c = _mm512_loadu_ps(t.c + b * TILE);
    for (int r = 0; r < R; ++r) {
      float scale = scales[(n + r) * nb + b];
      float zero = zero_points ? (float)zero_points[(n + r) * nb + b] : 128.0f;
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(_mm512_set1_ps(scale), sa), acc[r]);
      acc[r] = _mm512_fnmadd_ps(_mm512_set1_ps(scale * zero), c, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float out[TILE];
    _mm512_storeu_ps(out, acc[r]);
    for (int64_t k = 0; k < count; ++k) y[(m0 + k) * N + n + r] = out[k];
  }
}

AVX512 static void rows_tiled(const void* scratch, int64_t M, int64_t K, const uint8_t* w, const float* scales,
                              const uint8_t* zero_points, int64_t n0, int64_t n1, float* y, int64_t N) {
  int64_t nb = n_blocks(K);
  for (int64_t m0 = 0; m0 < M; m0 += TILE) {
    Tile t = tile_at(scratch, nb, m0 / TILE);
    int64_t count = M - m0 < TILE ? M - m0 : TILE, n = n0;
    for (; n + ROWS <= n1; n += ROWS) tile_rows(t, nb, w, scales, zero_points, n, ROWS, m0, count, y, N);
    switch (n1 - n) {  /* constant R for each: unrolled */
      case 7: tile_rows(t, nb, w, scales, zero_points, n, 7, m0, count, y, N); break;
      case 6: tile_rows(t, nb, w, scales, zero_points, n, 6, m0, count, y, N); break;
      case 5: tile_rows(t, nb, w, scales, zero_points, n, 5, m0, count, y, N); break;
      case 4: tile_rows(t, nb, w, scales, zero_points, n, 4, m0, count, y, N); break;
      case 3: tile_rows(t, nb, w, scales, zero_points, n, 3, m0, count, y, N); break;
      case 2: tile_rows(t, nb, w, scales, zero_points, n, 2, m0, count, y, N); break;
      case 1: tile_rows(t, nb, w, scales, zero_points, n, 1, m0, count, y, N); break;
      default: break;
    }
  }
}
#endif

int edgelin_q8_rows_tokens(const void* scratch, int64_t M, int64_t K, const uint8_t* weights, const float* scales,
                           const uint8_t* zero_points, int64_t n0, int64_t n1, float* y, int64_t N) {
#if defined(__x86_64__) || defined(_M_X64)
  if (tiled(M)) {
    rows_tiled(scratch, M, K, weights, scales, zero_points, n0, n1, y, N);
    return 0;
  }
#endif
#if defined(__aarch64__)
  if (M > 1 && edgelin_arm() >= EDGELIN_ARM_I8MM)
    return edgelin_i8mm_rows_tokens(8, scratch, edgelin_q4_scratch_bytes(K), M, K, weights, scales, zero_points,
                                    n0, n1, y, N);
#endif
  if (edgelin_grouped(M)) return edgelin_rows_grouped(8, scratch, M, K, weights, scales, zero_points, n0, n1, y, N);
  token_by_token(edgelin_q8_rows, scratch, edgelin_q4_scratch_bytes(K), M, K, weights, scales, zero_points, n0, n1, y,
                 N);
  return 0;
}
