"""Serving the hybrid families (decoders with their own per-sequence cache: recurrent state beside
K/V, or K/V of per-layer shapes): each running sequence owns one such cache.

A sequence's cache is made when it first computes from position 0, dropped when it leaves the
running set (finished, cancelled, or preempted: a preempted sequence restarts from position 0
with a fresh cache and zero recurrent state, recomputing its tokens), and its chunks run in
order, so the state carried between steps is exactly the single-request path's. Prefix caching
is off for these models (`BlockManager(prefix_caching=False)`): a cached block holds K/V only,
not the recurrent state at its end. The block manager still meters the tokens each sequence
holds, so admission and preemption work as for the dense models.

Each sequence's chunk runs as its own forward (the same computation as `Model.generate`, so
batched output equals single output exactly); the step is not batched across sequences.
"""

from __future__ import annotations

import torch

from .scheduler import Sequence


class SequenceCaches:
    """Per-sequence caches of a hybrid decoder, keyed by sequence id."""

    def __init__(self, decoder):
        self.decoder = decoder
        self.caches: dict[int, object] = {}

    def release_all_but(self, running: list[Sequence]) -> None:
        """Drop the caches of sequences no longer running (their memory is freed)."""
        live = {s.id for s in running}
        for sid in [sid for sid in self.caches if sid not in live]:
            del self.caches[sid]

    def run(self, batch: list[tuple[Sequence, int]]) -> tuple[list[Sequence], torch.Tensor]:
        """Compute each (sequence, n) chunk of the step into the sequence's cache. Returns the
        sequences whose chunk reached their last token and their logits float32 [S, V]."""
        done, rows = [], []
        for seq, n in batch:
            start = seq.num_computed
            cache = self.caches.get(seq.id)
            if cache is None or start == 0:
                cache = self.caches[seq.id] = self.decoder.new_cache(len(seq.token_ids) + 16)
            if cache.length != start:
                raise RuntimeError(f"sequence {seq.id}: cache holds {cache.length} positions, "
                                   f"the step starts at {start}")
            ids = torch.tensor(seq.token_ids[start:start + n])
            logits = self.decoder.forward(ids, cache, last_only=True)
            if start + n == len(seq.token_ids):
                done.append(seq)
                rows.append(logits[0])
        if not rows:
            return done, torch.empty((0, self.decoder.config.vocab_size))
        return done, torch.stack(rows)
