"""Chat templates: render a model's Jinja chat template exactly as transformers'
`apply_chat_template` does.

The Jinja environment mirrors transformers' (`utils/chat_template_utils.py`): an
ImmutableSandboxedEnvironment with trim_blocks/lstrip_blocks, the loopcontrols extension, a no-op
`{% generation %}` tag, `raise_exception`, `strftime_now`, a `tojson` filter that does not escape
HTML or non-ASCII, and underscore-safe `namespace`/`dict`.

Tokenizing a chat (``tokenize=True``) treats user-supplied strings as plain text: control tokens
that appear in message contents, tools, documents or template arguments are wrapped in private-use
markers before rendering, and the marked spans are encoded without matching added tokens, so
``<|im_start|>`` typed by a user never becomes the control token. Only the template's own markup
becomes control tokens.
"""

from __future__ import annotations

import json
import os
import re
import sys
from datetime import datetime
from functools import lru_cache
from typing import Any, Protocol

from mlxr import bounded_json
from mlxr.text import template_sandbox as sandbox
from mlxr.errors import TokenizerError

__all__ = ["apply_chat_template", "compile_template", "render_chat_template", "select_template"]



class ChatTokenizer(Protocol):
    """What rendering and encoding a chat needs of a tokenizer (`mlxr.text.tokenizer.Tokenizer`
    is one). A protocol, so that this module does not import the tokenizer module, which
    imports this one for `Tokenizer.apply_chat_template`."""

    name: str
    added_tokens: dict[int, Any]  # id -> tokenizers.AddedToken (.content, .special)
    _chat_templates: str | dict[str, str] | None

    @property
    def special_tokens_map(self) -> dict[str, str]: ...

    def added_tokens_content(self) -> list[str]: ...

    def token_to_id(self, token: str) -> int | None: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def encode_plain(self, text: str) -> list[int]: ...


_MARK_START = "\U000f0000"
_MARK_END = "\U000f0001"
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _jinja():
    try:
        import jinja2
        import jinja2.ext
        import jinja2.nodes
        import jinja2.sandbox
        import jinja2.utils
    except ImportError as exc:  # pragma: no cover
        raise TokenizerError(
            "chat templates need the `jinja2` package (pip install jinja2)"
        ) from exc
    return jinja2


@lru_cache(maxsize=1)
def _environment():
    jinja2 = _jinja()

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` renders its body (transformers uses it for
        assistant masks)."""

        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(
                lineno
            )

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        sandbox.check_indent(indent)
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format):
        sandbox.check_strftime_format(format)
        return datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    "Chat templates cannot store underscore-prefixed attributes on a namespace, "
                    f"but got {name!r}."
                )

    env = sandbox.BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    sandbox.bound_environment(env)
    env.globals["lipsum"] = sandbox.bounded_lipsum(env.globals["lipsum"])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


@lru_cache(maxsize=64)
def compile_template(source: str):
    jinja2 = _jinja()
    try:
        return _environment().from_string(source)
    except jinja2.exceptions.TemplateError as exc:
        raise TokenizerError(f"chat template does not compile: {exc}") from exc


@lru_cache(maxsize=64)
def _template_literal_text(source: str) -> str:
    jinja2 = _jinja()
    ast = _environment().parse(source)
    literals = {node.data for node in ast.find_all(jinja2.nodes.TemplateData)}
    literals |= {
        node.value for node in ast.find_all(jinja2.nodes.Const) if isinstance(node.value, str)
    }
    return "\0".join(literals)


def select_template(templates: str | dict[str, str] | None, tools=None, name: str = "model") -> str:
    """Pick the template to use, as transformers' `get_chat_template` (named templates: tool_use /
    default)."""
    if templates is None:
        raise TokenizerError(
            f"{name}: the model has no chat template (tokenizer_config.json chat_template, "
            "chat_template.jinja or chat_template.json); use plain completion instead"
        )
    if isinstance(templates, dict):
        if tools is not None and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
        raise TokenizerError(
            f"{name}: the model has several chat templates ({sorted(templates)}) and none is "
            "named 'default'"
        )
    return templates


# -------------------------------------------------------------------------------------------------
# Input preparation (as transformers: drop None-valued keys, plain data only, alias reasoning
# fields)


def _plain(value: Any) -> Any:
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _normalize_messages(messages) -> list[dict]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TokenizerError(
            "chat messages must be a non-empty list of {'role': ..., 'content': ...} dicts"
        )
    out = []
    for message in messages:
        if callable(getattr(message, "model_dump", None)):
            message = message.model_dump()
        if not isinstance(message, dict):
            raise TokenizerError(f"chat messages must be dicts, got {message!r}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next(
            (message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None
        )
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(_plain(message))
    return out


def _mark(obj: Any, pattern: re.Pattern) -> Any:
    if isinstance(obj, str):
        obj = obj.replace(_MARK_START, "").replace(_MARK_END, "")
        return pattern.sub(f"{_MARK_START}\\g<0>{_MARK_END}", obj)
    if isinstance(obj, dict):
        return {k: _mark(v, pattern) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_mark(v, pattern) for v in obj]
    return obj


def _control_tokens(tokenizer: ChatTokenizer, source: str) -> tuple[str, ...]:
    """Added tokens treated as control tokens: special ones, plus non-whitespace added tokens the
    template writes."""
    literal = _template_literal_text(source)
    out = []
    for tok in tokenizer.added_tokens.values():
        if tok.special or (tok.content in literal and not tok.content.isspace()):
            out.append(tok.content)
    return tuple(out)


@lru_cache(maxsize=16)
def _patterns(control_tokens: tuple[str, ...]) -> tuple[re.Pattern, re.Pattern]:
    longest_first = sorted(control_tokens, key=len, reverse=True)
    tokens_re = re.compile("|".join(map(re.escape, longest_first)) or "(?!)")
    markers_re = re.compile(
        f"{_MARK_START}({tokens_re.pattern}){_MARK_END}|[{_MARK_START}{_MARK_END}]"
    )
    return tokens_re, markers_re


def render_chat_template(
    source: str, messages, tools=None, documents=None, add_generation_prompt: bool = True, **kwargs
) -> str:
    """Render a chat template with transformers' semantics. Template errors become
    TokenizerError."""
    jinja2 = _jinja()
    template = compile_template(source)
    if tools is not None and (
        not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) for t in tools)
    ):
        raise TokenizerError("tools must be a list of JSON-schema dicts")
    if documents is not None and (
        not isinstance(documents, (list, tuple)) or not all(isinstance(d, dict) for d in documents)
    ):
        raise TokenizerError("documents must be a list of dicts with 'title' and 'text' keys")
    context = dict(messages=messages, tools=_plain(tools), documents=_plain(documents),
                   add_generation_prompt=add_generation_prompt, **_plain(kwargs))
    try:
        rendered = sandbox.render(template, sandbox.DEFAULT_LIMITS, context)
    except TokenizerError:
        raise
    except jinja2.exceptions.TemplateError as exc:
        raise TokenizerError(f"chat template error: {exc}") from exc
    except RecursionError:
        raise sandbox.TemplateLimitError("chat template exceeded a limit: recursion depth "
                                         f"(limit {sys.getrecursionlimit()})") from None
    except (TypeError, AttributeError, KeyError, IndexError, ValueError, ArithmeticError,
            MemoryError) as exc:  # ArithmeticError: division by zero, float overflow
        raise TokenizerError(f"chat template failed: {type(exc).__name__}: {exc}") from None
    if not bounded_json.utf8_ok(rendered):
        raise TokenizerError("chat template produced a lone UTF-16 surrogate (not UTF-8 text)")
    return rendered


def _encode_marked(tokenizer: ChatTokenizer, rendered: str, markers_re: re.Pattern) -> list[int]:
    pieces = markers_re.split(rendered)
    if len(pieces) == 1:
        return tokenizer.encode(rendered, add_special_tokens=False)
    newline_ids = tokenizer.encode("\n", add_special_tokens=False)
    ids = tokenizer.encode(pieces[0], add_special_tokens=False) if pieces[0] else []
    for i, piece in enumerate(pieces[1:], start=1):
        if not piece:
            continue
        as_text = i % 2 == 1
        encode = (
            tokenizer.encode_plain
            if as_text
            else (lambda s: tokenizer.encode(s, add_special_tokens=False))
        )
        # encode after a newline so SentencePiece-style tokenizers don't add a prefix space, then
        # drop the newline
        piece_ids = encode("\n" + piece)
        if piece_ids[: len(newline_ids)] == newline_ids:
            piece_ids = piece_ids[len(newline_ids) :]
        else:
            piece_ids = encode(piece)
        if as_text and tokenizer.token_to_id(piece) in piece_ids:
            raise TokenizerError(
                f"cannot encode {piece!r} as plain text: the tokenizer produces the control token"
            )
        ids += piece_ids
    return ids


def apply_chat_template(
    tokenizer: ChatTokenizer,
    messages,
    tools=None,
    documents=None,
    add_generation_prompt: bool = True,
    tokenize: bool = False,
    chat_template: str | None = None,
    **template_kwargs,
):
    """Render (and optionally tokenize) a conversation with the tokenizer's chat template.

    `template_kwargs` (e.g. ``enable_thinking=False``) are passed to the template, overriding the
    special tokens (bos_token, eos_token, ...) which are always available to it.
    """
    templates = tokenizer._chat_templates
    if chat_template is not None:
        if isinstance(templates, dict) and chat_template in templates:
            source = templates[chat_template]
        else:
            source = chat_template
    else:
        source = select_template(templates, tools, tokenizer.name)
    messages = _normalize_messages(messages)
    if tokenize:
        _, markers_re = _patterns(tuple(tokenizer.added_tokens_content()))
        tokens_re, _ = _patterns(_control_tokens(tokenizer, source))
        messages = _mark(messages, tokens_re)
        tools = _mark(tools, tokens_re) if tools is not None else None
        documents = _mark(documents, tokens_re) if documents is not None else None
        template_kwargs = _mark(template_kwargs, tokens_re)
    kwargs = {**tokenizer.special_tokens_map, **template_kwargs}
    try:
        rendered = render_chat_template(
            source,
            messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
    except sandbox.TemplateLimitError as exc:  # name the template that went past its limit
        raise sandbox.TemplateLimitError(f"{os.path.basename(tokenizer.name)}: {exc}") from None
    if not tokenize:
        return rendered
    return _encode_marked(tokenizer, rendered, markers_re)
