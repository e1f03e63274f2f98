// The fused decode step kernel: one CTA owns a [d_k, TILE_V] column tile of one (batch, head) state.
//
// Thread layout (a Tile: THREADS threads, COLGROUPS x 4 value columns, ROWS rows each): col4 = tid %
// COLGROUPS picks 4 adjacent value columns, row = tid / COLGROUPS picks rows row, row + ROW_GROUPS,
// ... of d_k, so all of d_k lives in registers. A warp covers 32 / COLGROUPS rows of COLGROUPS * 16
// contiguous bytes: every state load and store is a coalesced 16-byte access. step.cu picks the tile.
//
// Order of the memory traffic (why the kernel streams at copy bandwidth, issue 12):
//   1. every state load of the CTA is issued first;
//   2. a barrier: a scheduling fence, since ptxas may not move a global load across it (and
//      BAR.SYNC does not wait for the loads in flight: no scoreboard wait in its SASS);
//   3. q, k, v, g and beta: each element loaded once per CTA, all in one round trip that overlaps
//      the state's, converted (and exp(g) taken) once into shared memory;
//   4. the update, reading the inputs from shared memory.
// Without (2), ptxas hoisted the input loads, their conversions and exp(g) above the state loads, so
// each warp waited a whole memory round trip before requesting its state (77-88% of copy bandwidth
// at B=256, 3.2-4.5 us at B=1 on an H200). With (2) but per-row input loads, ptxas serialised those
// loads behind the barrier instead (up to 16 dependent waits per CTA); (3) makes them one batch.
// tests/test_kernels.py checks the order in the SASS of every arch.
// The erase gate (ERASE, Gated DeltaNet-2) is one more per-key input loaded with q and k in (3); the
// update then erases along e * k and writes along k: S += k (beta v)^T - (e * k)(beta S^T k)^T, one
// more FMA per state element and no more state traffic.
// Column sums over d_k (S^T k for the delta rule, S^T q for the readout) reduce in two steps:
// shuffles across the rows of a warp, then shared memory across the warps.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "edgelin_step.h"

namespace edgelin {

constexpr int kColsPerThread = 4;  // one float4 of state per row

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// The CTA shape: THREADS threads, COLGROUPS x 4 value columns, ROWS d_k rows per thread.
template <int THREADS_, int COLGROUPS_, int ROWS_>
struct Tile {
  static constexpr int kThreads = THREADS_;
  static constexpr int kColGroups = COLGROUPS_;
  static constexpr int kRows = ROWS_;
  static constexpr int kTileV = COLGROUPS_ * kColsPerThread;
  static constexpr int kRowGroups = THREADS_ / COLGROUPS_;
  static constexpr int kMaxK = kRowGroups * ROWS_;
  static constexpr int kWarps = THREADS_ / 32;
  // ask ptxas for no more than ~168 registers, not fewer: left to itself it capped some instances
  // at 96 or 128 and spilled, though occupancy matters less here than bytes in flight per CTA
  static constexpr int kMinBlocks = 65536 / (THREADS_ * 168);
  static_assert(THREADS_ % 32 == 0 && 32 % COLGROUPS_ == 0, "a warp holds whole rows of the tile");
};

// Sum each of the 4 column values over all d_k rows of the tile; every thread gets the totals
// for its own 4 columns. `scratch` is [kWarps][kTileV].
template <class TL>
__device__ __forceinline__ void column_sums(float (&part)[kColsPerThread], float* scratch, int col4) {
#pragma unroll
  for (int lanes = TL::kColGroups; lanes < 32; lanes *= 2)
#pragma unroll
    for (int c = 0; c < kColsPerThread; ++c) part[c] += __shfl_xor_sync(0xffffffffu, part[c], lanes);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane < TL::kColGroups) {
#pragma unroll
    for (int c = 0; c < kColsPerThread; ++c) scratch[warp * TL::kTileV + col4 * kColsPerThread + c] = part[c];
  }
  __syncthreads();
#pragma unroll
  for (int c = 0; c < kColsPerThread; ++c) {
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < TL::kWarps; ++w) total += scratch[w * TL::kTileV + col4 * kColsPerThread + c];
    part[c] = total;
  }
}

// T: q, k, v, o; TG: g, beta and erase (float, or T); GATE: EdgelinGate; DELTA: delta rule;
// ERASE: the erase gate (DELTA only); VEC: 16-byte state accesses (d_v % 4 == 0, aligned rows);
// TL: the tile (d_k <= TL::kMaxK).
template <typename T, typename TG, int GATE, bool DELTA, bool ERASE, bool VEC, class TL>
__global__ void __launch_bounds__(TL::kThreads, TL::kMinBlocks) step_kernel(const EdgelinStepArgs a) {
  constexpr int kRowsPerThread = TL::kRows, kRowGroups = TL::kRowGroups, kTileV = TL::kTileV;
  constexpr int kMaxK = TL::kMaxK, kThreads = TL::kThreads;
  // the inputs as float32, shared by the CTA: q, k, exp(g) per key, this tile's v, exp(g) and beta
  __shared__ float in_q[kMaxK], in_k[kMaxK], in_decay[GATE == EDGELIN_GATE_PER_KEY ? kMaxK : 1], in_v[kTileV];
  __shared__ float in_erase[ERASE ? kMaxK : 1];
  __shared__ float in_head[2];
  __shared__ float scratch[2][TL::kWarps * kTileV];  // two buffers: no barrier between the two sums
  const int tiles = (a.d_v + kTileV - 1) / kTileV;
  const int bh = blockIdx.x / tiles, tile = blockIdx.x % tiles;
  const int b = bh / a.heads, h = bh % a.heads;
  const int col4 = threadIdx.x % TL::kColGroups, row = threadIdx.x / TL::kColGroups;
  const int col = tile * kTileV + col4 * kColsPerThread;
  const int K = a.d_k, V = a.d_v;

  const float* s_in = a.state_in + b * a.in_stride_b + h * a.in_stride_h;
  float* s_out = a.state_out + b * a.out_stride_b + h * a.out_stride_h;

  // 1. Every state load (independent, 16 bytes each), so they are all in flight together. Row
  // addresses advance by a precomputed step: a multiply per row made ptxas reload the stride
  // from the parameter bank per row and wait on it between two state loads.
  float s[kRowsPerThread][kColsPerThread];
  const int64_t in_step = static_cast<int64_t>(kRowGroups) * a.in_stride_k;
  const float* p_in = s_in + row * a.in_stride_k + col;
#pragma unroll
  for (int r = 0; r < kRowsPerThread; ++r, p_in += in_step) {
    const int kr = row + r * kRowGroups;
    const float* p = p_in;
    if (VEC) {
      float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
      if (kr < K && col < V) x = *reinterpret_cast<const float4*>(p);
      s[r][0] = x.x; s[r][1] = x.y; s[r][2] = x.z; s[r][3] = x.w;
    } else {
#pragma unroll
      for (int c = 0; c < kColsPerThread; ++c) s[r][c] = (kr < K && col + c < V) ? p[c] : 0.f;
    }
  }
  // 2. The fence (see the header comment): the input loads below stay behind the state loads.
  __syncthreads();

  // 3. The inputs, each element loaded once per CTA (one round trip, not one per row), converted
  // and decayed once, then read from shared memory. Rows past d_k hold zeros (decay 1). Every
  // load is unconditional (indices clamped into range, the value masked after): a masked load
  // would become a branch, and ptxas would wait for one load before issuing the next.
  {
    const T* q = static_cast<const T*>(a.q) + b * a.q_stride_b + h * a.q_stride_h;
    const T* k = static_cast<const T*>(a.k) + b * a.k_stride_b + h * a.k_stride_h;
    const T* v = static_cast<const T*>(a.v) + b * a.v_stride_b + h * a.v_stride_h;
    const TG* g = static_cast<const TG*>(a.g) + b * a.g_stride_b + h * a.g_stride_h;
    const TG* e = static_cast<const TG*>(a.erase) + b * a.erase_stride_b + h * a.erase_stride_h;
    constexpr int kPer = (kMaxK + kThreads - 1) / kThreads;
    T rq[kPer], rk[kPer];
    TG rg[kPer], re[kPer];
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int i = min(static_cast<int>(threadIdx.x) + j * kThreads, K - 1);
      rq[j] = q[i];
      rk[j] = k[i];
      if (GATE == EDGELIN_GATE_PER_KEY) rg[j] = g[i];
      if (ERASE) re[j] = e[i];
    }
    const int vi = tile * kTileV + static_cast<int>(threadIdx.x);
    const T rv = v[min(vi, V - 1)];
    TG rs{}, rb{};
    if (GATE == EDGELIN_GATE_SCALAR) rs = g[0];
    if (DELTA) rb = static_cast<const TG*>(a.beta)[b * a.beta_stride_b + h * a.beta_stride_h];
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int i = threadIdx.x + j * kThreads;
      if (i < kMaxK) {
        in_q[i] = i < K ? to_float(rq[j]) : 0.f;
        in_k[i] = i < K ? to_float(rk[j]) : 0.f;
        if (GATE == EDGELIN_GATE_PER_KEY) in_decay[i] = i < K ? __expf(to_float(rg[j])) : 1.f;
        if (ERASE) in_erase[i] = i < K ? to_float(re[j]) : 0.f;
      }
    }
    if (threadIdx.x < kTileV) in_v[threadIdx.x] = vi < V ? to_float(rv) : 0.f;
    if (threadIdx.x == 0) {
      in_head[0] = GATE == EDGELIN_GATE_SCALAR ? __expf(to_float(rs)) : 1.f;
      in_head[1] = DELTA ? to_float(rb) : 0.f;
    }
  }
  __syncthreads();

  // 4. Decay, then the delta rule's correction u = beta (v - S^T k), then S += k u^T, o = S^T q.
  // With the erase gate: p = S^T k, S += k (beta v)^T - (e * k)(beta p)^T, o = S^T q.
  float kv[kRowsPerThread], qv[kRowsPerThread], ev[ERASE ? kRowsPerThread : 1];
#pragma unroll
  for (int r = 0; r < kRowsPerThread; ++r) {
    const int kr = row + r * kRowGroups;
    kv[r] = in_k[kr];
    qv[r] = in_q[kr];
    if (ERASE) ev[r] = -in_erase[kr] * kv[r];  // minus the erase direction
    const float d = GATE == EDGELIN_GATE_PER_KEY ? in_decay[kr] : in_head[0];
    if (GATE != EDGELIN_GATE_NONE) {
#pragma unroll
      for (int c = 0; c < kColsPerThread; ++c) s[r][c] *= d;
    }
  }

  float u[kColsPerThread], bp[kColsPerThread];  // bp: beta S^T k, what the erase gate subtracts
#pragma unroll
  for (int c = 0; c < kColsPerThread; ++c) u[c] = in_v[col4 * kColsPerThread + c];
  if (DELTA) {
    float part[kColsPerThread] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int r = 0; r < kRowsPerThread; ++r)
#pragma unroll
      for (int c = 0; c < kColsPerThread; ++c) part[c] = fmaf(s[r][c], kv[r], part[c]);
    column_sums<TL>(part, scratch[0], col4);
    const float beta = in_head[1];
    if (ERASE) {
#pragma unroll
      for (int c = 0; c < kColsPerThread; ++c) u[c] = beta * u[c], bp[c] = beta * part[c];
    } else {
#pragma unroll
      for (int c = 0; c < kColsPerThread; ++c) u[c] = beta * (u[c] - part[c]);
    }
  }

  float out[kColsPerThread] = {0.f, 0.f, 0.f, 0.f};
  const int64_t out_step = static_cast<int64_t>(kRowGroups) * a.out_stride_k;
  float* p_out = s_out + row * a.out_stride_k + col;
#pragma unroll
  for (int r = 0; r < kRowsPerThread; ++r, p_out += out_step) {
    const int kr = row + r * kRowGroups;
#pragma unroll
    for (int c = 0; c < kColsPerThread; ++c) {
      if (ERASE) s[r][c] = fmaf(ev[r], bp[c], s[r][c]);
      s[r][c] = fmaf(kv[r], u[c], s[r][c]);
      out[c] = fmaf(s[r][c], qv[r], out[c]);
    }
    float* p = p_out;
    if (VEC) {
      if (kr < K && col < V) *reinterpret_cast<float4*>(p) = make_float4(s[r][0], s[r][1], s[r][2], s[r][3]);
    } else {
#pragma unroll
      for (int c = 0; c < kColsPerThread; ++c)
        if (kr < K && col + c < V) p[c] = s[r][c];
    }
  }
  column_sums<TL>(out, scratch[1], col4);
  if (row == 0) {
    T* o = static_cast<T*>(a.o) + b * a.o_stride_b + h * a.o_stride_h;
#pragma unroll
    for (int c = 0; c < kColsPerThread; ++c)
      if (col + c < V) o[col + c] = from_float<T>(out[c]);
  }
}

}  // namespace edgelin
