"""Hostile configs and files of the MoE and hybrid families: each cause the family fuzzer
(tests/fuzz_hostile.py --family F, mutations in tests/fuzz_families.py) found is a clear mlxr
error naming the file and the key, never a KeyError / ZeroDivisionError / runaway allocation at
load or generation."""

from __future__ import annotations

import copy
import json

import pytest

from hostile_models import write_tokenizer
from hybrid_configs import FAMILIES as HYBRID
from mlxr.config import parse_config
from mlxr.errors import ModelFormatError, TokenizerError
from mlxr.text.tokenizer import load_tokenizer


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


# laguna (seed 2, case 693): a per-layer-type partial_rotary_factor of 1e308 overflowed int()
@pytest.mark.parametrize("frac", [1e308, float("inf"), -0.5, 0.0])
def test_laguna_partial_rotary_factor_bounded(frac):
    mlx_ref = pytest.importorskip("mlx_ref")
    cfg = mlx_ref.config_for("laguna")
    cfg["rope_parameters"]["sliding_attention"]["partial_rotary_factor"] = frac
    assert "rope_parameters.sliding_attention.partial_rotary_factor" in refused(cfg)


# every family (seed 2: laguna 1707, qwen3_5 1763, qwen3_5_moe 1703): a special token or an
# added token of tokenizer_config.json holding a lone surrogate reached tokenizers'
# token_to_id, a UnicodeEncodeError
@pytest.mark.parametrize("edit", [
    {"eos_token": "\ud800"}, {"pad_token": {"content": "a\udfff"}},
    {"added_tokens_decoder": {"320": {"content": "\ud800", "special": True}}},
])
def test_special_token_with_a_lone_surrogate(tmp_path, edit):
    write_tokenizer(tmp_path)
    path = tmp_path / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        load_tokenizer(tmp_path)


# the sweep (tests/fuzz_hostile.py sweep): a soft-cap or routed scale of 1e308 loaded (finite
# in Python) and computed NaN logits (float32: inf * tanh(x / inf) = inf * 0)
@pytest.mark.parametrize("family", ["gemma4_text", "gemma4", "gemma4_moe"])
def test_gemma4_final_softcap_bounded(family):
    assert "final_logit_softcapping" in refused(hybrid(family, final_logit_softcapping=1e308))


@pytest.mark.parametrize("key, value", [
    ("moe_routed_scaling_factor", 1e308), ("moe_routed_scaling_factor", 0.0),
    ("moe_routed_scaling_factor", -1.0), ("moe_router_logit_softcapping", 1e308),
])
def test_laguna_moe_scalars_bounded(key, value):
    mlx_ref = pytest.importorskip("mlx_ref")
    cfg = mlx_ref.config_for("laguna")
    cfg[key] = value
    assert key in refused(cfg)


def test_real_moe_scalars_still_parse():
    mlx_ref = pytest.importorskip("mlx_ref")
    cfg = mlx_ref.config_for("laguna")
    cfg.update(moe_routed_scaling_factor=16.0, moe_router_logit_softcapping=30.0)
    assert parse_config(cfg).moe.routed_scale == 16.0


def _bpe(tmp_path, prefix: str, merges=None):
    write_tokenizer(tmp_path)
    path = tmp_path / "tokenizer.json"
    doc = json.loads(path.read_text())
    doc["model"]["continuing_subword_prefix"] = prefix
    if merges is not None:
        doc["model"]["merges"] = merges
        doc["model"]["vocab"]["##t"] = 313
    path.write_text(json.dumps(doc))


# gemma4_moe (seed 4, case 3204; any family's tokenizer.json): a BPE continuing_subword_prefix
# longer than a merge's second part was a Rust panic in tokenizers (PanicException, a
# BaseException: it killed the process)
@pytest.mark.parametrize("prefix", ["NaN", "##"])
def test_bpe_prefix_longer_than_a_merge(tmp_path, prefix):
    _bpe(tmp_path, prefix)
    with pytest.raises(TokenizerError, match="continuing_subword_prefix"):
        load_tokenizer(tmp_path)


def test_bpe_prefix_held_by_every_merge_loads(tmp_path):
    _bpe(tmp_path, "##", [["Ġ", "##t"]])
    assert len(load_tokenizer(tmp_path).encode("a")) == 1


# gemma4 / gemma4_moe (seed 4, cases 279 and 291): a proportional rope's factor of 0 loaded
# and computed NaN logits (periods 0)
@pytest.mark.parametrize("factor", [0, -1.0, 1e308])
def test_gemma4_proportional_factor_bounded(factor):
    params = {"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                 "rope_theta": 1e6, "factor": factor},
              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    msg = refused(hybrid("gemma4_text", rope_parameters=params))
    assert "rope_parameters.full_attention.factor" in msg
