"""Test-suite plumbing (never product code): `python tests/cached_cli.py ARGS` is `edgelin ARGS` (the
same `edgelin.cli.main`, in its own process with pipes) whose ONNX graphs go through the test run's graph
cache (tests/graph_cache.py, the folder named by EDGELIN_TEST_GRAPH_DIR): a CLI export in a subprocess
then reuses a graph the in-process tests traced instead of tracing it again (~100 s of CI's 2 cores)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import graph_cache  # noqa: E402

if os.environ.get(graph_cache.DIR_ENV):
    graph_cache.set_cache_dir(Path(os.environ[graph_cache.DIR_ENV]))
    graph_cache.install()

from edgelin.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
