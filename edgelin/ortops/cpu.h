/* Which kernels this CPU runs: on x86-64 the AVX2 + FMA ones (and AVX-512 VNNI for the 4- and 8-bit products), on
   aarch64 the NEON ones (with dotprod, with i8mm: arm/), or the portable C ones (any CPU, or forced by the tests). */
#ifndef EDGELIN_CPU_H
#define EDGELIN_CPU_H

#define EDGELIN_API __attribute__((visibility("default")))  /* the library builds with -fvisibility=hidden */

int edgelin_cpu_avx2(void);  /* 1: this CPU has AVX2, FMA and F16C (every AVX2 x86 CPU in practice) */
int edgelin_avx2(void);      /* 1: take the AVX2 paths (the CPU's answer unless the tests forced the portable ones) */

/* The aarch64 levels, each including those below: NEON (Advanced SIMD: every ARMv8-A CPU, Cortex-A53/A72,
   Raspberry Pi 3/4), + dotprod (SDOT/UDOT, ARMv8.2: Cortex-A55/A76/A78, Raspberry Pi 5, Jetson Orin, most phones),
   + i8mm (USDOT/SMMLA: Cortex-A710/X2 and later, Neoverse V1/N2). Read from the kernel's HWCAP bits, never from a
   core's name. */
enum { EDGELIN_ARM_NONE = 0, EDGELIN_ARM_NEON = 1, EDGELIN_ARM_DOTPROD = 2, EDGELIN_ARM_I8MM = 3 };
int edgelin_cpu_arm(void);  /* this CPU's level (EDGELIN_ARM_NONE off aarch64) */
int edgelin_arm(void);      /* the level to take: the CPU's, unless the tests set a lower limit */
/* For the tests: take at most `level` (EDGELIN_ARM_*; EDGELIN_ARM_NONE: the portable paths), -1: the CPU's. */
EDGELIN_API void edgelin_arm_limit(int level);

/* "avx2", "neon-i8mm", "neon-dotprod", "neon"; "portable" (forced by the tests on a CPU with one of those); "none"
   (an x86 CPU without AVX2: ops.c registers nothing there). For the tests, force the portable paths (on = 1) or go
   back to the CPU's (on = 0). */
EDGELIN_API const char* edgelin_kernel_path(void);
EDGELIN_API void edgelin_use_portable(int on);
int edgelin_registers(void);  /* 1: ops.c registers the kernels (AVX2 on x86-64; aarch64) */

/* The 4-bit product's extra path: AVX-512 with VNNI (and BW, VL) on top of AVX2 (q4_gemv.c). */
int edgelin_cpu_avx512_vnni(void);  /* 1: this CPU (and OS) has them */
int edgelin_avx512_vnni(void);      /* 1: take that path (the CPU's answer, unless the tests turned it or AVX2 off) */
/* "avx512-vnni", "avx2", an ARM path's name (as edgelin_kernel_path) or "portable": the path edgelin_q4_rows
   takes. For the tests: edgelin_use_avx512(0) keeps the 4-bit product on its AVX2 path, (1) goes back to the CPU's
   answer. */
EDGELIN_API const char* edgelin_q4_path(void);
EDGELIN_API void edgelin_use_avx512(int on);
#endif
