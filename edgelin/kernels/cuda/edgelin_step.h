/* edgelin fused decode step: the C interface shared by the torch extension and the TensorRT plugin.
 *
 * One token for a whole layer (per batch row b and head h, state S [d_k, d_v] float32):
 *   S *= exp(g)                      gate: none | scalar (g [B, H, 1]) | per_key (g [B, H, d_k])
 *   u  = delta ? beta (v - S^T k) : v
 *   S += k u^T ;  o = S^T q
 * No torch or TensorRT type appears here: pointers, dims, element strides, flags and a stream.
 * The last dim of every tensor is contiguous; strides below are in elements, not bytes.
 * state_out may equal state_in (in-place update) or be another buffer (ping-pong).
 * g and beta have their own dtype, `aux_dtype` (float32 by default, the zero value): a half-precision
 * engine must not round its decay to fp16. aux_dtype is float32 or the same as `dtype`.
 * ABI version 2: aux_dtype added; callers check edgelin_step_abi_version() against the header.
 */
#ifndef EDGELIN_STEP_H
#define EDGELIN_STEP_H

#include <stdint.h>
#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

#define EDGELIN_STEP_ABI_VERSION 2
#define EDGELIN_STEP_MAX_HEAD_DIM 256

typedef enum { EDGELIN_F32 = 0, EDGELIN_F16 = 1, EDGELIN_BF16 = 2 } EdgelinDtype;
typedef enum { EDGELIN_GATE_NONE = 0, EDGELIN_GATE_SCALAR = 1, EDGELIN_GATE_PER_KEY = 2 } EdgelinGate;

typedef enum {
  EDGELIN_OK = 0,
  EDGELIN_ERR_NULL = -1,      /* a required pointer is NULL */
  EDGELIN_ERR_DIMS = -2,      /* batch/heads < 1, or d_k / d_v outside 1..256 */
  EDGELIN_ERR_FLAGS = -3,     /* unknown dtype or gate, delta not 0/1, aux_dtype neither f32 nor dtype */
  EDGELIN_ERR_ALIGN = -4,     /* a pointer is not aligned to its element size */
  EDGELIN_ERR_GRID = -5       /* batch * heads * ceil(d_v / 32) exceeds the grid limit */
} EdgelinStatus;

typedef struct EdgelinStepArgs {
  /* q, k [B, H, d_k]; v, o [B, H, d_v]; all of `dtype` */
  const void* q;
  const void* k;
  const void* v;
  void* o;
  /* g [B, H, 1 | d_k] and beta [B, H], of `aux_dtype`; NULL when the flag says absent */
  const void* g;
  const void* beta;
  /* state [B, H, d_k, d_v], float32 */
  const float* state_in;
  float* state_out;
  int32_t batch, heads, d_k, d_v;
  int64_t q_stride_b, q_stride_h, k_stride_b, k_stride_h, v_stride_b, v_stride_h, o_stride_b, o_stride_h;
  int64_t g_stride_b, g_stride_h, beta_stride_b, beta_stride_h;
  int64_t in_stride_b, in_stride_h, in_stride_k;
  int64_t out_stride_b, out_stride_h, out_stride_k;
  int32_t dtype; /* EdgelinDtype */
  int32_t gate;  /* EdgelinGate */
  int32_t delta; /* 0: additive rule, 1: delta rule (beta required) */
  int32_t aux_dtype; /* EdgelinDtype of g and beta: EDGELIN_F32 (default) or `dtype` */
} EdgelinStepArgs;

/* Validates the arguments and enqueues the kernel on `stream`. Returns EDGELIN_OK, an
 * EdgelinStatus (< 0, nothing launched), or a cudaError_t (> 0) from the launch. */
int edgelin_step_launch(const EdgelinStepArgs* args, cudaStream_t stream);

/* EDGELIN_STEP_ABI_VERSION of the launcher this library was built with: a caller built against
 * another header (a plugin, an extension) compares it with its own and refuses a mismatch. */
int edgelin_step_abi_version(void);

/* A static, human-readable message for a code returned by edgelin_step_launch. */
const char* edgelin_step_status_string(int code);

#ifdef __cplusplus
}
#endif

#endif /* EDGELIN_STEP_H */
