"""Request models (pydantic) for the OpenAI-compatible routes, and the OpenAI error envelope.

Unknown fields are rejected (400 naming the field) rather than silently ignored; fields the SDKs
send routinely and that have no effect on a local server (`user`, `store`, `metadata`, ...) are
accepted. Fields we understand but cannot honour (n > 1, images, audio, ...) are 400s naming the
field: see `unsupported()`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class APIError(Exception):
    """An error answered in the OpenAI envelope with `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


class _Req(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class StreamOptions(_Req):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None
    continuous_usage_stats: bool | None = None


class JSONSchemaFormat(_Req):
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Req):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class FunctionDef(_Req):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Req):
    type: Literal["function"]
    function: FunctionDef


class _Common(_Req):
    """Sampling fields shared by chat and completions."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    repetition_context_size: int | None = Field(default=None, ge=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, ge=1)
    user: str | None = None
    # accepted and ignored: no effect on a local, stateless server
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class ChatRequest(_Common):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    # understood, refused unless neutral
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    verbosity: str | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool | None = None
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None
    response_format: ResponseFormat | None = None


class ResponsesRequest(_Req):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    seed: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool | None = False
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    include: list[str] | None = None
    truncation: str | None = None
    background: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def unsupported(req: BaseModel) -> None:
    """400 for fields we understand but cannot honour (never silently ignore them)."""
    d = req.model_dump(exclude_none=True, by_alias=True)
    if d.get("n", 1) != 1:
        raise bad_request("n > 1 is not supported: send separate requests", "n")
    if d.get("best_of", 1) != 1:
        raise bad_request("best_of > 1 is not supported", "best_of")
    if d.get("echo"):
        raise bad_request("echo is not supported", "echo")
    if d.get("suffix"):
        raise bad_request("suffix (fill-in-the-middle) is not supported", "suffix")
    for f in ("audio", "prediction", "web_search_options", "functions", "function_call",
              "previous_response_id", "conversation"):
        if f in d:
            why = ("use tools/tool_choice" if f.startswith("function") else
                   "this server is stateless" if f in ("previous_response_id", "conversation")
                   else "not supported by this server")
            raise bad_request(f"{f!r} is not supported: {why}", f)
    if d.get("background"):
        raise bad_request("background responses are not supported", "background")
    if set(d.get("modalities", ["text"])) - {"text"}:
        raise bad_request("only the 'text' modality is supported", "modalities")
    if "include" in d and [i for i in d["include"] if "logprobs" not in i]:
        raise bad_request("include: only 'message.output_text.logprobs' is supported", "include")
    if d.get("truncation") not in (None, "disabled"):
        raise bad_request("truncation: only 'disabled' is supported (prompts are never "
                          "silently truncated)", "truncation")
