"""The serving engine's decode step for the hybrid families: B running sequences of a SlotPool,
one token each, in one launch (the hybrids' PagedDecodeRunner).

`forward_batch_static` takes every per-step index as a device tensor (token, position, full
layers' K/V slot, context length, state slot, block table), so on CUDA the whole step is
captured once per batch-size bucket (`decode_graphs.buckets_for`) and replayed: a step costs
one graph launch plus two small host-to-device copies. A batch of B runs in the smallest
bucket >= B; the padding rows decode token 0 at position 0 into the pool's trash block and
trash state slot, which no sequence owns (their states are never read by a real row). On CPU
(tests) the same step runs eagerly. `MLXR_HYBRID_GRAPHS=0` turns capture off
(`cuda_graph.graphable`).

Block tables live in a pinned host mirror [buckets[-1], width]; a row is rewritten only when
its sequence changed or its table grew (as in PagedDecodeRunner).
"""

from __future__ import annotations

import logging

import torch

from ..models.slot_pool import SlotCache, SlotPool
from .cuda_graph import capture
from .decode_graphs import buckets_for, clear_tables, stage_table

log = logging.getLogger(__name__)

# rows of the per-step index block: token, position, K/V slot, context length, state slot
IDS, POS, SLOT, LEN, STATE = range(5)


class HybridDecodeRunner:
    """Runs decode steps of up to `max_batch` sequences whose caches live in `pool`; captured
    per bucket where `graphs` (CUDA; a bucket whose capture fails runs eager, with a warning),
    else eager."""

    def __init__(self, decoder, pool: SlotPool, max_batch: int, graphs: bool):
        self.decoder, self.pool = decoder, pool
        self.buckets = buckets_for(max_batch)
        cap, dev, bs = self.buckets[-1], decoder.device, pool.block_size
        self.width = -(-pool.max_positions // bs)
        pin = dev.type == "cuda"
        self.h_rows = torch.zeros((5, cap), dtype=torch.long, pin_memory=pin)
        self.rows = torch.zeros((5, cap), dtype=torch.long, device=dev)
        self.h_tables = torch.full((cap, self.width), pool.trash_block, dtype=torch.int32,
                                   pin_memory=pin)
        self.tables = torch.full((cap, self.width), pool.trash_block, dtype=torch.int32,
                                 device=dev)
        self.row_state: list[tuple[list, int] | None] = [None] * cap
        self.rope = {}
        for rope in decoder.ropes:
            if id(rope.spec) not in self.rope:
                self.rope[id(rope.spec)] = rope.cos_sin(0, pool.max_positions)
        self.logits = torch.empty((cap, decoder.config.vocab_size), dtype=torch.float32,
                                  device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._reset_padding(0, cap)
        if graphs:
            self.rows.copy_(self.h_rows)
            mem = torch.cuda.graph_pool_handle()
            for b in reversed(self.buckets):  # largest first: the smaller ones reuse its memory
                try:
                    self.graphs[b] = capture(lambda b=b: self._body(b), mem)
                except Exception as e:  # noqa: BLE001 -- an op that cannot be captured: eager
                    log.warning("hybrid decode graph for %d rows not captured (%s); running "
                                "eager", b, e)

    def _body(self, b: int) -> None:
        r = self.rows[:, :b]
        logits = self.decoder.forward_batch_static(r[IDS], r[POS], r[SLOT], r[STATE],
                                                   self.tables[:b], r[LEN], self.pool,
                                                   self.rope)
        self.logits[:b].copy_(logits)

    def _reset_padding(self, start: int, end: int) -> None:
        """Rows [start, end) decode token 0 at position 0 into the trash block and slot."""
        self.h_rows[:, start:end] = 0
        self.h_rows[SLOT, start:end] = self.pool.trash_block * self.pool.block_size
        self.h_rows[LEN, start:end] = 1
        self.h_rows[STATE, start:end] = self.pool.trash_slot
        clear_tables(self.h_tables, self.row_state, start, end, self.pool.trash_block)

    def run(self, seqs: list, caches: list[SlotCache]) -> torch.Tensor:
        """Decode the pending token of each sequence (token_ids[num_computed], at position
        caches[r].length, its block allocated) into its cache (whose length the caller
        advances). Returns the logits float32 [n, V] on the device (valid until the next
        run)."""
        n, bs = len(seqs), self.pool.block_size
        b = next(x for x in self.buckets if x >= n)
        ids, pos, slots, states = [], [], [], []
        width = 1
        for r, (s, cache) in enumerate(zip(seqs, caches)):
            p, table = cache.length, s.block_table
            ids.append(s.token_ids[p])
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            states.append(cache.slot)
            width = max(width, stage_table(self.h_tables, self.row_state, r, table))
        self.h_rows[[IDS, POS, SLOT, STATE], :n] = torch.tensor([ids, pos, slots, states])
        self.h_rows[LEN, :n] = self.h_rows[POS, :n] + 1
        self._reset_padding(n, b)
        self.rows[:, :b].copy_(self.h_rows[:, :b], non_blocking=True)
        self.tables[:b, :width].copy_(self.h_tables[:b, :width], non_blocking=True)
        if b in self.graphs:
            self.graphs[b].replay()
        else:
            self._body(b)
        return self.logits[:n]
