"""Request checks the pydantic models cannot express, and job building off the event loop.

A request's body is untrusted all the way down: `chat_template_kwargs` reach the template
(its source, when a client may name one, is code), tool calls from earlier turns are free-form
dicts, and rendering and tokenizing a 4 MB prompt takes seconds of CPU. Each shape mistake is
a 400 naming the field; job building runs on a worker thread so /health and every other
request keep being answered meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from ..errors import MlxrError
from .protocol import APIError, bad_request

log = logging.getLogger("mlxr.server")

# apply_chat_template's own parameters and transformers' (a client key of the same name would
# collide with them: a TypeError, or a silent override of what the server decided)
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "tokenize",
    "chat_template", "continue_final_message", "return_tensors", "return_dict", "padding",
    "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask"})

# Whether clients may send `chat_template_kwargs.chat_template` (template source: code run in
# the server); `mlxr serve --allow-client-chat-template` sets it, off by default
_client_templates = {"allowed": False}


def allow_client_templates(allowed: bool) -> None:
    _client_templates["allowed"] = bool(allowed)


def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """`chat_template_kwargs` as keyword arguments for apply_chat_template, or a 400."""
    out = dict(kwargs or {})
    for key in out:
        where = f"chat_template_kwargs.{key}"
        if key == "chat_template" and _client_templates["allowed"]:
            if not isinstance(out[key], str):
                raise bad_request(f"{where} must be a string", where)
            continue
        if key == "chat_template":
            raise bad_request(f"{where}: clients cannot supply template source on this "
                              "server (the operator enables it with "
                              "--allow-client-chat-template)", where)
        if key in RESERVED_TEMPLATE_KWARGS or not key.isidentifier() or key.startswith("_"):
            raise bad_request(f"{where} is reserved or not a template variable name", where)
    return out


def tool_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's `tool_calls`: a list of {"function": {"name": str,
    "arguments": str | object}, ...} objects, or a 400 naming the entry."""
    if not isinstance(calls, list):
        raise bad_request(f"{where} must be a list of tool calls", where)
    for j, tc in enumerate(calls):
        at = f"{where}[{j}]"
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict):
            raise bad_request(f"{at} must be an object with a 'function' object", at)
        if not isinstance(fn.get("name"), str):
            raise bad_request(f"{at}.function.name must be a string", f"{at}.function.name")
        if not isinstance(fn.get("arguments", {}), (str, dict)):
            raise bad_request(f"{at}.function.arguments must be a JSON string or an object",
                              f"{at}.function.arguments")
    return calls


def tool_choice(choice: Any) -> None:
    """`tool_choice`: none / auto / required, or {"type": "function", "function": {"name"}}."""
    if choice is None or isinstance(choice, str):
        return
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request("tool_choice must be a string or {\"type\": \"function\", "
                          "\"function\": {\"name\": ...}}", "tool_choice")


async def build_job(build: Callable, *args: Any):
    """`build(*args)` (render, tokenize, grammar: CPU work) on a worker thread. Errors of the
    request's own making are 400s: mlxr's (a template or tokenizer refusing the input) and
    the shape errors of a field no schema describes (logged, they name the exception)."""
    try:
        return await asyncio.to_thread(build, *args)
    except APIError:
        raise
    except MlxrError as e:
        raise bad_request(str(e)) from None
    except (TypeError, AttributeError, KeyError, IndexError, ValueError, RecursionError) as e:
        log.warning("malformed request: %s: %s", type(e).__name__, e)
        raise bad_request(f"malformed request ({type(e).__name__}: {str(e)[:200]})") from None
