/* ai.edgelin::MatMul: ONNX MatMul for the step graph's float32 weight products, A [..., K] times an initializer B
   [K, N] (f32_gemv.c). ONNX Runtime's kernel splits the columns across its threads; here each task takes a slice
   of B's rows (a contiguous piece of the mapped weights file) into its own partial row, and the partial rows are
   summed after: the same sums in another order (float32 rounding, within the validate thresholds).
   ai.edgelin::MatMulF16: the same with B float16 (--quantize fp16; f16_gemm.c), in both graphs: a prefill piece
   (M >= TILE_TOKENS rows of A) takes slices of B's columns instead, each task writing its own columns of Y. */
#include <stdlib.h>
#include <string.h>

#include "f16_gemm.h"
#include "f32_gemv.h"
#include "glue.h"

#define ROWS_PER_TASK 64  /* 384 rows: 6 tasks, for ONNX Runtime's threads to share unevenly if one core is busy */
#define COLS_PER_TASK 64  /* a prefill piece's column slices (4 register tiles) */
#define TILE_TOKENS 6     /* from 6 rows of A on, the column-slice path (f16_gemm.c's register tiles) */

OrtStatus* edgelin_create_matmul(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
  (void)op;
  (void)api;
  (void)info;
  *out = calloc(1, 1);  /* no state of its own */
  return *out ? NULL : fail("edgelin MatMul: out of memory");
}

typedef struct {
  const float* x;
  const void* w;
  int64_t M, K, N;
  float* partial;  /* [tasks, M, N]; the column-slice path: Y itself */
  int half;        /* B is float16 */
} Task;

static void rows_of(const Task* t, int64_t k0, int64_t k1, float* y) {
  if (t->half)
    edgelin_f16_rows(t->x, t->M, t->K, t->N, t->w, k0, k1, y);
  else
    edgelin_f32_rows(t->x, t->M, t->K, t->N, t->w, k0, k1, y);
}

static void run_task(void* data, size_t index) {
  const Task* t = data;
  int64_t k0 = (int64_t)index * ROWS_PER_TASK, k1 = k0 + ROWS_PER_TASK < t->K ? k0 + ROWS_PER_TASK : t->K;
  rows_of(t, k0, k1, t->partial + (int64_t)index * t->M * t->N);
}

static void run_cols_task(void* data, size_t index) {
  const Task* t = data;
  int64_t n0 = (int64_t)index * COLS_PER_TASK, n1 = n0 + COLS_PER_TASK < t->N ? n0 + COLS_PER_TASK : t->N;
  edgelin_f16_cols(t->x, t->M, t->K, t->N, t->w, n0, n1, t->partial);
}

static OrtStatus* compute(OrtKernelContext* context, int half) {
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
  if (K == 0) {  /* an empty sum (ONNX's MatMul gives zeros) */
    memset(out, 0, sizeof(float) * (size_t)(M * N));
    return NULL;
  }
  if (half && M >= TILE_TOKENS) {  /* a prefill piece: column slices, each task writing its own columns */
    Task task = {data_of(a), data_of(b), M, K, N, out, 1};
    size_t slices = (size_t)((N + COLS_PER_TASK - 1) / COLS_PER_TASK);
    if (!g_parallel_for || slices < 2) {
      edgelin_f16_cols(task.x, M, K, N, task.w, 0, N, out);
      return NULL;
    }
    return ORT_CALL(g_api, KernelContext_ParallelFor)(context, run_cols_task, slices, 0, &task);
  }
  size_t tasks = (size_t)((K + ROWS_PER_TASK - 1) / ROWS_PER_TASK);
  Task task = {data_of(a), data_of(b), M, K, N, NULL, half};
  if (!g_parallel_for || tasks < 2) {
    rows_of(&task, 0, K, out);
    return NULL;
  }
  task.partial = malloc(sizeof(float) * tasks * (size_t)(M * N));
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

OrtStatus* edgelin_compute_matmul(void* kernel, OrtKernelContext* context) {
  (void)kernel;
  return compute(context, 0);
}

OrtStatus* edgelin_compute_matmul_f16(void* kernel, OrtKernelContext* context) {
  (void)kernel;
  return compute(context, 1);
}

void edgelin_destroy_matmul(void* kernel) { free(kernel); }
