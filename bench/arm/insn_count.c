/* A QEMU TCG plugin (qemu-user 7.2's API, version 1) that counts the guest instructions a program executes, for
   bench/arm/instructions.py: instructions retired per token under emulation, a cost figure emulation can give
   (never a time). Built against QEMU's public qemu-plugin.h (fetched into the git-ignored .qemu-headers/ by
   bench/arm/instructions.py; no QEMU code here). Each translated block adds its instruction count inline when it
   runs; the total is written to the file named by the plugin's `out=PATH` argument when the program exits.
   One counter for every guest thread (the bench runs one thread; with several the adds may race). */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include <qemu-plugin.h>

QEMU_PLUGIN_EXPORT int qemu_plugin_version = QEMU_PLUGIN_VERSION;

static uint64_t executed;
static char out_path[4096];

static void translated(qemu_plugin_id_t id, struct qemu_plugin_tb* tb) {
  (void)id;
  qemu_plugin_register_vcpu_tb_exec_inline(tb, QEMU_PLUGIN_INLINE_ADD_U64, &executed, qemu_plugin_tb_n_insns(tb));
}

static void finished(qemu_plugin_id_t id, void* unused) {
  (void)id;
  (void)unused;
  FILE* out = out_path[0] ? fopen(out_path, "w") : stderr;
  if (!out) return;
  fprintf(out, "%" PRIu64 "\n", executed);
  if (out != stderr) fclose(out);
}

QEMU_PLUGIN_EXPORT int qemu_plugin_install(qemu_plugin_id_t id, const qemu_info_t* info, int argc, char** argv) {
  (void)info;
  for (int i = 0; i < argc; ++i)
    if (strncmp(argv[i], "out=", 4) == 0) snprintf(out_path, sizeof out_path, "%s", argv[i] + 4);
  qemu_plugin_register_vcpu_tb_trans_cb(id, translated);
  qemu_plugin_register_atexit_cb(id, finished, NULL);
  return 0;
}
