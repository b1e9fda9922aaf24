"""Prefix caching for the hybrid families: snapshots of a sequence's whole cache (recurrent and
conv states, K/V) at block boundaries of its tokens, so a later request sharing that prefix
resumes from the snapshot instead of recomputing it.

A block of the paged pool cannot serve here: a hybrid's K/V lives in its per-sequence cache, and
the recurrent state after a prefix is not a function of any block's K/V. A snapshot is a
`HybridCache.copy` sized to its length, keyed by the exact token prefix (compared in full, not
only hashed). Memory is bounded: snapshots are kept least-recently-used first out within
`budget` bytes; one larger than the whole budget is not kept.
"""

from __future__ import annotations

from collections import OrderedDict


class StateSnapshots:
    """Cache snapshots by token prefix, within `budget` bytes."""

    def __init__(self, budget: int):
        self.budget, self.used = max(0, budget), 0
        self.items: OrderedDict[tuple[int, ...], object] = OrderedDict()
        self.lengths: dict[int, int] = {}  # prefix length -> snapshots of that length

    def __len__(self) -> int:
        return len(self.items)

    def put(self, tokens: tuple[int, ...], cache) -> None:
        """Keep a snapshot of `cache` (holding exactly `tokens`' positions)."""
        if tokens in self.items:
            self.items.move_to_end(tokens)
            return
        if not self.budget:
            return
        snap = cache.copy(len(tokens))
        size = snap.nbytes()
        if size > self.budget:
            return
        while self.used + size > self.budget:
            self._drop(next(iter(self.items)))
        self.items[tokens] = snap
        self.used += size
        self.lengths[len(tokens)] = self.lengths.get(len(tokens), 0) + 1

    def _drop(self, tokens: tuple[int, ...]) -> None:
        snap = self.items.pop(tokens)
        self.used -= snap.nbytes()
        n = len(tokens)
        self.lengths[n] -= 1
        if not self.lengths[n]:
            del self.lengths[n]

    def longest(self, ids: list[int], limit: int):
        """The snapshot of the longest prefix of ids of at most `limit` tokens, or None."""
        for n in sorted((n for n in self.lengths if n <= limit), reverse=True):
            snap = self.items.get(tuple(ids[:n]))
            if snap is not None:
                self.items.move_to_end(tuple(ids[:n]))
                return snap
        return None
