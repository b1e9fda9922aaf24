"""Tokenizer loading and encode/decode against transformers, sentencepiece, tiktoken and published
test vectors."""

from __future__ import annotations

import gzip
import json
import shutil
import warnings
from pathlib import Path

import pytest

from mlxr.errors import TokenizerError
from mlxr.text.tokenizer import load_tokenizer

warnings.filterwarnings("ignore", module="transformers")

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "多语言 текст العربية हिन्दी 日本語のテキスト 한국어 ελληνικά",
    "emoji 🎉👩‍👩‍👧 ok 🇫🇷 ✅",
    "def f(x):\n\treturn x**2  # comment\n\n\n",
    "for (int i = 0; i < n; ++i) { a[i] = b[i] * 3.14159f; }",
    "spaces   and\ttabs\n\n  \n   end",
    "café naïve Å ﬁ ½ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "1234567 3.14159 1,000,000",
    "line\r\nbreak and a\u00a0nbsp",
    "I'm sure they'll say it's 'quoted' \"double\"",
    "<|im_start|>user\nhi<|im_end|>",
    "",
]
LEADING = [" leading space", "  two", "\nnewline first"]

A = "tokenizers/"


def _copy(tmp_path_factory, assets, name, files, gz=None):
    d = tmp_path_factory.mktemp(name)
    for f in files:
        src = assets / f
        shutil.copy(
            src,
            d
            / (
                Path(f).name
                if not Path(f).name.startswith(("tokenizer.model.", "mistral_"))
                else "tokenizer.model"
            ),
        )
    if gz:
        with gzip.open(assets / gz, "rb") as s, open(d / "tokenizer.json", "wb") as t:
            shutil.copyfileobj(s, t)
    return d


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, assets):
    q = [A + "qwen3-0.6b-base/vocab.json", A + "qwen3-0.6b-base/merges.txt"]
    c = lambda *a, **k: _copy(tmp_path_factory, assets, *a, **k)
    return {
        "qwen3-json": c(
            "qwen3",
            [A + "qwen3-tokenizer-json/tokenizer_config.json"],
            gz=A + "qwen3-tokenizer-json/tokenizer.json.gz",
        ),
        "qwen3-base": assets / A / "qwen3-0.6b-base",
        "qwen2.5": c("qwen25", q + [A + "qwen2.5/tokenizer_config.json"]),
        "phi3": assets / A / "phi-3-mini-4k",
        "llama3-json": c(
            "llama3",
            [A + "llama3-tokenizer-json/tokenizer_config.json"],
            gz=A + "llama3-tokenizer-json/tokenizer.json.gz",
        ),
        "gpt2": assets / A / "gpt2",
        "llama2-spm": assets / A / "llama2-sentencepiece",
        "mistral-v1": c("mv1", [A + "mistral-sentencepiece/tokenizer.model.v1"]),
        "mistral-v3": c(
            "mv3", [A + "mistral-sentencepiece/mistral_instruct_tokenizer_240323.model.v3"]
        ),
        "llama3-tiktoken": assets / A / "llama3-tiktoken",
        "llama3.2-ollama": assets / A / "llama3.2-bpe-ollama",
    }


_CACHE: dict = {}


@pytest.fixture(scope="module")
def tok(dirs):
    def get(name):
        if name not in _CACHE:
            _CACHE[name] = load_tokenizer(dirs[name])
        return _CACHE[name]

    return get


EXPECTED = {  # name: (vocab_size incl. added tokens, bos id or None, an eos id, adds BOS)
    "qwen3-json": (151669, None, 151645, False),
    "qwen3-base": (151669, None, 151643, False),
    "qwen2.5": (151665, None, 151645, False),
    "phi3": (32011, 1, 32000, False),
    "llama3-json": (128256, 128000, 128009, True),
    "gpt2": (50257, None, None, False),
    "llama2-spm": (32000, 1, 2, True),
    "mistral-v1": (32000, 1, 2, True),
    "mistral-v3": (32768, 1, 2, True),
    "llama3-tiktoken": (128256, 128000, 128009, True),
    "llama3.2-ollama": (128000, None, None, False),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_loads(tok, name):
    t = tok(name)
    vocab, bos, eos, adds_bos = EXPECTED[name]
    assert t.vocab_size == vocab
    assert t.bos_token_id == bos
    if eos is not None:
        assert eos in t.eos_token_ids and eos in t.special_ids
    ids = t.encode("Hello")
    assert (ids[0] == bos) == adds_bos
    assert t.encode("Hello", add_special_tokens=False) == (ids[1:] if adds_bos else ids)
    assert t.token_to_id(t.id_to_token(ids[-1])) == ids[-1]
    # transformers 5's Llama pipeline for tokenizer.json (Metaspace, prepend_scheme="first") drops a
    # leading space
    for s in TEXTS + (LEADING if name != "phi3" else []):
        assert t.decode(t.encode(s, add_special_tokens=False)) == s, (name, s)


@pytest.mark.parametrize("name", ["qwen3-json", "qwen3-base", "qwen2.5", "phi3", "llama3-json"])
def test_matches_transformers_autotokenizer(tok, dirs, name):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    ref = transformers.AutoTokenizer.from_pretrained(str(dirs[name]))
    t = tok(name)
    assert t.vocab_size == len(ref)
    for s in TEXTS + LEADING:
        for special in (True, False):
            assert t.encode(s, add_special_tokens=special) == ref.encode(
                s, add_special_tokens=special
            ), (s, special)
        ids = ref.encode(s)
        assert t.decode(ids) == ref.decode(ids)
        assert t.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize(
    "name,files",
    [("gpt2", ("vocab.json", "merges.txt")), ("llama3.2-ollama", ("encoder.json", "vocab.bpe"))],
)
def test_byte_level_vocab_merges_matches_transformers(tok, dirs, name, files):
    transformers = pytest.importorskip("transformers")
    ref = transformers.GPT2Tokenizer(
        vocab=str(dirs[name] / files[0]), merges=str(dirs[name] / files[1])
    )
    t = tok(name)
    for s in TEXTS + LEADING:
        assert t.encode(s) == ref.encode(s), s
        assert t.decode(ref.encode(s)) == ref.decode(ref.encode(s))


@pytest.mark.parametrize("name", ["llama2-spm", "mistral-v1", "mistral-v3"])
def test_sentencepiece_matches_sentencepiece(tok, dirs, name):
    spm = pytest.importorskip("sentencepiece")
    sp = spm.SentencePieceProcessor(model_file=str(dirs[name] / "tokenizer.model"))
    t = tok(name)
    for s in TEXTS + LEADING + ["x  # c", "   spaces", "[INST] not a control token in plain sp"]:
        if "[INST]" in s and name == "mistral-v3":
            # control token: the tokenizer (like HF's) matches it, sentencepiece never does
            continue
        assert t.encode(s, add_special_tokens=False) == sp.encode(s), s
        assert t.encode(s) == [sp.bos_id()] + sp.encode(s)
        assert t.decode(sp.encode(s)) == sp.decode(sp.encode(s))


def test_sentencepiece_matches_transformers_llama(tok, dirs):
    transformers = pytest.importorskip("transformers")
    ref = transformers.LlamaTokenizer.from_pretrained(str(dirs["llama2-spm"]))
    t = tok("llama2-spm")
    # transformers 5 drops SentencePiece's dummy prefix before leading spaces and orders merges by
    # id (Llama 2's "▁▁" has the lowest score but a low id), so it departs from sentencepiece on
    # some whitespace: we follow sentencepiece (test above) and agree with transformers everywhere
    # else.
    agree = 0
    for s in TEXTS:
        if "  " in s or s.startswith(" "):
            continue
        assert t.encode(s, add_special_tokens=False) == ref.encode(s, add_special_tokens=False), s
        agree += 1
    assert agree >= 8


def test_mistral_v3_control_tokens(tok):
    t = tok("mistral-v3")
    assert t.encode("[INST] Hi [/INST]", add_special_tokens=False)[0] == 3
    assert {3, 4, 5, 6, 7, 8, 9} <= t.special_ids
    assert t.decode(t.encode("[INST] Hi [/INST]"), skip_special_tokens=True) == "Hi "


def test_tiktoken_matches_tiktoken_and_tokenizer_json(tok, assets):
    tiktoken = pytest.importorskip("tiktoken")
    from tiktoken.load import load_tiktoken_bpe

    from mlxr.text.tokenizer_formats import LLAMA3_SPLIT_REGEX

    ranks = load_tiktoken_bpe(str(assets / A / "llama3-tiktoken/tokenizer.model"))
    enc = tiktoken.Encoding(
        "llama3", pat_str=LLAMA3_SPLIT_REGEX, mergeable_ranks=ranks, special_tokens={}
    )
    t, j = tok("llama3-tiktoken"), tok("llama3-json")
    for s in TEXTS + LEADING:
        assert t.encode(s, add_special_tokens=False) == enc.encode(s), s
        assert t.encode(s) == j.encode(s), s
    for name in ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"):
        assert t.token_to_id(name) == j.token_to_id(name)
    # ollama's GPT-2-style copy of the same vocabulary has the same ids
    o = tok("llama3.2-ollama")
    assert o.token_to_id("Hello") == t.token_to_id("Hello")


def _swift(assets, name):
    return json.loads(
        (assets / "test-vectors/swift-transformers" / name).read_text(encoding="utf-8")
    )


@pytest.mark.parametrize(
    "name,vectors",
    [
        ("llama2-spm", "llama_encoded.json"),
        ("llama3-tiktoken", "llama_3.2_encoded.json"),
        ("llama3-json", "llama_3.2_encoded.json"),
        ("gpt2", "gpt2_encoded_tokens.json"),
    ],
)
def test_swift_transformers_vectors(tok, assets, name, vectors):
    v = _swift(assets, vectors)
    t = tok(name)
    assert t.encode(v["text"]) == v["token_ids"]
    assert t.decode(v["token_ids"], skip_special_tokens=True) == v["text"]


@pytest.mark.parametrize(
    "name,model",
    [
        ("llama2-spm", "coreml-projects/Llama-2-7b-chat-coreml"),
        ("llama3-tiktoken", "pcuenq/Llama-3.2-1B-Instruct-tokenizer"),
        ("gpt2", "distilgpt2"),
    ],
)
def test_swift_tokenizer_edge_cases(tok, assets, name, model):
    cases = _swift(assets, "tokenizer_tests.json")[model]
    t = tok(name)
    assert cases
    for case in cases:
        ids = case["encoded"]["input_ids"]
        assert t.encode(case["input"]) == ids, case["input"]
        # the vectors were made with an older transformers that applied
        # clean_up_tokenization_spaces; transformers 5 (and mlxr) no longer do for BPE tokenizers
        got = t.decode(ids, skip_special_tokens=True)
        assert case["decoded_without_special"] in (got, _clean_up(got)), case["input"]


def _clean_up(text: str) -> str:
    for a, b in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(a, b)
    return text


MISTRAL_TEMPLATE_OK = {"no_tools", "parallel_calls", "several_calls"}


def test_mistral_common_samples(tok, assets):
    root = assets / "test-vectors/mistral-common-samples"
    templates = assets / "chat-templates/mistral-common-jinja"
    checked = 0
    for sample_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        sample = json.loads((sample_dir / "sample.json").read_text(encoding="utf-8"))
        for version, name in (("v1", "mistral-v1"), ("v3", "mistral-v3")):
            tokens_file = sample_dir / f"tokens_{version}.json"
            if not tokens_file.exists():
                continue
            ids = json.loads(tokens_file.read_text(encoding="utf-8"))["tokens"]
            text = (sample_dir / f"text_{version}.txt").read_text(encoding="utf-8")
            t = tok(name)
            assert "".join(t.id_to_token(i) for i in ids) == text, sample_dir.name
            if sample_dir.name in MISTRAL_TEMPLATE_OK:
                source = (templates / f"{version}_spm.jinja").read_text(encoding="utf-8")
                got = t.apply_chat_template(
                    sample["messages"],
                    tools=sample.get("tools"),
                    tokenize=True,
                    add_generation_prompt=False,
                    chat_template=source,
                )
                assert got == ids, (sample_dir.name, version)
            checked += 1
    assert checked >= 6


# -------------------------------------------------------------------------------------------------
# Streaming detokenizer

STREAM_TEXTS = (
    TEXTS
    + LEADING
    + [
        "🎉🎉 👩‍👩‍👧‍👦 日本語の文章です。中文字符 ﬁ",
        "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and \U0001f600\U0001f601 then   spaces\n\n\tdone",
        " ▁literal▁markers▁ and <0x0A> text",
    ]
)


@pytest.mark.parametrize(
    "name", ["qwen3-json", "phi3", "llama3-json", "gpt2", "llama2-spm", "mistral-v3"]
)
def test_streaming_detokenizer(tok, name):
    t = tok(name)
    for s in STREAM_TEXTS:
        ids = t.encode(s)
        det = t.detokenizer()
        pieces = [det.add(i) for i in ids]
        pieces.append(det.flush())
        full = t.decode(ids)
        assert "".join(pieces) == full, (name, s)
        assert det.text == full
        if "\ufffd" not in full:
            assert not any("\ufffd" in p for p in pieces), (name, s)


def test_streaming_byte_fallback_pieces(tok):
    t = tok("llama2-spm")
    ids = t.encode("a 🎉 b", add_special_tokens=False)
    assert any(t.id_to_token(i).startswith("<0x") for i in ids)
    det = t.detokenizer()
    out = [det.add(i) for i in ids]
    # the emoji's four byte tokens produce "" until the last one completes the character
    assert "".join(out) == "a 🎉 b"
    assert "🎉" in out or any("🎉" in p for p in out)
    assert out.count("") >= 3


def test_streaming_window_is_bounded(tok):
    t = tok("qwen3-json")
    det = t.detokenizer()
    ids = t.encode("word " * 3000)
    calls = []
    orig = t.decode

    def counting_decode(ids_, skip_special_tokens=False):
        ids_ = list(ids_)
        calls.append(len(ids_))
        return orig(ids_, skip_special_tokens=skip_special_tokens)

    t.decode = counting_decode
    try:
        for i in ids:
            det.add(i)
    finally:
        del t.decode
    assert max(calls) <= 8


def test_streaming_skip_special(tok):
    t = tok("qwen3-json")
    ids = t.encode("<|im_start|>assistant\nHi 🎉<|im_end|>")
    det = t.detokenizer(skip_special_tokens=True)
    text = "".join(det.add(i) for i in ids) + det.flush()
    assert text == t.decode(ids, skip_special_tokens=True) == "assistant\nHi 🎉"


# -------------------------------------------------------------------------------------------------
# Errors


def _write(d: Path, name: str, data: bytes | str):
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data if isinstance(data, bytes) else data.encode())
    return d


def test_missing_and_malformed_files(tmp_path, assets):
    with pytest.raises(TokenizerError, match="not found"):
        load_tokenizer(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TokenizerError, match="no tokenizer files"):
        load_tokenizer(empty)
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        load_tokenizer(_write(tmp_path / "a", "tokenizer.json", '{"model": 3}'))
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        load_tokenizer(_write(tmp_path / "a2", "tokenizer.json", b"\x00\xff garbage"))
    bad_cfg = _write(tmp_path / "b", "tokenizer_config.json", "{oops")
    shutil.copy(assets / A / "phi-3-mini-4k/tokenizer.json", bad_cfg)
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        load_tokenizer(bad_cfg)
    with pytest.raises(TokenizerError, match="vocab.json"):
        d = _write(tmp_path / "c", "vocab.json", "[1, 2]")
        load_tokenizer(_write(d, "merges.txt", "#version: 0.2\na b\n"))
    with pytest.raises(TokenizerError, match="merges.txt"):
        d = _write(tmp_path / "d", "vocab.json", json.dumps({"a": 0, "b": 1, "ab": 2}))
        load_tokenizer(_write(d, "merges.txt", "#version: 0.2\na b c\n"))
    with pytest.raises(TokenizerError, match="tokenizer.model"):
        load_tokenizer(
            _write(tmp_path / "e", "tokenizer.model", b"\x0a\xff\xff\xff not a protobuf")
        )
    with pytest.raises(TokenizerError, match="tokenizer.model"):
        load_tokenizer(
            _write(tmp_path / "f", "tokenizer.model", "IQ== 0\nIg== 1\nnot-base64!! x\n")
        )
    bad_added = _write(
        tmp_path / "g",
        "tokenizer_config.json",
        json.dumps({"added_tokens_decoder": {"99999": {"content": "<x>", "special": True}}}),
    )
    shutil.copy(assets / A / "phi-3-mini-4k/tokenizer.json", bad_added)
    with pytest.raises(TokenizerError, match="added token"):
        load_tokenizer(bad_added)
    bad_special = _write(tmp_path / "h", "special_tokens_map.json", json.dumps({"eos_token": 5}))
    shutil.copy(assets / A / "phi-3-mini-4k/tokenizer.json", bad_special)
    with pytest.raises(TokenizerError, match="special_tokens_map.json"):
        load_tokenizer(bad_special)
    for err in (TokenizerError,):
        assert issubclass(err, ValueError)
