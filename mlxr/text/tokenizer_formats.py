"""Building a `tokenizers.Tokenizer` from the on-disk formats that
:func:`mlxr.text.tokenizer.load_tokenizer` reads.

``tokenizer.json`` pipelines of Llama tokenizers are modernised as transformers 5 does,
``vocab.json`` + ``merges.txt`` become byte-level BPE, ``tokenizer.model`` is converted from a
SentencePiece BPE model or a tiktoken rank file, and added / special tokens from
``tokenizer_config.json`` and ``special_tokens_map.json`` are registered. Every failure is raised
as :class:`mlxr.errors.TokenizerError` naming the file.
"""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from mlxr import bounded_json
from mlxr.errors import TokenizerError

GPT2_SPLIT_REGEX = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
QWEN2_SPLIT_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa: E501
LLAMA3_SPLIT_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""  # noqa: E501

# Llama 3.1's 256 reserved special tokens (ids 128000-128255), as in the Hugging Face
# tokenizer.json.
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


# -------------------------------------------------------------------------------------------------
# File reading helpers


def _read_json(path: Path) -> Any:
    return bounded_json.read_file(path, TokenizerError)


def _token_content(value: Any, where: str) -> str | None:
    """A special token value from tokenizer_config.json / special_tokens_map.json: str, AddedToken
    dict or None."""
    content = value.get("content") if isinstance(value, dict) else value
    if value is None or isinstance(content, str) and bounded_json.utf8_ok(content):
        return content
    raise TokenizerError(  # (a lone surrogate: tokenizers' token_to_id raises on it)
        f"{where}: expected a UTF-8 string or a {{'content': ...}} object, got {value!r}"
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


# -------------------------------------------------------------------------------------------------
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
    """Convert a SentencePiece BPE model like transformers' LlamaConverter (Metaspace, byte
    fallback)."""
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
    # Merges: every split of a piece into two pieces, ordered by the merged piece's score (highest
    # first), as transformers' generate_merges(vocab, vocab_scores) does (scores are not monotonic
    # in the id: Llama 2's "▁▁" has the lowest score); control/unknown/byte pieces are never
    # produced by merging.
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
    """transformers 5 rebuilds LlamaTokenizer pipelines: no normalizer,
    Metaspace(prepend_scheme="first")."""
    norm = tk.normalizer
    if norm is None or not _LLAMA_NORMALIZER_RE.search(repr(norm)) or "Prepend" not in repr(norm):
        return
    add_prefix = config.get("add_prefix_space")
    add_prefix = True if add_prefix is None else bool(add_prefix)
    scheme = ("always" if config.get("legacy") else "first") if add_prefix else "never"
    tk.normalizer = None
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)


def _add_tokens(
    backend: tokenizers.Tokenizer,
    root: Path,
    config: dict,
    stmap: dict,
    kind: str,
    special: dict[str, str | None],
    spm_added: list[tuple[str, bool]],
    extra_specials: list[str],
) -> None:
    """Register the added tokens of a model directory on `backend`; `special` gets the special
    tokens it names."""
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
        idx = int(key) if key.isascii() and key.isdigit() and len(key) < 11 else -1
        content = spec.get("content") if isinstance(spec, dict) else None
        if (not 0 <= idx < 1 << 31 or not isinstance(content, str) or not content
                or not bounded_json.utf8_ok(content)):
            raise TokenizerError(
                f"{root / 'tokenizer_config.json'}: added_tokens_decoder[{key!r}] is malformed "
                "(needs a token id key and a non-empty string 'content')"
            )
        if idx in existing and existing[idx].content == content:
            continue
        by_id.append((idx, _added_token(content, spec, bool(spec.get("special", False)))))
    by_id.sort(key=lambda x: x[0])
    next_free = backend.get_vocab_size(with_added_tokens=True) + len(to_add)
    for idx, tok in by_id:
        have = backend.token_to_id(tok.content)
        if have is not None and have != idx:
            raise TokenizerError(
                f"{root / 'tokenizer_config.json'}: added token {tok.content!r} has id {idx} "
                f"but the vocabulary maps it to {have}"
            )
        if have is None:
            # ids must be contiguous after the vocabulary for tokenizers to assign them
            if idx != next_free:
                raise TokenizerError(
                    f"{root / 'tokenizer_config.json'}: added token {tok.content!r} id {idx} "
                    f"is not the next free id ({next_free})"
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
                f"{root / 'tokenizer_config.json'}: added token {tok.content!r} "
                f"did not get id {idx}"
            )
