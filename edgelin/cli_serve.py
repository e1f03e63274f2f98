"""The CLI's `serve` command (edgelin.cli holds the others; all register on one app)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from edgelin.cli_support import JSON, NO_VERIFY, command
from edgelin.output import Output


@command
def serve(
    out: Output,
    folder: Path = typer.Argument(..., help="An export folder written with --serve triton."),
    env: Optional[Path] = typer.Option(None, "--env", help="A Python environment with edgelin[server] (numpy < 2) "
                                                           "to run the server from [this one]."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    grpc_port: int = typer.Option(8001, "--grpc-port", min=1, max=65535, help="gRPC port."),
    http_port: int = typer.Option(8000, "--http-port", min=1, max=65535, help="HTTP port (health, metadata)."),
    metrics_port: int = typer.Option(8002, "--metrics-port", min=1, max=65535, help="Prometheus metrics port."),
    log: Optional[Path] = typer.Option(None, "--log", help="Write the server's output to FILE [a temporary file]."),
    no_verify: bool = NO_VERIFY,
    as_json: bool = JSON,
) -> None:
    """Serve an export on Triton Inference Server (the nvidia-pytriton wheel's tritonserver) until Ctrl-C:
    concurrent conversations over gRPC, each sequence's state held by the server (docs/serving.md)."""
    from edgelin.serve.server import ServeRequest, TritonServer

    server = TritonServer(ServeRequest(folder, env, host, grpc_port, http_port, metrics_port, log))
    with server:
        out.result({"model": server.model, "grpc": server.grpc_url, "http": f"{host}:{http_port}",
                    "metrics": f"{host}:{metrics_port}", "log": str(server.log), "pid": server.process.pid})
        out.line(f"serving {server.model} from {folder}: gRPC {server.grpc_url}, HTTP {host}:{http_port} "
                 f"(log: {server.log}); Ctrl-C stops it")
        out.line(f"try: edgelin generate {folder} --server {server.grpc_url} --prompt \"...\"")
        try:
            code = server.wait()
        except KeyboardInterrupt:  # Ctrl-C, SIGTERM: the normal way to stop a server
            server.stop()
            out.note("stopped")
            return
    if code:
        out.error(f"tritonserver exited with code {code}: see its log {server.log}")
        raise typer.Exit(1)
