/* edgelin's weight products, ONNX MatMul of float32 activations A [..., K] by a constant weight B.
   ai.edgelin::MatMulF32 / MatMulF16 (what exports write): B float32 / float16 packed in column panels [P, K, 16]
   (attribute n: N, the columns that are not padding; panels.c): each task takes a slice of the panels and writes
   its own columns of Y, whatever M.
   Exports made before the panels: ai.edgelin::MatMul, B float32 [K, N] (f32_gemv.c; ONNX Runtime's kernel splits
   the columns across its threads, here each task takes a slice of B's rows, a contiguous piece of the mapped
   weights file, into its own partial row, and the partial rows are summed after: the same sums in another order),
   and MatMulF16 on a float16 [K, N] (f16_gemm.c; decoding as MatMul, a prefill piece of M >= TILE_TOKENS rows of A
   in slices of B's columns). */
#include <stdlib.h>
#include <string.h>

#include "f16_gemm.h"
#include "f32_gemv.h"
#include "panels.h"
#include "glue.h"

#define ROWS_PER_TASK 64  /* 384 rows: 6 tasks, for ONNX Runtime's threads to share unevenly if one core is busy */
#define COLS_PER_TASK 64  /* a prefill piece's column slices (4 register tiles) */
#define TILE_TOKENS 6     /* from 6 rows of A on, the column-slice path (f16_gemm.c's register tiles) */
#define PANELS_PER_TASK 4 /* packed panels of 16 columns per task: 64 columns */

OrtStatus* edgelin_create_matmul(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
  (void)op;
  (void)api;
  int64_t* n = calloc(1, sizeof(int64_t));
  if (!n) return fail("edgelin MatMul: out of memory");
  *n = attribute_or(info, "n", 0); /* packed panels: the columns that are not padding (0: all) */
  *out = n;
  return NULL;
}

typedef struct {
  const float* x;
  const void* w;
  int64_t M, K, N;
  float* partial;  /* [tasks, M, N]; the column-slice and panel paths: Y itself */
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

static void run_panels_task(void* data, size_t index) {
  const Task* t = data;
  int64_t p0 = (int64_t)index * PANELS_PER_TASK, panels = (t->N + 15) / 16;
  int64_t p1 = p0 + PANELS_PER_TASK < panels ? p0 + PANELS_PER_TASK : panels;
  edgelin_weight_panels(t->x, t->M, t->K, t->N, t->w, t->half, p0, p1, t->partial);
}

static void run_cols_task(void* data, size_t index) {
  const Task* t = data;
  int64_t n0 = (int64_t)index * COLS_PER_TASK, n1 = n0 + COLS_PER_TASK < t->N ? n0 + COLS_PER_TASK : t->N;
  edgelin_f16_cols(t->x, t->M, t->K, t->N, t->w, n0, n1, t->partial);
}

/* Y = A B; B (float16 if `half`) packed in column panels [P, K, 16] holding N columns (`n`; 0: 16 P), or [K, N]. */
static OrtStatus* compute(OrtKernelContext* context, int half, int64_t n) {
  const OrtValue *a = NULL, *b = NULL;
  int64_t ad[8], bd[8] = {0};
  size_t ar = 0, br = 0;
  OrtStatus* status = ORT_CALL(g_api, KernelContext_GetInput)(context, 0, &a);
  if (!status) status = ORT_CALL(g_api, KernelContext_GetInput)(context, 1, &b);
  if (!status) status = shape_of(a, ad, &ar);
  if (!status) status = shape_of(b, bd, &br);
  if (status) return status;
  int packed = br == 3;
  int64_t M = 1, K = packed ? bd[1] : bd[0], P = packed ? bd[0] : 0, N = packed ? (n ? n : 16 * P) : bd[1];
  if (packed && (ar < 1 || ad[ar - 1] != K || bd[2] != 16 || N > 16 * P || N <= 16 * (P - 1)))
    return fail("edgelin MatMulF16 / MatMulF32: expected A [..., K] and B packed as [ceil(n / 16), K, 16] (re-export "
                "the model)");
  if (!packed && (ar < 1 || br != 2 || ad[ar - 1] != K))
    return fail("edgelin MatMul: expected A [..., K] and B [K, N] (or use ONNX's MatMul)");
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
  if (packed) {  /* each task a slice of the panels, writing its own columns of Y */
    Task task = {data_of(a), data_of(b), M, K, N, out, half};
    size_t tasks = (size_t)((P + PANELS_PER_TASK - 1) / PANELS_PER_TASK);
    if (!g_parallel_for || tasks < 2) {
      run_panels_task(&task, 0);
      return NULL;
    }
    return ORT_CALL(g_api, KernelContext_ParallelFor)(context, run_panels_task, tasks, 0, &task);
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
  return compute(context, 0, 0);
}

OrtStatus* edgelin_compute_matmul_f32(void* kernel, OrtKernelContext* context) {
  return compute(context, 0, *(const int64_t*)kernel);
}

OrtStatus* edgelin_compute_matmul_f16(void* kernel, OrtKernelContext* context) {
  return compute(context, 1, *(const int64_t*)kernel);
}

void edgelin_destroy_matmul(void* kernel) { free(kernel); }
