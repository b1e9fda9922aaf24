"""The hybrid families' serving caches in preallocated tensors, one slot per running sequence,
so the engine's batched decode step reads them at fixed addresses and can be captured in a
CUDA graph (`engine.hybrid_graphs`).

Per layer kind (`hybrid_cache.layer_shapes`):
- full-attention K/V: a paged pool k[i] / v[i] [K, (blocks + 1) * bs, D]; a sequence's
  positions live in the blocks of its block table (the engine's BlockManager, which already
  meters these positions), p in slot table[p // bs] * bs + p % bs. Block `blocks` is the
  padding rows' trash block.
- sliding-window K/V: a ring of R = min(window, max_positions) slots per sequence slot,
  k[i] [K, (S + 1) * R, D], slot s's ring at [s * R, (s + 1) * R), position p at p % R (as
  HybridCache's ring: before it wraps, slot = position).
- recurrent state: conv[i] [S + 1, W-1, C] (compute dtype), ssm[i] [S + 1, Hv, Dv, Dk]
  float32.
- KV-shared layers: nothing (they read their source layer's buffers).
Slot S (the last) is the padding rows' trash slot; the other S are handed out by `take`.

`SlotCache` is one sequence's view with HybridCache's interface, so the per-sequence
`forward` (prefill chunks) runs over the pool unchanged, and `copy` makes a standalone
HybridCache (a prefix snapshot); `load` restores one into the slot.
"""

from __future__ import annotations

import torch

from .hybrid_cache import HybridCache, KVShape, LayerShape, StateShape


class SlotPool:
    """The buffers of `num_slots` sequences (see the module doc)."""

    def __init__(self, shapes: list[LayerShape], dtype: torch.dtype, device: torch.device,
                 num_blocks: int, block_size: int, num_slots: int, max_positions: int):
        self.shapes, self.dtype, self.device = shapes, dtype, device
        self.block_size, self.max_positions = block_size, max_positions
        self.trash_block, self.trash_slot = num_blocks, num_slots
        self.ring = [min(s.window, max_positions)
                     if isinstance(s, KVShape) and s.window is not None else None
                     for s in shapes]

        def kv(i: int, s: LayerShape) -> torch.Tensor | None:
            if not isinstance(s, KVShape):
                return None
            n = (num_slots + 1) * self.ring[i] if self.ring[i] else \
                (num_blocks + 1) * block_size
            return torch.zeros((s.kv_heads, n, s.head_dim), dtype=dtype, device=device)

        self.k = [kv(i, s) for i, s in enumerate(shapes)]
        self.v = [kv(i, s) for i, s in enumerate(shapes)]
        self.conv = [torch.zeros((num_slots + 1, *s.conv), dtype=dtype, device=device)
                     if isinstance(s, StateShape) else None for s in shapes]
        self.ssm = [torch.zeros((num_slots + 1, *s.ssm), dtype=torch.float32, device=device)
                    if isinstance(s, StateShape) else None for s in shapes]
        self.free = list(range(num_slots - 1, -1, -1))  # popped lowest first

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (*self.k, *self.v, *self.conv, *self.ssm) if t is not None)

    def take(self) -> int:
        """A free slot, its recurrent states zeroed (a sequence starts from zero state)."""
        slot = self.free.pop()
        for t in self.conv + self.ssm:
            if t is not None:
                t[slot].zero_()
        return slot

    def give(self, slot: int) -> None:
        self.free.append(slot)


class SlotCache(HybridCache):
    """Sequence `seq`'s view of a SlotPool at `slot` (HybridCache's interface: length,
    reserve, clear_states, extend, write_target, visible, copy; conv / ssm [1, ...] and the
    rings' k / v [K, R, D] are views of the pool). Full layers' K/V go through the blocks of
    seq.block_table (read at each call: it grows as the sequence does)."""

    def __init__(self, pool: SlotPool, slot: int, seq):
        self.store, self.slot, self.seq = pool, slot, seq
        self.shapes, self.dtype, self.device = pool.shapes, pool.dtype, pool.device
        self.length, self.capacity = 0, pool.max_positions
        self._ring_index = (None, None, None)
        self._phys: tuple[int, torch.Tensor | None] = (0, None)

        def ring(buf: torch.Tensor | None, r: int | None) -> torch.Tensor | None:
            return buf[:, slot * r:(slot + 1) * r] if r else None

        self.k = [ring(b, r) for b, r in zip(pool.k, pool.ring)]
        self.v = [ring(b, r) for b, r in zip(pool.v, pool.ring)]
        self.conv = [c[slot:slot + 1] if c is not None else None for c in pool.conv]
        self.ssm = [s[slot:slot + 1] if s is not None else None for s in pool.ssm]

    def _slots(self) -> torch.Tensor:
        """Pool slots of every position the block table covers [len(table) * bs] (device
        long), remade when the table grew."""
        table, bs = self.seq.block_table, self.store.block_size
        if self._phys[0] != len(table):
            t = torch.tensor(table, dtype=torch.long)
            phys = (t[:, None] * bs + torch.arange(bs)).reshape(-1).to(self.device)
            self._phys = (len(table), phys)
        return self._phys[1]

    def reserve(self, length: int) -> None:
        if length > self.capacity:
            raise RuntimeError(f"a slot holds {self.capacity} positions, not {length}")

    def write_target(self, i: int, start: int,
                     t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.store.k[i], self.store.v[i], self._slots()[start:start + t]

    def visible(self, i: int, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
        slots = self._slots()[:ctx]
        return self.store.k[i].index_select(1, slots), self.store.v[i].index_select(1, slots)

    def extend(self, i: int, k: torch.Tensor, v: torch.Tensor,
               start: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        if self.store.ring[i]:  # HybridCache's ring, over this slot's view
            return super().extend(i, k, v, start)
        kb, vb, slots = self.write_target(i, start, k.shape[1])
        kb.index_copy_(1, slots, k)
        vb.index_copy_(1, slots, v)
        return *self.visible(i, start + k.shape[1]), 0

    def copy(self, capacity: int) -> HybridCache:
        """A standalone HybridCache of `capacity` (>= length) holding this one's positions
        and states (HybridCache.copy's layout: a prefix snapshot)."""
        if capacity < self.length:
            raise ValueError(f"a cache of {capacity} positions cannot hold {self.length}")
        out = HybridCache(self.shapes, self.dtype, self.device, max(1, capacity))
        out.length = n = self.length
        for i, s in enumerate(self.shapes):
            if not isinstance(s, KVShape):
                continue
            if self.store.ring[i]:  # slots [0, m) hold every kept position
                m = min(n, self.store.ring[i])
                out.k[i][:, :m], out.v[i][:, :m] = self.k[i][:, :m], self.v[i][:, :m]
            elif n:
                out.k[i][:, :n], out.v[i][:, :n] = self.visible(i, n)
        self._copy_states(out, self)
        return out

    def load(self, snap: HybridCache) -> None:
        """Take the positions and states of a snapshot (its length within the block table)."""
        self.length = n = snap.length
        for i, s in enumerate(self.shapes):
            if not isinstance(s, KVShape):
                continue
            if self.store.ring[i]:
                m = min(n, snap.k[i].shape[1])
                self.k[i][:, :m], self.v[i][:, :m] = snap.k[i][:, :m], snap.v[i][:, :m]
            elif n:
                kb, vb, slots = self.write_target(i, 0, n)
                kb.index_copy_(1, slots, snap.k[i][:, :n])
                vb.index_copy_(1, slots, snap.v[i][:, :n])
        self._copy_states(self, snap)

    @staticmethod
    def _copy_states(dst: HybridCache, src: HybridCache) -> None:
        for d, s in zip(dst.conv + dst.ssm, src.conv + src.ssm):
            if d is not None:
                d.copy_(s)

    def nbytes(self) -> int:
        raise TypeError("a slot's bytes are the pool's (SlotPool.nbytes)")
