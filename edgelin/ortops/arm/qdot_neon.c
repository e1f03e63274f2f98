/* qdot.h on NEON alone (ARMv8-A: Cortex-A53/A72): 8 int8 products widened to int16 (SMULL, SMLAL2: two products per
   int16 lane, |q - 128| x 127 x 2 <= 32512 fits), then pairwise into int32 (SADALP). Also the level selector. */
#if defined(__aarch64__)
#include <arm_neon.h>

#include "../cpu.h"
#include "neon.h"

#define NAME(x) edgelin_neon_##x

static inline __attribute__((always_inline)) int32x4_t neon_dot16(int32x4_t acc, int8x16_t a, int8x16_t b) {
  int16x8_t p = vmull_s8(vget_low_s8(a), vget_low_s8(b));
  return vpadalq_s16(acc, vmlal_high_s8(p, a, b));
}

#define DOT16(acc, a, b) neon_dot16(acc, a, b)
#include "qdot.h"

EdgelinArmRows edgelin_arm_rows(int bits, int level) {
  switch (level) {
    case EDGELIN_ARM_I8MM:  /* SDOT's one-token products: USDOT's 8-bit one ran 1.7% more instructions (docs/arm.md) */
    case EDGELIN_ARM_DOTPROD: return bits == 8 ? edgelin_dotprod_q8_rows : edgelin_dotprod_q4_rows;
    case EDGELIN_ARM_NEON: return bits == 8 ? edgelin_neon_q8_rows : edgelin_neon_q4_rows;
    default: return 0;
  }
}
#endif
