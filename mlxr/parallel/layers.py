"""The layers a sharded decoder adds around its local ones: the all-reduce after a
row-parallel projection (o_proj, down_proj, a MoE block), the vocabulary-parallel embedding
and the gathered LM head. Each wraps the loader's own layer, so the local math is unchanged.
"""

from __future__ import annotations

import torch

from .group import Group


class AllReduced:
    """A layer whose output on each rank is a partial sum (its input columns were split):
    y = sum over ranks of inner(x) [N, E]. Other attributes are the inner layer's (its
    `weight` for `Decoder.quant_weights`, a MoE block's `linears`)."""

    def __init__(self, inner, group: Group):
        self.inner, self.group = inner, group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.inner(x))

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


class GatheredHead:
    """The LM head over this rank's vocabulary rows, gathered: x [N, E] -> logits [N, V]."""

    def __init__(self, inner, group: Group, width: int, vocab: int):
        self.inner, self.group, self.width, self.vocab = inner, group, width, vocab

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather_last(self.inner(x), self.width, self.vocab)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


class VocabEmbedding:
    """The embedding over this rank's rows [start, stop) of the vocabulary: each id's row
    comes from the one rank that holds it (the others add zeros, so the sum is exact)."""

    def __init__(self, inner, group: Group, start: int, stop: int, width: int, vocab: int):
        self.inner, self.group, self.start, self.stop = inner, group, start, stop
        self.as_linear = GatheredHead(inner.as_linear, group, width, vocab)

    @property
    def weight(self):
        return self.inner.weight

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.stop - self.start)
        h = self.inner(torch.where(mine, local, torch.zeros_like(local)))
        return self.group.all_reduce(torch.where(mine[:, None], h, torch.zeros_like(h)))
