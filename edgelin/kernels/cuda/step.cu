// The plain-C launcher: validates EdgelinStepArgs, picks the template instance for the flags
// (dtype x aux dtype x gate x delta x erase x vectorised x CTA tile), and enqueues it on the caller's stream. No
// allocation, no synchronisation: safe inside CUDA-graph capture and from a TensorRT plugin's enqueue().
#include <stdint.h>

#include "edgelin_step.h"
#include "step.cuh"

namespace {

using edgelin::Tile;
// The CTA shapes, [d_k rows, value columns] (edgelin/kernels/cuda/step.cuh). Chosen on an H200 at
// H=16, K=V=128 (docs/performance.md#gpu-decode): the small tile was fastest at B=1 and B=8, the large one at
// B=64 and B=256 (96.5-97.6% of copy bandwidth at B=256; a [128, 32] tile gave 93-94%).
using SmallTile = Tile<128, 4, 4>;    // [128, 16]: many small CTAs when few heads cannot fill the GPU
using LargeTile = Tile<128, 16, 16>;  // [128, 64]: 32 KB of state per CTA when there are many heads
using WideTile = Tile<128, 8, 16>;    // [256, 32]: d_k up to 256, and the unvectorised fallback
// Below this many 32-column tiles (B * H * ceil(d_v / 32)) the small tile is used: between the
// measured points (B*H = 128: small faster; B*H = 1024: large faster).
constexpr int64_t kLargeGrid = 1024;
constexpr int kTileV = 32;  // the ABI's grid check counts 32-column tiles (EDGELIN_ERR_GRID)

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// 16-byte state accesses need d_v % 4 == 0, every row start 16-byte aligned, both buffers.
bool can_vectorise(const EdgelinStepArgs& a) {
  const bool strides = a.in_stride_b % 4 == 0 && a.in_stride_h % 4 == 0 && a.in_stride_k % 4 == 0 &&
                       a.out_stride_b % 4 == 0 && a.out_stride_h % 4 == 0 && a.out_stride_k % 4 == 0;
  return a.d_v % 4 == 0 && strides && aligned(a.state_in, 16) && aligned(a.state_out, 16);
}

template <class TL, typename T, typename TG, int GATE, bool DELTA, bool ERASE, bool VEC>
int launch_tile(const EdgelinStepArgs& a, cudaStream_t stream) {
  // 1-D grid, column tiles fastest: neighbouring CTAs stream one head's contiguous state together
  const unsigned tiles = static_cast<unsigned>((a.d_v + TL::kTileV - 1) / TL::kTileV);
  const dim3 grid(static_cast<unsigned>(a.batch) * static_cast<unsigned>(a.heads) * tiles);
  edgelin::step_kernel<T, TG, GATE, DELTA, ERASE, VEC, TL><<<grid, TL::kThreads, 0, stream>>>(a);
  return static_cast<int>(cudaGetLastError());
}

template <typename T, typename TG, int GATE, bool DELTA, bool ERASE = false>
int launch_vec(const EdgelinStepArgs& a, cudaStream_t stream) {
  if (!can_vectorise(a)) return launch_tile<WideTile, T, TG, GATE, DELTA, ERASE, false>(a, stream);
  if (a.d_k > LargeTile::kMaxK) return launch_tile<WideTile, T, TG, GATE, DELTA, ERASE, true>(a, stream);
  const int64_t tiles32 = static_cast<int64_t>(a.batch) * a.heads * ((a.d_v + kTileV - 1) / kTileV);
  if (tiles32 < kLargeGrid) return launch_tile<SmallTile, T, TG, GATE, DELTA, ERASE, true>(a, stream);
  return launch_tile<LargeTile, T, TG, GATE, DELTA, ERASE, true>(a, stream);
}

// the delta rule, with or without the erase gate (which needs it: checked by the launcher)
template <typename T, typename TG, int GATE>
int launch_rule(const EdgelinStepArgs& a, cudaStream_t stream) {
  return a.erase_flag ? launch_vec<T, TG, GATE, true, true>(a, stream) : launch_vec<T, TG, GATE, true>(a, stream);
}

template <typename T, typename TG, int GATE>
int launch_delta(const EdgelinStepArgs& a, cudaStream_t stream) {
  return a.delta ? launch_rule<T, TG, GATE>(a, stream) : launch_vec<T, TG, GATE, false>(a, stream);
}

template <typename T, typename TG>
int launch_gate(const EdgelinStepArgs& a, cudaStream_t stream) {
  switch (a.gate) {
    case EDGELIN_GATE_SCALAR: return launch_delta<T, TG, EDGELIN_GATE_SCALAR>(a, stream);
    case EDGELIN_GATE_PER_KEY: return launch_delta<T, TG, EDGELIN_GATE_PER_KEY>(a, stream);
    // no gate: only beta can read TG, so the additive rule needs one instance per T alone
    default: return a.delta ? launch_rule<T, TG, EDGELIN_GATE_NONE>(a, stream)
                            : launch_vec<T, T, EDGELIN_GATE_NONE, false>(a, stream);
  }
}

// g, beta and erase in float32 (the default) or in the inputs' own dtype
template <typename T>
int launch_aux(const EdgelinStepArgs& a, cudaStream_t stream) {
  return a.aux_dtype == EDGELIN_F32 ? launch_gate<T, float>(a, stream) : launch_gate<T, T>(a, stream);
}

}  // namespace

extern "C" int edgelin_step_launch(const EdgelinStepArgs* args, cudaStream_t stream) {
  if (args == nullptr) return EDGELIN_ERR_NULL;
  const EdgelinStepArgs& a = *args;
  if (!a.q || !a.k || !a.v || !a.o || !a.state_in || !a.state_out) return EDGELIN_ERR_NULL;
  if (a.batch < 1 || a.heads < 1 || a.d_k < 1 || a.d_v < 1 || a.d_k > EDGELIN_STEP_MAX_HEAD_DIM ||
      a.d_v > EDGELIN_STEP_MAX_HEAD_DIM)
    return EDGELIN_ERR_DIMS;
  if (a.dtype < EDGELIN_F32 || a.dtype > EDGELIN_BF16 || a.gate < EDGELIN_GATE_NONE ||
      a.gate > EDGELIN_GATE_PER_KEY || (a.delta != 0 && a.delta != 1) || (a.erase_flag != 0 && a.erase_flag != 1) ||
      (a.erase_flag && !a.delta) || (a.aux_dtype != EDGELIN_F32 && a.aux_dtype != a.dtype))
    return EDGELIN_ERR_FLAGS;
  if ((a.gate != EDGELIN_GATE_NONE && !a.g) || (a.delta && !a.beta) || (a.erase_flag && !a.erase))
    return EDGELIN_ERR_NULL;
  const int64_t ctas = static_cast<int64_t>(a.batch) * a.heads * ((a.d_v + kTileV - 1) / kTileV);
  if (ctas > 0x7fffffffLL) return EDGELIN_ERR_GRID;
  const size_t elem = a.dtype == EDGELIN_F32 ? 4 : 2, aux = a.aux_dtype == EDGELIN_F32 ? 4 : 2;
  if (!aligned(a.q, elem) || !aligned(a.k, elem) || !aligned(a.v, elem) || !aligned(a.o, elem) ||
      (a.g && !aligned(a.g, aux)) || (a.beta && !aligned(a.beta, aux)) ||
      (a.erase_flag && !aligned(a.erase, aux)) || !aligned(a.state_in, 4) ||
      !aligned(a.state_out, 4))
    return EDGELIN_ERR_ALIGN;
  switch (a.dtype) {
    case EDGELIN_F32: return launch_gate<float, float>(a, stream);
    case EDGELIN_F16: return launch_aux<__half>(a, stream);
    default: return launch_aux<__nv_bfloat16>(a, stream);
  }
}

extern "C" int edgelin_step_abi_version(void) { return EDGELIN_STEP_ABI_VERSION; }

extern "C" const char* edgelin_step_status_string(int code) {
  switch (code) {
    case EDGELIN_OK: return "ok";
    case EDGELIN_ERR_NULL: return "a required pointer is NULL (q, k, v, o, states; g, beta or erase when flagged)";
    case EDGELIN_ERR_DIMS: return "batch and heads must be >= 1 and d_k, d_v within 1..256";
    case EDGELIN_ERR_FLAGS:
      return "unknown dtype or gate, delta or erase_flag not 0/1, erase without delta, or aux_dtype neither float32 "
             "nor dtype";
    case EDGELIN_ERR_ALIGN: return "a pointer is not aligned to its element size";
    case EDGELIN_ERR_GRID: return "batch * heads * ceil(d_v / 32) exceeds 2^31 - 1";
    default: return code > 0 ? cudaGetErrorString(static_cast<cudaError_t>(code)) : "unknown edgelin status";
  }
}
