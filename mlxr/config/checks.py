"""Ranges, types and cross-field rules for a parsed model config, checked when it is loaded.

`parse_config` reads keys with their types; here each block is checked for values the model
code cannot compute with: a rope scaling of any type whose fields would divide by zero, take
the log of a non-positive number, overflow or index past the rotary dims; norms and attention
scalars outside the range where the forward pass stays finite. A config that passes gives
finite RoPE tables and scales for every position up to its context length.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import ModelFormatError
from .spec import ModelConfig, RopeSpec

MAX_ROPE_FACTOR = 1024.0  # real factors are 2-64 (llama3 8, yarn 4-40, linear 2-16)
MAX_ROPE_BASE = 1e15  # real rope_theta: 1e4 to 1e8
# real soft-caps are 5-50 and routed scales 1-16; past these bounds float32 turns the
# cap * tanh(x / cap) or the scaled expert sum into inf * 0 = NaN
MAX_SOFTCAP = 1e6
MAX_ROUTED_SCALE = 1e3


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def positive(v: Any, where: str) -> float:
    """`v` as a float if it is a finite number > 0, else a ModelFormatError naming `where`."""
    if not _number(v) or v <= 0:
        raise ModelFormatError(f"{where} must be a finite number > 0, got {v!r}")
    return float(v)


def _in_range(s: dict, key: str, lo: float, hi: float, where: str, default: Any = None,
              lo_open: bool = False) -> float:
    v = s.get(key, default) if key in s or default is not None else None
    if not _number(v) or v > hi or v < lo or (lo_open and v == lo):
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise ModelFormatError(f"{where}.{key} must be a number in {bound}, got {v!r}")
    return float(v)


def _max_positions(s: dict, where: str, default: int | None) -> int:
    v = s.get("original_max_position_embeddings", default)
    if type(v) is not int or not 2 <= v <= 1 << 24:
        raise ModelFormatError(
            f"{where}.original_max_position_embeddings must be an int in [2, {1 << 24}], "
            f"got {v!r}")
    return v


def _factors(s: dict, key: str, n: int, where: str, required: bool) -> None:
    v = s.get(key)
    if v is None and not required:
        return
    if not isinstance(v, list) or len(v) != n or not all(_number(x) and x > 0 for x in v):
        raise ModelFormatError(f"{where}.{key} must list {n} numbers > 0 (dims / 2)")


def check_rope(spec: RopeSpec, where: str) -> None:
    """One layer's RoPE: base, and every field its scaling type reads (mlx-lm's rope_utils)."""
    if not _number(spec.base) or not 1 < spec.base <= MAX_ROPE_BASE:
        raise ModelFormatError(f"{where}: rope_theta must be in (1, {MAX_ROPE_BASE:g}], got "
                               f"{spec.base!r}")
    s = spec.scaling
    if not s:
        return
    where = f"{where}: rope_scaling"
    kind = s["rope_type"]
    if kind in ("linear", "dynamic", "llama3", "yarn"):
        lo = 1.0 if kind == "dynamic" else 0.0  # dynamic NTK with a factor < 1 has no base
        _in_range(s, "factor", lo, MAX_ROPE_FACTOR, where, lo_open=kind != "dynamic")
    if kind == "dynamic" and spec.dims <= 2:
        raise ModelFormatError(f"{where}: dynamic scaling needs more than 2 rotary dims")
    if kind == "llama3":
        low = _in_range(s, "low_freq_factor", 0.0, 1e6, where, 1.0, lo_open=True)
        high = _in_range(s, "high_freq_factor", 0.0, 1e6, where, 4.0, lo_open=True)
        if high <= low:
            raise ModelFormatError(f"{where}: high_freq_factor ({high}) must exceed "
                                   f"low_freq_factor ({low})")
        _max_positions(s, where, 8192)
    elif kind == "yarn":
        _max_positions(s, where, 4096)
        _in_range(s, "beta_fast", 0.0, 1e6, where, 32, lo_open=True)
        _in_range(s, "beta_slow", 0.0, 1e6, where, 1, lo_open=True)
        _in_range(s, "mscale", 0.0, 1e3, where, 1)
        _in_range(s, "mscale_all_dim", 0.0, 1e3, where, 0)
    elif kind in ("longrope", "su"):
        _factors(s, "long_factor", spec.dims // 2, where, True)
        _factors(s, "short_factor", spec.dims // 2, where, False)
        _max_positions(s, where, None)
        if s.get("long_mscale") is not None:
            _in_range(s, "long_mscale", 0.0, 1e3, where, lo_open=True)


def check_model_config(c: ModelConfig, source: str) -> None:
    """Refuse values that load but compute NaN, inf or raise later (at generation)."""
    if not _number(c.rms_norm_eps) or not 0 < c.rms_norm_eps < 1:
        raise ModelFormatError(f"{source}: rms_norm_eps must be in (0, 1), got {c.rms_norm_eps!r}")
    if not _number(c.attn_scale) or c.attn_scale <= 0:
        raise ModelFormatError(f"{source}: the attention scale must be a finite number > 0, got "
                               f"{c.attn_scale!r} (query_pre_attn_scalar / head_dim)")
    for key in ("attn_logit_softcap", "final_logit_softcap"):
        v = getattr(c, key)
        if v is not None and positive(v, f"{source}: {key}ping") > MAX_SOFTCAP:
            raise ModelFormatError(f"{source}: {key}ping must be at most {MAX_SOFTCAP:g}, "
                                   f"got {v!r}")
    if c.moe is not None:
        _check_moe(c, source)
    for i, spec in enumerate(c.layer_rope):
        if i == 0 or spec is not c.layer_rope[i - 1]:  # most configs share one spec
            check_rope(spec, source)


def _check_moe(c: ModelConfig, source: str) -> None:
    """The MoE block's scalars (router soft-cap, routed scale) within float32's reach."""
    if not 0 <= c.moe.router_softcap <= MAX_SOFTCAP:
        raise ModelFormatError(f"{source}: moe_router_logit_softcapping must be in "
                               f"[0, {MAX_SOFTCAP:g}], got {c.moe.router_softcap!r}")
    if not 0 < c.moe.routed_scale <= MAX_ROUTED_SCALE:
        raise ModelFormatError(f"{source}: moe_routed_scaling_factor must be in "
                               f"(0, {MAX_ROUTED_SCALE:g}], got {c.moe.routed_scale!r}")
