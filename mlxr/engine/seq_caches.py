"""Serving the hybrid families (decoders with their own per-sequence cache: recurrent state beside
K/V, or K/V of per-layer shapes): each running sequence owns one such cache.

A sequence's cache is made when it first computes from position 0, dropped when it leaves the
running set (finished, cancelled, or preempted: a preempted sequence restarts from position 0
with a fresh cache and zero recurrent state, recomputing its tokens), and its chunks run in
order, so the state carried between steps is exactly the single-request path's. Prefix caching
is off for these models (`BlockManager(prefix_caching=False)`): a cached block holds K/V only,
not the recurrent state at its end. The block manager still meters the tokens each sequence
holds, so admission and preemption work as for the dense models.

Sequences that decode one token run as one batch (`forward_batch`: projections, MLPs and the
recurrence batched; each sequence's attention over its own K/V); prefill chunks run as one
forward per sequence (the same computation as `Model.generate`).
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

    def _cache_at(self, seq: Sequence) -> object:
        """The sequence's cache, holding exactly its computed positions (fresh at 0)."""
        start = seq.num_computed
        cache = self.caches.get(seq.id)
        if cache is None or start == 0:
            cache = self.caches[seq.id] = self.decoder.new_cache(len(seq.token_ids) + 16)
        if cache.length != start:
            raise RuntimeError(f"sequence {seq.id}: cache holds {cache.length} positions, "
                               f"the step starts at {start}")
        return cache

    def run(self, batch: list[tuple[Sequence, int]]) -> tuple[list[Sequence], torch.Tensor]:
        """Compute each (sequence, n) chunk of the step into the sequence's cache: sequences
        decoding one token run together (`forward_batch`), the others one forward each.
        Returns the sequences whose chunk reached their last token (in batch order) and
        their logits float32 [S, V]."""
        rows: dict[int, torch.Tensor] = {}
        decodes = [seq for seq, n in batch if n == 1 and seq.num_computed > 0]
        if len(decodes) > 1:
            caches = [self._cache_at(seq) for seq in decodes]
            ids = torch.tensor([seq.token_ids[seq.num_computed] for seq in decodes])
            logits = self.decoder.forward_batch(ids, caches)
            rows.update({seq.id: logits[j] for j, seq in enumerate(decodes)})
        for seq, n in batch:
            if seq.id in rows:
                continue
            start = seq.num_computed
            ids = torch.tensor(seq.token_ids[start:start + n])
            logits = self.decoder.forward(ids, self._cache_at(seq), last_only=True)
            if start + n == len(seq.token_ids):
                rows[seq.id] = logits[0]
        done = [seq for seq, _ in batch if seq.id in rows]
        if not done:
            return done, torch.empty((0, self.decoder.config.vocab_size))
        return done, torch.stack([rows[seq.id] for seq in done])
