"""Hostile or broken MoE configs and files: every MoE key is checked and bounded before any
tensor is read, and stacked expert tensors against the config; each failure a
ModelFormatError naming the file and the key or tensor."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import mlxr
from mlxr.config import parse_config
from mlxr.errors import ModelFormatError

mlx_ref = pytest.importorskip("mlx_ref")


def _cfg(family: str) -> dict:
    return copy.deepcopy(mlx_ref.config_for(family))


def _expect(raw: dict, *needles: str) -> None:
    with pytest.raises(ModelFormatError) as e:
        parse_config(raw, "config.json")
    msg = str(e.value)
    assert msg.startswith("config.json:"), msg
    for n in needles:
        assert n in msg, msg


@pytest.mark.parametrize("family,changes,needles", [
    ("qwen3_moe", dict(num_experts_per_tok=9), ("num_experts_per_tok", "exceeds")),
    ("qwen3_moe", dict(num_experts_per_tok=0), ("num_experts_per_tok", "out of range")),
    ("qwen3_moe", dict(num_experts=0), ("num_experts", "out of range")),
    ("qwen3_moe", dict(num_experts=1 << 30), ("num_experts", "out of range")),
    ("qwen3_moe", dict(num_experts=None), ("num_experts", "missing")),
    ("qwen3_moe", dict(num_experts="8"), ("num_experts", "integer")),
    ("qwen3_moe", dict(moe_intermediate_size=1 << 30), ("moe_intermediate_size",)),
    ("qwen3_moe", dict(mlp_only_layers=[3]), ("mlp_only_layers",)),
    ("qwen3_moe", dict(mlp_only_layers="1"), ("mlp_only_layers",)),
    ("qwen3_moe", dict(decoder_sparse_step=0), ("decoder_sparse_step",)),
    ("qwen3_moe", dict(norm_topk_prob=None), ("norm_topk_prob", "missing")),
    ("mixtral", dict(num_local_experts=1, num_experts_per_tok=2), ("num_experts_per_tok",)),
    ("gpt_oss", dict(num_hidden_layers=5, layer_types=None), ("layer_types", "5 entries")),
    ("gpt_oss", dict(layer_types=["full_attention"] * 4), ("layer_types", "sliding")),
    ("gpt_oss", dict(layer_types=["sliding_attention", "global"] * 2), ("layer_types",
                                                                         "'global'")),
    ("gpt_oss", dict(sliding_window=0), ("sliding_window",)),
    ("laguna", dict(mlp_layer_types=["dense", "sparse"]), ("mlp_layer_types", "4 entries")),
    ("laguna", dict(mlp_layer_types=["dense", "moe", "sparse", "sparse"]), ("'moe'",)),
    ("laguna", dict(num_attention_heads_per_layer=[4, 6, 6]), ("num_attention_heads_per_layer",
                                                               "4 entries")),
    ("laguna", dict(num_attention_heads_per_layer=[4, 0, 6, 6]),
     ("num_attention_heads_per_layer", "positive multiple")),
    ("laguna", dict(num_attention_heads_per_layer=[4, 5, 6, 6]), ("multiple",)),
    ("laguna", dict(layer_types=["sliding_attention"] * 4), ("full_attention",)),
    ("laguna", dict(num_key_value_heads=0), ("num_key_value_heads",)),
    ("laguna", dict(moe_router_score_func="softmax"), ("moe_router_score_func",)),
    ("laguna", dict(moe_router_logit_softcapping=-1.0), ("moe_router_logit_softcapping",)),
    ("laguna", dict(num_experts=4, num_experts_per_tok=8), ("num_experts_per_tok",)),
    ("laguna", dict(rope_parameters={"full_attention": {"partial_rotary_factor": 0.01}}),
     ("rope_parameters.full_attention.partial_rotary_factor",)),
    ("laguna", dict(rope_parameters={"full_attention": {"rope_type": "yarn"}}),
     ("rope_parameters.full_attention", "factor")),
    ("laguna", dict(rope_parameters={"full_attention": 5}), ("rope_parameters.full_attention",
                                                              "object")),
    ("laguna", dict(rope_parameters="yarn"), ("rope_parameters", "object")),
])
def test_bad_moe_config_is_rejected(family, changes, needles):
    raw = _cfg(family)
    for k, v in changes.items():
        if v is None:
            raw.pop(k, None)
        else:
            raw[k] = v
    _expect(raw, *needles)


def test_good_configs_parse_as_mlx_lm_builds_them():
    c = parse_config(_cfg("laguna"))
    assert c.layer_heads == (4, 6, 6, 6) and c.num_heads == 6 and c.heads(0) == 4
    assert c.layer_window == (None, 8, 8, 8) and c.attn_head_gate and c.qk_norm
    assert [r.dims for r in c.layer_rope] == [16, 32, 32, 32]
    assert c.layer_rope[0].base == 500000.0 and c.layer_rope[1].base == 10000.0
    assert c.moe.sparse_layers == (False, True, True, True) and c.moe.routed_scale == 2.5
    assert c.moe.router == "sigmoid_topk" and c.moe.correction_bias and c.moe.shared_size == 64
    g = parse_config(_cfg("gpt_oss"))
    assert g.attn_sinks and g.qkv_bias and g.o_bias and g.layer_window == (8, None, 8, None)
    assert g.moe.expert_act == "swiglu_oai" and g.moe.router_bias and g.moe.expert_bias
    q = parse_config(_cfg("qwen3_moe"))
    assert q.moe.sparse_layers == (True, False, True) and q.moe.norm_topk


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Tiny mlx-lm-saved MoE models: qwen3_moe 4-bit (8-bit router), laguna's NVFP4 recipe."""
    return {(f, q): mlx_ref.make_model(tmp_path_factory.mktemp(f"{f}-{q}"), f, q)
            for f, q in (("qwen3_moe", "q4g64"), ("laguna", "laguna_nvfp4"))}


def _copy(src, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(src, d)
    return d


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(d, fn):
    path = d / "model.safetensors"
    t = load_file(path)
    fn(t)
    save_file(t, str(path), metadata={"format": "mlx"})
    (d / "model.safetensors.index.json").unlink(missing_ok=True)


def _load_fails(d, *needles) -> None:
    for check in (mlxr.validate, lambda p: mlxr.load(p, device="cpu")):
        with pytest.raises(ModelFormatError) as e:
            check(d)
        for n in needles:
            assert n in str(e.value), str(e.value)


@pytest.mark.parametrize("changes,needles", [
    (dict(num_experts=16), ("model.safetensors", "mlp.gate.weight", "[16, 32]")),
    (dict(moe_intermediate_size=128), ("switch_mlp", "config.json implies")),
    (dict(mlp_only_layers=[]), ("model.layers.1.mlp.gate",)),
    (dict(mlp_only_layers=[0, 1]), ("model.layers.0.mlp.gate_proj",)),
])
def test_expert_tensors_must_match_the_config(saved, tmp_path, changes, needles):
    d = _copy(saved["qwen3_moe", "q4g64"], tmp_path)
    _edit_config(d, **changes)
    _load_fails(d, *needles)


def test_expert_tensor_dtype_and_global_scale_checked(saved, tmp_path):
    d = _copy(saved["laguna", "laguna_nvfp4"], tmp_path)
    name = "model.layers.1.mlp.switch_mlp.up_proj.scales"

    def to_float(t):
        t[name] = t[name].to(torch.float16)

    _edit_tensors(d, to_float)  # float scales read as affine: its biases are then missing
    _load_fails(d, "switch_mlp.up_proj")
    d2 = _copy(saved["laguna", "laguna_nvfp4"], tmp_path / "b")

    def add_scale(t):
        t["model.layers.2.mlp.switch_mlp.down_proj.global_scale"] = torch.ones(3)

    _edit_tensors(d2, add_scale)
    _load_fails(d2, "down_proj.global_scale", "[3]", "[16]")


def test_laguna_recipe_keeps_float_modules(saved):
    """The NVFP4 export: experts and shared expert quantized, router / attention / layer-0
    MLP float, the correction bias float32 (as mlx-lm keeps it)."""
    m = mlxr.load(saved["laguna", "laguna_nvfp4"], device="cpu")
    moe = m.decoder.layers[1].moe
    assert m.decoder.layers[0].moe is None and moe is not None
    assert isinstance(moe.router.weight, torch.Tensor)
    assert moe.correction_bias.dtype == torch.float32
    assert moe.down[0].weight.spec.mode == "nvfp4" and moe.shared_down.weight.spec.mode == "nvfp4"
