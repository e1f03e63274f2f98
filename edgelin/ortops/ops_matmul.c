/* ai.edgelin::MatMul: ONNX MatMul for the step graph's float32 weight products, A [..., K] times an initializer B
   [K, N] (f32_gemv.c). ONNX Runtime's kernel splits the columns across its threads; here each task takes a slice
   of B's rows (a contiguous piece of the mapped weights file) into its own partial row, and the partial rows are
   summed after: the same sums in another order (float32 rounding, within the validate thresholds). */
#include <stdlib.h>

#include "f32_gemv.h"
#include "glue.h"

#define ROWS_PER_TASK 64  /* 384 rows: 6 tasks, for ONNX Runtime's threads to share unevenly if one core is busy */

OrtStatus* edgelin_create_matmul(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
  (void)op;
  (void)api;
  (void)info;
  *out = calloc(1, 1);  /* no state of its own */
  return *out ? NULL : fail("edgelin MatMul: out of memory");
}

typedef struct {
  const float *x, *w;
  int64_t M, K, N;
  float* partial;  /* [tasks, M, N] */
} Task;

static void run_task(void* data, size_t index) {
  const Task* t = data;
  int64_t k0 = (int64_t)index * ROWS_PER_TASK, k1 = k0 + ROWS_PER_TASK < t->K ? k0 + ROWS_PER_TASK : t->K;
  edgelin_f32_rows(t->x, t->M, t->K, t->N, t->w, k0, k1, t->partial + (int64_t)index * t->M * t->N);
}

OrtStatus* edgelin_compute_matmul(void* kernel, OrtKernelContext* context) {
  (void)kernel;
  const OrtValue *a = NULL, *b = NULL;
  int64_t ad[8], bd[8];
  size_t ar = 0, br = 0;
  OrtStatus* status = ORT_CALL(g_api, KernelContext_GetInput)(context, 0, &a);
  if (!status) status = ORT_CALL(g_api, KernelContext_GetInput)(context, 1, &b);
  if (!status) status = shape_of(a, ad, &ar);
  if (!status) status = shape_of(b, bd, &br);
  if (status) return status;
  if (ar < 1 || br != 2 || ad[ar - 1] != bd[0])
    return fail("edgelin MatMul: expected A [..., K] and B [K, N] (or use ONNX's MatMul)");
  int64_t M = 1, K = bd[0], N = bd[1];
  for (size_t i = 0; i + 1 < ar; ++i) M *= ad[i];
  ad[ar - 1] = N;
  OrtValue* y = NULL;
  status = ORT_CALL(g_api, KernelContext_GetOutput)(context, 0, ad, ar, &y);
  if (status || M == 0 || N == 0) return status;
  float* out = data_of(y);
  size_t tasks = (size_t)((K + ROWS_PER_TASK - 1) / ROWS_PER_TASK);
  if (!g_parallel_for || tasks < 2) {
    edgelin_f32_rows(data_of(a), M, K, N, data_of(b), 0, K, out);
    return NULL;
  }
  Task task = {data_of(a), data_of(b), M, K, N, malloc(sizeof(float) * tasks * (size_t)(M * N))};
  if (!task.partial) return fail("edgelin MatMul: out of memory");
  status = ORT_CALL(g_api, KernelContext_ParallelFor)(context, run_task, tasks, 0, &task);
  if (!status) {
    int64_t size = M * N;
    for (int64_t i = 0; i < size; ++i) {
      float s = task.partial[i];
      for (size_t t = 1; t < tasks; ++t) s += task.partial[(int64_t)t * size + i];
      out[i] = s;
    }
  }
  free(task.partial);
  return status;
}

void edgelin_destroy_matmul(void* kernel) { free(kernel); }
