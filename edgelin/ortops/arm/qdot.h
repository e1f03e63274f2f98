/* The 4-bit and 8-bit one-token products on aarch64 (q4_gemv.h, q8_gemv.h: the same scratch, weights and sums),
   written once and compiled per level by qdot_neon.c and qdot_dotprod.c, each under its own target (a file per
   level: a function that names SDOT must be compiled for it, and is called only where the CPU has it).
   Each instantiation defines, before including this file:
     NAME(x)           its functions' names (edgelin_<level>_x)
     DOT16(acc, a, b)  acc (int32x4) + the products of 16 int8 pairs, summed in lanes (a: codes, b: activations)
   The 8-bit codes are read as q - 128 (int8, one xor) and 128 goes into their zero point; the 4-bit ones (0..15)
   are int8 as they are.
   Four weight rows at once (independent accumulator chains), four blocks per step, straight-line: a block's dot is
   summed to one int32 lane by pairwise adds, then the four blocks are scaled together (scale x activation scale)
   and the zero points' term goes in once per block through the activation sum (offset x c), as on x86. Written
   with loops over arrays guarded by the blocks left, the same work ran 2.2x (4-bit) and 2.1x (8-bit) the
   instructions (docs/arm.md, "Instructions per token"). */
#include <arm_neon.h>
#include <string.h>

#include "../q4_scratch.h" /* Scratch, view, n_blocks, BLOCK, q4_zero_point */

#define QROWS 4
#define INLINE __attribute__((always_inline)) static inline

/* [dot of p0, of p1, of p2, of p3]: each partial's four lanes summed */
INLINE int32x4_t NAME(sum4)(int32x4_t p0, int32x4_t p1, int32x4_t p2, int32x4_t p3) {
  return vpaddq_s32(vpaddq_s32(p0, p1), vpaddq_s32(p2, p3));
}

/* acc += the dots of four blocks (int32x4) x weight scales (sw) x activation scales (sa), less the zero points'
   term (z: zero points as floats, c: the activations' scaled sums) */
INLINE float32x4_t NAME(scale4)(float32x4_t acc, int32x4_t dots, float32x4_t sw, float32x4_t sa, float32x4_t z,
                                float32x4_t c) {
  acc = vfmaq_f32(acc, vcvtq_f32_s32(dots), vmulq_f32(sw, sa));
  return vfmsq_f32(acc, vmulq_f32(sw, z), c);
}

/* The row's 4 values from block b (left < 4 of them past the row's end: zeros), as floats */
INLINE float32x4_t NAME(floats4)(const float* p, int64_t left) {
  if (left >= 4) return vld1q_f32(p);
  float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int64_t i = 0; i < left; ++i) v[i] = p[i];
  return vld1q_f32(v);
}

/* Blocks b .. b + 3's zero points of one row as floats, less `shift`: 8-bit (one byte each, NULL: 128) or 4-bit (two
   per byte, low nibble first, NULL: 8; b a multiple of 4, so the four are two whole bytes) */
INLINE float32x4_t NAME(zero_points4)(const uint8_t* zr, int bits, int64_t b, float shift) {
  if (!zr) return vdupq_n_f32((bits == 8 ? 128.0f : 8.0f) - shift);
  uint32_t word;
  uint32x4_t v;
  if (bits == 8) {
    memcpy(&word, zr + b, 4);
    v = vmovl_u16(vget_low_u16(vmovl_u8(vcreate_u8(word))));
  } else {
    word = (uint32_t)zr[b / 2] | (uint32_t)zr[b / 2 + 1] << 8;
    const int32_t right[4] = {0, -4, -8, -12};
    v = vandq_u32(vshlq_u32(vdupq_n_u32(word), vld1q_s32(right)), vdupq_n_u32(15));
  }
  return vsubq_f32(vcvtq_f32_u32(v), vdupq_n_f32(shift));
}

/* One block of one row: its 32 codes against the token's 32 activations (8-bit: two halves of 16; 4-bit: the low
   nibbles against the even values, the high ones against the odd) */
INLINE int32x4_t NAME(block_dot)(const uint8_t* codes, int bits, int8x16_t a0, int8x16_t a1) {
  const uint8x16_t flip = vdupq_n_u8(0x80);
  if (bits == 8)
    return DOT16(DOT16(vdupq_n_s32(0), vreinterpretq_s8_u8(veorq_u8(vld1q_u8(codes), flip)), a0),
                 vreinterpretq_s8_u8(veorq_u8(vld1q_u8(codes + 16), flip)), a1);
  uint8x16_t v = vld1q_u8(codes);
  return DOT16(DOT16(vdupq_n_s32(0), vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(0x0F))), a0),
               vreinterpretq_s8_u8(vshrq_n_u8(v, 4)), a1);
}

/* Block b's two activation vectors, as block_dot pairs them */
INLINE void NAME(block_activations)(Scratch s, int bits, int64_t b, int8x16_t* a0, int8x16_t* a1) {
  const int8_t* p = bits == 8 ? s.qa + b * BLOCK : s.qa + (b / 2) * 64 + (b % 2) * 16;
  *a0 = vld1q_s8(p);
  *a1 = vld1q_s8(p + (bits == 8 ? 16 : 32));
}

/* Rows n .. n + R - 1 (R <= QROWS and `bits` constants where inlined): whole groups of four blocks straight-line,
   the zero points read as vectors; the last nb % 4 blocks through the general code */
INLINE void NAME(rows_group)(Scratch s, int bits, int64_t nb, const uint8_t* w, const float* scales,
                             const uint8_t* zero_points, int64_t n, int R, float* y) {
  const int64_t row_bytes = nb * (bits == 8 ? BLOCK : 16), block_bytes = bits == 8 ? BLOCK : 16;
  const int64_t zero_bytes = bits == 8 ? nb : (nb + 1) / 2;
  const float shift = bits == 8 ? 128.0f : 0.0f;  /* the 8-bit codes' q - 128 */
  float32x4_t acc[QROWS];
  for (int r = 0; r < QROWS; ++r) acc[r] = vdupq_n_f32(0.0f);
  int64_t b = 0;
  for (; b + 4 <= nb; b += 4) {
    float32x4_t sa = vld1q_f32(s.sa + b), c = vld1q_f32(s.c + b);
    int8x16_t a[8];
    for (int j = 0; j < 4; ++j) NAME(block_activations)(s, bits, b + j, &a[2 * j], &a[2 * j + 1]);
    for (int r = 0; r < R; ++r) {
      const uint8_t* codes = w + (n + r) * row_bytes + b * block_bytes;
      __builtin_prefetch(codes + QROWS * row_bytes);  /* this block of the row one group on */
      if (bits == 8) __builtin_prefetch(codes + QROWS * row_bytes + 64);
      int32x4_t dots = NAME(sum4)(NAME(block_dot)(codes, bits, a[0], a[1]),
                                  NAME(block_dot)(codes + block_bytes, bits, a[2], a[3]),
                                  NAME(block_dot)(codes + 2 * block_bytes, bits, a[4], a[5]),
                                  NAME(block_dot)(codes + 3 * block_bytes, bits, a[6], a[7]));
      const uint8_t* zr = zero_points ? zero_points + (n + r) * zero_bytes : NULL;
      acc[r] = NAME(scale4)(acc[r], dots, vld1q_f32(scales + (n + r) * nb + b), sa,
                            NAME(zero_points4)(zr, bits, b, shift), c);
    }
  }
  if (b < nb) {  /* the last 1-3 blocks */
    int64_t left = nb - b;
    float32x4_t sa = vld1q_f32(s.sa + b), c = vld1q_f32(s.c + b);  /* (nb8 entries, zeros past nb) */
    for (int r = 0; r < R; ++r) {
      int32x4_t p[4] = {vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)};
      float z[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      const uint8_t* zr = zero_points ? zero_points + (n + r) * zero_bytes : NULL;
      for (int64_t j = 0; j < left; ++j) {
        int8x16_t a0, a1;
        NAME(block_activations)(s, bits, b + j, &a0, &a1);
        p[j] = NAME(block_dot)(w + (n + r) * row_bytes + (b + j) * block_bytes, bits, a0, a1);
        z[j] = bits == 8 ? (float)(zr ? zr[b + j] : 128) - shift : (float)q4_zero_point(zr, b + j);
      }
      acc[r] = NAME(scale4)(acc[r], NAME(sum4)(p[0], p[1], p[2], p[3]),
                            NAME(floats4)(scales + (n + r) * nb + b, left), sa, vld1q_f32(z), c);
    }
  }
  for (int r = 0; r < R; ++r) y[n + r] = vaddvq_f32(acc[r]);
}

/* Every group of QROWS rows, then the last (n1 - n0) % QROWS, each count its own unrolled group */
INLINE void NAME(quant_rows)(int bits, const void* scratch, int64_t K, const uint8_t* weights, const float* scales,
                       const uint8_t* zero_points, int64_t n0, int64_t n1, float* y) {
  Scratch s = view(scratch, K);
  int64_t nb = n_blocks(K), n = n0;
  for (; n + QROWS <= n1; n += QROWS) NAME(rows_group)(s, bits, nb, weights, scales, zero_points, n, QROWS, y);
  switch (n1 - n) {
    case 3: NAME(rows_group)(s, bits, nb, weights, scales, zero_points, n, 3, y); break;
    case 2: NAME(rows_group)(s, bits, nb, weights, scales, zero_points, n, 2, y); break;
    case 1: NAME(rows_group)(s, bits, nb, weights, scales, zero_points, n, 1, y); break;
    default: break;
  }
}

void NAME(q8_rows)(const void* scratch, int64_t K, const uint8_t* weights, const float* scales,
                   const uint8_t* zero_points, int64_t n0, int64_t n1, float* y) {
  NAME(quant_rows)(8, scratch, K, weights, scales, zero_points, n0, n1, y);
}

void NAME(q4_rows)(const void* scratch, int64_t K, const uint8_t* weights, const float* scales,
                   const uint8_t* zero_points, int64_t n0, int64_t n1, float* y) {
  NAME(quant_rows)(4, scratch, K, weights, scales, zero_points, n0, n1, y);
}
