"""The single-sequence cache of the hybrid decoders: per-layer K/V of any head count and width,
and the recurrent states of linear-attention layers.

Unlike `SequenceCache` (one [K, S, D] shape for every layer), a layer here declares what it
keeps: K/V [K, capacity, D] (its own K and D: gemma4's full layers are 512 wide), nothing (a
KV-shared layer reads another layer's), or a conv state [1, W-1, C] and a float32 recurrent
state [1, Hv, Dv, Dk] (a gated DeltaNet layer). Positions [0, length) are filled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVShape:
    """A layer that stores K/V: kv heads and head dim."""

    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class StateShape:
    """A layer with recurrent state: conv [W-1, C] in the compute dtype, ssm [Hv, Dv, Dk]
    float32."""

    conv: tuple[int, int]
    ssm: tuple[int, int, int]


LayerShape = KVShape | StateShape | None


class HybridCache:
    """One sequence's cache (the `SequenceCache` interface: length, reserve, capacity).
    k[i] / v[i] [K, capacity, D] for KVShape layers; conv[i] / ssm[i] [1, ...] for StateShape
    layers; entries of other layers are None."""

    def __init__(self, shapes: list[LayerShape], dtype: torch.dtype, device: torch.device,
                 capacity: int = 256):
        self.shapes, self.dtype, self.device = shapes, dtype, device
        self.length, self.capacity = 0, max(1, capacity)
        self.k, self.v = self._kv(self.capacity)
        self.conv = [torch.zeros((1, *s.conv), dtype=dtype, device=device)
                     if isinstance(s, StateShape) else None for s in shapes]
        self.ssm = [torch.zeros((1, *s.ssm), dtype=torch.float32, device=device)
                    if isinstance(s, StateShape) else None for s in shapes]

    def _kv(self, cap: int) -> tuple[list, list]:
        def one(s: LayerShape) -> torch.Tensor | None:
            if not isinstance(s, KVShape):
                return None
            return torch.zeros((s.kv_heads, cap, s.head_dim), dtype=self.dtype,
                               device=self.device)

        return [one(s) for s in self.shapes], [one(s) for s in self.shapes]

    def clear_states(self) -> None:
        """Zero the recurrent states (a sequence starting at position 0)."""
        for t in self.conv + self.ssm:
            if t is not None:
                t.zero_()

    def reserve(self, length: int) -> None:
        """Room for `length` positions (K/V grow geometrically, filled positions copied)."""
        if length <= self.capacity:
            return
        cap = max(length, 2 * self.capacity)
        k, v = self._kv(cap)
        for new, old in ((k, self.k), (v, self.v)):
            for n, o in zip(new, old):
                if n is not None:
                    n[:, :self.length] = o[:, :self.length]
        self.k, self.v, self.capacity = k, v, cap
