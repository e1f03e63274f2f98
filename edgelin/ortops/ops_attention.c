/* ai.edgelin::GroupQueryAttention: com.microsoft::GroupQueryAttention's inputs, attributes and outputs, for the
   step graph's full-context attention over a KV cache (edgelin export --kv-cache static): the call's keys and
   values written at their positions (in place when the runner binds one buffer as past and present), then
   attention.c over rows 0 .. position, pieces of rows spread over ONNX Runtime's threads. Not taken (refused when
   the session is made; the export routes no such node): rotary inside the op, a local window, softcap, smooth
   softmax, packed QKV, cos/sin caches, attention bias. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "glue.h"

#define ROWS_PER_TASK 4096  /* 1 MiB of keys and values at 64 float32 columns: a piece per thread at long context */

typedef struct {
  int64_t heads, kv_heads;
  float scale;  /* 0: 1 / sqrt(head size), as com.microsoft's */
  int half;     /* the float16 op (an fp16 KV cache), else the float32 one */
} Attention;

static OrtStatus* create(const OrtKernelInfo* info, int half, void** out) {
  Attention* a = calloc(1, sizeof(Attention));
  if (!a) return fail("edgelin GroupQueryAttention: out of memory");
  a->half = half;
  OrtStatus* status = attribute(info, "num_heads", &a->heads);
  if (!status) status = attribute(info, "kv_num_heads", &a->kv_heads);
  a->scale = float_attribute_or(info, "scale", 0.0f);
  if (!status && (a->heads <= 0 || a->kv_heads <= 0 || a->heads % a->kv_heads || attribute_or(info, "do_rotary", 0)
                  || attribute_or(info, "local_window_size", -1) != -1 || attribute_or(info, "smooth_softmax", 0)
                  || float_attribute_or(info, "softcap", 0.0f) != 0.0f))
    status = fail("edgelin GroupQueryAttention: only num_heads a multiple of kv_num_heads, without rotary, local "
                  "window, softcap or smooth softmax (or use com.microsoft's)");
  if (status) {
    free(a);
    return status;
  }
  *out = a;
  return NULL;
}

OrtStatus* edgelin_create_attention(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
  (void)op;
  (void)api;
  return create(info, 0, out);
}

OrtStatus* edgelin_create_attention_half(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info,
                                         void** out) {
  (void)op;
  (void)api;
  return create(info, 1, out);
}

static void run_task(void* data, size_t index) { edgelin_attention_task(data, (int64_t)index); }

OrtStatus* edgelin_compute_attention(void* kernel, OrtKernelContext* context) {
  const Attention* at = kernel;
  const OrtValue* in[7] = {NULL};
  size_t inputs = 0, qr = 0, kr = 0, vr = 0, pr = 0, pvr = 0, sr = 0;
  int64_t qd[8], kd[8], vd[8], pd[8], pvd[8], sd[8];
  OrtStatus* status = ORT_CALL(g_api, KernelContext_GetInputCount)(context, &inputs);
  for (size_t i = 0; !status && i < inputs && i < 7; ++i) status = ORT_CALL(g_api, KernelContext_GetInput)(context, i, &in[i]);
  if (status) return status;
  for (size_t i = 0; i < 7; ++i)
    if (!in[i]) return fail("edgelin GroupQueryAttention: needs query, key, value, past_key, past_value, seqlens_k "
                            "and total_sequence_length");
  status = shape_of(in[0], qd, &qr);
  if (!status) status = shape_of(in[1], kd, &kr);
  if (!status) status = shape_of(in[2], vd, &vr);
  if (!status) status = shape_of(in[3], pd, &pr);
  if (!status) status = shape_of(in[4], pvd, &pvr);
  if (!status) status = shape_of(in[5], sd, &sr);
  if (status) return status;
  int64_t B = qd[0], S = qd[1], Hq = at->heads, Hkv = at->kv_heads, D = qr == 3 ? qd[2] / Hq : 0;
  int64_t P = pr == 4 ? pd[2] : 0;
  if (qr != 3 || kr != 3 || vr != 3 || pr != 4 || pvr != 4 || D <= 0 || qd[2] != Hq * D || kd[0] != B
      || vd[0] != B || kd[1] != S || vd[1] != S || kd[2] != Hkv * D || vd[2] != Hkv * D || pd[0] != B || pd[1] != Hkv
      || pd[3] != D || memcmp(pd, pvd, sizeof(int64_t) * 4) != 0 || sr != 1 || sd[0] != B)
    return fail("edgelin GroupQueryAttention: expected query [B, S, Hq*D], key/value [B, S, Hkv*D], past_key/value "
                "[B, Hkv, P, D], seqlens_k [B]");
  const int32_t* seqlens = data_of(in[5]);
  int64_t total = *(const int32_t*)data_of(in[6]), rows = total > P ? total : P, longest = 0;
  for (int64_t b = 0; b < B; ++b) {
    int64_t last = seqlens[b];
    if (last + 1 < S || last >= total || last + 1 - S > P)
      return fail("edgelin GroupQueryAttention: seqlens_k must hold each sequence's last position, at least S - 1, "
                  "below total_sequence_length, its past within past_key");
    longest = last + 1 > longest ? last + 1 : longest;
  }
  int64_t od[3] = {B, S, Hq * D}, kvd[4] = {B, Hkv, rows, D};
  OrtValue *out = NULL, *present_k = NULL, *present_v = NULL;
  status = ORT_CALL(g_api, KernelContext_GetOutput)(context, 0, od, 3, &out);
  if (!status) status = ORT_CALL(g_api, KernelContext_GetOutput)(context, 1, kvd, 4, &present_k);
  if (!status) status = ORT_CALL(g_api, KernelContext_GetOutput)(context, 2, kvd, 4, &present_v);
  if (status) return status;
  size_t size = at->half ? 2 : 4;  /* bytes per element */
  const char *past[2] = {data_of(in[3]), data_of(in[4])}, *fresh[2] = {data_of(in[1]), data_of(in[2])};
  char* present[2] = {data_of(present_k), data_of(present_v)};
  for (int t = 0; t < 2; ++t)  /* the new keys and values at their rows (after the past's, unless it is the same buffer) */
    for (int64_t b = 0; b < B; ++b)
      for (int64_t g = 0; g < Hkv; ++g) {
        int64_t held = seqlens[b] + 1 - S;
        char* head = present[t] + (size_t)((b * Hkv + g) * rows * D) * size;
        if (present[t] != past[t]) {
          memcpy(head, past[t] + (size_t)((b * Hkv + g) * P * D) * size, size * (size_t)(held * D));
          memset(head + (size_t)((held + S) * D) * size, 0, size * (size_t)((rows - held - S) * D));
        }
        for (int64_t i = 0; i < S; ++i)
          memcpy(head + (size_t)((held + i) * D) * size, fresh[t] + (size_t)(((b * S + i) * Hkv + g) * D) * size,
                 size * (size_t)D);
      }
  EdgelinAttention a = {data_of(in[0]), present[0], present[1], seqlens, B, S, Hq, Hkv, D, rows,
                        longest > ROWS_PER_TASK ? (longest + ROWS_PER_TASK - 1) / ROWS_PER_TASK : 1,
                        at->scale ? at->scale : 1.0f / sqrtf((float)D), at->half, NULL, NULL, data_of(out)};
  int64_t tasks = edgelin_attention_tasks(&a), G = Hq / Hkv;
  a.partial = malloc(sizeof(float) * (size_t)(tasks * G * (D + 2)));
  a.scratch = malloc(sizeof(float) * (size_t)(tasks * edgelin_attention_scratch_floats(G, D)));
  if (!a.partial || !a.scratch) {
    free(a.partial);
    free(a.scratch);
    return fail("edgelin GroupQueryAttention: out of memory");
  }
  if (g_parallel_for && tasks > 1) {
    status = ORT_CALL(g_api, KernelContext_ParallelFor)(context, run_task, (size_t)tasks, 0, &a);
  } else {
    for (int64_t t = 0; t < tasks; ++t) edgelin_attention_task(&a, t);
  }
  if (!status && edgelin_attention_merge(&a) != 0) status = fail("edgelin GroupQueryAttention: out of memory");
  free(a.partial);
  free(a.scratch);
  return status;
}

void edgelin_destroy_attention(void* kernel) { free(kernel); }
