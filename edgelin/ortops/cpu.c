/* See cpu.h. */
#include "cpu.h"

static int g_avx2 = -1;  /* -1: not asked yet (or back to the hardware's answer) */
static int g_vnni = -1;  /* the same for the AVX-512 VNNI 4-bit product */

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

int edgelin_cpu_avx512_vnni(void) {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();  /* (libgcc reports AVX-512 features only where the OS saves the zmm state) */
  return edgelin_cpu_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#else
  return 0;
#endif
}

int edgelin_avx512_vnni(void) {
  if (g_vnni < 0) g_vnni = edgelin_cpu_avx512_vnni();
  return g_vnni && edgelin_avx2();
}

const char* edgelin_q4_path(void) {
  if (edgelin_avx512_vnni()) return "avx512-vnni";
  return edgelin_avx2() ? "avx2" : "portable";
}

void edgelin_use_avx512(int on) { g_vnni = on ? -1 : 0; }

const char* edgelin_kernel_path(void) {
  if (edgelin_avx2()) return "avx2";
  return edgelin_cpu_avx2() ? "portable" : "none";
}

void edgelin_use_portable(int on) { g_avx2 = on ? 0 : -1; }
