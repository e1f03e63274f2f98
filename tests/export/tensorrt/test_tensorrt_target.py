"""The tensorrt target's export phase: step.onnx with one edgelin::EdgelinStep plugin node per
linear layer (attributes as TensorRT's ONNX parser reads them) and an ONNX function per node kind,
so ONNX Runtime runs the same file (replay, validate); --trt-inplace; fp16 plugin nodes; and the
TensorRT runner's bookkeeping against the TensorRT stand-in (tests/trt_standin.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from typer.testing import CliRunner

import trt_standin
from edgelin.cli import app
from edgelin.errors import EdgelinError
from edgelin.export.pipeline import export_checkpoint
from edgelin.export.targets import get_target
from edgelin.export.tensorrt.target import TensorrtOptions
from helpers import assert_close, make_checkpoint

FIELDS = ("gate", "delta", "heads", "d_k", "d_v", "dtype", "aux_dtype", "inplace")  # the plugin creator's


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("trt")
    ckpt = make_checkpoint(root / "ckpt", "hybrid")  # gated_deltanet, softmax, gla
    # --trt-inplace: the same ONNX math as without it (ORT ignores the attribute); the runner tests
    # below build it both with and without aliasing, so one export serves both
    return ckpt, export_checkpoint(ckpt, root / "out", "tensorrt", options=TensorrtOptions(inplace=True)).folder


def plugin_nodes(path: Path) -> list[onnx.NodeProto]:
    return [n for n in onnx.load(str(path)).graph.node if n.op_type == "EdgelinStep"]


def test_step_has_one_plugin_node_per_linear_layer(exported):
    _, folder = exported
    nodes = plugin_nodes(folder / "step.onnx")
    assert len(nodes) == 2  # two linear layers; the softmax layer has none
    assert all(n.domain == "edgelin" for n in nodes)
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in nodes]
    types = [{a.name: a.type for a in n.attribute} for n in nodes]
    for a, t in zip(attrs, types):
        assert all(t[f] == onnx.AttributeProto.INT for f in FIELDS)
        assert a["plugin_version"] == b"1" and a["plugin_namespace"] == b""
        assert (a["heads"], a["d_k"], a["d_v"], a["dtype"], a["aux_dtype"], a["inplace"]) == (2, 8, 8, 0, 0, 1)
    # gated_deltanet: scalar gate + delta rule (q, k, v, g, beta, state); gla: per-key gate (q, k, v, g, state)
    assert (attrs[0]["gate"], attrs[0]["delta"], len(nodes[0].input)) == (1, 1, 6)
    assert (attrs[1]["gate"], attrs[1]["delta"], len(nodes[1].input)) == (2, 0, 5)
    assert nodes[0].input[-1] == "past_key_values.0.recurrent_state"
    assert nodes[1].input[-1] == "past_key_values.2.recurrent_state"
    assert not plugin_nodes(folder / "prefill.onnx")  # prefill stays in standard ops


def test_every_plugin_node_has_its_function(exported):
    _, folder = exported
    model = onnx.load(str(folder / "step.onnx"))
    functions = {(f.domain, f.name, f.overload): f for f in model.functions}
    for node in plugin_nodes(folder / "step.onnx"):
        function = functions[("edgelin", "EdgelinStep", node.overload)]
        assert len(function.input) == len(node.input) and len(function.output) == 2
        assert {n.domain for n in function.node} == {""}  # standard ops only
    assert {o.domain: o.version for o in model.opset_import}["edgelin"] == 1
    onnx.checker.check_model(model, full_check=True)


def test_onnxruntime_runs_the_plugin_file_and_replay_passes(exported):
    from edgelin.replay import replay
    from edgelin.runtime import open_runner

    _, folder = exported
    runner = open_runner(folder)
    state = runner.new_state(2)
    logits = runner.step(np.array([3, 5]), state, np.array([0, 0]))
    assert logits.shape == (2, runner.manifest.vocab_size) and np.isfinite(logits).all()
    assert np.abs(runner.read_state(state)["past_key_values.0.recurrent_state"]).max() > 0  # the node ran
    report = replay(folder, rtol=1e-5)
    assert report.passed, [m for m in report.metrics if not m.passed]


def test_validate_against_the_reference(exported):
    from edgelin.validate import validate

    _, folder = exported
    report = validate(folder, steps=20, prompt_len=9, batch=3)
    assert report.passed, [m for m in report.metrics if not m.passed]
    assert report.target == "tensorrt"


def test_build_phase_needs_nvcc_and_cmake_only():
    import shutil

    phase = get_target("tensorrt").can_build()
    assert phase is not None
    if shutil.which("cmake") and shutil.which("nvcc"):  # the plugin library builds here (engines: tensorrt_build)
        assert phase.ok
    else:
        assert not phase.ok and "TensorRT 10.3+" in phase.where


@pytest.mark.slow
def test_cli_export_for_jetson_orin_takes_its_fp16(exported, tmp_path):
    """The issue's command: the profile's fp16 exports (weights and matmuls fp16, recurrence and state
    fp32) and validates through the plugin functions on ONNX Runtime, which the CLI names."""
    ckpt, _ = exported
    cli = CliRunner()
    out = tmp_path / "orin"
    result = cli.invoke(app, ["export", str(ckpt), "--target", "tensorrt", "--device", "jetson-orin",
                              "--out", str(out)])
    assert result.exit_code == 0, result.output
    nodes = plugin_nodes(out / "step.onnx")
    assert len(nodes) == 2
    step = onnx.load(str(out / "step.onnx"), load_external_data=False)
    producers = {o: n.op_type for n in step.graph.node for o in n.output}
    types = {v.name: v.type.tensor_type.elem_type for v in [*step.graph.value_info, *step.graph.input]}
    for node in nodes:  # without --trt-inplace: out of place; q/k/v enter in fp16, g and beta in fp32
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert (attrs["dtype"], attrs["aux_dtype"], attrs["inplace"]) == (1, 0, 0)
        assert node.overload.endswith("_f16")
        for name in node.input[:3]:  # the plugin reads the fp16 tensors themselves, no Cast to fp32 before it
            assert producers.get(name) != "Cast" and types[name] == onnx.TensorProto.FLOAT16
        assert [types[name] for name in node.input[3:]] == [onnx.TensorProto.FLOAT] * (len(node.input) - 3)  # g, beta, state
    assert not plugin_nodes(out / "prefill.onnx")  # prefill: standard ops, the fp32 recurrence of the onnx target
    assert json.loads((out / "manifest.json").read_text())["precision"] == "fp16"
    checked = cli.invoke(app, ["validate", str(out)])
    assert checked.exit_code == 0, checked.output
    assert ("runner: onnxruntime (plugin functions); TensorRT engines not used: no engines are built"
            in checked.output.replace("\n", " "))
    from edgelin.replay import replay

    report = replay(out)  # the fp16 precision's bounds, at both recorded batch sizes
    assert report.passed and report.batches == [1, 3], [m for m in report.metrics if not m.passed]
    # The engine keeps the graph's own fp16/fp32 types: built strongly typed, never with a blanket --fp16.
    assert "STRONGLY_TYPED = True" in (out / "tensorrt" / "build_engine.py").read_text()
    commands = (out / "tensorrt" / "COMMANDS.md").read_text()
    trtexec = [line for line in commands.splitlines() if line.startswith("trtexec ")]
    assert len(trtexec) == 2 and all(line.endswith("--stronglyTyped") for line in trtexec), trtexec
    assert " --fp16" not in commands
    quantized = cli.invoke(app, ["export", str(ckpt), "--target", "tensorrt", "--quantize", "int8",
                                 "--out", str(tmp_path / "q")])
    assert quantized.exit_code == 2 and "--quantize int8 for the tensorrt target" in quantized.output
    assert not (tmp_path / "q").exists()


def test_cli_trt_inplace_reaches_the_export(exported, tmp_path, monkeypatch):
    ckpt, _ = exported
    seen = {}

    def fake_export(*args, **kwargs):  # stops the CLI at the export call: the flag's journey is what is tested
        seen["options"] = kwargs.get("options")
        raise EdgelinError("stopped", "test", "none")

    monkeypatch.setattr("edgelin.export.pipeline.export_checkpoint", fake_export)
    cli = CliRunner()
    cli.invoke(app, ["export", str(ckpt), "--target", "tensorrt", "--trt-inplace", "--out", str(tmp_path / "a")])
    assert seen["options"] == TensorrtOptions(inplace=True)
    refused = cli.invoke(app, ["export", str(ckpt), "--target", "onnx", "--trt-inplace", "--out", str(tmp_path / "b")])
    assert refused.exit_code == 2 and "--trt-inplace applies to --target tensorrt only" in refused.output


def test_inplace_export_marks_aliasing_for_the_builder(exported):
    _, folder = exported
    spec = json.loads((folder / "tensorrt" / "engines.json").read_text())
    assert spec["inplace"] is True
    assert spec["graphs"]["step"]["aliased"] == {"past_key_values.0.recurrent_state": "present.0.recurrent_state",
                                                 "past_key_values.2.recurrent_state": "present.2.recurrent_state"}
    assert spec["graphs"]["prefill"]["aliased"] == {}  # standard ops: nothing to alias
    # narrowest profile first: a batch-1 step; prompts up to 128, then the full range
    assert [p["input_ids"] for p in spec["graphs"]["step"]["profiles"]] == [[[1], [1], [1]], [[1], [1], [8]]]
    assert [p["input_ids"] for p in spec["graphs"]["prefill"]["profiles"]] == [[[1, 1], [1, 16], [8, 128]],
                                                                              [[1, 1], [1, 128], [8, 2048]]]
    assert "INPLACE = True" in (folder / "tensorrt" / "build_engine.py").read_text()
    lines = (folder / "tensorrt" / "COMMANDS.md").read_text().splitlines()
    step = [ln for ln in lines if ln.startswith("trtexec --onnx=step.onnx")]
    prefill = [ln for ln in lines if ln.startswith("trtexec --onnx=prefill.onnx")]
    assert step[0].endswith(" --preview=+aliasedPluginIO1003") and "--preview" not in prefill[0]


def test_both_graphs_share_one_weights_file_the_engine_path_finds(exported, tmp_path, monkeypatch):
    """step.onnx (rewritten with the plugin functions after the weights moved out) and prefill.onnx read
    the same weights.bin; every reference is a bare file name beside the graphs, which is where
    TensorRT's parser (build_engine.py parses from the path), trtexec and polygraphy look for it."""
    import shutil

    _, folder = exported
    sizes = {}
    for graph in ("step.onnx", "prefill.onnx"):
        proto = onnx.load(str(folder / graph), load_external_data=False)
        external = [t for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
        inside = [t for t in proto.graph.initializer if len(t.raw_data) >= 1024]
        assert external and not inside, graph  # the matrices live in weights.bin only
        assert {e.value for t in external for e in t.external_data if e.key == "location"} == {"weights.bin"}
        sizes[graph] = sum(int(next(e.value for e in t.external_data if e.key == "length")) for t in external)
    weights = json.loads((folder / "manifest.json").read_text())["extra"]["weights"]
    assert weights["file"] == "weights.bin" and weights["bytes"] == (folder / "weights.bin").stat().st_size
    assert weights["read_by"]["step.onnx"] == weights["read_by"]["prefill.onnx"] == weights["shared_tensors"] > 0
    assert sizes["step.onnx"] == sizes["prefill.onnx"] <= weights["bytes"]
    spec = json.loads((folder / "tensorrt" / "engines.json").read_text())
    assert {g["weights"] for g in spec["graphs"].values()} == {"weights.bin"}
    commands = (folder / "tensorrt" / "COMMANDS.md").read_text()
    assert "read their weights from `weights.bin` beside them" in commands and "trtexec --onnx=step.onnx" in commands
    script = (folder / "tensorrt" / "build_engine.py").read_text()
    assert "parser.parse_from_file(os.path.join(folder, spec[\"file\"]))" in script
    # a folder copied without its weights: build_engine.py says so before TensorRT parses anything
    trt_standin.install(monkeypatch)
    broken = tmp_path / "no-weights"
    shutil.copytree(folder, broken)
    (broken / "weights.bin").unlink()
    with pytest.raises(SystemExit, match="weights.bin is missing from .*step.onnx reads its weights from it"):
        trt_standin.build_with_standin(broken)
    assert not (broken / "step.engine").exists()


# ---- fp16 plugin nodes ---------------------------------------------------------------------------
def _reference_step(state, q, k, v, g, beta):
    """The recurrence in float64 numpy, written out here (not edgelin's code)."""
    s = state * np.exp(g)[..., None]
    if beta is not None:
        v = beta[..., None] * (v - np.einsum("bhk,bhkv->bhv", k, s))
    s = s + k[..., None] * v[..., None, :]
    return np.einsum("bhk,bhkv->bhv", q, s), s


def test_fp16_plugin_nodes_cast_around_an_fp32_recurrence(tmp_path):
    """A hand-built module under lowering("tensorrt"): fp16 q/k/v give plugin nodes with dtype=1 and
    aux_dtype=0 (g and beta cast to fp32, even when they come in fp16), whose functions run in ORT."""
    import onnxruntime as ort
    import torch

    from edgelin.export.lowering import lowering
    from edgelin.export.tensorrt.target import add_step_functions

    class TwoSteps(torch.nn.Module):
        def __init__(self, engine):
            super().__init__()
            self.engine = engine

        def forward(self, q, k, v, g, beta, state, g2, state2):
            o1, s1 = self.engine.step(state, q, k, v, g, beta)  # scalar gate, delta rule
            o2, s2 = self.engine.step(state2, q, k, v, g2, None)  # per-key gate in fp16
            return o1, s1, o2, s2

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, d, generator=gen).half() for d in (8, 8, 4))
    args = (q, k, v, -torch.rand(2, 2, 1, generator=gen), torch.rand(2, 2, generator=gen).half(),
            torch.randn(2, 2, 8, 4, generator=gen), -torch.rand(2, 2, 8, generator=gen).half(),
            torch.randn(2, 2, 8, 4, generator=gen))
    names = ["q", "k", "v", "g", "beta", "state", "g2", "state2"]
    path = tmp_path / "fp16.onnx"
    with lowering("tensorrt") as entry:
        module = TwoSteps(entry.engine).eval()
        eager = module(*args)
        torch.onnx.export(module, args, str(path), dynamo=True, opset_version=18, input_names=names,
                          output_names=["o1", "s1", "o2", "s2"], external_data=False)
    add_step_functions(path, 18)
    nodes = plugin_nodes(path)
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in nodes]
    assert [(a["gate"], a["delta"], a["dtype"], a["aux_dtype"]) for a in attrs] == [(1, 1, 1, 0), (2, 0, 1, 0)]
    assert [n.overload for n in nodes] == ["gate1_delta1_f16", "gate2_delta0_f16"]
    assert list(nodes[0].input[:3]) == ["q", "k", "v"]  # the plugin reads the fp16 tensors themselves
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
        None, {n: a.numpy() for n, a in zip(names, args)})
    assert [o.dtype for o in got] == [np.float16, np.float32, np.float16, np.float32]
    f = [a.double().numpy() for a in args]
    want = [*_reference_step(f[5], f[0], f[1], f[2], f[3], f[4]), *_reference_step(f[7], f[0], f[1], f[2], f[6], None)]
    for out, ref, rtol, what in zip(got, want, (2e-3, 1e-6, 2e-3, 1e-6), ("o1", "s1", "o2", "s2")):
        assert_close(out, ref, rtol, f"onnxruntime {what}")  # fp16 o: one rounding; state: fp32 throughout
    for out, ref, rtol, what in zip(eager, want, (2e-3, 1e-6, 2e-3, 1e-6), ("o1", "s1", "o2", "s2")):
        assert_close(out, ref, rtol, f"eager {what}")
    assert eager[0].dtype == torch.float16 and eager[1].dtype == torch.float32


# ---- the TensorRT runner, on the stand-in ---------------------------------------------------------
ALIASED = [True, False, False, False, True]  # recurrent states of layers 0 and 2; conv and KV caches ping-pong


@pytest.fixture(params=["ping-pong", "in-place"])
def built(request, exported, tmp_path, monkeypatch):
    """A copy of the export with engines built by its own build_engine.py against the stand-in:
    `ping-pong` as build_engine.py --no-inplace, `in-place` with the aliasing the export asked for."""
    import shutil

    counters = trt_standin.install(monkeypatch)
    folder = tmp_path / "built"
    shutil.copytree(exported[1], folder)
    trt_standin.build_with_standin(folder, inplace=request.param == "in-place")
    return folder, counters, request.param


def test_trt_runner_replays_the_reference_vectors(built):
    from edgelin.export.tensorrt.runner import TensorrtRunner
    from edgelin.replay import replay
    from edgelin.runtime import open_runner

    folder, counters, mode = built
    runner = open_runner(folder)
    assert isinstance(runner, TensorrtRunner)
    assert runner.aliased == (ALIASED if mode == "in-place" else [False] * 5)
    in_place = "state updated in place; " if mode == "in-place" else ""
    assert runner.label == f"tensorrt engine ({in_place}CUDA graph for batch-1 steps)"
    report = replay(folder, rtol=1e-5)  # prefill, rollout and prefill-vs-steps at batch 1 and 3
    assert report.passed, [m for m in report.metrics if not m.passed]
    assert report.batches == [1, 3]
    assert counters.captures > 0 and counters.launches > counters.executes  # batch-1 steps replay graphs


def test_trt_runner_state_bookkeeping(built):
    from edgelin.runtime import open_runner

    folder, counters, mode = built
    runner = open_runner(folder)
    state = runner.new_state(3)
    value = state._value
    assert [s is None for s in value.spare] == (ALIASED if mode == "in-place" else [False] * 5)
    ids, pos = np.array([3, 5, 7]), np.zeros(3, np.int64)
    start = len(counters.bindings)
    for t in range(2):
        runner.step(ids, state, pos + t)
    first, second = counters.bindings[start:start + 2]
    for i, (past, present) in enumerate(zip(runner.state_names, runner.present_names)):
        if mode == "in-place" and ALIASED[i]:  # one buffer, read and written by every step
            assert first[past] == first[present] == second[past] == second[present]
        else:  # ping-pong: the buffer written by one step is read by the next
            assert first[present] == second[past] and first[past] == second[present] != first[present]
    # read/write round trip, exactly
    rng = np.random.default_rng(0)
    written = {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in runner.read_state(state).items()}
    runner.write_state(state, written)
    back = runner.read_state(state)
    assert all(np.array_equal(back[k], written[k]) for k in written)
    # fork independence: stepping the fork leaves the original as it was, and both agree on the same token
    fork = runner.fork(state)
    logits_fork = runner.step(ids, fork, pos + 2)
    assert all(np.array_equal(runner.read_state(state)[k], written[k]) for k in written)
    logits = runner.step(ids, state, pos + 2)
    np.testing.assert_array_equal(logits, logits_fork)
    after, after_fork = runner.read_state(state), runner.read_state(fork)
    assert all(np.array_equal(after[k], after_fork[k]) for k in after)
    assert not np.array_equal(after["past_key_values.0.recurrent_state"], written["past_key_values.0.recurrent_state"])
    # handles: another runner's, another batch, a batch beyond the engines' profiles
    with pytest.raises(EdgelinError, match="belongs to another runner"):
        open_runner(folder).step(ids, state, pos)
    with pytest.raises(EdgelinError, match="holds batch 3 but the ids have batch 1"):
        runner.step(ids[:1], state, pos[:1])
    with pytest.raises(EdgelinError, match="batch 9 for the TensorRT engines"):
        runner.new_state(9)


def test_trt_runner_picks_a_profile_per_shape(built):
    from edgelin.export.onnx.runner import OnnxRunner
    from edgelin.runtime import open_runner

    folder, counters, _ = built
    runner = open_runner(folder)
    ids = np.random.default_rng(1).integers(0, runner.manifest.vocab_size, (2, 200))
    reference = OnnxRunner(folder, runner.manifest)  # ONNX Runtime on the same graphs: the values
    want = reference.prefill(ids, reference.new_state(2), np.zeros(2, np.int64))
    state = runner.new_state(2)
    runner.prefill(ids[:, :100], state, np.zeros(2, np.int64))  # 100 tokens: the short-prompt profile
    got = runner.prefill(ids[:, 100:], state, np.full(2, 100, np.int64))  # then 100 more, at position 100
    assert_close(got, want, 1e-5, "prefill in two pieces vs ONNX Runtime")
    runner.prefill(ids, runner.new_state(2), np.zeros(2, np.int64))  # 200 tokens: the full profile
    runner.step(ids[:1, 0], runner.new_state(1), np.zeros(1, np.int64))  # batch 1: its own profile (graph context)
    runner.step(ids[:, 0], runner.new_state(2), np.zeros(2, np.int64))
    assert counters.contexts == [("prefill.onnx", 0), ("prefill.onnx", 1), ("step.onnx", 0), ("step.onnx", 1)]


def test_trt_runner_steps_without_a_graph_when_capture_is_refused(built):
    from edgelin.replay import replay
    from edgelin.runtime import open_runner

    folder, counters, _ = built
    counters.refuse_capture = True  # as TensorRT does for engines it cannot capture
    runner = open_runner(folder)
    state = runner.new_state(1)
    for t in range(3):
        runner.step(np.array([t + 1]), state, np.array([t]))
    assert runner.graph_note == "TensorRT refused to enqueue during stream capture"
    assert runner.label.endswith("no CUDA graph: TensorRT refused to enqueue during stream capture)")
    assert counters.launches == 0
    assert replay(folder, rtol=1e-5).passed


def test_trt_runner_refuses_a_plugin_of_another_tensorrt_major(exported, tmp_path, monkeypatch):
    import shutil

    from edgelin.runtime import open_runner

    trt_standin.install(monkeypatch)  # TensorRT 10
    folder = tmp_path / "built"
    shutil.copytree(exported[1], folder)
    trt_standin.build_with_standin(folder, trt_major=11)
    with pytest.raises(EdgelinError, match="was built for TensorRT 11, not 10"):
        open_runner(folder)


def test_trt_runner_reads_only_its_own_file_names_from_build_json(exported, tmp_path, monkeypatch):
    """build.json is data: a plugin library or engine it names elsewhere (a path out of the folder) is never
    loaded; the runner takes tensorrt/libedgelin_trt_plugin_trt<major>.so and <graph>.engine only."""
    import shutil

    from edgelin.runtime import open_runner

    counters = trt_standin.install(monkeypatch)
    folder = tmp_path / "built"
    shutil.copytree(exported[1], folder)
    trt_standin.build_with_standin(folder)
    record_path = folder / "tensorrt" / "build.json"
    record = json.loads(record_path.read_text())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    planted = trt_standin.fake_plugin_library(elsewhere)  # passes check_library: only its place is wrong
    record_path.write_text(json.dumps({**record, "plugin": f"../../elsewhere/{planted.name}"}))
    with pytest.raises(EdgelinError, match="build.json names the plugin library '../../elsewhere/"):
        open_runner(folder)
    assert str(planted) not in [str(Path(p).resolve()) for p in counters.loaded]
    # an engine named outside the folder: not followed (the folder's own step.engine is gone)
    (folder / "step.engine").rename(elsewhere / "step.engine")
    record_path.write_text(json.dumps({**record, "engines": {**record["engines"], "step": "../elsewhere/step.engine"}}))
    runner = open_runner(folder)
    assert runner.label.endswith("TensorRT engines not used: the step engine is not built (edgelin build DIR)")


def test_cli_says_the_tensorrt_engine_ran(built):
    folder, _, _ = built
    result = CliRunner().invoke(app, ["validate", str(folder)])
    assert result.exit_code == 0, result.output
    assert "runner: tensorrt engine (" in result.output


# ---- Gated DeltaNet-2: the plugin node's erase input ------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp16"])
def test_gdn2_exports_with_the_erase_input_and_validates(precision, tmp_path):
    """`edgelin export --target tensorrt` of a Gated DeltaNet-2 checkpoint (gates moved off their init):
    one plugin node with erase=1 and the e input before the state, an overload whose function erases
    along e * k, and `edgelin validate` through ONNX Runtime passing (the plugin functions). fp16, the
    Jetson precision, only: fp32 (the overload without `_f16`) cost CI's 12-minute cap another 35 s."""
    import torch

    from conftest import tiny_config
    from edgelin.checkpoint import save_checkpoint
    from edgelin.model.lm import CausalLM

    model = CausalLM(tiny_config(("gated_deltanet2", "gated_deltanet2"))).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("erase_proj.weight", "write_proj.weight", "erase_bias", "write_bias")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    ckpt = save_checkpoint(model, tmp_path / "jittered")
    out = tmp_path / "trt"
    result = CliRunner().invoke(app, ["export", str(ckpt), "--target", "tensorrt", "--out", str(out),
                                      "--no-tokenizer", "--precision", precision])
    assert result.exit_code == 0, result.output
    nodes = plugin_nodes(out / "step.onnx")
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in nodes]
    suffix = "_f16" if precision == "fp16" else ""
    assert [(a["gate"], a["delta"], a["erase"]) for a in attrs] == [(1, 1, 1)] * len(nodes) and nodes
    assert all(n.overload == f"gate1_delta1_erase{suffix}" and len(n.input) == 7 for n in nodes)
    result = CliRunner().invoke(app, ["validate", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["passed"] is True


def test_trt_runner_loads_only_the_plugin_and_engines_edgelin_build_made(exported, tmp_path, monkeypatch):
    """The plugin library and the engines are code the runner loads: each is checked against the sha256 that
    `edgelin build` recorded in build.json before it is loaded. A library planted in their place (one that passes
    check_library's marker and exports), a changed engine, or a build.json without digests is refused."""
    import shutil

    from edgelin.runtime import open_runner

    counters = trt_standin.install(monkeypatch)
    folder = tmp_path / "built"
    shutil.copytree(exported[1], folder)
    record = trt_standin.build_with_standin(folder)
    plugin = folder / "tensorrt" / record["plugin"]
    assert set(record["sha256"]) == {f"tensorrt/{record['plugin']}", "step.engine", "prefill.engine"}
    open_runner(folder)  # as built: loads
    assert str(plugin) in [str(p) for p in counters.loaded]
    counters.loaded.clear()

    original = plugin.read_bytes()
    plugin.write_bytes(original + b"planted")  # still passes check_library (marker, exports): only its bytes differ
    with pytest.raises(EdgelinError, match=r"libedgelin_trt_plugin_trt10\.so is not the file edgelin build made"):
        open_runner(folder)
    assert counters.loaded == []  # refused before TensorRT loaded it
    plugin.write_bytes(original)

    engine = folder / "step.engine"
    built = engine.read_bytes()
    engine.write_bytes(built + b"\0")
    with pytest.raises(EdgelinError, match=r"step\.engine is not the file edgelin build made"):
        open_runner(folder)
    engine.write_bytes(built)

    record_path = folder / "tensorrt" / "build.json"
    legacy = {k: v for k, v in json.loads(record_path.read_text()).items() if k != "sha256"}
    record_path.write_text(json.dumps(legacy))  # an older edgelin's build: nothing to check the library against
    counters.loaded.clear()
    with pytest.raises(EdgelinError, match="records no sha256 for tensorrt/libedgelin_trt_plugin_trt10.so"):
        open_runner(folder)
    assert counters.loaded == []
