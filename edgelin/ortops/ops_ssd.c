/* ai.edgelin::SsdRecurrence: Mamba2's SSD step around the recurrence, one node instead of the ~20 small ONNX nodes
   (reshapes, the dt path's Add / Softplus / Mul, the key's Unsqueeze / Expand, the skip's Mul / Add) that each cost
   ONNX Runtime a kernel launch (the Mamba2 peer's int4 step x0.76 at 1 thread, x0.83 at 2; issue 13's
   sixteenth session, docs/performance.md#cpu-step-latency). Inputs, per token (T of them) of each of B sequences:
     q [B, T, Hq * dk] (C), k [B, T, Hq * dk] (B: one key per query group), x [B, T, H * dv], dt [B, T, H],
     past_state [B, H, dk, dv], dt_bias, A, D (H values each, any shape);
   with sp = softplus(dt + dt_bias): the gated recurrence of linear_attention.c with decay A sp, key k of head h's
   group (h / (H / Hq)) and value x sp; y = its output + D x. Outputs y [B, T, H * dv] and present_state (may be
   past_state's buffer: the runner updates it in place). Attributes: q_num_heads, kv_num_heads, scale. The export's
   function body computes the same with ONNX ops and com.microsoft::LinearAttention (onnx_ssd.py). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "glue.h"
#include "linear_attention.h"

OrtStatus* edgelin_create_ssd(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
  (void)op;
  (void)api;
  return fused_heads_create(info, "edgelin SsdRecurrence: needs q_num_heads dividing kv_num_heads and a non-zero scale",
                            0, out);
}

typedef struct {
  const FusedHeads* s;
  const float *q, *k, *v, *decay, *state;
  int64_t B, T, dk, dv;
  float *out, *present;
} Task;

static void run_heads(void* data, size_t index) {
  const Task* t = data;
  edgelin_linear_attention(EDGELIN_RULE_GATED, t->q, t->k, t->v, t->decay, 1, NULL, t->state, t->B, t->T,
                           t->s->q_heads, t->s->heads, t->dk, t->dv, t->s->scale, t->out, t->present,
                           (int64_t)index, 1);
}

OrtStatus* edgelin_compute_ssd(void* kernel, OrtKernelContext* context) {
  const FusedHeads* s = kernel;
  const OrtValue* in[8] = {NULL};
  int64_t d[8][8];
  size_t r[8] = {0};
  OrtStatus* status = inputs_of(context, 8, in, d, r);
  if (status) return status;
  int64_t H = s->heads, Hq = s->q_heads, B = d[0][0], T = r[0] == 3 ? d[0][1] : 0, dk = d[4][2], dv = d[4][3];
  if (r[0] != 3 || r[1] != 3 || r[2] != 3 || r[3] != 3 || r[4] != 4 || d[0][2] != Hq * dk || d[1][2] != Hq * dk
      || d[2][2] != H * dv || d[3][2] != H || d[4][1] != H || dv > 1024 || count_of(d[5], r[5]) != H
      || count_of(d[6], r[6]) != H || count_of(d[7], r[7]) != H)
    return fail("edgelin SsdRecurrence: expected q, k [B, T, Hq*dk], x [B, T, H*dv], dt [B, T, H], past_state "
                "[B, H, dk, dv <= 1024], dt_bias, A, D of H values");
  for (int i = 1; i < 4; ++i)
    if (d[i][0] != B || d[i][1] != T || d[4][0] != B)
      return fail("edgelin SsdRecurrence: q, k, x, dt and past_state disagree on B or T");
  int64_t od[3] = {B, T, H * dv};
  OrtValue *y = NULL, *present = NULL;
  status = ORT_CALL(g_api, KernelContext_GetOutput)(context, 0, od, 3, &y);
  if (!status) status = ORT_CALL(g_api, KernelContext_GetOutput)(context, 1, d[4], 4, &present);
  if (status || B * T == 0) return status;
  const float *k = data_of(in[1]), *x = data_of(in[2]), *dt = data_of(in[3]), *bias = data_of(in[5]),
              *A = data_of(in[6]), *D = data_of(in[7]);
  int64_t tokens = B * T, group = H / Hq;
  /* one token of a few heads fits on the stack: no heap allocation per decoded token */
  float stack[SMALL_SCRATCH];
  size_t need = (size_t)(tokens * H * (dk + dv + 1));
  float* scratch = need <= SMALL_SCRATCH ? stack : malloc(sizeof(float) * need);
  if (!scratch) return fail("edgelin SsdRecurrence: out of memory");
  float *keys = scratch, *values = keys + tokens * H * dk, *decay = values + tokens * H * dv;
  for (int64_t n = 0; n < tokens; ++n)  /* the dt path, each head's key and value */
    for (int64_t h = 0; h < H; ++h) {
      float sp = edgelin_softplus(dt[n * H + h] + bias[h]);
      decay[n * H + h] = A[h] * sp;
      memcpy(keys + (n * H + h) * dk, k + (n * Hq + h / group) * dk, sizeof(float) * (size_t)dk);
      const float* xs = x + (n * H + h) * dv;
      float* vs = values + (n * H + h) * dv;
      for (int64_t j = 0; j < dv; ++j) vs[j] = xs[j] * sp;
    }
  Task task = {s, data_of(in[0]), keys, values, decay, data_of(in[4]), B, T, dk, dv, data_of(y), data_of(present)};
  if (g_parallel_for && B * H > 1)  /* one head per task: the heads' states are independent */
    status = ORT_CALL(g_api, KernelContext_ParallelFor)(context, run_heads, (size_t)(B * H), 0, &task);
  else
    edgelin_linear_attention(EDGELIN_RULE_GATED, task.q, keys, values, decay, 1, NULL, task.state, B, T, Hq, H, dk,
                             dv, s->scale, task.out, task.present, 0, B * H);
  if (!status)  /* the skip: y += D x */
    for (int64_t n = 0; n < tokens; ++n)
      for (int64_t h = 0; h < H; ++h) {
        float* ys = task.out + (n * H + h) * dv;
        const float* xs = x + (n * H + h) * dv;
        for (int64_t j = 0; j < dv; ++j) ys[j] += D[h] * xs[j];
      }
  if (scratch != stack) free(scratch);
  return status;
}
