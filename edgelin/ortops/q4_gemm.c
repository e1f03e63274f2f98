/* edgelin's 4-bit weight products for several tokens at once: a prefill piece, or a batch (see q4_gemv.h).

   With AVX-512 VNNI the 4-bit codes run on the 8-bit product's token tiles (q8_gemm.c: 16 tokens per register,
   each row's codes broadcast to all 16, a block's dot scaled once per 16 tokens): each slice of up to 128 weight rows
   is first unpacked to one code per byte (and its zero points to one per byte) in a buffer of its own, then
   multiplied by every tile of tokens: each code is unpacked once per piece and read by every tile (4 tiles for the
   64-token pieces a constant-memory model prefills in, onnx_runtime.CONSTANT_MEMORY_PREFILL_PIECE). The 4-bit codes
   read into registers as nibbles (the earlier layout of this file: four rows by four tokens, each 64-byte
   load unpacked per step) ran at 63-74 GMAC/s per core on the Mamba2 peer's shapes, the tiles at 126-136
   (issue 13's twenty-third session; docs/performance.md#cpu-step-latency).

   With AVX2 alone (no vpdpbusd), from 6 tokens, 8 weight rows share a register instead (nbits_grouped.c, which
   the 8-bit product shares). The one-token path per token (a block's dot over 8 lanes of one row, scaled per 64
   weights and row, the codes unpacked again for every token) had run the prefill's products 1.4x slower than ONNX
   Runtime's prepacked MatMulNBits there, now 0.87x (bench/matmul_nbits.py --tokens 64).
   Otherwise (fewer tokens, or no AVX2) each token goes through the one-token path (edgelin_q4_rows), slice by
   slice of weight rows. */
#include <stdlib.h>
#include <string.h>

#include "nbits_grouped.h"
#include "q4_gemv.h"
#include "q4_scratch.h"
#include "q8_gemv.h"
#include "arm/neon.h"

/* Rows unpacked at once for the tiles: 128 rows of K = 768 are 96 KB of bytes, in L2. */
#define SLICE 128

/* The tiled path's condition: the 8-bit product's, whose scratch it then uses. */
static int tiled(int64_t M) { return edgelin_token_tiles(M); }

/* The AVX2 path's: each token's scratch is the one-token one, its blocks in their natural order (the 8-bit
   product's, edgelin_q8_quantize) instead of the 4-bit product's pairs. */
static int grouped(int64_t M) { return edgelin_grouped(M); }

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
#endif
#if defined(__aarch64__)
  if (M > 1 && edgelin_arm() >= EDGELIN_ARM_I8MM)
    return edgelin_i8mm_rows_tokens(4, scratch, edgelin_q4_scratch_bytes(K), M, K, weights, scales, zero_points,
                                    n0, n1, y, N);
#endif
  if (grouped(M)) return edgelin_rows_grouped(4, scratch, M, K, weights, scales, zero_points, n0, n1, y, N);
  token_by_token(edgelin_q4_rows, scratch, edgelin_q4_scratch_bytes(K), M, K, weights, scales, zero_points, n0, n1, y,
                 N);
  return 0;
}
