/* Which kernels this CPU runs: the AVX2 + FMA ones, or the portable C ones (any CPU, or forced by the tests). */
#ifndef EDGELIN_CPU_H
#define EDGELIN_CPU_H

#define EDGELIN_API __attribute__((visibility("default")))  /* the library builds with -fvisibility=hidden */

int edgelin_avx2(void);  /* 1: take the AVX2 paths */

/* "avx2" or "portable"; for the tests, force the portable paths (on = 1) or go back to what the CPU has (0). */
EDGELIN_API const char* edgelin_kernel_path(void);
EDGELIN_API void edgelin_use_portable(int on);
#endif
