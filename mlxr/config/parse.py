"""config.json -> ModelConfig: the dense and MoE families here (mlx-lm's per-family
defaults, key aliases and conventions normalised so the model code reads plain fields), the
hybrid families in `hybrid.py`; then `checks.py`'s value rules.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from .. import bounded_json
from ..errors import ModelFormatError
from .checks import check_model_config, positive
from .hybrid import Nested, parse_hybrid
from .moe import MOE_TYPES, layer_kinds, layer_list, parse_moe
from .reader import _MISSING, LIMITS, _eos_ids, _Reader, _rope_scaling, parse_quant
from .spec import ModelConfig, RopeSpec

DENSE = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3")
HYBRID = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "gemma4", "gemma4_text")  # config.hybrid
SUPPORTED = DENSE + MOE_TYPES + HYBRID


def parse_config(raw: dict, source: str = "config.json") -> ModelConfig:
    """Normalise an HF/mlx-lm config dict into a ModelConfig (mlx-lm's per-family defaults)."""
    if not isinstance(raw, dict):
        raise ModelFormatError(f"{source}: must be a JSON object")
    mt = raw.get("model_type")
    if mt is None:
        raise ModelFormatError(f"{source}: key 'model_type' is required but missing")
    if mt not in SUPPORTED:
        raise ModelFormatError(
            f"{source}: model_type {mt!r} is not supported (supported: {', '.join(SUPPORTED)})"
        )
    if mt in HYBRID:  # the same value rules (rope fields, norms, softcaps) as the rest
        config = parse_hybrid(raw, source)
        check_model_config(config, source)
        return config
    r = _Reader(raw, source)
    gemma3 = mt == "gemma3_text"
    d3 = gemma3  # gemma3_text has a default for every key
    hidden = r.int("hidden_size", 1152 if d3 else _MISSING)
    layers = r.int("num_hidden_layers", 26 if d3 else _MISSING)
    heads = r.int("num_attention_heads", 4 if d3 else _MISSING)
    kv_default = (heads if mt in ("llama", "mistral", "phi3", "mixtral") else
                  8 if mt in ("gpt_oss", "laguna") else (1 if d3 else _MISSING))
    kv_heads = r.int("num_key_value_heads", kv_default)
    if heads % kv_heads:
        raise ModelFormatError(
            f"{source}: num_attention_heads ({heads}) is not a multiple of "
            f"num_key_value_heads ({kv_heads})"
        )
    if mt in ("qwen3", "gemma", "gemma2", "qwen3_moe"):
        head_dim = r.int("head_dim")
    elif mt in ("gpt_oss", "laguna"):
        head_dim = r.int("head_dim", 64 if mt == "gpt_oss" else 128)
    elif d3:
        head_dim = r.int("head_dim", 256)
    elif mt in ("llama", "mistral"):
        head_dim = r.int("head_dim", hidden // heads)
    else:
        head_dim = hidden // heads
    if head_dim < 2 or head_dim % 2:
        raise ModelFormatError(f"{source}: head_dim {head_dim} must be even")
    vocab = r.int("vocab_size", 262144 if d3 else _MISSING)
    inter = r.int("intermediate_size", {"gemma3_text": 6912, "mixtral": 14336, "gpt_oss": 2880,
                                        "laguna": 8192}.get(mt, _MISSING))
    eps = r.float("rms_norm_eps", {"gemma3_text": 1e-6, "mixtral": 1e-5, "gpt_oss": 1e-5,
                                   "laguna": 1e-6}.get(mt, _MISSING))
    max_pos = r.int("max_position_embeddings", {"qwen2": 32768, "phi3": 131072,
                                                  "gemma3_text": 32768, "mixtral": 32768,
                                                  "gpt_oss": 131072,
                                                  "laguna": 262144}.get(mt, 4096))
    kw: dict = {}
    traditional = r.bool("rope_traditional", False)
    windows: list[int | None] = [None] * layers
    if mt in ("llama", "mistral"):
        theta = r.float("rope_theta", 10000.0)
        b = r.bool("attention_bias", False)
        kw.update(qkv_bias=b, o_bias=b, mlp_bias=r.bool("mlp_bias", False))
        tie = r.bool("tie_word_embeddings", True)
        ropes = [RopeSpec(head_dim, theta, traditional, _rope_scaling(r), max_pos)] * layers
        layer_types = raw.get("layer_types")
        if layer_types is not None:
            if not isinstance(layer_types, list) or len(layer_types) != layers:
                raise ModelFormatError(f"{source}: 'layer_types' must list {layers} entries")
            if "full_attention" not in layer_types:
                raise ModelFormatError(f"{source}: 'layer_types' has no full_attention layer")
            window = r.int("sliding_window") if "sliding_attention" in layer_types else None
            windows = [window if t == "sliding_attention" else None for t in layer_types]
    elif mt == "qwen2":
        theta = r.float("rope_theta", 1e6)
        kw.update(qkv_bias=True)
        tie = r.bool("tie_word_embeddings", True)
        ropes = [RopeSpec(head_dim, theta, traditional, _rope_scaling(r), max_pos)] * layers
    elif mt == "qwen3":
        params = r.dict("rope_parameters")
        theta = raw.get("rope_theta")
        scaling = _rope_scaling(r)
        if params:
            theta = theta if theta is not None else params.get("rope_theta")
            scaling = scaling if scaling is not None else _rope_scaling(r, "rope_parameters")
        if theta is None:
            raise ModelFormatError(f"{source}: key 'rope_theta' is required but missing")
        theta = _Reader({"rope_theta": theta}, source).float("rope_theta")
        kw.update(qk_norm=True)
        tie = r.bool("tie_word_embeddings")
        ropes = [RopeSpec(head_dim, theta, traditional, scaling, max_pos)] * layers
    elif mt in ("gemma", "gemma2"):
        theta = r.float("rope_theta", 10000.0)
        kw.update(norm_offset=1.0, embed_scale=math.sqrt(hidden))
        tie = True
        ropes = [RopeSpec(head_dim, theta, traditional)] * layers
        if mt == "gemma":
            kw.update(hidden_act="gelu")
        else:
            kw.update(
                hidden_act="gelu_tanh", sandwich_norm=True,
                attn_scale=positive(r.float("query_pre_attn_scalar", 144.0),
                                    f"{source}: query_pre_attn_scalar") ** -0.5,
                attn_logit_softcap=r.float("attn_logit_softcapping", 50.0),
                final_logit_softcap=r.float("final_logit_softcapping", 30.0),
            )
    elif gemma3:
        pattern = r.int("sliding_window_pattern", 6)
        window = r.int("sliding_window", 512)
        local = RopeSpec(head_dim, r.float("rope_local_base_freq", 10000.0), False)
        glob = RopeSpec(head_dim, r.float("rope_theta", 1e6), False, _rope_scaling(r), max_pos)
        is_global = [i % pattern == pattern - 1 for i in range(layers)]
        ropes = [glob if g else local for g in is_global]
        windows = [None if g else window for g in is_global]
        kw.update(
            qk_norm=True, norm_offset=1.0, embed_scale=math.sqrt(hidden), embed_scale_bf16=True,
            hidden_act="gelu_tanh", sandwich_norm=True, clip_residual_fp16=True,
            attn_scale=positive(r.float("query_pre_attn_scalar", 256.0),
                                f"{source}: query_pre_attn_scalar") ** -0.5,
        )
        tie = None
    elif mt in MOE_TYPES:
        tie, ropes, windows = _moe_family(r, mt, layers, heads, kv_heads, head_dim, max_pos,
                                          traditional, kw)
    else:  # phi3
        theta = r.float("rope_theta", 10000.0)
        partial = r.float("partial_rotary_factor", 1.0)
        rope_dims = int(head_dim * partial) if 0 < partial <= 1 else 0
        if rope_dims < 2 or rope_dims % 2 or rope_dims > head_dim:
            raise ModelFormatError(f"{source}: partial_rotary_factor {partial} is invalid")
        scaling = _rope_scaling(r)
        if scaling is not None:
            if scaling["rope_type"] not in ("longrope", "su", "linear"):
                scaling = None  # mlx-lm disables unsupported phi3 scaling (with a warning)
            elif scaling["rope_type"] != "linear":
                scaling["original_max_position_embeddings"] = r.int(
                    "original_max_position_embeddings", 4096)
                factors = scaling.get("long_factor")
                if not isinstance(factors, list) or len(factors) != rope_dims // 2:
                    raise ModelFormatError(
                        f"{source}: rope_scaling.long_factor must have {rope_dims // 2} entries")
        kw.update(fused_qkv=True, fused_gate_up=True)
        tie = r.bool("tie_word_embeddings", False)
        ropes = [RopeSpec(rope_dims, theta, traditional, scaling, max_pos)] * layers
    if kw.get("attn_scale") is None:
        kw["attn_scale"] = head_dim**-0.5
    for w in windows:
        if w is not None and not 1 <= w <= LIMITS["sliding_window"]:
            raise ModelFormatError(f"{source}: sliding_window {w} is out of range")
    bos = raw.get("bos_token_id")
    config = ModelConfig(
        model_type=mt, vocab_size=vocab, hidden_size=hidden, num_layers=layers,
        num_heads=kw.pop("num_heads", heads),
        num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=inter, rms_norm_eps=eps,
        max_position_embeddings=max_pos, tie_word_embeddings=tie, layer_rope=tuple(ropes),
        layer_window=tuple(windows),
        bos_token_id=bos if isinstance(bos, int) and not isinstance(bos, bool) else None,
        eos_token_ids=_eos_ids(raw.get("eos_token_id")), quant=parse_quant(raw, source),
        moe=parse_moe(r, mt, layers, inter) if mt in MOE_TYPES else None,
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"), **kw,
    )
    check_model_config(config, source)
    return config


def _moe_family(r: _Reader, mt: str, layers: int, heads: int, kv_heads: int, head_dim: int,
                max_pos: int, traditional: bool,
                kw: dict) -> tuple[bool, list[RopeSpec], list[int | None]]:
    """Attention of the MoE families as mlx-lm builds it: (tied, per-layer RoPE, per-layer
    window), the attention flags into `kw`. (Their MoE blocks: `config_moe.parse_moe`.)"""
    windows: list[int | None] = [None] * layers
    if mt == "qwen3_moe":  # mlx-lm's qwen3_moe ignores rope_scaling (plain nn.RoPE)
        kw.update(qk_norm=True)
        return (r.bool("tie_word_embeddings"),
                [RopeSpec(head_dim, r.float("rope_theta"), False)] * layers, windows)
    if mt == "mixtral":
        return (r.bool("tie_word_embeddings", False),
                [RopeSpec(head_dim, r.float("rope_theta", 1e6), traditional)] * layers, windows)
    both = ("sliding_attention", "full_attention")
    if mt == "gpt_oss":  # no lm_head tying; layers alternate sliding / full by default
        types = layer_kinds(r, "layer_types", layers, both, list(both) * (layers // 2))
        if len(types) != layers or set(types) != set(both):
            raise ModelFormatError(f"{r.source}: key 'layer_types' must list {layers} entries "
                                   "with both sliding_attention and full_attention layers")
        window = r.int("sliding_window", 128)
        kw.update(qkv_bias=True, o_bias=True, attn_sinks=True)
        rope = RopeSpec(head_dim, r.float("rope_theta", 150000.0), False, _rope_scaling(r),
                        max_pos)
        return False, [rope] * layers, [window if t == both[0] else None for t in types]
    # laguna: per-layer query heads and RoPE by layer type, a softplus gate per head
    types = layer_kinds(r, "layer_types", layers, both, [both[1]] * layers)
    if both[1] not in types:
        raise ModelFormatError(f"{r.source}: key 'layer_types' has no full_attention layer")
    per = layer_list(r, "num_attention_heads_per_layer", layers, [heads] * layers)
    for h in per:
        if isinstance(h, bool) or not isinstance(h, int) or not 1 <= h <= LIMITS[
                "num_attention_heads"] or h % kv_heads:
            raise ModelFormatError(f"{r.source}: key 'num_attention_heads_per_layer' has {h!r}; "
                                   f"each must be a positive multiple of num_key_value_heads "
                                   f"({kv_heads})")
    window = r.int("sliding_window", 512)
    params = r.dict("rope_parameters") or {}
    partial = r.float("partial_rotary_factor", 1.0)
    by_type = {t: _laguna_rope(r, params.get(t), f"rope_parameters.{t}", head_dim, partial,
                               max_pos) for t in set(types)}
    gating = r.raw.get("gating", True)  # any truthy value is mlx-lm's per-head gate
    kw.update(qk_norm=True, qkv_bias=r.bool("qkv_bias", False),
              o_bias=r.bool("attention_bias", False), attn_head_gate=bool(gating),
              layer_heads=tuple(per), num_heads=max(per))
    return (r.bool("tie_word_embeddings", False), [by_type[t] for t in types],
            [window if t == both[0] else None for t in types])


def _laguna_rope(r: _Reader, sub, key: str, head_dim: int, partial: float,
                 max_pos: int) -> RopeSpec:
    """One layer type's RoPE: its own theta (default 1e4), partial rotary factor and
    scaling (mlx-lm laguna._layer_rope)."""
    sub = sub or {}
    if not isinstance(sub, dict):
        raise ModelFormatError(f"{r.source}: key '{key}' must be an object")
    sr = Nested(sub, r.source, key + ".")  # (errors name rope_parameters.<type>.<key>)
    base = sr.float("rope_theta", 10000.0)
    frac = sr.float("partial_rotary_factor", partial)
    dims = int(head_dim * frac) if 0 < frac <= 1 else 0  # (inf: no OverflowError)
    if dims < 2 or dims % 2 or dims > head_dim:
        raise ModelFormatError(f"{r.source}: key '{key}.partial_rotary_factor' = {frac} "
                               f"gives {dims} rotary dims of head_dim {head_dim}")
    scaling = _rope_scaling(_Reader({key: {k: v for k, v in sub.items() if k != "rope_theta"}},
                                    r.source), key)
    return RopeSpec(dims, base, False, scaling, max_pos)


MAX_JSON_BYTES = 16 << 20


def read_json(path: Path) -> dict:
    """Read a small JSON object file from a model directory (bounded); errors name the file."""
    data = bounded_json.read_file(path, ModelFormatError, MAX_JSON_BYTES, name=path.name)
    if not isinstance(data, dict):
        raise ModelFormatError(f"{path.name}: must be a JSON object")
    return data


def load_config(model_dir: Path) -> tuple[ModelConfig, dict]:
    """Parse `config.json` (and `generation_config.json`) of a model directory.

    Returns the config and the generation-config dict (empty if absent). As mlx-lm does, the
    generation config's EOS ids are merged into the model's.
    """
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ModelFormatError(f"{model_dir}: no config.json (not a model directory)")
    config = parse_config(read_json(model_dir / "config.json"), "config.json")
    gen = {}
    if (model_dir / "generation_config.json").is_file():
        gen = read_json(model_dir / "generation_config.json")
        extra = [i for i in _eos_ids(gen.get("eos_token_id")) if i not in config.eos_token_ids]
        if extra:
            config = replace(config, eos_token_ids=config.eos_token_ids + tuple(extra))
    return config, gen
