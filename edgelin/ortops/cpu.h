/* Which kernels this CPU runs: the AVX2 + FMA ones, or the portable C ones (any CPU, or forced by the tests). */
#ifndef EDGELIN_CPU_H
#define EDGELIN_CPU_H

#define EDGELIN_API __attribute__((visibility("default")))  /* the library builds with -fvisibility=hidden */

int edgelin_cpu_avx2(void);  /* 1: this CPU has AVX2, FMA and F16C (every AVX2 x86 CPU in practice) */
int edgelin_avx2(void);      /* 1: take the AVX2 paths (the CPU's answer unless the tests forced the portable ones) */

/* "avx2"; "portable" (forced by the tests on an AVX2 CPU); "none" (a CPU without AVX2: ops.c registers nothing
   there). For the tests, force the portable paths (on = 1) or go back to the CPU's (on = 0). */
EDGELIN_API const char* edgelin_kernel_path(void);
EDGELIN_API void edgelin_use_portable(int on);

/* The 4-bit product's extra path: AVX-512 with VNNI (and BW, VL) on top of AVX2 (q4_gemv.c). */
int edgelin_cpu_avx512_vnni(void);  /* 1: this CPU (and OS) has them */
int edgelin_avx512_vnni(void);      /* 1: take that path (the CPU's answer, unless the tests turned it or AVX2 off) */
/* "avx512-vnni", "avx2" or "portable": the path edgelin_q4_rows takes. For the tests: edgelin_use_avx512(0) keeps
   the 4-bit product on its AVX2 path, (1) goes back to the CPU's answer. */
EDGELIN_API const char* edgelin_q4_path(void);
EDGELIN_API void edgelin_use_avx512(int on);
#endif
