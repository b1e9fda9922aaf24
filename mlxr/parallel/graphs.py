"""The single-request decode step as a CUDA graph on every rank (opt-in: MLXR_TP_GRAPHS=1,
not yet verified on GPUs; docs/tensor_parallel.md).

Each rank captures the same step (`cuda_graph.GraphDecoder`: forward_static, argmax into the
step's input, position + 1) over its shard, the all-reduces and the logits' all-gather inside
the graph. Every rank holds the whole logits row after the gather, so every rank's argmax picks
the same next token on the device: rank 0 announces only "start at (token, position)" and
"replay" (`wire` messages "graph", "graph_start", "graph_replay"), never a token per step.
"""

from __future__ import annotations

import os

from ..engine.cuda_graph import GraphDecoder, graphable
from ..engine.kv_cache import SequenceCache
from .launcher import Team


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


class FollowerGraphs:
    """A follower's captured steps, by rank 0's cache key."""

    def __init__(self, calls):
        self.calls = calls  # wire.CallDecoder: the follower's caches by key
        self.graphs: dict[int, GraphDecoder] = {}

    def handle(self, msg: tuple) -> None:
        kind, key = msg[0], msg[1]
        if kind == "graph":
            cache = self.calls.cache(key, msg[2])
            self.graphs[key] = GraphDecoder(self.calls.decoder, cache)
        elif kind == "graph_start":
            self.graphs[key].start(msg[2], msg[3])
        else:  # graph_replay
            self.graphs[key].graph.replay()

    def release(self, keys: list[int]) -> None:
        for key in keys:
            self.graphs.pop(key, None)
