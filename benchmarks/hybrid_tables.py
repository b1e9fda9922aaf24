"""Tensor tables of the hybrid shapes `make_checkpoint.py` writes: qwen3_5, qwen3_5_moe and
qwen3_next (gated DeltaNet + gated attention, dense MLP or the MoE block) and gemma4 (with
its MoE variant). Each table maps a module path to (out, in, lead, recipe) as
`make_checkpoint.moe_modules` does (lead: stacked experts; recipe (bits, group, mode) or None
for bf16), beside its norms (path -> size) and raw tensors (name -> tensor).

Names and layouts are what mlx-lm 0.32.2 saves after its `sanitize`: conv1d [C, W, 1],
A_log float32, experts stacked [X, out, in] under switch_mlp / switch_glu, qwen3_next's
in_proj_qkvz / in_proj_ba grouped per key head. In quantized files the routers and
shared-expert gates are affine 8-bit g64, as the families' quant_predicate makes
mlx_lm.convert write them; recipe None writes everything bf16.
"""

from __future__ import annotations

import torch

Q8 = (8, 64, "affine")

HYBRID_MOE_SHAPES = {
    # Qwen3.5-35B-A3B's text model (the vision tower is not written): 40 layers, 3 gated
    # DeltaNet per gated-attention layer, every MLP 256 experts (8 routed) + 1 shared
    "qwen3.5-35b-a3b": dict(model_type="qwen3_5_moe", tie_word_embeddings=False, text_config=dict(
        model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, full_attention_interval=4, num_experts=256,
        num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        norm_topk_prob=True, vocab_size=248320, tie_word_embeddings=False, rms_norm_eps=1e-6,
        max_position_embeddings=262144, rope_parameters=dict(
            rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
            mrope_section=[11, 11, 10]))),
    # Qwen3-Next-80B-A3B: 48 layers, 512 experts (10 routed) + 1 shared in every layer
    "qwen3-next-80b-a3b": dict(
        model_type="qwen3_next", hidden_size=2048, num_hidden_layers=48, intermediate_size=5120,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, full_attention_interval=4, num_experts=512,
        num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, vocab_size=151936,
        tie_word_embeddings=False, rope_theta=10000000.0, partial_rotary_factor=0.25,
        rms_norm_eps=1e-6, max_position_embeddings=262144),
}


def text_config(cfg: dict) -> dict:
    """The text model's keys (the wrappers' text_config, else the config itself)."""
    return cfg.get("text_config", cfg)


def cut(cfg: dict, n: int) -> dict:
    """The shape with its first n layers."""
    cfg = dict(cfg)
    if "text_config" in cfg:
        cfg["text_config"] = dict(cfg["text_config"], num_hidden_layers=n)
    else:
        cfg["num_hidden_layers"] = n
    return cfg


def narrow_gemma4(cfg: dict) -> dict:
    """A gemma4 shape at small widths (hidden 128, PLE 64, vocab 512), its structure kept:
    layer count, KV sharing, the sliding / full pattern and window, the double-wide MLP."""
    cfg = dict(cfg, vocab_size=512)
    cfg["text_config"] = dict(cfg["text_config"], hidden_size=128, intermediate_size=128,
                              num_attention_heads=2, head_dim=64, global_head_dim=128,
                              hidden_size_per_layer_input=64, vocab_size=512,
                              vocab_size_per_layer_input=512)
    return cfg


def _prefix(cfg: dict) -> str:
    return "language_model.model." if "text_config" in cfg else "model."


def _sparse(t: dict, i: int) -> bool:
    """Layer i has the MoE block (mlx-lm's rule per family)."""
    if not t.get("num_experts"):
        return False
    if t.get("model_type") != "qwen3_next":
        return True
    return i not in t["mlp_only_layers"] and (i + 1) % t["decoder_sparse_step"] == 0


def _qwen_moe(mods: dict, p: str, t: dict, recipe) -> None:
    e, x, f, s = (t["hidden_size"], t["num_experts"], t["moe_intermediate_size"],
                  t["shared_expert_intermediate_size"])
    for name, o, n in (("gate_proj", f, e), ("up_proj", f, e), ("down_proj", e, f)):
        mods[p + "mlp.switch_mlp." + name] = (o, n, (x,), recipe)
    for name, o, n in (("gate_proj", s, e), ("up_proj", s, e), ("down_proj", e, s)):
        mods[p + "mlp.shared_expert." + name] = (o, n, (), recipe)
    router = None if recipe is None else Q8
    mods[p + "mlp.gate"] = (x, e, (), router)
    mods[p + "mlp.shared_expert_gate"] = (1, e, (), router)


def qwen_tables(cfg: dict, g: torch.Generator, recipe) -> tuple[dict, dict, dict]:
    """qwen3_5 / qwen3_5_moe / qwen3_next: modules, norms, raw tensors."""
    t = text_config(cfg)
    e, L = t["hidden_size"], t["num_hidden_layers"]
    h, k, d = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    hk, hv = t["linear_num_key_heads"], t["linear_num_value_heads"]
    dk, dv, w = t["linear_key_head_dim"], t["linear_value_head_dim"], t["linear_conv_kernel_dim"]
    conv = 2 * hk * dk + hv * dv
    m = _prefix(cfg)
    mods = {m + "embed_tokens": (t["vocab_size"], e, (), recipe)}
    if not t.get("tie_word_embeddings", False):
        mods[("language_model." if "text_config" in cfg else "") + "lm_head"] = (
            t["vocab_size"], e, (), recipe)
    norms, raw = {m + "norm": e}, {}
    for i in range(L):
        p = f"{m}layers.{i}."
        if (i + 1) % t["full_attention_interval"]:
            a = p + "linear_attn."
            if t.get("model_type") == "qwen3_next":  # rows grouped per key head
                mods.update({a + "in_proj_qkvz": (2 * hk * dk + 2 * hv * dv, e, (), recipe),
                             a + "in_proj_ba": (2 * hv, e, (), recipe)})
            else:
                mods.update({a + "in_proj_qkv": (conv, e, (), recipe),
                             a + "in_proj_z": (hv * dv, e, (), recipe),
                             a + "in_proj_b": (hv, e, (), recipe),
                             a + "in_proj_a": (hv, e, (), recipe)})
            mods[a + "out_proj"] = (e, hv * dv, (), recipe)
            norms[a + "norm"] = dv
            raw[a + "conv1d.weight"] = (0.3 * torch.randn(conv, w, 1, generator=g)).bfloat16()
            raw[a + "A_log"] = torch.log(1 + 15 * torch.rand(hv, generator=g))
            raw[a + "dt_bias"] = torch.ones(hv, dtype=torch.bfloat16)
        else:
            a = p + "self_attn."
            mods.update({a + "q_proj": (2 * h * d, e, (), recipe),
                         a + "k_proj": (k * d, e, (), recipe),
                         a + "v_proj": (k * d, e, (), recipe),
                         a + "o_proj": (e, h * d, (), recipe)})
            norms.update({a + "q_norm": d, a + "k_norm": d})
            if t.get("attention_bias"):
                for name, o in (("q_proj", 2 * h * d), ("k_proj", k * d), ("v_proj", k * d),
                                ("o_proj", e)):
                    raw[a + name + ".bias"] = torch.zeros(o, dtype=torch.bfloat16)
        if _sparse(t, i):
            _qwen_moe(mods, p, t, recipe)
        else:
            f = t["intermediate_size"]
            mods.update({p + "mlp.gate_proj": (f, e, (), recipe),
                         p + "mlp.up_proj": (f, e, (), recipe),
                         p + "mlp.down_proj": (e, f, (), recipe)})
        norms.update({p + "input_layernorm": e, p + "post_attention_layernorm": e})
    return mods, norms, raw


def gemma4_tables(cfg: dict, g: torch.Generator, recipe) -> tuple[dict, dict, dict]:
    """gemma4 / gemma4_text (per-layer embeddings, KV sharing, k = v full layers and the MoE
    block where the config has them): modules, norms, raw tensors."""
    t = text_config(cfg)
    e, f, L = t["hidden_size"], t["intermediate_size"], t["num_hidden_layers"]
    h, k = t["num_attention_heads"], t["num_key_value_heads"]
    pat, ple = t["sliding_window_pattern"], t.get("hidden_size_per_layer_input", 256)
    first_shared = L - t.get("num_kv_shared_layers", 20)
    wide = t.get("use_double_wide_mlp", True) and first_shared < L
    k_eq_v = t.get("attention_k_eq_v", False)
    m = _prefix(cfg)
    mods = {m + "embed_tokens": (cfg.get("vocab_size", t["vocab_size"]), e, (), recipe)}
    norms, raw = {m + "norm": e}, {}
    if ple:
        mods.update({m + "embed_tokens_per_layer": (t["vocab_size_per_layer_input"], L * ple,
                                                    (), recipe),
                     m + "per_layer_model_projection": (L * ple, e, (), recipe)})
        norms[m + "per_layer_projection_norm"] = ple
    for i in range(L):
        p, a = f"{m}layers.{i}.", f"{m}layers.{i}.self_attn."
        full = i % pat == pat - 1
        d = t["global_head_dim"] if full else t["head_dim"]
        kv = t.get("num_global_key_value_heads") or k if full and k_eq_v else k
        fi = 2 * f if wide and i >= first_shared else f
        mods.update({a + "q_proj": (h * d, e, (), recipe), a + "o_proj": (e, h * d, (), recipe),
                     p + "mlp.gate_proj": (fi, e, (), recipe),
                     p + "mlp.up_proj": (fi, e, (), recipe),
                     p + "mlp.down_proj": (e, fi, (), recipe)})
        norms[a + "q_norm"] = d
        if i < first_shared:
            mods[a + "k_proj"] = (kv * d, e, (), recipe)
            if not (full and k_eq_v):
                mods[a + "v_proj"] = (kv * d, e, (), recipe)
            norms[a + "k_norm"] = d
        if ple:
            mods.update({p + "per_layer_input_gate": (ple, e, (), recipe),
                         p + "per_layer_projection": (e, ple, (), recipe)})
            norms[p + "post_per_layer_input_norm"] = e
        names = ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"]
        if t.get("enable_moe_block"):
            x, fm = t["num_experts"], t["moe_intermediate_size"]
            for name, o, n in (("gate_proj", fm, e), ("up_proj", fm, e), ("down_proj", e, fm)):
                mods[p + "experts.switch_glu." + name] = (o, n, (x,), recipe)
            mods[p + "router.proj"] = (x, e, (), None if recipe is None else Q8)
            raw[p + "router.scale"] = torch.ones(e, dtype=torch.bfloat16)
            raw[p + "router.per_expert_scale"] = torch.ones(x, dtype=torch.bfloat16)
            names += ["pre_feedforward_layernorm_2", "post_feedforward_layernorm_1",
                      "post_feedforward_layernorm_2"]
        norms.update({p + n: e for n in names})
        raw[p + "layer_scalar"] = torch.ones(1, dtype=torch.bfloat16)
    return mods, norms, raw


def tables(cfg: dict, g: torch.Generator, recipe) -> tuple[dict, dict, dict]:
    """The tables of a hybrid config (recipe: every module's but the routers')."""
    if cfg["model_type"] in ("gemma4", "gemma4_text"):
        return gemma4_tables(cfg, g, recipe)
    return qwen_tables(cfg, g, recipe)
