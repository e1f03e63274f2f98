"""The ONNX target: step + prefill ONNX graphs and the ONNX Runtime runner (edgelin.export.onnx.runner,
torch-free: the run side of an edgelin[runtime] install opens it). Light on purpose: the registry reads
TARGET below without importing torch or onnxruntime."""

TARGET = "edgelin.export.onnx.target:OnnxTarget"
DEFAULT = True  # `edgelin export CKPT --out DIR` with no target: ONNX files run on every machine
