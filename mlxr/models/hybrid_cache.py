"""The single-sequence cache of the hybrid decoders: per-layer K/V of any head count and width,
and the recurrent states of linear-attention layers.

Unlike `SequenceCache` (one [K, S, D] shape for every layer), a layer here declares what it
keeps: K/V [K, S, D] (its own K and D: gemma4's full layers are 512 wide), nothing (a
KV-shared layer reads another layer's), or a conv state [1, W-1, C] and a float32 recurrent
state [1, Hv, Dv, Dk] (a gated DeltaNet layer). Positions [0, length) are computed.

A sliding-window layer (window w: a query sees the w positions ending at its own) keeps a ring
of R = min(w, capacity) slots, position p in slot p % R: its memory stops growing at w
positions, however long the context. While R < w the capacity covers every position, so no
slot has wrapped yet (slot = position) and growing the ring copies slots as they are. Other
layers keep every position (slot = position), grown geometrically.

Every buffer is updated in place, so a decode step reading them at fixed addresses (and its
position as a device tensor: `step_slots`, `write_at`) can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config.hybrid import GatedDeltaSpec, Gemma4Spec
from ..config.spec import ModelConfig


@dataclass(frozen=True)
class KVShape:
    """A layer that stores K/V: kv heads, head dim, and its attention window (None: every
    earlier position is visible, all are kept)."""

    kv_heads: int
    head_dim: int
    window: int | None = None


@dataclass(frozen=True)
class StateShape:
    """A layer with recurrent state: conv [W-1, C] in the compute dtype, ssm [Hv, Dv, Dk]
    float32."""

    conv: tuple[int, int]
    ssm: tuple[int, int, int]


LayerShape = KVShape | StateShape | None


def layer_shapes(config: ModelConfig) -> list[LayerShape]:
    """What each layer of a config keeps per sequence (from the config alone: the memory budget
    sizes caches before any weight loads). qwen3_5 / qwen3_next: a conv and a recurrent state
    on linear-attention layers, K/V on full ones; gemma4: K/V of the layer's own heads and
    width (a ring on sliding layers), nothing on KV-shared ones; dense families: the same K/V
    on every layer."""
    c, s = config, config.arch
    if isinstance(s, GatedDeltaSpec):
        return [StateShape((s.conv_kernel - 1, s.conv_dim),
                           (s.num_v_heads, s.v_head_dim, s.k_head_dim))
                if t == "linear_attention" else KVShape(c.num_kv_heads, c.head_dim)
                for t in s.layer_types]
    if isinstance(s, Gemma4Spec):
        return [KVShape(s.kv_heads[i], s.head_dims[i], c.layer_window[i])
                if s.kv_source[i] == i else None for i in range(c.num_layers)]
    return [KVShape(c.num_kv_heads, c.head_dim)] * c.num_layers


class HybridCache:
    """One sequence's cache (the `SequenceCache` interface: length, reserve, capacity).
    k[i] / v[i] [K, slots, D] for KVShape layers (slots: capacity, or the ring's
    min(window, capacity)); conv[i] / ssm[i] [1, ...] for StateShape layers; entries of other
    layers are None."""

    def __init__(self, shapes: list[LayerShape], dtype: torch.dtype, device: torch.device,
                 capacity: int = 256):
        self.shapes, self.dtype, self.device = shapes, dtype, device
        self.length, self.capacity = 0, max(1, capacity)
        self._ring_index: tuple = (None, None, None)  # (key, old slots, new slots)
        none = [None] * len(shapes)
        self.k, self.v = self._kv(self.capacity, (none, none))
        self.conv = [torch.zeros((1, *s.conv), dtype=dtype, device=device)
                     if isinstance(s, StateShape) else None for s in shapes]
        self.ssm = [torch.zeros((1, *s.ssm), dtype=torch.float32, device=device)
                    if isinstance(s, StateShape) else None for s in shapes]

    @property
    def pool(self) -> HybridCache:
        """The buffers a captured decode step reads (`GraphDecoder`): the cache itself."""
        return self

    def slots(self, i: int, capacity: int | None = None) -> int:
        """Layer i's K/V slots at `capacity` (the current one by default)."""
        cap = self.capacity if capacity is None else capacity
        w = self.shapes[i].window
        return cap if w is None else min(w, cap)

    def _kv(self, cap: int, old: tuple[list, list]) -> tuple[list, list]:
        """K/V lists for `cap`: a full ring (already min(window, cap) slots) is kept as is."""
        def one(i: int, s: LayerShape, prev: torch.Tensor | None) -> torch.Tensor | None:
            if not isinstance(s, KVShape):
                return None
            n = self.slots(i, cap)
            if prev is not None and prev.shape[1] == n:
                return prev
            return torch.zeros((s.kv_heads, n, s.head_dim), dtype=self.dtype,
                               device=self.device)

        return ([one(i, s, o) for i, (s, o) in enumerate(zip(self.shapes, old[0]))],
                [one(i, s, o) for i, (s, o) in enumerate(zip(self.shapes, old[1]))])

    def copy(self, capacity: int) -> HybridCache:
        """A new cache of `capacity` (>= length) holding this one's positions and states: a
        prefix snapshot (capacity = length: full layers keep exactly the computed positions)
        or a sequence resumed from one."""
        if capacity < self.length:
            raise ValueError(f"a cache of {capacity} positions cannot hold {self.length}")
        out = HybridCache(self.shapes, self.dtype, self.device, max(1, capacity))
        out.length = self.length
        for dst, src in ((out.k, self.k), (out.v, self.v)):
            for d, s in zip(dst, src):
                if d is not None:  # slots [0, m) hold every kept position (a wrapped ring is
                    m = min(self.length, s.shape[1])  # full, window-sized on both sides)
                    d[:, :m] = s[:, :m]
        for dst, src in ((out.conv, self.conv), (out.ssm, self.ssm)):
            for d, s in zip(dst, src):
                if d is not None:
                    d.copy_(s)
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (*self.k, *self.v, *self.conv, *self.ssm) if t is not None)

    def clear_states(self) -> None:
        """Zero the recurrent states (a sequence starting at position 0)."""
        for t in self.conv + self.ssm:
            if t is not None:
                t.zero_()

    def reserve(self, length: int) -> None:
        """Room for `length` positions (K/V grow geometrically, filled slots copied; a ring
        stops at its window)."""
        if length <= self.capacity:
            return
        cap = max(length, 2 * self.capacity)
        k, v = self._kv(cap, (self.k, self.v))
        for new, old in ((k, self.k), (v, self.v)):
            for n, o in zip(new, old):
                if n is not None and n is not o:  # not yet wrapped: slot = position
                    n[:, :self.length] = o[:, :self.length]
        self.k, self.v, self.capacity = k, v, cap

    def extend(self, i: int, k: torch.Tensor, v: torch.Tensor,
               start: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Store layer i's new K/V [K, T, D] at positions [start, +T) (room reserved) and
        return what its queries attend: K/V [K, S, D] of positions [lo, start + T) in order,
        and lo (0, or for a window w the first position the first new query sees)."""
        w, t = self.shapes[i].window, k.shape[1]
        if w is None:
            self.k[i][:, start:start + t] = k
            self.v[i][:, start:start + t] = v
            return self.k[i][:, :start + t], self.v[i][:, :start + t], 0
        n = self.k[i].shape[1]
        lo = max(0, start - w + 1)
        keep = min(t, n)  # a chunk longer than the ring leaves only its last n positions
        old, slots = self._ring_slots(lo, start, t, n)
        if lo == start:  # nothing earlier in view (a prompt's first chunk): the new K/V alone
            keys, values = k, v
        else:
            keys = torch.cat((self.k[i].index_select(1, old), k), 1)
            values = torch.cat((self.v[i].index_select(1, old), v), 1)
        self.k[i].index_copy_(1, slots, k[:, t - keep:])
        self.v[i].index_copy_(1, slots, v[:, t - keep:])
        return keys, values, lo

    def _ring_slots(self, lo: int, start: int, t: int, n: int) -> tuple:
        """Slots of positions [lo, start) (still in the ring: fewer than w back) and of the
        last min(t, n) new positions, in a ring of n; made once per forward (every ring
        layer of a model has the same window)."""
        key = (lo, start, t, n)
        if self._ring_index[0] != key:
            keep = min(t, n)
            self._ring_index = (key, torch.arange(lo, start, device=self.device) % n,
                                torch.arange(start + t - keep, start + t, device=self.device) % n)
        return self._ring_index[1], self._ring_index[2]

    def step_slots(self, pos: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """For a token at position pos [1] (device long, no host value read), per K/V buffer
        length n: (its write slot pos % n, the last slot it sees: clamp(pos, max=n - 1), as
        `attention_at` takes it: every slot of a wrapped ring holds one of the last `window`
        positions, all visible). Two device ops per distinct length, made once per step and
        shared by the layers (a ring's layers all have one length, the full layers another)."""
        lengths = dict.fromkeys(k.shape[1] for k in self.k if k is not None)
        return {n: (torch.remainder(pos, n), torch.clamp(pos, max=n - 1)) for n in lengths}

    def padded_sources(self, last: torch.Tensor, t: int) -> dict[int, torch.Tensor]:
        """For a prompt padded to t rows at positions [0, t) whose last real row is `last` [1]
        (device long, no host value read: the prefill graph), per ring length n: the row each
        of the ring's n slots takes where t > n (`write_padded`). Slot s holds the last real
        position p = last - (last - s) mod n that maps to it, as an unpadded prefill leaves the
        ring; where none does (p < 0: s is past the prompt, which is shorter than the ring),
        pad row s, which no query sees before a decode step overwrites it. That is row s
        itself wherever t <= n (no wrap: no entry, a plain copy); full layers take rows [0, t) as
        they are too (slot = position). Made once per forward, shared by the ring layers."""
        out = {}
        for i, k in enumerate(self.k):
            n = None if k is None else k.shape[1]
            if n is None or self.shapes[i].window is None or n in out or n >= t:
                continue
            s = torch.arange(n, device=self.device)
            p = last - torch.remainder(last - s, n)
            out[n] = torch.where(p >= 0, p, s)
        return out

    def write_padded(self, i: int, k: torch.Tensor, v: torch.Tensor,
                     sources: dict[int, torch.Tensor]) -> None:
        """Store layer i's K/V [K, t, D] of a padded prompt at positions [0, t)
        (`padded_sources`: a ring keeps each slot's last real position, so padding never
        overwrites one, however far the prompt wraps the ring)."""
        rows = sources.get(self.k[i].shape[1]) if self.shapes[i].window is not None else None
        if rows is None:
            self.k[i][:, :k.shape[1]] = k
            self.v[i][:, :v.shape[1]] = v
            return
        self.k[i][:, :rows.shape[0]] = k.index_select(1, rows)
        self.v[i][:, :rows.shape[0]] = v.index_select(1, rows)

    def write_at(self, i: int, k: torch.Tensor, v: torch.Tensor, slot: torch.Tensor) -> None:
        """Store one token's K/V [K, 1, D] in layer i's slot [1] (device long, `step_slots`)."""
        self.k[i].index_copy_(1, slot, k)
        self.v[i].index_copy_(1, slot, v)
