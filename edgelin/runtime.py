"""Running an exported folder (the run phase): open its runner, prefill long prompts piecewise,
measure memory. Imports no torch: this is what a runtime-only install (edgelin[runtime]) runs."""

from __future__ import annotations

import math
import os

import resource
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from edgelin.errors import EdgelinError
from edgelin.export.base import Artifact, Runner, StateHandle, phase_refusal
from edgelin.artifact.manifest import Manifest
from edgelin.export.targets import get_target
from edgelin.integrity import verify_folder

if TYPE_CHECKING:
    from edgelin.devices import DeviceProfile


def load_artifact(folder: Path) -> Artifact:
    """An exported folder as an Artifact: its checked manifest and its graph files, every file the export wrote
    verified against the manifest's digests first (edgelin.integrity; `integrity.checking(verify=False)`: the
    CLI's --no-verify)."""
    _check_path_is_text(Path(folder))
    manifest = Manifest.load(folder)
    verify_folder(Path(folder), manifest)
    return Artifact(Path(folder), manifest, {kind: entry.file for kind, entry in manifest.graphs.items()})


def _check_path_is_text(folder: Path) -> None:
    """The runtimes take paths as UTF-8 text (ONNX Runtime's session, the verdict cache's keys): a folder whose path
    holds bytes that are not UTF-8 (Linux allows them; Python carries them as surrogates) is refused in one line."""
    try:
        str(folder.absolute()).encode("utf-8")
    except UnicodeEncodeError as exc:
        shown = os.fsencode(folder).decode("utf-8", "backslashreplace")
        raise EdgelinError(f"the folder path {shown} is not valid UTF-8",
                           f"byte {exc.object[exc.start:exc.end].encode('utf-8', 'surrogateescape').hex()} is not "
                           "part of a UTF-8 character, and the runtimes take paths as UTF-8 text",
                           "move or rename the folder to a UTF-8 path (e.g. `mv` it under a plain ASCII name)") from exc


def open_runner(folder: Path, threads: int | None = None, device: "DeviceProfile | None" = None) -> Runner:
    """A runner on an exported folder, if its target can run here (for `device`, when given);
    otherwise one line naming the run phase, why not, and where it does run."""
    artifact = load_artifact(folder)
    target = get_target(artifact.manifest.target)
    phase = target.can_run(device)
    if not phase.ok:
        raise phase_refusal(target, "run", phase)
    return target.runner(artifact, device, threads or None)


def runner_label(runner: Runner) -> str:
    """Which runtime a runner runs (reports print it as `runner: ...`): its own label (e.g. "tensorrt engine
    (...)"), else its target's runtime (Target.runtime)."""
    label = getattr(runner, "label", None)
    if label:
        return str(label)
    return get_target(runner.manifest.target).runtime_of("")


def prefill(runner: Runner, ids: np.ndarray, state: StateHandle | None = None, start: int = 0,
            chunk: int = 2048) -> tuple[np.ndarray, StateHandle]:
    """Prefill ids [B, T] in pieces of at most `chunk` tokens (bounded memory for any T), from `state`
    (a new zero state when None), which is advanced in place; returns (last logits, the handle).
    Pieces are shorter still where that costs nothing: at most `runner.prefill_piece` tokens (CONSTANT_PIECE
    unless the runner says otherwise), and for a growing KV cache shrinking further with the context
    (`piece_length`).
    runner.prefill checks every piece (ids, positions, the handle) before it reaches the runtime."""
    ids = np.asarray(ids)
    if ids.ndim != 2:
        raise EdgelinError(f"prefill ids have shape {list(ids.shape)}", "prefill takes [batch, tokens]",
                           "pass a 2-D array, e.g. ids[None] for one sequence")
    if ids.shape[1] == 0:
        raise EdgelinError("the prompt is empty", "prefill needs at least one token", "pass a non-empty prompt")
    if chunk < 1:
        raise EdgelinError(f"prefill chunk {chunk}", "a piece holds at least one token", "pass chunk >= 1")
    batch = ids.shape[0]
    # A fixed-capacity KV cache: the whole prompt is checked, not piece by piece (whose refusal would name
    # one piece and a --context too short for the rest). A constant-memory model has no KV cache.
    if not runner.manifest.constant_memory:
        check_room(runner.manifest, start + ids.shape[1], f"prefill of {ids.shape[1]} token(s) after {start}")
    state = runner.new_state(batch) if state is None else state
    # a static KV cache (export --kv-cache static) holds no [piece, past + piece] scores: pieces as for constant memory
    logits, lo, growing = None, 0, not runner.manifest.constant_memory and runner.manifest.kv_capacity is None
    while lo < ids.shape[1]:
        n = min(piece_length(chunk, start + lo) if growing else chunk, runner.prefill_piece)
        logits = runner.prefill(ids[:, lo:lo + n], state, np.full(batch, start + lo, np.int64))
        lo += n
    return logits, state


def check_room(manifest: Manifest, tokens: int, what: str, fix: str | None = None) -> None:
    """Refuse, in one line, a sequence of `tokens` tokens on an export whose fixed-capacity KV cache
    (`export --kv-cache static --context N`, manifest.kv_capacity) holds fewer; nothing for any other export.
    `fix`: what the caller can change (default: re-export with a --context that holds it)."""
    capacity = manifest.kv_capacity
    if capacity is not None and tokens > capacity:
        flag = manifest.kv_flag(capacity)
        raise EdgelinError(what, f"the export's fixed-capacity KV cache holds {capacity} tokens (exported with "
                           f"{flag}) and this needs {tokens}",
                           fix or f"re-export with a larger --context (at least {tokens}), or start a new sequence")


# A constant-memory model's prefill graph holds its activations for a whole piece (ONNX Runtime keeps
# them in its arena after the call): pieces of 256 tokens instead of 2,048 cut the Mamba2 peer checkpoint's
# (12.1 M parameters) peak RSS for a 2,048-token prompt from 643 to 237 MiB at 1 thread, and prefill got no
# slower (4,200 -> 4,700-5,000 tokens/s: the chunk scan's working set stays in cache); 128 saved another
# 30 MiB for ~5% of the speed, 64 and below lost 20-50% then. The ONNX runner sets its own since its products
# became edgelin's kernels (the ONNX runner's CONSTANT_MEMORY_PREFILL_PIECE: 64); this stays the default of others.
CONSTANT_PIECE = Runner.prefill_piece  # 256

# A growing KV cache's prefill graph holds [heads, piece, past + piece] attention scores (and the
# softmax's copies of them): pieces shrink as the context grows, so that piece x (past + piece)
# stays under this many token pairs (32 MiB of float32 scores per head) at any position. They start at the
# runner's prefill_piece, as a constant-memory model's do: the arena keeps the largest piece's activations
# (Qwen3.5-2B's shapes, int4, a 2,048-token prompt at 1 thread: peak RSS 2,552 MiB in one piece, 1,663 in
# pieces of 256, prefill no slower: bench/prefill_pieces.py; beside llama.cpp: docs/benchmarks.md, "Beside
# llama.cpp: qwen3.5-2b").
ATTENTION_PAIRS = 1 << 23


def piece_length(chunk: int, past: int) -> int:
    """The longest piece n <= chunk with n * (past + n) <= ATTENTION_PAIRS (at least one token)."""
    n = int((math.sqrt(past * past + 4 * ATTENTION_PAIRS) - past) / 2)
    return max(1, min(chunk, n))


def rss_bytes() -> int:
    """Current resident set size (Linux /proc; falls back to the peak elsewhere)."""
    try:
        with open("/proc/self/statm") as fh:
            import os

            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
