"""Core ML's lowering: the static chunk loop per enumerated prompt length (edgelin.export.static_chunks), because
coremltools 9.0 cannot convert torch's scan and Core ML takes tensors of rank <= 5 only."""

from edgelin.export.lowering import Lowering
from edgelin.export.static_chunks import StaticChunkEngine

LOWERING = Lowering("coreml", StaticChunkEngine("coreml-static-chunks"), "static chunk loop per enumerated prompt length, rank <= 5 "
                    "tensors per chunk (coremltools cannot convert torch's scan)")
