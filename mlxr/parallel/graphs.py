"""The decode steps as CUDA graphs on every rank (captured with MLXR_TP_GRAPHS=1, not yet
verified on GPUs; docs/tensor_parallel.md).

Single request: each rank captures the same step (`cuda_graph.GraphDecoder`: forward_static,
argmax into the step's input, position + 1) over its shard, the all-reduces and the logits'
all-gather inside the graph. Every rank holds the whole logits row after the gather, so every
rank's argmax picks the same next token on the device: rank 0 announces only "start at (token,
position)" and "replay" (messages "graph", "graph_start", "graph_replay"), never a token.

Serving engine: every rank holds a `decode_graphs.PagedDecodeRunner` over its pool (captured
per batch bucket where enabled, else run eagerly); rank 0 sends each step's host rows and block
tables (messages "paged_new", "paged_launch"), the followers launch the same bucket.
"""

from __future__ import annotations

import os

from ..engine.cuda_graph import GraphDecoder, graphable
from ..engine.decode_graphs import PagedDecodeRunner
from ..engine.kv_cache import KVPool, SequenceCache
from .launcher import Team
from .wire import PoolRef


def enabled(local) -> bool:
    """Whether rank 0 captures the decode step: asked for, and a step one GPU would capture."""
    return os.environ.get("MLXR_TP_GRAPHS") == "1" and graphable(local)


class _AnnouncedReplay:
    """A captured graph whose every replay on rank 0 is first announced to the followers."""

    def __init__(self, graph, team: Team, key: int):
        self._graph, self._team, self._key = graph, team, key

    def replay(self) -> None:
        self._team.send(("graph_replay", self._key))
        self._graph.replay()


class MirroredGraphDecoder(GraphDecoder):
    """Rank 0's captured decode step over `cache`; the followers capture theirs at the same
    time (the warm-up runs' collectives meet), over their caches of the same key."""

    def __init__(self, local, team: Team, key: int, cache: SequenceCache):
        self._team, self._key = team, key
        team.send(("graph", key, cache.capacity))
        try:
            super().__init__(local, cache)
        except Exception as e:
            raise team.failure(e) from e
        self.graph = _AnnouncedReplay(self.graph, team, key)

    def start(self, token: int, position: int) -> None:
        self._team.send(("graph_start", self._key, token, position))
        super().start(token, position)


class MirroredPagedRunner(PagedDecodeRunner):
    """Rank 0's paged decode runner: the followers build theirs over their pools at the same
    time (capturing the same buckets), and each step's launch goes to them first."""

    def __init__(self, local, team: Team, key: int, pool: KVPool, trash_block: int,
                 max_batch: int, max_positions: int, capture: bool):
        self._team, self._key = team, key
        team.send(("paged_new", PoolRef(key, pool.num_blocks, pool.block_size), trash_block,
                   max_batch, max_positions, capture))
        try:
            super().__init__(local, pool, trash_block, max_batch, max_positions, capture)
        except Exception as e:
            raise team.failure(e) from e

    def _launch(self, b: int, width: int) -> None:
        self._team.send(("paged_launch", self._key, b, width, self.h_rows[:, :b].clone(),
                         self.h_tables[:b, :width].clone()))
        try:
            super()._launch(b, width)
        except Exception as e:
            raise self._team.failure(e) from e


class FollowerGraphs:
    """A follower's decode steps (captured or not), by rank 0's cache / pool key."""

    def __init__(self, calls):
        self.calls = calls  # wire.CallDecoder: the follower's caches and pools by key
        self.graphs: dict[int, GraphDecoder] = {}
        self.runners: dict[int, PagedDecodeRunner] = {}

    def handle(self, msg: tuple) -> None:
        kind, key = msg[0], msg[1]
        if kind == "graph":
            cache = self.calls.cache(key, msg[2])
            self.graphs[key] = GraphDecoder(self.calls.decoder, cache)
        elif kind == "graph_start":
            self.graphs[key].start(msg[2], msg[3])
        elif kind == "graph_replay":
            self.graphs[key].graph.replay()
        elif kind == "paged_new":
            pool = self.calls.decode(key)  # a PoolRef: the follower's pool of that key
            self.runners[key.key] = PagedDecodeRunner(self.calls.decoder, pool, *msg[2:])
        else:  # paged_launch
            b, width, rows, tables = msg[2:]
            runner = self.runners[key]
            runner.h_rows[:, :b] = rows
            runner.h_tables[:b, :width] = tables
            runner._launch(b, width)

    def release(self, keys: list[int]) -> None:
        for key in keys:
            self.graphs.pop(key, None)
            self.runners.pop(key, None)
