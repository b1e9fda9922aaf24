"""make_checkpoint's hybrid shapes: the files it writes for every tiny hybrid config are what
mlxr's loader accepts (every tensor name, shape and dtype, the routers' 8-bit entries), and the
full-size hybrid MoE shapes parse to their MoE blocks, cut by --layers to whole 3:1 groups."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import mlxr
from hybrid_configs import FAMILIES
from mlxr.config import parse_config


@pytest.fixture(scope="module")
def mc(make_checkpoint):
    return make_checkpoint


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("recipe", [(4, 64, "affine"), None])
def test_written_tiny_hybrids_load(mc, family, recipe, tmp_path):
    out = mc.write_hybrid(copy.deepcopy(FAMILIES[family]), tmp_path / family, recipe)
    model = mlxr.load(out, device="cpu", dtype="float32")  # every tensor checked, none left
    logits = model.logits([1, 2, 3, 4, 5])
    assert logits.shape == (5, 320) and torch.isfinite(logits).all()
    quant = json.loads((out / "config.json").read_text()).get("quantization", {})
    assert bool(quant) == (recipe is not None)
    routers = [k for k in quant if k.endswith((".mlp.gate", "shared_expert_gate", "router.proj"))]
    assert bool(routers) == (model.config.moe is not None and recipe is not None)
    assert all(quant[k] == dict(bits=8, group_size=64, mode="affine") for k in routers)


@pytest.mark.parametrize("name,experts,k,layers", [("qwen3.5-35b-a3b", 256, 8, 40),
                                                   ("qwen3-next-80b-a3b", 512, 10, 48)])
def test_hybrid_moe_shapes_parse(mc, name, experts, k, layers):
    c = parse_config(copy.deepcopy(mc.HYBRID_MOE[name]))
    assert (c.moe.num_experts, c.moe.top_k, c.num_layers) == (experts, k, layers)
    assert c.moe.shared_gate and all(c.moe.sparse_layers)
    cut = parse_config(mc.hybrid_tables.cut(mc.HYBRID_MOE[name], 4))
    assert cut.arch.layer_types == ("linear_attention",) * 3 + ("full_attention",)
