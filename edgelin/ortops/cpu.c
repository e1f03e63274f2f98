/* See cpu.h. */
#include "cpu.h"

static int g_avx2 = -1;  /* -1: not asked yet */

int edgelin_avx2(void) {
#if defined(__x86_64__) || defined(_M_X64)
  if (g_avx2 < 0) {
    __builtin_cpu_init();
    g_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }
  return g_avx2;
#else
  return 0;
#endif
}

const char* edgelin_kernel_path(void) { return edgelin_avx2() ? "avx2" : "portable"; }

void edgelin_use_portable(int on) { g_avx2 = on ? 0 : -1; }
