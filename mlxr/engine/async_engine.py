"""`AsyncEngine`: an LLMEngine stepped on a background thread, with an async generator per
request for the asyncio consumer (the HTTP server)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

from ..errors import MlxrError
from .engine import EngineRequest, LLMEngine, QueueFullError, RequestOutput

__all__ = ["AsyncEngine", "RequestOutput"]


class AsyncEngine:
    """LLMEngine on a background thread, with an async generator per request."""

    def __init__(self, model, max_num_seqs: int = 16, max_queued: int = 64, **engine_kw):
        self.engine = LLMEngine(model, max_num_seqs=max_num_seqs, **engine_kw)
        self.max_queued = max_queued
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.ready = True

    def stats(self) -> dict:
        return self.engine.stats()

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            while self.engine.has_work():
                try:
                    self.engine.step()
                except Exception as e:  # an engine fault ends every request, never the server
                    self._error = e
                    with self.engine.lock:
                        seqs = [*self.engine.scheduler.running, *self.engine.scheduler.waiting]
                        for seq in seqs:
                            self.engine.scheduler.finish(seq)
                    for seq in seqs:
                        seq.emit(e)

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="mlxr-engine", daemon=True)
            self._thread.start()

    async def generate(self, req: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs. Raises QueueFullError or MlxrError before streaming;
        leaving the loop early aborts the request and frees its KV blocks."""
        if len(self.engine.scheduler.waiting) >= self.max_queued:
            raise QueueFullError("too many requests are waiting; retry later", retry_after=1)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        seq = self.engine.add(req, lambda out: loop.call_soon_threadsafe(queue.put_nowait, out))
        self._ensure_thread()
        self._wake.set()
        done = False
        try:
            while True:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise MlxrError(f"engine failure: {out}") from out
                done = out.finish_reason is not None
                yield out
                if done:
                    return
        finally:
            if not done:
                self.engine.abort(seq)
                self._wake.set()
