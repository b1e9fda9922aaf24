"""Rank 0's decoder: the local shard's decoder, whose forward calls are first sent to the
followers (`wire`) so that every rank runs the same step; everything else (config, dtype,
device, layers, ropes) is the local decoder's."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ..engine.kv_cache import KVPool, SequenceCache
from .graphs import MirroredGraphDecoder, MirroredPagedRunner, enabled
from .launcher import Team
from .wire import CallEncoder


@contextmanager
def _step_finishes() -> Iterator[None]:
    """Ctrl-C during a step takes effect when the step is done: a step that rank 0 left
    between two collectives would leave the followers waiting in the next one (the model
    then out of step for good). A second Ctrl-C interrupts at once (the model is then
    broken). Only the main thread receives signals; elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list = []

    def defer(signum, frame):
        if pending:
            raise KeyboardInterrupt
        pending.append((signum, frame))

    previous = signal.signal(signal.SIGINT, defer)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pending and callable(previous):
        previous(*pending[0])
    elif pending and previous == signal.SIG_DFL:
        raise KeyboardInterrupt


class _MirroredWeight:
    """A rank-0 QuantWeight whose `add_batch_copy` (the engine's, before it sizes the KV
    pool) runs on every rank."""

    def __init__(self, inner, index: int, team: Team):
        self._inner, self._index, self._team = inner, index, team

    def add_batch_copy(self) -> int:
        self._team.send(("batch_copy", self._index))
        return self._inner.add_batch_copy()

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


class DriverDecoder:
    """Rank 0 of a tensor-parallel model. A graph that rank 0 replayed alone would not reach
    the followers: the decode steps are captured on every rank (`graph_decoder`,
    `paged_runner`) where enabled, and prefill graphs stay off."""

    prefill_graphs = False  # captured on rank 0 alone, a prefill would not reach the others

    def __init__(self, local, team: Team):
        self._local, self._team = local, team
        self._calls = CallEncoder(local)

    @property
    def graphable(self) -> bool:
        """Whether the decode steps are captured (on every rank: `graph_decoder`,
        `paged_runner`); where not, they run eagerly, every call mirrored."""
        return enabled(self._local)

    @property
    def world(self) -> int:
        return self._team.world

    def __getattr__(self, name: str):
        return getattr(self._local, name)

    def forward(self, *args, **kw) -> torch.Tensor:
        return self._call("forward", args, kw)

    def forward_step(self, *args, **kw) -> torch.Tensor:
        return self._call("forward_step", args, kw)

    def forward_static(self, *args, **kw) -> torch.Tensor:
        return self._call("forward_static", args, kw)

    def forward_paged(self, *args, **kw) -> torch.Tensor:
        return self._call("forward_paged", args, kw)

    def _call(self, method: str, args: tuple, kw: dict) -> torch.Tensor:
        """Send the call to the followers, then run it here (the collectives inside it meet
        theirs)."""
        enc = self._calls
        with _step_finishes():
            self._team.send(("call", method, enc.encode(args), enc.encode(kw),
                             enc.released()))
            try:
                return getattr(self._local, method)(*args, **kw)
            except Exception as e:
                raise self._team.failure(e) from e
            except BaseException as e:  # a second Ctrl-C: the followers are mid-step
                self._team.failure(e)
                raise

    def graph_decoder(self, cache: SequenceCache) -> MirroredGraphDecoder | None:
        """The captured decode step on every rank, where enabled (`graphs.enabled`); else
        None: the step runs eagerly, each call mirrored."""
        if not enabled(self._local):
            return None
        return MirroredGraphDecoder(self._local, self._team, self._calls.key(cache), cache)

    def paged_runner(self, pool: KVPool, trash_block: int, max_batch: int,
                     max_positions: int, capture: bool) -> MirroredPagedRunner:
        """The serving engine's decode runner, run by every rank over its own pool."""
        return MirroredPagedRunner(self._local, self._team, self._calls.key(pool), pool,
                                   trash_block, max_batch, max_positions, capture)

    def quant_weights(self) -> list:
        return [_MirroredWeight(w, i, self._team)
                for i, w in enumerate(self._local.quant_weights())]

    def close(self) -> None:
        """Stop the followers (the model cannot compute afterwards)."""
        self._team.close()
