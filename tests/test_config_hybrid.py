"""Untrusted configs of the hybrid families: every new key is checked and bounded before
anything is allocated, and the error names the file and the key (nested keys in full)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import mlxr
from hybrid_configs import FAMILIES
from mlxr.config import parse_config
from mlxr.config.hybrid import GatedDeltaSpec, Gemma4Spec
from mlxr.errors import ModelFormatError

QWEN = dict(model_type="qwen3_5", text_config=dict(
    hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, full_attention_interval=2, linear_num_value_heads=4,
    linear_num_key_heads=2, linear_key_head_dim=32, linear_value_head_dim=32, vocab_size=320,
    rope_parameters=dict(rope_type="default", rope_theta=1e6, partial_rotary_factor=0.25)))
GEMMA = dict(model_type="gemma4_text", hidden_size=64, num_hidden_layers=5,
             intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
             global_head_dim=64, vocab_size=320, vocab_size_per_layer_input=320,
             hidden_size_per_layer_input=16, num_kv_shared_layers=2, sliding_window=8,
             sliding_window_pattern=2)


def _with(base: dict, **kw) -> dict:
    cfg = copy.deepcopy(base)
    (cfg["text_config"] if "text_config" in cfg else cfg).update(kw)
    return cfg


def test_valid_configs_parse_to_specs():
    q = parse_config(QWEN)
    assert isinstance(q.arch, GatedDeltaSpec)
    assert q.arch.layer_types == ("linear_attention", "full_attention") * 2
    assert q.arch.conv_dim == 2 * 2 * 32 + 4 * 32
    assert q.layer_rope[0].dims == 8
    g = parse_config(GEMMA)
    assert isinstance(g.arch, Gemma4Spec)
    assert g.arch.kv_source == (0, 1, 2, 1, 2)  # shared layers read the last of their type
    assert g.arch.head_dims == (32, 64, 32, 64, 32)
    assert g.arch.mlp_sizes == (128, 128, 128, 256, 256)
    assert g.layer_window == (8, None, 8, None, 8)


@pytest.mark.parametrize("kw,key", [
    (dict(linear_conv_kernel_dim=1), "text_config.linear_conv_kernel_dim"),
    (dict(linear_conv_kernel_dim=100000), "text_config.linear_conv_kernel_dim"),
    (dict(linear_key_head_dim=1 << 20), "text_config.linear_key_head_dim"),
    (dict(linear_num_value_heads=0), "text_config.linear_num_value_heads"),
    (dict(linear_num_value_heads=3), "text_config.linear_num_value_heads"),
    (dict(linear_value_head_dim="128"), "text_config.linear_value_head_dim"),
    (dict(full_attention_interval=0), "text_config.full_attention_interval"),
    (dict(layer_types=["linear_attention"] * 3), "text_config.layer_types"),
    (dict(layer_types=["linear_attention", "mamba"] * 2), "text_config.layer_types"),
    (dict(layer_types=["full_attention", "linear_attention"] * 2), "text_config.layer_types"),
    (dict(num_experts=8), "text_config.num_experts_per_tok' is required"),
    (dict(head_dim=4096), "text_config.head_dim"),
    (dict(rope_parameters=dict(rope_type="default", partial_rotary_factor=0.01)),
     "partial_rotary_factor"),
    (dict(rope_parameters=dict(rope_type="yarn")), "rope_parameters"),
    (dict(num_attention_heads=3), "num_attention_heads"),
])
def test_bad_qwen3_5_keys_name_the_key(kw, key):
    with pytest.raises(ModelFormatError) as e:
        parse_config(_with(QWEN, **kw), "config.json")
    assert "config.json" in str(e.value) and key in str(e.value)


QWEN_MOE = _with(QWEN, model_type="qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=64, shared_expert_intermediate_size=64)
QWEN_MOE["model_type"] = "qwen3_5_moe"
NEXT = dict(model_type="qwen3_next", **{k: v for k, v in QWEN["text_config"].items()
                                        if k != "rope_parameters"},
            rope_theta=1e6, partial_rotary_factor=0.25, max_position_embeddings=4096,
            rms_norm_eps=1e-6, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[2])
GEMMA_MOE = _with(GEMMA, enable_moe_block=True, num_experts=4, top_k_experts=2,
                  moe_intermediate_size=64)


def test_valid_moe_configs_parse_to_moe_specs():
    q = parse_config(QWEN_MOE)
    assert q.moe.sparse_layers == (True,) * 4 and q.moe.norm_topk and q.moe.shared_gate
    n = parse_config(NEXT)
    assert n.arch.qkvz_grouped and not n.moe.norm_topk  # qwen3_next's default: false
    assert n.moe.sparse_layers == (True, True, False, True)  # layer 2 in mlp_only_layers
    assert parse_config(_with(NEXT, num_experts=0)).moe is None
    g = parse_config(GEMMA_MOE)
    assert (g.moe.router, g.moe.expert_act, g.moe.top_k) == ("topk_softmax", "gelu_tanh", 2)


@pytest.mark.parametrize("kw,key", [
    (dict(num_experts_per_tok=5), "text_config.num_experts_per_tok' = 5 exceeds"),
    (dict(num_experts_per_tok=0), "text_config.num_experts_per_tok"),
    (dict(num_experts=1 << 20), "text_config.num_experts"),
    (dict(num_experts=-1), "text_config.num_experts"),
    (dict(moe_intermediate_size=None), "text_config.moe_intermediate_size' is required"),
    (dict(moe_intermediate_size=1 << 30), "text_config.moe_intermediate_size"),
    (dict(shared_expert_intermediate_size=0), "text_config.shared_expert_intermediate_size"),
    (dict(norm_topk_prob="yes"), "text_config.norm_topk_prob"),
])
def test_bad_qwen3_5_moe_keys_name_the_key(kw, key):
    with pytest.raises(ModelFormatError) as e:
        parse_config(_with(QWEN_MOE, **kw), "config.json")
    assert str(e.value).startswith("config.json: ") and key in str(e.value)


@pytest.mark.parametrize("drop_or_kw,key", [
    ("rope_theta", "'rope_theta' is required"),
    ("head_dim", "'head_dim' is required"),
    ("decoder_sparse_step", "'decoder_sparse_step' is required"),
    ("mlp_only_layers", "'mlp_only_layers'"),
    ("linear_conv_kernel_dim", "'linear_conv_kernel_dim' is required"),
    (dict(mlp_only_layers=[9]), "'mlp_only_layers'"),
    (dict(mlp_only_layers="2"), "'mlp_only_layers'"),
    (dict(partial_rotary_factor=0.01), "'partial_rotary_factor'"),
    (dict(rope_scaling=dict(type="unknown")), "'rope_scaling'"),
    (dict(linear_num_value_heads=3), "linear_num_value_heads"),
    (dict(num_experts_per_tok=8), "'num_experts_per_tok' = 8 exceeds"),
    (dict(layer_types=["full_attention"] * 4), "'layer_types'"),
])
def test_bad_qwen3_next_keys_name_the_key(drop_or_kw, key):
    cfg = copy.deepcopy(NEXT)
    if isinstance(drop_or_kw, str):
        del cfg[drop_or_kw]
    else:
        cfg.update(drop_or_kw)
    with pytest.raises(ModelFormatError) as e:
        parse_config(cfg, "config.json")
    assert str(e.value).startswith("config.json: ") and key in str(e.value)


@pytest.mark.parametrize("kw,key", [
    (dict(num_experts=None), "text_config.num_experts' is required"),
    (dict(top_k_experts=5), "text_config.top_k_experts' = 5 exceeds"),
    (dict(top_k_experts=None), "text_config.top_k_experts' is required"),
    (dict(moe_intermediate_size=0), "text_config.moe_intermediate_size"),
    (dict(enable_moe_block="true"), "text_config.enable_moe_block"),
])
def test_bad_gemma4_moe_keys_name_the_key(kw, key):
    cfg = dict(model_type="gemma4", vocab_size=320, text_config=_with(GEMMA_MOE, **kw))
    with pytest.raises(ModelFormatError) as e:
        parse_config(cfg, "config.json")
    assert str(e.value).startswith("config.json: ") and key in str(e.value)


HOSTILE = [0, -1, 1, 2, 1e308, -1e308, 1e-300, 0.5, None, "", "x", [], {}, True, False,
           1 << 40, 2**63, 10**400, [1, 2], 3.0, {"__float__": "NaN"}, {"__float__": "Infinity"}]


def _key_paths(d: dict, pre: tuple = ()):
    for k, v in d.items():
        yield pre + (k,)
        if isinstance(v, dict):
            yield from _key_paths(v, pre + (k,))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_key_of_every_hybrid_takes_hostile_values(family):
    """Each key (nested ones too) of each tiny hybrid config set to each hostile value: the
    config parses, or the error is a ModelFormatError naming config.json (no OverflowError
    from 1e308 partial rotary factors or 400-digit integers, no TypeError)."""
    base = dict(copy.deepcopy(FAMILIES[family]), quantization=dict(group_size=64, bits=4))
    for path in list(_key_paths(base)):
        for v in HOSTILE:
            cfg = copy.deepcopy(base)
            node = cfg
            for k in path[:-1]:
                node = node[k]
            node[path[-1]] = v
            try:
                parse_config(cfg, "config.json")
            except ModelFormatError as e:
                assert str(e).startswith("config.json: "), (path, v, str(e))


def test_text_config_must_be_an_object():
    with pytest.raises(ModelFormatError, match="'text_config' must be an object"):
        parse_config(dict(model_type="qwen3_5", text_config=[1]))


@pytest.mark.parametrize("kw,key", [
    (dict(global_head_dim=1 << 16), "global_head_dim"),
    (dict(hidden_size_per_layer_input=1 << 20), "hidden_size_per_layer_input"),
    (dict(vocab_size_per_layer_input=100), "vocab_size_per_layer_input"),
    (dict(num_kv_shared_layers=5), "num_kv_shared_layers"),
    (dict(num_kv_shared_layers=-1), "num_kv_shared_layers"),
    (dict(layer_types=["sliding_attention"] * 4), "layer_types"),
    (dict(layer_types=["sliding_attention", "local"] * 2 + ["full_attention"]), "layer_types"),
    # the shared layers 3, 4 include a full layer, but no unshared layer is full
    (dict(layer_types=["sliding_attention"] * 3 + ["full_attention"] * 2), "layer_types"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(sliding_window_pattern=0), "sliding_window_pattern"),
    (dict(enable_moe_block=True), "'num_experts' is required"),
    (dict(num_global_key_value_heads=3, attention_k_eq_v=True), "num_global_key_value_heads"),
    (dict(rope_parameters=dict(full_attention=dict(rope_type="yarn"))), "rope_type"),
    (dict(rope_parameters=dict(full_attention=dict(rope_type="proportional",
                                                   partial_rotary_factor=3.0))),
     "partial_rotary_factor"),
])
def test_bad_gemma4_keys_name_the_key(kw, key):
    with pytest.raises(ModelFormatError) as e:
        parse_config(_with(GEMMA, **kw), "config.json")
    assert "config.json" in str(e.value) and key in str(e.value)


def test_gemma4_wrapper_vocab_wins():
    cfg = dict(model_type="gemma4", vocab_size=320, text_config=_with(GEMMA, vocab_size=999))
    assert parse_config(cfg).vocab_size == 320


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    hyb = pytest.importorskip("mlx_ref_hybrid")
    return hyb.make_model(tmp_path_factory.mktemp("qwen3_5"), "qwen3_5", None)


def _copy(src, dst, edit_config=None, edit_tensors=None):
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    if edit_config:
        edit_config(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(src / "model.safetensors")
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "mlx"})
    return dst


def test_conv_kernel_disagreeing_with_the_tensor_is_named(qwen_dir, tmp_path):
    d = _copy(qwen_dir, tmp_path / "m",
              edit_config=lambda c: c["text_config"].update(linear_conv_kernel_dim=3))
    with pytest.raises(ModelFormatError, match="conv1d.weight' has shape"):
        mlxr.validate(d)


def test_hf_layout_conv_weight_is_refused(qwen_dir, tmp_path):
    """Unsanitised HF files store conv1d as [C, 1, W]; mlxr reads mlx-lm's [C, W, 1] only."""
    def swap(t):
        for k in [k for k in t if k.endswith("conv1d.weight")]:
            t[k] = t[k].transpose(1, 2).contiguous()
    d = _copy(qwen_dir, tmp_path / "m", edit_tensors=swap)
    with pytest.raises(ModelFormatError, match="conv1d.weight"):
        mlxr.validate(d)


def test_other_modalities_are_skipped_unknown_tensors_refused(qwen_dir, tmp_path):
    def add(name):
        return lambda t: t.update({name: torch.zeros(2, 2)})

    ok = _copy(qwen_dir, tmp_path / "ok", edit_tensors=add("vision_tower.blocks.0.w"))
    mlxr.validate(ok)
    bad = _copy(qwen_dir, tmp_path / "bad",
                edit_tensors=add("language_model.model.layers.0.linear_attn.extra"))
    with pytest.raises(ModelFormatError, match="unexpected tensors.*linear_attn.extra"):
        mlxr.validate(bad)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    hyb = pytest.importorskip("mlx_ref_hybrid")
    return hyb.make_model(tmp_path_factory.mktemp("qwen3_5_moe"), "qwen3_5_moe",
                          dict(bits=4, group_size=64))


def test_expert_count_disagreeing_with_the_file_is_named(moe_dir, tmp_path):
    d = _copy(moe_dir, tmp_path / "m",
              edit_config=lambda c: c["text_config"].update(num_experts=8))
    with pytest.raises(ModelFormatError, match=r"layers\.0\.mlp\.(gate|switch_mlp)\S*' has "
                                               "shape"):
        mlxr.validate(d)


def test_moe_vision_tower_is_skipped_with_a_note(moe_dir, tmp_path, caplog):
    """qwen3_5_moe files converted with their vision tower: the tower is not read, and the
    load says so."""
    d = _copy(moe_dir, tmp_path / "m", edit_tensors=lambda t: t.update(
        {"vision_tower.blocks.0.attn.qkv.weight": torch.zeros(2, 2),
         "model.visual.merger.weight": torch.zeros(2, 2)}))
    mlxr.validate(d)
    with caplog.at_level("INFO", logger="mlxr.models.hybrid_loader"):
        mlxr.load(d, device="cpu", dtype="float32")
    assert "2 tensors of other modalities" in caplog.text
