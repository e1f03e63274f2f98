/* ai.edgelin::GatedDeltaRecurrence: a Gated DeltaNet layer's step into its recurrence, one node instead of the ~26
   small ONNX nodes (q and k reshaped to their heads and L2-normalised as RMSNorm, the key heads broadcast to the
   value heads, the decay's Add / Softplus / Mul, beta's Sigmoid, the reshapes) that each cost ONNX Runtime a kernel
   launch. Inputs, per token (T of them) of each of B sequences:
     q, k [B, T, Hq * dk] (before their norms), v [B, T, H * dv], dt, b [B, T, H], past_state [B, H, dk, dv],
     dt_bias, A (H values each, any shape), q_scale, k_scale (dk values each);
   with n(x, w) = x / sqrt(mean(x^2) + epsilon) * w over each head's dk values: the gated delta rule of
   linear_attention.c with query n(q, q_scale) of head h's group (h / (H / Hq)), key n(k, k_scale) of that group,
   value v, decay A softplus(dt + dt_bias) and beta sigmoid(b). Outputs: the recurrence's [B, T, H * dv] and
   present_state (may be past_state's buffer: the runner updates it in place). Attributes: q_num_heads,
   kv_num_heads, scale, epsilon. The export's function body computes the same with ONNX ops and
   com.microsoft::LinearAttention (onnx_gdn.py). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "glue.h"
#include "linear_attention.h"

OrtStatus* edgelin_create_gdn(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
  (void)op;
  (void)api;
  return fused_heads_create(info, "edgelin GatedDeltaRecurrence: needs q_num_heads dividing kv_num_heads, a non-zero "
                            "scale and epsilon >= 0", 1, out);
}

typedef struct {
  const FusedHeads* s;
  const float *q, *k, *v, *decay, *beta, *state;
  int64_t B, T, dk, dv;
  float *out, *present;
} Task;

static void run_heads(void* data, size_t index) {
  const Task* t = data;
  edgelin_linear_attention(EDGELIN_RULE_GATED_DELTA, t->q, t->k, t->v, t->decay, 1, t->beta, t->state, t->B, t->T,
                           t->s->q_heads, t->s->heads, t->dk, t->dv, t->s->scale, t->out, t->present,
                           (int64_t)index, 1);
}

/* out = x / sqrt(mean(x^2) + eps) * w over n values, the mean summed in order as a float (ONNX Runtime's
   ReduceMean is a float sum too) */
static void rms_norm(const float* x, const float* w, int64_t n, float eps, float* out) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  float rms = sqrtf(sum / (float)n + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] / rms * w[i];
}

OrtStatus* edgelin_compute_gdn(void* kernel, OrtKernelContext* context) {
  const FusedHeads* s = kernel;
  const OrtValue* in[10] = {NULL};
  int64_t d[10][8];
  size_t r[10] = {0};
  OrtStatus* status = inputs_of(context, 10, in, d, r);
  if (status) return status;
  int64_t H = s->heads, Hq = s->q_heads, B = d[0][0], T = r[0] == 3 ? d[0][1] : 0, dk = d[5][2], dv = d[5][3];
  if (r[0] != 3 || r[1] != 3 || r[2] != 3 || r[3] != 3 || r[4] != 3 || r[5] != 4 || d[0][2] != Hq * dk
      || d[1][2] != Hq * dk || d[2][2] != H * dv || d[3][2] != H || d[4][2] != H || d[5][1] != H || dv > 1024
      || count_of(d[6], r[6]) != H || count_of(d[7], r[7]) != H || count_of(d[8], r[8]) != dk
      || count_of(d[9], r[9]) != dk)
    return fail("edgelin GatedDeltaRecurrence: expected q, k [B, T, Hq*dk], v [B, T, H*dv], dt, b [B, T, H], "
                "past_state [B, H, dk, dv <= 1024], dt_bias, A of H values, q_scale, k_scale of dk values");
  for (int i = 1; i < 5; ++i)
    if (d[i][0] != B || d[i][1] != T || d[5][0] != B)
      return fail("edgelin GatedDeltaRecurrence: q, k, v, dt, b and past_state disagree on B or T");
  int64_t od[3] = {B, T, H * dv};
  OrtValue *o = NULL, *present = NULL;
  status = ORT_CALL(g_api, KernelContext_GetOutput)(context, 0, od, 3, &o);
  if (!status) status = ORT_CALL(g_api, KernelContext_GetOutput)(context, 1, d[5], 4, &present);
  if (status || B * T == 0) return status;
  const float *q = data_of(in[0]), *k = data_of(in[1]), *dt = data_of(in[3]), *b = data_of(in[4]),
              *bias = data_of(in[6]), *A = data_of(in[7]), *q_scale = data_of(in[8]), *k_scale = data_of(in[9]);
  int64_t tokens = B * T, group = H / Hq;
  /* one token of a few heads fits on the stack: no heap allocation per decoded token */
  float stack[SMALL_SCRATCH];
  size_t need = (size_t)(tokens * (Hq * dk + H * dk + 2 * H));
  float* scratch = need <= SMALL_SCRATCH ? stack : malloc(sizeof(float) * need);
  if (!scratch) return fail("edgelin GatedDeltaRecurrence: out of memory");
  float *queries = scratch, *keys = queries + tokens * Hq * dk, *decay = keys + tokens * H * dk,
        *beta = decay + tokens * H;
  for (int64_t n = 0; n < tokens; ++n) {  /* the norms, each value head's key, the decay and beta */
    for (int64_t g = 0; g < Hq; ++g) {
      rms_norm(q + (n * Hq + g) * dk, q_scale, dk, s->epsilon, queries + (n * Hq + g) * dk);
      rms_norm(k + (n * Hq + g) * dk, k_scale, dk, s->epsilon, keys + (n * H + g * group) * dk);
      for (int64_t j = 1; j < group; ++j)
        memcpy(keys + (n * H + g * group + j) * dk, keys + (n * H + g * group) * dk, sizeof(float) * (size_t)dk);
    }
    for (int64_t h = 0; h < H; ++h) {
      decay[n * H + h] = A[h] * edgelin_softplus(dt[n * H + h] + bias[h]);
      beta[n * H + h] = 1.0f / (1.0f + expf(-b[n * H + h]));
    }
  }
  Task task = {s, queries, keys, data_of(in[2]), decay, beta, data_of(in[5]), B, T, dk, dv, data_of(o),
               data_of(present)};
  if (g_parallel_for && B * H > 1)  /* one head per task: the heads' states are independent */
    status = ORT_CALL(g_api, KernelContext_ParallelFor)(context, run_heads, (size_t)(B * H), 0, &task);
  else
    edgelin_linear_attention(EDGELIN_RULE_GATED_DELTA, queries, keys, task.v, decay, 1, beta, task.state, B, T, Hq,
                             H, dk, dv, s->scale, task.out, task.present, 0, B * H);
  if (scratch != stack) free(scratch);
  return status;
}

/* ---- ai.edgelin::GatedRmsNorm: the recurrence's gated output norm, y = x / sqrt(mean(x^2) + epsilon) * w *
   silu(z) over each group of dv values (dv = w's size): x, z [..., N] with N a multiple of dv, y like x. One node
   where ONNX Runtime ran six (the reshapes, its fused norm, SiLU, the gate's Mul); the export's function body is
   the unfused nodes (onnx_gated_norm.py). Attribute: epsilon.
   ai.edgelin::GateThenRmsNorm: the gate first, then the norm (Mamba2's gated norm): y = g / sqrt(mean(g^2) +
   epsilon) * w with g = x * silu(z), over groups of `group_size` values (attribute; 0: w's size) within each row of
   w's size, w spanning the row; one node where the step ran nine (one group) or eleven. */
typedef struct {
  float epsilon;
  int gate_first;     /* GateThenRmsNorm */
  int64_t group_size; /* 0: the weight's size */
} GatedNorm;

static OrtStatus* create_norm(const OrtKernelInfo* info, int gate_first, void** out) {
  GatedNorm* norm = malloc(sizeof(GatedNorm));
  if (!norm) return fail("edgelin GatedRmsNorm: out of memory");
  norm->gate_first = gate_first;
  norm->group_size = gate_first ? attribute_or(info, "group_size", 0) : 0;
  OrtStatus* status = ORT_CALL(g_api, KernelInfoGetAttribute_float)(info, "epsilon", &norm->epsilon);
  if (!status && !(norm->epsilon >= 0.0f)) status = fail("edgelin GatedRmsNorm: needs epsilon >= 0");
  if (status) {
    free(norm);
    return status;
  }
  *out = norm;
  return NULL;
}

OrtStatus* edgelin_create_gated_norm(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info,
                                     void** out) {
  (void)op;
  (void)api;
  return create_norm(info, 0, out);
}

OrtStatus* edgelin_create_gate_then_norm(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info,
                                         void** out) {
  (void)op;
  (void)api;
  return create_norm(info, 1, out);
}

static float silu(float z) { return z / (1.0f + expf(-z)); }

OrtStatus* edgelin_compute_gated_norm(void* kernel, OrtKernelContext* context) {
  const GatedNorm* norm = kernel;
  const OrtValue* in[3] = {NULL};
  int64_t d[3][8];
  size_t r[3] = {0};
  OrtStatus* status = inputs_of(context, 3, in, d, r);
  if (status) return status;
  int64_t n = count_of(d[0], r[0]), dv = count_of(d[2], r[2]);
  int64_t group = norm->group_size > 0 ? norm->group_size : dv;
  int same = r[0] == r[1] && r[0] >= 1;
  for (size_t i = 0; same && i < r[0]; ++i) same = d[0][i] == d[1][i];
  if (!same || dv <= 0 || d[0][r[0] - 1] % dv || dv % group)
    return fail("edgelin GatedRmsNorm: expected x and z of one shape [..., N], weight of dv values dividing N "
                "(and group_size dividing dv)");
  OrtValue* y = NULL;
  status = ORT_CALL(g_api, KernelContext_GetOutput)(context, 0, d[0], r[0], &y);
  if (status) return status;
  const float *x = data_of(in[0]), *z = data_of(in[1]), *w = data_of(in[2]);
  float* out = data_of(y);
  if (norm->gate_first) {  /* each gated group into y, then normalised in place (rms_norm reads each value first) */
    for (int64_t g = 0; g < n / group; ++g) {
      for (int64_t j = g * group; j < (g + 1) * group; ++j) out[j] = x[j] * silu(z[j]);
      rms_norm(out + g * group, w + (g * group) % dv, group, norm->epsilon, out + g * group);
    }
    return NULL;
  }
  for (int64_t g = 0; g < n / dv; ++g) {
    rms_norm(x + g * dv, w, dv, norm->epsilon, out + g * dv);
    for (int64_t j = g * dv; j < (g + 1) * dv; ++j) out[j] *= silu(z[j]);
  }
  return NULL;
}
