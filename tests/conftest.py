"""Shared fixtures: tiny configs for every family, and tiny checkpoints saved in the real format."""

from __future__ import annotations

import os

import pytest
import torch

# Under pytest-xdist (`-n 2` on the 2-core CI machine) each worker gets one core's worth of threads,
# so the two workers do not oversubscribe the machine.
THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2
os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
torch.set_num_threads(THREADS)

if not torch.cuda.is_available():  # on a GPU machine Triton and fla run natively
    try:  # fla's models run on CPU only under the Triton interpreter, on before anything imports triton
        from upstream_fla import enable_fla_cpu

        enable_fla_cpu()
    except ImportError:  # fla or triton not installed: the fla parity tests skip with the reason
        pass

from edgelin.families import FAMILIES, SOFTMAX  # noqa: E402
from edgelin.model.config import AttentionConfig, ModelConfig  # noqa: E402

import graph_cache  # noqa: E402  (tests/graph_cache.py: identical graphs traced once per run)

graph_cache.install()


@pytest.fixture(scope="module", autouse=True)
def _threads():
    """Every file starts at the worker's thread count: a file left at 2 threads made the next ones on its
    worker oversubscribe the 2 cores (a 200-step CPU training took 182 s instead of 23)."""
    torch.set_num_threads(THREADS)


@pytest.fixture(scope="session", autouse=True)
def _graph_cache(tmp_path_factory):
    """One graph cache per run: under xdist the workers' base temp folders share a parent (pytest
    keeps the last three runs' folders and deletes older ones)."""
    base = tmp_path_factory.getbasetemp()
    graph_cache.set_cache_dir((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "graph-cache")


# Seconds per file on the 2-core CI machine (`--durations=0`, 2026-12-02), heaviest first. `make test` runs
# `--dist loadfile --no-loadscope-reorder`: each worker takes the next file in collection order, so starting
# with the long files (longest processing time first) keeps one worker from running a long file alone at
# the end. A file not listed goes last; a stale figure only costs balance, never a test.
FILE_SECONDS = {
    "test_convert_fla.py": 130, "test_kernels.py": 100, "test_tensorrt_target.py": 121, "test_onnx.py": 86,
    "test_cli_polish.py": 95, "test_convert_hf.py": 78, "test_trained_upstream.py": 58, "test_coreml.py": 56,
    "test_precision_export.py": 49, "test_upstream_fla_smoke.py": 47, "test_tensorrt_build.py": 37,
    "test_runtime_checks.py": 34, "test_quality.py": 33, "test_validate_stream.py": 33, "test_hostile.py": 30,
    "test_artifact.py": 27, "test_kv_static.py": 27, "test_gdn2_clvr.py": 25, "test_trt_plugin.py": 25,
    "test_kernel_compile.py": 22, "test_outputs.py": 16, "test_shared_weights.py": 15, "test_optimum_cli.py": 13,
    "test_report.py": 10,
}


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0))  # stable: a file's own order stays


ALL_FAMILIES = list(FAMILIES)
HYBRID = ("gated_deltanet", SOFTMAX, "gla")


def tiny_config(layer_types, **changes) -> ModelConfig:
    base = dict(
        vocab_size=97, hidden_size=32, layer_types=tuple(layer_types), num_heads=2, head_k_dim=8, head_v_dim=8,
        intermediate_size=64, attention=AttentionConfig(num_heads=2, num_kv_heads=1, head_dim=16, window=8),
        chunk_size=16,
    )
    base.update(changes)
    return ModelConfig(**base)


def family_layers(family: str) -> tuple[str, ...]:
    """Two layers of a family; 'hybrid' is linear + sliding-window softmax + linear."""
    return HYBRID if family == "hybrid" else (family, family)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
