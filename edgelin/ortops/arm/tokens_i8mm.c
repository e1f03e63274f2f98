/* The 4- and 8-bit products for several tokens at once (a prefill piece, a batch) with i8mm's USMMLA (Cortex-A710 /
   X2 and later, Neoverse V1 / N2): one instruction multiplies a 2 x 8 matrix of unsigned codes (two weight rows) by
   a 2 x 8 matrix of int8 activations (two tokens) into the 2 x 2 int32 sums, 32 multiply-adds where SDOT does 16,
   and each of the four sums lands in a lane of its own: a block's four dots (2 rows x 2 tokens) are scaled by one
   multiply and one FMA, with no horizontal adds. The operands are each row pair's and each token pair's bytes
   zipped 8 at a time, once per call (the weights once per row pair, reused by every token pair). The 4-bit codes
   are the block's low nibbles (its even values) and high nibbles (its odd ones), matched with the 4-bit scratch's
   even and odd activations; the 8-bit codes are the block's two 16-byte halves. The scratch is the one-token
   product's, one per token (q4_gemv.h, q8_gemv.h). */
#if defined(__aarch64__)
#pragma GCC target("arch=armv8.2-a+dotprod+i8mm")
#include <arm_neon.h>
#include <stdlib.h>

#include "../q4_scratch.h"
#include "neon.h"

#define INLINE __attribute__((always_inline)) static inline

/* Block b's 32 activation values of one token's scratch, as two 16-byte halves matching the codes' halves */
INLINE void activation_halves(Scratch s, int bits, int64_t b, int8x16_t* first, int8x16_t* second) {
  const int8_t* p = bits == 8 ? s.qa + b * BLOCK : s.qa + (b / 2) * 64 + (b % 2) * 16;
  *first = vld1q_s8(p);
  *second = vld1q_s8(p + (bits == 8 ? 16 : 32));
}

/* Block b's 32 codes of one row, as two 16-byte halves */
INLINE void code_halves(const uint8_t* w, int bits, int64_t nb, int64_t row, int64_t b, uint8x16_t* first,
                        uint8x16_t* second) {
  if (bits == 8) {
    const uint8_t* p = w + (row * nb + b) * BLOCK;
    *first = vld1q_u8(p);
    *second = vld1q_u8(p + 16);
  } else {
    uint8x16_t v = vld1q_u8(w + (row * nb + b) * 16);
    *first = vandq_u8(v, vdupq_n_u8(0x0F));
    *second = vshrq_n_u8(v, 4);
  }
}

static float zero_point(const uint8_t* zero_points, int bits, int64_t nb, int64_t row, int64_t b) {
  if (bits == 8) return zero_points ? (float)zero_points[row * nb + b] : 128.0f;
  return (float)q4_zero_point(zero_points ? zero_points + row * ((nb + 1) / 2) : NULL, b);
}

/* The four 8-byte segments of two 32-byte blocks (x = x0 x1, y = y0 y1), paired as USMMLA's 2 x 8 operands:
   out[j] = [segment j of x, segment j of y] */
INLINE void pair_segments(uint8x16_t x0, uint8x16_t x1, uint8x16_t y0, uint8x16_t y1, uint8x16_t* out) {
  uint64x2_t a0 = vreinterpretq_u64_u8(x0), a1 = vreinterpretq_u64_u8(x1);
  uint64x2_t b0 = vreinterpretq_u64_u8(y0), b1 = vreinterpretq_u64_u8(y1);
  out[0] = vreinterpretq_u8_u64(vzip1q_u64(a0, b0));
  out[1] = vreinterpretq_u8_u64(vzip2q_u64(a0, b0));
  out[2] = vreinterpretq_u8_u64(vzip1q_u64(a1, b1));
  out[3] = vreinterpretq_u8_u64(vzip2q_u64(a1, b1));
}

/* One token pair (t0, t1; t1 == t0 for a lone last token): per block its 4 paired operands (int8 bytes), then the
   pair's activation scales and scaled sums as [s0, s1, s0, s1] (the lanes of a row pair's result) */
static void zip_tokens(const void* scratch, size_t stride, int64_t K, int bits, int64_t t0, int64_t t1,
                       uint8x16_t* ops, float* scales, float* sums) {
  Scratch a = view((const char*)scratch + (size_t)t0 * stride, K), c = view((const char*)scratch + (size_t)t1 * stride, K);
  int64_t nb = n_blocks(K);
  for (int64_t b = 0; b < nb; ++b) {
    int8x16_t a0, a1, c0, c1;
    activation_halves(a, bits, b, &a0, &a1);
    activation_halves(c, bits, b, &c0, &c1);
    pair_segments(vreinterpretq_u8_s8(a0), vreinterpretq_u8_s8(a1), vreinterpretq_u8_s8(c0), vreinterpretq_u8_s8(c1),
                  ops + 4 * b);
    float sa[4] = {a.sa[b], c.sa[b], a.sa[b], c.sa[b]}, cs[4] = {a.c[b], c.c[b], a.c[b], c.c[b]};
    vst1q_f32(scales + 4 * b, vld1q_f32(sa));
    vst1q_f32(sums + 4 * b, vld1q_f32(cs));
  }
}

/* One row pair (r0, r1): its zipped codes, and per block its weight scales [w0, w0, w1, w1] and zero-point terms
   [w0 z0, w0 z0, w1 z1, w1 z1] */
static void zip_rows(const uint8_t* w, const float* scales, const uint8_t* zero_points, int bits, int64_t nb,
                     int64_t r0, int64_t r1, uint8x16_t* ops, float* ws, float* zs) {
  for (int64_t b = 0; b < nb; ++b) {
    uint8x16_t p0, p1, q0, q1;
    code_halves(w, bits, nb, r0, b, &p0, &p1);
    code_halves(w, bits, nb, r1, b, &q0, &q1);
    pair_segments(p0, p1, q0, q1, ops + 4 * b);
    float w0 = scales[r0 * nb + b], w1 = scales[r1 * nb + b];
    float z0 = w0 * zero_point(zero_points, bits, nb, r0, b), z1 = w1 * zero_point(zero_points, bits, nb, r1, b);
    float wv[4] = {w0, w0, w1, w1}, zv[4] = {z0, z0, z1, z1};
    vst1q_f32(ws + 4 * b, vld1q_f32(wv));
    vst1q_f32(zs + 4 * b, vld1q_f32(zv));
  }
}

int edgelin_i8mm_rows_tokens(int bits, const void* scratch, size_t stride, int64_t M, int64_t K,
                             const uint8_t* weights, const float* scales, const uint8_t* zero_points, int64_t n0,
                             int64_t n1, float* y, int64_t N) {
  int64_t nb = n_blocks(K), pairs = (M + 1) / 2;
  /* every token pair's operands and scales, then one row pair's: (pairs + 1) x nb x (64 + 32) bytes */
  char* buffer = malloc((size_t)(pairs + 1) * (size_t)nb * (4 * 16 + 8 * sizeof(float)));
  if (!buffer) return -1;
  uint8x16_t* token_ops = (uint8x16_t*)buffer;
  float* token_scales = (float*)(token_ops + pairs * nb * 4);
  float* token_sums = token_scales + pairs * nb * 4;
  uint8x16_t* row_ops = (uint8x16_t*)(token_sums + pairs * nb * 4);
  float* row_scales = (float*)(row_ops + nb * 4);
  float* row_zeros = row_scales + nb * 4;
  for (int64_t p = 0; p < pairs; ++p) {
    int64_t t0 = 2 * p, t1 = t0 + 1 < M ? t0 + 1 : t0;
    zip_tokens(scratch, stride, K, bits, t0, t1, token_ops + p * nb * 4, token_scales + p * nb * 4,
               token_sums + p * nb * 4);
  }
  for (int64_t r0 = n0; r0 < n1; r0 += 2) {
    int64_t r1 = r0 + 1 < n1 ? r0 + 1 : r0;
    zip_rows(weights, scales, zero_points, bits, nb, r0, r1, row_ops, row_scales, row_zeros);
    for (int64_t p = 0; p < pairs; ++p) {
      const uint8x16_t* a = token_ops + p * nb * 4;
      const float *sa = token_scales + p * nb * 4, *c = token_sums + p * nb * 4;
      float32x4_t acc = vdupq_n_f32(0.0f), off = vdupq_n_f32(0.0f);
      for (int64_t b = 0; b < nb; ++b) {
        int32x4_t dot = vusmmlaq_s32(vdupq_n_s32(0), row_ops[4 * b], vreinterpretq_s8_u8(a[4 * b]));
        dot = vusmmlaq_s32(dot, row_ops[4 * b + 1], vreinterpretq_s8_u8(a[4 * b + 1]));
        dot = vusmmlaq_s32(dot, row_ops[4 * b + 2], vreinterpretq_s8_u8(a[4 * b + 2]));
        dot = vusmmlaq_s32(dot, row_ops[4 * b + 3], vreinterpretq_s8_u8(a[4 * b + 3]));
        acc = vfmaq_f32(acc, vcvtq_f32_s32(dot), vmulq_f32(vld1q_f32(row_scales + 4 * b), vld1q_f32(sa + 4 * b)));
        off = vfmaq_f32(off, vld1q_f32(row_zeros + 4 * b), vld1q_f32(c + 4 * b));
      }
      float out[4];
      vst1q_f32(out, vsubq_f32(acc, off));  /* lanes: r0 t0, r0 t1, r1 t0, r1 t1 */
      int64_t t0 = 2 * p;
      y[t0 * N + r0] = out[0];
      if (r1 != r0) y[t0 * N + r1] = out[2];
      if (t0 + 1 < M) {
        y[(t0 + 1) * N + r0] = out[1];
        if (r1 != r0) y[(t0 + 1) * N + r1] = out[3];
      }
    }
  }
  free(buffer);
  return 0;
}
#endif
