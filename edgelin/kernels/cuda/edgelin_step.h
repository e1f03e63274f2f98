/* edgelin fused decode step: the C interface shared by the torch extension and the TensorRT plugin.
 *
 * One token for a whole layer (per batch row b and head h, state S [d_k, d_v] float32):
 *   S *= exp(g)                      gate: none | scalar (g [B, H, 1]) | per_key (g [B, H, d_k])
 *   u  = delta ? beta (v - S^T k) : v
 *   S += k u^T ;  o = S^T q
 * With the erase gate (erase_flag = 1, delta rule only; Gated DeltaNet-2, e [B, H, d_k]):
 *   p  = S^T k ;  S += beta k v^T - beta (e * k) p^T ;  o = S^T q
 * (the delta rule reads with the whole key but erases only along e * k; e = 1 is the plain rule).
 * No torch or TensorRT type appears here: pointers, dims, element strides, flags and a stream.
 * The last dim of every tensor is contiguous; strides below are in elements, not bytes.
 * state_out may equal state_in (in-place update) or be another buffer (ping-pong).
 * g and beta have their own dtype, `aux_dtype` (float32 by default, the zero value): a half-precision
 * engine must not round its decay to fp16. aux_dtype is float32 or the same as `dtype`.
 * ABI version 2: aux_dtype added. ABI version 3: the erase gate (erase flag, erase pointer of
 * aux_dtype, its strides) appended to the struct. Callers check edgelin_step_abi_version() against
 * the header.
 */
#ifndef EDGELIN_STEP_H
#define EDGELIN_STEP_H

#include <stdint.h>
#include <cuda_runtime.h>

#ifdef __cplusplus
extern "C" {
#endif

#define EDGELIN_STEP_ABI_VERSION 3
#define EDGELIN_STEP_MAX_HEAD_DIM 256

typedef enum { EDGELIN_F32 = 0, EDGELIN_F16 = 1, EDGELIN_BF16 = 2 } EdgelinDtype;
typedef enum { EDGELIN_GATE_NONE = 0, EDGELIN_GATE_SCALAR = 1, EDGELIN_GATE_PER_KEY = 2 } EdgelinGate;

typedef enum {
  EDGELIN_OK = 0,
  EDGELIN_ERR_NULL = -1,      /* a required pointer is NULL (erase too, when the erase flag is on) */
  EDGELIN_ERR_DIMS = -2,      /* batch/heads < 1, or d_k / d_v outside 1..256 */
  EDGELIN_ERR_FLAGS = -3,     /* unknown dtype or gate, delta or erase not 0/1, erase without delta,
                                 aux_dtype neither f32 nor dtype */
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
  int32_t aux_dtype; /* EdgelinDtype of g, beta and erase: EDGELIN_F32 (default) or `dtype` */
  /* ABI 3: the erase gate e [B, H, d_k] of `aux_dtype` (needs delta); NULL and 0 when absent */
  const void* erase;
  int64_t erase_stride_b, erase_stride_h;
  int32_t erase_flag; /* 0: the delta rule erases along k; 1: along erase * k */
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
