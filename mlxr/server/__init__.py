"""`mlxr serve`: an OpenAI- and Ollama-compatible HTTP server over the batching engine.

`create_app(state, security)` builds the ASGI app (app.py); `run(...)` serves it with uvicorn
(runner.py), closed by default (see security.py): on uvloop and uvicorn's httptools protocol when
those are installed (uvicorn[standard]), else on asyncio and h11.
"""

from __future__ import annotations

from .app import ServerState, create_app
from .runner import run
from .security import SecurityConfig

__all__ = ["SecurityConfig", "ServerState", "create_app", "run"]
