"""One bounded JSON reader for untrusted documents: files of a model folder and request bodies.

`json.loads` alone accepts what later code cannot survive: nesting deep enough to exhaust the
recursion limit of every walker after it, integer literals of hundreds of digits (an
OverflowError when turned into a float), `NaN` / `Infinity` (not JSON at all) and floats that
overflow to inf. Here each of those is an error naming the document, raised before anyone walks
the data. Depth is measured after parsing with an explicit stack (no recursion of our own).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from .errors import MlxrError, ModelFormatError

MAX_DEPTH = 64  # real configs nest < 8 levels, tokenizer.json < 10, tool schemas < 20
# int64 / uint64 fit, and transformers' "unbounded" model_max_length (int(1e30): 31 digits)
MAX_INT_DIGITS = 40
MAX_FILE_BYTES = 64 << 20  # config-like files are KiB; the largest tokenizer.json is ~35 MB


class _Reject(Exception):
    """Raised by the decoder hooks; turned into the caller's error with the document's name."""


def _constant(name: str) -> Any:
    raise _Reject(f"{name} is not a JSON number")


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _Reject(f"integer literal of {len(text)} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise _Reject(f"number {text[:40]!r} overflows a float")
    return v


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise _Reject(f"duplicate key {key!r}")
        obj[key] = value
    return obj


def depth_and_surrogate(doc: Any, max_depth: int, strings: bool) -> str | None:
    """Why `doc` is unacceptable (nested deeper than `max_depth`; with `strings`, a string or
    key holding a lone UTF-16 surrogate, which no UTF-8 consumer accepts), or None."""
    stack = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            if depth > max_depth:
                return f"nested deeper than {max_depth} levels"
            for k, v in node.items():
                if strings and not utf8_ok(k):
                    return f"key {k[:40]!r} holds a lone surrogate"
                stack.append((v, depth + 1))
        elif isinstance(node, list):
            if depth > max_depth:
                return f"nested deeper than {max_depth} levels"
            stack.extend((v, depth + 1) for v in node)
        elif strings and isinstance(node, str) and not utf8_ok(node):
            return f"string {node[:40]!r} holds a lone surrogate"
    return None


def utf8_ok(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def loads(raw: bytes | str, where: str, error: type[MlxrError] = ModelFormatError,
          max_depth: int = MAX_DEPTH, reject_duplicates: bool = False,
          strings: bool = False) -> Any:
    """Parse one untrusted JSON document; every failure is `error` naming `where`.

    `reject_duplicates` refuses a key repeated in one object; `strings=True` refuses lone
    surrogates (a request body's `"\\ud800"`)."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        doc = json.loads(text, parse_constant=_constant, parse_int=_int, parse_float=_float,
                         object_pairs_hook=_no_duplicates if reject_duplicates else None)
    except _Reject as e:
        raise error(f"{where}: invalid JSON ({e})") from None
    except RecursionError:
        raise error(f"{where}: JSON nested deeper than {max_depth} levels") from None
    except ValueError as e:  # bad UTF-8, malformed JSON
        raise error(f"{where}: malformed JSON ({e})") from None
    why = depth_and_surrogate(doc, max_depth, strings)
    if why is not None:
        raise error(f"{where}: JSON {why}")
    return doc


def read_text(path: Path, error: type[MlxrError] = ModelFormatError,
              max_bytes: int = MAX_FILE_BYTES, name: str | None = None) -> str:
    """A UTF-8 text file of a model folder (JSON, a Jinja template), at most `max_bytes`;
    errors name it (`name`, else its path). Only regular files are opened (a FIFO blocks)."""
    path = Path(path)
    where = name or str(path)
    try:
        if not path.is_file():
            raise error(f"{where}: not a regular file")
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > max_bytes:
                raise error(f"{where}: {size} bytes exceeds the {max_bytes}-byte limit")
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise error(f"{where}: cannot read ({e.strerror or e})") from None
    if len(raw) > max_bytes:
        raise error(f"{where}: grew past the {max_bytes}-byte limit while reading")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{where}: not UTF-8 text ({e})") from None


def read_file(path: Path, error: type[MlxrError] = ModelFormatError,
              max_bytes: int = MAX_FILE_BYTES, max_depth: int = MAX_DEPTH,
              name: str | None = None, reject_duplicates: bool = False) -> Any:
    """Read and parse a JSON file of a model folder (see `read_text` and `loads`)."""
    where = name or str(path)
    return loads(read_text(path, error, max_bytes, where), where, error, max_depth,
                 reject_duplicates)
