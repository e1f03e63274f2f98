"""`edgelin serve`'s refusals before any server starts: an environment that cannot run Triton's Python backend, a
folder without a Python-backend repository, a taken port (no server needed: the CI tier runs these)."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from edgelin.cli import app
from edgelin.errors import EdgelinError
from edgelin.serve.server import _check_port, find_environment


def test_an_environment_without_the_server_or_with_numpy_2_is_refused(tmp_path: Path) -> None:
    import importlib.util

    with pytest.raises(EdgelinError, match=r"--env .*: it is not a Python virtual environment \(no bin/python\)"):
        find_environment(tmp_path)
    has_server = importlib.util.find_spec("pytriton") is not None
    import numpy

    want = (r"has numpy 2\..*empty tensors under numpy 2" if has_server and numpy.__version__ >= "2"
            else r"Triton Inference Server is not installed in this Python environment")
    if has_server and not numpy.__version__ >= "2":
        pytest.skip("this environment is a serving environment (nothing to refuse)")
    with pytest.raises(EdgelinError, match=want) as caught:
        find_environment(None)
    assert "pip install 'edgelin[runtime,server]'" in caught.value.fix and sys.prefix in caught.value.what


def test_a_folder_without_a_python_backend_repository_is_refused_in_one_line(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["serve", str(tmp_path / "nothing")])
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1, result.output
    assert "nothing" in errors[0]


def test_a_taken_port_is_refused_before_the_start() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(EdgelinError, match=rf"--grpc-port {port} on 127.0.0.1: the port is taken"):
            _check_port("127.0.0.1", port, "--grpc-port")
