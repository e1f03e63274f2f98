"""What a fixed-capacity KV cache (`edgelin export --kv-cache static --context N`) costs, estimated from the model
config before anything is traced, and the refusal of an N that cannot be written or held.

Everything sized by N is linear in it:
- the cache: per sequence, K and V of every full-context attention layer, [kv_heads, N, head_dim] each at the
  cache's dtype (--kv-dtype). The runner allocates it whole when a sequence starts (edgelin.export.onnx.runner);
  the export's own quality gate (fp16/quantised exports) and `edgelin validate DIR` run it.
- the step graph's rotary tables (--step-ops contrib or edgelin: edgelin.export.onnx.rotary): a cos and a sin table
  of N x rotary_dim/2 float32 values per attention layer (each layer's rotary is its own initializer), held inline
  in step.onnx, so within protobuf's 2 GiB message limit. The exporter builds them in numpy, copies them into the
  graph and serialises it: about ROTARY_COPIES times their bytes at once.
So the largest N that fits a limit is the limit over the bytes per position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from edgelin.errors import EdgelinError

if TYPE_CHECKING:
    from edgelin.model.config import ModelConfig

PROTOBUF_LIMIT = 2**31 - 1  # protobuf refuses to serialise a larger message (an ONNX ModelProto included)
GRAPH_RESERVE = 64 << 20  # the rest of step.onnx beside the tables (its weights are in weights.bin)
ROTARY_COPIES = 5  # the tables at once: built (numpy), in the graph, serialised, reloaded (measured 4.9x)
DTYPE_BYTES = {"float32": 4, "float16": 2}


@dataclass(frozen=True)
class StaticCacheSize:
    """The bytes a static KV cache of `capacity` tokens needs, by what holds them."""

    capacity: int
    kv_bytes: int  # the K/V cache of one sequence (every full-context attention layer)
    rotary_bytes: int  # the step graph's cos/sin tables (0: none, e.g. --step-ops standard)

    @property
    def memory_bytes(self) -> int:
        """The export's peak for what is sized by N: one sequence's cache and the tables as they are written."""
        return self.kv_bytes + ROTARY_COPIES * self.rotary_bytes


def static_cache_size(config: "ModelConfig", capacity: int, kv_dtype: str = "float32",
                      rotary_tables: bool = True) -> StaticCacheSize:
    """The estimate for `config` at `capacity` tokens; `kv_dtype`: the cache's element type ("float32",
    "float16"); `rotary_tables`: the step graph carries them (--step-ops contrib or edgelin)."""
    from edgelin.families import SOFTMAX

    attention = config.attention
    layers = sum(t == SOFTMAX for t in config.layer_types)
    if attention is None or attention.window is not None or not layers:
        return StaticCacheSize(capacity, 0, 0)  # no cache that grows with the context: nothing sized by N
    kv = layers * 2 * attention.num_kv_heads * attention.head_dim * capacity * DTYPE_BYTES[kv_dtype]
    rotary_dim = attention.rotary_dim or attention.head_dim
    rotary = layers * 2 * capacity * (rotary_dim // 2) * 4 if rotary_tables else 0
    return StaticCacheSize(capacity, kv, rotary)


def check_static_cache_size(config: "ModelConfig", capacity: int, kv_dtype: str = "float32", rotary_tables: bool = True,
                            available: int | None = None, least: int = 1) -> StaticCacheSize:
    """Refuse, in one line naming the estimate, the limit and the largest --context that fits, a capacity whose
    rotary tables exceed protobuf's limit or whose cache and tables exceed `available` bytes of memory (default:
    what this machine has available now; None where the OS does not say: not compared). `least`: the least
    --context the export takes (a fix below it names the memory that one needs instead). Returns the estimate."""
    from edgelin.bench import available_memory
    from edgelin.output import human_bytes

    size = static_cache_size(config, capacity, kv_dtype, rotary_tables)
    per_position = static_cache_size(config, 1, kv_dtype, rotary_tables)
    what = f"--kv-cache static --context {capacity}"
    table_limit = PROTOBUF_LIMIT - GRAPH_RESERVE
    if size.rotary_bytes > table_limit:
        largest = table_limit // per_position.rotary_bytes
        raise EdgelinError(what, f"the step graph's rotary cos/sin tables would be {human_bytes(size.rotary_bytes)}, "
                           f"more than the {human_bytes(table_limit)} ONNX's 2 GiB protobuf limit leaves for them",
                           f"pass --context {largest} or less (the largest that fits), or --step-ops standard "
                           "(rotary computed in the graph, no tables)")
    available = available_memory() if available is None else available
    if available is not None and size.memory_bytes > available:
        largest = available // per_position.memory_bytes
        parts = f"the K/V cache of one sequence {human_bytes(size.kv_bytes)}" + (
            f" + the rotary tables {human_bytes(size.rotary_bytes)} x {ROTARY_COPIES} while written"
            if size.rotary_bytes else "")
        fix = (f"pass --context {largest} or less (the largest that fits), or free memory" if largest >= least else
               f"free memory, or export on a machine with more (--context {least}, the least the export takes, "
               f"needs about {human_bytes(least * per_position.memory_bytes)})")
        raise EdgelinError(what, f"it needs about {human_bytes(size.memory_bytes)} ({parts}), more than the "
                           f"{human_bytes(available)} of memory available on this machine", fix)
    return size
