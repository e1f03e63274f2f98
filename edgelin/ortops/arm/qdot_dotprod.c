/* qdot.h with SDOT (ARMv8.2 dotprod: Cortex-A55/A76/A78, Raspberry Pi 5, Jetson Orin): 4 int8 products summed into
   each int32 lane in one instruction. */
#if defined(__aarch64__)
#pragma GCC target("arch=armv8.2-a+dotprod")
#include "neon.h"

#define NAME(x) edgelin_dotprod_##x
#define DOT16(acc, a, b) vdotq_s32(acc, a, b)
#include "qdot.h"
#endif
