/* See cpu.h. */
#include "cpu.h"

static int g_avx2 = -1;  /* -1: not asked yet (or back to the hardware's answer) */

int edgelin_cpu_avx2(void) {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return 0;
#endif
}

int edgelin_avx2(void) {
  if (g_avx2 < 0) g_avx2 = edgelin_cpu_avx2();
  return g_avx2;
}

const char* edgelin_kernel_path(void) {
  if (edgelin_avx2()) return "avx2";
  return edgelin_cpu_avx2() ? "portable" : "none";
}

void edgelin_use_portable(int on) { g_avx2 = on ? 0 : -1; }
