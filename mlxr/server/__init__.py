"""`mlxr serve`: an OpenAI-compatible HTTP server over the batching engine.

`create_app(state, security)` builds the ASGI app (app.py); `run(...)` serves it with uvicorn,
closed by default (see security.py): on uvloop and uvicorn's httptools protocol when those are
installed (uvicorn[standard]), else on asyncio and h11.
"""

from __future__ import annotations

from pathlib import Path

from .app import ServerState, create_app
from .security import SecurityConfig, deadline_protocol

__all__ = ["SecurityConfig", "ServerState", "create_app", "run"]


def run(model_path: Path, *, host: str = "127.0.0.1", port: int = 8080, api_key: str | None = None,
        allow_origins=(), model_id: str | None = None, max_num_seqs: int = 16,
        max_num_batched_tokens: int | None = None, max_queued: int = 64, max_connections: int = 256,
        max_body_bytes: int = 4 << 20,
        header_timeout: float = 10.0, body_timeout: float = 30.0, device=None, dtype=None,
        log_level: str = "info", stream_interval: int | None = None,
        engine_process: str = "auto", allow_client_chat_template: bool = False) -> None:
    import uvicorn

    sec = SecurityConfig(bind_host=host, api_key=api_key, allow_origins=list(allow_origins),
                         max_body_bytes=max_body_bytes, body_timeout=body_timeout,
                         header_timeout=header_timeout,
                         allow_client_chat_template=allow_client_chat_template)
    sec.check()
    state = ServerState(model_path, model_id or Path(model_path).name,
                        dict(max_num_seqs=max_num_seqs, max_queued=max_queued,
                             stream_interval=stream_interval, **(
                            {"max_num_batched_tokens": max_num_batched_tokens}
                            if max_num_batched_tokens else {})),
                        dict(device=device, dtype=dtype), engine_process)
    app = create_app(state, sec)
    uvicorn.run(app, host=host, port=port, http=deadline_protocol(header_timeout),
                limit_concurrency=max_connections, timeout_keep_alive=5,
                h11_max_incomplete_event_size=64 * 1024, log_level=log_level,
                server_header=False, ws="none", lifespan="on")
