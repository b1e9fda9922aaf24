"""Tool-call parsing (Qwen/Hermes `<tool_call>`, Llama 3.1+ JSON, Mistral `[TOOL_CALLS]`) and the
reasoning split (`<think>` ... `</think>`), both incremental: text arrives in arbitrary pieces and
events come out as soon as they are certain. Partial or malformed JSON never raises: text that
does not turn out to be a tool call is given back as content.

Events: ("content", text) | ("reasoning", text) | ("call", index, id, name) |
("args", index, json_text_piece). The pieces of a call's arguments concatenate to a JSON text.
"""

from __future__ import annotations

import json
import re
import secrets

HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"'
                    r"\s*:\s*")
LLAMA_START = re.compile(r'\s*(<\|python_tag\|>\s*)?\{\s*"(name|type)"')
MARKERS = {"hermes": ("<tool_call>", "</tool_call>"), "mistral": ("[TOOL_CALLS]", None),
           "llama3": ("<|python_tag|>", None)}


def detect_family(template: str | None) -> str | None:
    """The tool-call format a chat template asks the model to use."""
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return "hermes" if "tools" in template else None


def template_supports_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _held(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ReasoningSplitter:
    """Split `<think>...</think>` from the answer. `start_in_reasoning` when the prompt already
    opened the block (templates that end the generation prompt with `<think>`)."""

    def __init__(self, start_in_reasoning: bool = False, open: str = "<think>",
                 close: str = "</think>"):
        self.open, self.close = open, close
        self.inside, self.buf = start_in_reasoning, ""
        self.seen_content = False  # an opening tag only counts before any answer text
        self.strip = False

    def feed(self, text: str) -> list[tuple]:
        self.buf += text
        out: list[tuple] = []
        while self.buf:
            if self.inside:
                i = self.buf.find(self.close)
                if i >= 0:
                    if i:
                        out.append(("reasoning", self.buf[:i]))
                    self.buf, self.inside, self.strip = self.buf[i + len(self.close):], False, True
                    continue
                keep = _held(self.buf, self.close)
                piece, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                if piece:
                    out.append(("reasoning", piece))
                break
            if self.strip:
                self.buf = self.buf.lstrip()
                if not self.buf:
                    break
                self.strip = False
            if not self.seen_content:
                s = self.buf.lstrip()
                if s.startswith(self.open):
                    self.buf, self.inside = s[len(self.open):], True
                    continue
                if self.open.startswith(s):
                    break  # could still become the opening tag
            self.seen_content = True
            out.append(("content", self.buf))
            self.buf = ""
        return out

    def flush(self) -> list[tuple]:
        buf, self.buf = self.buf, ""
        return [("reasoning" if self.inside else "content", buf)] if buf else []


class ToolCallParser:
    """Incremental tool-call extraction for one family ("hermes", "llama3", "mistral")."""

    def __init__(self, family: str | None):
        self.family = family or "hermes"
        self.start, self.end = MARKERS[self.family]
        self.state = "content"  # content | region | done-detect (llama/mistral at the start)
        self.buf = ""
        self.calls: list[dict] = []  # {"id", "name", "arguments"}
        self.at_start = True  # nothing but whitespace so far
        self.ws_hold = ""  # whitespace after a call, emitted only if content follows
        self._reset_obj()

    def _reset_obj(self):
        self.obj, self.depth, self.in_str, self.esc = "", 0, False, False
        self.header, self.streaming, self.value_start = False, False, 0

    # -- content -------------------------------------------------------------------------------
    def feed(self, text: str) -> list[tuple]:
        self.buf += text
        out: list[tuple] = []
        while self.buf:
            if self.state == "region":
                if not self._region(out):
                    break
                continue
            if self.at_start and self.family in ("llama3", "mistral"):
                s = self.buf.lstrip()
                if not s:
                    break
                m = LLAMA_START.match(s) or re.match(r'\s*\[\s*\{\s*"name"', s)
                if m:
                    if m.lastindex and m.group(1):
                        s = s[len(m.group(1)):]
                    self.state, self.buf, self.at_start = "region", s, False
                    continue
                if len(s) < 24 and ('{"name"'.startswith(s[:7]) or
                                    '[{"name"'.startswith(s[:8]) or
                                    self.start.startswith(s[:len(self.start)])):
                    if not s.startswith(self.start):
                        break  # too early to tell
            i = self.buf.find(self.start)
            if i >= 0:
                self._content(self.buf[:i], out)
                self.buf, self.state, self.at_start = (
                    self.buf[i + len(self.start):], "region", False)
                continue
            keep = _held(self.buf, self.start)
            self._content(self.buf[:len(self.buf) - keep], out)
            self.buf = self.buf[len(self.buf) - keep:]
            break
        return out

    def _content(self, text: str, out: list) -> None:
        if not text:
            return
        if text.strip():
            self.at_start = False
        if self.calls and not text.strip():
            self.ws_hold += text
            return
        if self.calls:
            text, self.ws_hold = self.ws_hold + text, ""
        out.append(("content", text))

    # -- inside a tool-call region ---------------------------------------------------------------
    def _region(self, out: list) -> bool:
        """Consume region text from self.buf; False when more input is needed."""
        buf = self.buf
        n = len(buf)
        if self.family == "mistral" and self.depth == 0 and not self.obj:
            s = buf.lstrip()
            if s and (s[0].isalpha() or s[0] == "_"):  # v11+: [TOOL_CALLS]name[ARGS]{...}
                k = s.find("[ARGS]")
                if k < 0:
                    return False
                self._call(s[:k].strip(), out)
                self.header, self.streaming, self._v11 = True, False, True
                self.buf = s[k + len("[ARGS]"):].lstrip()
                return True
        args_piece = []
        i = 0
        while i < n:
            c = buf[i]
            i += 1
            if self.depth == 0 and not self.obj:
                if c == "{":
                    self.obj, self.depth = "{", 1
                    if getattr(self, "_v11", False):
                        self.streaming = True
                        args_piece.append(c)
                    continue
                if c in "[],; \n\t\r":
                    continue
                if self.end and buf.startswith(self.end, i - 1):
                    self._flush_args(args_piece, out)
                    self.buf, self.state = buf[i - 1 + len(self.end):], "content"
                    return True
                if self.end and self.end.startswith(buf[i - 1:]):
                    self._flush_args(args_piece, out)
                    self.buf = buf[i - 1:]
                    return False
                # junk inside the region: not a tool call after all
                self._flush_args(args_piece, out)
                self.state = "content"
                self._content(self.start + buf[i - 1:], out)
                self.buf = ""
                return True
            self.obj += c
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == '"':
                    self.in_str = False
            elif c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
            if self.streaming:
                args_piece.append(c)
                if self.depth == (0 if getattr(self, "_v11", False) else 1) and not self.in_str:
                    self.streaming = False
            elif not self.header and not self.in_str:
                m = HEADER.match(self.obj)
                if m and len(self.obj) > m.end() and not self.obj[-1].isspace():
                    self.header = True
                    self.value_start = m.end()
                    self._call(_unescape(m.group(1)), out)
                    if c == "{":
                        self.streaming = True
                        args_piece.append(c)
            if self.depth == 0:
                self._flush_args(args_piece, out)
                self._finish_obj(out)
                self.buf = buf[i:]
                return True
        self._flush_args(args_piece, out)
        self.buf = buf[i:]
        return bool(self.buf) and i > 0

    def _flush_args(self, pieces: list, out: list) -> None:
        if pieces:
            piece = "".join(pieces)
            pieces.clear()
            self.calls[-1]["arguments"] += piece
            out.append(("args", len(self.calls) - 1, piece))

    def _call(self, name: str, out: list) -> None:
        self.calls.append({"id": new_call_id(), "name": name, "arguments": ""})
        out.append(("call", len(self.calls) - 1, self.calls[-1]["id"], name))

    def _finish_obj(self, out: list) -> None:
        obj, v11 = self.obj, getattr(self, "_v11", False)
        self._v11 = False
        header = self.header
        self._reset_obj()
        if v11:
            return
        try:
            d = json.loads(obj)
        except ValueError:
            d = None
        if header:
            call = self.calls[-1]
            if not call["arguments"] and isinstance(d, dict):  # non-object value: not streamed
                args = d.get("arguments", d.get("parameters", {}))
                call["arguments"] = args if isinstance(args, str) else json.dumps(args)
                out.append(("args", len(self.calls) - 1, call["arguments"]))
            return
        if isinstance(d, dict) and isinstance(d.get("function"), dict):
            d = d["function"]
        if not isinstance(d, dict) or not isinstance(d.get("name"), str):
            self._content(obj, out)
            return
        args = d.get("arguments", d.get("parameters", {}))
        self._call(d["name"], out)
        self.calls[-1]["arguments"] = args if isinstance(args, str) else json.dumps(args)
        out.append(("args", len(self.calls) - 1, self.calls[-1]["arguments"]))

    def flush(self) -> list[tuple]:
        out: list[tuple] = []
        if self.state == "region" and self.obj and not self.header:
            self._content(self.obj, out)
        elif self.state == "content" and self.buf:
            if self.at_start and self.family in ("llama3", "mistral"):
                self.at_start = False
            self._content(self.buf, out)
        self.buf = ""
        self._reset_obj()
        return out


def _unescape(s: str) -> str:
    try:
        return json.loads(f'"{s}"')
    except ValueError:
        return s


def parse_all(text: str, family: str | None, reasoning: bool = False,
              start_in_reasoning: bool = False) -> tuple[str, str | None, list[dict]]:
    """Non-streaming: (content, reasoning or None, tool calls)."""
    events = OutputSplitter(family, reasoning, start_in_reasoning, tools=family is not None)
    evs = events.feed(text) + events.flush()
    content = "".join(e[1] for e in evs if e[0] == "content")
    thought = "".join(e[1] for e in evs if e[0] == "reasoning")
    return content, (thought if reasoning and thought else None), events.tools.calls if \
        events.tools else []


class OutputSplitter:
    """Reasoning split, then tool-call parsing of the answer part."""

    def __init__(self, family: str | None, reasoning: bool, start_in_reasoning: bool = False,
                 tools: bool = True):
        self.reason = ReasoningSplitter(start_in_reasoning) if reasoning else None
        self.tools = ToolCallParser(family) if tools else None

    def _route(self, evs: list[tuple], final: bool) -> list[tuple]:
        out: list[tuple] = []
        for e in evs:
            if e[0] == "content" and self.tools is not None:
                out += self.tools.feed(e[1])
            else:
                out.append(e)
        if final and self.tools is not None:
            out += self.tools.flush()
        return out

    def feed(self, text: str) -> list[tuple]:
        evs = self.reason.feed(text) if self.reason else [("content", text)]
        return self._route(evs, False)

    def flush(self) -> list[tuple]:
        evs = self.reason.flush() if self.reason else []
        return self._route(evs, True)
