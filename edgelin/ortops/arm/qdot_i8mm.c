/* qdot.h's 8-bit product with USDOT (i8mm: Cortex-A710/X2 and later, Neoverse V1/N2): the unsigned codes by the int8
   activations directly, as AVX-512 VNNI's vpdpbusd does (no q - 128 and no shifted zero point). The 4-bit codes
   (0..15) are int8 already: that product is SDOT's (qdot_dotprod.c). */
#if defined(__aarch64__)
#pragma GCC target("arch=armv8.2-a+dotprod+i8mm")
#include "neon.h"

#define NAME(x) edgelin_i8mm_##x
#define DOT16(acc, a, b) vdotq_s32(acc, a, b)
#define Q8_DOT16(acc, a, b) vusdotq_s32(acc, a, b)
#define Q8_CODES(v) (v)
#define Q8_SHIFT 0
#define QDOT_NO_Q4
#include "qdot.h"
#endif
