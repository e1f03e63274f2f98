"""Input validation of checkpoints: config values by type and range (inspect and export agree on
each), upstream fields that the source library never reads (inert: accepted and listed), weights
with a non-float dtype, and a missing or corrupt tokenizer."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

from conftest import tiny_config
from edgelin.checkpoint import load_model
from edgelin.convert import convert
from edgelin.convert.base import HARMLESS, Weights
from edgelin.convert.reads import MODELING_READS, TRANSFORMERS_GENERIC, upstream_reads
from edgelin.errors import EdgelinError
from edgelin.export.pipeline import export_checkpoint
from edgelin.families import FAMILIES
from edgelin.inspect import inspect_checkpoint
from edgelin.model.config import AttentionConfig
from helpers import make_checkpoint, make_tokenizer

SITE = Path(sysconfig.get_paths()["purelib"])


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory) -> Path:
    """gated_deltanet + sliding-window softmax + gla (3 layers), no tokenizer: every section is present."""
    return make_checkpoint(tmp_path_factory.mktemp("hybrid") / "ckpt", "hybrid", tokenizer=False)


def edited(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    data = json.loads((src / "config.json").read_text())
    for key, value in changes.items():
        if key.startswith("attention__"):
            data["attention"][key.removeprefix("attention__")] = value
        else:
            data[key] = value
    (dst / "config.json").write_text(json.dumps(data))
    return dst


# (field, bad value, the allowed range the one-line error must state). The hybrid has vocab 97, 2 heads
# of key width 8, 3 layers, attention 2 heads / 1 kv head of 16.
BAD = [
    ("num_heads", 0, "num_heads must be an integer >= 1"),
    ("num_heads", -2, "num_heads must be an integer >= 1"),
    ("vocab_size", "97", "vocab_size must be an integer >= 1"),
    ("vocab_size", 97.0, "vocab_size must be an integer >= 1"),
    ("hidden_size", True, "hidden_size must be an integer >= 1"),
    ("head_k_dim", 0, "head_k_dim must be an integer >= 1"),
    ("intermediate_size", -1, "intermediate_size must be an integer >= 0"),
    ("num_k_heads", 3, "num_k_heads must be null or a divisor of num_heads=2"),
    ("num_hidden_layers", 5, "num_hidden_layers must be len(layer_types) = 3"),
    ("rms_norm_eps", "1e-6", "rms_norm_eps must be a finite number > 0"),
    ("rms_norm_eps", 0, "rms_norm_eps must be a finite number > 0"),
    ("rope_theta", -1, "rope_theta must be a finite number > 0"),
    ("chunk_size", 0, "chunk_size must be null or an integer >= 1"),
    ("conv_size", 1, "conv_size must be an integer >= 2 (gated_deltanet layers have a short convolution)"),
    ("tie_word_embeddings", "no", "tie_word_embeddings must be true or false"),
    ("feature_seed", -1, "feature_seed must be an integer >= 0"),
    ("bos_token_id", 97, "bos_token_id must be null or an integer in [0, 96] (vocab_size=97)"),
    ("eos_token_id", -1, "eos_token_id must be null or an integer >= 0"),
    ("layer_types", "gated_deltanet", "layer_types must be a non-empty list of layer types"),
    ("attention", "yes", "attention must be null or an object"),
    ("attention__window", 0, "attention.window must be null or an integer >= 1"),
    ("attention__num_heads", 0, "attention.num_heads must be an integer >= 1"),
    ("attention__num_kv_heads", 3, "attention.num_kv_heads must be a divisor of attention.num_heads=2"),
    ("attention__rotary_dim", 3, "attention.rotary_dim must be null or an even integer in [2, 16]"),
    ("attention__qk_norm_eps", -1.0, "attention.qk_norm_eps must be null or a finite number > 0"),
    ("attention__qkv_bias", 1, "attention.qkv_bias must be true or false"),
    ("family_overrides", {"gla": {"gate_normalizer": "16"}},
     "family_overrides.gla.gate_normalizer must be a finite number > 0"),
    ("family_overrides", {"gla": {"short_conv": 1}}, "family_overrides.gla.short_conv must be true or false"),
    ("family_overrides", {"gla": {"output_gate": "sideways"}},
     "family_overrides.gla.output_gate must be one of 'none', 'after_norm', 'before_norm'"),
    ("family_overrides", {"gla": {"dt_clamp": 3}}, "family_overrides.gla.dt_clamp must be null or a pair"),
]


@pytest.mark.parametrize("key, value, allowed", BAD, ids=[f"{k}={v!r}" for k, v, _ in BAD])
def test_bad_config_value_is_one_line_and_inspect_agrees_with_export(hybrid, tmp_path, key, value, allowed):
    folder = edited(hybrid, tmp_path / "ckpt", **{key: value})
    name = allowed.split(" must be ")[0]  # the field the line names, e.g. attention.window
    with pytest.raises(EdgelinError) as err:
        export_checkpoint(folder, tmp_path / "out")
    line = err.value.line()
    assert f"{name}=" in line and allowed in line and "\n" not in line, line
    assert not (tmp_path / "out").exists()
    report = inspect_checkpoint(folder)
    assert not report.supported
    assert report.reason == f"{err.value.what}: {err.value.why}"


def test_configs_built_in_code_are_checked_too():
    with pytest.raises(EdgelinError, match=r"model config: num_heads=0 is invalid: num_heads must be an integer >= 1"):
        tiny_config(("gla",), num_heads=0)
    with pytest.raises(EdgelinError, match=r"attention.window=0 is invalid"):
        AttentionConfig(2, 1, 16, window=0)
    with pytest.raises(EdgelinError, match=r"attention.head_dim=15 is invalid: attention.head_dim must be an even"):
        AttentionConfig(2, 1, 15)
    with pytest.raises(EdgelinError, match=r"head_k_dim=3 is invalid"):  # RetNet rotates pairs of the key width
        tiny_config(("retnet",), head_k_dim=3)
    config = dataclasses.replace(tiny_config(("gla",)), layer_types=["gla", "gla"])  # a list, from code
    assert config.layer_types == ("gla", "gla")  # stored as the tuple the dataclass promises


@pytest.mark.parametrize("knobs, needle", [
    ({"gate_normalizer": "16"}, "gate_normalizer='16' is invalid"),
    ({"use_beta": "yes"}, "use_beta='yes' is invalid: family_overrides.deltanet.use_beta must be true or false"),
    ({"chunk_size": 2.5}, "chunk_size=2.5 is invalid"),
    ({"gate_low_rank": -1}, "gate_low_rank=-1 is invalid"),
    ({"dt_clamp": [1.0, 0.5]}, "dt_clamp=[1.0, 0.5] is invalid"),
    ({"feature_map": "cosine"}, "feature_map='cosine' is invalid"),
])
def test_family_overrides_refuse_wrong_types(knobs, needle):
    with pytest.raises(EdgelinError) as err:
        FAMILIES["deltanet"].with_overrides(knobs)
    assert needle in err.value.line()


def test_good_overrides_still_apply():
    spec = FAMILIES["mamba2"].with_overrides({"dt_clamp": [0.0, 4], "output_gate": "after_norm"})
    assert spec.dt_clamp == (0.0, 4.0) and spec.output_gate.value == "after_norm"


# ---- converters: typed reads, inert fields -------------------------------------------------------
QWEN = dict(model_type="qwen3_5_text", vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_key_head_dim=8,
            linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, hidden_act="silu",
            layer_types=["linear_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
GLA = dict(model_type="gla", vocab_size=100, hidden_size=32, num_hidden_layers=2, num_heads=2, hidden_act="swish",
           use_gk=True, use_gv=False, attn=None, fuse_norm=True)
MAMBA2 = dict(model_type="mamba2", vocab_size=100, hidden_size=64, num_hidden_layers=2, state_size=16, head_dim=16,
              num_heads=8)
DELTA = dict(model_type="delta_net", vocab_size=100, hidden_size=32, num_hidden_layers=2, num_heads=2,
             hidden_act="swish")


def test_upstream_leftovers_are_inert_and_listed():
    # GLAConfig saves use_gk/use_gv, which fla 0.6's GLA model never reads; my_leftover is made up.
    assert convert({**GLA, "my_leftover": 1}, "gla").inert == ("my_leftover", "use_gk", "use_gv")
    # Qwen3.5 has no sliding window: transformers keeps use_sliding_window as an unread attribute.
    assert convert({**QWEN, "use_sliding_window": True, "my_leftover": "x"}, "q").inert == \
        ("my_leftover", "use_sliding_window")
    # fla's DeltaNet model never passes num_kv_heads to its layer, so an MQA-looking value changes nothing.
    done = convert({**DELTA, "num_kv_heads": 1}, "delta")
    assert done.inert == ("num_kv_heads",) and done.config.num_k_heads == 2
    # unknown keys of an fla attention spec are kept, never read, by fla's get_attention
    attn = {"layers": [1], "num_heads": 2, "window_size": 8, "qk_norm": True}
    assert convert({**GLA, "attn": attn}, "gla").inert == ("attn.qk_norm", "use_gk", "use_gv")
    # the multimodal config: the text model's leftovers are named inside text_config
    mm = {"model_type": "qwen3_5", "text_config": {**QWEN, "model_type": "qwen3_5_text", "old": 1},
          "vision_config": {}, "vision_start_token_id": 5}
    assert convert(mm, "mm").inert == ("text_config.old", "vision_start_token_id")


def test_fields_upstream_reads_but_edgelin_does_not_implement_are_refused():
    for data, field in (({**QWEN, "per_layer_config": {"0": {}}}, "per_layer_config"),
                        ({**QWEN, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
                        ({**GLA, "attnres_block_size": 2}, "attnres_block_size=2")):
        with pytest.raises(EdgelinError) as err:
            convert(data, "config.json")
        assert field in err.value.line()


@pytest.mark.parametrize("data, needle", [
    ({**GLA, "num_heads": "2"}, "num_heads='2' is invalid: num_heads must be an integer >= 1"),
    ({**GLA, "norm_eps": "1e-6"}, "norm_eps='1e-6' is invalid: norm_eps must be a finite number > 0"),
    ({**GLA, "hidden_size": 30}, "hidden_size * expand_k=15 is invalid: hidden_size * expand_k must be a multiple"),
    ({**GLA, "attn": {"layers": [2], "num_heads": 2}}, "attn.layers=2 is invalid"),
    ({**GLA, "use_short_conv": "yes"}, "use_short_conv='yes' is invalid"),
    ({**GLA, "use_output_gate": 0}, "use_output_gate=0 is invalid"),
    ({**QWEN, "linear_num_key_heads": 3}, "linear_num_key_heads=3 is invalid: linear_num_key_heads must be a divisor"),
    ({**QWEN, "num_hidden_layers": 3}, "num_hidden_layers=3 is invalid: num_hidden_layers must be len(layer_types)"),
    ({**QWEN, "rms_norm_eps": None, "vocab_size": 0}, "vocab_size=0 is invalid"),
    ({**MAMBA2, "n_groups": 3}, "n_groups=3 is invalid: n_groups must be a divisor of num_heads=8"),
    ({**MAMBA2, "time_step_limit": "fast"}, "time_step_limit='fast' is invalid"),
    ({**MAMBA2, "time_step_limit": [0.5, 0.1]}, "time_step_limit=[0.5, 0.1] is invalid"),
])
def test_converter_values_are_typed_and_ranged(data, needle):
    with pytest.raises(EdgelinError) as err:
        convert(data, "config.json")
    assert needle in err.value.line(), err.value.line()


def test_use_expect_does_not_confuse_flags_with_numbers():
    with pytest.raises(EdgelinError, match="use_bias=0 is not supported"):  # 0 == False in Python, not in JSON
        convert({**MAMBA2, "use_bias": 0}, "config.json")


def test_mamba2_defaults_follow_each_library():
    assert convert(MAMBA2, "m").config.num_k_heads == 8  # transformers' Mamba2Config: n_groups=8
    assert convert({**MAMBA2, "dt_limit": [0.0, 5.0]}, "m").config.num_k_heads == 1  # fla's: n_groups=1


def test_qwen_rotary_defaults_follow_transformers():
    # Qwen3_5TextConfig defaults partial_rotary_factor to 0.25 when config.json does not say.
    data = {k: v for k, v in QWEN.items() if k != "rope_parameters"}
    assert convert(data, "q").config.attention.rotary_dim == 4  # 16 * 0.25
    del data["layer_types"]  # every full_attention_interval-th layer is full attention (default 4)
    data.update(num_hidden_layers=4, full_attention_interval=2)
    assert convert(data, "q").config.layer_types == ("gated_deltanet", "softmax") * 2


# ---- the read sets are the installed upstream sources' ---------------------------------------------
def _config_reads(tree: ast.AST) -> set[str]:
    """Every `config.X`, `self.config.X` and `getattr(config, "X"...)` in a parsed module or class."""
    def is_config(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and node.id == "config") or (isinstance(node, ast.Attribute)
                                                                        and node.attr == "config")
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_config(node.value):
            found.add(node.attr)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                and len(node.args) >= 2 and is_config(node.args[0]) and isinstance(node.args[1], ast.Constant)):
            found.add(node.args[1].value)
    return found


def _modeling(rel: str) -> ast.Module:
    path = SITE / rel
    if not path.is_file():
        pytest.skip(f"{rel} is not installed")
    return ast.parse(path.read_text())


@pytest.mark.parametrize("model_type", ["linear_attn", "retnet", "gla", "delta_net", "gated_deltanet", "kda", "mamba2"])
def test_fla_read_sets_match_the_installed_modeling_code(model_type):
    derived = _config_reads(_modeling(f"fla/models/{model_type}/modeling_{model_type}.py"))
    assert derived == MODELING_READS[("fla", model_type)]
    shared = _config_reads(_modeling("fla/models/modeling_utils.py"))
    assert shared <= upstream_reads("fla", model_type)


def test_transformers_read_sets_match_the_installed_modeling_code():
    classes = {c.name: _config_reads(c) for c in _modeling("transformers/models/qwen3_5/modeling_qwen3_5.py").body
               if isinstance(c, ast.ClassDef)}
    multimodal = {"Qwen3_5Model", "Qwen3_5ForConditionalGeneration"}
    text = set().union(*(r for n, r in classes.items() if "Vision" not in n and n not in multimodal))
    assert text == MODELING_READS[("transformers", "qwen3_5_text")]
    assert set().union(*(classes[n] for n in multimodal)) == MODELING_READS[("transformers", "qwen3_5")]
    mamba2 = _config_reads(_modeling("transformers/models/mamba2/modeling_mamba2.py"))
    assert mamba2 == MODELING_READS[("transformers", "mamba2")]


def test_harmless_fields_are_read_by_some_upstream():
    """HARMLESS means 'read upstream, no effect on inference'; a field no upstream reads is inert instead."""
    read = set(TRANSFORMERS_GENERIC).union(*(upstream_reads(*key) for key in MODELING_READS))
    assert HARMLESS <= read, sorted(HARMLESS - read)


# ---- weights ---------------------------------------------------------------------------------------
def _retype(folder: Path, name: str, dtype: torch.dtype) -> torch.Tensor:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    tensors[name] = tensors[name].to(dtype)
    save_file(tensors, str(folder / "model.safetensors"))
    return tensors[name]


def test_integer_weights_are_refused_by_name(tmp_path):
    folder = make_checkpoint(tmp_path / "ckpt", "gla", tokenizer=False)
    _retype(folder, "model.layers.0.mixer.q_proj.weight", torch.int32)
    with pytest.raises(EdgelinError, match=r"tensor model.layers.0.mixer.q_proj.weight has dtype int32"):
        load_model(folder)
    assert not inspect_checkpoint(folder).supported


def test_half_precision_weights_load(tmp_path):
    folder = make_checkpoint(tmp_path / "ckpt", "gla", tokenizer=False)
    want = _retype(folder, "model.norm.weight", torch.bfloat16)
    model, _ = load_model(folder)
    assert torch.equal(model.state_dict()["model.norm.weight"], want.float())


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool])
def test_converters_refuse_non_float_weights(dtype):
    weights = Weights({"backbone.norm_f.weight": torch.ones(4, dtype=dtype)}, "mamba2 checkpoint")
    with pytest.raises(EdgelinError, match=f"tensor backbone.norm_f.weight has dtype {str(dtype)[6:]}"):
        weights.pop("backbone.norm_f.weight")
    assert Weights({"a": torch.ones(2, dtype=torch.float16)}, "x").pop("a").dtype == torch.float32


# ---- tokenizer ----------------------------------------------------------------------------------------
@pytest.fixture
def exports(monkeypatch) -> list[dict]:
    """export_checkpoint's own work (loading, tokenizer checks, warnings, inert fields) without the ONNX
    export itself (tested elsewhere, ~10 s a model): export_model is recorded, not run."""
    import edgelin.export.pipeline as pipeline

    calls: list[dict] = []

    def fake_export_model(model, out, target, source, tokenizer=None, *args, **kwargs):
        calls.append({"out": out, "tokenizer": tokenizer})
        return pipeline.ExportResult(Path(out), None, {})

    monkeypatch.setattr(pipeline, "export_model", fake_export_model)
    return calls


@pytest.fixture(scope="module")
def with_tokenizer(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tok") / "ckpt", "gated_deltanet", tokenizer=True)


def test_corrupt_tokenizer_is_refused_at_export_unless_left_out(with_tokenizer, tmp_path, exports):
    folder = tmp_path / "ckpt"
    shutil.copytree(with_tokenizer, folder)
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(EdgelinError) as err:
        export_checkpoint(folder, tmp_path / "out")
    assert f"tokenizer {folder / 'tokenizer.json'} is corrupt" in err.value.line()
    assert "--no-tokenizer" in err.value.fix and exports == []
    report = inspect_checkpoint(folder)
    assert report.tokenizer.startswith("corrupt: ") and "--no-tokenizer" in report.warnings[0]
    result = export_checkpoint(folder, tmp_path / "out", include_tokenizer=False)
    assert exports == [{"out": tmp_path / "out", "tokenizer": None}] and result.warnings == ()


def test_good_tokenizer_is_shipped(with_tokenizer, tmp_path, exports):
    assert inspect_checkpoint(with_tokenizer).tokenizer == "ok"
    result = export_checkpoint(with_tokenizer, tmp_path / "out")
    assert exports[0]["tokenizer"] == with_tokenizer.resolve() / "tokenizer.json" and result.warnings == ()


def test_tokenizer_with_ids_beyond_the_vocabulary_is_corrupt(with_tokenizer, tmp_path, exports):
    folder = tmp_path / "ckpt"
    shutil.copytree(with_tokenizer, folder)
    make_tokenizer(folder / "tokenizer.json", vocab_size=300)  # the model has 256 embeddings
    with pytest.raises(EdgelinError, match=r"does not fit the model: it has token id 2\d\d, but the model's "
                                           r"vocab_size is 256"):
        export_checkpoint(folder, tmp_path / "out")
    assert inspect_checkpoint(folder).tokenizer.startswith("corrupt: it has token id")


def test_missing_tokenizer_is_a_warning(hybrid, tmp_path, exports):
    report = inspect_checkpoint(hybrid)
    assert report.supported and report.tokenizer == "missing" and "no tokenizer.json" in report.warnings[0]
    result = export_checkpoint(hybrid, tmp_path / "out")
    assert result.warnings == (f"no tokenizer.json in {hybrid.resolve()}: the export has no tokenizer, so generate "
                               "will need one",)
    assert result.inert_fields == () and exports[0]["tokenizer"] is None


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_inert_fields_reach_inspect_and_export(tmp_path, exports):
    from upstream_hf import tiny_mamba2

    tiny_mamba2(tmp_path / "ckpt")
    data = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    # fused_add_norm: a mamba_ssm setting some Mamba2 configs carry; transformers' Mamba2 never reads it
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({**data, "fused_add_norm": True}))
    report = inspect_checkpoint(tmp_path / "ckpt")
    assert report.supported and report.inert_fields == ["fused_add_norm"]
    assert export_checkpoint(tmp_path / "ckpt", tmp_path / "out").inert_fields == ("fused_add_norm",)
