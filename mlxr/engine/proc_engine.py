"""`ProcEngine`: the batching engine in a process of its own, for the server.

Why: at high concurrency the HTTP path (uvicorn, FastAPI, SSE writes) and the engine's host-side
Python (scheduling, sampling, detokenizing) each want most of a core; in one process they take
turns on one GIL. ProcEngine runs the model and `AsyncEngine`'s engine thread in a child process
(multiprocessing "spawn": no CUDA state is forked), so the server process keeps only the tokenizer
and the HTTP work.

Protocol, two one-way pipes of pickled tuples (nothing per token):
- in: ("add", rid, EngineRequest), ("embed", rid, token lists, pooling) and ("abort", rid). EOF
  (the server closed it or died) ends the child.
- out: first ("ready", stats) or ("failed", exception); then at most ONE message per engine step,
  (outputs, errors, stats values, embeddings) with outputs = [(rid, token_ids, text,
  finish_reason, prompt_tokens, completion_tokens, cached_tokens, logprobs)], errors = [(rid,
  queue_full, message)] and embeddings = [(rid, EmbeddingOutput)] (one per text that
  completed). The stream interval and the merging of held outputs run in the child (AsyncEngine's
  `_flush`), so a step's message carries only what is due; a step with nothing due but changed
  stats (blocks freed by an abort) sends the stats alone.
One reader thread in the server process turns what arrived (a step, or several when it fell
behind) into RequestOutputs and hands them to the event loop with one `call_soon_threadsafe`, as
AsyncEngine's thread does per step.

Logits processors are closures and cannot cross: a grammar processor (anything with a `grammar`
string) is sent as ("grammar", text) and rebuilt in the child with the child's model; another is
sent only if it pickles (e.g. a module-level function).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import gc
import itertools
import logging
import multiprocessing as mp
import os
import pickle
import signal
import threading
from collections.abc import AsyncIterator
from typing import Any
from dataclasses import replace
from functools import partial
from pathlib import Path

from ..errors import MlxrError
from .async_engine import AsyncEngine, _Stream, embeddings_of, next_output, to_loops
from .embedding_seqs import EmbeddingOutput
from .engine import EngineRequest, QueueFullError, RequestOutput, TokenLogprob

__all__ = ["ProcEngine"]


def _messages(fd: int):
    """Messages as multiprocessing's Connection frames them (4-byte big-endian length, pickle),
    read from a pipe in large pieces: a list of all that arrived per read. (Connection.recv
    reads twice per message, and each read gives the GIL up: taking it back from a busy thread
    -- the event loop here, the engine thread in the child -- can cost the interpreter's switch
    interval, 5 ms, each time.)"""
    buf = b""
    while data := os.read(fd, 1 << 20):
        buf += data
        msgs, at = [], 0
        while len(buf) - at >= 4:
            n = int.from_bytes(buf[at:at + 4], "big")
            if len(buf) - at - 4 < n:
                break
            msgs.append(pickle.loads(memoryview(buf)[at + 4:at + 4 + n]))
            at += 4 + n
        buf = buf[at:]
        if msgs:
            yield msgs


# -- the engine process --------------------------------------------------------------------------

class _Remote:
    """The child's handle of a request: what AsyncEngine's `_flush` keys the held outputs on.
    `seqs`: its engine sequence(s) (an embeddings request has one per text); `left`: the
    outputs still to come before it is over (its texts' embeddings; 1 for a generation)."""

    __slots__ = ("closed", "left", "rid", "seqs")

    def __init__(self, rid: int):
        self.rid, self.closed, self.seqs, self.left = rid, False, [], 1


class _ChildEngine(AsyncEngine):
    """AsyncEngine whose step handoff is a message on the pipe instead of event-loop calls."""

    def __init__(self, model, tx, **kw):
        super().__init__(model, **kw)
        self.tx = tx
        self.send_lock = threading.Lock()  # the engine thread and the request reader both send
        self.remotes: dict[int, _Remote] = {}
        self.sent_stats = None

    def _send(self, outs: list, errs: list, embs: list | None = None) -> None:
        stats = tuple(self.engine.stats().values())
        with self.send_lock:
            self.tx.send((outs, errs, stats, embs or []))
        self.sent_stats = stats

    def _handoff(self, batch: list) -> None:
        outs, errs, embs = [], [], []
        for r, o in batch:
            if isinstance(o, EmbeddingOutput):
                embs.append((r.rid, o))
                r.left -= 1
                if r.left:
                    continue
            elif isinstance(o, RequestOutput):
                outs.append((r.rid, o.token_ids, o.text, o.finish_reason, o.prompt_tokens,
                             o.completion_tokens, o.cached_tokens,
                             o.logprobs and [(t.token_id, t.logprob, t.top) for t in o.logprobs]))
                if o.finish_reason is None:
                    continue
            else:  # engine_failure(...): the request is over
                errs.append((r.rid, False, str(o)))
            self.remotes.pop(r.rid, None)
        self._send(outs, errs, embs)

    def _flush(self) -> None:
        super()._flush()
        if tuple(self.engine.stats().values()) != self.sent_stats:
            self._send([], [])

    def _emit(self, r: _Remote, out) -> None:
        self._outbox.append((r, out))

    def _add(self, rid: int, req: EngineRequest | tuple) -> None:
        r = self.remotes[rid] = _Remote(rid)
        try:
            self._check_queue()
            if isinstance(req, tuple):  # (token lists, pooling): an embeddings request
                r.seqs = self.engine.add_embeddings(*req, partial(self._emit, r))
                r.left = len(r.seqs)
            else:
                if isinstance(req.logits_processor, tuple):  # ("grammar", text): ProcEngine
                    from ..server.grammar import GrammarProcessor

                    proc = GrammarProcessor(self.engine.model, req.logits_processor[1])
                    proc.prepare()  # a grammar that does not fit the vocabulary fails: a 400
                    req = replace(req, logits_processor=proc)
                r.seqs = [self.engine.add(req, partial(self._emit, r))]
        except Exception as e:  # noqa: BLE001 -- bad input is a 400, anything else a 500
            self.remotes.pop(rid, None)
            msg = str(e) if isinstance(e, ValueError) else f"engine failure: {e}"
            self._send([], [(rid, isinstance(e, QueueFullError), msg)])
            return
        self._ensure_thread()
        self._wake.set()

    def serve(self, rx) -> None:
        """Apply the server's requests and aborts until the pipe closes."""
        for msgs in _messages(rx.fileno()):  # a burst of requests: one read, one GIL wait
            for msg in msgs:
                if msg[0] == "add":
                    self._add(msg[1], msg[2])
                elif msg[0] == "embed":
                    self._add(msg[1], (msg[2], msg[3]))
                elif (r := self.remotes.pop(msg[1], None)) is not None:  # abort
                    r.closed = True
                    for seq in r.seqs:
                        self.engine.abort(seq)
                    self._wake.set()


def _portable_error(e: Exception) -> Exception:
    """`e` if it survives pickling (same type on the server side), else its text."""
    try:
        return pickle.loads(pickle.dumps(e))
    except Exception:  # noqa: BLE001 -- e.g. an __init__ with other arguments
        return RuntimeError(f"{type(e).__name__}: {e}")


def _child_main(path: str, load_kw: dict, engine_kw: dict, rx, tx) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the server; its exit ends us
    try:
        import mlxr

        model = mlxr.load(path, **load_kw)
        model.tokenizer  # noqa: B018 -- fail now, not on the first request
        eng = _ChildEngine(model, tx, **engine_kw)
    except Exception as e:  # reported as the server's load error, in one line (traceback: debug)
        logging.getLogger("mlxr.engine").debug("the engine process failed to load %s", path,
                                               exc_info=True)
        tx.send(("failed", _portable_error(e)))
        return
    gc.collect()  # the loaded heap out of the cyclic GC, as server.app.freeze_heap does: a full
    gc.freeze()  # collection would walk it again (~80 ms with stories260K) in the middle of a step
    tx.send(("ready", eng.engine.stats()))
    eng.serve(rx)
    os._exit(0)  # now, without waiting for the engine thread (it may be inside a step)


# -- the server side -----------------------------------------------------------------------------

def _portable(req: EngineRequest) -> EngineRequest:
    """The request as it can cross the pipe (see the module docstring for processors)."""
    p = req.logits_processor
    if p is None:
        return req
    grammar = getattr(p, "grammar", None)
    if isinstance(grammar, str):
        return replace(req, logits_processor=("grammar", grammar))
    try:
        pickle.dumps(p)
    except Exception as e:  # noqa: BLE001 -- closures, locks, C objects...
        raise MlxrError("this logits processor cannot be sent to the engine process (it does "
                        f"not pickle: {e}); use a grammar or a module-level function, or serve "
                        "with --engine-process off") from None
    return req


class _Open:
    """A request open in the child: its mailbox, and whether its last output arrived (then
    leaving it sends no abort)."""

    __slots__ = ("done", "stream")

    def __init__(self, stream: _Stream):
        self.stream, self.done = stream, False


class ProcEngine:
    """The engine in a child process, used as the server uses AsyncEngine: `generate`, `stats`,
    `ready`. The child loads `mlxr.load(path, **load_kw)` itself and builds
    `AsyncEngine(model, **engine_kw)` (max_num_seqs, max_queued, stream_interval, LLMEngine
    options). Call `wait_ready()` before serving and `close()` to stop the child."""

    # what the child runs, given (path, load_kw, engine_kw, rx, tx): a module-level function
    # (serve_bench's --null-engine replaces it with one that serves a stand-in engine)
    child_main = staticmethod(_child_main)

    def __init__(self, path: str | Path, load_kw: dict | None = None, **engine_kw):
        ctx = mp.get_context("spawn")
        rx, self._tx = ctx.Pipe(duplex=False)  # requests: server -> engine
        self._rx, tx = ctx.Pipe(duplex=False)  # steps: engine -> server
        self.proc = ctx.Process(target=self.child_main, name="mlxr-engine", daemon=True,
                                args=(str(path), dict(load_kw or {}), engine_kw, rx, tx))
        self.proc.start()
        rx.close()  # the child's ends: ours see EOF when it exits
        tx.close()
        for conn in (self._rx, self._tx):  # Linux: room for many steps (requests), so that a
            with contextlib.suppress(AttributeError, OSError):  # busy reader on the other side
                fcntl.fcntl(conn.fileno(), fcntl.F_SETPIPE_SZ, 1 << 20)  # stalls nobody
        self._streams: dict[int, _Stream] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()  # sends come from the event loop(s)
        self._keys: tuple = ()
        self._stats: tuple = ()
        self.ready = False
        self.error: str | None = None  # why the engine process is gone, once it is
        self._reader: threading.Thread | None = None  # joins the child when it is gone

    def wait_ready(self) -> None:
        """Block until the child has loaded the model; raise its load error if it failed."""
        try:
            kind, val = self._rx.recv()
        except EOFError:
            self.proc.join(10)
            raise MlxrError(f"the engine process exited (code {self.proc.exitcode}) while "
                            "loading the model") from None
        if kind == "failed":
            self.proc.join(10)
            raise val
        self._keys, self._stats = tuple(val), tuple(val.values())
        self.ready = True
        self._reader = threading.Thread(target=self._read, name="mlxr-engine-reader",
                                        daemon=True)
        self._reader.start()

    def stats(self) -> dict:
        """The engine's stats (LLMEngine.stats keys) as of its last step."""
        return dict(zip(self._keys, self._stats))

    def _read(self) -> None:
        """The reader thread: the steps that arrived -> one handoff to the event loop(s)."""
        streams = self._streams
        with contextlib.suppress(OSError):
            for msgs in _messages(self._rx.fileno()):
                batch = []
                for outs, errs, self._stats, embs in msgs:
                    for rid, ids, text, finish, p, c, cached, lps in outs:
                        st = streams.get(rid)
                        if st is not None and not st.closed:
                            batch.append((st, RequestOutput(
                                ids, text, finish, p, c, cached,
                                lps and [TokenLogprob(*t) for t in lps])))
                    for rid, out in embs:
                        st = streams.get(rid)
                        if st is not None and not st.closed:
                            batch.append((st, out))
                    for rid, full, msg in errs:
                        if (st := streams.get(rid)) is not None:
                            batch.append((st, QueueFullError(msg) if full else MlxrError(msg)))
                if batch:
                    to_loops(batch)
        self.proc.join(10)
        self.error = f"the engine process exited (code {self.proc.exitcode})"
        self.ready = False
        left = [(st, MlxrError(f"engine failure: {self.error}")) for st in list(streams.values())]
        if left:
            to_loops(left)

    def _send(self, msg: tuple) -> None:
        try:
            with self._lock:
                self._tx.send(msg)
        except (OSError, ValueError) as e:  # the child is gone, or we closed
            raise MlxrError(f"engine failure: the engine process is gone ({e})") from None

    @contextlib.asynccontextmanager
    async def _request(self, kind: str, *payload: Any) -> AsyncIterator[_Open]:
        """Send (kind, rid, *payload) to the child and yield the request's mailbox; on leaving,
        the mailbox is dropped, and the child told to abort the request unless the caller
        marked it `done` (its last output arrived)."""
        if not self.ready:
            raise MlxrError(f"engine failure: {self.error or 'the engine is not ready'}")
        rid = next(self._ids)
        opened = _Open(_Stream(asyncio.get_running_loop()))
        self._streams[rid] = opened.stream
        try:
            self._send((kind, rid, *payload))
            yield opened
        finally:
            opened.stream.closed = True
            del self._streams[rid]
            if not opened.done:
                with contextlib.suppress(MlxrError):
                    self._send(("abort", rid))

    async def generate(self, req: EngineRequest) -> AsyncIterator[RequestOutput]:
        """As AsyncEngine.generate: outputs (merged when the consumer lags); QueueFullError or
        MlxrError before streaming; leaving the loop early aborts the request in the child."""
        portable = _portable(req)
        async with self._request("add", portable) as opened:
            while not opened.done:
                out = await next_output(opened.stream)
                opened.done = out.finish_reason is not None
                yield out

    async def embed(self, seqs: list[list[int]], pooling: str = "last") -> tuple[Any, int]:
        """As AsyncEngine.embed, in the engine process: (float32 [B, E], prompt tokens)."""
        async with self._request("embed", [list(s) for s in seqs], pooling) as opened:
            out = await embeddings_of(opened.stream, len(seqs))
            opened.done = True
            return out

    def close(self) -> None:
        """Stop the engine process: it exits when its request pipe closes."""
        self._tx.close()
        if self._reader is not None:  # it joins the process (two joiners would race)
            self._reader.join(20)
        else:
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
