"""The Core AI target (Apple's new stack): one .aimodel whose `step` and `prefill_{L}` entry points share the
weights and hold the recurrent state as model state, converted with coreai-torch; its runner runs Apple's Core AI
runtime (on Linux the CPU runtime the coreai-core wheel carries, on macOS the OS's). Light on purpose: the registry
reads TARGET below without importing torch or coreai."""

TARGET = "edgelin.export.coreai.target:CoreaiTarget"
