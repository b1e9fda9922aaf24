"""Tokenizers for mlx-lm / Hugging Face model directories, on top of the `tokenizers` library.

Supported layouts, in order of preference:

* ``tokenizer.json`` (any Hugging Face fast tokenizer),
* ``vocab.json`` + ``merges.txt`` (or GPT-2's ``encoder.json`` + ``vocab.bpe``): byte-level BPE,
  with the Qwen2 pre-tokenizer regex and NFC when ``tokenizer_config.json`` names a Qwen2
  tokenizer, GPT-2's otherwise,
* ``tokenizer.model``: a SentencePiece BPE model (Llama / Mistral style, byte fallback), converted
  the way transformers' ``convert_slow_tokenizer`` does, or a tiktoken rank file (Llama 3),
  converted to byte-level BPE.

Added tokens come from ``tokenizer_config.json``'s ``added_tokens_decoder`` and
``special_tokens_map.json``. Every failure to read these files is raised as
:class:`mlxr.errors.TokenizerError` naming the file.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from mlxr import bounded_json
from mlxr.errors import TokenizerError
from mlxr.text.tokenizer_checks import check_tokenizer_json

try:  # the import itself is cheap, but keep the error readable if the dependency is missing
    import tokenizers
    from tokenizers import AddedToken, pre_tokenizers, processors
except ImportError as exc:  # pragma: no cover
    raise ImportError("mlxr needs the `tokenizers` package: pip install tokenizers") from exc

from mlxr.text.chat import apply_chat_template, select_template
from mlxr.text.detokenizer import StreamingDetokenizer
from mlxr.text.tokenizer_formats import (
    _SPECIAL_KEYS,
    _add_tokens,
    _is_tiktoken_file,
    _load_sentencepiece,
    _load_tiktoken,
    _load_vocab_merges,
    _modernize_llama_json,
    _read_json,
    _token_content,
)

__all__ = ["TOKENIZER_FILES", "StreamingDetokenizer", "Tokenizer", "check_tokenizer_files",
           "load_chat_template", "load_tokenizer"]

# Every file a tokenizer (with its special tokens and chat template) may be read from: what to
# copy to move a tokenizer between model folders (fnmatch patterns).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "merges.txt", "encoder.json", "vocab.bpe", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json", "*.tiktoken")
# The vocabulary files load_tokenizer needs, one of these sets (in its order of preference).
_VOCAB_SETS = (("tokenizer.json",), ("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe"),
               ("tokenizer.model",))

MAX_TEMPLATE_BYTES = 4 << 20  # real chat templates are < 100 KB
LONG_TEXT = 1 << 16  # chars: texts past it are encoded without holding the GIL

# -------------------------------------------------------------------------------------------------


class Tokenizer:
    """A loaded tokenizer: encode/decode, special tokens, chat template and a streaming
    detokenizer."""

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

    # -- special tokens ---------------------------------------------------------------------------
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
        try:
            return self._tk.token_to_id(token)
        except UnicodeEncodeError:  # a lone surrogate (from a config's JSON) is no token
            return None

    def id_to_token(self, token_id: int) -> str | None:
        return self._tk.id_to_token(int(token_id))

    # -- encode / decode --------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode() expects a str, got {type(text).__name__}")
        if not bounded_json.utf8_ok(text):  # tokenizers raises a TypeError on them
            raise TokenizerError("text holds a lone UTF-16 surrogate (not UTF-8 text)")
        if self._spm_dummy_prefix and text.startswith(" "):
            # SentencePiece always adds its dummy prefix; tokenizers' Metaspace skips it when the
            # text already starts with a space, so " a" would lose a "▁". Spell the prefix out.
            text = "▁" + text
        if len(text) > LONG_TEXT:  # encode_batch releases the GIL (encode holds it: seconds)
            return self._tk.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tk.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_plain(self, text: str) -> list[int]:
        """Encode `text` as plain text: no added token (special or not) is matched, no BOS/EOS is
        added."""
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

    def decode_batch(self, seqs: list[list[int]], skip_special_tokens: bool = False) -> list[str]:
        """decode() of each id list, in one call (tokenizers decodes them in parallel, without
        the GIL: the serving engine detokenizes every sequence of a step this way)."""
        return self._tk.decode_batch(seqs, skip_special_tokens=skip_special_tokens)

    def detokenizer(self, skip_special_tokens: bool = False) -> StreamingDetokenizer:
        return StreamingDetokenizer(self, skip_special_tokens=skip_special_tokens)

    # -- chat -------------------------------------------------------------------------------------
    def get_chat_template(self, tools=None) -> str:
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


# -------------------------------------------------------------------------------------------------


def _read_chat_template(root: Path, config: dict) -> str | dict[str, str] | None:
    """chat_template.jinja (preferred, as in transformers 5) > chat_template.json >
    tokenizer_config.json."""
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        return bounded_json.read_text(jinja, TokenizerError, MAX_TEMPLATE_BYTES)
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
        extra = {p.stem: bounded_json.read_text(p, TokenizerError, MAX_TEMPLATE_BYTES)
                 for p in sorted(tmpl_dir.glob("*.jinja"))}
        if extra:
            result = (
                {"default": result, **extra} if isinstance(result, str) else {**extra, **result}
            )
    return result


def load_chat_template(path: str | os.PathLike) -> str | dict[str, str] | None:
    """The chat template(s) of a model directory, without loading the vocabulary (None if it has
    none)."""
    root = Path(path)
    config: dict = {}
    if (root / "tokenizer_config.json").is_file():
        config = _read_json(root / "tokenizer_config.json")
        if not isinstance(config, dict):
            raise TokenizerError(f"{root / 'tokenizer_config.json'}: expected a JSON object")
    return _read_chat_template(root, config)


def check_tokenizer_files(path: str | os.PathLike) -> None:
    """Raise TokenizerError naming the folder when it lacks the vocabulary files load_tokenizer
    needs: a check of file names only, for callers to make before loading any weights."""
    root = Path(path)
    if not root.is_dir():
        raise TokenizerError(f"{root}: tokenizer directory not found")
    if not any(all((root / f).is_file() for f in files) for files in _VOCAB_SETS):
        present = sorted(p.name for p in root.iterdir())
        shown = ", ".join(present[:8]) + (f", ... ({len(present)} files)" if len(present) > 8
                                          else "")
        raise TokenizerError(
            f"{root}: no tokenizer files (expected tokenizer.json, vocab.json + merges.txt, or "
            f"tokenizer.model; found {shown or 'nothing'}): copy the tokenizer files of the "
            "model it was made from into this folder")


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load the tokenizer of a model directory (see the module docstring for the supported
    files)."""
    root = Path(path)
    check_tokenizer_files(root)
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
        path = root / "tokenizer.json"
        text = bounded_json.read_text(path, TokenizerError)
        check_tokenizer_json(bounded_json.loads(text, str(path), TokenizerError), str(path))
        try:
            backend = tokenizers.Tokenizer.from_str(text)
        except BaseException as exc:  # tokenizers raises a bare Exception, or panics
            if not isinstance(exc, Exception) and type(exc).__name__ != "PanicException":
                raise  # (KeyboardInterrupt, SystemExit; a Rust panic is a BaseException)
            raise TokenizerError(f"{path}: cannot load ({exc})") from exc
        if str(config.get("tokenizer_class", "")).startswith("LlamaTokenizer"):
            _modernize_llama_json(backend, config)
    elif (root / "vocab.json").is_file() and (root / "merges.txt").is_file():
        kind = "vocab.json"
        backend = _load_vocab_merges(root / "vocab.json", root / "merges.txt", config)
    elif (root / "encoder.json").is_file() and (root / "vocab.bpe").is_file():
        kind = "vocab.json"
        backend = _load_vocab_merges(root / "encoder.json", root / "vocab.bpe", config)
    else:  # tokenizer.model: check_tokenizer_files made sure one of the sets is present
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

    # -- added tokens -----------------------------------------------------------------------------
    _add_tokens(backend, root, config, stmap, kind, special, spm_added, extra_specials)

    # -- BOS/EOS post-processing (as transformers' update_post_processor) -------------------------
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
        pair = (
            f"{single}{(' ' + bos + ':1') if add_bos else ''}"
            f" $B:1{(' ' + eos + ':1') if add_eos else ''}"
        )
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
