/* ai.edgelin::SiluGate: a gated MLP's activation, y = silu(x[..., :F]) * x[..., F:], with x [..., 2F] (the gate and
   up products fused into one, edgelin.export.fuse_matmuls) and y [..., F]. One node where the step had three (the
   Split of the fused product, SiLU, the Mul), each a few microseconds of ONNX Runtime's dispatch around F floats
   of work. The export's function body is those nodes (onnx_silu_gate.py). No attributes. */
#include <stdlib.h>
#include <string.h>

#include "conv.h"
#include "glue.h"

OrtStatus* edgelin_create_silu_gate(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info,
                                    void** out) {
  (void)op;
  (void)api;
  (void)info;
  *out = malloc(1);  /* no state: a token for KernelDestroy (edgelin_destroy_fused frees it) */
  return *out ? NULL : fail("edgelin SiluGate: out of memory");
}

OrtStatus* edgelin_compute_silu_gate(void* kernel, OrtKernelContext* context) {
  (void)kernel;
  const OrtValue* in[1] = {NULL};
  int64_t d[1][8];
  size_t r[1] = {0};
  OrtStatus* status = inputs_of(context, 1, in, d, r);
  if (status) return status;
  int64_t width = r[0] ? d[0][r[0] - 1] : 0;
  if (width <= 0 || width % 2) return fail("edgelin SiluGate: expected x [..., 2F] with F >= 1");
  int64_t f = width / 2, rows = count_of(d[0], r[0]) / width, dims[8];
  memcpy(dims, d[0], r[0] * sizeof(int64_t));
  dims[r[0] - 1] = f;
  OrtValue* y = NULL;
  status = ORT_CALL(g_api, KernelContext_GetOutput)(context, 0, dims, r[0], &y);
  if (status) return status;
  const float* x = data_of(in[0]);
  float* out = data_of(y);
  for (int64_t i = 0; i < rows; ++i) {
    float* row = out + i * f;
    const float* up = x + i * width + f;
    memcpy(row, x + i * width, (size_t)f * sizeof(float));
    edgelin_silu(row, f);
    for (int64_t j = 0; j < f; ++j) row[j] *= up[j];
  }
  return NULL;
}
