"""Checks on tokenizer files that the `tokenizers` library does not make, run before its Rust
code sees the data (a bad pattern there is a panic, not an exception) and against the model
(a token id past the embedding table would index out of it at generation)."""

from __future__ import annotations

from typing import Any

from ..errors import ModelFormatError, TokenizerError

MAX_TOKEN_ID = (1 << 31) - 1  # ids are int32 on the device
_PATTERN_TYPES = ("Replace", "Split")  # normalizers, pre-tokenizers and decoders with a pattern


def check_tokenizer_json(doc: Any, where: str) -> None:
    """Refuse what makes `tokenizers` panic or misbehave: an empty Replace / Split pattern
    anywhere in the pipeline, added tokens whose content is not a string or whose id is not
    an int in [0, 2^31)."""
    if not isinstance(doc, dict):
        raise TokenizerError(f"{where}: expected a JSON object")
    added = doc.get("added_tokens") or []
    if not isinstance(added, list):
        raise TokenizerError(f"{where}: added_tokens must be a list")
    for i, tok in enumerate(added):
        if not isinstance(tok, dict) or not isinstance(tok.get("content"), str) \
                or not tok["content"]:
            raise TokenizerError(f"{where}: added_tokens[{i}].content must be a non-empty string")
        tid = tok.get("id")
        if type(tid) is not int or not 0 <= tid <= MAX_TOKEN_ID:
            raise TokenizerError(f"{where}: added_tokens[{i}].id = {tid!r} is not a token id")
    _check_bpe_prefix(doc.get("model"), where)
    for key in ("normalizer", "pre_tokenizer", "decoder", "post_processor"):
        stack = [(doc.get(key), key)]
        while stack:
            node, path = stack.pop()
            if isinstance(node, list):
                stack.extend((v, f"{path}[{i}]") for i, v in enumerate(node))
            elif isinstance(node, dict):
                if node.get("type") in _PATTERN_TYPES:
                    _check_pattern(node.get("pattern"), f"{where}: {path}.pattern")
                stack.extend((v, f"{path}.{k}") for k, v in node.items()
                             if isinstance(v, (dict, list)))


def _check_bpe_prefix(model: Any, where: str) -> None:
    """tokenizers' BPE builder cuts continuing_subword_prefix's bytes off the second part of
    every merge (model.rs: `&b[prefix_len..]`): a part shorter than the prefix, or a cut inside
    a UTF-8 character, is a Rust panic."""
    if not isinstance(model, dict) or model.get("type") != "BPE":
        return
    prefix = model.get("continuing_subword_prefix")
    merges = model.get("merges")
    if not isinstance(prefix, str) or not prefix or not isinstance(merges, list):
        return
    cut = len(prefix.encode("utf-8", "surrogatepass"))
    for i, merge in enumerate(merges):
        parts = merge.split(" ") if isinstance(merge, str) else merge
        if not isinstance(parts, list) or len(parts) != 2 or not isinstance(parts[1], str):
            continue  # (tokenizers refuses these itself, with an exception)
        rest = parts[1].encode("utf-8", "surrogatepass")
        if len(rest) < cut or (len(rest) > cut and rest[cut] & 0xC0 == 0x80):
            raise TokenizerError(f"{where}: model.merges[{i}] = {merge!r}: its second part "
                                 f"does not hold continuing_subword_prefix {prefix!r}")


def _check_pattern(pattern: Any, where: str) -> None:
    if not isinstance(pattern, dict) or len(pattern) != 1:
        raise TokenizerError(f"{where}: expected {{'String': ...}} or {{'Regex': ...}}")
    (kind, value), = pattern.items()
    if kind not in ("String", "Regex") or not isinstance(value, str):
        raise TokenizerError(f"{where}: expected {{'String': ...}} or {{'Regex': ...}}")
    if not value:
        raise TokenizerError(f"{where}: an empty {kind} pattern matches everywhere")


def check_token_ids(tok, vocab_size: int, where: str) -> None:
    """Every id the tokenizer can produce (vocabulary and added tokens) must be a row of the
    embedding table of `vocab_size` rows."""
    vocab = tok._tk.get_vocab(with_added_tokens=True)
    top = max(vocab.values(), default=-1)
    if top >= vocab_size:
        name = max(vocab, key=vocab.__getitem__)
        raise ModelFormatError(
            f"{where}: tokenizer token {name[:40]!r} has id {top} but the embedding table "
            f"(config.json vocab_size) has only {vocab_size} rows")
