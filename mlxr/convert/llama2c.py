"""Convert a llama2.c checkpoint (legacy "version 0" .bin) and tokenizer (.bin) to a HF llama dir.

The output is an ordinary Hugging Face llama model directory (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, generation_config.json) that mlx-lm, transformers and mlxr
load as-is.

llama2.c legacy checkpoint layout (little-endian):
  7 x int32 header: dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len
  (a negative vocab_size means the classifier is not shared with the token embedding), then fp32
  token_embedding[vocab, dim], rms_att[L, dim], wq[L, dim, dim], wk[L, kv_dim, dim],
  wv[L, kv_dim, dim], wo[L, dim, dim], rms_ffn[L, dim], w1[L, hidden, dim], w2[L, dim, hidden],
  w3[L, hidden, dim], rms_final[dim], freq_cis_real[seq_len, head_size/2],
  freq_cis_imag[seq_len, head_size/2], [wcls[vocab, dim] when unshared].

RoPE: llama2.c's run.c rotates interleaved pairs (2i, 2i+1) of each head (Meta's layout); HF and
mlx-lm llama rotate halves (i, i + head_size/2). As transformers' convert_llama_weights_to_hf
does, we permute the rows of wq and wk so that the output is an ordinary HF llama checkpoint.

llama2.c tokenizer layout: int32 max_token_length, then per token: float32 score, int32 length,
`length` bytes. Tokens 0..2 are <unk>, "\\n<s>\\n", "\\n</s>\\n"; 3..258 are the byte tokens
<0x00>..<0xFF>; the rest are SentencePiece BPE pieces with " " in place of "▁", scored by merge
order. We rebuild it as a `tokenizers` BPE with byte fallback, the way transformers'
convert_slow_tokenizer builds Llama's (merges derived from the piece scores).

Usage: python -m mlxr.convert.llama2c MODEL.bin TOK.bin OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mlxr.errors import ModelFormatError, TokenizerError

__all__ = ["Llama2cConfig", "convert", "read_checkpoint", "read_tokenizer", "build_tokenizer"]

HEADER = struct.Struct("<7i")
VERSIONED_MAGIC = 0x616B3432  # "ak42": llama2.c's newer export versions (1, 2), not supported here
MAX_DIM = 1 << 16
MAX_LAYERS = 1024
MAX_VOCAB = 1 << 20
MAX_SEQ_LEN = 1 << 20
ROPE_THETA = 10000.0
RMS_NORM_EPS = 1e-5  # llama2.c's run.c and model.py
SPIECE_UNDERLINE = "▁"


@dataclass(frozen=True)
class Llama2cConfig:
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    shared_classifier: bool

    @property
    def head_size(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_size

    def tensor_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """The fp32 arrays of the checkpoint, in file order."""
        L, d, h, kv = self.n_layers, self.dim, self.hidden_dim, self.kv_dim
        shapes = [
            ("token_embedding", (self.vocab_size, d)),
            ("rms_att", (L, d)),
            ("wq", (L, d, d)),
            ("wk", (L, kv, d)),
            ("wv", (L, kv, d)),
            ("wo", (L, d, d)),
            ("rms_ffn", (L, d)),
            ("w1", (L, h, d)),
            ("w2", (L, d, h)),
            ("w3", (L, h, d)),
            ("rms_final", (d,)),
            ("freq_cis_real", (self.seq_len, self.head_size // 2)),
            ("freq_cis_imag", (self.seq_len, self.head_size // 2)),
        ]
        if not self.shared_classifier:
            shapes.append(("wcls", (self.vocab_size, d)))
        return shapes

    def file_size(self) -> int:
        return HEADER.size + 4 * sum(math.prod(s) for _, s in self.tensor_shapes())


def _parse_header(path: Path, data: bytes) -> Llama2cConfig:
    if len(data) < HEADER.size:
        raise ModelFormatError(
            f"{path}: {len(data)} bytes is too short for a llama2.c checkpoint "
            f"(the header alone is {HEADER.size} bytes)"
        )
    if struct.unpack_from("<I", data)[0] == VERSIONED_MAGIC:
        raise ModelFormatError(
            f"{path}: llama2.c versioned export (magic 'ak42') is not supported; "
            "only the legacy version 0 format (export.py --version 0 / legacy_export) is"
        )
    dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab, seq_len = HEADER.unpack_from(data)
    shared = vocab > 0
    vocab = abs(vocab)
    fields = {
        "dim": (dim, MAX_DIM),
        "hidden_dim": (hidden_dim, 8 * MAX_DIM),
        "n_layers": (n_layers, MAX_LAYERS),
        "n_heads": (n_heads, MAX_DIM),
        "n_kv_heads": (n_kv_heads, MAX_DIM),
        "vocab_size": (vocab, MAX_VOCAB),
        "seq_len": (seq_len, MAX_SEQ_LEN),
    }
    for name, (value, limit) in fields.items():
        if not 0 < value <= limit:
            raise ModelFormatError(
                f"{path}: header field {name}={value} is out of range (1..{limit}); "
                "not a llama2.c legacy checkpoint?"
            )
    if dim % n_heads:
        raise ModelFormatError(f"{path}: dim={dim} is not divisible by n_heads={n_heads}")
    if (dim // n_heads) % 2:
        raise ModelFormatError(f"{path}: head size {dim // n_heads} is odd; RoPE needs it even")
    if n_kv_heads > n_heads or n_heads % n_kv_heads:
        raise ModelFormatError(
            f"{path}: n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}"
        )
    cfg = Llama2cConfig(dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab, seq_len, shared)
    expected = cfg.file_size()
    if len(data) != expected:
        other = Llama2cConfig(
            dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab, seq_len, not shared
        ).file_size()
        hint = (
            " (that would fit the header with the classifier "
            f"{'unshared' if shared else 'shared'}: is the vocab_size sign wrong?)"
            if len(data) == other
            else ""
        )
        raise ModelFormatError(
            f"{path}: file is {len(data)} bytes but its header ({cfg}) implies exactly "
            f"{expected} bytes; truncated or not a llama2.c legacy checkpoint{hint}"
        )
    return cfg


def read_checkpoint(path: Path) -> tuple[Llama2cConfig, dict[str, np.ndarray]]:
    """Read and validate a legacy llama2.c checkpoint; returns its config and fp32 arrays."""
    path = Path(path)
    data = path.read_bytes()
    cfg = _parse_header(path, data)
    arrays: dict[str, np.ndarray] = {}
    offset = HEADER.size
    for name, shape in cfg.tensor_shapes():
        n = math.prod(shape)
        arr = np.frombuffer(data, dtype="<f4", count=n, offset=offset).reshape(shape)
        offset += 4 * n
        if not np.isfinite(arr).all():
            raise ModelFormatError(f"{path}: tensor {name} contains NaN or infinite values")
        arrays[name] = arr.astype(np.float32)
    _check_rope_table(path, cfg, arrays["freq_cis_real"], arrays["freq_cis_imag"])
    return cfg, arrays


def _check_rope_table(path: Path, cfg: Llama2cConfig, real: np.ndarray, imag: np.ndarray) -> None:
    """The stored RoPE table must be llama2.c's theta=10000 one, which config.json declares."""
    hs = cfg.head_size
    freqs = 1.0 / (ROPE_THETA ** (np.arange(0, hs, 2, dtype=np.float64) / hs))
    angles = np.outer(np.arange(cfg.seq_len, dtype=np.float64), freqs)
    if not (
        np.allclose(real, np.cos(angles), atol=1e-3)
        and np.allclose(imag, np.sin(angles), atol=1e-3)
    ):
        raise ModelFormatError(
            f"{path}: stored RoPE table (freq_cis_real/imag) is not the standard theta=10000 "
            "one; cannot convert faithfully"
        )


def _permute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Interleaved-pair (Meta / llama2.c) rows -> rotate-half (HF) rows, per head.

    Same as transformers' convert_llama_weights_to_hf `permute`.
    """
    out_dim, in_dim = w.shape
    return (
        w.reshape(n_heads, out_dim // n_heads // 2, 2, in_dim)
        .transpose(0, 2, 1, 3)
        .reshape(out_dim, in_dim)
    )


def hf_tensors(cfg: Llama2cConfig, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """llama2.c arrays -> HF llama state dict (fp32, contiguous)."""
    t: dict[str, np.ndarray] = {"model.embed_tokens.weight": arrays["token_embedding"]}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = arrays["rms_att"][i]
        t[p + "self_attn.q_proj.weight"] = _permute_rotary(arrays["wq"][i], cfg.n_heads)
        t[p + "self_attn.k_proj.weight"] = _permute_rotary(arrays["wk"][i], cfg.n_kv_heads)
        t[p + "self_attn.v_proj.weight"] = arrays["wv"][i]
        t[p + "self_attn.o_proj.weight"] = arrays["wo"][i]
        t[p + "post_attention_layernorm.weight"] = arrays["rms_ffn"][i]
        t[p + "mlp.gate_proj.weight"] = arrays["w1"][i]
        t[p + "mlp.down_proj.weight"] = arrays["w2"][i]
        t[p + "mlp.up_proj.weight"] = arrays["w3"][i]
    t["model.norm.weight"] = arrays["rms_final"]
    if not cfg.shared_classifier:
        t["lm_head.weight"] = arrays["wcls"]
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in t.items()}


def hf_config(cfg: Llama2cConfig) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_size,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_theta": ROPE_THETA,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.shared_classifier,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }


# ----------------------------------------------------------------------------- tokenizer


def read_tokenizer(path: Path, vocab_size: int) -> list[tuple[bytes, float]]:
    """Read and validate a llama2.c tokenizer .bin; returns [(piece bytes, score)] * vocab_size."""
    path = Path(path)
    data = path.read_bytes()
    if len(data) < 4:
        raise TokenizerError(f"{path}: {len(data)} bytes is too short for a llama2.c tokenizer")
    (max_len,) = struct.unpack_from("<i", data)
    if not 0 < max_len <= 1024:
        raise TokenizerError(f"{path}: max_token_length={max_len} is out of range (1..1024)")
    pieces: list[tuple[bytes, float]] = []
    off = 4
    for i in range(vocab_size):
        if off + 8 > len(data):
            raise TokenizerError(
                f"{path}: truncated at token {i} of {vocab_size} (offset {off}, "
                f"file is {len(data)} bytes); does it belong to this model?"
            )
        score, n = struct.unpack_from("<fi", data, off)
        off += 8
        if not 0 < n <= max_len or off + n > len(data):
            raise TokenizerError(
                f"{path}: token {i} has bad length {n} (max_token_length {max_len}, "
                f"{len(data) - off} bytes left)"
            )
        if not math.isfinite(score):
            raise TokenizerError(f"{path}: token {i} has non-finite score {score}")
        pieces.append((data[off : off + n], score))
        off += n
    if off != len(data):
        raise TokenizerError(
            f"{path}: {len(data) - off} trailing bytes after {vocab_size} tokens; "
            "the tokenizer's vocabulary size does not match the model's"
        )
    return pieces


def _piece_strings(path: Path, pieces: list[tuple[bytes, float]]) -> list[str]:
    if len(pieces) < 259:
        raise TokenizerError(f"{path}: {len(pieces)} tokens; expected at least 3 + 256 bytes")
    expect = {0: b"<unk>", 1: b"\n<s>\n", 2: b"\n</s>\n"}
    for i, want in expect.items():
        if pieces[i][0] != want:
            raise TokenizerError(f"{path}: token {i} is {pieces[i][0]!r}, expected {want!r}")
    out = ["<unk>", "<s>", "</s>"]
    for b in range(256):
        raw = pieces[3 + b][0]
        if raw != f"<0x{b:02X}>".encode():
            raise TokenizerError(f"{path}: token {3 + b} is {raw!r}, expected <0x{b:02X}>")
        out.append(raw.decode())
    for i, (raw, _) in enumerate(pieces[259:], start=259):
        try:
            s = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TokenizerError(f"{path}: token {i} ({raw!r}) is not valid UTF-8") from e
        out.append(s.replace(" ", SPIECE_UNDERLINE))
    seen: dict[str, int] = {}
    for i, s in enumerate(out):
        if s in seen:
            raise TokenizerError(f"{path}: tokens {seen[s]} and {i} are both {s!r}")
        seen[s] = i
    return out


def _merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges from piece scores, as transformers' SentencePieceExtractor / generate_merges.

    Every split of every piece into two existing pieces is a merge; merges are ranked by the
    merged piece's score (highest first), ties by the ids of the two parts.
    """
    merges = []
    for piece, score in scores.items():
        local = []
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                local.append((left, right, score))
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(m[0], m[1]) for m in merges]


def build_tokenizer(path: Path, vocab_size: int):
    """Build a `tokenizers.Tokenizer` equivalent to llama2.c's tokenizer in `path`."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE

    pieces = read_tokenizer(path, vocab_size)
    strings = _piece_strings(Path(path), pieces)
    vocab = {s: i for i, s in enumerate(strings)}
    # Only the merged pieces take part in merges (special and byte tokens never do).
    scores = {s: pieces[i][1] for i, s in enumerate(strings) if i >= 259}
    tok = Tokenizer(
        BPE(
            vocab=vocab,
            merges=_merges(vocab, scores),
            unk_token="<unk>",
            fuse_unk=True,
            byte_fallback=True,
            dropout=None,
        )
    )
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend(SPIECE_UNDERLINE), normalizers.Replace(" ", SPIECE_UNDERLINE)]
    )
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace(SPIECE_UNDERLINE, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(
        [AddedToken(s, normalized=False, special=True) for s in ("<unk>", "<s>", "</s>")]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return tok


def tokenizer_config(seq_len: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "legacy": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": seq_len,
    }


# ----------------------------------------------------------------------------- driver


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert(model_bin: Path, tokenizer_bin: Path, out_dir: Path) -> None:
    """Convert a llama2.c legacy checkpoint + tokenizer to a HF llama model directory."""
    from safetensors.numpy import save_file

    cfg, arrays = read_checkpoint(Path(model_bin))
    tok = build_tokenizer(Path(tokenizer_bin), cfg.vocab_size)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(
        hf_tensors(cfg, arrays), str(out_dir / "model.safetensors"), metadata={"format": "pt"}
    )
    _write_json(out_dir / "config.json", hf_config(cfg))
    _write_json(
        out_dir / "generation_config.json",
        {"bos_token_id": 1, "eos_token_id": 2, "max_length": cfg.seq_len},
    )
    tok.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(cfg.seq_len))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m mlxr.convert.llama2c",
        description="Convert a llama2.c legacy checkpoint and tokenizer to a HF llama directory.",
    )
    ap.add_argument("model_bin", type=Path, help="llama2.c checkpoint, e.g. stories260K.bin")
    ap.add_argument("tokenizer_bin", type=Path, help="llama2.c tokenizer, e.g. tok512.bin")
    ap.add_argument("out_dir", type=Path, help="output model directory")
    args = ap.parse_args(argv)
    try:
        convert(args.model_bin, args.tokenizer_bin, args.out_dir)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
