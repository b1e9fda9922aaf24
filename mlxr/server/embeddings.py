"""Embeddings: `POST /v1/embeddings` (OpenAI) and `POST /api/embed` (Ollama), for decoder
embedding models (mlxr.embed: last-token pooling, L2 norm). A model that is not an embedding
model is a 400, and so is one of the hybrid families (qwen3_5, gemma4...: none ships as an
embedding model). The texts go through the model's serving engine (`AsyncEngine.embed`, or
`ProcEngine.embed` in the engine's process): each is a prefill-only sequence packed with the
other requests' texts and the generations into the engine's steps under its token budget;
a client that disconnects aborts its texts.

Extensions: `instruction` (Qwen3-Embedding's task line, put in front of every input) and
`dimensions` (the first N components, renormalised: Qwen3-Embedding is trained for it).
"""

from __future__ import annotations

import base64
import time
from typing import Any

from fastapi import Request  # module level: FastAPI resolves the (string) annotations here
from pydantic import Field

from ..errors import MlxrError
from . import render
from .protocol import APIError, _Req, bad_request

MAX_INPUTS = 2048  # OpenAI's limit per request


class EmbeddingRequest(_Req):
    model: str = ""
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: str | None = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    instruction: str | None = None


class OllamaEmbedRequest(_Req):
    model: str = ""
    input: str | list[str]
    truncate: bool | None = None
    options: dict[str, Any] | None = None
    keep_alive: float | str | None = None
    dimensions: int | None = Field(default=None, ge=1)
    instruction: str | None = None


def _token_lists(model, inp, instruction: str | None) -> list[list[int]]:
    from ..embed import with_instruction

    if isinstance(inp, str):
        inp = [inp]
    if not inp:
        raise bad_request("input must not be empty", "input")
    if len(inp) > MAX_INPUTS:
        raise bad_request(f"at most {MAX_INPUTS} inputs per request", "input")
    if all(isinstance(x, int) for x in inp):
        inp = [inp]
    out = []
    for i, x in enumerate(inp):
        if isinstance(x, str):
            if not x:
                raise bad_request(f"input[{i}] is empty", "input")
            out.append(model.tokenizer.encode(with_instruction(x, instruction),
                                              add_special_tokens=True))
        else:
            if instruction or any(not 0 <= t < model.config.vocab_size for t in x):
                raise bad_request(f"input[{i}]: token ids must be inside the vocabulary (and "
                                  "take no instruction)", "input")
            out.append(list(x))
    return out


async def embed(entry, inp, instruction: str | None, dimensions: int | None):
    """(embeddings float32 [B, E'], prompt token count) for one request."""
    import torch

    from ..embed import is_embedding_model, pooling
    from ..engine import QueueFullError

    if not is_embedding_model(entry.path):
        raise bad_request(f"model {entry.model_id!r} is not an embedding model (no "
                          "sentence-transformers files, no encoder architecture)", "model",
                          "not_an_embedding_model")
    if entry.model.config.arch is not None:  # no embedding model of these families ships
        raise bad_request(f"model {entry.model_id!r} is not an embedding model mlxr runs: "
                          f"its family ({entry.model.config.model_type}) is a hybrid one; "
                          "embeddings come from decoder embedding models of the dense families "
                          "(e.g. Qwen3-Embedding)", "model", "not_an_embedding_model")
    seqs = _token_lists(entry.model, inp, instruction)
    try:
        e, n = await entry.engine.embed(seqs, pooling(entry.path))
    except QueueFullError as err:
        raise APIError(429, "the server is busy: too many queued requests", "server_error",
                       code="queue_full", headers={"Retry-After": str(err.retry_after)}) from None
    except MlxrError as err:
        if str(err).startswith("engine failure"):
            raise APIError(500, str(err), "server_error") from None
        raise bad_request(str(err), "input") from None
    if dimensions is not None:
        if dimensions > e.shape[1]:
            raise bad_request(f"dimensions must be <= {e.shape[1]}", "dimensions")
        e = torch.nn.functional.normalize(e[:, :dimensions], dim=-1)
    return e, n


def register(app, state, parse) -> None:
    from fastapi.responses import JSONResponse

    @app.post("/v1/embeddings")
    async def openai_embeddings(request: Request):
        req = parse(EmbeddingRequest, await request.body())
        if req.encoding_format not in (None, "float", "base64"):
            raise bad_request("encoding_format must be float or base64", "encoding_format")
        entry = await state.acquire(req.model)

        async def body() -> dict:
            e, n = await embed(entry, req.input, req.instruction, req.dimensions)
            if req.encoding_format == "base64":  # little-endian float32, as OpenAI's
                vecs = [base64.b64encode(v.numpy().astype("<f4").tobytes()).decode() for v in e]
            else:
                vecs = e.tolist()
            return {"object": "list", "model": entry.model_id,
                    "data": [{"object": "embedding", "index": i, "embedding": v}
                             for i, v in enumerate(vecs)],
                    "usage": {"prompt_tokens": n, "total_tokens": n}}
        return await render.json_unless_disconnected(request.receive, body())

    @app.post("/api/embed")
    async def ollama_embed(request: Request):
        t0 = time.monotonic()
        try:
            req = parse(OllamaEmbedRequest, await request.body())
            entry = await state.acquire(req.model or None, req.keep_alive)
        except APIError as err:
            return JSONResponse({"error": err.message}, err.status, headers=err.headers)

        async def body() -> dict:
            e, n = await embed(entry, req.input, req.instruction, req.dimensions)
            return {"model": entry.model_id, "embeddings": e.tolist(),
                    "total_duration": int((time.monotonic() - t0) * 1e9), "load_duration": 0,
                    "prompt_eval_count": n}
        try:
            return await render.json_unless_disconnected(request.receive, body())
        except APIError as err:
            return JSONResponse({"error": err.message}, err.status, headers=err.headers)
