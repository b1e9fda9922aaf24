"""The serving engine's decode step: B running sequences, one token each, in one launch.

`Decoder.forward_paged` takes every per-step index as a device tensor (token, position, cache
slot, block table, context length), so on CUDA the whole step, greedy selection included, is
captured once per batch-size bucket and replayed: a step costs one graph launch plus two small
host-to-device copies, whatever the batch. A batch of B runs in the smallest bucket >= B; the
padding rows decode token 0 at position 0 into a reserved trash block that no sequence owns.
On CPU (tests) the same step runs eagerly.

Block tables live in a pinned host mirror [buckets[-1], width]; a row is rewritten only when
its sequence changed (another sequence took the row, or a preemption gave it a new table list)
or its table grew, so a step costs O(B) host work, not O(context).
"""

from __future__ import annotations

import torch

from .. import ops
from .cuda_graph import capture, graphable

# Batch sizes with a captured graph: small steps fine-grained, then every 32 rows.
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def buckets_for(max_batch: int) -> list[int]:
    """Buckets covering batches up to max_batch (the last one, max_batch itself if larger)."""
    out = [b for b in BUCKETS if b < max_batch]
    return out + [max_batch]


def supported(decoder) -> bool:
    """Whether the paged decode step can be captured for `decoder`: graphable (CUDA, a RoPE
    that does not depend on the sequence length) and run by Triton kernels (the reference
    paged attention reads the block tables on the host)."""
    return graphable(decoder) and ops.fast_kernels(decoder.device)


def stage_table(h_tables: torch.Tensor, row_state: list, r: int, table: list[int]) -> int:
    """Row r of the pinned host mirror of the block tables holds `table`: rewritten only from
    the first column it lacks (all of it when row r held another sequence's table, whose list
    is another object). row_state[r] = (table, columns written). Returns len(table)."""
    m = len(table)
    st = row_state[r]
    have = st[1] if st is not None and st[0] is table else 0
    if have < m:
        h_tables[r, have:m] = torch.tensor(table[have:m], dtype=torch.int32)
        row_state[r] = (table, m)
    return m


def clear_tables(h_tables: torch.Tensor, row_state: list, start: int, end: int,
                 trash: int) -> None:
    """Padding rows [start, end) read the trash block (only column 0 is ever read: their
    context length is 1)."""
    for r in range(start, end):
        if row_state[r] is not None:
            h_tables[r, 0] = trash
            row_state[r] = None


class PagedDecodeRunner:
    """Runs decode steps of up to `max_batch` sequences whose KV lives in `pool` (block size
    bs); `trash_block` is a pool block outside the BlockManager (padding rows write there)."""

    def __init__(self, decoder, pool, trash_block: int, max_batch: int, max_positions: int,
                 capture: bool):
        self.decoder, self.pool, self.trash = decoder, pool, trash_block
        self.buckets = buckets_for(max_batch)
        cap, dev, bs = self.buckets[-1], decoder.device, pool.block_size
        self.width = min(-(-max_positions // bs), pool.num_blocks)
        pin = dev.type == "cuda"
        # ids, pos, slots, ctx lens; padding rows: token 0 at position 0 in the trash block
        self.h_rows = torch.zeros((4, cap), dtype=torch.long, pin_memory=pin)
        self.rows = torch.zeros((4, cap), dtype=torch.long, device=dev)
        self.h_tables = torch.full((cap, self.width), trash_block, dtype=torch.int32,
                                   pin_memory=pin)
        self.tables = torch.full((cap, self.width), trash_block, dtype=torch.int32, device=dev)
        self.row_state: list[tuple[list, int] | None] = [None] * cap
        self.rope = {}
        for rope in decoder.ropes:
            if id(rope.spec) not in self.rope:
                self.rope[id(rope.spec)] = rope.cos_sin(0, max_positions)
        self.logits = torch.empty((cap, decoder.config.vocab_size), dtype=torch.float32,
                                  device=dev)
        self.next_ids = torch.zeros(cap, dtype=torch.long, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if capture:
            self._capture()

    def _body(self, b: int) -> None:
        ids, pos, slots, lens = self.rows[:, :b]
        logits = self.decoder.forward_paged(ids, pos, slots, self.tables[:b], lens, self.pool,
                                            self.rope)
        self.logits[:b].copy_(logits)
        self.next_ids[:b].copy_(logits.argmax(dim=-1))

    def _capture(self) -> None:
        self._reset_padding(0, self.buckets[-1])
        self.rows.copy_(self.h_rows)
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):  # largest first: the smaller ones reuse its memory
            self.graphs[b] = capture(lambda b=b: self._body(b), pool)

    def _reset_padding(self, start: int, end: int) -> None:
        self.h_rows[:, start:end] = 0
        self.h_rows[2, start:end] = self.trash * self.pool.block_size
        self.h_rows[3, start:end] = 1
        clear_tables(self.h_tables, self.row_state, start, end, self.trash)

    def _launch(self, b: int, width: int) -> None:
        """The step of bucket b from the host rows and the first `width` columns of the
        tables: copied to the device, then the graph (or the eager body) runs."""
        self.rows[:, :b].copy_(self.h_rows[:, :b], non_blocking=True)
        self.tables[:b, :width].copy_(self.h_tables[:b, :width], non_blocking=True)
        if b in self.graphs:
            self.graphs[b].replay()
        else:
            self._body(b)

    def run(self, seqs: list, want_logits: list[bool]) -> tuple[list[int], dict[int, torch.Tensor]]:
        """Decode the pending token of each sequence (token_ids[num_computed], its block
        already allocated). Returns the greedy next id of every row and the float32 logits [V]
        (on the host) of the rows in want_logits."""
        n, bs = len(seqs), self.pool.block_size
        b = next(x for x in self.buckets if x >= n)
        ids, pos, slots = [], [], []
        width = 1
        for r, s in enumerate(seqs):
            p, table = s.num_computed, s.block_table
            ids.append(s.token_ids[p])
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            width = max(width, stage_table(self.h_tables, self.row_state, r, table))
        self.h_rows[:3, :n] = torch.tensor([ids, pos, slots])
        self.h_rows[3, :n] = self.h_rows[1, :n] + 1
        self._reset_padding(n, b)
        self._launch(b, width)
        want = [r for r, w in enumerate(want_logits) if w]
        logits = {}
        if want:
            rows = self.logits[torch.tensor(want, device=self.logits.device)].cpu()
            logits = dict(zip(want, rows))
        return self.next_ids[:n].tolist(), logits
