"""CPU decoding side by side with the peers users would pick instead (issue 13): a benchmark, not a test.

    python bench/peers.py CKPT [--threads 1,2] [--positions 1,1024,8192,32768] [--runtimes ...] [--json FILE]
                               [--rounds 3] [--plot latency.png]
    python bench/peers.py --from-json FILE [--plot latency.png]   # re-render a saved report, time nothing

One transformers checkpoint (qwen3_5_text or mamba2: bench/peer_checkpoints.py makes them) through every
runtime on this machine, in one run, each runtime in its own subprocess (so peak RSS is its own) with the
same thread count: edgelin's ONNX exports (fp32, fp16, int8, int4), llama.cpp through llama-cpp-python
(the checkpoint converted by the convert_hf_to_gguf.py of the llama.cpp source it vendors, to f32/f16,
then Q8_0/Q4_0 by llama_model_quantize), ExecuTorch (XNNPACK), transformers (pure-torch path, fla
blocked). The peers live in their own venvs (bench/peers.md: `make peers-setup`).

Per runtime and thread count: greedy continuation of the prompt (--new-tokens, token agreement with the
transformers fp32 reference is printed), prefill tokens/s for a --prefill-token prompt (best of 2), decode
latency p50/p99 over --iters timed steps at each position (reached by prefill in pieces of 2,048 from the
empty state; step i of position p sits at p + 3 + i), peak RSS of the process, bytes on disk, and where the
process's resident pages are at the end (anonymous; the artifact's mapped files; the runtime package's libraries;
every other file's, e.g. Python's and numpy's).
Protocol per runtime: reset (empty state), prefill(ids) -> last logits, step(token) -> logits; the same
seeded random ids (numpy default_rng(0), vocabulary-wide) for every runtime.
--rounds N times every runtime N times, whole rounds interleaved (the order reversed every other round), for a
shared host whose speed drifts: each cell is the median over rounds, each ratio also gives the range of the rounds'
own ratios (edgelin and peer timed in the same round, minutes apart).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PEERS = Path(os.environ.get("EDGELIN_PEERS", "/work/peers"))
LLAMA_SRC = PEERS / "src" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
PY = {"edgelin": sys.executable, "transformers": sys.executable,
      "llama": str(PEERS / "venv-llama" / "bin" / "python"), "executorch": str(PEERS / "venv-et" / "bin" / "python")}
PROMPT = "def main("
MEM_LIMIT = 12 << 30  # address-space cap per worker: a runtime that would take more fails in its cell, no OOM kill
RUNTIMES = ["edgelin-fp32", "edgelin-fp32-prepack", "edgelin-fp16", "edgelin-f16w", "edgelin-int8", "edgelin-int4",
            "edgelin-int4-contrib", "llama-f32", "llama-f16", "llama-q8_0", "llama-q4_0", "executorch-fp32",
            "transformers-fp32"]
# Also on request (--runtimes): edgelin-int4b64, 4-bit weights in blocks of 64 (4.56 bits per weight with their fp32
# scale and 4-bit zero point, against Q4_0's 4.5; edgelin's default blocks of 32 are 5.13); any edgelin kind with
# "-std" (e.g. edgelin-int4-std): the export with --step-ops standard (no contrib ops in the step), side by side;
# "-kv16" (e.g. edgelin-int4-kv16): a static KV cache in float16 (--kv-dtype fp16; llama.cpp's cache is f16 too);
# "-contrib" (edgelin-int4-contrib, in the default list): --step-ops contrib (ONNX Runtime's kernels only); "-ops":
# --step-ops edgelin, which is also the default export since 2026-12-03 (the step's convs, recurrences and 4-bit
# products through edgelin's own kernel library, edgelin.ortops, built here at first use); "-e8" (edgelin-int4-e8):
# the embedding table and LM head at 8 bits (--embeddings-bits 8: llama.cpp's Q4_0 keeps token_embd at Q8_0);
# "-kef": both float (--keep-embeddings-float).
# edgelin-f16w: --quantize fp16 (float16 weights, float32 arithmetic: what llama.cpp's f16 file holds);
# edgelin-fp16: --precision fp16 (an fp16 graph, for GPU providers; ONNX Runtime's x86 CPU runs it through Casts)
PRECISION = {"fp32": "fp32", "f32": "fp32", "fp16": "fp16", "f16w": "fp16", "f16": "fp16", "int8": "8-bit",
             "q8_0": "8-bit",
             "int4": "4-bit", "int4b64": "4-bit", "q4_0": "4-bit"}


# ---- workers: one runtime in this process ---------------------------------------------------------
class EdgelinSession:
    def __init__(self, artifact: str, threads: int):
        from edgelin.runtime import open_runner

        self.runner = open_runner(Path(artifact), threads=threads)
        self.reset()

    def reset(self) -> None:
        # the old state goes first: a static KV cache's buffers (143 MB for the Qwen3.5 peer at 34,944 rows)
        # would otherwise be held twice while the new ones fill, and count in the peak RSS
        self.state = None
        self.state, self.pos = self.runner.new_state(1), 0

    def prefill(self, ids: np.ndarray) -> np.ndarray:
        from edgelin.runtime import prefill

        logits, _ = prefill(self.runner, ids[None], self.state, start=self.pos, chunk=2048)
        self.pos += len(ids)
        return logits[0]

    def step(self, token: int) -> np.ndarray:
        out = self.runner.step(np.array([token], np.int64), self.state, np.array([self.pos], np.int64))
        self.pos += 1
        return out[0]


class LlamaSession:
    def __init__(self, artifact: str, threads: int, n_ctx: int, extra_bufts: bool = True):
        import ctypes

        import llama_cpp

        if not extra_bufts:  # llama.cpp's own switch (`--no-extra-bufts`): no AMX / repacked weight buffers
            low = llama_cpp.llama_cpp  # (Llama() takes its model params from this module's defaults)
            default = low.llama_model_default_params

            def params():
                made = default()
                made.use_extra_bufts = False
                return made

            low.llama_model_default_params = params
        self.lib, self.ctypes = llama_cpp, ctypes
        self.llm = llama_cpp.Llama(artifact, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=2048,
                                   n_ubatch=512, verbose=False)
        self.ctx, self.vocab = self.llm.ctx, self.llm.n_vocab()

    def reset(self) -> None:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)

    def _decode(self, ids) -> np.ndarray:
        arr = (self.lib.llama_token * len(ids))(*[int(i) for i in ids])
        rc = self.lib.llama_decode(self.ctx, self.lib.llama_batch_get_one(arr, len(ids)))
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        ptr = self.lib.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.vocab,))

    def prefill(self, ids: np.ndarray) -> np.ndarray:
        for lo in range(0, len(ids), 2048):
            logits = self._decode(ids[lo:lo + 2048])
        return logits

    def step(self, token: int) -> np.ndarray:
        return self._decode([token])


class TransformersSession:
    def __init__(self, artifact: str, threads: int):
        sys.path.insert(0, str(ROOT / "bench"))
        from peer_checkpoints import block_fla

        block_fla()
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(artifact, dtype=torch.float32).eval()
        self.reset()

    def reset(self) -> None:
        self.cache = None

    def _forward(self, ids) -> np.ndarray:
        with self.torch.inference_mode():
            out = self.model(input_ids=self.torch.as_tensor(np.asarray(ids, np.int64))[None],
                             past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.cache = out.past_key_values
        return out.logits[0, -1].numpy()

    def prefill(self, ids: np.ndarray) -> np.ndarray:
        for lo in range(0, len(ids), 2048):
            logits = self._forward(ids[lo:lo + 2048])
        return logits

    def step(self, token: int) -> np.ndarray:
        return self._forward([token])

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        """generate() with its cache, greedy: what a transformers user runs."""
        with self.torch.inference_mode():
            out = self.model.generate(self.torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                                      min_new_tokens=n, pad_token_id=0)
        return out[0, len(prompt):].tolist()


class ExecuTorchSession:
    """The .pte of export_llm (XNNPACK, KV cache, dynamic shape up to 127 tokens a call): forward(tokens, input_pos)."""

    def __init__(self, artifact: str, threads: int):
        import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  registers llama::custom_sdpa etc.
        import torch
        from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool
        from executorch.runtime import Runtime

        _unsafe_reset_threadpool(threads)
        torch.set_num_threads(threads)
        self.torch = torch
        self.method = Runtime.get().load_program(artifact).load_method("forward")
        self.reset()

    def reset(self) -> None:
        self.pos = 0  # the .pte keeps its caches; a new sequence restarts at input_pos 0 (it resets the delta state)

    def _forward(self, ids) -> np.ndarray:
        out = self.method.execute([self.torch.as_tensor(np.asarray(ids, np.int64))[None],
                                   self.torch.tensor([self.pos], dtype=self.torch.long)])
        self.pos += len(ids)
        return out[0].reshape(-1, out[0].shape[-1])[-1].numpy()

    def prefill(self, ids: np.ndarray) -> np.ndarray:
        for lo in range(0, len(ids), 127):  # the export's dynamic token dim is 0..127
            logits = self._forward(ids[lo:lo + 127])
        return logits

    def step(self, token: int) -> np.ndarray:
        return self._forward([token])


RUNTIME_PACKAGES = {"edgelin": "onnxruntime", "llama": "llama_cpp", "transformers": "torch", "executorch": "executorch"}
RESIDENT_PARTS = ("anon", "model", "runtime", "other")


def _resident_split(artifact: str, package: str) -> dict[str, float]:
    """Where this process's resident pages are now, MiB (/proc/self/smaps; Linux): "anon" (heap, arenas, stacks,
    and the written pages of file mappings), "model" (the other pages of the artifact's own files: mapped
    weights), "runtime" (those of the files under the runtime's Python package: its libraries' code and read-only
    data), "other" (every other file's: Python's, numpy's, the C library's)."""
    def under(folder: str | None, path: str) -> bool:
        return folder is not None and (path == folder or path.startswith(folder + "/"))

    root = str(Path(artifact).resolve())
    places = list(getattr(sys.modules.get(package), "__path__", []))  # (executorch is a namespace package: no __file__)
    lib = str(Path(places[0]).resolve()) if places else None
    split = dict.fromkeys(RESIDENT_PARTS, 0)
    name, rss = "", 0
    with open("/proc/self/smaps") as fh:
        for line in fh:
            head = line.split(None, 5)
            if head[0] == "Rss:":
                rss = int(head[1])
            elif head[0] == "Anonymous:":
                split["anon"] += int(head[1])
                if name.startswith("/"):  # a file's pages that are not anonymous
                    kind = "model" if under(root, name) else "runtime" if under(lib, name) else "other"
                    split[kind] += rss - int(head[1])
            elif not head[0].endswith(":"):  # a mapping's first line: range, perms, offset, dev, inode[, path]
                name = head[5].strip() if len(head) > 5 else ""
    return {k: round(v / 1024, 1) for k, v in split.items()}


def _rss_mib() -> float:
    """This process's peak RSS (VmHWM: its own address space's high-water mark; ru_maxrss would keep the
    parent's peak across fork + exec, flooring every worker at the parent's size)."""
    with open("/proc/self/status") as fh:
        return next(int(ln.split()[1]) for ln in fh if ln.startswith("VmHWM:")) / 1024


def worker(spec: dict) -> dict:
    resource.setrlimit(resource.RLIMIT_AS, (MEM_LIMIT, MEM_LIMIT))
    kind, threads = spec["kind"], spec["threads"]
    t0 = time.perf_counter()
    if kind.startswith("edgelin"):
        s = EdgelinSession(spec["artifact"], threads)
    elif kind.startswith("llama"):
        s = LlamaSession(spec["artifact"], threads, max(spec["positions"]) + 2 * spec["iters"] + 2048 + 64,
                         spec.get("extra_bufts", True))
    elif kind.startswith("transformers"):
        s = TransformersSession(spec["artifact"], threads)
    elif kind.startswith("executorch"):
        s = ExecuTorchSession(spec["artifact"], threads)
    else:
        raise SystemExit(f"no worker for {kind}")
    res: dict = {"load_s": round(time.perf_counter() - t0, 2), "rss_after_load_mib": round(_rss_mib(), 1)}
    prompt, n = spec["prompt"], spec["new_tokens"]
    if hasattr(s, "greedy"):
        res["greedy"] = s.greedy(prompt, n)
    else:
        s.reset()
        logits, toks = s.prefill(np.asarray(prompt, np.int64)), []
        for _ in range(n):
            toks.append(int(np.argmax(logits)))
            logits = s.step(toks[-1])
        res["greedy"] = toks
    rng = np.random.default_rng(0)
    ids = rng.integers(0, spec["vocab"], max(spec["positions"]) + 2048, dtype=np.int64)
    times = []
    for _ in range(2):
        s.reset()
        t = time.perf_counter()
        s.prefill(ids[:spec["prefill"]])
        times.append(time.perf_counter() - t)
    res["prefill_tok_s"] = round(spec["prefill"] / min(times), 1)
    s.reset()
    reached, res["latency"] = 0, {}
    for p in spec["positions"]:
        try:
            t = time.perf_counter()
            if p > reached:
                s.prefill(ids[reached:p])
            reach_s = time.perf_counter() - t
            reached = max(p, reached)
            tok = int(ids[p])
            for _ in range(3):
                s.step(tok)
            ms = []
            for i in range(spec["iters"]):
                t = time.perf_counter()
                s.step(tok)
                ms.append((time.perf_counter() - t) * 1e3)
            reached += 3 + spec["iters"]
            res["latency"][str(p)] = {"p50": round(float(np.percentile(ms, 50)), 3),
                                      "p99": round(float(np.percentile(ms, 99)), 3), "reach_s": round(reach_s, 1)}
        except (MemoryError, RuntimeError) as exc:
            res["latency"][str(p)] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            break
    res["peak_rss_mib"] = round(_rss_mib(), 1)
    res["resident_mib"] = _resident_split(spec["artifact"], RUNTIME_PACKAGES[kind.split("-")[0]])
    return res


# ---- the parent: artifacts, then one subprocess per runtime and thread count ----------------------------
def _run(cmd: list[str], log: Path, env: dict | None = None, timeout: float = 3600) -> tuple[bool, str]:
    """Runs cmd under nice; (ok, the last error line of its output)."""
    with open(log, "w") as fh:
        proc = subprocess.run(["nice", "-n", "19", *cmd], stdout=fh, stderr=subprocess.STDOUT, env=env,
                              timeout=timeout, cwd=ROOT)
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    errors = [ln.strip() for ln in lines if "Error" in ln or "error:" in ln or "Invalid value" in ln] or lines[-1:]
    return proc.returncode == 0, " / ".join(errors[-2:])[:400]


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _artifact_size(kind: str, path: Path) -> int:
    """Bytes the runtime loads: the graphs + weights of an export (not its reference vectors or tokenizer)."""
    if kind.startswith("edgelin"):
        return sum(p.stat().st_size for p in path.iterdir() if p.suffix in (".onnx", ".bin", ".data"))
    if kind.startswith("transformers"):
        return sum(p.stat().st_size for p in path.glob("*.safetensors"))
    return _size(path)


LLAMA_CONVERT = """import runpy, sys
sys.path.insert(0, {src!r})
import conversion.base as base
# The recipe's tokenizer is byte-level BPE with GPT-2's split regex and its own 2,048-token vocabulary,
# whose hash llama.cpp's table cannot know: name its pre-tokenizer 'gpt-2' (the same regex).
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = ["convert_hf_to_gguf.py", *{args!r}]
runpy.run_path({src!r} + "/convert_hf_to_gguf.py", run_name="__main__")
"""
LLAMA_QUANTIZE = """import llama_cpp, sys
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = getattr(llama_cpp, sys.argv[3]); p.nthread = 2
rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p)
sys.exit(rc)
"""


def _executorch_export(ckpt: Path, work: Path, pte: Path, log: Path) -> tuple[bool, str]:
    """ExecuTorch's own LLM exporter (export_llm, its qwen3_5 model class and XNNPACK fp32 config) on a params
    file mapped from the transformers config; it has no Mamba2 model class (the error says which it has)."""
    cfg = json.loads((ckpt / "config.json").read_text())
    if cfg["model_type"] != "qwen3_5_text":
        _, err = _run([PY["executorch"], "-m", "executorch.extension.llm.export.export_llm",
                       f"base.model_class={cfg['model_type']}", f"hydra.run.dir={work / 'hydra'}"], log)  # its refusal
        return False, err
    rope = cfg.get("rope_parameters") or {}
    params = {"dim": cfg["hidden_size"], "n_layers": cfg["num_hidden_layers"], "n_heads": cfg["num_attention_heads"],
              "n_kv_heads": cfg["num_key_value_heads"], "head_dim": cfg["head_dim"],
              "hidden_dim": cfg["intermediate_size"], "vocab_size": cfg["vocab_size"], "norm_eps": cfg["rms_norm_eps"],
              "rms_norm_add_unit_offset": True, "use_q_gate": True, "use_qk_norm": True, "qk_norm_before_rope": True,
              "partial_rotary_factor": rope.get("partial_rotary_factor", 0.25),
              "rope_theta": rope.get("rope_theta", 10000.0), "use_hf_rope": True, "layer_types": cfg["layer_types"],
              **{k: cfg[k] for k in ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                                     "linear_num_key_heads", "linear_num_value_heads")}}
    (work / "et-params.json").write_text(json.dumps(params))
    ok, err = _run([PY["executorch"], "-m", "executorch.examples.models.qwen3_5.convert_weights", str(ckpt),
                    str(work / "et-weights.pth")], log)
    if not ok:
        return False, err
    config = Path(subprocess.run([PY["executorch"], "-c", "import executorch; print(list(executorch.__path__)[0])"],
                                 capture_output=True, text=True, check=True).stdout.strip())  # (a namespace package)
    config = config / "examples" / "models" / "qwen3_5" / "config" / "qwen3_5_xnnpack_fp32.yaml"
    ok, err = _run([PY["executorch"], "-m", "executorch.extension.llm.export.export_llm", "--config", str(config),
                    "+base.model_class=qwen3_5_0_8b", f"+base.checkpoint={work / 'et-weights.pth'}",
                    f"+base.params={work / 'et-params.json'}", "export.max_seq_length=128",
                    "export.max_context_length=33000", f"+export.output_dir={work}",
                    f"+export.output_name={pte}", "model.enable_dynamic_shape=True",  # (a name ending .pte is the path)
                    f"hydra.run.dir={work / 'hydra'}"], log)  # (hydra's own log folder: not in the cwd)
    return ok and pte.is_file(), err


def prepare(kind: str, ckpt: Path, work: Path, context: int | None = None) -> tuple[Path | None, str]:
    """(artifact, '') or (None, the exact error). Cached in work/. `context`: edgelin exports a model with
    full attention layers with an in-place KV cache of that many tokens (--kv-cache static; fp16 graphs keep that
    cache float32), in work/<kind>-kv<context>."""
    kind = kind.removesuffix("-prepack")  # the same export, run with prepacking on
    out = work / kind
    log = work / f"{kind}.log"
    if kind.startswith("edgelin"):
        static = context is not None and "full_attention" in json.loads(
            (ckpt / "config.json").read_text()).get("layer_types", [])
        out = work / f"{kind}-kv{context}" if static else out
        if not (out / "manifest.json").is_file():
            flag = {"fp32": [], "fp16": ["--precision", "fp16"], "f16w": ["--quantize", "fp16"],
                    "int8": ["--quantize", "int8"],
                    "int4": ["--quantize", "int4"],
                    "int4b64": ["--quantize", "int4", "--block-size", "64"]}[kind.split("-")[1]]
            flag += {"std": ["--step-ops", "standard"], "ops": ["--step-ops", "edgelin"],
                     "contrib": ["--step-ops", "contrib"], "e8": ["--embeddings-bits", "8"],
                     "kef": ["--keep-embeddings-float"]}.get(kind.split("-")[-1], [])
            flag += ["--kv-dtype", "fp16"] if static and kind.endswith("-kv16") else []
            flag += ["--kv-cache", "static", "--context", str(context)] if static else []
            ok, err = _run([str(Path(sys.executable).parent / "edgelin"), "export", str(ckpt), "--target", "onnx",
                            "--out", str(out), *flag], log)
            if not ok:
                return None, err
        return out, ""
    if kind.startswith("llama"):
        q = kind.split("-")[1]
        gguf = work / f"{kind}.gguf"
        if gguf.is_file():
            return gguf, ""
        if q in ("f32", "f16"):
            extra = ["--no-mtp"] if "qwen" in json.loads((ckpt / "config.json").read_text())["model_type"] else []
            code = LLAMA_CONVERT.format(src=str(LLAMA_SRC), args=[str(ckpt), *extra, "--outtype", q,
                                                                  "--outfile", str(gguf)])
            ok, err = _run([PY["llama"], "-c", code], log)
        else:
            src, _ = prepare("llama-f32", ckpt, work)
            if src is None:
                return None, "needs llama-f32"
            ftype = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0"}[q]
            ok, err = _run([PY["llama"], "-c", LLAMA_QUANTIZE, str(src), str(gguf), ftype], log)
        return (gguf, "") if ok and gguf.is_file() else (None, err)
    if kind.startswith("executorch"):
        pte = work / "executorch-fp32.pte"
        if not pte.is_file():
            ok, err = _executorch_export(ckpt, work, pte, log)
            if not ok:
                return None, err
        return pte, ""
    return ckpt, ""  # transformers runs the checkpoint itself


def versions() -> dict:
    def ask(py: str, code: str) -> str:
        try:
            return subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=120).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return "not installed"
    import onnxruntime
    import transformers

    return {"onnxruntime": onnxruntime.__version__, "transformers": transformers.__version__,
            "torch": __import__("torch").__version__,
            "llama-cpp-python": ask(PY["llama"], "import llama_cpp; print(llama_cpp.__version__)"),
            "executorch": ask(PY["executorch"], "import executorch.version as v; print(v.__version__)"),
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                     cwd=ROOT).stdout.strip() + " + working tree",
            "cpu": next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
                        "?"), "uptime_before": os.getloadavg()}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        print("PEERS-RESULT " + json.dumps(worker(json.loads(sys.argv[2]))), flush=True)
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, nargs="?", help="transformers checkpoint folder (not with --from-json)")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--positions", default="1,1024,8192,32768")
    parser.add_argument("--iters", type=int, default=32)
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--runtimes", default=",".join(RUNTIMES))
    parser.add_argument("--work", type=Path, help="artifacts (default /work/peers/work/<checkpoint name>)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per worker")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path, help="also draw decode latency vs position (PNG, matplotlib)")
    parser.add_argument("--from-json", type=Path, help="render (and --plot) a saved --json report; time nothing")
    parser.add_argument("--prepare-only", action="store_true", help="build the artifacts, time nothing")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time every runtime this many times, rounds interleaved (order reversed every other "
                             "round); cells are medians, ratios add the spread of the rounds' own ratios")
    parser.add_argument("--edgelin-kv", choices=("static", "growing"), default="static",
                        help="edgelin's KV cache for models with full attention (export --kv-cache)")
    args = parser.parse_args()
    if args.from_json:
        report = json.loads(args.from_json.read_text())
        if args.plot:
            plot(report, args.plot)
        print(render(report))
        return
    if args.checkpoint is None:
        parser.error("a checkpoint folder is required (or --from-json REPORT)")
    ckpt = args.checkpoint.resolve()
    work = (args.work or PEERS / "work" / ckpt.name).resolve()
    work.mkdir(parents=True, exist_ok=True)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    prompt = tok.encode(PROMPT, add_special_tokens=False).ids
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    meta = versions()
    rows, artifacts = [], {}
    # edgelin's in-place KV cache holds what the timed run feeds (as llama.cpp's n_ctx), unless --edgelin-kv growing
    positions = [int(p) for p in args.positions.split(",")]
    context = None if args.edgelin_kv == "growing" else max(positions) + 2 * args.iters + 2048 + 64
    for kind in args.runtimes.split(","):  # every artifact first (under nice), then the timed runs back to back
        t = time.perf_counter()
        artifacts[kind], err = prepare(kind, ckpt, work, context)
        rows.append({"runtime": kind, "prepare_s": round(time.perf_counter() - t, 1), "error": err, "runs": {}})
        print(f"{kind}: " + (f"cannot prepare: {err}" if artifacts[kind] is None else f"{artifacts[kind]}"), flush=True)
    if args.prepare_only:
        return
    meta["uptime_before"] = os.getloadavg()
    meta["rounds"] = args.rounds
    # Whole rounds, the runtimes' order reversed every other one (drift cancels); within a round the thread count
    # is the outer loop, so the cells compared with each other (same thread count) run next to each other in time.
    for round_index in range(args.rounds):
        for threads in [int(x) for x in args.threads.split(",")]:
            for row in rows if round_index % 2 == 0 else rows[::-1]:
                kind, artifact = row["runtime"], artifacts[row["runtime"]]
                if artifact is None:
                    continue
                row["bytes_on_disk"] = _artifact_size(kind, artifact)
                result = timed_run(kind, artifact, threads, prompt, vocab, args)
                row.setdefault("rounds", {}).setdefault(str(threads), []).append(result)
                print(f"{kind} x{threads} (round {round_index + 1}): {_brief(result)}", flush=True)
    for row in rows:
        row["runs"] = {threads: merged(results) for threads, results in row.get("rounds", {}).items()}
        if args.rounds == 1:
            row.pop("rounds", None)
    meta["uptime_after"] = os.getloadavg()
    report = {"checkpoint": str(ckpt), "meta": meta, "prompt": prompt, "rows": rows,
              "command": "python bench/peers.py " + " ".join(sys.argv[1:])}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    if args.plot:
        plot(report, args.plot)
    print(render(report))


def timed_run(kind: str, artifact: Path, threads: int, prompt: list[int], vocab: int, args) -> dict:
    """One runtime at one thread count, in a worker process of its own."""
    spec = {"kind": kind, "artifact": str(artifact), "threads": threads, "prompt": prompt, "vocab": vocab,
            "new_tokens": args.new_tokens, "prefill": args.prefill, "iters": args.iters,
            "positions": [int(p) for p in args.positions.split(",")]}
    env = {**os.environ, "PYTHONPATH": str(ROOT), **{v: str(threads) for v in (
        "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}}
    env.pop("EDGELIN_ORT_PREPACK", None)  # edgelin's default: off for float weights, on for int8/int4
    if kind.endswith("-prepack"):  # the same folder with ONNX Runtime's weight prepacking on (`bench --prepack`)
        env["EDGELIN_ORT_PREPACK"] = "1"
    py = PY[kind.split("-")[0]]
    result = run_worker(py, spec, env, args.timeout)
    if kind.startswith("llama") and result.get("signal") == signal.SIGSEGV:
        # llama.cpp's AMX weight buffers crash in ggml_backend_amx_mul_mat on AMX CPUs (llama.cpp issue
        # #20824, open); the path it offers: its default buffers, no AMX or repacking (`--no-extra-bufts`)
        crashed = result["error"]
        result = run_worker(py, {**spec, "extra_bufts": False}, env, args.timeout)
        result["note"] = f"default run: {crashed}; this row with use_extra_bufts=False (no AMX/repack)"
    return result


def _brief(result: dict) -> str:
    """One progress line for a worker's result: p50/p99 per position, prefill and peak RSS (or its error)."""
    if "error" in result:
        return f"error: {result['error']}"
    cells = " ".join(f"@{pos} {c['p50']:.2f}/{c['p99']:.2f}" if "p50" in c else f"@{pos} {c.get('error')}"
                     for pos, c in result["latency"].items())
    return f"{cells} ms; prefill {result['prefill_tok_s']:,.0f} tok/s; peak RSS {result['peak_rss_mib']} MiB"


def merged(results: list[dict]) -> dict:
    """One cell from several rounds: per position the median of the rounds' p50s and of their p99s, the median
    prefill rate, the largest peak RSS; the first round's greedy tokens. A cell that failed in every round keeps
    the first error."""
    ok = [r for r in results if "error" not in r]
    if len(ok) <= 1:
        return ok[0] if ok else results[0]
    latency = {}
    for pos in ok[0]["latency"]:
        cells = [r["latency"].get(pos, {}) for r in ok]
        if all("p50" in c for c in cells):
            latency[pos] = {q: float(np.median([c[q] for c in cells])) for q in ("p50", "p99")}
        else:
            latency[pos] = next(c for c in cells if "p50" not in c)
    resident = {k: float(np.median([r["resident_mib"][k] for r in ok])) for k in ok[0].get("resident_mib", {})
                if all(k in r.get("resident_mib", {}) for r in ok)}
    return {**ok[0], "latency": latency, "prefill_tok_s": float(np.median([r["prefill_tok_s"] for r in ok])),
            "peak_rss_mib": max(r["peak_rss_mib"] for r in ok), "resident_mib": resident, "rounds": len(ok)}


def run_worker(py: str, spec: dict, env: dict, timeout: float) -> dict:
    """One timed worker process: its PEERS-RESULT, or {"error": why} (with "signal" when a signal killed it)."""
    try:
        proc = subprocess.run([py, str(Path(__file__).resolve()), "--worker", json.dumps(spec)], env=env,
                              capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:g} s"}
    out = [ln for ln in proc.stdout.splitlines() if ln.startswith("PEERS-RESULT ")]
    if out:
        return json.loads(out[-1][13:])
    if proc.returncode < 0:
        return {"error": f"killed by {signal.Signals(-proc.returncode).name}", "signal": -proc.returncode}
    return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]}


def plot(report: dict, path: Path) -> None:
    """Decode latency (p50, ms per token) vs context position, one panel per thread count: edgelin's rows
    solid and coloured, the peers dashed, so the comparison reads at a glance."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    rows = [r for r in report["rows"] if r["runs"]]
    threads = sorted({t for r in rows for t in r["runs"]}, key=int)
    fig, axes = plt.subplots(1, len(threads), figsize=(6.2 * len(threads), 4.4), squeeze=False, sharey=True)
    for ax, count in zip(axes[0], threads):
        for i, row in enumerate(rows):
            latency = (row["runs"].get(count) or {}).get("latency", {})
            points = sorted((int(p), v["p50"]) for p, v in latency.items() if "p50" in v)
            if not points:
                continue
            mine = row["runtime"].startswith("edgelin")
            ax.plot(*zip(*points), label=row["runtime"], marker="o" if mine else "s", linestyle="-" if mine else "--",
                    linewidth=2.2 if mine else 1.4, color=f"C{i % 10}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context position (tokens)")
        ax.set_title(f"{count} thread(s)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("decode ms per token (p50)")
    axes[0][-1].legend(fontsize=8, loc="upper left")
    fig.suptitle(f"{Path(report['checkpoint']).name}: decode latency vs position (bench/peers.py)", fontweight="bold")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _agreement(ref: list[int] | None, toks: list[int] | None) -> str:
    if not ref or not toks:
        return "—"
    same = sum(a == b for a, b in zip(ref, toks))
    first = next((i for i, (a, b) in enumerate(zip(ref, toks)) if a != b), len(ref))
    return f"{same}/{len(ref)}" + ("" if first == len(ref) else f" (first diff @{first})")


def render(report: dict) -> str:
    """Markdown: one table per thread count, then edgelin/peer ratios at the same weight precision."""
    rows, lines = report["rows"], []
    ref_row = next((r for r in rows if r["runtime"] == "transformers-fp32" and r["runs"]), None)
    for threads in sorted({t for r in rows for t in r["runs"]}):
        ref = ((ref_row or {}).get("runs", {}).get(threads) or {}).get("greedy")
        positions = sorted({int(p) for r in rows for run in r["runs"].values() for p in run.get("latency", {})})
        lines += [f"\n**{threads} thread(s)** (decode ms per token p50 / p99)\n",
                  "| runtime | disk MiB | peak RSS MiB | resident at the end: anon / model / runtime / other MiB | "
                  "prefill tok/s | " + " | ".join(f"@{p}" for p in positions) + " | greedy agreement |",
                  "|---" * (6 + len(positions)) + "|"]
        for r in rows:
            run = r["runs"].get(threads)
            if run is None or "error" in run:
                why = r["error"] or (run or {}).get("error", "")
                lines.append(f"| {r['runtime']} | — | — | — | — | " + " | ".join("—" for _ in positions)
                             + f" | cannot run: {why} |")
                continue
            cells = []
            for p in positions:
                lat = run["latency"].get(str(p))
                cells.append("not reached" if lat is None
                             else lat.get("error") or f"{lat['p50']:.2f} / {lat['p99']:.2f}")
            mark = " (*)" if run.get("note") else ""
            split = run.get("resident_mib") or {}
            resident = " / ".join(f"{split[k]:.1f}" for k in RESIDENT_PARTS) if len(split) == len(RESIDENT_PARTS) \
                else "—"
            lines.append(f"| {r['runtime']}{mark} | {r['bytes_on_disk'] / 2**20:.1f} | {run['peak_rss_mib']:.0f} | "
                         f"{resident} | {run['prefill_tok_s']:,.0f} | " + " | ".join(cells)
                         + f" | {_agreement(ref, run['greedy'])} |")
        notes = sorted({run["note"] for r in rows if (run := r["runs"].get(threads)) and run.get("note")})
        lines += [f"\n(*) {note}" for note in notes]
        lines += ratios(rows, threads, positions)
    return "\n".join(lines)


def _spread(paired: list[tuple[dict, dict]], pos: str) -> str:
    """" (lo-hi)": the range of one cell's ratio over the rounds, each round's edgelin p50 over its peer's p50 of
    the same round (timed minutes apart); empty with one round."""
    each = [x["latency"][pos]["p50"] / y["latency"][pos]["p50"] for x, y in paired
            if "p50" in x.get("latency", {}).get(pos, {}) and "p50" in y.get("latency", {}).get(pos, {})]
    return f" ({min(each):.2f}-{max(each):.2f})" if len(each) > 1 else ""


def ratios(rows: list[dict], threads: str, positions: list[int]) -> list[str]:
    """edgelin / peer for every cell, same weight precision (transformers counts as fp32)."""
    def prec(kind: str) -> str:
        return "fp32" if kind.startswith(("transformers", "executorch")) else PRECISION[kind.split("-")[1]]

    ok = [r for r in rows if r["runs"].get(threads) and "error" not in r["runs"][threads]]
    out = ["", f"edgelin / peer, {threads} thread(s), same weight precision (latency and RSS: < 1 is edgelin "
                f"ahead; prefill: > 1 is edgelin ahead)", "",
           "| edgelin | peer | disk | peak RSS | prefill | " + " | ".join(f"@{p}" for p in positions) + " |",
           "|---" * (5 + len(positions)) + "|"]
    for e in (r for r in ok if r["runtime"].startswith("edgelin")):
        for p in (r for r in ok if not r["runtime"].startswith("edgelin") and prec(r["runtime"]) == prec(e["runtime"])):
            a, b = e["runs"][threads], p["runs"][threads]
            cells = []
            paired = list(zip(e.get("rounds", {}).get(threads, []), p.get("rounds", {}).get(threads, [])))
            for pos in positions:
                la, lb = a["latency"].get(str(pos), {}), b["latency"].get(str(pos), {})
                cells.append(f"{la['p50'] / lb['p50']:.2f}{_spread(paired, str(pos))}" if "p50" in la and "p50" in lb
                             else "—")
            out.append(f"| {e['runtime']} | {p['runtime']} | {e['bytes_on_disk'] / p['bytes_on_disk']:.2f} | "
                       f"{a['peak_rss_mib'] / b['peak_rss_mib']:.2f} | {a['prefill_tok_s'] / b['prefill_tok_s']:.2f} | "
                       + " | ".join(cells) + " |")
    return out


if __name__ == "__main__":
    main()
