/* See cpu.h. */
#include "cpu.h"

#if defined(__aarch64__)
#include <sys/auxv.h>
/* The kernel's feature bits (asm/hwcap.h): set only where every core has the feature, so a big.LITTLE mix reports
   what all of its cores run. */
#define EDGELIN_HWCAP_ASIMD (1UL << 1)
#define EDGELIN_HWCAP_ASIMDDP (1UL << 20)
#define EDGELIN_HWCAP2_I8MM (1UL << 13)
#endif

static int g_avx2 = -1;  /* -1: not asked yet (or back to the hardware's answer) */
static int g_vnni = -1;  /* the same for the AVX-512 VNNI 4-bit product */
static int g_arm = -1;   /* the ARM level to take (EDGELIN_ARM_*), -1: the CPU's */
static int g_arm_cpu = -1;  /* the CPU's ARM level, read once (the products ask per call) */

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

static int read_arm_level(void) {
#if defined(__aarch64__)
  unsigned long caps = getauxval(AT_HWCAP), caps2 = getauxval(AT_HWCAP2);
  if (!(caps & EDGELIN_HWCAP_ASIMD)) return EDGELIN_ARM_NONE;  /* (every ARMv8-A Linux CPU has it) */
  if (!(caps & EDGELIN_HWCAP_ASIMDDP)) return EDGELIN_ARM_NEON;
  return (caps2 & EDGELIN_HWCAP2_I8MM) ? EDGELIN_ARM_I8MM : EDGELIN_ARM_DOTPROD;
#else
  return EDGELIN_ARM_NONE;
#endif
}

int edgelin_cpu_arm(void) {
  if (g_arm_cpu < 0) g_arm_cpu = read_arm_level();
  return g_arm_cpu;
}

int edgelin_arm(void) {
  int cpu = edgelin_cpu_arm();
  if (g_arm < 0) return cpu;
  return g_arm < cpu ? g_arm : cpu;  /* a limit, never a feature the CPU lacks (that would be SIGILL) */
}

void edgelin_arm_limit(int level) { g_arm = level; }

static const char* arm_name(int level) {
  switch (level) {
    case EDGELIN_ARM_I8MM: return "neon-i8mm";
    case EDGELIN_ARM_DOTPROD: return "neon-dotprod";
    case EDGELIN_ARM_NEON: return "neon";
    default: return "portable";
  }
}

const char* edgelin_q4_path(void) {
  if (edgelin_cpu_arm() != EDGELIN_ARM_NONE) return arm_name(edgelin_arm());
  if (edgelin_avx512_vnni()) return "avx512-vnni";
  return edgelin_avx2() ? "avx2" : "portable";
}

void edgelin_use_avx512(int on) { g_vnni = on ? -1 : 0; }

const char* edgelin_kernel_path(void) {
  if (edgelin_cpu_arm() != EDGELIN_ARM_NONE) return arm_name(edgelin_arm());
  if (edgelin_avx2()) return "avx2";
  return edgelin_cpu_avx2() ? "portable" : "none";
}

int edgelin_registers(void) { return edgelin_cpu_avx2() || edgelin_cpu_arm() != EDGELIN_ARM_NONE; }

void edgelin_use_portable(int on) {
  g_avx2 = on ? 0 : -1;
  g_arm = on ? EDGELIN_ARM_NONE : -1;
}
