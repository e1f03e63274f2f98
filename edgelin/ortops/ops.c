/* edgelin's ONNX Runtime operator library, for one-token decoding (and the prefill's 4-bit products), each op with
   the inputs, attributes and outputs of the com.microsoft op of the same name:
   - ai.edgelin::MatMulNBits: the 4-bit and 8-bit weight products of the step and the prefill (q4_gemv.c,
     q8_gemv.c; MatMulNBits' packed weights as stored, so both graphs read one mapping of the weights file);
   - ai.edgelin::CausalConvWithState: the short conv with its carried state, SiLU fused (conv.c);
   - ai.edgelin::LinearAttention: the recurrence's step, every update rule (linear_attention.c);
   - ai.edgelin::GroupQueryAttention: attention over a KV cache, each cached row read once per kv head
     (ops_attention.c, attention.c);
   - ai.edgelin::MatMul: ONNX MatMul's float32 weight products, slices of the weights' rows per thread
     (ops_matmul.c, f32_gemv.c);
   - ai.edgelin::GateThenRmsNorm: Mamba2's gated norm, RMSNorm(x * silu(z)) * w (ops_gdn.c; an edgelin op);
   - ai.edgelin::MatMulF32 / MatMulF16: float32 activations by float32 / float16 weights (--quantize fp16) packed in
     column panels, both graphs (ops_matmul.c, panels.c; MatMulF16 also on ONNX's [K, N], f16_gemm.c; edgelin ops:
     their function bodies unpack the panels for ONNX's MatMul);
   - ai.edgelin::SsdRecurrence: Mamba2's step around the recurrence (dt path, shared keys, skip) in one node
     (ops_ssd.c; an edgelin op: its function body is ONNX ops around com.microsoft::LinearAttention);
   - ai.edgelin::GatedDeltaRecurrence: a Gated DeltaNet layer's step into its recurrence (q / k norms, key heads,
     decay, beta) in one node (ops_gdn.c; an edgelin op, like SsdRecurrence);
   - ai.edgelin::GatedRmsNorm: a recurrence's gated output norm, RMSNorm(o) w silu(z) per head (ops_gdn.c);
   - ai.edgelin::SiluGate: a gated MLP's silu(gate) * up from the fused gate/up product (ops_mlp.c).
   An export that uses them also carries, for each, an ONNX function of the same name whose body is the
   com.microsoft op (ONNX's, for MatMul), so a runtime without this library runs the same file through ONNX Runtime's
   own kernels.
   Load: SessionOptions.register_custom_ops_library(path); ONNX Runtime calls RegisterCustomOps. */
#include <stdlib.h>
#include <string.h>

#include "glue.h"
#include "attention.h"
#include "conv.h"
#include "cpu.h"
#include "linear_attention.h"
#include "q4_gemv.h"
#include "q8_gemv.h"

#define DOMAIN "ai.edgelin"
#define ROWS_PER_TASK 128

typedef struct {
  int64_t K, N, bits;
} Kernel;

static OrtStatus* create_kernel(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
  (void)op;
  (void)api;
  int64_t block = 0;
  Kernel* k = calloc(1, sizeof(Kernel));
  if (!k) return fail("edgelin MatMulNBits: out of memory");
  OrtStatus* status = attribute(info, "K", &k->K);
  if (!status) status = attribute(info, "N", &k->N);
  if (!status) status = attribute(info, "bits", &k->bits);
  if (!status) status = attribute(info, "block_size", &block);
  if (!status && ((k->bits != 4 && k->bits != 8) || block != 32 || k->K <= 0 || k->N <= 0))
    status = fail("edgelin MatMulNBits: only bits 4 or 8 with block_size 32 (export with those, or use "
                  "com.microsoft's)");
  if (status) {
    free(k);
    return status;
  }
  *out = k;
  return NULL;
}

typedef struct {
  const void* scratch;  /* the tokens' activation blocks (the kernel's layout) */
  int64_t M, K, N, bits;
  const uint8_t* weights;
  const float* scales;
  const uint8_t* zero_points;  /* NULL: the midpoint (8, 128) */
  float* y;
  volatile int failed;  /* a task could not allocate its buffer (any task sets it; read after all have run) */
} Task;

static void rows_of(Task* t, int64_t n0, int64_t n1) {
  int (*rows)(const void*, int64_t, int64_t, const uint8_t*, const float*, const uint8_t*, int64_t, int64_t, float*,
              int64_t) = t->bits == 8 ? edgelin_q8_rows_tokens : edgelin_q4_rows_tokens;
  if (rows(t->scratch, t->M, t->K, t->weights, t->scales, t->zero_points, n0, n1, t->y, t->N)) t->failed = 1;
}

static void run_task(void* data, size_t index) {
  Task* t = data;
  int64_t n0 = (int64_t)index * ROWS_PER_TASK, n1 = n0 + ROWS_PER_TASK < t->N ? n0 + ROWS_PER_TASK : t->N;
  rows_of(t, n0, n1);
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
  if (status || rows == 0) return status;
  /* every token's int8 blocks first, then each task's slice of weight rows for all of them (a prefill piece reads
     the weights once per slice, not once per token) */
  size_t bytes = k->bits == 8 ? edgelin_q8_tokens_scratch_bytes(rows, k->K)
                              : edgelin_q4_tokens_scratch_bytes(rows, k->K);
  char* scratch = malloc(bytes);
  if (!scratch) return fail("edgelin MatMulNBits: out of memory");
  if (k->bits == 8) {
    edgelin_q8_quantize_tokens(data_of(a), rows, k->K, scratch);
  } else {
    edgelin_q4_quantize_tokens(data_of(a), rows, k->K, scratch);
  }
  Task task = {scratch, rows, k->K, k->N, k->bits, data_of(b), data_of(scales),
               zero_points ? data_of(zero_points) : NULL, data_of(y), 0};
  size_t tasks = (size_t)((k->N + ROWS_PER_TASK - 1) / ROWS_PER_TASK);
  if (g_parallel_for && tasks > 1) {
    status = ORT_CALL(g_api, KernelContext_ParallelFor)(context, run_task, tasks, 0, &task);
  } else {
    rows_of(&task, 0, k->N);
  }
  free(scratch);
  if (!status && task.failed) status = fail("edgelin MatMulNBits: out of memory");
  return status;
}

static void destroy_kernel(void* kernel) { free(kernel); }

/* ---- ai.edgelin::CausalConvWithState ---------------------------------------------------------------------- */
static OrtStatus* create_conv(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
  (void)op;
  (void)api;
  char activation[16] = {0};
  size_t size = sizeof activation;
  OrtStatus* status = ORT_CALL(g_api, KernelInfoGetAttribute_string)(info, "activation", activation, &size);
  int64_t ndim = status ? 1 : attribute_or(info, "ndim", 1);
  if (!status && (strcmp(activation, "silu") != 0 || ndim != 1))
    status = fail("edgelin CausalConvWithState: only ndim 1 with activation silu (or use com.microsoft's)");
  if (status) return status;
  *out = calloc(1, 1);  /* no state of its own */
  return *out ? NULL : fail("edgelin CausalConvWithState: out of memory");
}

static OrtStatus* compute_conv(void* kernel, OrtKernelContext* context) {
  (void)kernel;
  const OrtValue *x = NULL, *weight = NULL, *bias = NULL, *state = NULL;
  int64_t xd[8], wd[8], sd[8];
  size_t xr = 0, wr = 0, sr = 0, inputs = 0;
  OrtStatus* status = ORT_CALL(g_api, KernelContext_GetInputCount)(context, &inputs);
  if (!status) status = ORT_CALL(g_api, KernelContext_GetInput)(context, 0, &x);
  if (!status) status = ORT_CALL(g_api, KernelContext_GetInput)(context, 1, &weight);
  if (!status && inputs > 2) status = ORT_CALL(g_api, KernelContext_GetInput)(context, 2, &bias);
  if (!status && inputs > 3) status = ORT_CALL(g_api, KernelContext_GetInput)(context, 3, &state);
  if (!status && !state) status = fail("edgelin CausalConvWithState: no conv state input");
  if (!status) status = shape_of(x, xd, &xr);
  if (!status) status = shape_of(weight, wd, &wr);
  if (!status) status = shape_of(state, sd, &sr);
  if (status) return status;
  if (xr != 3 || wr != 3 || sr != 3 || wd[0] != xd[1] || wd[1] != 1 || wd[2] < 1 || wd[2] > 64 || sd[0] != xd[0]
      || sd[1] != xd[1] || sd[2] != wd[2] - 1)
    return fail("edgelin CausalConvWithState: expected x [B, C, T], weight [C, 1, W <= 64], conv_state [B, C, W-1]");
  OrtValue *y = NULL, *present = NULL;
  status = ORT_CALL(g_api, KernelContext_GetOutput)(context, 0, xd, 3, &y);
  if (!status) status = ORT_CALL(g_api, KernelContext_GetOutput)(context, 1, sd, 3, &present);
  if (status) return status;
  edgelin_conv_silu(data_of(x), data_of(weight), bias ? data_of(bias) : NULL, data_of(state), xd[0], xd[1], xd[2],
                    wd[2], data_of(y), data_of(present));
  return NULL;
}

static void destroy_conv(void* kernel) { free(kernel); }

/* ---- ai.edgelin::LinearAttention --------------------------------------------------------------------------- */
typedef struct {
  int rule;
  int64_t q_heads, heads;
  float scale;
} Recurrence;

static OrtStatus* create_la(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
  (void)op;
  (void)api;
  static const char* rules[] = {"linear", "gated", "delta", "gated_delta"};
  char rule[32] = {0};
  size_t size = sizeof rule;
  Recurrence* r = calloc(1, sizeof(Recurrence));
  if (!r) return fail("edgelin LinearAttention: out of memory");
  r->rule = -1;
  OrtStatus* status = ORT_CALL(g_api, KernelInfoGetAttribute_string)(info, "update_rule", rule, &size);
  if (!status) status = attribute(info, "q_num_heads", &r->q_heads);
  if (!status) status = attribute(info, "kv_num_heads", &r->heads);
  if (!status) status = ORT_CALL(g_api, KernelInfoGetAttribute_float)(info, "scale", &r->scale);
  for (int i = 0; !status && i < 4; ++i)
    if (strcmp(rule, rules[i]) == 0) r->rule = i;
  if (!status && (r->rule < 0 || r->q_heads <= 0 || r->heads <= 0 || r->heads % r->q_heads || r->scale == 0.0f))
    status = fail("edgelin LinearAttention: needs update_rule linear|gated|delta|gated_delta, q_num_heads dividing "
                  "kv_num_heads and an explicit non-zero scale (or use com.microsoft's)");
  if (status) {
    free(r);
    return status;
  }
  *out = r;
  return NULL;
}

typedef struct {
  const Recurrence* r;
  const float *q, *k, *v, *decay;
  int64_t gw;
  const float *beta, *state;
  int64_t B, T, H, dk, dv;
  float *out, *present;
} HeadsTask;

static void run_heads_range(const HeadsTask* t, int64_t first, int64_t count) {
  edgelin_linear_attention(t->r->rule, t->q, t->k, t->v, t->decay, t->gw, t->beta, t->state, t->B, t->T,
                           t->r->q_heads, t->H, t->dk, t->dv, t->r->scale, t->out, t->present, first, count);
}

static void run_heads(void* data, size_t index) { run_heads_range(data, (int64_t)index, 1); }

static OrtStatus* compute_la(void* kernel, OrtKernelContext* context) {
  const Recurrence* r = kernel;
  const OrtValue* in[6] = {NULL};
  int64_t qd[8], kd[8], vd[8], sd[8], gd[8];
  size_t qr = 0, kr = 0, vr = 0, sr = 0, gr = 0, inputs = 0;
  OrtStatus* status = ORT_CALL(g_api, KernelContext_GetInputCount)(context, &inputs);
  for (size_t i = 0; !status && i < inputs && i < 6; ++i) status = ORT_CALL(g_api, KernelContext_GetInput)(context, i, &in[i]);
  if (status) return status;
  int gated = r->rule == EDGELIN_RULE_GATED || r->rule == EDGELIN_RULE_GATED_DELTA;
  int delta = r->rule == EDGELIN_RULE_DELTA || r->rule == EDGELIN_RULE_GATED_DELTA;
  if (!in[3] || (gated && !in[4]) || (delta && !in[5]))
    return fail("edgelin LinearAttention: needs past_state, and decay / beta for its update rule");
  status = shape_of(in[0], qd, &qr);
  if (!status) status = shape_of(in[1], kd, &kr);
  if (!status) status = shape_of(in[2], vd, &vr);
  if (!status) status = shape_of(in[3], sd, &sr);
  if (!status && gated) status = shape_of(in[4], gd, &gr);
  if (status) return status;
  int64_t B = qd[0], T = qd[1], H = r->heads, dk = sd[2], dv = sd[3];
  int64_t gw = gated ? gd[2] / H : 1;
  if (qr != 3 || kr != 3 || vr != 3 || sr != 4 || kd[0] != B || vd[0] != B || kd[1] != T || vd[1] != T
      || sd[0] != B || sd[1] != H || qd[2] != r->q_heads * dk || kd[2] != H * dk || vd[2] != H * dv || dv > 1024
      || (gated && (gr != 3 || (gw != 1 && gw != dk) || gd[2] != H * gw)))
    return fail("edgelin LinearAttention: expected q [B, T, Hq*dk], k [B, T, H*dk], v [B, T, H*dv], past_state "
                "[B, H, dk, dv <= 1024], decay [B, T, H or H*dk]");
  int64_t od[3] = {B, T, H * dv};
  OrtValue *o = NULL, *present = NULL;
  status = ORT_CALL(g_api, KernelContext_GetOutput)(context, 0, od, 3, &o);
  if (!status) status = ORT_CALL(g_api, KernelContext_GetOutput)(context, 1, sd, 4, &present);
  if (status) return status;
  HeadsTask task = {r, data_of(in[0]), data_of(in[1]), data_of(in[2]), gated ? data_of(in[4]) : NULL, gw,
                    delta ? data_of(in[5]) : NULL, data_of(in[3]), B, T, H, dk, dv, data_of(o), data_of(present)};
  if (g_parallel_for && B * H > 1)  /* one head per task: the heads' states are independent */
    return ORT_CALL(g_api, KernelContext_ParallelFor)(context, run_heads, (size_t)(B * H), 0, &task);
  run_heads_range(&task, 0, B * H);
  return NULL;
}

static void destroy_la(void* kernel) { free(kernel); }

/* ---- registration ------------------------------------------------------------------------------------------ */
static const char* name_matmul(const OrtCustomOp* op) { (void)op; return "MatMulNBits"; }
static EdgelinElementType input_type_matmul(const OrtCustomOp* op, size_t i) {
  (void)op;
  return i == 0 || i == 2 ? ORT_TYPE_FLOAT : ORT_TYPE_UINT8;
}
static EdgelinIoKind input_kind_matmul(const OrtCustomOp* op, size_t i) { (void)op; return i == 3 ? ORT_IO_OPTIONAL : ORT_IO_REQUIRED; }
static size_t outputs_matmul(const OrtCustomOp* op) { (void)op; return 1; }

static const char* name_conv(const OrtCustomOp* op) { (void)op; return "CausalConvWithState"; }
static EdgelinElementType all_float(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return ORT_TYPE_FLOAT; }
static EdgelinIoKind input_kind_conv(const OrtCustomOp* op, size_t i) { (void)op; return i == 2 ? ORT_IO_OPTIONAL : ORT_IO_REQUIRED; }
static size_t two_outputs(const OrtCustomOp* op) { (void)op; return 2; }

static const char* name_la(const OrtCustomOp* op) { (void)op; return "LinearAttention"; }
static EdgelinIoKind input_kind_la(const OrtCustomOp* op, size_t i) { (void)op; return i >= 3 ? ORT_IO_OPTIONAL : ORT_IO_REQUIRED; }
static size_t inputs_la(const OrtCustomOp* op) { (void)op; return 6; }

static const char* name_attention(const OrtCustomOp* op) { (void)op; return "GroupQueryAttention"; }
static EdgelinElementType input_type_attention(const OrtCustomOp* op, size_t i) { (void)op; return i >= 5 ? ORT_TYPE_INT32 : ORT_TYPE_FLOAT; }
static size_t inputs_attention(const OrtCustomOp* op) { (void)op; return 7; }
static EdgelinElementType input_type_attention_half(const OrtCustomOp* op, size_t i) {
  (void)op;
  return i >= 5 ? ORT_TYPE_INT32 : ORT_TYPE_FLOAT16;
}
static EdgelinElementType output_type_half(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return ORT_TYPE_FLOAT16; }
static EdgelinIoKind all_required(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return ORT_IO_REQUIRED; }
static size_t three_outputs(const OrtCustomOp* op) { (void)op; return 3; }

static const char* name_f32_matmul(const OrtCustomOp* op) { (void)op; return "MatMul"; }
static const char* name_f16_matmul(const OrtCustomOp* op) { (void)op; return "MatMulF16"; }
static const char* name_panel_matmul(const OrtCustomOp* op) { (void)op; return "MatMulF32"; }
static EdgelinElementType input_type_f16_matmul(const OrtCustomOp* op, size_t i) { (void)op; return i ? ORT_TYPE_FLOAT16 : ORT_TYPE_FLOAT; }
static size_t two_inputs(const OrtCustomOp* op) { (void)op; return 2; }
static const char* name_ssd(const OrtCustomOp* op) { (void)op; return "SsdRecurrence"; }
static size_t eight_inputs(const OrtCustomOp* op) { (void)op; return 8; }
static const char* name_gdn(const OrtCustomOp* op) { (void)op; return "GatedDeltaRecurrence"; }
static size_t ten_inputs(const OrtCustomOp* op) { (void)op; return 10; }
static const char* name_gated_norm(const OrtCustomOp* op) { (void)op; return "GatedRmsNorm"; }
static const char* name_gate_then_norm(const OrtCustomOp* op) { (void)op; return "GateThenRmsNorm"; }
static size_t three_inputs(const OrtCustomOp* op) { (void)op; return 3; }
static const char* name_silu_gate(const OrtCustomOp* op) { (void)op; return "SiluGate"; }
static size_t one_input(const OrtCustomOp* op) { (void)op; return 1; }

static const char* op_provider(const OrtCustomOp* op) { (void)op; return "CPUExecutionProvider"; }
static size_t four_inputs(const OrtCustomOp* op) { (void)op; return 4; }
static EdgelinElementType output_type(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return ORT_TYPE_FLOAT; }
static EdgelinIoKind output_kind(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return ORT_IO_REQUIRED; }
static EdgelinMemoryKind memory_type(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return ORT_MEM_DEFAULT; }
static int one(const OrtCustomOp* op) { (void)op; return 1; }

static OrtCustomOp describe(const char* (*name)(const OrtCustomOp*),
                            EdgelinElementType (*input_type)(const OrtCustomOp*, size_t),
                            size_t (*inputs)(const OrtCustomOp*), EdgelinIoKind (*input_kind)(const OrtCustomOp*, size_t),
                            size_t (*outputs)(const OrtCustomOp*),
                            OrtStatus* (*create)(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo*, void**),
                            OrtStatus* (*run)(void*, OrtKernelContext*), void (*destroy)(void*)) {
  OrtCustomOp op;
  memset(&op, 0, sizeof op);
  op.version = ORT_ABI_VERSION;
  op.GetName = name;
  op.GetExecutionProviderType = op_provider;
  op.GetInputType = input_type;
  op.GetInputTypeCount = inputs;
  op.GetOutputType = output_type;
  op.GetOutputTypeCount = outputs;
  op.KernelDestroy = destroy;
  op.GetInputCharacteristic = input_kind;
  op.GetOutputCharacteristic = output_kind;
  op.GetInputMemoryType = memory_type;
  op.GetVariadicInputMinArity = one;
  op.GetVariadicInputHomogeneity = one;
  op.GetVariadicOutputMinArity = one;
  op.GetVariadicOutputHomogeneity = one;
  op.CreateKernelV2 = create;
  op.KernelComputeV2 = run;
  return op;
}

static OrtCustomOp g_ops[13];

/* ONNX Runtime's entry point (register_custom_ops_library), once per session that loads the library. */
EDGELIN_API OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
  const OrtApi* api = base->GetApi(ORT_ABI_VERSION);
  if (!api) return NULL;  /* older than 1.16: nothing registered; the export's function bodies run instead */
  if (!g_api) {  /* the op tables once: sessions made earlier keep pointers to them */
    g_api = api;
    g_parallel_for = base->GetApi(ORT_ABI_PARALLEL_FOR) != NULL;
    g_ops[0] = describe(name_conv, all_float, four_inputs, input_kind_conv, two_outputs, create_conv,
                        compute_conv, destroy_conv);
    g_ops[1] = describe(name_la, all_float, inputs_la, input_kind_la, two_outputs, create_la, compute_la,
                        destroy_la);
    g_ops[2] = describe(name_matmul, input_type_matmul, four_inputs, input_kind_matmul, outputs_matmul, create_kernel,
                        compute, destroy_kernel);
    g_ops[3] = describe(name_attention, input_type_attention, inputs_attention, all_required, three_outputs,
                        edgelin_create_attention, edgelin_compute_attention, edgelin_destroy_attention);
    g_ops[4] = describe(name_attention, input_type_attention_half, inputs_attention, all_required, three_outputs,
                        edgelin_create_attention_half, edgelin_compute_attention, edgelin_destroy_attention);
    g_ops[4].GetOutputType = output_type_half;  /* the float16 kernel of the same op (an fp16 KV cache) */
    g_ops[5] = describe(name_f32_matmul, all_float, two_inputs, all_required, outputs_matmul, edgelin_create_matmul,
                        edgelin_compute_matmul, edgelin_destroy_matmul);
    g_ops[6] = describe(name_ssd, all_float, eight_inputs, all_required, two_outputs, edgelin_create_ssd,
                        edgelin_compute_ssd, edgelin_destroy_fused);
    g_ops[7] = describe(name_gdn, all_float, ten_inputs, all_required, two_outputs, edgelin_create_gdn,
                        edgelin_compute_gdn, edgelin_destroy_fused);
    g_ops[8] = describe(name_gated_norm, all_float, three_inputs, all_required, outputs_matmul,
                        edgelin_create_gated_norm, edgelin_compute_gated_norm, edgelin_destroy_fused);
    g_ops[9] = describe(name_silu_gate, all_float, one_input, all_required, outputs_matmul, edgelin_create_silu_gate,
                        edgelin_compute_silu_gate, edgelin_destroy_fused);
    g_ops[10] = describe(name_f16_matmul, input_type_f16_matmul, two_inputs, all_required, outputs_matmul,
                         edgelin_create_matmul, edgelin_compute_matmul_f16, edgelin_destroy_matmul);
    g_ops[11] = describe(name_gate_then_norm, all_float, three_inputs, all_required, outputs_matmul,
                         edgelin_create_gate_then_norm, edgelin_compute_gated_norm, edgelin_destroy_fused);
    g_ops[12] = describe(name_panel_matmul, all_float, two_inputs, all_required, outputs_matmul,
                         edgelin_create_matmul, edgelin_compute_matmul_f32, edgelin_destroy_matmul);
  }
  /* Where edgelin's vector kernels run: AVX2 on x86-64 (measured faster than ONNX Runtime's there:
     docs/performance.md#cpu-step-latency), and aarch64 (NEON, with dotprod or i8mm where the CPU has them: arm/;
     checked under emulation, timing on boards still to be measured: docs/arm.md). On an x86 CPU without AVX2
     nothing is registered and every node runs its function body, ONNX Runtime's own kernels. */
  if (!edgelin_registers()) return NULL;
  size_t count = sizeof g_ops / sizeof g_ops[0];
  OrtCustomOpDomain* domain = NULL;
  OrtStatus* status = ORT_CALL(api, CreateCustomOpDomain)(DOMAIN, &domain);
  for (size_t i = 0; !status && i < count; ++i)
    status = ORT_CALL(api, CustomOpDomain_Add)(domain, &g_ops[i]);
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
