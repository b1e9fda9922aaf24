"""Hostile configs and files of the MoE and hybrid families: each cause the family fuzzer
(tests/fuzz_hostile.py --family F, mutations in tests/fuzz_families.py) found is a clear mlxr
error naming the file and the key, never a KeyError / ZeroDivisionError / runaway allocation at
load or generation."""

from __future__ import annotations

import copy

import pytest

from hybrid_configs import FAMILIES as HYBRID
from mlxr.config import parse_config
from mlxr.errors import ModelFormatError


def hybrid(family: str, **text) -> dict:
    """A hybrid family's tiny config with `text` keys set where the family reads them."""
    cfg = copy.deepcopy(HYBRID[family])
    (cfg.get("text_config") or cfg).update(text)
    return cfg


def refused(cfg: dict) -> str:
    with pytest.raises(ModelFormatError) as e:
        parse_config(cfg)
    return str(e.value)


# qwen3_next (seed 1, case 158): a longrope rope_scaling without its fields passed the parser
# (the hybrids skipped the value rules) and raised KeyError building the RoPE tables
@pytest.mark.parametrize("scaling, field", [
    ({"rope_type": "su", "long_factor": 1.0}, "long_factor"),
    ({"rope_type": "longrope", "long_factor": [1.0] * 4}, "original_max_position_embeddings"),
    ({"rope_type": "yarn", "factor": 4.0, "beta_fast": 0}, "beta_fast"),
    ({"rope_type": "linear", "factor": 1e300}, "factor"),
])
def test_qwen3_next_rope_scaling_checked(scaling, field):
    msg = refused(hybrid("qwen3_next", rope_scaling=scaling))
    assert msg.startswith("config.json") and field in msg


def test_hybrid_rope_theta_checked():
    assert "rope_theta" in refused(hybrid("qwen3_next", rope_theta=1.0))
    assert "rope_theta" in refused(hybrid(
        "gemma4_text", rope_parameters={"sliding_attention": {"rope_theta": 1e300}}))


def test_hybrid_norm_eps_and_softcap_checked():
    assert "rms_norm_eps" in refused(hybrid("qwen3_5", rms_norm_eps=0.0))
    assert "final_logit_softcap" in refused(hybrid("gemma4", final_logit_softcapping=0.0))


@pytest.mark.parametrize("family", list(HYBRID))
def test_hybrid_tiny_configs_still_parse(family):
    parse_config(copy.deepcopy(HYBRID[family]))
