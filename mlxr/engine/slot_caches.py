"""Serving the hybrid families from one preallocated pool (`SlotPool`): SequenceCaches'
behaviour (chunked prefill, prefix snapshots, release on finish / cancel / preemption) with
every running sequence's cache a slot of the pool, so that the decode step runs as one
captured CUDA graph per batch bucket (`HybridDecodeRunner`) instead of an eager Python loop
over per-sequence caches.

A sequence takes a slot (its recurrent states zeroed) the first time it runs after admission
and gives it back when it leaves the running set; a snapshot it resumed from is loaded into
the slot then (`resume` only notes it: the slot of a sequence preempted in the same schedule
is not free yet). Its full layers' K/V live in the blocks of its own block table (the
BlockManager's prefix caching is off for these models, so no block is shared). Prefill chunks
run the per-sequence `forward` over the slot's view (`SlotCache`), split at the last block
boundary as SequenceCaches does; every decoding sequence, one or many, runs in the runner.
"""

from __future__ import annotations

import torch

from ..models.slot_pool import SlotCache, SlotPool
from .hybrid_graphs import HybridDecodeRunner
from .scheduler import Sequence
from .seq_caches import SequenceCaches


class SlotCaches(SequenceCaches):
    """SequenceCaches over a SlotPool of `max_seqs` slots (full layers' K/V in `num_blocks`
    blocks of `block_size`, up to `max_positions` per sequence); `graphs`: capture the
    decode step per bucket (CUDA)."""

    def __init__(self, decoder, block_size: int, snapshot_bytes: int, num_blocks: int,
                 max_seqs: int, max_positions: int, graphs: bool):
        super().__init__(decoder, block_size, snapshot_bytes)
        self.pool = SlotPool(decoder.layer_shapes(), decoder.dtype, decoder.device, num_blocks,
                             block_size, max_seqs, max_positions)
        self.runner = HybridDecodeRunner(decoder, self.pool, max_seqs, graphs)
        self.caches: dict[int, SlotCache] = {}
        self.pending: dict[int, object] = {}  # sequence id -> the snapshot it resumes from

    def _restore(self, seq: Sequence, snap) -> None:
        self.pending[seq.id] = snap

    def _drop(self, sid: int) -> None:
        cache = self.caches.pop(sid, None)
        if cache is not None:
            self.pool.give(cache.slot)
        self.pending.pop(sid, None)

    def release_all_but(self, running: list[Sequence]) -> None:
        live = {s.id for s in running}
        for sid in [sid for sid in (*self.caches, *self.pending) if sid not in live]:
            self._drop(sid)

    def _cache_at(self, seq: Sequence) -> SlotCache:
        """The sequence's slot view, holding exactly its computed positions (a new slot with
        zero states, or its resumed snapshot, the first time it runs)."""
        start = seq.num_computed
        cache = self.caches.get(seq.id)
        if cache is None:
            cache = self.caches[seq.id] = SlotCache(self.pool, self.pool.take(), seq)
            snap = self.pending.pop(seq.id, None)
            if snap is not None:
                cache.load(snap)
        if start == 0:
            cache.length = 0
        if cache.length != start:
            raise RuntimeError(f"sequence {seq.id}: its slot holds {cache.length} positions, "
                               f"the step starts at {start}")
        return cache

    def _decode(self, decodes: list[Sequence]) -> dict[int, torch.Tensor]:
        """Every decoding sequence's token through the runner (one graph replay on CUDA)."""
        if not decodes:
            return {}
        caches = [self._cache_at(seq) for seq in decodes]
        logits = self.runner.run(decodes, caches)
        for seq, cache in zip(decodes, caches):
            cache.length += 1
            self._snapshot(seq, cache)
        return {seq.id: logits[j] for j, seq in enumerate(decodes)}
