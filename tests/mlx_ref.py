"""Tiny random-weight models made, quantized and saved by mlx-lm itself, and its outputs.

These are real mlx-community-format files: the model class is mlx-lm's, quantization is
`mlx_lm.utils.quantize_model`, saving is `mlx_lm.utils.save_model` / `save_config`. The reference
outputs come from mlx-lm running the same files.
"""

from __future__ import annotations

import copy
import importlib
import random
import zlib
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map_with_path, tree_unflatten
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
    # tests/test_tensor_parallel.py: 8 heads over 2 KV heads (4 ranks replicate each KV head
    # twice), o_proj's and down_proj's inputs split on whole 64-groups at 2 and 4 ranks
    "llama_tp": dict(model_type="llama", tie_word_embeddings=False, attention_bias=True,
                     num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                     intermediate_size=512, rope_theta=500000.0),
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


# Mixture-of-experts families (tests/test_parity_moe.py): a mixed dense / MoE layer stack
# (qwen3_moe's mlp_only_layers, laguna's dense layer 0), sliding layers beside full ones with
# windows shorter than the test sequences, YaRN with an original length they pass.
MOE_FAMILIES: dict[str, dict] = {
    "qwen3_moe": dict(model_type="qwen3_moe", num_hidden_layers=3, head_dim=32, rope_theta=1e6,
                      tie_word_embeddings=True, num_experts=8, num_experts_per_tok=2,
                      decoder_sparse_step=1, mlp_only_layers=[1], moe_intermediate_size=64,
                      norm_topk_prob=True),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2,
                    intermediate_size=128, tie_word_embeddings=False, rope_theta=1e6),
    "gpt_oss": dict(model_type="gpt_oss", num_hidden_layers=4, head_dim=32, intermediate_size=64,
                    num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
                    rope_theta=150000.0,
                    layer_types=["sliding_attention", "full_attention"] * 2,
                    rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0,
                                      beta_slow=1.0, original_max_position_embeddings=16,
                                      truncate=False)),
    "laguna": dict(model_type="laguna", num_hidden_layers=4, head_dim=32, intermediate_size=256,
                   num_attention_heads_per_layer=[4, 6, 6, 6], sliding_window=8,
                   layer_types=["full_attention"] + ["sliding_attention"] * 3,
                   mlp_layer_types=["dense"] + ["sparse"] * 3, num_experts=16,
                   num_experts_per_tok=4, moe_intermediate_size=64,
                   shared_expert_intermediate_size=64, moe_routed_scaling_factor=2.5,
                   gating="per-head", tie_word_embeddings=False,
                   rope_parameters={
                       "full_attention": dict(rope_type="yarn", rope_theta=500000.0, factor=32.0,
                                              original_max_position_embeddings=16,
                                              beta_fast=64.0, beta_slow=1.0,
                                              partial_rotary_factor=0.5),
                       "sliding_attention": dict(rope_type="default", rope_theta=10000.0,
                                                 partial_rotary_factor=1.0)}),
}


def laguna_recipe(path: str, module) -> bool:
    """Poolside's Laguna-XS-2.1 NVFP4 export: only the routed and shared experts quantized
    (nvfp4, no global scale); attention, router, embeddings, head, layer-0 MLP in bf16."""
    return "switch_mlp" in path or "shared_expert" in path


def gpt_oss_recipe(path: str, module) -> bool | dict:
    """gpt-oss as mlx-community's MXFP4-Q8 conversions ship it: mxfp4 experts, every other
    quantizable module affine 8-bit, group 64."""
    if ".experts." in path:
        return {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    return {"group_size": 64, "bits": 8, "mode": "affine"}


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
    "laguna_nvfp4": dict(mode="nvfp4", predicate=laguna_recipe),
    "nvfp4_gs": dict(mode="nvfp4", global_scale=True),
    "mxfp4_q8": dict(bits=8, group_size=64, predicate=gpt_oss_recipe),
}


def config_for(family: str) -> dict:
    cfg = dict(BASE)
    cfg.update(copy.deepcopy({**FAMILIES, **WIDE, **MOE_FAMILIES}[family]))
    return cfg


def _randomize(model, seed: int) -> None:
    """Give every parameter a distinctive value: projections scaled up (mlx's default init makes a
    model that repeats one token), norms and biases random so (1+w) and biases matter."""
    mx.random.seed(seed)

    def f(path, p):
        if path.endswith("norm.weight"):
            return 1.0 + 0.3 * mx.random.normal(p.shape) if "gemma" not in model.model_type \
                else 0.3 * mx.random.normal(p.shape)
        if path.endswith(".bias") or path.endswith("sinks"):
            return 0.2 * mx.random.normal(p.shape)
        if path.endswith("e_score_correction_bias"):  # steers the selection, as trained
            return 0.05 * mx.random.normal(p.shape)
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
    # real checkpoints are bf16 before quantization; as mlx_lm.convert casts (a family's
    # cast_predicate keeps e.g. laguna's e_score_correction_bias in float32)
    keep = getattr(model, "cast_predicate", lambda _: True)
    model.update(tree_map_with_path(
        lambda k, v: v.astype(mx.bfloat16) if keep(k) and mx.issubdtype(v.dtype, mx.floating)
        else v, model.parameters()))
    q = QUANTS[quant]
    if q is not None:
        q = dict(q)
        pred = q.pop("predicate", None)
        model, cfg = quantize_model(model, cfg, q.get("group_size"), q.get("bits"),
                                    mode=q.get("mode", "affine"),
                                    global_scale=q.get("global_scale", False),
                                    quant_predicate=pred)
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
    # [T, V] same sequence, the model as loaded (bf16 activations); None where mlx cannot
    logits_bf16: np.ndarray | None


def _dequantize_global_scaled(model) -> None:
    """mlx's CPU gather_qmm refuses nvfp4 experts with a per-expert global scale (GPU only),
    and mlx-lm 0.32.2's dequantize_model drops that scale: replace such switch layers by
    float ones holding mx.dequantize's values (global scale included), expert by expert."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    swaps = []
    for name, m in model.named_modules():
        if isinstance(m, QuantizedSwitchLinear) and m.global_scale is not None:
            w = mx.stack([mx.dequantize(m.weight[e], m.scales[e], None, m.group_size, m.bits,
                                        m.mode, global_scale=m.global_scale[e])
                          for e in range(m.weight.shape[0])]).astype(mx.float32)
            f = SwitchLinear(w.shape[2], w.shape[1], w.shape[0], bias="bias" in m)
            f.weight = w
            if "bias" in m:
                f.bias = m.bias
            swaps.append((name, f))
    if swaps:
        model.update_modules(tree_unflatten(swaps))


def reference(path: Path, prompt: list[int], max_tokens: int = 32) -> Reference:
    """mlx-lm's outputs on a saved model: greedy continuation and teacher-forced logits."""
    model, _ = load_model(path)
    model32, _ = load_model(path)
    _dequantize_global_scaled(model32)
    model32.set_dtype(mx.float32)  # every float parameter; packed codes (uint32) untouched
    greedy = []
    for tok, _ in generate_step(mx.array(prompt), model32, max_tokens=max_tokens):
        greedy.append(int(tok))
    seq = prompt + greedy
    logits32 = np.array(model32(mx.array(seq)[None])[0].astype(mx.float32))
    try:
        logits_bf16 = np.array(model(mx.array(seq)[None])[0].astype(mx.float32))
    except (RuntimeError, ValueError):  # mlx's CPU gather_mm (float experts) runs only in
        # float32, its gather_qmm takes no global scale
        logits_bf16 = None
    return Reference(prompt, greedy, logits32, logits_bf16)


def param_names(path: Path) -> list[str]:
    return sorted(k for k, _ in tree_flatten(load_model(path)[0].parameters()))


def _selection_scores(family: str, block, x):
    """The scores mlx-lm's router of `family` ranks the experts by (its top-k of them)."""
    if family == "qwen3_moe":
        return mx.softmax(block.gate(x), axis=-1, precise=True)
    if family == "mixtral":
        return block.gate(x)
    if family == "gpt_oss":
        return block.router(x)
    gate = block.gate  # laguna: sigmoid scores plus the correction bias
    return mx.sigmoid(gate.proj(x).astype(mx.float32)) + gate.e_score_correction_bias


def router_choices(path: Path, family: str, seq: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """mlx-lm's expert selection over seq (teacher-forced, float32 params), per MoE layer and
    position: the selected experts [L, T, k] (sorted ids), and the gap between the k-th and
    (k+1)-th selection scores relative to the row's score range [L, T] (a gap this small lets
    float32 rounding pick another set)."""
    model, _ = load_model(path)
    _dequantize_global_scaled(model)
    model.set_dtype(mx.float32)
    seen = []
    for layer in model.layers:
        block = getattr(layer, "block_sparse_moe", None) or layer.mlp
        if not (hasattr(block, "switch_mlp") or hasattr(block, "experts")):
            continue
        cls = type(block)

        def record(self, x, _cls=cls):
            seen.append((self, x))
            return _cls.__call__(self, x)

        block.__class__ = type(f"Recording{cls.__name__}", (cls,), {"__call__": record})
    model(mx.array(seq)[None])
    k = MOE_FAMILIES[family]["num_experts_per_tok"]
    gaps, sets = [], []
    for block, x in seen:
        scores = np.array(_selection_scores(family, block, x)[0].astype(mx.float32))
        order = np.argsort(scores, -1, kind="stable")
        s = np.take_along_axis(scores, order, -1)
        gaps.append((s[:, -k] - s[:, -k - 1]) / (s[:, -1] - s[:, 0]))
        sets.append(np.sort(order[:, -k:], -1))
    return np.stack(sets), np.stack(gaps)



def stable_prompt(family: str, quant: str, vocab: int, n: int = 24) -> list[int]:
    """A random prompt of `n` ids, the same for a (family, quant) case on every run."""
    rng = random.Random(zlib.crc32(f"{family}/{quant}".encode()))
    return [rng.randrange(vocab) for _ in range(n)]


def logit_range(logits: np.ndarray) -> np.ndarray:
    """Each position's logit range: the scale the parity tolerances are fractions of."""
    return logits.max(-1) - logits.min(-1)


def top2_margin(logits: np.ndarray) -> np.ndarray:
    """Each position's gap between its two largest logits (a greedy near-tie when small)."""
    part = np.sort(logits, axis=-1)
    return part[..., -1] - part[..., -2]
