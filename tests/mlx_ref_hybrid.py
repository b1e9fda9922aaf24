"""Tiny random hybrid-family models (qwen3_5, qwen3_5_moe, qwen3_next, gemma4_text, gemma4 and
its MoE variant) made, quantized and saved by
mlx-lm itself, as `mlx_ref` does for the dense families.

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

_QWEN35_TEXT = dict(
    model_type="qwen3_5_text", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, full_attention_interval=2,
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32,
    linear_value_head_dim=32, linear_conv_kernel_dim=4, vocab_size=320, rms_norm_eps=1e-6,
    tie_word_embeddings=True, max_position_embeddings=4096,
    rope_parameters=dict(rope_type="default", rope_theta=1e6, partial_rotary_factor=0.25,
                         mrope_section=[2, 1, 1]))

_GEMMA4_TEXT = dict(
    model_type="gemma4_text", hidden_size=64, num_hidden_layers=5, intermediate_size=128,
    num_attention_heads=2, num_key_value_heads=1, head_dim=32, global_head_dim=64,
    vocab_size=320, vocab_size_per_layer_input=320, hidden_size_per_layer_input=64,
    num_kv_shared_layers=2, sliding_window=8, sliding_window_pattern=2, rms_norm_eps=1e-6,
    final_logit_softcapping=30.0, max_position_embeddings=4096)

# the MoE block's keys: 4 experts, 2 per token, 64-wide (quantizable at group 64), a shared
# expert under its sigmoid gate
_QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                 shared_expert_intermediate_size=64)

_QWEN3_NEXT = dict(
    model_type="qwen3_next", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, full_attention_interval=2,
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32,
    linear_value_head_dim=32, linear_conv_kernel_dim=4, vocab_size=320, rms_norm_eps=1e-6,
    rope_theta=1e6, partial_rotary_factor=0.25, max_position_embeddings=4096,
    decoder_sparse_step=1, mlp_only_layers=[2], tie_word_embeddings=False, **_QWEN_MOE)

FAMILIES: dict[str, dict] = {
    # text_config wrapper, 2 gated DeltaNet + 2 gated-attention layers, Hv = 2 Hk
    "qwen3_5": dict(model_type="qwen3_5", text_config=_QWEN35_TEXT),
    "qwen3_5_untied": dict(model_type="qwen3_5", text_config=dict(
        _QWEN35_TEXT, tie_word_embeddings=False, linear_num_key_heads=4,
        attention_bias=True)),
    # sliding, full (512-style wide head, proportional rope), sliding, then two KV-shared
    # layers (full, sliding; double-wide MLPs) that read layers 1 and 2
    "gemma4_text": _GEMMA4_TEXT,
    # the wrapper with k = v on full layers and their own kv head count
    "gemma4": dict(model_type="gemma4", vocab_size=320, text_config=dict(
        _GEMMA4_TEXT, model_type="gemma4_text", attention_k_eq_v=True,
        num_global_key_value_heads=2, num_attention_heads=4)),
    # every layer sparse, norm_topk_prob at its qwen3_5 default (true)
    "qwen3_5_moe": dict(model_type="qwen3_5_moe", text_config=dict(
        _QWEN35_TEXT, model_type="qwen3_5_moe_text", **_QWEN_MOE)),
    # grouped in_proj_qkvz / in_proj_ba (Hv = 2 Hk), layer 2 a dense MLP (mlp_only_layers),
    # norm_topk_prob at its qwen3_next default (false)
    "qwen3_next": _QWEN3_NEXT,
    # the 26B-A4B shape in small: experts beside every dense MLP, k = v on full layers, no
    # per-layer embeddings or KV sharing
    "gemma4_moe": dict(model_type="gemma4", vocab_size=320, text_config=dict(
        _GEMMA4_TEXT, model_type="gemma4_text", attention_k_eq_v=True,
        num_global_key_value_heads=2, num_attention_heads=4, hidden_size_per_layer_input=0,
        num_kv_shared_layers=0, enable_moe_block=True, num_experts=4, top_k_experts=2,
        moe_intermediate_size=64)),
}


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
