"""Limits for chat templates: a template is code from a model folder, run on every request.

Jinja's sandbox stops attribute escapes, not resource use: `range(10**9)` (an OverflowError
past 100,000 items), `[0] * 10**9`, `'x' * 300000000`, `10 ** 10 ** 8`, `lipsum(n=200000)`,
`tojson(indent=10**9)`, `'%1000000000s' % x`, nested loops, recursive macros. `BoundedSandbox`
checks the size of every value an operator, call or filter is about to build *before* it is
built, counts the output as it is produced, and `render` bounds the wall time by tracing the
template's own frames (line events in compiled template code only). Every limit raised is a
`TemplateLimitError` naming the limit; real templates render byte-identical (tests/test_chat.py).
"""

from __future__ import annotations

import functools
import re
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.sandbox

from ..errors import TokenizerError

# jinja compiles templates from strings under this file name
_TEMPLATE_FILE = "<template>"
_FORMAT_SPEC = re.compile(r"%[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")
_SIZED = (str, list, tuple, dict, bytes)


class TemplateLimitError(TokenizerError):
    """A chat template went past one of its TemplateLimits."""


@dataclass(frozen=True)
class TemplateLimits:
    """What one render may use. Real templates stay orders of magnitude below each."""

    max_output_chars: int = 16 << 20  # the rendered prompt (request bodies are <= 4 MiB)
    max_str_chars: int = 16 << 20  # any one string a template builds
    max_items: int = 1 << 20  # any one list / tuple / dict a template builds
    max_int_bits: int = 1 << 16  # ~20,000 decimal digits
    max_width: int = 1 << 16  # padding widths, indents, batch sizes, slice counts
    max_seconds: float = 5.0
    max_lipsum_words: int = 10_000
    max_strftime_format: int = 256


DEFAULT_LIMITS = TemplateLimits()


class _Budget(threading.local):
    limits: TemplateLimits | None = None
    output = 0
    deadline = 0.0
    lines = 0


_budget = _Budget()


def _limits() -> TemplateLimits:
    return _budget.limits or DEFAULT_LIMITS


def _fail(what: str, limit: Any) -> TemplateLimitError:
    return TemplateLimitError(f"chat template exceeded a limit: {what} (limit {limit})")


def check_size(value: Any) -> Any:
    """`value` unchanged if its length is within the limits; else TemplateLimitError."""
    if isinstance(value, _SIZED):
        lim = _limits()
        cap = lim.max_str_chars if isinstance(value, (str, bytes)) else lim.max_items
        if len(value) > cap:
            raise _fail(f"a {type(value).__name__} of {len(value)} items", cap)
    return value


def _check_width(n: Any, what: str) -> None:
    lim = _limits().max_width
    if isinstance(n, int) and not -lim <= n <= lim:
        raise _fail(f"{what} {n}", lim)


def _check_percent_format(fmt: str, what: str) -> None:
    for m in _FORMAT_SPEC.finditer(fmt):
        for part in m.groups():
            if part == "*":
                raise _fail(f"{what}: a '*' width", "explicit widths only")
            if part is not None:
                _check_width(int(part), f"{what} width")


def _check_brace_format(fmt: str) -> None:
    if re.search(r"\{[^{}]*\{", fmt):
        raise _fail("str.format with a nested replacement field", "none")
    for n in re.findall(r"\d+", fmt):
        if len(n) > 6:
            raise _fail(f"str.format width {n[:12]}", _limits().max_width)


def _product_size(seq: Any, n: Any) -> None:
    if isinstance(seq, _SIZED) and isinstance(n, int):
        lim = _limits()
        cap = lim.max_str_chars if isinstance(seq, (str, bytes)) else lim.max_items
        if len(seq) * max(n, 0) > cap:
            raise _fail(f"repeating a {type(seq).__name__} {n} times", cap)


def _check_binop(op: str, left: Any, right: Any) -> None:
    lim = _limits()
    ints = isinstance(left, int) and isinstance(right, int)
    if op == "*":
        _product_size(left, right)
        _product_size(right, left)
        if ints and left.bit_length() + right.bit_length() > lim.max_int_bits:
            raise _fail("an integer product", f"{lim.max_int_bits} bits")
    elif op == "**" and ints and right > 0 and abs(left) > 1:
        if left.bit_length() * right > lim.max_int_bits:
            raise _fail(f"an integer power ({right})", f"{lim.max_int_bits} bits")
    elif op == "+" and isinstance(left, _SIZED) and isinstance(right, _SIZED):
        cap = lim.max_str_chars if isinstance(left, str) else lim.max_items
        if len(left) + len(right) > cap:
            raise _fail("a concatenation", cap)
    elif op == "%" and isinstance(left, str):
        _check_percent_format(left, "'%' formatting")


def _check_call(obj: Any, args: tuple, kwargs: dict) -> None:
    owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
    if not isinstance(owner, str):
        return
    if name in ("ljust", "rjust", "center", "zfill", "expandtabs"):
        for a in (*args, *kwargs.values()):
            _check_width(a, f"str.{name}")
    elif name in ("format", "format_map"):
        _check_brace_format(owner)
    elif name == "replace" and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
        old, new = args[0], args[1]
        hits = owner.count(old) if old else len(owner) + 1
        if len(owner) + hits * max(0, len(new) - len(old)) > _limits().max_str_chars:
            raise _fail("str.replace", _limits().max_str_chars)


class BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The immutable sandbox plus size checks on operators, calls and filters (see module)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        _check_binop(operator, left, right)
        return check_size(super().call_binop(context, operator, left, right))

    def wrap_str_format(self, value: Any):
        """Access to a str's `format` / `format_map` (jinja wraps them here): refuse padding
        widths past the limit before the call can build them."""
        if isinstance(getattr(value, "__self__", None), str) \
                and getattr(value, "__name__", "") in ("format", "format_map"):
            _check_brace_format(value.__self__)
        return super().wrap_str_format(value)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 -- jinja's signature
        _check_call(__obj, args, kwargs)
        return check_size(super().call(__context, __obj, *args, **kwargs))


def _count_output(value: Any) -> Any:
    """Every `{{ ... }}` value (also inside {% set %} blocks and macros) counts toward the
    output limit: a captured block grows without passing through the output stream."""
    if isinstance(value, str):
        _budget.output += len(value)
        lim = _limits().max_output_chars
        if _budget.output > lim and _budget.limits is not None:
            raise _fail("output size", f"{lim} chars")
    return value


def _sized_filter(fn, pre=None):
    skip = 1 if hasattr(fn, "jinja_pass_arg") else 0  # its first argument is a context

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if pre is not None:
            pre(args[skip:], kwargs)  # (value, arguments...)
        return check_size(fn(*args, **kwargs))
    return wrapped


def _arg(args: tuple, kwargs: dict, i: int, name: str) -> Any:
    return args[i] if len(args) > i else kwargs.get(name)


# Pre-checks for filters that build a value from a size argument: (filter, positional index
# of the size counting the value itself, keyword name). jinja's signatures.
_SIZE_ARGS = {"center": (1, "width"), "indent": (1, "width"), "batch": (1, "linecount"),
              "slice": (1, "slices"), "truncate": (1, "length"), "wordwrap": (1, "width")}


def bound_environment(env: BoundedSandbox) -> None:
    """Wrap every filter with a size check, and the sized ones with a pre-check; count output.
    Constant folding is switched off: it would run filters at compile time, outside `render`'s
    time limit (the rendered text is the same)."""
    env.optimized = False
    for name, fn in list(env.filters.items()):
        pre = None
        if name in _SIZE_ARGS:
            i, key = _SIZE_ARGS[name]

            def pre(args, kwargs, i=i, key=key, name=name):
                v = _arg(args, kwargs, i, key)
                if isinstance(v, str):  # indent(width="  ")
                    check_size(v)
                else:
                    _check_width(v, f"{name}()")
        elif name == "format":
            def pre(args, kwargs):
                if args and isinstance(args[0], str):
                    _check_percent_format(args[0], "format filter")
        elif name == "replace":
            def pre(args, kwargs):
                if len(args) >= 3 and all(isinstance(a, str) for a in args[:3]):
                    _check_call(args[0].replace, args[1:3], {})
        env.filters[name] = _sized_filter(fn, pre)
    env.finalize = _count_output


def bounded_lipsum(lipsum):
    """jinja's lipsum with its paragraph count and word range bounded."""
    def wrapped(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
        words = _limits().max_lipsum_words
        if not all(isinstance(v, int) for v in (n, min, max)) or n * max > words or min > max:
            raise _fail(f"lipsum(n={n!r}, max={max!r})", f"{words} words")
        return lipsum(n=n, html=html, min=min, max=max)
    return wrapped


def check_strftime_format(fmt: Any) -> None:
    lim = _limits().max_strftime_format
    if not isinstance(fmt, str) or len(fmt) > lim:
        raise _fail("strftime_now format", f"a string of {lim} chars")


def check_indent(indent: Any) -> None:
    if isinstance(indent, str):
        _check_width(len(indent), "tojson indent")
    elif indent is not None:
        _check_width(indent if isinstance(indent, int) else 0, "tojson indent")


def _tracer(frame, event, arg):
    if frame.f_code.co_filename != _TEMPLATE_FILE:
        return None
    return _line_tracer


def _line_tracer(frame, event, arg):
    b = _budget
    b.lines += 1
    if not b.lines & 1023 and time.monotonic() > b.deadline:
        raise _fail("render time", f"{_limits().max_seconds} s")
    return _line_tracer


def render(template: jinja2.Template, limits: TemplateLimits, context: dict) -> str:
    """`template.render(**context)` within `limits` (on this thread)."""
    b = _budget
    saved = (b.limits, b.output, b.deadline, b.lines)
    b.limits, b.output, b.lines = limits, 0, 0
    b.deadline = time.monotonic() + limits.max_seconds
    previous = sys.gettrace()
    sys.settrace(_tracer)
    try:
        pieces, size = [], 0
        for piece in template.generate(**context):
            size += len(piece)
            if size > limits.max_output_chars:
                raise _fail("output size", f"{limits.max_output_chars} chars")
            pieces.append(piece)
        return "".join(pieces)
    finally:
        sys.settrace(previous)
        b.limits, b.output, b.deadline, b.lines = saved
