"""Config parsing for the hybrid and new-generation families: qwen3_5, qwen3_5_moe and
qwen3_next (gated DeltaNet layers beside attention) and gemma4 / gemma4_text (per-layer
embeddings, KV sharing, 512-wide heads); their MoE blocks through `config.moe`.

The common fields land in a ModelConfig as for the dense families; what only these families
have lives in a frozen spec (`GatedDeltaSpec`, `Gemma4Spec`) in `ModelConfig.arch`. Defaults
are mlx-lm 0.32.2's ModelArgs defaults. Every new key is bounded before anything is allocated,
and every error names the file and the key (nested keys as `text_config.<key>`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ModelFormatError
from .checks import MAX_ROPE_FACTOR
from .moe import parse_hybrid_moe
from .reader import _MISSING, LIMITS, _eos_ids, _Reader, _rope_scaling, parse_quant
from .spec import ModelConfig, RopeSpec

QWEN_HYBRID = ("qwen3_5", "qwen3_5_moe", "qwen3_next")  # gated DeltaNet + gated attention

# Bounds of the new keys (no real checkpoint comes near them): a hostile config fails here, not
# in an allocation of terabytes.
NEW_LIMITS = {
    "linear_num_value_heads": 1024,
    "linear_num_key_heads": 1024,
    "linear_key_head_dim": 1024,
    "linear_value_head_dim": 1024,
    "linear_conv_kernel_dim": 64,
    "full_attention_interval": 1024,
    "global_head_dim": 1024,
    "num_global_key_value_heads": 1024,
    "hidden_size_per_layer_input": 1 << 14,
    "vocab_size_per_layer_input": 1 << 22,
    "sliding_window_pattern": 1024,
}


@dataclass(frozen=True)
class GatedDeltaSpec:
    """qwen3_5's linear-attention layers. layer_types[i] is "linear_attention" (a gated
    DeltaNet: conv state [kernel-1, conv_dim], recurrent state [Hv, Dv, Dk] float32) or
    "full_attention" (gated softmax attention over the KV cache)."""

    layer_types: tuple[str, ...]
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    # qwen3_next's files: in_proj_qkvz / in_proj_ba rows grouped per key head ([q k v z] and
    # [b a] of each); the loader reorders them to qwen3_5's [q | k | v | z | b | a]
    qkvz_grouped: bool = False

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class Gemma4Spec:
    """gemma4_text's per-layer structure (every tuple has one entry per layer).

    kv_source[i]: the layer whose K/V layer i attends (i itself, or for a KV-shared layer the
    last unshared layer of its type: its K/V are stored once). head_dims / kv_heads: of that
    layer's attention (full layers use global_head_dim). k_eq_v: values are the keys'
    projection (no v_proj). mlp_sizes: intermediate size (doubled on shared layers with
    use_double_wide_mlp). ple_dim: per-layer-embedding width (0: none)."""

    layer_types: tuple[str, ...]
    head_dims: tuple[int, ...]
    kv_heads: tuple[int, ...]
    kv_source: tuple[int, ...]
    k_eq_v: tuple[bool, ...]
    mlp_sizes: tuple[int, ...]
    ple_dim: int
    ple_vocab: int


class Nested(_Reader):
    """A reader whose errors name keys under a parent object (`text_config.hidden_size`) and
    that bounds the new keys by NEW_LIMITS."""

    def __init__(self, raw: dict, source: str, prefix: str = ""):
        super().__init__(raw, source)
        self.prefix = prefix

    def _fail(self, key: str, why: str) -> ModelFormatError:
        return ModelFormatError(f"{self.source}: key '{self.prefix}{key}' {why}")

    def int(self, key: str, default=_MISSING, minimum: int = 1) -> int:
        v = super().int(key, default, minimum)
        top = NEW_LIMITS.get(key)
        if top is not None and v > top:
            raise self._fail(key, f"= {v} is out of range [{minimum}, {top}]")
        return v

    def list(self, key: str, n: int, allowed: tuple[str, ...]) -> tuple[str, ...] | None:
        v = self.raw.get(key)
        if v is None:
            return None
        if not isinstance(v, list) or len(v) != n or any(t not in allowed for t in v):
            raise self._fail(key, f"must list {n} entries, each one of {', '.join(allowed)}")
        return tuple(v)


def _text_reader(raw: dict, source: str) -> Nested:
    tc = raw.get("text_config")
    if tc is None:
        return Nested(raw, source)
    if not isinstance(tc, dict):
        raise ModelFormatError(f"{source}: key 'text_config' must be an object")
    return Nested(tc, source, "text_config.")


def _common(r: Nested, raw: dict, mt: str, **kw) -> dict:
    """Fields every family's ModelConfig has, from the text reader (eos / bos / quantization
    also from the top level)."""
    eos = _eos_ids(r.raw.get("eos_token_id")) + _eos_ids(raw.get("eos_token_id"))
    bos = r.raw.get("bos_token_id", raw.get("bos_token_id"))
    return dict(
        model_type=mt, eos_token_ids=tuple(dict.fromkeys(eos)),
        bos_token_id=bos if isinstance(bos, int) and not isinstance(bos, bool) else None,
        quant=parse_quant(raw, r.source),
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype") or r.raw.get("dtype"), **kw)


def _heads(r: Nested, heads: int, kv: int, key: str = "num_key_value_heads") -> None:
    if heads % kv:
        raise ModelFormatError(f"{r.source}: key '{r.prefix}num_attention_heads' ({heads}) is "
                               f"not a multiple of '{r.prefix}{key}' ({kv})")


def _qwen_rope(r: Nested, head_dim: int, max_pos: int, next_: bool) -> RopeSpec:
    """qwen3_5: rope_parameters (theta, partial_rotary_factor, type; mrope's text positions
    are the same on every axis); qwen3_next: the top-level rope_theta, partial_rotary_factor
    and rope_scaling (all required but the last, as mlx-lm's ModelArgs has them)."""
    if next_:
        key = ""
        theta, partial = r.float("rope_theta"), r.float("partial_rotary_factor")
        scaling = _rope_scaling(r)
    else:
        params = r.dict("rope_parameters") or {"rope_type": "default", "rope_theta": 100000.0,
                                               "partial_rotary_factor": 0.25}
        pr, key = Nested(params, r.source, r.prefix + "rope_parameters."), "rope_parameters."
        kind = params.get("type") or params.get("rope_type") or "default"
        scaling = None if kind in ("default", "mrope") else _rope_scaling(r, "rope_parameters")
        theta, partial = pr.float("rope_theta", 100000.0), pr.float("partial_rotary_factor",
                                                                    0.25)
    rope_dims = int(head_dim * partial) if 0 < partial <= 1 else 0  # (1e308: no overflow)
    if not 2 <= rope_dims <= head_dim or rope_dims % 2:
        raise ModelFormatError(f"{r.source}: key '{r.prefix}{key}partial_rotary_factor' = "
                               f"{partial} does not rotate an even number >= 2 of the "
                               f"{head_dim} head dims")
    return RopeSpec(rope_dims, theta, False, scaling, max_pos)


def parse_qwen3_5(raw: dict, source: str) -> ModelConfig:
    """qwen3_5 / qwen3_5_moe (wrappers; their text_config is mlx-lm's TextModelArgs, every
    key with a default) and qwen3_next (flat; mlx-lm's ModelArgs requires most keys): gated
    DeltaNet layers beside gated attention, each followed by a SwiGLU MLP or the MoE block."""
    mt = raw["model_type"]
    next_ = mt == "qwen3_next"
    r = Nested(raw, source) if next_ else _text_reader(raw, source)

    def dflt(v):  # qwen3_next's ModelArgs has no default for most keys
        return _MISSING if next_ else v

    hidden = r.int("hidden_size", dflt(4096))
    layers = r.int("num_hidden_layers", dflt(32))
    heads = r.int("num_attention_heads", dflt(32))
    kv = r.int("num_key_value_heads", dflt(8))
    _heads(r, heads, kv)
    head_dim = r.int("head_dim", dflt(hidden // heads))
    interval = r.int("full_attention_interval", 4)
    types = tuple("linear_attention" if (i + 1) % interval else "full_attention"
                  for i in range(layers))
    listed = r.list("layer_types", layers, ("linear_attention", "full_attention"))
    if listed is not None and listed != types:
        raise ModelFormatError(
            f"{source}: key '{r.prefix}layer_types' disagrees with full_attention_interval "
            f"{interval} (mlx-lm follows the interval)")
    spec = GatedDeltaSpec(
        types, r.int("linear_num_key_heads", dflt(16)), r.int("linear_num_value_heads",
                                                              dflt(64)),
        r.int("linear_key_head_dim", dflt(192)), r.int("linear_value_head_dim", dflt(128)),
        r.int("linear_conv_kernel_dim", dflt(4), minimum=2), qkvz_grouped=next_)
    if spec.num_v_heads % spec.num_k_heads:
        raise ModelFormatError(f"{source}: {r.prefix}linear_num_value_heads "
                               f"({spec.num_v_heads}) is not a multiple of "
                               f"linear_num_key_heads ({spec.num_k_heads})")
    max_pos = r.int("max_position_embeddings", dflt(131072))
    rope = _qwen_rope(r, head_dim, max_pos, next_)
    bias = r.bool("attention_bias", False)
    return ModelConfig(
        vocab_size=r.int("vocab_size", dflt(151936)), hidden_size=hidden, num_layers=layers,
        num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
        intermediate_size=r.int("intermediate_size", dflt(14336)),
        rms_norm_eps=r.float("rms_norm_eps", dflt(1e-6)), max_position_embeddings=max_pos,
        tie_word_embeddings=r.bool("tie_word_embeddings", False), qkv_bias=bias, o_bias=bias,
        qk_norm=True, attn_scale=head_dim**-0.5, layer_rope=(rope,) * layers,
        layer_window=(None,) * layers, arch=spec,
        moe=parse_hybrid_moe(r, "qwen3_next" if next_ else "qwen3_5", layers),
        **_common(r, raw, mt))


def _gemma4_rope(r: Nested, params: dict, kind_key: str, dims: int,
                 max_pos: int) -> RopeSpec:
    p = params.get(kind_key) or {}
    if not isinstance(p, dict):
        raise ModelFormatError(f"{r.source}: key '{r.prefix}rope_parameters.{kind_key}' must "
                               "be an object")
    pr = Nested(p, r.source, f"{r.prefix}rope_parameters.{kind_key}.")
    theta = pr.float("rope_theta", 10000.0)
    kind = p.get("rope_type") or p.get("type") or "default"
    if kind == "default":
        return RopeSpec(dims, theta, False, None, max_pos)
    if kind == "linear":
        return RopeSpec(dims, theta, False, {"rope_type": "linear",
                                             "factor": pr.float("factor")}, max_pos)
    if kind == "proportional":
        partial = pr.float("partial_rotary_factor", 1.0)
        rotated = int(dims * partial) if 0 <= partial <= 1 else -1  # (1e308: no overflow)
        if rotated < 0 or rotated % 2:
            raise ModelFormatError(f"{r.source}: key '{pr.prefix}partial_rotary_factor' = "
                                   f"{partial} does not rotate an even number of the {dims} "
                                   "head dims")
        factor = pr.float("factor", 1.0)
        if not 0 < factor <= MAX_ROPE_FACTOR:  # (0: periods 0, inverse frequencies inf)
            raise ModelFormatError(f"{r.source}: key '{pr.prefix}factor' = {factor} is not in "
                                   f"(0, {MAX_ROPE_FACTOR:g}]")
        return RopeSpec(dims, theta, False, {"rope_type": "proportional", "rotated": rotated,
                                             "factor": factor}, max_pos)
    raise ModelFormatError(f"{r.source}: key '{pr.prefix}rope_type' = {kind!r} is not "
                           "supported (default, linear, proportional)")


def parse_gemma4(raw: dict, source: str) -> ModelConfig:
    """gemma4_text, or the gemma4 wrapper's text_config (its top-level vocab_size wins, as in
    mlx-lm); the vision and audio towers of gemma4 checkpoints are not read."""
    r = _text_reader(raw, source)
    vocab = r.int("vocab_size", 262144)
    if raw.get("model_type") == "gemma4":
        vocab = _Reader(raw, source).int("vocab_size", 262144)
    hidden = r.int("hidden_size", 1536)
    layers = r.int("num_hidden_layers", 35)
    heads = r.int("num_attention_heads", 8)
    kv = r.int("num_key_value_heads", 1)
    _heads(r, heads, kv)
    head_dim = r.int("head_dim", 256)
    global_dim = r.int("global_head_dim", 512)
    pattern = r.int("sliding_window_pattern", 5)
    types = r.list("layer_types", layers, ("sliding_attention", "full_attention"))
    if types is None:
        types = tuple("full_attention" if i % pattern == pattern - 1 else "sliding_attention"
                      for i in range(layers))
    shared = r.int("num_kv_shared_layers", 20, minimum=0)
    first_shared = layers - shared
    if shared and first_shared <= 0:
        raise ModelFormatError(f"{source}: key '{r.prefix}num_kv_shared_layers' = {shared} "
                               f"leaves no layer of the {layers} with its own K/V")
    source_of: dict[str, int] = {}
    kv_source = []
    for i, t in enumerate(types):
        if i < first_shared or not shared:
            source_of[t] = i
            kv_source.append(i)
        elif t not in source_of:
            raise ModelFormatError(f"{source}: KV-shared layer {i} ({t}) has no earlier "
                                   f"{t} layer to share K/V with ('{r.prefix}layer_types')")
        else:
            kv_source.append(source_of[t])
    k_eq_v_flag = r.bool("attention_k_eq_v", False)
    global_kv = r.int("num_global_key_value_heads", kv)
    _heads(r, heads, global_kv, "num_global_key_value_heads")
    full = [t == "full_attention" for t in types]
    k_eq_v = tuple(k_eq_v_flag and f for f in full)
    inter = r.int("intermediate_size", 6144)
    wide = r.bool("use_double_wide_mlp", True)
    ple_dim = r.int("hidden_size_per_layer_input", 256, minimum=0)
    max_pos = r.int("max_position_embeddings", 131072)
    window = r.int("sliding_window", 512)
    if window > LIMITS["sliding_window"]:
        raise ModelFormatError(f"{source}: key '{r.prefix}sliding_window' = {window} is out "
                               "of range")
    params = r.dict("rope_parameters")
    if params is None:
        params = {"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1e6,
                                     "rope_type": "proportional"},
                  "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}}
    dims = tuple(global_dim if f else head_dim for f in full)
    # one spec object per layer type: the decoder keys its RoPE tables (and their per-step
    # gathers) by spec identity, two per forward instead of two per layer
    kinds = {key: _gemma4_rope(r, params, *key, max_pos)
             for key in dict.fromkeys(zip(types, dims))}
    ropes = tuple(kinds[key] for key in zip(types, dims))
    spec = Gemma4Spec(
        layer_types=types, head_dims=dims,
        kv_heads=tuple(global_kv if e else kv for e in k_eq_v), kv_source=tuple(kv_source),
        k_eq_v=k_eq_v,
        mlp_sizes=tuple(2 * inter if wide and shared and i >= first_shared else inter
                        for i in range(layers)),
        ple_dim=ple_dim,
        ple_vocab=r.int("vocab_size_per_layer_input", 262144) if ple_dim else 0)
    if ple_dim and spec.ple_vocab < vocab:
        raise ModelFormatError(f"{source}: key '{r.prefix}vocab_size_per_layer_input' = "
                               f"{spec.ple_vocab} is smaller than vocab_size {vocab} (token "
                               "ids past it would read outside the per-layer table)")
    softcap = r.raw.get("final_logit_softcapping", 30.0)
    return ModelConfig(
        vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=kv, head_dim=head_dim, intermediate_size=inter,
        rms_norm_eps=r.float("rms_norm_eps", 1e-6), max_position_embeddings=max_pos,
        tie_word_embeddings=r.bool("tie_word_embeddings", True), qk_norm=True,
        embed_scale=math.sqrt(hidden), hidden_act="gelu_tanh", sandwich_norm=True,
        attn_scale=1.0,
        final_logit_softcap=None if softcap is None else r.float("final_logit_softcapping",
                                                                  30.0),
        layer_rope=ropes, layer_window=tuple(None if f else window for f in full), arch=spec,
        moe=parse_hybrid_moe(r, "gemma4", layers), **_common(r, raw, raw.get("model_type")))


def parse_hybrid(raw: dict, source: str) -> ModelConfig:
    """Dispatch on model_type (one of config.HYBRID)."""
    if raw["model_type"] in QWEN_HYBRID:
        return parse_qwen3_5(raw, source)
    return parse_gemma4(raw, source)
