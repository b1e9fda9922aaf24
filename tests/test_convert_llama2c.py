"""mlxr.convert.llama2c on Karpathy's stories260K, checked against mlx-lm and llama2.c's
algorithms."""

from __future__ import annotations

import json
import random
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mlxr.convert import llama2c

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "mlxr" / "bundled"
N_STEPS = 200  # llama2.c's test_all.py asserts the first 200 greedy steps
FIRST_20 = [403, 407, 261, 378, 432, 383, 286, 261, 376, 298,
            315, 421, 395, 317, 426, 338, 401, 396, 267, 337]  # fmt: skip


@pytest.fixture(scope="session")
def src(assets) -> Path:
    return assets / "models" / "stories260K"


@pytest.fixture(scope="session")
def converted(src, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("stories260K")
    llama2c.convert(src / "stories260K.bin", src / "tok512.bin", out)
    return out


@pytest.fixture(scope="session")
def reference_text(src) -> str:
    """run.c's temperature-0 output from stories260K.md."""
    md = (src / "stories260K.md").read_text(encoding="utf-8")
    marker = "$ ./run stories260K/stories260K.bin -z stories260K/tok512.bin -t 0.0\n"
    start = md.index(marker) + len(marker)
    text = md[start : md.index("\n```", start)]
    assert text.startswith("Once upon a time, there was a little girl named Lily.")
    return text


def mlx_greedy(model_dir: Path, n: int) -> tuple[list[int], str]:
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import generate_step

    model, tok = mlx_lm.load(str(model_dir))
    greedy = lambda x: mx.argmax(x, axis=-1)  # noqa: E731
    ids = [int(t) for t, _ in generate_step(mx.array([1]), model, max_tokens=n, sampler=greedy)]
    return ids, tok.decode(ids)


@pytest.fixture(scope="session")
def fp32_greedy(converted) -> tuple[list[int], str]:
    return mlx_greedy(converted, N_STEPS)


# ------------------------------------------------------------------ llama2.c's own tokenizer


class Llama2cTokenizer:
    """Re-implementation of llama2.c run.c's `encode`: dummy prefix, byte fallback, then greedily
    merge the adjacent pair whose concatenation has the best score (leftmost on ties)."""

    def __init__(self, path: Path):
        data = path.read_bytes()
        self.vocab, self.scores = [], []
        off = 4
        while off < len(data):
            score, n = struct.unpack_from("<fi", data, off)
            self.vocab.append(data[off + 8 : off + 8 + n].decode("utf-8"))
            self.scores.append(score)
            off += 8 + n
        self.lookup = {s: i for i, s in enumerate(self.vocab)}

    def encode(self, text: str) -> list[int]:
        toks = [self.lookup[" "]] if text else []
        for ch in text:
            if ch in self.lookup:
                toks.append(self.lookup[ch])
            else:
                toks.extend(b + 3 for b in ch.encode("utf-8"))
        while True:
            best, best_i, best_id = -1e10, -1, -1
            for i in range(len(toks) - 1):
                j = self.lookup.get(self.vocab[toks[i]] + self.vocab[toks[i + 1]])
                if j is not None and self.scores[j] > best:
                    best, best_i, best_id = self.scores[j], i, j
            if best_i < 0:
                return toks
            toks[best_i : best_i + 2] = [best_id]


def sample_strings(reference_text: str) -> list[str]:
    rng = random.Random(1234)
    alphabet = list("abcdefghijklmnopqrstuvwxyzLTO     .,!?'\"\n\t-é日🤖")
    fixed = [
        "",
        " ",
        "Hello world",
        "Once upon a time",
        "  two  leading spaces and trailing ",
        "héllo ünïcode 日本語 🤖 ™",
        "a\nb\tc\r\n",
        "The end.\n\n",
        "x" * 40,
        "literal <0x41> byte-token text <> </",
        reference_text,
    ]
    rand = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 50))) for _ in range(300)]
    return fixed + rand


# ------------------------------------------------------------------ (a) mlx-lm reproduces run.c


def test_config(converted):
    cfg = json.loads((converted / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (64, 172, 5)
    assert (
        cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    ) == (8, 4, 512)
    assert cfg["max_position_embeddings"] == 512 and cfg["rms_norm_eps"] == 1e-5
    assert cfg["rope_theta"] == 10000 and cfg["tie_word_embeddings"] is True
    assert "rope_traditional" not in cfg  # wq/wk are permuted to HF's rotate-half layout
    tc = json.loads((converted / "tokenizer_config.json").read_text())
    assert tc["bos_token"] == "<s>" and tc["eos_token"] == "</s>" and tc["unk_token"] == "<unk>"
    assert tc["add_bos_token"] is True and "chat_template" not in tc


def test_mlx_lm_greedy_reproduces_reference(fp32_greedy, reference_text):
    ids, text = fp32_greedy
    assert ids[:20] == FIRST_20
    assert len(ids) == N_STEPS and 1 not in ids and 2 not in ids
    assert reference_text.startswith(text)
    assert len(text) > 400  # 200 tokens of the story, not a degenerate prefix


def test_mlx_lm_generate_text(converted, reference_text):
    import mlx_lm

    model, tok = mlx_lm.load(str(converted))
    text = mlx_lm.generate(model, tok, [1], max_tokens=40)  # default sampler: greedy
    assert text.startswith("Once upon a time, there was a little girl named Lily.")
    assert reference_text.startswith(text)


def test_reference_ids_match_llama2c_tokenization(src, fp32_greedy, reference_text):
    # The model's greedy ids are exactly llama2.c's tokenization of its reference output.
    ids, _ = fp32_greedy
    ref_ids = Llama2cTokenizer(src / "tok512.bin").encode(reference_text)
    assert ids == ref_ids[:N_STEPS]


# ------------------------------------------------------------------ (b) bundled == fresh


@pytest.mark.parametrize(
    "name", ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"]
)
def test_bundled_files_equal_fresh_conversion(converted, name):
    assert (BUNDLED / "stories260K" / name).read_bytes() == (converted / name).read_bytes()


def test_bundled_safetensors_equal_fresh_conversion(converted):
    from safetensors.numpy import load_file

    bundled = load_file(BUNDLED / "stories260K" / "model.safetensors")
    fresh = load_file(converted / "model.safetensors")
    assert sorted(bundled) == sorted(fresh)
    assert len(fresh) == 2 + 9 * 5
    for k, v in fresh.items():
        assert bundled[k].dtype == v.dtype == np.float32, k
        assert np.array_equal(bundled[k], v), k


def test_bundled_has_license_and_readme(src):
    d = BUNDLED / "stories260K"
    assert (d / "LICENSE").read_bytes() == (src / "LLAMA2C-LICENSE").read_bytes()
    readme = (d / "README.md").read_text()
    assert "0bd21da7698eaf29a0d7de3992de8a46ef624add" in readme
    assert "b0a507e7ad0f626624f17112325e66691f9076d622e1d3274d103d00299f2696" in readme


def test_bundled_quantized_variant_is_faithful(fp32_greedy):
    quant = sorted(BUNDLED.glob("stories260K-*bit"))
    if not quant:
        pytest.skip("no quantized variant bundled")
    for d in quant:
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["quantization"]["bits"] in (4, 8)
        assert (d / "tokenizer.json").read_bytes() == (
            BUNDLED / "stories260K" / "tokenizer.json"
        ).read_bytes()
        ids, _ = mlx_greedy(d, N_STEPS)
        assert ids == fp32_greedy[0], d.name


# ------------------------------------------------------------------ (c) tokenizer


def test_tokenizer_matches_llama2c_encode(src, converted, reference_text):
    from tokenizers import Tokenizer

    ref = Llama2cTokenizer(src / "tok512.bin")
    tok = Tokenizer.from_file(str(converted / "tokenizer.json"))
    for s in sample_strings(reference_text):
        want = ref.encode(s)
        assert tok.encode(s, add_special_tokens=False).ids == want, repr(s)
        assert tok.encode(s).ids == [1] + want, repr(s)


def test_tokenizer_round_trips(converted, reference_text):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(converted / "tokenizer.json"))
    for s in sample_strings(reference_text):
        assert tok.decode(tok.encode(s).ids) == s, repr(s)
    assert tok.decode(tok.encode(reference_text).ids) == reference_text
    assert tok.token_to_id("<0x0A>") == 13 and tok.id_to_token(1) == "<s>"


def test_special_token_text(converted):
    # Unlike llama2.c (which has no special-token parsing), and like every HF llama tokenizer,
    # the literal text of a special token encodes to that token.
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(converted / "tokenizer.json"))
    assert tok.encode("</s>", add_special_tokens=False).ids == [2]
    assert tok.decode([1, 403, 407, 2]) == "Once upon"


def test_transformers_tokenizer_matches_llama2c_encode(src, converted, reference_text):
    # What mlx-lm uses. tokenizer_class PreTrainedTokenizerFast makes transformers use our
    # tokenizer.json as written (LlamaTokenizerFast would rebuild it and drop the dummy prefix
    # before leading whitespace), so every string must match llama2.c's encode.
    from transformers import AutoTokenizer

    ref = Llama2cTokenizer(src / "tok512.bin")
    tok = AutoTokenizer.from_pretrained(str(converted))
    for s in sample_strings(reference_text):
        assert tok.encode(s, add_special_tokens=False) == ref.encode(s), repr(s)
    assert tok.encode("Hello")[0] == 1


# ------------------------------------------------------------------ (d) hostile inputs


def _header(dim=64, hidden=172, layers=5, heads=8, kv=4, vocab=512, seq=512) -> bytes:
    return struct.pack("<7i", dim, hidden, layers, heads, kv, vocab, seq)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda b: b[:-4], "implies exactly"),
        (lambda b: b[: len(b) // 2], "truncated"),
        (lambda b: b + b"\0" * 4, "implies exactly"),
        (lambda b: b[:10], "too short"),
        (lambda b: b"", "too short"),
        (lambda b: _header(dim=2**31 - 1) + b[28:], "dim=2147483647 is out of range"),
        (lambda b: _header(layers=0) + b[28:], "n_layers=0 is out of range"),
        (lambda b: _header(heads=-8) + b[28:], "n_heads=-8 is out of range"),
        (lambda b: _header(vocab=-(2**31)) + b[28:], "vocab_size"),
        (lambda b: _header(seq=10**9) + b[28:], "seq_len"),
        (lambda b: _header(heads=7) + b[28:], "not divisible by n_heads"),
        (lambda b: _header(kv=3) + b[28:], "not a multiple of n_kv_heads"),
        (lambda b: _header(vocab=-512) + b[28:], "vocab_size sign"),  # classifier sign flipped
        (lambda b: struct.pack("<I", 0x616B3432) + b[4:], "versioned export"),
        (lambda b: b[:28] + struct.pack("<f", float("nan")) + b[32:], "NaN"),
    ],
)
def test_hostile_checkpoint(src, tmp_path, mutate, match):
    bad = tmp_path / "bad.bin"
    bad.write_bytes(mutate((src / "stories260K.bin").read_bytes()))
    with pytest.raises(ValueError, match=match):
        llama2c.convert(bad, src / "tok512.bin", tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda b: b[:-3], "bad length|truncated"),
        (lambda b: b[:2000], "bad length|truncated"),
        (lambda b: b + b"\0\0\0\0\0\0\0\0", "trailing bytes"),
        (lambda b: struct.pack("<i", -1) + b[4:], "max_token_length"),
        (lambda b: b[:4] + struct.pack("<fi", 0.0, 10**6) + b[12:], "bad length"),
        (lambda b: b"", "too short"),
    ],
)
def test_hostile_tokenizer(src, tmp_path, mutate, match):
    bad = tmp_path / "bad_tok.bin"
    bad.write_bytes(mutate((src / "tok512.bin").read_bytes()))
    with pytest.raises(ValueError, match=match):
        llama2c.convert(src / "stories260K.bin", bad, tmp_path / "out")


def test_cli(src, tmp_path):
    run = [sys.executable, "-m", "mlxr.convert.llama2c"]
    ok = subprocess.run(
        run + [str(src / "stories260K.bin"), str(src / "tok512.bin"), str(tmp_path / "m")],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "m" / "model.safetensors").is_file()
    bad = tmp_path / "x.bin"
    bad.write_bytes(b"\0" * 100)
    err = subprocess.run(
        run + [str(bad), str(src / "tok512.bin"), str(tmp_path / "n")],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert err.returncode == 1 and "error:" in err.stderr and "out of range" in err.stderr
