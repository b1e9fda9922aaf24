"""Contiguous per-sequence KV cache (one sequence; the paged pool for serving builds on it).

Layout per layer: k, v [K, capacity, D] (head-major, so attention reads [K, S, D] views without
copying). Sliding-window layers keep all positions; attention reads only the window's slice.
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys/values of all layers for one sequence, grown geometrically as tokens arrive."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", capacity: int = 256):
        self.shape = (num_kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.k = [self._alloc(capacity) for _ in range(num_layers)]
        self.v = [self._alloc(capacity) for _ in range(num_layers)]
        self.length = 0  # positions [0, length) are filled in every layer

    def _alloc(self, cap: int) -> torch.Tensor:
        k, d = self.shape
        return torch.empty((k, cap, d), dtype=self.dtype, device=self.device)

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]

    def reserve(self, length: int) -> None:
        """Make room for `length` positions in every layer."""
        if length <= self.capacity:
            return
        cap = max(length, 2 * self.capacity)
        for buf in (self.k, self.v):
            for i, old in enumerate(buf):
                new = self._alloc(cap)
                new[:, : self.length] = old[:, : self.length]
                buf[i] = new

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        """Store k/v [T, K, D] at positions [start, start+T); return views [K, start+T, D]."""
        end = start + k.shape[0]
        self.k[layer][:, start:end] = k.transpose(0, 1)
        self.v[layer][:, start:end] = v.transpose(0, 1)
        return self.k[layer][:, :end], self.v[layer][:, :end]

    def truncate(self, length: int) -> None:
        """Forget positions >= length (e.g. to reuse a shared prompt prefix)."""
        self.length = min(self.length, length)
