"""Streaming detokenization: the text of a growing id sequence, emitted piece by piece as it
becomes final (never a half UTF-8 character), equal in total to decoding all ids at once."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol


class Decodes(Protocol):
    """What the detokenizer needs of a tokenizer (mlxr.text.tokenizer.Tokenizer has it)."""

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str: ...


class StreamingDetokenizer:
    """Incremental decoding: `add(id)` returns the newly completed text (possibly "").

    Decodes a small window of recent ids (from the last emitted boundary), never the whole history,
    and holds back text that ends in an incomplete UTF-8 sequence (decoded as U+FFFD). The
    concatenation of everything returned by `add` and `flush` equals `tokenizer.decode(all_ids)`.
    """

    #: after this many held-back tokens a trailing U+FFFD is taken to be genuinely invalid bytes and
    #: emitted
    MAX_PENDING = 8

    def __init__(self, tokenizer: Decodes, skip_special_tokens: bool = False):
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
        return self.accept([self._decode(w) for w in self.windows(token_id)])

    def windows(self, token_id: int) -> list[list[int]]:
        """Append `token_id` and return the id windows whose text `accept` needs (decode them
        one by one, or many streams' at once with Tokenizer.decode_batch)."""
        self.token_ids.append(int(token_id))
        ids = self.token_ids
        new = ids[self._prefix:]
        return [ids[self._prefix:self._read], new] if self._read > self._prefix else [new]

    @property
    def skip_special_tokens(self) -> bool:
        return self._skip

    def accept(self, texts: list[str]) -> str:
        """The newly completed text, given the decoded `windows` of the last token."""
        prefix_text, new_text = texts if len(texts) == 2 else ("", texts[0])
        ids = self.token_ids
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
