"""Test-suite plumbing (never product code): `python tests/cached_cli.py ARGS` is `edgelin ARGS` (the
same `edgelin.cli.main`, in its own process with pipes) whose ONNX graphs go through the test run's graph
cache (tests/graph_cache.py, the folder named by EDGELIN_TEST_GRAPH_DIR): a CLI export in a subprocess
then reuses a graph the in-process tests traced instead of tracing it again (~100 s of CI's 2 cores). With
GREEDY_ENV set, its exports record that many greedy steps of quality figures, as the calling test file's
in-process exports do (tests/conftest.py: SHORT_GREEDY_STEPS)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import graph_cache  # noqa: E402

GREEDY_ENV = "EDGELIN_TEST_GREEDY_STEPS"

if os.environ.get(graph_cache.DIR_ENV):
    graph_cache.set_cache_dir(Path(os.environ[graph_cache.DIR_ENV]))
    graph_cache.install()
if os.environ.get(GREEDY_ENV):
    from edgelin.reference import parity

    parity.GREEDY_STEPS = int(os.environ[GREEDY_ENV])

from edgelin.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
