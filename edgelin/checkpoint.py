"""Checkpoint directories (Hugging Face layout): config.json + safetensors weights (single or sharded
with an index) + tokenizer.json. Loading never unpickles: pickle files are refused."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath

import torch

from edgelin.errors import EdgelinError
from edgelin.model.config import MODEL_TYPE, ModelConfig
from edgelin.tokenizer import TOKENIZER
from edgelin.model.lm import CausalLM

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    format: str  # "edgelin" (upstream formats are converted on load)
    model_type: str
    sha256: str
    tokenizer: Path | None
    inert_fields: tuple[str, ...] = ()  # config.json fields the upstream model never reads (accepted)


def checkpoint_dir(path: Path) -> Path:
    path = Path(path)
    if not path.exists():
        raise EdgelinError(f"checkpoint {path} does not exist", "nothing to load", "pass a checkpoint directory")
    if not path.is_dir():
        raise EdgelinError(f"checkpoint {path} is not a directory",
                           "a checkpoint is a directory with config.json and *.safetensors", "pass its directory")
    return path


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint, in index order for sharded ones."""
    index = path / INDEX
    if index.is_file():
        weight_map = _weight_map(index)
        files = [_inside(path, s, index) for s in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise EdgelinError(f"{path}: missing shards {', '.join(missing)}", f"{INDEX} lists them",
                               "copy every shard listed in the index")
        _check_shards(path, files, index, weight_map)
        return files
    files = sorted(path.glob("*.safetensors"))
    if files:
        _check_shards(path, files)
        return files
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise EdgelinError(
            f"{path} has only pickle weights ({', '.join(pickles)})",
            "unpickling can run arbitrary code, so edgelin loads safetensors only",
            "convert once in a trusted environment: save_pretrained(..., safe_serialization=True)",
        )
    raise EdgelinError(f"{path} has no weights", "no *.safetensors file found", "add model.safetensors")


def _weight_map(index: Path) -> dict[str, str]:
    """A sharded checkpoint's index: {"weight_map": {tensor: shard file}}, at least one tensor."""
    data = read_json(index, "re-save the checkpoint")
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise EdgelinError(f"{index} is malformed", "it has no \"weight_map\" object (tensor name -> shard file)",
                           "re-save the checkpoint")
    bad = next((v for v in weight_map.values() if not isinstance(v, str)), None)
    if bad is not None:
        raise EdgelinError(f"{index} is malformed", f"weight_map maps a tensor to {_short(bad)}, not a file name",
                           "re-save the checkpoint")
    if not weight_map:
        raise EdgelinError(f"{index} is malformed", "its weight_map lists no tensors", "re-save the checkpoint")
    return weight_map


def _check_shards(path: Path, files: list[Path], index: Path | None = None,
                  weight_map: dict[str, str] | None = None) -> None:
    """Read each safetensors header (a few KB: no tensor data) before anything is loaded or written: a
    truncated file, a tensor held by two files, or an index that disagrees with its shards is one line.
    Shards may differ in dtype (bf16 beside fp16): every value converts to float32 exactly."""
    from safetensors import safe_open

    held: dict[str, str] = {}
    for file in files:
        with _reading(file), safe_open(str(file), "pt") as handle:
            names = list(handle.keys())
        for name in names:
            if name in held:
                raise EdgelinError(f"{path}: tensor {name} is in both {held[name]} and {file.name}",
                                   "a checkpoint holds each tensor once, so one of the files is stale",
                                   "re-download the checkpoint, or remove the file a re-save left behind")
            held[name] = file.name
    if weight_map is None:
        return
    wrong = sorted(t for t, f in weight_map.items() if held.get(t) != f)
    unlisted = sorted(set(held) - set(weight_map))
    if wrong or unlisted:
        t = (wrong or unlisted)[0]
        why = (f"it places {t} in {weight_map[t]}, " + (f"but {held[t]} holds it" if t in held else "which lacks it")
               if wrong else f"{held[t]} holds {t}, which the index does not list")
        more = len(wrong) + len(unlisted) - 1
        raise EdgelinError(f"{index} does not match its shards", why + (f" (+{more} more)" if more else ""),
                           "re-download the checkpoint: the index and the shards come from different saves")


@contextmanager
def _reading(file: Path, what: str | None = None) -> Iterator[None]:
    """A safetensors file read inside: its read error becomes one line naming `what` (default: the file)."""
    from safetensors import SafetensorError

    try:
        yield
    except (SafetensorError, OSError, ValueError) as exc:
        raise EdgelinError(f"cannot read {what or file}", f"corrupt or truncated safetensors ({exc})",
                           "re-download or re-save the checkpoint") from exc


def _inside(root: Path, name: str, index: Path) -> Path:
    """`root / name` for a file name from a checkpoint's metadata, refusing a name that leaves the folder.
    The check is on the name alone (absolute, a drive, a backslash, a '..' part): links the user placed
    are followed, not judged, so a Hugging Face cache snapshot (shards linked into ../blobs/) loads."""
    parts = PurePosixPath(name).parts
    if (not name or name.startswith("/") or PureWindowsPath(name).is_absolute() or PureWindowsPath(name).drive
            or "\\" in name or ".." in parts or not parts or parts == (".",)):
        raise EdgelinError(f"{index}: file name {_short(name)} escapes the checkpoint folder",
                           "the index may only name files inside the checkpoint", "fix the index file")
    return root / name


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def read_json(file: Path, fix: str) -> object:
    """A checkpoint's JSON file, parsed; one line naming it if it is not JSON (or nested too deeply to parse)."""
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise EdgelinError(f"{file} is not valid JSON", str(exc), fix) from exc
    except RecursionError as exc:  # json's parser recurses once per nesting level
        raise EdgelinError(f"{file} is malformed", "its JSON is nested too deeply to parse", fix) from exc


class TensorFiles:
    """A checkpoint's tensors by name, each read from its safetensors file only when popped (the file opened and
    closed around it): a converter turning them to float32 one at a time then never holds the checkpoint beside the
    converted model (Qwen3.5-0.8B: 1.5 GB of bf16 that load_state_dict would keep until the last tensor)."""

    def __init__(self, where: dict[str, Path], shapes_only: bool = False):
        self._where, self._shapes_only = where, shapes_only

    @classmethod
    def of(cls, path: Path, shapes_only: bool = False) -> "TensorFiles":
        """`shapes_only`: each popped tensor is an empty one on torch's meta device, of the shape and dtype its
        file's header gives (nothing is read past the headers: `describe_model`)."""
        from safetensors import safe_open

        where: dict[str, Path] = {}
        for file in weight_files(path):  # (their headers were checked there: a truncated file is refused)
            with _reading(file), safe_open(str(file), "pt") as handle:
                where.update(dict.fromkeys(handle.keys(), file))
        return cls(where, shapes_only)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def keys(self):
        return self._where.keys()

    def copy(self) -> "TensorFiles":
        return TensorFiles(dict(self._where), self._shapes_only)

    def pop(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        file = self._where.pop(name)
        with _reading(file, f"{name} from {file}"), safe_open(str(file), "pt") as handle:
            if not self._shapes_only:
                return handle.get_tensor(name)
            piece = handle.get_slice(name)
            dtype = SAFETENSORS_DTYPES.get(piece.get_dtype())
            if dtype is None:
                raise EdgelinError(f"{file}: tensor {name} has dtype {piece.get_dtype()}",
                                   "edgelin reads float, integer and bool safetensors dtypes",
                                   "re-save the checkpoint with its floating-point weights")
            return torch.empty(piece.get_shape(), dtype=dtype, device="meta")

    def popall(self) -> dict[str, torch.Tensor]:
        return {name: self.pop(name) for name in list(self._where)}


# safetensors' header dtypes (the format's own names) -> torch's
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
                      "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U64": torch.uint64,
                      "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool}


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        with _reading(file):
            tensors.update(load_file(str(file)))
    return tensors


def read_config(path: Path) -> dict:
    file = path / CONFIG
    if not file.is_file():
        raise EdgelinError(f"no {CONFIG} in {path}", "the architecture is defined there",
                           "pass a checkpoint directory with config.json")
    data = read_json(file, "repair or re-save the checkpoint")
    if not isinstance(data, dict):
        raise EdgelinError(f"{file} is not a JSON object", "config.json maps fields to values", "repair it")
    if data.get("auto_map"):
        raise EdgelinError(f"{file} has an auto_map (remote code)",
                           "edgelin never runs code shipped with a checkpoint",
                           "use a model_type edgelin supports natively (edgelin inspect lists them)")
    return data


def checkpoint_hash(path: Path) -> str:
    digest = hashlib.sha256()
    names = [CONFIG, *[f.relative_to(path).as_posix() for f in weight_files(path)], TOKENIZER]
    for name in names:
        file = path / name
        if file.is_file():
            digest.update(name.encode())
            with open(file, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    digest.update(block)
    return digest.hexdigest()


def model_config(path: Path) -> ModelConfig:
    """The architecture of a checkpoint directory, from its config.json alone (no weights read): what an export
    estimates its memory and disk from before the weights load."""
    path = checkpoint_dir(path)
    data = read_config(path)
    if data.get("model_type") == MODEL_TYPE:
        return ModelConfig.from_dict(data, source=str(path / CONFIG))
    from edgelin.convert import convert

    return convert(data, str(path / CONFIG)).config


def load_model(path: Path) -> tuple[CausalLM, CheckpointInfo]:
    """Build edgelin's reference model from a checkpoint directory (fp32, eval mode): edgelin's own
    format, or an upstream one (fla, transformers) through its converter."""
    return _build(path, shapes_only=False)


def describe_model(path: Path) -> tuple[CausalLM, CheckpointInfo]:
    """What load_model checks, from config.json and the safetensors headers alone: the names, shapes and float
    dtypes of every weight against the config, through the same converter; the model's parameters stay on torch's
    meta device (nothing is read or allocated: `edgelin inspect` of a 2 B checkpoint on a board with less memory
    than its float32 weights). Values are not checked (NaN or Inf: export's load refuses them) and info.sha256 is
    empty (hashing reads every byte)."""
    return _build(path, shapes_only=True)


def _build(path: Path, shapes_only: bool) -> tuple[CausalLM, CheckpointInfo]:
    path = checkpoint_dir(path)
    data = read_config(path)
    model_type = data.get("model_type")
    source = str(path / CONFIG)
    converter = None
    if model_type == MODEL_TYPE:
        config, fmt, inert = ModelConfig.from_dict(data, source=source), MODEL_TYPE, ()
    else:
        from edgelin.convert import convert

        done = convert(data, source)
        config, fmt, inert, converter = done.config, done.converter.origin(data), done.inert, done.converter
    if shapes_only:  # a description needs no memory: only a size its files cannot hold is refused
        check_fits_in_files(config, source, path)
    else:
        check_fits_in_memory(config, source)
    if converter is not None:
        tensors = converter.map_weights(TensorFiles.of(path, shapes_only), config, data)
    else:
        tensors = TensorFiles.of(path, shapes_only=True).popall() if shapes_only else load_state_dict(path)
    if shapes_only:  # every parameter and buffer on the meta device: nothing allocated, whatever the sizes say
        with torch.device("meta"):
            model = CausalLM(config)
    else:
        model = empty_model(config)
    assign_weights(model, tensors, path)
    del tensors
    tokenizer = path / TOKENIZER
    info = CheckpointInfo(path.resolve(), fmt, str(model_type), "" if shapes_only else checkpoint_hash(path),
                          tokenizer if tokenizer.is_file() else None, tuple(inert))
    return model.eval(), info


def float32_footprint(config: ModelConfig) -> tuple[int, int]:
    """(parameters, bytes of parameters and buffers in float32) of `config`'s model, laid out on torch's meta
    device (nothing allocated)."""
    with torch.device("meta"):
        model = CausalLM(config)
    return model.num_parameters(), sum(t.numel() * 4 for t in [*model.parameters(), *model.buffers()])


def check_fits_in_memory(config: ModelConfig, source: str) -> None:
    """Refuse a config whose float32 weights alone exceed this machine's memory (a typo like hidden_size =
    10**12), before building it: the model is laid out on torch's meta device, which allocates nothing."""
    memory = _physical_memory()
    if memory is None:
        return
    count, needed = float32_footprint(config)
    if needed > memory:
        raise EdgelinError(f"{source} asks for {count:,} parameters ({needed / 2**30:,.1f} GiB in float32)",
                           f"that is more than this machine's {memory / 2**30:,.1f} GiB of memory, so the sizes "
                           "are likely wrong", "check the sizes in the config (hidden_size, vocab_size, "
                           "intermediate_size, head dims, the number of layers)")


def check_fits_in_files(config: ModelConfig, source: str, path: Path) -> None:
    """Refuse a config that asks for more parameters than its weight files have bytes (every float dtype takes at
    least one): a typo's size, which describe_model's layout on the meta device would otherwise report as every
    weight's shape mismatch."""
    count, needed = float32_footprint(config)
    held = sum(file.stat().st_size for file in weight_files(path))
    if count > held:
        raise EdgelinError(f"{source} asks for {count:,} parameters ({needed / 2**30:,.1f} GiB in float32)",
                           f"its weight files hold {held / 2**30:,.2f} GiB, fewer bytes than that many parameters, "
                           "so the sizes are likely wrong", "check the sizes in the config (hidden_size, vocab_size, "
                           "intermediate_size, head dims, the number of layers)")


def _physical_memory() -> int | None:
    """Bytes of RAM on this machine; None where the OS does not say (then nothing is refused)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def assign_weights(model: CausalLM, tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Check `tensors` against the model's names, shapes and float dtypes, then give each its value
    (consuming the dict: each source tensor is dropped once converted, so a large checkpoint never
    sits in memory twice)."""
    expected = {k: v for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
        tensors.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = [f"{k}: {tuple(tensors[k].shape)} vs config {tuple(expected[k].shape)}"
             for k in sorted(set(expected) & set(tensors)) if tensors[k].shape != expected[k].shape]
    problems = [f"missing {_few(missing)}" if missing else "", f"unexpected {_few(unexpected)}" if unexpected else "",
                f"shape mismatch {_few(wrong)}" if wrong else ""]
    problems = [p for p in problems if p]
    if problems:
        raise EdgelinError(f"weights in {path} do not match config.json", "; ".join(problems),
                           "use the config.json saved with these weights")
    for name in sorted(set(tensors) & set(expected)):  # a cast would hide corrupt or mislabeled weights
        if expected[name].is_floating_point() and not tensors[name].is_floating_point():
            raise EdgelinError(f"{path}: tensor {name} has dtype {str(tensors[name].dtype).removeprefix('torch.')}",
                               "the model holds floating-point values there (float16, bfloat16, float32 or "
                               "float64 are read)", "re-save the checkpoint with its floating-point weights")
    with torch.no_grad():
        for name in list(tensors):
            value, target = tensors.pop(name), expected[name]  # one converted tensor alive at a time
            if not value.is_meta and not _all_finite(value):  # (describe_model: shapes only)
                raise EdgelinError(f"{path}: tensor {name} has NaN or Inf", "the weights are corrupt",
                                   "re-train or re-save the checkpoint")
            if target.is_meta:  # empty_model's parameter: the converted tensor becomes it (no second copy)
                _set_tensor(model, name, value.to(target.dtype).contiguous())
            else:
                target.copy_(value.to(target.dtype))
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight


def empty_model(config: ModelConfig) -> CausalLM:
    """The model with its parameters on torch's meta device (nothing allocated, no random init: 23 s and
    3 GB for a 0.75 B model otherwise) and its buffers built on the CPU as usual (rotary frequencies and
    fixed decays are computed there, not loaded); assign_weights gives every parameter its value."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None:
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta  # (nn.Linear's torch.empty is never touched: no memory)
    try:
        return CausalLM(config)
    finally:
        torch.nn.Module.register_parameter = register


def _all_finite(value: torch.Tensor, piece: int = 1 << 24) -> bool:
    """No NaN or Inf in `value`, checked a slice at a time (torch.isfinite of a whole 248k-token table takes
    1.7 GB of temporaries)."""
    flat = value.reshape(-1)
    return all(bool(torch.isfinite(flat[lo:lo + piece]).all()) for lo in range(0, flat.numel(), piece))


def _set_tensor(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner)
    if leaf in module._parameters:
        module._parameters[leaf] = torch.nn.Parameter(value, requires_grad=module._parameters[leaf].requires_grad)
    else:
        module._buffers[leaf] = value


def _few(items: list[str], n: int = 4) -> str:
    return ", ".join(items[:n]) + (f" (+{len(items) - n} more)" if len(items) > n else "")


def write_checkpoint_files(model: CausalLM, folder: Path, tokenizer: Path | None = None,
                           dtype: torch.dtype = torch.float32) -> list[str]:
    """Write config.json + model.safetensors (+ tokenizer.json) into `folder` (a claimed temp folder;
    see save_checkpoint). Returns the names written."""
    folder = Path(folder)
    config = {**model.config.to_dict(), "torch_dtype": str(dtype).removeprefix("torch.")}
    (folder / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    state = {k: (v.to(dtype) if v.is_floating_point() else v).detach().contiguous()
             for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_safetensors(state, folder / WEIGHTS, {"format": "pt"})
    if tokenizer is not None:
        shutil.copyfile(tokenizer, folder / TOKENIZER)
    return [CONFIG, WEIGHTS] + ([TOKENIZER] if tokenizer is not None else [])


def save_checkpoint(model: CausalLM, out: Path, tokenizer: Path | None = None,
                    dtype: torch.dtype = torch.float32, force: bool = False) -> Path:
    """Write config.json + model.safetensors (+ tokenizer.json) atomically. `dtype` is the storage
    type of floating-point tensors (float16 halves the file; loading always computes in fp32).
    An existing `out` needs `force`, and only a checkpoint edgelin trained is replaced (its other
    files are kept): see edgelin.outputs."""
    from edgelin.outputs import CHECKPOINT, claim_output

    writes = [CONFIG, WEIGHTS] + ([TOKENIZER] if tokenizer is not None else [])
    with claim_output(Path(out), force, CHECKPOINT, writes=writes) as tmp:
        write_checkpoint_files(model, tmp, tokenizer, dtype)
    return Path(out)


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """safetensors' save_file, then the mode any other file gets (0666 less the umask): it writes through
    a private temp file, and the weights came out 0600 beside 0644 configs (unreadable to a group)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
