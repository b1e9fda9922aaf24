"""Constrained decoding with llguidance: `response_format` (json_object / json_schema) and forced
tool calls (`tool_choice` "required" or a named function) become a logits processor that masks
every token the grammar does not allow at the next position.

The processor is the engine's `logits_processor(generated_ids, logits) -> logits`: it consumes
the tokens generated since its last call, then applies the next-token mask. When the grammar is
complete only EOS is allowed, so the answer ends right after the JSON.
"""

from __future__ import annotations

import json
import threading
import weakref

import torch

from .protocol import bad_request

# per loaded model, dropped with it: keyed weakly, not by id() (the model manager unloads
# models, and a later model may get a freed model's id)
_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _lltokenizer(model):
    import llguidance

    with _LOCK:
        if model not in _TOKENIZERS:
            tok = model.tokenizer
            eos = sorted(model.eos_token_ids) or None
            _TOKENIZERS[model] = llguidance.LLTokenizer(tok._tk.to_str(),
                                                      n_vocab=model.config.vocab_size,
                                                      eos_token=eos)
        return _TOKENIZERS[model]


class GrammarProcessor:
    """A logits processor for one request (not shared: it holds the parser state). `grammar` is
    kept: ProcEngine sends it, not the processor, to the engine process, which rebuilds one.

    Built in two steps: the grammar's syntax is checked here (no tokenizer, ~1 ms), the matcher
    by `prepare` (llguidance's tokenizer: ~1.2 s once per model for a 150k vocabulary, then
    ~1 ms per request), so a server whose engine runs in another process never builds one."""

    def __init__(self, model, grammar: str):
        import llguidance

        err = llguidance.LLMatcher.validate_grammar(grammar)
        if err:
            raise bad_request(f"invalid grammar: {err}", "response_format")
        self.model, self.grammar = model, grammar
        self.matcher = None
        self.eos = sorted(model.eos_token_ids)
        self.consumed = 0
        self.failed = False

    def prepare(self) -> None:
        """Build the matcher (once); a grammar that does not fit the vocabulary is a 400."""
        if self.matcher is None:
            import llguidance

            m = llguidance.LLMatcher(_lltokenizer(self.model), self.grammar, log_level=0)
            if m.is_error():
                raise bad_request(f"invalid grammar: {m.get_error()}", "response_format")
            self.matcher = m

    def __call__(self, generated_ids, logits: torch.Tensor) -> torch.Tensor:
        self.prepare()
        m = self.matcher
        new = list(generated_ids[self.consumed:])
        self.consumed = len(generated_ids)
        if new and not self.failed and not m.consume_tokens(new):
            self.failed = True  # e.g. a forced EOS we could not stop; leave the logits alone
        if self.failed or m.is_error():
            return logits
        if m.is_stopped():
            mask = torch.zeros(logits.shape[-1], dtype=torch.bool)
            mask[[i for i in self.eos if i < logits.shape[-1]]] = True
        else:
            bits = torch.frombuffer(bytearray(m.compute_bitmask()), dtype=torch.uint8)
            mask = ((bits.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8)) & 1).flatten()
            mask = mask.bool()[:logits.shape[-1]]
            if mask.numel() < logits.shape[-1]:
                mask = torch.cat([mask, torch.zeros(logits.shape[-1] - mask.numel(),
                                                    dtype=torch.bool)])
        return logits.masked_fill(~mask.to(logits.device), float("-inf"))


def _json_grammar(schema: dict) -> str:
    import llguidance

    opts = {"whitespace_flexible": False, "coerce_one_of": True}
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=opts)
    except (ValueError, TypeError) as e:
        raise bad_request(f"json_schema: {e}", "response_format") from e


def response_format_grammar(rf: dict | None) -> str | None:
    """A chat/completions `response_format` dict -> llguidance grammar (None for text)."""
    if not rf or rf.get("type") in (None, "text"):
        return None
    if rf["type"] == "json_object":
        return _json_grammar({"type": "object"})
    if rf["type"] == "json_schema":
        js = rf.get("json_schema") or {}
        schema = js.get("schema")
        if schema is None:
            raise bad_request("response_format.json_schema.schema is required",
                              "response_format.json_schema.schema")
        return _json_grammar(schema)
    raise bad_request(f"unknown response_format type {rf['type']!r}", "response_format.type")


def tool_call_grammar(tools: list[dict], choice, family: str) -> str | None:
    """tool_choice "required" or {"type": "function", "function": {"name"}} -> a grammar that
    makes the model emit one call in its template's format (None for "auto"/"none")."""
    import llguidance

    if choice in (None, "auto", "none"):
        return None
    fns = [t["function"] for t in tools]
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") or choice.get("name")
        fns = [f for f in fns if f["name"] == name]
        if not fns:
            raise bad_request(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
    elif choice != "required":
        raise bad_request(f"tool_choice {choice!r} must be none, auto, required or a function",
                          "tool_choice")
    key = "parameters" if family == "llama3" else "arguments"

    def params(f):  # a closed object unless the tool says otherwise
        p = dict(f.get("parameters") or {"type": "object", "properties": {}})
        if p.get("type") == "object" and "additionalProperties" not in p:
            p["additionalProperties"] = False
        return p
    alts = [{"type": "object", "properties": {"name": {"const": f["name"]}, key: params(f)},
        "required": ["name", key], "additionalProperties": False} for f in fns]
    schema = dict(alts[0]) if len(alts) == 1 else {"anyOf": alts}
    schema["x-guidance"] = {"whitespace_flexible": False, "coerce_one_of": True}
    body = "%json " + json.dumps(schema)
    if family == "hermes":
        lark = f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: {body}\n'
    elif family == "mistral":
        lark = f'start: "[" call "]"\ncall: {body}\n'
    else:
        lark = f"start: call\ncall: {body}\n"
    return llguidance.LLMatcher.grammar_from_lark(lark)
