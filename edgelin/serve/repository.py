"""What both Triton repository flavours share (edgelin.serve.triton, edgelin.serve.triton_python): where the
repository goes, its client, and the check of a config.pbtxt against Triton's own schema."""

from __future__ import annotations

from pathlib import Path

from edgelin.errors import EdgelinError

FOLDER = "triton"
CLIENT = "client.py"


def parse_config(text: str, where: str) -> bool:
    """`text` parsed with Triton's own schema (tritonclient's ModelConfig, protobuf text format), so that a
    config.pbtxt Triton's parser rejects is one line, never a repository reported written. False: tritonclient is
    not installed here, so nothing was parsed."""
    try:
        from google.protobuf import text_format
        from tritonclient.grpc.model_config_pb2 import ModelConfig
    except ImportError:
        return False
    try:
        text_format.Parse(text, ModelConfig())
    except text_format.ParseError as exc:
        raise EdgelinError(f"{where} would not load in Triton", f"Triton's ModelConfig parser rejects it: {exc}",
                           "check the device profile's [serving] values (devices/README.md), or report "
                           "this as an edgelin bug") from None
    return True


def client_text(name: str, prefill: bool) -> str:
    """DIR/triton/client.py: the client template with the model's name (and whether it prefills) filled in."""
    template = (Path(__file__).parent / "triton_client.py").read_text()
    return template.replace('MODEL = "model"  # filled in by edgelin export', f'MODEL = "{name}"').replace(
        "PREFILL = True  # filled in by edgelin export: whether the model takes several tokens in one request",
        f"PREFILL = {prefill}")
