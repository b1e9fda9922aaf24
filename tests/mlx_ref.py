"""Tiny random-weight models made, quantized and saved by mlx-lm itself, and its outputs.

These are real mlx-community-format files: the model class is mlx-lm's, quantization is
`mlx_lm.utils.quantize_model`, saving is `mlx_lm.utils.save_model` / `save_config`. The reference
outputs come from mlx-lm running the same files.
"""

from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.generate import generate_step
from mlx_lm.utils import MODEL_REMAPPING, load_model, quantize_model, save_config, save_model

BASE = dict(hidden_size=128, num_hidden_layers=2, intermediate_size=256, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=320,
            max_position_embeddings=4096)

FAMILIES: dict[str, dict] = {
    # Llama 3.1 style: llama3 rope scaling, untied head, attention bias.
    "llama": dict(model_type="llama", tie_word_embeddings=False, rope_theta=500000.0,
                  attention_bias=True, rope_scaling=dict(
                      rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=64)),
    # Llama 3.2 style: tied embeddings, explicit head_dim.
    "llama_tied": dict(model_type="llama", tie_word_embeddings=True, head_dim=64,
                       num_attention_heads=2, num_key_value_heads=1),
    "llama_linear": dict(model_type="llama", rope_scaling=dict(type="linear", factor=4.0)),
    "llama_dynamic": dict(model_type="llama", max_position_embeddings=32,
                          rope_scaling=dict(type="dynamic", factor=2.0)),
    "llama_sliding": dict(model_type="llama", num_hidden_layers=3, sliding_window=8,
                          layer_types=["sliding_attention", "full_attention",
                                       "sliding_attention"]),
    "mistral": dict(model_type="mistral", tie_word_embeddings=False, rope_theta=1e6,
                    head_dim=32),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True, rope_theta=1e6),
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=True, head_dim=32, rope_theta=1e6),
    "gemma": dict(model_type="gemma", head_dim=32, num_key_value_heads=1),
    "gemma2": dict(model_type="gemma2", head_dim=32, query_pre_attn_scalar=32.0,
                   attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    "gemma3_text": dict(model_type="gemma3_text", head_dim=32, num_hidden_layers=4,
                        sliding_window=8, sliding_window_pattern=2, query_pre_attn_scalar=32.0,
                        rope_scaling=dict(rope_type="linear", factor=8.0)),
    "phi3": dict(model_type="phi3", tie_word_embeddings=False, partial_rotary_factor=0.5,
                 max_position_embeddings=256, original_max_position_embeddings=64,
                 rope_scaling=dict(type="longrope", short_factor=[1.0 + 0.1 * i for i in range(8)],
                                   long_factor=[1.0 + 0.5 * i for i in range(8)])),
}


# Families for the GPU parity run only (scripts/make_gpu_fixtures.py): dimensions that the
# decode GEMVs' tensor-core kernel takes (K a multiple of 512), so greedy decode runs through
# it (decode_gemv_tc, and its nibble planes for the other affine widths).
WIDE: dict[str, dict] = {
    "qwen3_wide": dict(model_type="qwen3", tie_word_embeddings=True, hidden_size=512,
                       intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=128, rope_theta=1e6),
}


def mixed_predicate(path: str, module) -> bool | dict:
    """Per-layer recipe: an unquantized module, an 8-bit module, the rest at the default."""
    if path.endswith("layers.0.mlp.down_proj"):
        return False
    if path.endswith("v_proj") or path.endswith("qkv_proj"):
        return {"group_size": 64, "bits": 8, "mode": "affine"}
    return True


QUANTS: dict[str, dict | None] = {
    "bf16": None,
    "q4g64": dict(bits=4, group_size=64),
    "q4g32": dict(bits=4, group_size=32),
    "q4g128": dict(bits=4, group_size=128),
    "q2g64": dict(bits=2, group_size=64),
    "q3g64": dict(bits=3, group_size=64),
    "q5g64": dict(bits=5, group_size=64),
    "q6g64": dict(bits=6, group_size=64),
    "q8g64": dict(bits=8, group_size=64),
    "q3g32": dict(bits=3, group_size=32),
    "q6g128": dict(bits=6, group_size=128),
    "mxfp4": dict(mode="mxfp4"),
    "nvfp4": dict(mode="nvfp4"),
    "mxfp8": dict(mode="mxfp8"),
    "mixed": dict(bits=4, group_size=64, predicate=mixed_predicate),
}


def config_for(family: str) -> dict:
    cfg = dict(BASE)
    cfg.update(copy.deepcopy(FAMILIES[family] if family in FAMILIES else WIDE[family]))
    return cfg


def _randomize(model, seed: int) -> None:
    """Give every parameter a distinctive value: projections scaled up (mlx's default init makes a
    model that repeats one token), norms and biases random so (1+w) and biases matter."""
    mx.random.seed(seed)

    def f(path, p):
        if path.endswith("norm.weight"):
            return 1.0 + 0.3 * mx.random.normal(p.shape) if "gemma" not in model.model_type \
                else 0.3 * mx.random.normal(p.shape)
        if path.endswith(".bias"):
            return 0.2 * mx.random.normal(p.shape)
        if "embed_tokens" in path:  # gemma multiplies embeddings by sqrt(hidden)
            return (0.03 if "gemma" in model.model_type else 0.25) * mx.random.normal(p.shape)
        return 3.0 * p

    model.update(tree_map_with_path(f, model.parameters()))


def make_model(out: Path, family: str, quant: str, seed: int = 0) -> Path:
    """Build, (quantize,) and save a tiny mlx-lm model; returns the directory."""
    cfg = config_for(family)
    mt = MODEL_REMAPPING.get(cfg["model_type"], cfg["model_type"])
    arch = importlib.import_module(f"mlx_lm.models.{mt}")
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict(cfg))
    _randomize(model, seed + 1)
    model.set_dtype(mx.bfloat16)  # real checkpoints are bf16 before quantization
    q = QUANTS[quant]
    if q is not None:
        q = dict(q)
        pred = q.pop("predicate", None)
        model, cfg = quantize_model(model, cfg, q.get("group_size"), q.get("bits"),
                                    mode=q.get("mode", "affine"), quant_predicate=pred)
    mx.eval(model.parameters())
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model)
    save_config(cfg, out / "config.json")
    return out


@dataclass
class Reference:
    prompt: list[int]
    greedy: list[int]  # mlx-lm's greedy continuation (float32 params)
    logits32: np.ndarray  # [T, V] teacher-forced over prompt + greedy, float32 params
    logits_bf16: np.ndarray  # [T, V] same sequence, the model as loaded (bf16 activations)


def reference(path: Path, prompt: list[int], max_tokens: int = 32) -> Reference:
    """mlx-lm's outputs on a saved model: greedy continuation and teacher-forced logits."""
    model, _ = load_model(path)
    seq_model = model
    logits_bf16 = np.array(seq_model(mx.array(prompt)[None])[0].astype(mx.float32))
    model32, _ = load_model(path)
    model32.set_dtype(mx.float32)  # every float parameter; packed codes (uint32) untouched
    greedy = []
    for tok, _ in generate_step(mx.array(prompt), model32, max_tokens=max_tokens):
        greedy.append(int(tok))
    seq = prompt + greedy
    logits32 = np.array(model32(mx.array(seq)[None])[0].astype(mx.float32))
    logits_bf16 = np.array(model(mx.array(seq)[None])[0].astype(mx.float32))
    return Reference(prompt, greedy, logits32, logits_bf16)


def param_names(path: Path) -> list[str]:
    return sorted(k for k, _ in tree_flatten(load_model(path)[0].parameters()))
