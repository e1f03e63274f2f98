"""The torch target: the PyTorch reference as a runner (safetensors + config), with the whole-model
decoders it may run on CUDA (fused_decode, graph_decode). Light on purpose: the registry reads TARGET
below without importing torch."""

TARGET = "edgelin.export.torch.target:TorchTarget"
IN_DEVICE_PROFILES = False  # the reference, not a deployment (any profile with compute cuda or cpu runs it)
