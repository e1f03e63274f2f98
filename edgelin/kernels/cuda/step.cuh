// The fused decode step kernel: one CTA owns a [d_k, 32] column tile of one (batch, head) state.
//
// Thread layout (128 threads): col4 = tid % 8 picks 4 adjacent value columns, row = tid / 8 picks
// rows row, row + 16, ... of d_k (up to 16 rows each, so d_k <= 256 lives in registers). A warp
// then covers 4 rows x 128 contiguous bytes: every state load/store is a coalesced 16-byte access.
// Small CTAs with few registers let many CTAs share an SM, which keeps enough state bytes in
// flight to stream at copy bandwidth (256-thread CTAs reached only 70-83% of it on an H200).
// Column sums over d_k (S^T k for the delta rule, S^T q for the readout) reduce in two steps:
// shuffles across the 4 rows of a warp, then shared memory across the 8 warps.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "edgelin_step.h"

namespace edgelin {

constexpr int kThreads = 128;
constexpr int kColsPerThread = 4;
constexpr int kColGroups = 8;                          // 8 x 4 = 32 columns per CTA
constexpr int kTileV = kColGroups * kColsPerThread;
constexpr int kRowGroups = kThreads / kColGroups;      // 16
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Sum each of the 4 column values over all d_k rows of the tile; every thread gets the totals
// for its own 4 columns. `scratch` is [kWarps][kTileV].
__device__ __forceinline__ void column_sums(float (&part)[kColsPerThread], float* scratch, int col4) {
#pragma unroll
  for (int c = 0; c < kColsPerThread; ++c) {
    part[c] += __shfl_xor_sync(0xffffffffu, part[c], 8);
    part[c] += __shfl_xor_sync(0xffffffffu, part[c], 16);
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane < kColGroups) {
#pragma unroll
    for (int c = 0; c < kColsPerThread; ++c) scratch[warp * kTileV + col4 * kColsPerThread + c] = part[c];
  }
  __syncthreads();
#pragma unroll
  for (int c = 0; c < kColsPerThread; ++c) {
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += scratch[w * kTileV + col4 * kColsPerThread + c];
    part[c] = total;
  }
}

// T: q, k, v, o; TG: g and beta (float, or T); GATE: EdgelinGate; DELTA: delta rule;
// VEC: 16-byte state accesses (d_v % 4 == 0, aligned rows);
// ROWS: d_k rows per thread (8: d_k <= 128, 16: d_k <= 256). Fewer rows, fewer registers, more
// CTAs per SM and so more state bytes in flight.
template <typename T, typename TG, int GATE, bool DELTA, bool VEC, int ROWS>
__global__ void __launch_bounds__(kThreads) step_kernel(const EdgelinStepArgs a) {
  constexpr int kRowsPerThread = ROWS;
  __shared__ float scratch[2][kWarps * kTileV];  // two buffers: no barrier between the two sums
  const int tiles = (a.d_v + kTileV - 1) / kTileV;
  const int bh = blockIdx.x / tiles, tile = blockIdx.x % tiles;
  const int b = bh / a.heads, h = bh % a.heads;
  const int col4 = threadIdx.x % kColGroups, row = threadIdx.x / kColGroups;
  const int col = tile * kTileV + col4 * kColsPerThread;
  const int K = a.d_k, V = a.d_v;

  const T* q = static_cast<const T*>(a.q) + b * a.q_stride_b + h * a.q_stride_h;
  const T* k = static_cast<const T*>(a.k) + b * a.k_stride_b + h * a.k_stride_h;
  const T* v = static_cast<const T*>(a.v) + b * a.v_stride_b + h * a.v_stride_h;
  const float* s_in = a.state_in + b * a.in_stride_b + h * a.in_stride_h;
  float* s_out = a.state_out + b * a.out_stride_b + h * a.out_stride_h;

  // Issue every state load first (independent, 16 bytes each) so they are all in flight together.
  float s[kRowsPerThread][kColsPerThread];
#pragma unroll
  for (int r = 0; r < kRowsPerThread; ++r) {
    const int kr = row + r * kRowGroups;
    const float* p = s_in + kr * a.in_stride_k + col;
    if (VEC) {
      float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
      if (kr < K && col < V) x = *reinterpret_cast<const float4*>(p);
      s[r][0] = x.x; s[r][1] = x.y; s[r][2] = x.z; s[r][3] = x.w;
    } else {
#pragma unroll
      for (int c = 0; c < kColsPerThread; ++c) s[r][c] = (kr < K && col + c < V) ? p[c] : 0.f;
    }
  }
  float kv[kRowsPerThread], qv[kRowsPerThread];
#pragma unroll
  for (int r = 0; r < kRowsPerThread; ++r) {
    const int kr = row + r * kRowGroups;
    kv[r] = kr < K ? to_float(k[kr]) : 0.f;
    qv[r] = kr < K ? to_float(q[kr]) : 0.f;
  }
  float vv[kColsPerThread];
#pragma unroll
  for (int c = 0; c < kColsPerThread; ++c) vv[c] = col + c < V ? to_float(v[col + c]) : 0.f;

  if (GATE == EDGELIN_GATE_SCALAR) {
    const float decay = __expf(to_float(static_cast<const TG*>(a.g)[b * a.g_stride_b + h * a.g_stride_h]));
#pragma unroll
    for (int r = 0; r < kRowsPerThread; ++r)
#pragma unroll
      for (int c = 0; c < kColsPerThread; ++c) s[r][c] *= decay;
  } else if (GATE == EDGELIN_GATE_PER_KEY) {
    const TG* g = static_cast<const TG*>(a.g) + b * a.g_stride_b + h * a.g_stride_h;
#pragma unroll
    for (int r = 0; r < kRowsPerThread; ++r) {
      const int kr = row + r * kRowGroups;
      const float decay = kr < K ? __expf(to_float(g[kr])) : 0.f;
#pragma unroll
      for (int c = 0; c < kColsPerThread; ++c) s[r][c] *= decay;
    }
  }

  float u[kColsPerThread];
  if (DELTA) {
    float part[kColsPerThread] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int r = 0; r < kRowsPerThread; ++r)
#pragma unroll
      for (int c = 0; c < kColsPerThread; ++c) part[c] = fmaf(s[r][c], kv[r], part[c]);
    column_sums(part, scratch[0], col4);
    const float beta = to_float(static_cast<const TG*>(a.beta)[b * a.beta_stride_b + h * a.beta_stride_h]);
#pragma unroll
    for (int c = 0; c < kColsPerThread; ++c) u[c] = beta * (vv[c] - part[c]);
  } else {
#pragma unroll
    for (int c = 0; c < kColsPerThread; ++c) u[c] = vv[c];
  }

  float out[kColsPerThread] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int r = 0; r < kRowsPerThread; ++r) {
    const int kr = row + r * kRowGroups;
#pragma unroll
    for (int c = 0; c < kColsPerThread; ++c) {
      s[r][c] = fmaf(kv[r], u[c], s[r][c]);
      out[c] = fmaf(s[r][c], qv[r], out[c]);
    }
    float* p = s_out + kr * a.out_stride_k + col;
    if (VEC) {
      if (kr < K && col < V) *reinterpret_cast<float4*>(p) = make_float4(s[r][0], s[r][1], s[r][2], s[r][3]);
    } else {
#pragma unroll
      for (int c = 0; c < kColsPerThread; ++c)
        if (kr < K && col + c < V) p[c] = s[r][c];
    }
  }
  column_sums(out, scratch[1], col4);
  if (row == 0) {
    T* o = static_cast<T*>(a.o) + b * a.o_stride_b + h * a.o_stride_h;
#pragma unroll
    for (int c = 0; c < kColsPerThread; ++c)
      if (col + c < V) o[col + c] = from_float<T>(out[c]);
  }
}

}  // namespace edgelin
