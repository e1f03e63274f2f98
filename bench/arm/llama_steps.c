/* llama.cpp's side of bench/arm/instructions.py: load a GGUF, decode a 16-token prompt, then N teacher-forced
   single-token steps (the ids edgelin's worker feeds), 1 thread; built for aarch64 against llama.cpp's public
   llama.h (llama.cpp cross-built with its NEON / dotprod kernels: bench/arm/instructions.py --llama-build).
   Usage: llama_steps MODEL.gguf STEPS */
#include <stdio.h>
#include <stdlib.h>

#include "llama.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s MODEL.gguf STEPS\n", argv[0]);
    return 2;
  }
  llama_backend_init();
  struct llama_model_params model_params = llama_model_default_params();
  struct llama_model* model = llama_model_load_from_file(argv[1], model_params);
  if (!model) return 1;
  struct llama_context_params params = llama_context_default_params();
  params.n_ctx = 256;
  params.n_batch = 16;
  params.n_threads = params.n_threads_batch = 1;
  struct llama_context* context = llama_init_from_model(model, params);
  if (!context) return 1;
  llama_token prompt[16];
  for (int i = 0; i < 16; ++i) prompt[i] = i + 1;
  if (llama_decode(context, llama_batch_get_one(prompt, 16)) != 0) return 1;
  for (int i = 0; i < atoi(argv[2]); ++i) {
    llama_token token = (7 * i) % 97 + 1;
    if (llama_decode(context, llama_batch_get_one(&token, 1)) != 0) return 1;
  }
  printf("llama.cpp (aarch64, 1 thread)\n");
  llama_free(context);
  llama_model_free(model);
  return 0;
}
