"""A follower rank's process: join the group, build its shard, then run every decoder call
rank 0 sends, until rank 0 says stop or goes away.

Messages on the pipe from rank 0 (pickled tuples):
  ("call", method, args, kw, released)  run decoder.<method>(*args, **kw) (`wire`
                                    references resolved; `released`: pool/cache keys that
                                    rank 0 dropped)
  ("batch_copy", index)             quant_weights()[index].add_batch_copy() (the engine's)
  ("graph", key, capacity), ("graph_start", key, token, position), ("graph_replay", key),
  ("paged_new", pool, trash, max_batch, max_positions, capture),
  ("paged_launch", key, bucket, width, rows, tables)
                                    the decode steps (`graphs`)
  ("stop",)                         leave the group and exit 0
To rank 0: ("started",) before the rendezvous, ("ready",) after the load, ("failed", text)
when the load or a call raised (then exit 1).
"""

from __future__ import annotations

import os
import signal
import threading
import time
import sys
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from . import group, wire
from .build import build_shard
from .graphs import FollowerGraphs
from .wire import CallDecoder

PARENT_POLL_S = 0.5


def _exit_with_parent(parent: int) -> None:
    """End this process when rank 0's process is gone (whatever this one is blocked in)."""
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent:
            os._exit(3)


def main(fd: int) -> None:
    """`python -m mlxr.parallel.worker FD`: FD is this rank's end of its socket pair with
    rank 0, whose first message is ("init", rank, world, port, path, config, device, dtype,
    rank 0's pid)."""
    conn = Connection(fd)
    try:
        _, rank, world, port, path, config, device, dtype, parent = wire.recv(conn)
    except EOFError:
        return
    run(rank, world, port, path, config, device, dtype, conn, parent)


def run(rank: int, world: int, port: int, path: str, config, device: str, dtype: torch.dtype,
        conn, parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which stops us
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    else:  # the host's cores shared between the ranks
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        wire.send(conn, ("started",))
        ranks = group.Group(None, port, rank, world, dev)
        decoder = build_shard(Path(path), config, ranks, dtype, dev)
        wire.send(conn, ("ready",))
        _serve(decoder, conn)
        # stopped: nothing to flush; skipping the interpreter's teardown (the process group's
        # destructors) ends the process at once, and exit frees its memory, GPU's included
        os._exit(0)
    except EOFError:  # rank 0 closed the pipe: it is gone or stopping
        os._exit(0)
    except BaseException as e:  # noqa: BLE001 -- reported to rank 0, then this process ends
        try:
            wire.send(conn, ("failed", f"{type(e).__name__}: {e}",
                       "".join(traceback.format_exception(e))))
        except OSError:
            pass
        os._exit(1)


def _serve(decoder, conn) -> None:
    calls = CallDecoder(decoder)
    graphs = FollowerGraphs(calls)
    while True:
        msg = wire.recv(conn)
        if msg[0] == "stop":
            return
        if msg[0] == "batch_copy":
            decoder.quant_weights()[msg[1]].add_batch_copy()
            continue
        if msg[0].startswith(("graph", "paged")):
            with torch.inference_mode():
                graphs.handle(msg)
            continue
        _, method, args, kw, released = msg
        calls.release(released)
        graphs.release(released)
        with torch.inference_mode():
            getattr(decoder, method)(*calls.decode(args), **calls.decode(kw))


if __name__ == "__main__":
    main(int(sys.argv[1]))
