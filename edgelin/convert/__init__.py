"""Upstream checkpoints (fla, transformers) as first-class inputs: model_type -> converter."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from importlib import import_module

from edgelin.convert.base import ConfigReader, Converter
from edgelin.errors import EdgelinError
from edgelin.model.config import MODEL_TYPE, ModelConfig

_MODULES = ("edgelin.convert.hf", "edgelin.convert.fla")


def converters() -> dict[str, Converter]:
    found: dict[str, Converter] = {}
    for module in _MODULES:
        for conv in import_module(module).CONVERTERS:
            found[conv.model_type] = conv
    return found


# Architectures that inspect recognises and explains instead of a bare "unsupported".
REFUSED = {
    "qwen3_next": "mixture-of-experts MLP blocks: edgelin's blocks have one dense SwiGLU MLP",
    "kimi_linear": "its softmax layers are multi-head latent attention (MLA), which edgelin does not implement",
    "falcon_h1": "parallel hybrid blocks (attention and Mamba2 side by side in one layer) and muP multipliers",
    "nemotron_h": "per-layer block kinds without a shared MLP and squared-ReLU MLPs",
    "mamba": "Mamba1 (selective scan with per-channel A): not a linear-attention family edgelin implements",
}


def supported_model_types() -> list[str]:
    return [MODEL_TYPE, *converters()]


def get_converter(model_type: str | None, source: str) -> Converter:
    found = converters()
    if model_type in found:
        return found[model_type]
    why = REFUSED.get(model_type or "", "edgelin has no converter for it")
    close = difflib.get_close_matches(str(model_type), supported_model_types(), n=1)
    raise EdgelinError(
        f"{source}: model_type {model_type!r} is not supported" + (f" (closest: {close[0]!r})" if close else ""),
        why, f"supported: {', '.join(supported_model_types())}",
    )


@dataclass(frozen=True)
class Converted:
    config: ModelConfig
    converter: Converter
    inert: tuple[str, ...]  # fields of config.json the upstream model never reads (accepted, listed)


def convert(data: dict, source: str) -> Converted:
    conv = get_converter(data.get("model_type"), source)
    reader = ConfigReader(data, source, harmless=set(conv.harmless), reads=conv.reads(data))
    config = conv.to_config(reader)
    reader.finish()
    return Converted(config, conv, tuple(reader.inert))


def convert_config(data: dict, source: str) -> tuple[ModelConfig, Converter]:
    done = convert(data, source)
    return done.config, done.converter
