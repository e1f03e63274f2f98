"""The TensorRT target: ONNX graphs with the edgelin step plugin, built into engines on the GPU
(edgelin.export.tensorrt.build) and run by edgelin.export.tensorrt.runner (torch-free). Light on
purpose: the registry reads TARGET below without importing torch or tensorrt."""

TARGET = "edgelin.export.tensorrt.target:TensorrtTarget"
PROFILE_COMPUTES = ("cuda",)  # a device profile that lists this target has compute = "cuda"
COMPUTE_REASON = "TensorRT runs on NVIDIA GPUs only"
