// A thin torch binding of edgelin_step_launch, for tests and the GPU reference. Shapes and dtypes
// are checked in Python (edgelin/kernels/cuda_ext.py); this file only maps tensors to the C struct.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "edgelin_step.h"

namespace {

int32_t dtype_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return EDGELIN_F32;
    case at::kHalf: return EDGELIN_F16;
    case at::kBFloat16: return EDGELIN_BF16;
    default: TORCH_CHECK(false, "edgelin step: unsupported dtype ", t.scalar_type());
  }
  return -1;
}

// q, k [B, H, K]; v, o [B, H, V]; g [B, H, 1|K] or empty; beta [B, H] or empty; states [B, H, K, V];
// erase [B, H, K] or empty (the erase gate, delta rule only; g's and beta's dtype).
void step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& g,
          const c10::optional<at::Tensor>& beta, const at::Tensor& state_in, at::Tensor state_out, at::Tensor o,
          const c10::optional<at::Tensor>& erase) {
  const c10::cuda::CUDAGuard guard(q.device());
  EdgelinStepArgs a{};
  a.q = q.data_ptr();
  a.k = k.data_ptr();
  a.v = v.data_ptr();
  a.o = o.data_ptr();
  a.state_in = state_in.data_ptr<float>();
  a.state_out = state_out.data_ptr<float>();
  a.batch = static_cast<int32_t>(q.size(0));
  a.heads = static_cast<int32_t>(q.size(1));
  a.d_k = static_cast<int32_t>(q.size(2));
  a.d_v = static_cast<int32_t>(v.size(2));
  a.q_stride_b = q.stride(0), a.q_stride_h = q.stride(1);
  a.k_stride_b = k.stride(0), a.k_stride_h = k.stride(1);
  a.v_stride_b = v.stride(0), a.v_stride_h = v.stride(1);
  a.o_stride_b = o.stride(0), a.o_stride_h = o.stride(1);
  a.in_stride_b = state_in.stride(0), a.in_stride_h = state_in.stride(1), a.in_stride_k = state_in.stride(2);
  a.out_stride_b = state_out.stride(0), a.out_stride_h = state_out.stride(1), a.out_stride_k = state_out.stride(2);
  a.dtype = dtype_code(q);
  a.gate = EDGELIN_GATE_NONE;
  if (g.has_value()) {
    a.g = g->data_ptr();
    a.g_stride_b = g->stride(0), a.g_stride_h = g->stride(1);
    a.gate = g->size(2) == 1 ? EDGELIN_GATE_SCALAR : EDGELIN_GATE_PER_KEY;
  }
  // g and beta share one dtype (cuda_ext.py casts them): float32 unless both match q
  a.aux_dtype = g.has_value() ? dtype_code(*g) : beta.has_value() ? dtype_code(*beta) : EDGELIN_F32;
  a.delta = beta.has_value() ? 1 : 0;
  if (beta.has_value()) {
    a.beta = beta->data_ptr();
    a.beta_stride_b = beta->stride(0), a.beta_stride_h = beta->stride(1);
  }
  if (erase.has_value()) {
    a.erase = erase->data_ptr();
    a.erase_stride_b = erase->stride(0), a.erase_stride_h = erase->stride(1);
    a.erase_flag = 1;
  }
  const int code = edgelin_step_launch(&a, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(code == EDGELIN_OK, "edgelin_step_launch failed (", code, "): ", edgelin_step_status_string(code));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("step", &step, "edgelin fused decode step (CUDA)", pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"),
        pybind11::arg("g"), pybind11::arg("beta"), pybind11::arg("state_in"), pybind11::arg("state_out"),
        pybind11::arg("o"), pybind11::arg("erase") = pybind11::none());
  // the header this binding was compiled with, and the launcher it links: equal by construction here
  m.attr("abi_version") = EDGELIN_STEP_ABI_VERSION;
  m.def("launcher_abi_version", &edgelin_step_abi_version, "EDGELIN_STEP_ABI_VERSION of the linked launcher");
}
