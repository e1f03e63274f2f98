"""`export --serve triton|triton-native`: the Triton Inference Server repositories, checked against Triton's own
config schema (tritonclient's ModelConfig); the native one's model.onnx run through ONNX Runtime (no server here
has its backend). The Python-backend repository runs on a real server in test_triton_server.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgelin.errors import EdgelinError
from edgelin.artifact.manifest import Manifest
from edgelin.export.pipeline import export_checkpoint
from helpers import TOKENIZER_VOCAB, make_checkpoint

pytest.importorskip("tritonclient.grpc.model_config_pb2", reason="tritonclient[grpc] (the dev extra) is not installed")

ROOT = Path(__file__).resolve().parents[2]
TYPES = {"float32": "TYPE_FP32", "int64": "TYPE_INT64"}  # Triton's names, written out here, not read from edgelin


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("serve")
    # linear + sliding-window softmax
    ckpt = make_checkpoint(root / "tiny-hybrid", "hybrid", tokenizer=False, vocab_size=TOKENIZER_VOCAB)
    return export_checkpoint(ckpt, root / "out", serve="triton-native").folder


def parse(path: Path):
    from google.protobuf import text_format
    from tritonclient.grpc.model_config_pb2 import DataType, ModelConfig, ModelInput, ModelSequenceBatching

    config = text_format.Parse(path.read_text(), ModelConfig())
    return config, DataType, ModelInput, ModelSequenceBatching


@pytest.mark.slow  # the module's export: ~80 s on a busy 2-core machine (once per module)
def test_config_feeds_back_what_the_manifest_and_graph_say(served: Path) -> None:
    import onnx

    manifest = Manifest.load(served)
    config, DataType, _, Seq = parse(served / "triton" / "tiny-hybrid" / "config.pbtxt")
    assert (config.name, config.backend, config.max_batch_size) == ("tiny-hybrid", "onnxruntime", 8)
    graph = onnx.load(str(served / "triton" / "tiny-hybrid" / "1" / "model.onnx"), load_external_data=False).graph
    dims = lambda vi: [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]  # noqa: E731
    g_in, g_out = {i.name: i for i in graph.input}, {o.name: o for o in graph.output}

    # every past_key_values.* input is a state fed back from its present.* output, zero at START, and the
    # position (the hybrid's softmax layer needs one) is a state too
    want = [(s["input"], s["output"], TYPES[s["dtype"]], s["dims"][1:]) for s in manifest.to_dict()["state"]]
    assert manifest.needs_position and len(want) == 5  # GDN: recurrent + conv; softmax: key + value; GLA: recurrent
    want.append(("past_position", "present.position", "TYPE_INT64", [1]))
    states = config.sequence_batching.state
    assert [(s.input_name, s.output_name, DataType.Name(s.data_type), list(s.dims)) for s in states] == want
    for s in states:
        (init,) = s.initial_state
        assert init.zero_data and list(init.dims) == list(s.dims) and init.data_type == s.data_type
        assert s.input_name in g_in and s.output_name in g_out  # the graph has both ends, batch first
        assert dims(g_in[s.input_name]) == dims(g_out[s.output_name]) == ["batch", *s.dims]
    assert "position_ids" not in g_in  # fed from the state inside the graph

    controls = {c.name: Seq.Control.Kind.Name(c.control[0].kind) for c in config.sequence_batching.control_input}
    assert controls == {"START": "CONTROL_SEQUENCE_START", "READY": "CONTROL_SEQUENCE_READY",
                        "CORRID": "CONTROL_SEQUENCE_CORRID"}
    for name in controls:  # Triton's ONNX backend wants each control input shaped [batch, 1]
        assert dims(g_in[name]) == ["batch", 1]
    # the backend's count: config inputs + controls + states == the model's inputs
    assert len(config.input) + len(controls) + len(states) == len(graph.input)
    (ids,) = config.input
    assert (ids.name, DataType.Name(ids.data_type), list(ids.dims), list(ids.reshape.shape)) == \
        ("input_ids", "TYPE_INT64", [1], [])
    (logits,) = config.output
    assert (logits.name, list(logits.dims)) == ("logits", [manifest.vocab_size])
    oldest = config.sequence_batching.oldest
    assert (oldest.max_candidate_sequences, list(oldest.preferred_batch_size)) == (64, [4, 8])


def test_serving_graph_steps_like_step_onnx(served: Path) -> None:
    import onnxruntime as ort

    manifest = Manifest.load(served)
    version = served / "triton" / "tiny-hybrid" / "1"
    weights = served / "weights.bin"
    assert (version / "weights.bin").stat().st_ino == weights.stat().st_ino  # a hard link, not a second copy
    assert "triton/tiny-hybrid/config.pbtxt" in manifest.files and manifest.extra["serve"]["triton"]["model"] == \
        "tiny-hybrid"
    rng = np.random.default_rng(0)
    state = {k: rng.standard_normal(v.shape).astype(v.dtype) * 0.1 for k, v in manifest.initial_state(2).items()}
    ids = np.array([5, 9], np.int64)
    step = ort.InferenceSession(str(served / "step.onnx"))
    serve = ort.InferenceSession(str(version / "model.onnx"))
    names = [o.name for o in serve.get_outputs()]
    # row 0 continues at position 3; row 1 starts a sequence (START=1: position 0 whatever the state said)
    got = dict(zip(names, serve.run(None, {"input_ids": ids, **state, "past_position": np.array([[3], [7]]),
                                           "START": np.array([[0], [1]], np.int32),
                                           "READY": np.array([[1], [1]], np.int32),
                                           "CORRID": np.array([[11], [12]], np.uint64)})))
    want = dict(zip([o.name for o in step.get_outputs()],
                    step.run(None, {"input_ids": ids, "position_ids": np.array([3, 0]), **state})))
    np.testing.assert_array_equal(got["present.position"], [[4], [1]])
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_shipped_model_config_for_a_gpu_profile(tmp_path: Path) -> None:
    """The shipped model's repository config (from its checkpoint, no export) against the schema, with the
    desktop-gpu profile's [serving] limits."""
    from edgelin.checkpoint import load_model
    from edgelin.devices import get_device
    from edgelin.export.pipeline import build_manifest
    from edgelin.serve.triton import config_text

    model, _ = load_model(ROOT / "recipes" / "tiny-gdn-hybrid")
    manifest = build_manifest(model, "onnx", "fp32", {"step": "step.onnx", "prefill": "prefill.onnx"}, {}, None)
    gpu = get_device("desktop-gpu")
    (tmp_path / "config.pbtxt").write_text(config_text(manifest, "tiny-gdn-hybrid", gpu.serving, "onnxruntime", True))
    config, _, _, _ = parse(tmp_path / "config.pbtxt")
    assert config.max_batch_size == 32 and config.sequence_batching.oldest.max_candidate_sequences == 256
    assert [g.kind for g in config.instance_group] == [1]  # KIND_GPU
    inputs = [s.input_name for s in config.sequence_batching.state]
    assert inputs == [t.name for t in manifest.state_inputs] + ["past_position"]
    assert list(config.sequence_batching.state[0].dims) == [4, 64, 64]  # the shipped GDN layer's 4 heads of 64x64
    # a tensorrt export: platform tensorrt_plan (the user builds model.plan), and only the controls the graph
    # reads (TensorRT drops unread inputs, and Triton would then miss CORRID)
    trt = build_manifest(model, "tensorrt", "fp16", {"step": "step.onnx", "prefill": "prefill.onnx"}, {}, None)
    (tmp_path / "config.pbtxt").write_text(config_text(trt, "tiny-gdn-hybrid", gpu.serving, "tensorrt_plan", True))
    config, _, _, _ = parse(tmp_path / "config.pbtxt")
    assert (config.platform, config.backend, config.default_model_filename) == ("tensorrt_plan", "", "model.plan")
    assert [c.name for c in config.sequence_batching.control_input] == ["START", "READY"]


def test_growing_state_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    from edgelin.model.config import AttentionConfig

    attention = AttentionConfig(num_heads=2, num_kv_heads=1, head_dim=16, window=None)  # a full KV cache
    ckpt = make_checkpoint(tmp_path / "full", "hybrid", tokenizer=False, attention=attention)
    with pytest.raises(EdgelinError, match=r"--serve triton-native: state past_key_values\.1\.key has dims "
                                           r".*past_sequence.* grows with the context"):
        export_checkpoint(ckpt, tmp_path / "out", serve="triton-native")
    assert not (tmp_path / "out").exists()


def test_the_python_backend_repository_serves_a_growing_cache(tmp_path: Path) -> None:
    """--serve triton takes the hybrid the native flavour refuses: a Python-backend config (parsed with Triton's
    schema) whose limits are the device profile's, and a model.py that only imports edgelin's model."""
    from edgelin.devices import get_device
    from edgelin.model.config import AttentionConfig

    attention = AttentionConfig(num_heads=2, num_kv_heads=1, head_dim=16, window=None)
    ckpt = make_checkpoint(tmp_path / "full", "hybrid", tokenizer=False, attention=attention)
    folder = export_checkpoint(ckpt, tmp_path / "out", device=get_device("desktop-cpu"), serve="triton").folder
    config, DataType, _, _ = parse(folder / "triton" / "full" / "config.pbtxt")
    assert (config.backend, config.max_batch_size) == ("python", 8)
    assert [(i.name, i.data_type, list(i.dims)) for i in config.input] == [("input_ids", DataType.TYPE_INT64, [-1])]
    assert [(o.name, o.data_type, list(o.dims)) for o in config.output] == [
        ("logits", DataType.TYPE_FP32, [Manifest.load(folder).vocab_size]), ("next_token", DataType.TYPE_INT64, [1])]
    batching = config.sequence_batching
    assert [c.name for c in batching.control_input] == ["START", "END", "CORRID"] and not batching.state
    assert (batching.oldest.max_candidate_sequences, list(batching.oldest.preferred_batch_size)) == (32, [4, 8])
    assert config.parameters["device"].string_value == "desktop-cpu"
    source = (folder / "triton" / "full" / "1" / "model.py").read_text()
    assert [line for line in source.splitlines() if not line.startswith("#")] == [
        "from edgelin.serve.python_model import TritonPythonModel  # noqa: F401"]
    assert "triton/full/1/model.py" in Manifest.load(folder).sha256  # verified when the server opens the folder


def test_bad_serving_table_is_refused() -> None:
    from edgelin.devices import DeviceProfile

    base = {"title": "t", "kind": "server", "targets": ["onnx"], "compute": "cpu", "precision": "fp32",
            "state_dtype": "float32", "memory_gib": 4}
    with pytest.raises(EdgelinError, match="preferred_batch_sizes .16. must ascend, without repeats, up to "
                                           "max_batch_size"):
        DeviceProfile.from_dict("x", {**base, "serving": {"max_batch_size": 8, "preferred_batch_sizes": [16]}}, "x")
    with pytest.raises(EdgelinError, match="unknown key 'max_batch'"):
        DeviceProfile.from_dict("x", {**base, "serving": {"max_batch": 8}}, "x")
    ok = DeviceProfile.from_dict("x", {**base, "serving": {"max_batch_size": 2, "preferred_batch_sizes": [1, 2]}}, "x")
    assert (ok.serving.max_batch_size, ok.serving.preferred_batch_sizes, ok.serving.max_candidate_sequences) == \
        (2, (1, 2), 64)


# ---- config.pbtxt parsed with Triton's schema before the export reports it written ---------------------------
def _manifest(name: str = "tiny") -> Manifest:
    from conftest import family_layers, tiny_config
    from edgelin.export.pipeline import build_manifest
    from edgelin.model.lm import CausalLM

    model = CausalLM(tiny_config(family_layers("hybrid")))
    return build_manifest(model, "onnx", "fp32", {"step": "step.onnx", "prefill": "prefill.onnx"},
                          {"path": f"/checkpoints/{name}"}, None)


def _unparsable_device():
    """A profile whose [serving] values Triton's parser rejects (max_batch_size is an int32), built directly: past
    the checks a profile file gets when it is read (tests/devices/test_devices.py), as a check that missed a field would."""
    from dataclasses import replace

    from edgelin.devices import ServingLimits, get_device

    too_large = ServingLimits(max_batch_size=2**32, max_candidate_sequences=2**32)
    return replace(get_device("desktop-cpu"), serving=too_large)


@pytest.mark.parametrize("serve", ["triton", "triton-native"])
def test_a_config_triton_rejects_is_refused_before_anything_is_written(tmp_path: Path, monkeypatch, serve) -> None:
    from edgelin.export.onnx.target import OnnxTarget

    def traced(*args, **kwargs):
        raise AssertionError("the export traced the graphs: its config.pbtxt was not checked first")

    monkeypatch.setattr(OnnxTarget, "export", traced)
    ckpt = make_checkpoint(tmp_path / "tiny", "hybrid", tokenizer=False)
    with pytest.raises(EdgelinError) as caught:
        export_checkpoint(ckpt, tmp_path / "out", device=_unparsable_device(), serve=serve)
    assert caught.value.line().startswith("triton/tiny/config.pbtxt would not load in Triton: Triton's ModelConfig "
                                          "parser rejects it: ") and "max_batch_size" in caught.value.line()
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("serve", ["triton", "triton-native"])
def test_the_written_config_is_parsed_back(tmp_path: Path, serve: str) -> None:
    from edgelin.serve.triton import write_repository

    with pytest.raises(EdgelinError, match="triton/tiny/config.pbtxt would not load in Triton"):
        write_repository(tmp_path, _manifest(), _unparsable_device(), serve)  # (the pipeline's temp folder goes with it)


def test_without_tritonclient_the_config_check_is_a_warning(monkeypatch) -> None:
    import sys

    from edgelin.serve.triton import check_config

    assert check_config(_manifest(), None, "triton") is None  # parsed: nothing to say
    assert check_config(_manifest(), None, "triton-native") is None
    monkeypatch.setitem(sys.modules, "tritonclient.grpc.model_config_pb2", None)  # as if not installed
    assert check_config(_manifest(), _unparsable_device(), "triton") == (
        "tritonclient is not installed, so triton/tiny/config.pbtxt was not parsed with Triton's schema (pip install "
        "'edgelin[serve]' to have export check it)")
