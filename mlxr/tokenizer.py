"""Tokenizers for mlx-lm / Hugging Face model directories, on top of the `tokenizers` library.

Supported layouts, in order of preference:

* ``tokenizer.json`` (any Hugging Face fast tokenizer),
* ``vocab.json`` + ``merges.txt`` (or GPT-2's ``encoder.json`` + ``vocab.bpe``): byte-level BPE, with the Qwen2
  pre-tokenizer regex and NFC when ``tokenizer_config.json`` names a Qwen2 tokenizer, GPT-2's otherwise,
* ``tokenizer.model``: a SentencePiece BPE model (Llama / Mistral style, byte fallback), converted the way
  transformers' ``convert_slow_tokenizer`` does, or a tiktoken rank file (Llama 3), converted to byte-level BPE.

Added tokens come from ``tokenizer_config.json``'s ``added_tokens_decoder`` and ``special_tokens_map.json``.
Every failure to read these files is raised as :class:`mlxr.errors.TokenizerError` naming the file.
"""

from __future__ import annotations

import base64
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mlxr.errors import TokenizerError

try:  # the import itself is cheap, but keep the error readable if the dependency is missing
    import tokenizers
    from tokenizers import (
        AddedToken,
        Regex,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )
except ImportError as exc:  # pragma: no cover
    raise ImportError("mlxr needs the `tokenizers` package: pip install tokenizers") from exc

__all__ = ["StreamingDetokenizer", "Tokenizer", "load_chat_template", "load_tokenizer"]

GPT2_SPLIT_REGEX = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
QWEN2_SPLIT_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
LLAMA3_SPLIT_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

# Llama 3.1's 256 reserved special tokens (ids 128000-128255), as in the Hugging Face tokenizer.json.
_LLAMA3_NAMED_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|reserved_special_token_2|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
]
LLAMA3_SPECIAL_TOKENS = _LLAMA3_NAMED_SPECIALS + [
    f"<|reserved_special_token_{i}|>" for i in range(3, 3 + 256 - len(_LLAMA3_NAMED_SPECIALS))
]

_SPECIAL_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character table."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


# --------------------------------------------------------------------------------------------------------------------
# File reading helpers


def _read_json(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{path}: cannot read JSON ({exc})") from exc


def _token_content(value: Any, where: str) -> str | None:
    """A special token value from tokenizer_config.json / special_tokens_map.json: str, AddedToken dict or None."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(
        f"{where}: expected a string or a {{'content': ...}} object, got {value!r}"
    )


def _added_token(content: str, spec: dict | None, special: bool) -> AddedToken:
    spec = spec or {}
    return AddedToken(
        content,
        single_word=bool(spec.get("single_word", False)),
        lstrip=bool(spec.get("lstrip", False)),
        rstrip=bool(spec.get("rstrip", False)),
        normalized=bool(spec.get("normalized", not special)),
        special=special,
    )


# --------------------------------------------------------------------------------------------------------------------
# Backend builders


def _byte_level_bpe(
    vocab: dict[str, int], merges: list, split_regex: str | None, nfc: bool
) -> tokenizers.Tokenizer:
    tk = tokenizers.Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    if nfc:
        tk.normalizer = normalizers.NFC()
    if split_regex is None:
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split_regex), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tk.decoder = decoders.ByteLevel()
    return tk


def _load_vocab_merges(vocab_path: Path, merges_path: Path, config: dict) -> tokenizers.Tokenizer:
    vocab = _read_json(vocab_path)
    if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
        raise TokenizerError(f"{vocab_path}: expected a JSON object mapping tokens to integer ids")
    try:
        text = merges_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"{merges_path}: cannot read merges ({exc})") from exc
    merges = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line or (lineno == 1 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        if len(parts) != 2:
            raise TokenizerError(
                f"{merges_path}:{lineno}: expected two space-separated tokens, got {line!r}"
            )
        merges.append((parts[0], parts[1]))
    cls = str(config.get("tokenizer_class") or "")
    is_qwen = cls.startswith("Qwen2")
    try:
        return _byte_level_bpe(vocab, merges, QWEN2_SPLIT_REGEX if is_qwen else None, nfc=is_qwen)
    except Exception as exc:  # tokenizers raises plain Exceptions for inconsistent vocab/merges
        raise TokenizerError(f"{merges_path}: invalid BPE vocabulary/merges ({exc})") from exc


def _is_tiktoken_file(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(256)
    first = head.split(b"\n", 1)[0]
    return bool(re.fullmatch(rb"[A-Za-z0-9+/=]+ \d+", first.strip()))


def _load_tiktoken(path: Path) -> tuple[tokenizers.Tokenizer, list[str]]:
    ranks: dict[bytes, int] = {}
    try:
        for lineno, line in enumerate(path.read_bytes().splitlines(), 1):
            if not line.strip():
                continue
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
    except (ValueError, OSError) as exc:
        raise TokenizerError(f"{path}: malformed tiktoken rank file ({exc})") from exc
    byte_encoder = _bytes_to_unicode()

    def to_str(b: bytes) -> str:
        return "".join(byte_encoder[x] for x in b)

    vocab = {}
    merges = []
    for token, rank in ranks.items():
        vocab[to_str(token)] = rank
        if len(token) == 1:
            continue
        local = []
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                local.append((ranks[left], ranks[right], left, right))
        local.sort()
        merges.extend((rank, to_str(left), to_str(right)) for _, _, left, right in local)
    merges.sort(key=lambda m: m[0])
    tk = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=[(a, b) for _, a, b in merges], fuse_unk=False)
    )
    if hasattr(tk.model, "ignore_merges"):
        tk.model.ignore_merges = True
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tk.decoder = decoders.ByteLevel()
    specials = LLAMA3_SPECIAL_TOKENS if len(ranks) == 128000 else []
    return tk, specials


def _load_sentencepiece(
    path: Path, config: dict
) -> tuple[tokenizers.Tokenizer, list[tuple[str, bool]], dict]:
    """Convert a SentencePiece BPE model like transformers' LlamaConverter (Metaspace, byte fallback)."""
    try:
        from sentencepiece import sentencepiece_model_pb2 as model_pb2
    except ImportError as exc:  # pragma: no cover
        raise TokenizerError(
            f"{path}: reading SentencePiece models needs the `sentencepiece` package"
        ) from exc
    proto = model_pb2.ModelProto()
    try:
        proto.ParseFromString(path.read_bytes())
    except Exception as exc:  # protobuf's DecodeError is not a ValueError
        raise TokenizerError(f"{path}: not a SentencePiece model ({exc})") from exc
    if not proto.pieces:
        raise TokenizerError(f"{path}: SentencePiece model has no pieces")
    if proto.trainer_spec.model_type != 2:  # 1 = unigram, 2 = BPE
        raise TokenizerError(
            f"{path}: only SentencePiece BPE models are supported (model_type "
            f"{proto.trainer_spec.model_type})"
        )
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    # Merges: every split of a piece into two pieces, ordered by the merged piece's score (highest first), as
    # transformers' generate_merges(vocab, vocab_scores) does (scores are not monotonic in the id: Llama 2's "▁▁" has
    # the lowest score); control/unknown/byte pieces are never produced by merging.
    skip = {p.piece for p in proto.pieces if p.type in (2, 3, 6)}
    merges = []
    for piece, pid in vocab.items():
        if piece in skip or len(piece) < 2:
            continue
        local = []
        for i in range(1, len(piece)):
            left, right = piece[:i], piece[i:]
            if left in vocab and right in vocab and left not in skip and right not in skip:
                local.append((vocab[left], vocab[right], left, right))
        local.sort()
        score = proto.pieces[pid].score
        merges.extend((score, len(left), len(right), left, right) for _, _, left, right in local)
    merges.sort(key=lambda m: m[:3], reverse=True)
    unk_id = proto.trainer_spec.unk_id
    unk = proto.pieces[unk_id].piece if 0 <= unk_id < len(proto.pieces) else None
    tk = tokenizers.Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(m[3], m[4]) for m in merges],
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=bool(proto.trainer_spec.byte_fallback),
            dropout=None,
        )
    )
    add_prefix = (
        bool(proto.normalizer_spec.add_dummy_prefix) if proto.HasField("normalizer_spec") else True
    )
    if config.get("add_prefix_space") is not None:
        add_prefix = bool(config["add_prefix_space"])
    scheme = ("always" if config.get("legacy") else "first") if add_prefix else "never"
    tk.normalizer = None
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    seq = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        seq.append(decoders.Strip(content=" ", left=1))
    tk.decoder = decoders.Sequence(seq)
    added = [(p.piece, p.type == 3 or p.type == 2) for p in proto.pieces if p.type in (2, 3, 4)]
    ts = proto.trainer_spec
    defaults = {}
    for key, idx in (
        ("bos_token", ts.bos_id),
        ("eos_token", ts.eos_id),
        ("unk_token", ts.unk_id),
        ("pad_token", ts.pad_id),
    ):
        if 0 <= idx < len(proto.pieces):
            defaults[key] = proto.pieces[idx].piece
    return tk, added, defaults


_LLAMA_NORMALIZER_RE = re.compile(r"Prepend|Replace")


def _modernize_llama_json(tk: tokenizers.Tokenizer, config: dict) -> None:
    """transformers 5 rebuilds LlamaTokenizer pipelines: no normalizer, Metaspace(prepend_scheme="first")."""
    norm = tk.normalizer
    if norm is None or not _LLAMA_NORMALIZER_RE.search(repr(norm)) or "Prepend" not in repr(norm):
        return
    add_prefix = config.get("add_prefix_space")
    add_prefix = True if add_prefix is None else bool(add_prefix)
    scheme = ("always" if config.get("legacy") else "first") if add_prefix else "never"
    tk.normalizer = None
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)


# --------------------------------------------------------------------------------------------------------------------


class Tokenizer:
    """A loaded tokenizer: encode/decode, special tokens, chat template and a streaming detokenizer."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        special_tokens: dict[str, str | None] | None = None,
        chat_template: str | dict[str, str] | None = None,
        extra_eos_ids: Iterable[int] = (),
        name: str = "tokenizer",
        config: dict | None = None,
        spm_dummy_prefix: bool = False,
    ):
        self._tk = backend
        self.name = name
        self.config = dict(config or {})
        special_tokens = special_tokens or {}
        for key in _SPECIAL_KEYS:
            setattr(self, key, special_tokens.get(key))
        self.bos_token_id = self.token_to_id(self.bos_token) if self.bos_token else None
        eos = set(extra_eos_ids)
        if self.eos_token is not None and self.token_to_id(self.eos_token) is not None:
            eos.add(self.token_to_id(self.eos_token))
        self.eos_token_ids = frozenset(eos)
        self.eos_token_id = self.token_to_id(self.eos_token) if self.eos_token else None
        self.pad_token_id = self.token_to_id(self.pad_token) if self.pad_token else None
        self.unk_token_id = self.token_to_id(self.unk_token) if self.unk_token else None
        decoder = backend.get_added_tokens_decoder()
        self.added_tokens: dict[int, AddedToken] = dict(decoder)
        self.special_ids = frozenset(i for i, t in decoder.items() if t.special) | frozenset(
            i
            for i in (self.bos_token_id, self.eos_token_id, self.pad_token_id, self.unk_token_id)
            if i is not None
        )
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._chat_templates = chat_template
        self._spm_dummy_prefix = spm_dummy_prefix

    # -- special tokens ----------------------------------------------------------------------------------------------
    @property
    def chat_template(self) -> str | None:
        t = self._chat_templates
        if isinstance(t, dict):
            return t.get("default") or next(iter(t.values()), None)
        return t

    @property
    def special_tokens_map(self) -> dict[str, str]:
        out = {k: getattr(self, k) for k in _SPECIAL_KEYS if getattr(self, k) is not None}
        extra = self.config.get("additional_special_tokens")
        if isinstance(extra, list) and extra:
            out["additional_special_tokens"] = [
                _token_content(t, "additional_special_tokens") for t in extra
            ]
        return out

    def added_tokens_content(self) -> list[str]:
        """The strings of all added tokens (special or not), in id order."""
        return [t.content for _, t in sorted(self.added_tokens.items())]

    def token_to_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tk.id_to_token(int(token_id))

    # -- encode / decode ---------------------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode() expects a str, got {type(text).__name__}")
        if self._spm_dummy_prefix and text.startswith(" "):
            # SentencePiece always adds its dummy prefix; tokenizers' Metaspace skips it when the text already
            # starts with a space, so " a" would lose a "▁". Spell the prefix out.
            text = "▁" + text
        return self._tk.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_plain(self, text: str) -> list[int]:
        """Encode `text` as plain text: no added token (special or not) is matched, no BOS/EOS is added."""
        if not text:
            return []
        tk = self._tk
        if tk.normalizer is not None:
            text = tk.normalizer.normalize_str(text)
        splits = [text]
        if tk.pre_tokenizer is not None:
            splits = [s for s, _ in tk.pre_tokenizer.pre_tokenize_str(text)]
        return [t.id for s in splits for t in tk.model.tokenize(s)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        return self._tk.decode(ids, skip_special_tokens=skip_special_tokens)

    def detokenizer(self, skip_special_tokens: bool = False) -> StreamingDetokenizer:
        return StreamingDetokenizer(self, skip_special_tokens=skip_special_tokens)

    # -- chat --------------------------------------------------------------------------------------------------------
    def get_chat_template(self, tools=None) -> str:
        from mlxr.chat import select_template

        return select_template(self._chat_templates, tools, self.name)

    def apply_chat_template(
        self,
        messages,
        tools=None,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        documents=None,
        chat_template: str | None = None,
        **template_kwargs,
    ):
        from mlxr.chat import apply_chat_template

        return apply_chat_template(
            self,
            messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            tokenize=tokenize,
            chat_template=chat_template,
            **template_kwargs,
        )

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size})"


class StreamingDetokenizer:
    """Incremental decoding: `add(id)` returns the newly completed text (possibly "").

    Decodes a small window of recent ids (from the last emitted boundary), never the whole history, and holds back
    text that ends in an incomplete UTF-8 sequence (decoded as U+FFFD). The concatenation of everything returned by
    `add` and `flush` equals `tokenizer.decode(all_ids)`.
    """

    #: after this many held-back tokens a trailing U+FFFD is taken to be genuinely invalid bytes and emitted
    MAX_PENDING = 8

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.reset()

    def reset(self) -> None:
        self.token_ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # ids before this index have been emitted
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    def _decode(self, ids) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        self.token_ids.append(int(token_id))
        ids = self.token_ids
        prefix_text = (
            self._decode(ids[self._prefix : self._read]) if self._read > self._prefix else ""
        )
        new_text = self._decode(ids[self._prefix :])
        pending = len(ids) - self._read
        if (
            (new_text.endswith("\ufffd") and pending < self.MAX_PENDING)
            or len(new_text) < len(prefix_text)
            or not new_text.startswith(prefix_text)
        ):
            if not new_text.startswith(prefix_text) and pending >= self.MAX_PENDING:
                # should not happen with the decoders we build; resynchronise on a fresh window
                self._prefix = self._read
            return ""
        piece = new_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(ids)
        if piece:
            self._pieces.append(piece)
        return piece

    def flush(self) -> str:
        ids = self.token_ids
        if self._read >= len(ids):
            return ""
        prefix_text = (
            self._decode(ids[self._prefix : self._read]) if self._read > self._prefix else ""
        )
        new_text = self._decode(ids[self._prefix :])
        piece = new_text.removeprefix(prefix_text)
        self._prefix, self._read = self._read, len(ids)
        if piece:
            self._pieces.append(piece)
        return piece


# --------------------------------------------------------------------------------------------------------------------


def _read_chat_template(root: Path, config: dict) -> str | dict[str, str] | None:
    """chat_template.jinja (preferred, as in transformers 5) > chat_template.json > tokenizer_config.json."""
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        try:
            return jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenizerError(f"{jinja}: cannot read chat template ({exc})") from exc
    tmpl_dir = root / "additional_chat_templates"
    if (root / "chat_template.json").is_file():
        data = _read_json(root / "chat_template.json")
        value = data.get("chat_template") if isinstance(data, dict) else None
        where = f"{root / 'chat_template.json'}: chat_template"
    else:
        value = config.get("chat_template")
        where = "tokenizer_config.json: chat_template"
    if value is None:
        return None
    if isinstance(value, str):
        result: str | dict[str, str] = value
    elif isinstance(value, list):
        named = {}
        for item in value:
            if not (
                isinstance(item, dict)
                and isinstance(item.get("name"), str)
                and isinstance(item.get("template"), str)
            ):
                raise TokenizerError(
                    f"{where}: list entries must be {{'name': str, 'template': str}}"
                )
            named[item["name"]] = item["template"]
        result = named
    else:
        raise TokenizerError(f"{where}: expected a string or a list of named templates")
    if tmpl_dir.is_dir():
        extra = {p.stem: p.read_text(encoding="utf-8") for p in sorted(tmpl_dir.glob("*.jinja"))}
        if extra:
            result = (
                {"default": result, **extra} if isinstance(result, str) else {**extra, **result}
            )
    return result


def load_chat_template(path: str | os.PathLike) -> str | dict[str, str] | None:
    """The chat template(s) of a model directory, without loading the vocabulary (None if it has none)."""
    root = Path(path)
    config: dict = {}
    if (root / "tokenizer_config.json").is_file():
        config = _read_json(root / "tokenizer_config.json")
        if not isinstance(config, dict):
            raise TokenizerError(f"{root / 'tokenizer_config.json'}: expected a JSON object")
    return _read_chat_template(root, config)


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load the tokenizer of a model directory (see the module docstring for the supported files)."""
    root = Path(path)
    if not root.is_dir():
        raise TokenizerError(f"{root}: tokenizer directory not found")
    config: dict = {}
    if (root / "tokenizer_config.json").is_file():
        config = _read_json(root / "tokenizer_config.json")
        if not isinstance(config, dict):
            raise TokenizerError(f"{root / 'tokenizer_config.json'}: expected a JSON object")
    stmap: dict = {}
    if (root / "special_tokens_map.json").is_file():
        stmap = _read_json(root / "special_tokens_map.json")
        if not isinstance(stmap, dict):
            raise TokenizerError(f"{root / 'special_tokens_map.json'}: expected a JSON object")

    special: dict[str, str | None] = {}
    spm_added: list[tuple[str, bool]] = []
    extra_specials: list[str] = []
    default_bos = False  # whether BOS is added when nothing says otherwise
    kind: str
    if (root / "tokenizer.json").is_file():
        kind = "tokenizer.json"
        try:
            backend = tokenizers.Tokenizer.from_file(str(root / "tokenizer.json"))
        except Exception as exc:  # tokenizers raises a bare Exception
            raise TokenizerError(f"{root / 'tokenizer.json'}: cannot load ({exc})") from exc
        if str(config.get("tokenizer_class", "")).startswith("LlamaTokenizer"):
            _modernize_llama_json(backend, config)
    elif (root / "vocab.json").is_file() and (root / "merges.txt").is_file():
        kind = "vocab.json"
        backend = _load_vocab_merges(root / "vocab.json", root / "merges.txt", config)
    elif (root / "encoder.json").is_file() and (root / "vocab.bpe").is_file():
        kind = "vocab.json"
        backend = _load_vocab_merges(root / "encoder.json", root / "vocab.bpe", config)
    elif (root / "tokenizer.model").is_file():
        model_path = root / "tokenizer.model"
        try:
            is_tiktoken = _is_tiktoken_file(model_path)
        except OSError as exc:
            raise TokenizerError(f"{model_path}: cannot read ({exc})") from exc
        if is_tiktoken:
            kind = "tiktoken"
            backend, extra_specials = _load_tiktoken(model_path)
            if extra_specials:
                special.update(bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>")
            default_bos = True
        else:
            kind = "sentencepiece"
            backend, spm_added, defaults = _load_sentencepiece(model_path, config)
            special.update(defaults)
            default_bos = True
    else:
        present = sorted(p.name for p in root.iterdir())
        raise TokenizerError(
            f"{root}: no tokenizer files found (expected tokenizer.json, vocab.json + merges.txt, or tokenizer.model;"
            f" found {present})"
        )

    # -- added tokens ------------------------------------------------------------------------------------------------
    to_add: list[AddedToken] = []
    for content, is_special in spm_added:
        to_add.append(AddedToken(content, normalized=False, special=is_special))
    for content in extra_specials:
        to_add.append(AddedToken(content, normalized=False, special=True))
    # extra specials get consecutive ids after the base vocabulary
    added_decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(added_decoder, dict):
        raise TokenizerError(
            f"{root / 'tokenizer_config.json'}: added_tokens_decoder must be an object"
        )
    existing = backend.get_added_tokens_decoder()
    by_id: list[tuple[int, AddedToken]] = []
    for key, spec in added_decoder.items():
        try:
            idx = int(key)
            content = spec["content"]
        except (ValueError, TypeError, KeyError) as exc:
            raise TokenizerError(
                f"{root / 'tokenizer_config.json'}: added_tokens_decoder[{key!r}] is malformed"
            ) from exc
        if idx in existing and existing[idx].content == content:
            continue
        by_id.append((idx, _added_token(content, spec, bool(spec.get("special", False)))))
    by_id.sort(key=lambda x: x[0])
    next_free = backend.get_vocab_size(with_added_tokens=True) + len(to_add)
    for idx, tok in by_id:
        have = backend.token_to_id(tok.content)
        if have is not None and have != idx:
            raise TokenizerError(
                f"{root / 'tokenizer_config.json'}: added token {tok.content!r} has id {idx} but the "
                f"vocabulary maps it to {have}"
            )
        if have is None:
            # ids must be contiguous after the vocabulary for tokenizers to assign them
            if idx != next_free:
                raise TokenizerError(
                    f"{root / 'tokenizer_config.json'}: added token {tok.content!r} id {idx} is not "
                    f"the next free id ({next_free})"
                )
            next_free += 1
        to_add.append(tok)
    # special tokens named in the config / special_tokens_map must be registered (as special)
    for source, where in ((stmap, "special_tokens_map.json"), (config, "tokenizer_config.json")):
        for key in _SPECIAL_KEYS:
            if key in source:
                special[key] = _token_content(source[key], f"{where}: {key}")
        extras = source.get("additional_special_tokens")
        if isinstance(extras, list):
            for item in extras:
                content = _token_content(item, f"{where}: additional_special_tokens")
                if content is not None:
                    to_add.append(
                        _added_token(content, item if isinstance(item, dict) else None, True)
                    )
    if kind != "tokenizer.json":
        for key in _SPECIAL_KEYS:
            content = special.get(key)
            if content is not None and backend.token_to_id(content) is not None:
                to_add.append(AddedToken(content, normalized=False, special=True))
    # add in a single call, preserving the decoder order (ids are assigned in order for new tokens)
    for t in to_add:  # one by one, so that new tokens get ids in the listed order
        if t.special:
            backend.add_special_tokens([t])
        else:
            backend.add_tokens([t])
    for idx, tok in by_id:
        if backend.token_to_id(tok.content) != idx:
            raise TokenizerError(
                f"{root / 'tokenizer_config.json'}: added token {tok.content!r} did not get id {idx}"
            )

    # -- BOS/EOS post-processing (as transformers' update_post_processor) ------------------------------------------------
    explicit = "add_bos_token" in config or "add_eos_token" in config
    if explicit or backend.post_processor is None or kind in ("sentencepiece", "tiktoken"):
        add_bos = bool(config.get("add_bos_token", default_bos))
        add_eos = bool(config.get("add_eos_token", False))
        bos, eos = special.get("bos_token"), special.get("eos_token")
        bos_id = backend.token_to_id(bos) if bos else None
        eos_id = backend.token_to_id(eos) if eos else None
        add_bos = add_bos and bos_id is not None
        add_eos = add_eos and eos_id is not None
        single = f"{(bos + ':0 ') if add_bos else ''}$A:0{(' ' + eos + ':0') if add_eos else ''}"
        pair = f"{single}{(' ' + bos + ':1') if add_bos else ''} $B:1{(' ' + eos + ':1') if add_eos else ''}"
        toks = ([(bos, bos_id)] if add_bos else []) + ([(eos, eos_id)] if add_eos else [])
        backend.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=toks
        )

    extra_eos: set[int] = set()
    if kind == "tiktoken" and extra_specials:
        extra_eos.update(
            backend.token_to_id(t) for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")
        )
    gen_path = root / "generation_config.json"
    if gen_path.is_file():
        gen = _read_json(gen_path)
        eid = gen.get("eos_token_id") if isinstance(gen, dict) else None
        for i in [eid] if isinstance(eid, int) else eid if isinstance(eid, list) else []:
            if isinstance(i, int):
                extra_eos.add(i)

    chat_template = _read_chat_template(root, config)
    spm_prefix = (
        kind == "sentencepiece"
        and isinstance(backend.pre_tokenizer, pre_tokenizers.Metaspace)
        and backend.pre_tokenizer.prepend_scheme != "never"
    )
    return Tokenizer(
        backend,
        special_tokens=special,
        chat_template=chat_template,
        extra_eos_ids=extra_eos,
        name=str(root),
        config=config,
        spm_dummy_prefix=spm_prefix,
    )
