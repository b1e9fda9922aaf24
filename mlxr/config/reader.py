"""Typed, bounded reading of a raw config dict: the key bounds (`LIMITS`), the reader whose
every error names the file and the key, and the blocks several families share (quantization,
rope scaling, EOS ids).
"""

from __future__ import annotations

import math

from ..errors import ModelFormatError
from .spec import QUANT_DEFAULTS, QuantConfig, QuantSpec

_MISSING = object()

# Upper bounds that no real checkpoint reaches; they stop a hostile config from making us
# allocate terabytes or loop for hours before any weight is read.
LIMITS = {
    "vocab_size": 1 << 22,
    "hidden_size": 1 << 16,
    "num_hidden_layers": 1024,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "head_dim": 1024,
    "intermediate_size": 1 << 18,
    "max_position_embeddings": 1 << 24,
    "sliding_window": 1 << 24,
    "num_experts": 1 << 14,
    "num_local_experts": 1 << 14,
    "num_experts_per_tok": 1 << 14,
    "moe_intermediate_size": 1 << 18,
    "shared_expert_intermediate_size": 1 << 18,
    "decoder_sparse_step": 1024,
}


class _Reader:
    """Typed access to the raw config dict; every error names the file and the key."""

    def __init__(self, raw: dict, source: str):
        self.raw, self.source = raw, source

    def _fail(self, key: str, why: str) -> ModelFormatError:
        return ModelFormatError(f"{self.source}: key '{key}' {why}")

    def int(self, key: str, default=_MISSING, minimum: int = 1) -> int:
        if key not in self.raw or self.raw[key] is None:
            if default is _MISSING:
                raise self._fail(key, "is required but missing")
            return default
        v = self.raw[key]
        if isinstance(v, bool) or not isinstance(v, int):
            raise self._fail(key, f"must be an integer, got {v!r}")
        if v < minimum or v > LIMITS.get(key, 1 << 40):
            raise self._fail(key, f"= {v} is out of range [{minimum}, {LIMITS.get(key, 1 << 40)}]")
        return v

    def float(self, key: str, default=_MISSING) -> float:
        if key not in self.raw or self.raw[key] is None:
            if default is _MISSING:
                raise self._fail(key, "is required but missing")
            return default
        v = _decode_float(self.raw[key])
        number = isinstance(v, (int, float)) and not isinstance(v, bool)
        try:
            f = float(v) if number else math.nan
        except OverflowError:  # an integer past float's range (JSON allows any digit count)
            f = math.inf
        if not math.isfinite(f):
            raise self._fail(key, f"must be a finite number, got {_short(self.raw[key])}")
        return f

    def bool(self, key: str, default=_MISSING) -> bool:
        if key not in self.raw or self.raw[key] is None:
            if default is _MISSING:
                raise self._fail(key, "is required but missing")
            return default
        v = self.raw[key]
        if not isinstance(v, bool):
            raise self._fail(key, f"must be true or false, got {v!r}")
        return v

    def dict(self, key: str) -> dict | None:
        v = self.raw.get(key)
        if v is not None and not isinstance(v, dict):
            raise self._fail(key, f"must be an object, got {type(v).__name__}")
        return v


def _short(v) -> str:
    """repr of a config value, cut to 60 characters (a 400-digit number stays one line)."""
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _decode_float(v):
    # mlx-lm's save_config writes non-finite floats as {"__float__": "Infinity"}.
    if isinstance(v, dict) and set(v) == {"__float__"} and isinstance(v["__float__"], str):
        try:
            return float(v["__float__"])
        except ValueError:
            return v  # refused by the caller's type check, naming the key
    return v


def _parse_quant_spec(v, source: str, key: str) -> QuantSpec | None:
    if v is False:
        return None
    if not isinstance(v, dict):
        raise ModelFormatError(f"{source}: quantization entry '{key}' must be an object or false")
    mode = v.get("mode") or "affine"
    if not isinstance(mode, str) or mode not in QUANT_DEFAULTS:
        raise ModelFormatError(f"{source}: quantization '{key}' has unknown mode {mode!r}")
    bits, group = QUANT_DEFAULTS[mode]
    bits = v.get("bits") if v.get("bits") is not None else bits
    group = v.get("group_size") if v.get("group_size") is not None else group
    for name, val in (("bits", bits), ("group_size", group)):
        if isinstance(val, bool) or not isinstance(val, int) or not 1 <= val <= 1024:
            raise ModelFormatError(f"{source}: quantization '{key}'.{name} = {val!r} is invalid")
    return QuantSpec(mode, bits, group, bool(v.get("global_scale", False)))


def parse_quant(raw: dict, source: str) -> QuantConfig | None:
    """Read `quantization` (or an MLX-style `quantization_config`) into a QuantConfig."""
    q = raw.get("quantization")
    if q is None:
        q = raw.get("quantization_config")
        if q is None:
            return None
        if not isinstance(q, dict) or "quant_method" in q:
            method = q.get("quant_method") if isinstance(q, dict) else q
            raise ModelFormatError(
                f"{source}: quantization_config.quant_method={method!r} is not an MLX "
                "quantization; mlxr reads MLX-quantized or unquantized checkpoints "
                "(convert this model with mlx_lm.convert first)"
            )
    if not isinstance(q, dict):
        raise ModelFormatError(f"{source}: 'quantization' must be an object")
    top = {k: q[k] for k in ("group_size", "bits", "mode") if k in q}
    default = _parse_quant_spec(top, source, "quantization")
    overrides = {
        k: _parse_quant_spec(v, source, k)
        for k, v in q.items()
        if k not in ("group_size", "bits", "mode", "quant_method")
    }
    return QuantConfig(default, overrides)


def _rope_scaling(r: _Reader, key: str = "rope_scaling") -> dict | None:
    s = r.dict(key)
    if s is None:
        return None
    s = {k: _decode_float(v) for k, v in s.items()}
    s["rope_type"] = s.get("type") or s.get("rope_type") or "default"
    if s["rope_type"] in ("linear", "dynamic", "llama3", "yarn") and not isinstance(
        s.get("factor"), (int, float)
    ):
        raise ModelFormatError(f"{r.source}: '{key}' of type {s['rope_type']} needs a 'factor'")
    if s["rope_type"] not in ("default", "linear", "dynamic", "llama3", "yarn", "longrope", "su"):
        raise ModelFormatError(f"{r.source}: '{key}' type {s['rope_type']!r} is not supported")
    return s


def _eos_ids(v) -> tuple[int, ...]:
    if v is None:
        return ()
    ids = v if isinstance(v, list) else [v]
    return tuple(i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= 0)
