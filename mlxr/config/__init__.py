"""Typed, frozen model configuration parsed from config.json.

Every upstream quirk (mlx-lm defaults, key aliases, per-family conventions) is normalised here so
the model code reads plain fields. `spec.py` the frozen types, `reader.py` typed and bounded key
access, `parse.py` the dense and MoE families (`moe.py` the MoE keys), `hybrid.py` the hybrid
families, `checks.py` the value rules every parsed config passes.
"""

from .parse import SUPPORTED, load_config, parse_config, read_json
from .reader import LIMITS, parse_quant
from .spec import QUANT_DEFAULTS, ModelConfig, QuantConfig, QuantSpec, RopeSpec

__all__ = ["LIMITS", "QUANT_DEFAULTS", "SUPPORTED", "ModelConfig", "QuantConfig", "QuantSpec",
           "RopeSpec", "load_config", "parse_config", "parse_quant", "read_json"]
