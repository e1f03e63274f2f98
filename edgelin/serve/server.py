"""`edgelin serve DIR`: Triton Inference Server, from the nvidia-pytriton wheel, serving the repository that
`edgelin export --serve triton` wrote into DIR (docs/serving.md, "Run it").

The server runs from a Python environment that has `edgelin[server]` (nvidia-pytriton, numpy < 2: Triton's
Python backend answers with empty tensors under numpy 2; docs/serving.md, "The serving environment"): the
running one, or `--env VENV`. That environment's python is the backend's (first on the server's PATH); the
backend folder is assembled once in edgelin's cache (the wheel's backend library and the stub for that Python
version: the wheel keeps the stubs apart), and the wheel's bundled libraries go on LD_LIBRARY_PATH. Nothing is
written into DIR or into the environment.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from edgelin.errors import EdgelinError

if TYPE_CHECKING:
    from edgelin.artifact.manifest import Manifest

SETUP = ("python3 -m venv ~/.edgelin-serve && ~/.edgelin-serve/bin/pip install 'edgelin[runtime,server]', then "
         "pass --env ~/.edgelin-serve (docs/serving.md, \"The serving environment\")")
QUIET = ("--allow-gpu-metrics=false", "--pinned-memory-pool-byte-size=0", "--exit-timeout-secs=5")
PROBE = """import importlib.util, json, sys
def where(name):
    spec = importlib.util.find_spec(name)
    return None if spec is None else (list(spec.submodule_search_locations or []) or [spec.origin])[0]
try:
    import numpy
    numpy_version = numpy.__version__
except ImportError:
    numpy_version = None
print(json.dumps({"python": "%d.%d" % sys.version_info[:2], "bin": sys.exec_prefix + "/bin",
                  "pytriton": where("pytriton"), "edgelin": where("edgelin"), "numpy": numpy_version}))
"""


@dataclass(frozen=True)
class ServerEnvironment:
    """What runs the server: the environment's bin folder (first on PATH: the backend's python), the wheel's
    tritonserver folder, its bundled libraries, and the Python version of the stub."""

    bin: Path
    tritonserver: Path
    libraries: Path
    python: str


@dataclass(frozen=True)
class ServeRequest:
    folder: Path
    environment: Path | None = None  # a venv with edgelin[server]; None: the running interpreter's
    host: str = "127.0.0.1"
    grpc_port: int = 8001
    http_port: int = 8000
    metrics_port: int = 8002
    log: Path | None = None  # the server's output; None: a file in a fresh temporary folder
    ready_seconds: float = 180.0


def find_environment(environment: Path | None) -> ServerEnvironment:
    """The serving environment, checked: pytriton with its server, numpy < 2, edgelin importable."""
    python = Path(sys.executable) if environment is None else Path(environment) / "bin" / "python"
    where = str(environment) if environment is not None else f"this Python environment ({sys.prefix})"
    if not python.is_file():
        raise EdgelinError(f"--env {environment}", "it is not a Python virtual environment (no bin/python)",
                           f"create one: {SETUP}")
    try:
        probe = subprocess.run([str(python), "-I", "-c", PROBE], capture_output=True, text=True, timeout=60)
        found = json.loads(probe.stdout)
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
        raise EdgelinError(f"the Python of {where} did not run", str(exc).splitlines()[0] if str(exc) else
                           type(exc).__name__, f"check the environment, or create one: {SETUP}") from None
    if found["pytriton"] is None:
        raise EdgelinError(f"Triton Inference Server is not installed in {where}",
                           "edgelin serve runs the tritonserver of the nvidia-pytriton wheel", SETUP)
    if found["numpy"] is None or int(found["numpy"].split(".")[0]) >= 2:
        raise EdgelinError(f"{where} has numpy {found['numpy']}", "Triton's Python backend (the stub in "
                           "nvidia-pytriton 0.7) answers every request with empty tensors under numpy 2",
                           f"serve from an environment with numpy < 2: {SETUP}")
    if found["edgelin"] is None:
        raise EdgelinError(f"edgelin is not installed in {where}", "the served model runs edgelin's runner", SETUP)
    server = Path(found["pytriton"]) / "tritonserver"
    libraries = Path(found["pytriton"]).parent / "nvidia_pytriton.libs"
    if not (server / "bin" / "tritonserver").is_file():
        raise EdgelinError(f"{server}/bin/tritonserver is missing", "the nvidia-pytriton install is incomplete",
                           "reinstall it: pip install --force-reinstall nvidia-pytriton")
    return ServerEnvironment(Path(found["bin"]), server, libraries, found["python"])


def backend_folder(env: ServerEnvironment) -> Path:
    """A --backend-directory whose python/ holds the wheel's Python backend and the stub for env's Python (in
    edgelin's cache, assembled once per wheel and Python version; written whole, then renamed into place)."""
    stub = env.tritonserver / "python_backend_stubs" / env.python / "triton_python_backend_stub"
    backend = env.tritonserver / "backends" / "python"
    if not stub.is_file():
        raise EdgelinError(f"nvidia-pytriton has no Python backend stub for Python {env.python}",
                           f"{stub} is missing", "serve from a Python 3.8-3.13 environment")
    parts = [stub, *sorted(backend.iterdir())]
    key = hashlib.sha256("\n".join(f"{p}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in parts if p.is_file())
                         .encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "edgelin" / "triton-backends"
    folder = cache / key
    if (folder / "python" / stub.name).is_file():
        return folder
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=cache, prefix=".new-"))
    (staging / "python").mkdir()
    for part in parts:
        if part.is_file():
            shutil.copy2(part, staging / "python" / part.name)
    try:
        staging.rename(folder)
    except OSError:  # another process assembled it first: theirs is the same
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def served_manifest(folder: Path) -> "Manifest":
    """The manifest of an export with a Python-backend repository (`edgelin serve`, `generate --server`), after the
    folder is verified (every file, the repository's included, against the manifest's digests)."""
    from edgelin.runtime import load_artifact
    from edgelin.serve.triton_python import PYTHON

    manifest = load_artifact(folder).manifest
    served = manifest.extra.get("serve", {}).get("triton")
    if not served:
        raise EdgelinError(f"{folder} has no Triton repository", "it was exported without --serve",
                           "re-export with --serve triton (the same `edgelin export` command plus that flag)")
    if served.get("backend") != PYTHON:
        raise EdgelinError(f"{folder}/triton holds a {served.get('backend')} repository (--serve triton-native)",
                           "the nvidia-pytriton server has only the Python backend",
                           "re-export with --serve triton, or run that repository in NVIDIA's Triton container "
                           "(docs/serving.md, \"The native flavour\")")
    return manifest


def _check_port(host: str, port: int, flag: str) -> None:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            raise EdgelinError(f"{flag} {port} on {host}", f"the port is taken ({exc.strerror})",
                               f"pass a free {flag}, or stop what listens there") from None


class TritonServer:
    """A running tritonserver for one export (a context manager: started on enter, stopped on exit)."""

    def __init__(self, request: ServeRequest):
        self.request = request
        self.model = str(served_manifest(request.folder).extra["serve"]["triton"]["model"])
        self.environment = find_environment(request.environment)
        for flag, port in (("--grpc-port", request.grpc_port), ("--http-port", request.http_port),
                           ("--metrics-port", request.metrics_port)):
            _check_port(request.host, port, flag)
        self.log = request.log or Path(tempfile.mkdtemp(prefix="edgelin-serve-")) / "tritonserver.log"
        self.process: subprocess.Popen | None = None

    @property
    def grpc_url(self) -> str:
        return f"{self.request.host}:{self.request.grpc_port}"

    def command(self) -> list[str]:
        r = self.request
        return [str(self.environment.tritonserver / "bin" / "tritonserver"),
                f"--model-repository={Path(r.folder).resolve() / 'triton'}",
                f"--backend-directory={backend_folder(self.environment)}",
                f"--grpc-address={r.host}", f"--grpc-port={r.grpc_port}", f"--http-address={r.host}",
                f"--http-port={r.http_port}", f"--metrics-address={r.host}", f"--metrics-port={r.metrics_port}",
                *QUIET]

    def start(self) -> "TritonServer":
        env = dict(os.environ)
        env["PATH"] = f"{self.environment.bin}{os.pathsep}{env.get('PATH', '')}"
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(self.environment.libraries),
                                                             env.get("LD_LIBRARY_PATH")) if p)
        env.pop("PYTHONPATH", None)  # the backend's python is the environment's, not the caller's packages
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        url = f"http://{self.request.host}:{self.request.http_port}/v2/models/{self.model}/ready"
        deadline = time.monotonic() + self.request.ready_seconds
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise self._failure(f"tritonserver exited with code {self.process.returncode}")
            try:
                with urllib.request.urlopen(url, timeout=2) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        self.stop()
        raise self._failure(f"the model was not ready after {self.request.ready_seconds:g} s")

    def _failure(self, what: str) -> EdgelinError:
        self.stop()
        text = self.log.read_text(errors="replace") if self.log.is_file() else ""
        errors = [line for line in text.splitlines() if "error:" in line or line.startswith("E")]
        why = errors[-1].strip()[:400] if errors else "no error line in its log"
        return EdgelinError(f"serving {self.request.folder}: {what}", why, f"see the server's log {self.log}",
                            exit_code=1)

    def stop(self) -> int | None:
        """Stop the server (SIGINT: Triton unloads the models; killed if it is still there after 15 s)."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return None if process is None else process.returncode
        process.send_signal(signal.SIGINT)
        try:
            return process.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            return process.wait()

    def wait(self) -> int:
        assert self.process is not None
        return self.process.wait()

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
