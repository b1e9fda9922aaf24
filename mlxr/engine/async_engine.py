"""`AsyncEngine`: an LLMEngine stepped on a background thread, with an async generator per
request for the asyncio consumer (the HTTP server).

Handoff: the engine thread collects every output of a step (the per-request `emit` callbacks
only append to a list) and hands the whole step to each event loop with ONE
`call_soon_threadsafe` -- one self-pipe write per step instead of one per token, which at 256
streams is the difference between 256 wake-ups of the loop per step and one.

Stream interval: with many streams the event loop, not the GPU, becomes the limit (each
delivered output is a task wake-up and an SSE write: ~30 us of the one Python thread on the
H200 host, so 256 streams x one token per step cannot keep up with a 7 ms step). A stream's
outputs are therefore handed over every `interval` steps (its first output and its last at
once): interval = `stream_interval`, or by default ceil(running / 64), i.e. every token up to
64 streams, every 4th at 256. The text and tokens are the same, in fewer, larger chunks.

Coalescing: a consumer that lags (the HTTP stream is still writing the previous chunk when the
next step lands) receives everything queued for it merged into one RequestOutput
(`merge_outputs`), so a slow client costs one SSE chunk per catch-up, not one per token.

Embeddings (`embed`): an embeddings request's texts are queued in the engine as one group
(engine.add_embeddings); each text's EmbeddingOutput arrives in the request's mailbox as it
completes, and the request returns once all have.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator

import torch

from ..errors import MlxrError
from .embedding_seqs import EmbeddingOutput
from .engine import EngineRequest, LLMEngine, QueueFullError, RequestOutput

__all__ = ["AsyncEngine", "RequestOutput", "merge_outputs"]


def merge_outputs(outs: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one: token ids, text and logprobs concatenated;
    finish reason and counts from the last (they are running totals)."""
    if len(outs) == 1:
        return outs[0]
    last = outs[-1]
    lps = [lp for o in outs if o.logprobs for lp in o.logprobs]
    return RequestOutput([t for o in outs for t in o.token_ids], "".join(o.text for o in outs),
                         last.finish_reason, last.prompt_tokens, last.completion_tokens,
                         last.cached_tokens,
                         lps if lps or any(o.logprobs is not None for o in outs) else None)


class _Stream:
    """One request's mailbox on its event loop: outputs (or an engine exception) in order, and
    the future its consumer sleeps on when the mailbox is empty. Touched only on the loop."""

    __slots__ = ("closed", "items", "loop", "waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.closed = False  # the consumer left: outputs held for it are dropped
        self.items: deque = deque()
        self.waiter: asyncio.Future | None = None


def _merge_held(held: list) -> list:
    """Held outputs of one stream, merged (an exception stays a separate, last item)."""
    outs = [o for o in held if isinstance(o, RequestOutput)]
    rest = [o for o in held if not isinstance(o, RequestOutput)]
    return ([merge_outputs(outs)] if outs else []) + rest


def engine_failure(e: BaseException) -> MlxrError:
    """What a request sees when a step raised `e` (the server answers it with a 500)."""
    err = MlxrError(f"engine failure: {e}")
    err.__cause__ = e
    return err


def _deliver(batch: list) -> None:
    """On the event loop: drop one step's outputs into their mailboxes, wake the consumers."""
    for stream, out in batch:
        stream.items.append(out)
        w = stream.waiter
        if w is not None:
            stream.waiter = None
            if not w.done():
                w.set_result(None)


def to_loops(batch: list) -> None:
    """From any thread: deliver (stream, output) pairs with one thread-safe call per event loop."""
    loop = batch[0][0].loop
    if all(s.loop is loop for s, _ in batch):  # the server: one loop
        groups = {loop: batch}
    else:
        groups = {}
        for item in batch:
            groups.setdefault(item[0].loop, []).append(item)
    for lp, items in groups.items():
        try:
            lp.call_soon_threadsafe(_deliver, items)
        except RuntimeError:  # that loop is closed: nobody is left to read
            pass


async def next_output(stream: _Stream) -> RequestOutput:
    """On the stream's loop: its next output, everything queued merged into one; an exception
    in the mailbox (a failed step or a rejected request) is raised."""
    items = stream.items
    if not items:
        stream.waiter = stream.loop.create_future()
        await stream.waiter
    if isinstance(items[0], BaseException):
        raise items.popleft()
    outs = [items.popleft()]
    while items and not isinstance(items[0], BaseException):
        outs.append(items.popleft())
    return merge_outputs(outs)


async def embeddings_of(stream: _Stream, n: int) -> tuple[torch.Tensor, int]:
    """On the stream's loop: the n EmbeddingOutputs of one request as (float32 [n, E] in
    input order, total prompt tokens); an exception in the mailbox is raised."""
    got: dict[int, EmbeddingOutput] = {}
    while len(got) < n:
        if not stream.items:
            stream.waiter = stream.loop.create_future()
            await stream.waiter
        while stream.items:
            item = stream.items.popleft()
            if isinstance(item, BaseException):
                raise item
            got[item.index] = item
    return (torch.stack([got[i].vector for i in range(n)]),
            sum(o.prompt_tokens for o in got.values()))


class AsyncEngine:
    """LLMEngine on a background thread, with an async generator per request. `engine`: an
    LLMEngine-like object to drive instead of LLMEngine(model, ...) (serve_bench's stand-in)."""

    def __init__(self, model, max_num_seqs: int = 16, max_queued: int = 64,
                 stream_interval: int | None = None, engine=None, **engine_kw):
        if engine is None:
            engine = LLMEngine(model, max_num_seqs=max_num_seqs, **engine_kw)
        self.engine = engine
        self.max_queued = max_queued
        if stream_interval is not None and stream_interval < 1:
            raise ValueError("stream_interval must be >= 1")
        self.stream_interval = stream_interval
        self._held: dict[_Stream, list] = {}  # outputs waiting for their stream's interval
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._outbox: list = []  # (stream, output): appended by emit during a step
        self._closed = False
        self.ready = True

    def stats(self) -> dict:
        return self.engine.stats()

    def _flush(self) -> None:
        """Hand what the last step emitted to the event loop(s): one thread-safe call each."""
        if not self._outbox:
            return
        step, self._outbox = self._outbox, []
        for st in [st for st in self._held if st.closed]:
            del self._held[st]
        k = self.stream_interval or -(-len(self.engine.scheduler.running) // 64)
        batch = []
        for stream, out in step:
            if k <= 1 and stream not in self._held:
                batch.append((stream, out))
                continue
            held = self._held.setdefault(stream, [])
            held.append(out)
            first = isinstance(out, RequestOutput) and out.completion_tokens == len(
                out.token_ids)
            if len(held) >= k or first or not isinstance(out, RequestOutput) \
                    or out.finish_reason is not None:
                del self._held[stream]
                batch += [(stream, o) for o in _merge_held(held)]
        if batch:
            self._handoff(batch)

    # ProcEngine's engine process overrides this to send the step over a pipe
    _handoff = staticmethod(to_loops)

    def close(self) -> None:
        """Stop the engine thread (the model server unloads the model after this); requests
        still running end with an engine failure."""
        self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(30)
        with self.engine.lock:
            seqs = [*self.engine.scheduler.running, *self.engine.scheduler.waiting]
            for seq in seqs:
                self.engine.scheduler.finish(seq)
        for seq in seqs:
            seq.emit(engine_failure(MlxrError("the model was unloaded")))
        self._flush()

    def _loop(self) -> None:
        while not self._closed:
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
                        seq.emit(engine_failure(e))
                self._flush()

    def _check_queue(self) -> None:
        if self.engine.scheduler.waiting_requests() >= self.max_queued:
            raise QueueFullError("too many requests are waiting; retry later", retry_after=1)

    async def embed(self, seqs: list[list[int]], pooling: str = "last") -> tuple[torch.Tensor,
                                                                               int]:
        """Embeddings of token lists through the engine's steps: (float32 [B, E] L2-normalised,
        prompt tokens). Raises QueueFullError or MlxrError (naming the bad input) before any
        runs; cancelling the caller aborts the texts still queued or running."""
        if self._closed:
            raise engine_failure(MlxrError("the model was unloaded"))
        self._check_queue()
        stream = _Stream(asyncio.get_running_loop())
        group = self.engine.add_embeddings(seqs, pooling,
                                           lambda out: self._outbox.append((stream, out)))
        self._ensure_thread()
        self._wake.set()
        try:
            return await embeddings_of(stream, len(group))
        finally:
            stream.closed = True
            for seq in group:
                if not seq.finished:
                    self.engine.abort(seq)
            self._wake.set()

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="mlxr-engine", daemon=True)
            self._thread.start()

    async def generate(self, req: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (those that queued up while the consumer was busy come
        merged into one). Raises QueueFullError, MlxrError or what the logits processor's
        `prepare()` raises (if it has one) before streaming; leaving the loop
        early aborts the request and frees its KV blocks."""
        if self._closed:  # the model server unloaded this model
            raise engine_failure(MlxrError("the model was unloaded"))
        self._check_queue()
        prepare = getattr(req.logits_processor, "prepare", None)
        if prepare is not None:  # e.g. a grammar's matcher: built here, not on the engine thread
            prepare()
        loop = asyncio.get_running_loop()
        stream = _Stream(loop)
        # emit runs on the engine thread inside step(); _flush (same thread) swaps the list
        seq = self.engine.add(req, lambda out: self._outbox.append((stream, out)))
        self._ensure_thread()
        self._wake.set()
        done = False
        try:
            while True:
                out = await next_output(stream)
                done = out.finish_reason is not None
                yield out
                if done:
                    return
        finally:
            stream.closed = True
            if not done:
                self.engine.abort(seq)
                self._wake.set()
