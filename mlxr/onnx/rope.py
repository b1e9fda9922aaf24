"""RoPE from the graph's own cos/sin caches: exports precompute them (with whatever scaling
the exporter applied), so the decoder reads those tables instead of recomputing frequencies."""

from __future__ import annotations

import torch

from ..config import RopeSpec
from ..layers import Rope


class TableRope(Rope):
    """cos/sin [positions, dims/2] float32 from the graph; positions past the table (never
    reached through `mlxr.load`, whose context is the table's length) use the frequencies of
    the table's position-1 row."""

    def __init__(self, spec: RopeSpec, cos: torch.Tensor, sin: torch.Tensor,
                 device: torch.device):
        super().__init__(spec, device)
        self.scale = 1.0  # any magnitude the exporter folded in is in the table itself
        self._inv = torch.atan2(sin[1], cos[1]) if cos.shape[0] > 1 else self._inv
        self._graph_rows = cos.shape[0]
        self._table = (cos.float().to(device), sin.float().to(device))

    def cos_sin(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        end = start + length
        if end > self._table[0].shape[0]:
            ang = self._angles(self._inv, self._graph_rows, max(end, 2 * self._graph_rows))
            cos, sin = self._table
            self._table = (torch.cat([cos[:self._graph_rows], ang.cos().to(self.device)]),
                           torch.cat([sin[:self._graph_rows], ang.sin().to(self.device)]))
        cos, sin = self._table
        return cos[start:end], sin[start:end]
