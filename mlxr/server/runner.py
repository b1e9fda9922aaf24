"""`run(...)`: serve the app with uvicorn, and own the server's lifecycle around the model load.

The socket opens at once and the model loads in the background (/health says "loading" until it
is ready). The log says "loading MODEL" when the load starts and "ready on http://HOST:PORT" once
both the model is loaded and the socket listens. A model that fails to load stops the server:
`run` raises one MlxrError (the CLI prints it as one line and exits 1) instead of leaving a
server up that answers every request with a 500.
"""

from __future__ import annotations

import copy
import logging
import threading
from pathlib import Path

from ..errors import MlxrError
from .app import ServerState, create_app
from .security import SecurityConfig, deadline_protocol

log = logging.getLogger("mlxr.server")


def check_port(port: int) -> None:
    """0 (any free port, reported in the "ready" line) to 65535. Out of range is an error here:
    the OS resolver would otherwise wrap it (99999 -> 34463) and the log would name a port that
    nothing listens on."""
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise MlxrError(f"port {port!r} is not a TCP port (0-65535)")


def url_for(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _log_config(level: str) -> dict:
    """uvicorn's logging config, plus the "mlxr" loggers on the same handler and format."""
    from uvicorn.config import LOGGING_CONFIG

    cfg = copy.deepcopy(LOGGING_CONFIG)
    cfg["loggers"]["mlxr"] = {"handlers": ["default"], "level": level.upper(),
                              "propagate": False}
    return cfg


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server that stops when the model fails to load and announces readiness."""

        def __init__(self, config, state: ServerState, security: SecurityConfig):
            super().__init__(config)
            self.state, self.security = state, security
            self.url: str | None = None
            self._lock = threading.Lock()
            self._announced = False
            state.on_loaded = self._model_done

        async def startup(self, sockets=None):
            await super().startup(sockets)
            port = self.servers[0].sockets[0].getsockname()[1]  # the real one when port=0
            self.security.port = port
            self.url = url_for(self.config.host, port)
            self._announce()

        def _model_done(self) -> None:  # on the loading thread
            if self.state.error:
                self.should_exit = True  # uvicorn's main loop polls it (as its signal handler)
            else:
                self._announce()

        def _announce(self) -> None:
            with self._lock:
                if self._announced or self.url is None or not self.state.ready.is_set():
                    return
                self._announced = True
            log.info("ready on %s", self.url)

    return Server


def run(model_path: Path, *, host: str = "127.0.0.1", port: int = 8080, api_key: str | None = None,
        allow_origins=(), model_id: str | None = None, max_num_seqs: int = 16,
        max_num_batched_tokens: int | None = None, max_queued: int = 64, max_connections: int = 256,
        max_body_bytes: int = 4 << 20,
        header_timeout: float = 10.0, body_timeout: float = 30.0, device=None, dtype=None,
        tensor_parallel: int = 1,
        log_level: str = "info", stream_interval: int | None = None,
        engine_process: str = "auto", allow_pull: bool = False,
        allow_delete: bool = False, allow_client_chat_template: bool = False) -> None:
    import uvicorn

    check_port(port)
    sec = SecurityConfig(bind_host=host, api_key=api_key, allow_origins=list(allow_origins),
                         max_body_bytes=max_body_bytes, body_timeout=body_timeout,
                         header_timeout=header_timeout, port=port or None,
                         allow_client_chat_template=allow_client_chat_template)
    sec.check()
    state = ServerState(model_path, model_id or Path(model_path).name,
                        dict(max_num_seqs=max_num_seqs, max_queued=max_queued,
                             stream_interval=stream_interval, **(
                            {"max_num_batched_tokens": max_num_batched_tokens}
                            if max_num_batched_tokens else {})),
                        dict(device=device, dtype=dtype, **(
                            {"tensor_parallel": tensor_parallel} if tensor_parallel != 1 else {})),
                        engine_process,
                        allow_pull=allow_pull, allow_delete=allow_delete)
    app = create_app(state, sec)
    config = uvicorn.Config(app, host=host, port=port, http=deadline_protocol(header_timeout),
                            limit_concurrency=max_connections, timeout_keep_alive=5,
                            h11_max_incomplete_event_size=64 * 1024, log_level=log_level,
                            log_config=_log_config(log_level), server_header=False, ws="none",
                            lifespan="on")
    server = _server_class()(config, state, sec)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    if state.error:
        raise MlxrError(f"{model_path}: the model failed to load: {state.error}")
