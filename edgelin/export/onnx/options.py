"""The ONNX target's options (OnnxOptions: what `edgelin export onnx` flags set) and what they change in the
graphs: the fixed-capacity KV cache's checks and marks, the in-place states, the edgelin-ops metadata. Imports
no torch or onnx at module level (the exporter's modules load inside the functions)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from edgelin.errors import EdgelinError
from edgelin.export.onnx.metadata import KV_CAPACITY_KEY
from edgelin.ortops import DOMAIN as ORT_OPS_DOMAIN
from edgelin.artifact.tensors import TensorIO

if TYPE_CHECKING:
    from edgelin.devices import ExportSettings
    from edgelin.model.lm import CausalLM


@dataclass(frozen=True)
class OnnxOptions:
    """The ONNX target's own export options."""

    opset: int = 18
    # --quantize: also quantise the embedding table and LM head (GatherBlockQuantized / MatMulNBits);
    # False: --keep-embeddings-float. No effect without --quantize.
    quantize_embeddings: bool = True
    # --embeddings-bits: the embedding table and LM head at these bits (8 with --quantize int4: llama.cpp's Q4_0
    # keeps its token table at Q8_0 too); None: the --quantize bits.
    embedding_bits: int | None = None
    # --kv-cache static --context N: full-context attention layers export as GroupQueryAttention and the
    # runner keeps their KV cache in one buffer of N positions per tensor, updated in place (KV_CACHES).
    kv_cache: str = "growing"
    context: int | None = None  # the static cache's capacity in tokens (required with kv_cache="static")
    # --kv-dtype: the static cache's dtype; fp16 halves the bytes its attention reads per token (edgelin's kernel
    # reads float16 rows with F16C; the node's q/k/v are cast to fp16 and its output back)
    kv_dtype: str = "fp32"
    # --step-ops: the step graph's recurrence and short conv as ONNX Runtime's com.microsoft LinearAttention and
    # CausalConvWithState (one node each per linear layer; ONNX Runtime >= 1.32), or standard ONNX ops (any
    # ONNX runtime; slower). edgelin.export.lowering.OnnxEngine.contrib_ops. "edgelin" (the default): contrib, and
    # the step's convs, recurrences, 4-/8-bit products and static-cache attention as ai.edgelin ops for edgelin's
    # operator library, ONNX Runtime's own op as each one's function body, so the file runs without the library too
    # (edgelin.export.onnx.kernels; edgelin.ortops).
    step_ops: str = "edgelin"

    def __post_init__(self) -> None:
        if self.step_ops not in STEP_OPS:
            raise EdgelinError(f"--step-ops {self.step_ops}", f"the ONNX step's ops are one of {', '.join(STEP_OPS)}",
                               "pass --step-ops contrib (ONNX Runtime >= 1.32), edgelin (contrib and edgelin's own "
                               "CPU kernels) or standard")
        if self.embedding_bits not in (None, 4, 8):
            raise EdgelinError(f"--embeddings-bits {self.embedding_bits}", "the embedding table and LM head quantise "
                               "to 4 or 8 bits", "pass --embeddings-bits 8 (or 4)")
        if self.embedding_bits is not None and not self.quantize_embeddings:
            raise EdgelinError("--embeddings-bits with --keep-embeddings-float", "the embedding table and LM head "
                               "stay float with --keep-embeddings-float", "drop one of the two")
        if self.kv_cache not in KV_CACHES:
            raise EdgelinError(f"--kv-cache {self.kv_cache}", f"the ONNX target's KV caches are {', '.join(KV_CACHES)}",
                               "pass --kv-cache growing or --kv-cache static --context N")
        if self.kv_cache == "static" and (isinstance(self.context, bool) or not isinstance(self.context, int)
                                          or not 1 <= self.context <= MAX_CONTEXT):
            given = "without --context" if self.context is None else f"with --context {self.context}"
            raise EdgelinError(f"--kv-cache static {given}",
                               f"a fixed-capacity cache needs its capacity in tokens, 1..{MAX_CONTEXT}",
                               "pass --context N (the longest sequence the export will hold, e.g. 32768)")
        if self.kv_dtype not in KV_DTYPES:
            raise EdgelinError(f"--kv-dtype {self.kv_dtype}", f"the static KV cache is one of {', '.join(KV_DTYPES)}",
                               "pass --kv-dtype fp32 or fp16")
        if self.kv_dtype != "fp32" and self.kv_cache != "static":
            raise EdgelinError(f"--kv-dtype {self.kv_dtype} without --kv-cache static", "the dtype is the "
                               "fixed-capacity cache's (the growing cache follows the graphs' precision)",
                               "add --kv-cache static --context N, or drop --kv-dtype")
        if self.kv_cache == "growing" and self.context is not None:
            raise EdgelinError(f"--context {self.context} without --kv-cache static",
                               "a growing KV cache has no capacity", "add --kv-cache static, or drop --context")


# growing: past/present are graph inputs/outputs, concatenated each call (the default); static: an in-place
# fixed-capacity cache (GroupQueryAttention, one bound buffer; README "Fixed-capacity KV cache").
KV_CACHES = ("growing", "static")
KV_DTYPES = {"fp32": "float32", "fp16": "float16"}  # --kv-dtype: the static cache's I/O dtype
STEP_OPS = ("contrib", "standard", "edgelin")  # OnnxOptions.step_ops: OnnxEngine.contrib_ops on or off (edgelin: on)
ORT_OPS_KEY = "ort_ops"  # the manifest's entry for a step graph that names edgelin.ortops' ops
MAX_CONTEXT = (1 << 31) - 1  # GroupQueryAttention's sequence lengths are int32


def check_static_cache(model: "CausalLM", target: str, settings: "ExportSettings") -> None:
    """--kv-cache static is for ONNX Runtime and a model with a growing KV cache (fp16 graphs keep that cache
    float32: graph_modules)."""
    from edgelin.model.attention import SoftmaxAttention

    if target != "onnx":
        raise EdgelinError(f"--kv-cache static with --target {target}", "the fixed-capacity cache is ONNX Runtime's "
                           "GroupQueryAttention contrib op", "export with --target onnx, or drop --kv-cache")
    if not any(isinstance(m, SoftmaxAttention) and m.cfg.window is None for m in model.modules()):
        raise EdgelinError("--kv-cache static on a model without a growing KV cache", "its state is constant-size "
                           "already (linear layers, sliding-window attention)", "drop --kv-cache static")


def check_cache_capacity(model: "CausalLM", target: str, settings: "ExportSettings", options: "OnnxOptions") -> None:
    """A fixed-capacity KV cache (`--kv-cache static --context N`) must hold the longest sequence the export's
    own checks feed it: `edgelin validate DIR` replays the recorded reference vectors and measures the quality
    figures (reference_vectors.positions_needed: 527 tokens), and an fp16/quantised export runs the same figures
    as its quality gate. A shorter cache would write an export that cannot validate itself, and a larger one than
    this machine's memory or ONNX's protobuf limit holds (edgelin.export.static_cache) would fail minutes into the
    export: both refused before anything is traced, naming the --context that works."""
    from edgelin.artifact.reference_vectors import positions_needed
    from edgelin.export.static_cache import check_static_cache_size

    capacity = getattr(options, "context", None) if getattr(options, "kv_cache", None) == "static" else None
    if capacity is None:
        return
    check_static_cache(model, target, settings)  # its own refusals first (wrong target, no growing cache)
    need = positions_needed()
    if capacity < need:
        raise EdgelinError(f"--kv-cache static --context {capacity}",
                           f"the export's own checks (the reference vectors and quality figures that `edgelin "
                           f"validate DIR` replays, and the fp16/quantised quality gate) feed one sequence up to "
                           f"{need} tokens, more than a {capacity}-token cache holds",
                           f"pass --context {need} or more (the longest sequence the export will hold)")
    check_static_cache_size(model.config, capacity, KV_DTYPES[options.kv_dtype],
                            rotary_tables=options.step_ops != "standard", least=need)


def mark_static_cache(path: Path, outputs: list[TensorIO], layers: int, capacity: int) -> None:
    """Check that each GroupQueryAttention node reads its past KV from a graph input and writes its present
    straight to the graph output that feeds that input (what lets the runner bind one buffer to both: in
    place, nothing between them to copy), then record the capacity in the graph's metadata."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)  # weights stay where they are (weights.bin)
    graph_inputs = {v.name for v in proto.graph.input}
    feeds = {t.name: t.feeds for t in outputs if t.feeds is not None}
    nodes = [n for n in proto.graph.node if n.domain in ("com.microsoft", ORT_OPS_DOMAIN)
             and n.op_type == "GroupQueryAttention"]
    in_place = [n for n in nodes if all(n.input[3 + i] in graph_inputs and feeds.get(n.output[1 + i]) == n.input[3 + i]
                                        for i in (0, 1))]
    if len(nodes) != layers or len(in_place) != layers:
        raise EdgelinError(f"{path.name}: {len(in_place)} of {layers} attention layers export as an in-place "
                           "GroupQueryAttention", "the exporter put other nodes between the KV state and the op",
                           "report this model config as an edgelin bug; export without --kv-cache static meanwhile")
    set_metadata(proto, KV_CAPACITY_KEY, str(capacity))
    onnx.save(proto, str(path))


def mark_in_place_states(path: Path, outputs: list[TensorIO]) -> list[str]:
    """Record in the step graph's metadata which of its states the runner may update in place
    (edgelin.export.onnx.in_place); returns their past input names."""
    import onnx

    from edgelin.export.onnx.in_place import in_place_states
    from edgelin.export.onnx.metadata import IN_PLACE_KEY

    proto = onnx.load(str(path), load_external_data=False)  # weights stay where they are (weights.bin)
    safe = in_place_states(proto.graph, {t.name: t.feeds for t in outputs if t.feeds is not None})
    set_metadata(proto, IN_PLACE_KEY, ",".join(safe))
    onnx.save(proto, str(path))
    return safe


def set_metadata(proto, key: str, value: str) -> None:
    """The graph's metadata_props entry `key` set to `value` (replacing any)."""
    kept = [p for p in proto.metadata_props if p.key != key]
    del proto.metadata_props[:]
    proto.metadata_props.extend(kept)
    proto.metadata_props.add(key=key, value=value)


def ort_op_counts(path: Path) -> tuple[int, int]:
    """For the graph at `path`: how many nodes are edgelin.ortops' (--step-ops edgelin), and how many weight
    products ONNX Runtime would prepack (its own MatMulNBits, those the library does not take; the runner turns
    prepacking off when no graph has any). One parse; none for a graph without either name in its bytes."""
    import onnx

    data = path.read_bytes()
    if ORT_OPS_DOMAIN.encode() not in data and b"MatMulNBits" not in data:
        return 0, 0
    nodes = onnx.load(str(path), load_external_data=False).graph.node
    return (sum(node.domain == ORT_OPS_DOMAIN for node in nodes),
            sum(node.op_type == "MatMulNBits" and node.domain == "com.microsoft" for node in nodes))


def static_capacity(path: Path) -> int | None:
    """The static KV cache capacity a graph file records (None: a growing cache)."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    value = {p.key: p.value for p in proto.metadata_props}.get(KV_CAPACITY_KEY)
    return int(value) if value is not None else None


def kv_retyped(tensors: tuple[TensorIO, ...], dtype: str) -> tuple[TensorIO, ...]:
    """The growing KV caches' state tensors (dims with past_sequence) as `dtype`."""
    import dataclasses

    return tuple(dataclasses.replace(t, dtype=dtype) if t.role == "state" and any("past_sequence" in str(d)
                                                                                    for d in t.dims) else t
                 for t in tensors)


def kv_cache_entry(capacity: int, dtype: str = "float32") -> dict:
    """manifest extra["kv_cache"] of a static-cache export (edgelin.artifact.manifest reads it)."""
    return {"layout": "static", "capacity": capacity, "op": "com.microsoft.GroupQueryAttention", "dtype": dtype}
