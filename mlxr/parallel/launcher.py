"""Rank 0's side of a tensor-parallel model: start the follower processes, watch them, tear
them down.

`Team.start` starts ranks 1..N-1 as fresh interpreters (`python -m mlxr.parallel.worker`: no
CUDA state forked, and unlike multiprocessing's spawn, the user's main script is not imported
again, nor does a daemonic parent stop it), each talking to rank 0 over its own socket pair,
joins the group as rank 0 and waits until each has loaded its shard. A watchdog thread polls
the processes: a follower that dies marks the team broken, the other followers are ended (so no
rank stays blocked in a collective) and rank 0's next (or current) call raises
`TensorParallelError` naming the rank, its exit code and the error it reported. `close` (also
at interpreter exit, after Ctrl-C) stops the followers: "stop", then terminate, then kill.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from ..config import ModelConfig
from ..errors import MlxrError
from . import group, wire

log = logging.getLogger(__name__)

JOIN_S = 5.0  # a follower's grace to exit after "stop", then after terminate
POLL_S = 0.2  # how often the watchdog looks at the followers


class TensorParallelError(MlxrError):
    """A tensor-parallel model whose ranks failed (a follower died, or failed to load)."""


def rank_device(device: torch.device, rank: int) -> str:
    """Rank r's device: the CPU, or CUDA GPU (rank 0's index + r)."""
    if device.type == "cpu":
        return "cpu"
    return f"cuda:{(device.index or 0) + rank}"


class Team:
    """Followers 1..N-1 of this process (rank 0)."""

    def __init__(self, world: int):
        self.world = world
        self.procs: list = []
        self.conns: list = []
        self.broken: str | None = None
        self._closing = threading.Event()
        self._watch: threading.Thread | None = None
        self._store = None
        self.group: group.Group | None = None

    def start(self, path: Path, config: ModelConfig, device: torch.device,
              dtype: torch.dtype) -> None:
        """Spawn the followers and join the group with them (each then loads its shard; rank 0
        loads its own meanwhile and calls `wait_ready`)."""
        group.set_process_env()
        self._store = group.master_store(self.world)
        for rank in range(1, self.world):
            ours, theirs = socket.socketpair()
            p = subprocess.Popen([sys.executable, "-m", "mlxr.parallel.worker",
                                  str(theirs.fileno())], pass_fds=(theirs.fileno(),))
            theirs.close()
            conn = Connection(ours.detach())
            wire.send(conn, ("init", rank, self.world, self._store.port, str(path), config,
                       rank_device(device, rank), dtype, os.getpid()))
            self.procs.append(p)
            self.conns.append(conn)
        atexit.register(self.close)
        self._watch = threading.Thread(target=self._watchdog, name="mlxr-tp-watchdog",
                                       daemon=True)
        self._watch.start()
        for rank in range(1, self.world):  # each follower is up before rank 0 rendezvous
            self._expect(rank, "started")
        self.group = group.Group(self._store, self._store.port, 0, self.world, device)

    def wait_ready(self) -> None:
        for rank in range(1, self.world):
            self._expect(rank, "ready")

    def _expect(self, rank: int, what: str) -> None:
        conn, proc = self.conns[rank - 1], self.procs[rank - 1]
        while True:
            if self.broken:
                raise TensorParallelError(self.broken)
            if conn.poll(0.2):
                try:
                    msg = wire.recv(conn)
                except EOFError:
                    continue  # it died: the watchdog reports it
                if msg[0] == what:
                    return
                if msg[0] == "failed":
                    log.debug("rank %d: %s", rank, msg[2])
                    self.broken = f"tensor-parallel rank {rank} failed: {msg[1]}"
                    self.close()
                    raise TensorParallelError(self.broken)
            elif proc.poll() is not None:
                self._fail_dead()

    def _fail_dead(self) -> None:
        """Give the watchdog a moment to describe the death, then raise."""
        for _ in range(50):
            if self.broken:
                break
            time.sleep(0.02)
        raise TensorParallelError(self.broken or "a tensor-parallel rank died")

    def _watchdog(self) -> None:
        while not self._closing.wait(POLL_S):
            dead = [i for i, p in enumerate(self.procs) if p.poll() is not None]
            if not dead or self._closing.is_set():
                continue
            # the cause rather than a consequence: a rank ended by a signal (killed, out of
            # memory, a crash) before one that exited on the error its collective then raised
            rank = min(dead, key=lambda i: (self.procs[i].returncode >= 0, i)) + 1
            p = self.procs[rank - 1]
            if self.broken is not None:  # ended by `failure` (rank 0's own error)
                return
            why = self._reported(rank)
            self.broken = (f"tensor-parallel rank {rank} (pid {p.pid}) died (exit code "
                           f"{p.returncode}){': ' + why if why else ''}; this model cannot "
                           "compute any more: load it again")
            log.error("%s", self.broken)
            self._abort()
            return

    def _reported(self, rank: int) -> str | None:
        """The error a follower sent before it ended, if any."""
        conn = self.conns[rank - 1]
        try:
            while conn.poll(0):
                msg = wire.recv(conn)
                if msg[0] == "failed":
                    return msg[1]
        except (EOFError, OSError):
            pass
        return None

    def _abort(self) -> None:
        """End the other followers, so that no rank stays blocked in a collective (gloo then
        fails at once on the closed connections; NCCL's communicator is aborted). Killed, not
        asked: the team is broken, and a stopped process would not take SIGTERM."""
        self._terminate(force=True)
        if self.group is not None:
            try:
                self.group.abort()
            except Exception:  # noqa: BLE001 -- best effort on the way down
                pass

    def _terminate(self, force: bool = False) -> None:
        for p in self.procs:
            if p.poll() is None:
                if force:
                    p.kill()
                else:
                    p.terminate()
        for p in self.procs:
            try:
                p.wait(JOIN_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(JOIN_S)

    def send(self, msg: tuple) -> None:
        """Send one message to every follower (a dead one makes this raise)."""
        if self.broken:
            raise TensorParallelError(self.broken)
        try:
            for conn in self.conns:
                wire.send(conn, msg)
        except OSError:
            self._fail_dead()

    def failure(self, e: BaseException) -> TensorParallelError:
        """What rank 0 raises for an exception inside a call. A follower's death when that is
        the cause (a collective fails as soon as a rank's connections close, which can be a
        moment before its process is reaped). Otherwise the ranks are out of step (a
        collective timed out, or rank 0 failed between two collectives that the followers
        then wait in): the followers are ended and the team is broken either way."""
        for _ in range(50):
            if self.broken or not self._all_alive():
                break
            time.sleep(0.02)
        if self.broken is None and not self._all_alive():
            try:
                self._fail_dead()
            except TensorParallelError as err:
                return err
        if self.broken is None:
            self.broken = (f"tensor-parallel rank 0 failed in a step ({type(e).__name__}: "
                           f"{e}); the ranks are out of step: this model cannot compute any "
                           "more: load it again")
            log.error("%s", self.broken)
            self._abort()
        return TensorParallelError(self.broken)

    def _all_alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def close(self) -> None:
        """Stop the followers and leave the group (idempotent)."""
        if self._closing.is_set():
            return
        self._closing.set()
        atexit.unregister(self.close)
        for conn in self.conns:
            try:
                wire.send(conn, ("stop",))
            except OSError:
                pass
        deadline = time.monotonic() + JOIN_S
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._terminate()
        for conn in self.conns:
            conn.close()
        self.group = None
