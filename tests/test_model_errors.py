"""Hostile or broken model directories: config.json and tensors that disagree with it. Each is
a ModelFormatError naming the file and the key or tensor, raised before weights are used;
through the CLI, a one-line error and exit 1."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import mlxr
from mlxr.errors import ModelFormatError

mlx_ref = pytest.importorskip("mlx_ref")


@pytest.fixture(scope="module")
def q4(tmp_path_factory):
    """A tiny mlx-lm-saved qwen3 model, 4-bit, with an 8-bit and an unquantized module."""
    return mlx_ref.make_model(tmp_path_factory.mktemp("q4"), "qwen3", "mixed")


@pytest.fixture
def broken(q4, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(q4, d)
    return d


def edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


def edit_tensors(d, fn):
    path = d / "model.safetensors"
    t = load_file(path)
    fn(t)
    save_file(t, str(path), metadata={"format": "mlx"})
    (d / "model.safetensors.index.json").unlink(missing_ok=True)


def expect(d, *needles):
    with pytest.raises(ModelFormatError) as e:
        mlxr.load(d, device="cpu")
    for n in needles:
        assert n in str(e.value), str(e.value)
    return str(e.value)


def test_valid_model_loads(q4):
    assert mlxr.validate(q4).model_type == "qwen3"
    assert mlxr.load(q4, device="cpu").logits([1, 2, 3]).shape == (3, 320)


def test_malformed_config_json(broken):
    (broken / "config.json").write_text('{"model_type": "qwen3", "hidden_size": ')
    expect(broken, "config.json", "malformed JSON")


def test_unknown_model_type(broken):
    edit_config(broken, model_type="falcon_mamba")
    expect(broken, "config.json", "falcon_mamba", "not supported")


@pytest.mark.parametrize("key", ["hidden_size", "num_hidden_layers", "model_type", "head_dim"])
def test_missing_required_key(broken, key):
    edit_config(broken, **{key: None})
    expect(broken, "config.json", f"'{key}'")


@pytest.mark.parametrize("key,value", [("num_hidden_layers", 10**12), ("vocab_size", 2**40),
                                       ("hidden_size", -4), ("num_attention_heads", 0),
                                       ("rms_norm_eps", "tiny"), ("num_key_value_heads", 3)])
def test_absurd_sizes_rejected_before_allocating(broken, key, value):
    edit_config(broken, **{key: value})
    t = time.perf_counter()
    expect(broken, "config.json", key)
    assert time.perf_counter() - t < 5


def test_shape_disagrees_with_config(broken):
    edit_config(broken, intermediate_size=384)
    msg = expect(broken, "model.safetensors", "mlp.")
    assert "config.json implies" in msg or "inconsistent" in msg


def test_missing_tensor(broken):
    edit_tensors(broken, lambda t: t.pop("model.layers.1.self_attn.o_proj.scales"))
    expect(broken, "model.layers.1.self_attn.o_proj")


def test_missing_plain_tensor(broken):
    edit_tensors(broken, lambda t: t.pop("model.layers.0.input_layernorm.weight"))
    expect(broken, "missing tensor", "model.layers.0.input_layernorm.weight")


def test_unexpected_tensor(broken):
    edit_tensors(broken, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(4)}))
    expect(broken, "unexpected", "model.layers.0.mlp.extra.weight")


def test_wrong_dtype(broken):
    def f(t):
        t["model.norm.weight"] = t["model.norm.weight"].to(torch.int32)
    edit_tensors(broken, f)
    expect(broken, "model.norm.weight", "dtype")


def test_config_says_unquantized_but_file_is_quantized(broken):
    cfg = json.loads((broken / "config.json").read_text())
    cfg["quantization"]["model.layers.0.self_attn.q_proj"] = False
    (broken / "config.json").write_text(json.dumps(cfg))
    expect(broken, "model.layers.0.self_attn.q_proj", "false")


def test_foreign_quantization_explained(broken):
    edit_config(broken, quantization=None, quantization_config={"quant_method": "awq",
                                                                 "bits": 4})
    expect(broken, "quant_method", "awq")


def test_cli_reports_without_traceback(broken):
    edit_config(broken, num_hidden_layers=10**12)
    r = subprocess.run([sys.executable, "-m", "mlxr", "run", str(broken), "hi"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "num_hidden_layers" in r.stderr and "Traceback" not in r.stderr
