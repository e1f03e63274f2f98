/* The 4-bit and 8-bit one-token products on aarch64 (q4_gemv.h, q8_gemv.h: the same scratch, weights and sums),
   written once and compiled per level by qdot_neon.c, qdot_dotprod.c and qdot_i8mm.c, each under its own target
   (a file per level: a function that names SDOT must be compiled for it, and is called only where the CPU has it).
   Each instantiation defines, before including this file:
     NAME(x)           its functions' names (edgelin_<level>_x)
     DOT16(acc, a, b)  acc (int32x4) + the products of 16 int8 pairs, summed in lanes (a: codes, b: activations)
     Q8_CODES(v)       an 8-bit row's 16 codes (uint8x16) as DOT16's first operand; Q8_SHIFT what that subtracted
                       from each (128: codes read as q - 128, int8; 0: USDOT takes them unsigned)
     Q8_DOT16          DOT16 for the 8-bit codes as Q8_CODES gives them
   Four weight rows at once (independent accumulator chains), four blocks per step: a block's dot is summed to one
   int32 lane by pairwise adds, then the four blocks are scaled together (scale x activation scale) and the zero
   points' term goes in once per block through the activation sum (offset x c), as on x86. */
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

/* Rows n .. n + R - 1 (R <= QROWS, a constant where inlined) of the 8-bit product */
INLINE void NAME(q8_group)(Scratch s, int64_t nb, const uint8_t* w, const float* scales, const uint8_t* zero_points,
                           int64_t n, int R, float* y) {
  float32x4_t acc[QROWS];
  for (int r = 0; r < QROWS; ++r) acc[r] = vdupq_n_f32(0.0f);
  for (int64_t b = 0; b < nb; b += 4) {
    int64_t left = nb - b < 4 ? nb - b : 4;
    float32x4_t sa = vld1q_f32(s.sa + b), c = vld1q_f32(s.c + b);  /* (nb8 entries, zeros past nb) */
    int8x16_t a[8];
    for (int64_t j = 0; j < left; ++j) {
      a[2 * j] = vld1q_s8(s.qa + (b + j) * BLOCK);
      a[2 * j + 1] = vld1q_s8(s.qa + (b + j) * BLOCK + 16);
    }
    for (int r = 0; r < R; ++r) {
      const uint8_t* wb = w + ((n + r) * nb + b) * BLOCK;
      __builtin_prefetch(wb + QROWS * nb * BLOCK);  /* this block of the row one group on */
      __builtin_prefetch(wb + QROWS * nb * BLOCK + 64);
      int32x4_t p[4];
      for (int j = 0; j < 4; ++j) {
        p[j] = vdupq_n_s32(0);
        if (j < left) {
          p[j] = Q8_DOT16(p[j], Q8_CODES(vld1q_u8(wb + j * BLOCK)), a[2 * j]);
          p[j] = Q8_DOT16(p[j], Q8_CODES(vld1q_u8(wb + j * BLOCK + 16)), a[2 * j + 1]);
        }
      }
      float z[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      const uint8_t* zr = zero_points ? zero_points + (n + r) * nb + b : NULL;
      for (int64_t j = 0; j < left; ++j) z[j] = (float)((zr ? zr[j] : 128) - Q8_SHIFT);
      acc[r] = NAME(scale4)(acc[r], NAME(sum4)(p[0], p[1], p[2], p[3]), NAME(floats4)(scales + (n + r) * nb + b, left),
                            sa, vld1q_f32(z), c);
    }
  }
  for (int r = 0; r < R; ++r) y[n + r] = vaddvq_f32(acc[r]);
}

/* Rows n .. n + R - 1 of the 4-bit product: a block's 16 bytes are its even values (low nibbles) and odd ones
   (high), which the scratch holds apart (q4_gemv.c's layout: per pair of blocks, 32 evens then 32 odds) */
INLINE void NAME(q4_group)(Scratch s, int64_t nb, const uint8_t* w, const float* scales, const uint8_t* zero_points,
                           int64_t n, int R, float* y) {
  const uint8x16_t low = vdupq_n_u8(0x0F);
  int64_t zb = (nb + 1) / 2;
  float32x4_t acc[QROWS];
  for (int r = 0; r < QROWS; ++r) acc[r] = vdupq_n_f32(0.0f);
  for (int64_t b = 0; b < nb; b += 4) {
    int64_t left = nb - b < 4 ? nb - b : 4;
    float32x4_t sa = vld1q_f32(s.sa + b), c = vld1q_f32(s.c + b);
    int8x16_t even[4], odd[4];
    for (int64_t j = 0; j < left; ++j) {
      const int8_t* pair = s.qa + ((b + j) / 2) * 64 + ((b + j) % 2) * 16;
      even[j] = vld1q_s8(pair);
      odd[j] = vld1q_s8(pair + 32);
    }
    for (int r = 0; r < R; ++r) {
      const uint8_t* wb = w + ((n + r) * nb + b) * 16;
      __builtin_prefetch(wb + QROWS * nb * 16);
      int32x4_t p[4];
      for (int j = 0; j < 4; ++j) {
        p[j] = vdupq_n_s32(0);
        if (j < left) {
          uint8x16_t v = vld1q_u8(wb + j * 16);
          p[j] = DOT16(p[j], vreinterpretq_s8_u8(vandq_u8(v, low)), even[j]);
          p[j] = DOT16(p[j], vreinterpretq_s8_u8(vshrq_n_u8(v, 4)), odd[j]);
        }
      }
      float z[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      const uint8_t* zr = zero_points ? zero_points + (n + r) * zb : NULL;
      for (int64_t j = 0; j < left; ++j) z[j] = (float)q4_zero_point(zr, b + j);
      acc[r] = NAME(scale4)(acc[r], NAME(sum4)(p[0], p[1], p[2], p[3]), NAME(floats4)(scales + (n + r) * nb + b, left),
                            sa, vld1q_f32(z), c);
    }
  }
  for (int r = 0; r < R; ++r) y[n + r] = vaddvq_f32(acc[r]);
}

/* Every group of QROWS rows, then the last n1 - n0 % QROWS, each count its own unrolled group */
#define QDOT_ROWS(group)                                                                                         \
  Scratch s = view(scratch, K);                                                                                  \
  int64_t nb = n_blocks(K), n = n0;                                                                              \
  for (; n + QROWS <= n1; n += QROWS) group(s, nb, weights, scales, zero_points, n, QROWS, y);                   \
  switch (n1 - n) {                                                                                              \
    case 3: group(s, nb, weights, scales, zero_points, n, 3, y); break;                                          \
    case 2: group(s, nb, weights, scales, zero_points, n, 2, y); break;                                          \
    case 1: group(s, nb, weights, scales, zero_points, n, 1, y); break;                                          \
    default: break;                                                                                              \
  }

void NAME(q8_rows)(const void* scratch, int64_t K, const uint8_t* weights, const float* scales,
                   const uint8_t* zero_points, int64_t n0, int64_t n1, float* y) {
  QDOT_ROWS(NAME(q8_group))
}

#ifndef QDOT_NO_Q4
void NAME(q4_rows)(const void* scratch, int64_t K, const uint8_t* weights, const float* scales,
                   const uint8_t* zero_points, int64_t n0, int64_t n1, float* y) {
  QDOT_ROWS(NAME(q4_group))
}
#endif
