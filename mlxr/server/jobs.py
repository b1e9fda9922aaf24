"""Validated requests -> `Job`s: what the OpenAI routes (`app`), the Responses route
(`responses`) and the Ollama routes (`ollama`) hand the engine. A job holds the prompt ids, the
sampling params, the grammar (`response_format`, forced tool calls), and how to parse the output
(tool-call family, reasoning).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import bounded_json
from ..errors import MlxrError
from ..text.sampling import SamplingParams
from . import request_checks
from .protocol import ChatRequest, CompletionRequest, bad_request


@dataclass
class Job:
    """One validated generation request."""

    prompt_ids: list[int]
    params: SamplingParams
    logprobs: int | None = None
    processor: object = None
    family: str | None = None  # tool-call format to parse, None = no tool parsing
    reasoning: bool = False
    start_in_reasoning: bool = False
    include_usage: bool = False
    extra: dict = field(default_factory=dict)


def _messages(raw: list) -> list[dict]:
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or m.get("role") not in (
                "system", "developer", "user", "assistant", "tool"):
            raise bad_request(f"messages[{i}].role must be system, developer, user, assistant "
                              "or tool", f"messages[{i}].role")
        m = dict(m)
        if m["role"] == "developer":
            m["role"] = "system"
        c = m.get("content")
        if isinstance(c, list):
            texts = []
            for j, part in enumerate(c):
                if not isinstance(part, dict) or part.get("type") not in (
                        "text", "input_text", "output_text"):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise bad_request(f"messages[{i}].content[{j}]: content type {kind!r} is "
                                      "not supported (text only)", f"messages[{i}].content[{j}]")
                texts.append(str(part.get("text", "")))
            m["content"] = "".join(texts)
        elif c is not None and not isinstance(c, str):
            raise bad_request(f"messages[{i}].content must be a string or a list of text parts",
                              f"messages[{i}].content")
        calls = m.get("tool_calls")
        if calls:
            fixed = []
            for tc in request_checks.tool_calls(calls, f"messages[{i}].tool_calls"):
                tc = dict(tc)
                fn = dict(tc.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:  # templates expect a mapping (as transformers and mlx-lm pass it)
                        fn["arguments"] = bounded_json.loads(fn["arguments"], "arguments")
                    except MlxrError:
                        pass
                tc["function"] = fn
                fixed.append(tc)
            m["tool_calls"] = fixed
        out.append(m)
    return out


def _sampling(model, req, prompt_len: int, max_tokens: int | None) -> SamplingParams:
    ctx = model.config.context_length
    if prompt_len >= ctx:
        raise bad_request(f"the prompt has {prompt_len} tokens; the model's context is {ctx} "
                          "tokens", "messages", "context_length_exceeded")
    if max_tokens is None:
        max_tokens = ctx - prompt_len
    elif prompt_len + max_tokens > ctx:
        raise bad_request(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds "
                          f"the model's context of {ctx} tokens", "max_tokens",
                          "context_length_exceeded")
    bias = None
    if getattr(req, "logit_bias", None):
        try:
            bias = {int(k): float(v) for k, v in req.logit_bias.items()}
        except ValueError:
            raise bad_request("logit_bias keys must be token ids", "logit_bias") from None
        if any(abs(v) > 100 for v in bias.values()):
            raise bad_request("logit_bias values must be in [-100, 100]", "logit_bias")
    stop = getattr(req, "stop", None)
    stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
    kw = dict(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
              top_k=req.top_k, min_p=req.min_p, repetition_penalty=req.repetition_penalty,
              presence_penalty=getattr(req, "presence_penalty", None) or 0.0,
              frequency_penalty=getattr(req, "frequency_penalty", None) or 0.0,
              logit_bias=bias, seed=req.seed, stop=stop,
              stop_token_ids=tuple(getattr(req, "stop_token_ids", None) or ()),
              ignore_eos=bool(getattr(req, "ignore_eos", False)))
    if getattr(req, "repetition_context_size", None):
        kw["repetition_context_size"] = req.repetition_context_size
    try:
        params = SamplingParams(**kw).with_defaults(model.generation_config)
        params.validate(model.config.vocab_size)
    except MlxrError as e:
        raise bad_request(str(e), str(e).split(":")[0].split("[")[0].strip() or None) from None
    return params


def chat_job(model, req: ChatRequest) -> Job:
    from .grammar import GrammarProcessor, response_format_grammar, tool_call_grammar
    from .tools import detect_family, template_supports_tools

    tok = model.tokenizer
    if tok.chat_template is None:
        raise bad_request(f"model {model.path.name!r} has no chat template: use "
                          "/v1/completions for plain text completion", "messages",
                          "no_chat_template")
    choice = req.tool_choice
    request_checks.tool_choice(choice)
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []] or None
    if tools and choice != "none":
        template = tok.get_chat_template(tools)
        if not template_supports_tools(template):
            raise bad_request(f"model {model.path.name!r} does not support tools (its chat "
                              "template has no tool support)", "tools")
    else:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        tools, template = None, tok.chat_template
    kwargs = request_checks.template_kwargs(req.chat_template_kwargs)
    if req.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
        if req.reasoning_effort == "none":
            kwargs.setdefault("enable_thinking", False)
    try:
        ids = tok.apply_chat_template(_messages(req.messages), tools=tools,
                                      add_generation_prompt=True, tokenize=True, **kwargs)
    except MlxrError as e:
        raise bad_request(f"chat template: {e}", "messages") from None
    family = detect_family(template) if tools else None
    reasoning = "<think>" in template or "reasoning_content" in template
    job = Job(list(ids), _sampling(model, req, len(ids), req.max_completion_tokens or
                                    req.max_tokens),
              family=family, reasoning=reasoning,
              start_in_reasoning=reasoning and tok.decode(ids[-24:]).rstrip().endswith(
                  "<think>"),
              include_usage=bool(req.stream_options and req.stream_options.include_usage))
    if req.logprobs:
        job.logprobs = req.top_logprobs or 0
    elif req.top_logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    rf = req.response_format.model_dump(by_alias=True, exclude_none=True) \
        if req.response_format else None
    grammar = response_format_grammar(rf)
    if tools:
        tg = tool_call_grammar(tools, choice, family or "hermes")
        if tg and grammar:
            raise bad_request("response_format cannot be combined with a forced tool_choice",
                              "response_format")
        grammar = grammar or tg
    if grammar:
        job.processor = GrammarProcessor(model, grammar)
    return job


def completion_job(model, req: CompletionRequest) -> Job:
    from .grammar import GrammarProcessor, response_format_grammar

    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise bad_request("only one prompt per request is supported", "prompt")
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise bad_request("prompt must not be empty", "prompt")
        ids = model.tokenizer.encode(p, add_special_tokens=True)
    else:
        ids = [int(i) for i in p]
        if not ids or any(not 0 <= i < model.config.vocab_size for i in ids):
            raise bad_request("prompt token ids must be non-empty and inside the vocabulary",
                              "prompt")
    job = Job(ids, _sampling(model, req, len(ids), req.max_tokens or 16),
              logprobs=req.logprobs,
              include_usage=bool(req.stream_options and req.stream_options.include_usage))
    rf = req.response_format.model_dump(by_alias=True, exclude_none=True) \
        if req.response_format else None
    grammar = response_format_grammar(rf)
    if grammar:
        job.processor = GrammarProcessor(model, grammar)
    return job
