"""Hostile model folders (issue 34): each cause the fuzzers found is a clear mlxr error at load,
naming the file and the field, never a RecursionError / KeyError / OverflowError / Rust panic
or a model that loads and computes NaN."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

import mlxr
from hostile_models import make_folder
from mlxr.config import parse_config
from mlxr.errors import MlxrError, ModelFormatError, TokenizerError
from mlxr.text.tokenizer import load_tokenizer

mlx_ref = pytest.importorskip("mlx_ref")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_folder(mlx_ref, tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture
def folder(tiny, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny, d)
    return d


def edit_json(path, fn):
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))


def load_error(d, kind=MlxrError) -> str:
    with pytest.raises(kind) as e:
        mlxr.load(d, device="cpu")
    return str(e.value)


def test_tiny_folder_loads(tiny):
    m = mlxr.load(tiny, device="cpu")
    assert len(list(m.generate("the", max_tokens=3))) == 3


# -- the bounded JSON reader ---------------------------------------------------------------------

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("name", ["config.json", "generation_config.json",
                                  "tokenizer_config.json", "tokenizer.json",
                                  "model.safetensors.index.json"])
def test_deeply_nested_json_is_a_clear_error(folder, name):
    (folder / name).write_text('{"a": ' + DEEP + "}")
    msg = load_error(folder)
    assert name in msg and "nested deeper" in msg, msg


@pytest.mark.parametrize("literal,why", [("NaN", "not a JSON number"),
                                         ("-Infinity", "not a JSON number"),
                                         ("1e400", "overflows"), ("9" * 400, "digits")])
def test_json_numbers_out_of_range(folder, literal, why):
    text = (folder / "config.json").read_text()
    (folder / "config.json").write_text(text[:-1] + f', "rope_theta": {literal}}}')
    msg = load_error(folder, ModelFormatError)
    assert "config.json" in msg and why in msg, msg


def test_generation_config_400_digit_top_p(folder):
    (folder / "generation_config.json").write_text('{"top_p": ' + "7" * 400 + "}")
    assert "generation_config.json" in load_error(folder, ModelFormatError)


@pytest.mark.parametrize("key,value", [("top_p", 5.0), ("temperature", -1), ("top_k", "x"),
                                       ("repetition_penalty", 0), ("min_p", 2)])
def test_generation_defaults_checked_at_load(folder, key, value):
    edit_json(folder / "generation_config.json", lambda d: d.update({key: value}))
    msg = load_error(folder, ModelFormatError)
    assert "generation_config.json" in msg and key in msg, msg


# -- weights and index ---------------------------------------------------------------------------

def test_quantized_weight_missing_beside_scales(folder):
    path = folder / "model.safetensors"
    t = load_file(path)
    del t["model.layers.0.mlp.up_proj.weight"]
    save_file(t, str(path), metadata={"format": "mlx"})
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    msg = load_error(folder, ModelFormatError)
    assert "model.layers.0.mlp.up_proj.weight" in msg, msg


def test_overlong_shard_name_in_index(folder):
    index = folder / "model.safetensors.index.json"
    if not index.exists():
        names = load_file(folder / "model.safetensors").keys()
        index.write_text(json.dumps({"weight_map": {n: "model.safetensors" for n in names}}))
    edit_json(index, lambda d: d["weight_map"].update({"model.norm.weight": "x" * 5000}))
    msg = load_error(folder, ModelFormatError)
    assert "model.safetensors.index.json" in msg and "not a file name" in msg, msg


# -- config values -------------------------------------------------------------------------------

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
         "vocab_size": 320, "rms_norm_eps": 1e-5}


def _rope(kind, **fields):
    return {"rope_scaling": {"rope_type": kind, **fields}}


BAD_CONFIGS = {
    "rms_norm_eps -1": (LLAMA, {"rms_norm_eps": -1}, "rms_norm_eps"),
    "rope_theta 0": (LLAMA, {"rope_theta": 0}, "rope_theta"),
    "linear factor 0": (LLAMA, _rope("linear", factor=0), "factor"),
    "linear factor 1e308": (LLAMA, _rope("linear", factor=1e308), "factor"),
    "dynamic factor 0.5": (LLAMA, _rope("dynamic", factor=0.5), "factor"),
    "llama3 low_freq_factor 0": (LLAMA, _rope("llama3", factor=8, low_freq_factor=0),
                                 "low_freq_factor"),
    "llama3 high_freq_factor null": (LLAMA, _rope("llama3", factor=8, high_freq_factor=None),
                                     "high_freq_factor"),
    "llama3 high == low": (LLAMA, _rope("llama3", factor=8, low_freq_factor=2,
                                        high_freq_factor=2), "high_freq_factor"),
    "llama3 original_max 0": (LLAMA, _rope("llama3", factor=8,
                                           original_max_position_embeddings=0),
                              "original_max_position_embeddings"),
    "yarn beta_slow 0": (LLAMA, _rope("yarn", factor=4, beta_slow=0), "beta_slow"),
    "yarn beta_fast string": (LLAMA, _rope("yarn", factor=4, beta_fast="32"), "beta_fast"),
    "yarn original_max string": (LLAMA, _rope("yarn", factor=4,
                                              original_max_position_embeddings="4096"),
                                 "original_max_position_embeddings"),
    "yarn mscale -50": (LLAMA, _rope("yarn", factor=4, mscale=-50), "mscale"),
    "longrope long_factor short": (LLAMA, _rope("longrope", long_factor=[1.0],
                                                original_max_position_embeddings=64),
                                   "long_factor"),
    "longrope long_mscale string": (LLAMA, _rope("longrope", long_factor=[1.0] * 8,
                                                 original_max_position_embeddings=64,
                                                 long_mscale="x"), "long_mscale"),
    "longrope original_max null": (LLAMA, _rope("longrope", long_factor=[1.0] * 8),
                                   "original_max_position_embeddings"),
    "factor as __float__ junk": (LLAMA, _rope("linear", factor={"__float__": "x"}), "factor"),
    "gemma2 query_pre_attn_scalar 0": (
        {**LLAMA, "model_type": "gemma2", "head_dim": 16}, {"query_pre_attn_scalar": 0},
        "query_pre_attn_scalar"),
    "gemma3 query_pre_attn_scalar -4": (
        {**LLAMA, "model_type": "gemma3_text", "head_dim": 16}, {"query_pre_attn_scalar": -4},
        "query_pre_attn_scalar"),
    "gemma2 softcap 0": ({**LLAMA, "model_type": "gemma2", "head_dim": 16},
                         {"attn_logit_softcapping": 0}, "softcap"),
    "phi3 partial_rotary_factor 1e308": ({**LLAMA, "model_type": "phi3"},
                                         {"partial_rotary_factor": 1e308},
                                         "partial_rotary_factor"),
    "phi3 long_factor an int": ({**LLAMA, "model_type": "phi3"},
                                _rope("longrope", long_factor=7, short_factor=[1.0] * 8),
                                "long_factor"),
    "quantization mode a dict": (LLAMA, {"quantization": {"group_size": 64, "bits": 4,
                                                          "mode": {"a": 1}}}, "mode"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_config_values_refused_at_parse(case):
    base, change, needle = BAD_CONFIGS[case]
    raw = {**copy.deepcopy(base), **change}
    with pytest.raises(ModelFormatError) as e:
        parse_config(raw, "config.json")
    assert "config.json" in str(e.value) and needle in str(e.value), str(e.value)


@pytest.mark.parametrize("change", [{}, _rope("llama3", factor=8, low_freq_factor=1,
                                              high_freq_factor=4,
                                              original_max_position_embeddings=8192),
                                    _rope("yarn", factor=4, original_max_position_embeddings=32),
                                    _rope("linear", factor=2), _rope("dynamic", factor=2)])
def test_real_rope_configs_still_parse(change):
    parse_config({**LLAMA, **change}, "config.json")


# -- tokenizer files -----------------------------------------------------------------------------

def test_added_token_content_not_a_string(folder):
    edit_json(folder / "tokenizer_config.json", lambda d: d.update(
        {"added_tokens_decoder": {"300": {"content": 7, "special": True}}}))
    assert "added_tokens_decoder" in load_error(folder, TokenizerError)


def test_added_token_content_not_a_string_in_tokenizer_json(folder):
    edit_json(folder / "tokenizer.json", lambda d: d["added_tokens"][0].update(content=["x"]))
    assert "added_tokens[0].content" in load_error(folder, TokenizerError)


def test_non_utf8_extra_jinja(folder):
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tool_use.jinja").write_bytes(b"\xff\xfe{{ x }}")
    msg = load_error(folder, TokenizerError)
    assert "tool_use.jinja" in msg and "UTF-8" in msg, msg


@pytest.mark.parametrize("where", ["normalizer", "decoder", "pre_tokenizer"])
def test_empty_replace_pattern_refused_before_rust(folder, where):
    kind = "Split" if where == "pre_tokenizer" else "Replace"
    node = {"type": kind, "pattern": {"String": ""}, "content": "x", "behavior": "Isolated",
            "invert": False}
    edit_json(folder / "tokenizer.json", lambda d: d.update(
        {where: {"type": "Sequence", "normalizers" if where == "normalizer" else
                 "pretokenizers" if where == "pre_tokenizer" else "decoders": [node]}}))
    assert "empty String pattern" in load_error(folder, TokenizerError)


@pytest.mark.parametrize("token_id", [320, 2**32 - 1])
@pytest.mark.parametrize("where", ["vocab", "added"])
def test_token_ids_past_the_embedding_table(folder, token_id, where):
    def add(d):
        if where == "vocab":  # the embedding has 320 rows: id 320 is one past it
            d["model"]["vocab"]["zz"] = token_id
            return
        d["added_tokens"].append({"id": token_id, "content": "<|extra|>", "single_word": False,
                                  "lstrip": False, "rstrip": False, "normalized": False,
                                  "special": True})
    edit_json(folder / "tokenizer.json", add)
    try:
        m = mlxr.load(folder, device="cpu")
    except MlxrError as e:
        assert str(token_id) in str(e) or "not a token id" in str(e), str(e)
        return
    # tokenizers renumbered the token: every id it can produce is a row of the table
    assert max(m.tokenizer._tk.get_vocab(with_added_tokens=True).values()) < 320


def test_tokenizer_alone_refuses_deep_json(folder):
    (folder / "tokenizer.json").write_text(DEEP)
    with pytest.raises(TokenizerError, match="nested deeper"):
        load_tokenizer(folder)


@pytest.mark.parametrize("shard", [7, None, ["x"], "../config.json"])
def test_index_shard_not_a_name(folder, shard):  # found by tests/fuzz_hostile.py (seed 1)
    names = load_file(folder / "model.safetensors").keys()
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {**{n: "model.safetensors" for n in names}, "model.norm.weight": shard}}))
    assert "not a file name" in load_error(folder, ModelFormatError)


def test_lone_surrogate_in_text_is_a_tokenizer_error(tiny):
    tok = load_tokenizer(tiny)
    with pytest.raises(TokenizerError, match="surrogate"):
        tok.encode("a\ud800b")
    with pytest.raises(TokenizerError, match="surrogate"):
        tok.apply_chat_template([{"role": "user", "content": "\udfff"}], tokenize=True)
