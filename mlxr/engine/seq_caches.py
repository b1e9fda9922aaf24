"""Serving the hybrid families (decoders with their own per-sequence cache: recurrent state beside
K/V, or K/V of per-layer shapes): each running sequence owns one such cache.

A sequence's cache is made when it first computes from position 0 (or from a prefix snapshot,
below), dropped when it leaves the running set (finished, cancelled, or preempted: a preempted
sequence restarts like a new one, from its longest snapshot or from position 0 with a fresh
cache and zero recurrent state, recomputing its other tokens), and its chunks run in
order, so the state carried between steps is exactly the single-request path's. The block
manager's prefix cache is off for these models (`BlockManager(prefix_caching=False)`: a block
holds K/V only, not the recurrent state at its end); it still meters the tokens each sequence
holds, so admission and preemption work as for the dense models.

Prefix caching runs on snapshots instead (`StateSnapshots`): a sequence's whole cache is copied
whenever its computed tokens end on a block boundary, and a prefill chunk that crosses the last
boundary before the sequence's last token is run as two forwards split there, so every prompt
leaves a snapshot of its longest block-aligned proper prefix. An admitted sequence resumes from
the snapshot of its longest such prefix (`resume`). The split is made whether or not snapshots
are kept, so outputs with and without prefix caching are the same.

Sequences that decode one token run as one batch (`forward_batch`: projections, MLPs, the
recurrence and the attention, padded across the sequences' own K/V, batched); prefill chunks run
as one forward per sequence (the computation of `Model.generate`, split at most once).

`slot_caches.SlotCaches` is this class over one preallocated pool (a slot per running
sequence) whose decode step is captured per batch bucket on CUDA; this one is the engine's
path elsewhere (CPU, `paged_decode=False`, `MLXR_HYBRID_GRAPHS=0`, decoders without
`forward_batch_static`).
"""

from __future__ import annotations

import torch

from .memory import CACHE_SLACK
from .scheduler import Sequence
from .state_snapshots import StateSnapshots


class SequenceCaches:
    """Per-sequence caches of a hybrid decoder, keyed by sequence id, and the prefix snapshots
    (at most `snapshot_bytes`; 0: no prefix caching) at multiples of `block_size` tokens.
    Snapshots need a cache that copies itself (`HybridCache.copy`); a decoder says so with
    `cache_snapshots = True` (the ONNX fallback decoders' caches do not: no prefix caching)."""

    def __init__(self, decoder, block_size: int, snapshot_bytes: int):
        self.decoder, self.block_size = decoder, block_size
        self.caches: dict[int, object] = {}
        self.snapshots = StateSnapshots(
            snapshot_bytes if getattr(decoder, "cache_snapshots", False) else 0)
        self.queries = self.hits = 0  # prefix-cache statistics, in blocks (as BlockManager's)

    def resume(self, seq: Sequence) -> int:
        """Tokens of an admitted sequence restored from the snapshot of its longest cached
        prefix (its cache made from the snapshot), 0 if none; its last token is always
        computed (its logits are needed)."""
        self._drop(seq.id)
        snap = self.snapshots.longest(seq.token_ids, len(seq.token_ids) - 1)
        self.queries += (len(seq.token_ids) - 1) // self.block_size
        if snap is None:
            return 0
        self.hits += snap.length // self.block_size
        self._restore(seq, snap)
        return snap.length

    def _restore(self, seq: Sequence, snap) -> None:
        """The sequence's cache made from a snapshot."""
        self.caches[seq.id] = snap.copy(len(seq.token_ids) + CACHE_SLACK)

    def _drop(self, sid: int) -> None:
        self.caches.pop(sid, None)

    def _snapshot(self, seq: Sequence, cache) -> None:
        if self.snapshots.budget and cache.length % self.block_size == 0:
            self.snapshots.put(tuple(seq.token_ids[:cache.length]), cache)

    def _forward(self, seq: Sequence, n: int):
        """The chunk of n tokens from seq.num_computed, split at the last block boundary
        before the sequence's last token if it crosses it; logits [1, V] of its last row."""
        start, cache = seq.num_computed, self._cache_at(seq)
        cut = (len(seq.token_ids) - 1) // self.block_size * self.block_size
        for a, z in ((start, cut), (cut, start + n)) if start < cut < start + n else (
                (start, start + n),):
            logits = self.decoder.forward(torch.tensor(seq.token_ids[a:z]), cache,
                                          last_only=True)
            self._snapshot(seq, cache)
        return logits

    def release_all_but(self, running: list[Sequence]) -> None:
        """Drop the caches of sequences no longer running (their memory is freed)."""
        live = {s.id for s in running}
        for sid in [sid for sid in self.caches if sid not in live]:
            self._drop(sid)

    def _cache_at(self, seq: Sequence) -> object:
        """The sequence's cache, holding exactly its computed positions (fresh at 0)."""
        start = seq.num_computed
        cache = self.caches.get(seq.id)
        if cache is None or start == 0:
            cache = self.caches[seq.id] = self.decoder.new_cache(len(seq.token_ids) + CACHE_SLACK)
        if cache.length != start:
            raise RuntimeError(f"sequence {seq.id}: cache holds {cache.length} positions, "
                               f"the step starts at {start}")
        return cache

    def run(self, batch: list[tuple[Sequence, int]]) -> tuple[list[Sequence], torch.Tensor]:
        """Compute each (sequence, n) chunk of the step into the sequence's cache: sequences
        decoding one token run together (`forward_batch`), the others one forward each.
        Returns the sequences whose chunk reached their last token (in batch order) and
        their logits float32 [S, V]."""
        rows = self._decode([seq for seq, n in batch if n == 1 and seq.num_computed > 0])
        for seq, n in batch:
            if seq.id in rows:
                continue
            logits = self._forward(seq, n)
            if seq.num_computed + n == len(seq.token_ids):
                rows[seq.id] = logits[0]
        done = [seq for seq, _ in batch if seq.id in rows]
        if not done:
            return done, torch.empty((0, self.decoder.config.vocab_size))
        return done, torch.stack([rows[seq.id] for seq in done])

    def _decode(self, decodes: list[Sequence]) -> dict[int, torch.Tensor]:
        """Decode one token of each sequence (more than one: together, `forward_batch`);
        their logits rows [V] by sequence id (a lone one is left to `_forward`)."""
        if len(decodes) < 2:
            return {}
        caches = [self._cache_at(seq) for seq in decodes]
        ids = torch.tensor([seq.token_ids[seq.num_computed] for seq in decodes])
        logits = self.decoder.forward_batch(ids, caches)
        for seq, cache in zip(decodes, caches):
            self._snapshot(seq, cache)
        return {seq.id: logits[j] for j, seq in enumerate(decodes)}
