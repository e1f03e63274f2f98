"""Native plugins that let a target runtime run edgelin's own kernels (TensorRT today)."""
