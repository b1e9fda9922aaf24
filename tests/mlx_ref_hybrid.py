"""Tiny random hybrid-family models (`hybrid_configs.FAMILIES`: qwen3_5, qwen3_5_moe, qwen3_next,
gemma4_text, gemma4 and its MoE variant) made, quantized and saved by mlx-lm itself, as
`mlx_ref` does for the dense families.

Differences from `mlx_ref.make_model`: the cast to bf16 honours the model's `cast_predicate`
(qwen3_5 keeps A_log in float32, as mlx-lm's convert does), and the randomisation keeps the
gated DeltaNet's decay meaningful (A_log and dt_bias of a real model's scale: the state neither
vanishes in one step nor never decays).
"""

from __future__ import annotations

import copy
import importlib
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.utils import quantize_model, save_config, save_model

from hybrid_configs import FAMILIES


def config_for(family: str) -> dict:
    return copy.deepcopy(FAMILIES[family])


def _randomize(model, seed: int) -> None:
    mx.random.seed(seed)

    def f(path: str, p):
        if path.endswith("A_log"):  # decay rates exp(A_log) in [0.5, 8]
            return mx.log(mx.random.uniform(0.5, 8.0, p.shape))
        if path.endswith("dt_bias"):
            return 0.5 * mx.random.normal(p.shape) - 1.0
        if path.endswith("per_expert_scale"):
            return 1.0 + 0.3 * mx.random.normal(p.shape)
        if path.endswith("layer_scalar"):
            return 1.0 + 0.2 * mx.random.normal(p.shape)
        if path.endswith("norm.weight"):
            return 1.0 + 0.3 * mx.random.normal(p.shape)
        if path.endswith(".bias"):
            return 0.2 * mx.random.normal(p.shape)
        if "embed_tokens" in path:
            return (0.03 if "gemma" in model.model_type else 0.25) * mx.random.normal(p.shape)
        return 3.0 * p

    model.update(tree_map_with_path(f, model.parameters()))


def make_model(out: Path, family: str, quant: dict | None, seed: int = 0) -> Path:
    """Build, cast to bf16 (keeping what `cast_predicate` keeps), quantize and save."""
    cfg = config_for(family)
    arch = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict(copy.deepcopy(cfg)))
    _randomize(model, seed + 1)
    inner = getattr(model, "language_model", model)
    keep = getattr(inner, "cast_predicate", None)

    def cast(path: str, p):
        if keep is not None and not keep(path):
            return p
        return p.astype(mx.bfloat16) if mx.issubdtype(p.dtype, mx.floating) else p

    model.update(tree_map_with_path(cast, model.parameters()))
    if quant is not None:
        model, cfg = quantize_model(model, cfg, quant.get("group_size"), quant.get("bits"),
                                    mode=quant.get("mode", "affine"))
    mx.eval(model.parameters())
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model)
    save_config(cfg, out / "config.json")
    return out


def param_names(model) -> list[str]:
    return sorted(k for k, _ in tree_flatten(model.parameters()))
