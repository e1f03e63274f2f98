/* What the ops' ONNX Runtime glue shares: the API table, one-line failures, shapes and data of values. */
#ifndef EDGELIN_GLUE_H
#define EDGELIN_GLUE_H
#include <stddef.h>
#include <stdint.h>

#include "ort_api.h"

extern const OrtApi* g_api;  /* set by RegisterCustomOps */
extern int g_parallel_for;   /* 1: the runtime has KernelContext_ParallelFor */

OrtStatus* fail(const char* message);
OrtStatus* attribute(const OrtKernelInfo* info, const char* name, int64_t* out);
/* An optional attribute: `fallback` when the node does not set it. */
int64_t attribute_or(const OrtKernelInfo* info, const char* name, int64_t fallback);
float float_attribute_or(const OrtKernelInfo* info, const char* name, float fallback);
OrtStatus* shape_of(const OrtValue* value, int64_t* dims, size_t* rank);
void* data_of(const OrtValue* value);
/* Inputs 0..n-1 (n <= 10) of a node and their shapes (rank <= 8 each). */
OrtStatus* inputs_of(OrtKernelContext* context, size_t n, const OrtValue** in, int64_t (*dims)[8], size_t* ranks);
int64_t count_of(const int64_t* dims, size_t rank);

/* What a fused recurrence op's attributes say (SsdRecurrence, GatedDeltaRecurrence): query (key) heads dividing the
   value heads, the readout's scale, and (when `epsilon` is not NULL) the q / k norms' epsilon. */
typedef struct {
  int64_t q_heads, heads;
  float scale, epsilon;
} FusedHeads;
/* floats of per-call scratch a fused op keeps on its stack (16 KiB) before it takes the heap */
enum { SMALL_SCRATCH = 4096 };
OrtStatus* fused_heads_create(const OrtKernelInfo* info, const char* failure, int with_epsilon, void** out);

/* ai.edgelin::GroupQueryAttention (ops_attention.c) */
OrtStatus* edgelin_create_attention(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out);
OrtStatus* edgelin_create_attention_half(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info,
                                         void** out);
OrtStatus* edgelin_compute_attention(void* kernel, OrtKernelContext* context);
void edgelin_destroy_attention(void* kernel);

/* ai.edgelin::MatMul (ops_matmul.c) */
OrtStatus* edgelin_create_matmul(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out);
OrtStatus* edgelin_compute_matmul(void* kernel, OrtKernelContext* context);
void edgelin_destroy_matmul(void* kernel);
/* ai.edgelin::MatMulF16 and MatMulF32 (ops_matmul.c): B float16 / float32 in packed panels (MatMulF16 also [K, N]);
   created and destroyed as MatMul */
OrtStatus* edgelin_compute_matmul_f16(void* kernel, OrtKernelContext* context);
OrtStatus* edgelin_compute_matmul_f32(void* kernel, OrtKernelContext* context);

/* ai.edgelin::SsdRecurrence (ops_ssd.c) */
OrtStatus* edgelin_create_ssd(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out);
OrtStatus* edgelin_compute_ssd(void* kernel, OrtKernelContext* context);

/* ai.edgelin::GatedDeltaRecurrence (ops_gdn.c) */
OrtStatus* edgelin_create_gdn(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out);
OrtStatus* edgelin_compute_gdn(void* kernel, OrtKernelContext* context);
/* ai.edgelin::GatedRmsNorm (ops_gdn.c) */
OrtStatus* edgelin_create_gated_norm(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info,
                                     void** out);
OrtStatus* edgelin_compute_gated_norm(void* kernel, OrtKernelContext* context);
/* ai.edgelin::GateThenRmsNorm (ops_gdn.c): computed by edgelin_compute_gated_norm */
OrtStatus* edgelin_create_gate_then_norm(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info,
                                         void** out);

/* ai.edgelin::SiluGate (ops_mlp.c) */
OrtStatus* edgelin_create_silu_gate(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info,
                                    void** out);
OrtStatus* edgelin_compute_silu_gate(void* kernel, OrtKernelContext* context);

void edgelin_destroy_fused(void* kernel);  /* the fused ops' (and SiluGate's) */
#endif
