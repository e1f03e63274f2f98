/* edgelin's ONNX Runtime operator library: ai.edgelin::MatMulNBits, the 4-bit weight products of one-token decoding
   (q4_gemv.c), with com.microsoft::MatMulNBits' inputs, attributes and weight layout. An export that uses it also
   carries an ONNX function of the same name whose body is com.microsoft::MatMulNBits, so a runtime without this
   library runs the same file through ONNX Runtime's own kernel.
   Load: SessionOptions.register_custom_ops_library(path); ONNX Runtime calls RegisterCustomOps. */
#include <stdlib.h>
#include <string.h>

#include "ort_abi.h"
#include "q4_gemv.h"

#define DOMAIN "ai.edgelin"
#define ROWS_PER_TASK 128

static const OrtApi* g_api;
static int g_parallel_for;

typedef struct {
  int64_t K, N;
  float* offsets;        /* [N, nb]: -scale * zero point, made once when the weights are initializers */
} Kernel;

static OrtStatus* fail(const char* message) { return ORT_CALL(g_api, CreateStatus)(ORT_INVALID_ARGUMENT, message); }

static OrtStatus* attribute(const OrtKernelInfo* info, const char* name, int64_t* out) {
  return ORT_CALL(g_api, KernelInfoGetAttribute_int64)(info, name, out);
}

static OrtStatus* shape_of(const OrtValue* value, int64_t* dims, size_t* rank) {
  OrtTensorTypeAndShapeInfo* info = NULL;
  OrtStatus* status = ORT_CALL(g_api, GetTensorTypeAndShape)(value, &info);
  if (!status) status = ORT_CALL(g_api, GetDimensionsCount)(info, rank);
  if (!status && *rank > 8) status = fail("edgelin MatMulNBits: input A has more than 8 dimensions");
  if (!status) status = ORT_CALL(g_api, GetDimensions)(info, dims, *rank);
  if (info) ORT_CALL(g_api, ReleaseTensorTypeAndShapeInfo)(info);
  return status;
}

static void* data_of(const OrtValue* value) {
  void* data = NULL;
  OrtStatus* status = ORT_CALL(g_api, GetTensorMutableData)((OrtValue*)value, &data);
  if (status) {
    ORT_CALL(g_api, ReleaseStatus)(status);
    return NULL;
  }
  return data;
}

static float* make_offsets(const Kernel* k, const OrtValue* scales, const OrtValue* zero_points) {
  int64_t nb = (k->K + 31) / 32;
  float* offsets = malloc(sizeof(float) * (size_t)(k->N * nb));
  if (offsets)
    edgelin_q4_offsets(k->K, k->N, data_of(scales), zero_points ? data_of(zero_points) : NULL, offsets);
  return offsets;
}

static OrtStatus* create_kernel(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
  (void)op;
  (void)api;
  int64_t bits = 0, block = 0;
  Kernel* k = calloc(1, sizeof(Kernel));
  if (!k) return fail("edgelin MatMulNBits: out of memory");
  OrtStatus* status = attribute(info, "K", &k->K);
  if (!status) status = attribute(info, "N", &k->N);
  if (!status) status = attribute(info, "bits", &bits);
  if (!status) status = attribute(info, "block_size", &block);
  if (!status && (bits != 4 || block != 32 || k->K <= 0 || k->N <= 0))
    status = fail("edgelin MatMulNBits: only bits 4 with block_size 32 (export with those, or use com.microsoft's)");
  if (!status) {  /* the offsets once, when scales (and zero points) are initializers */
    const OrtValue *scales = NULL, *zero_points = NULL;
    int constant_scales = 0, constant_zero_points = 0;
    status = ORT_CALL(g_api, KernelInfoGetConstantInput_tensor)(info, 2, &constant_scales, &scales);
    if (!status) status = ORT_CALL(g_api, KernelInfoGetConstantInput_tensor)(info, 3, &constant_zero_points, &zero_points);
    if (status) {  /* no fourth input: zero points absent */
      ORT_CALL(g_api, ReleaseStatus)(status);
      status = NULL;
      zero_points = NULL;
      constant_zero_points = 1;
    }
    if (constant_scales && constant_zero_points && scales) {
      k->offsets = make_offsets(k, scales, zero_points);
      if (!k->offsets) status = fail("edgelin MatMulNBits: out of memory");
    }
  }
  if (status) {
    free(k->offsets);
    free(k);
    return status;
  }
  *out = k;
  return NULL;
}

typedef struct {
  const void* scratch;
  int64_t K, N;
  const uint8_t* weights;
  const float *scales, *offsets;
  float* y;
} Task;

static void run_task(void* data, size_t index) {
  const Task* t = data;
  int64_t n0 = (int64_t)index * ROWS_PER_TASK, n1 = n0 + ROWS_PER_TASK < t->N ? n0 + ROWS_PER_TASK : t->N;
  edgelin_q4_rows(t->scratch, t->K, t->weights, t->scales, t->offsets, n0, n1, t->y);
}

static OrtStatus* compute(void* kernel, OrtKernelContext* context) {
  Kernel* k = kernel;
  size_t inputs = 0, rank = 0;
  const OrtValue *a = NULL, *b = NULL, *scales = NULL, *zero_points = NULL;
  int64_t dims[8];
  OrtStatus* status = ORT_CALL(g_api, KernelContext_GetInputCount)(context, &inputs);
  if (!status) status = ORT_CALL(g_api, KernelContext_GetInput)(context, 0, &a);
  if (!status) status = ORT_CALL(g_api, KernelContext_GetInput)(context, 1, &b);
  if (!status) status = ORT_CALL(g_api, KernelContext_GetInput)(context, 2, &scales);
  if (!status && inputs > 3) status = ORT_CALL(g_api, KernelContext_GetInput)(context, 3, &zero_points);
  if (!status) status = shape_of(a, dims, &rank);
  if (status) return status;
  if (rank < 1 || dims[rank - 1] != k->K) return fail("edgelin MatMulNBits: A's last dimension is not K");
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < rank; ++i) rows *= dims[i];
  dims[rank - 1] = k->N;
  OrtValue* y = NULL;
  status = ORT_CALL(g_api, KernelContext_GetOutput)(context, 0, dims, rank, &y);
  if (status) return status;
  float* offsets = k->offsets;
  if (!offsets) offsets = make_offsets(k, scales, zero_points);  /* scales fed at run time */
  void* scratch = malloc(edgelin_q4_scratch_bytes(k->K));
  if (!offsets || !scratch) {
    if (offsets != k->offsets) free(offsets);
    free(scratch);
    return fail("edgelin MatMulNBits: out of memory");
  }
  const float* x = data_of(a);
  Task task = {scratch, k->K, k->N, data_of(b), data_of(scales), offsets, NULL};
  size_t tasks = (size_t)((k->N + ROWS_PER_TASK - 1) / ROWS_PER_TASK);
  for (int64_t m = 0; m < rows && !status; ++m) {
    edgelin_q4_quantize(x + m * k->K, k->K, scratch);
    task.y = (float*)data_of(y) + m * k->N;
    if (g_parallel_for && tasks > 1) {
      status = ORT_CALL(g_api, KernelContext_ParallelFor)(context, run_task, tasks, 0, &task);
    } else {
      edgelin_q4_rows(scratch, k->K, task.weights, task.scales, offsets, 0, k->N, task.y);
    }
  }
  free(scratch);
  if (offsets != k->offsets) free(offsets);
  return status;
}

static void destroy_kernel(void* kernel) {
  Kernel* k = kernel;
  if (k) free(k->offsets);
  free(k);
}

static const char* op_name(const OrtCustomOp* op) { (void)op; return "MatMulNBits"; }
static const char* op_provider(const OrtCustomOp* op) { (void)op; return "CPUExecutionProvider"; }
static int input_type(const OrtCustomOp* op, size_t i) { (void)op; return i == 0 || i == 2 ? ORT_TYPE_FLOAT : ORT_TYPE_UINT8; }
static size_t input_count(const OrtCustomOp* op) { (void)op; return 4; }
static int output_type(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return ORT_TYPE_FLOAT; }
static size_t output_count(const OrtCustomOp* op) { (void)op; return 1; }
static int input_kind(const OrtCustomOp* op, size_t i) { (void)op; return i == 3 ? ORT_IO_OPTIONAL : ORT_IO_REQUIRED; }
static int output_kind(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return ORT_IO_REQUIRED; }
static int memory_type(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return 0; }
static int one(const OrtCustomOp* op) { (void)op; return 1; }

static OrtCustomOp g_op;

/* ONNX Runtime's entry point (register_custom_ops_library). */
EDGELIN_API OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
  const OrtApi* api = base->GetApi(ORT_ABI_VERSION);
  if (!api) return NULL;  /* older than 1.16: nothing registered; the export's function bodies run instead */
  g_api = api;
  g_parallel_for = base->GetApi(ORT_ABI_PARALLEL_FOR) != NULL;
  memset(&g_op, 0, sizeof g_op);
  g_op.version = ORT_ABI_VERSION;
  g_op.GetName = op_name;
  g_op.GetExecutionProviderType = op_provider;
  g_op.GetInputType = input_type;
  g_op.GetInputTypeCount = input_count;
  g_op.GetOutputType = output_type;
  g_op.GetOutputTypeCount = output_count;
  g_op.KernelDestroy = destroy_kernel;
  g_op.GetInputCharacteristic = input_kind;
  g_op.GetOutputCharacteristic = output_kind;
  g_op.GetInputMemoryType = memory_type;
  g_op.GetVariadicInputMinArity = one;
  g_op.GetVariadicInputHomogeneity = one;
  g_op.GetVariadicOutputMinArity = one;
  g_op.GetVariadicOutputHomogeneity = one;
  g_op.CreateKernelV2 = create_kernel;
  g_op.KernelComputeV2 = compute;
  OrtCustomOpDomain* domain = NULL;
  OrtStatus* status = ORT_CALL(api, CreateCustomOpDomain)(DOMAIN, &domain);
  if (!status) status = ORT_CALL(api, CustomOpDomain_Add)(domain, &g_op);
  if (!status) status = ORT_CALL(api, AddCustomOpDomain)(options, domain);
  return status;  /* the domain lives as long as the process (ONNX Runtime keeps a pointer to it) */
}

/* For the tests: the runtime's message of a status made at slot CreateStatus, read back through slot
   GetErrorMessage (a wrong slot number fails here rather than in a session). */
EDGELIN_API int edgelin_ort_abi_check(const OrtApiBase* base, char* out, size_t size) {
  const OrtApi* api = base->GetApi(ORT_ABI_VERSION);
  if (!api) return -1;
  OrtStatus* status = ORT_CALL(api, CreateStatus)(ORT_INVALID_ARGUMENT, "edgelin abi check");
  const char* message = ORT_CALL(api, GetErrorMessage)(status);
  strncpy(out, message, size - 1);
  out[size - 1] = 0;
  ORT_CALL(api, ReleaseStatus)(status);
  return base->GetApi(ORT_ABI_PARALLEL_FOR) != NULL;
}
