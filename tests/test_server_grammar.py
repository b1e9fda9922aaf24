"""GrammarProcessor: the grammar's syntax is checked at construction without llguidance's
tokenizer (a server whose engine runs in another process builds no matcher), the matcher is
built once by `prepare` (or at first use), and a bad grammar is a 400 at construction."""

from pathlib import Path

import pytest
import torch

import mlxr
from mlxr.server import grammar as G
from mlxr.server.protocol import APIError


@pytest.fixture(scope="module")
def model():
    return mlxr.load(Path(mlxr.__file__).parent / "bundled" / "stories260K", weights=False)


def test_grammar_checked_without_the_tokenizer(model):
    G._TOKENIZERS.pop(model, None)
    p = G.GrammarProcessor(model, G.response_format_grammar({"type": "json_object"}))
    assert p.matcher is None and model not in G._TOKENIZERS  # nothing built yet
    p.prepare()
    m = p.matcher
    assert m is not None and model in G._TOKENIZERS
    p.prepare()
    assert p.matcher is m  # built once
    out = p([], torch.zeros(model.config.vocab_size))
    allowed = int(torch.isfinite(out).sum())
    assert 0 < allowed < model.config.vocab_size  # a JSON object's first token: a few allowed


def test_first_use_builds_the_matcher(model):
    p = G.GrammarProcessor(model, G.response_format_grammar({"type": "json_object"}))
    out = p([], torch.zeros(model.config.vocab_size))
    assert p.matcher is not None and 0 < int(torch.isfinite(out).sum()) < out.numel()


def test_bad_grammar_is_a_400_at_construction(model):
    with pytest.raises(APIError) as e:
        G.GrammarProcessor(model, '{"grammars": [{"lark_grammar": "start: foo"}]}')
    assert e.value.status == 400 and "invalid grammar" in e.value.message
