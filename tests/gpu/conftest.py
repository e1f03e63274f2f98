"""GPU tests (marker `gpu`): deselected where torch sees no CUDA device (tests/conftest.py:
deselect_gpu_tests), so they never count as skips on a machine without one."""
