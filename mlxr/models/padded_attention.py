"""Decode attention of B sequences whose K/V live in separate per-sequence caches (the hybrid
families' serving step): their visible K/V padded into one batch, one attention for all B
instead of one attention per sequence.

Torch (the CPU path and the spec): `ops.reference.attention` for one query row, in float32 (as
that reference runs on CPU): scores = q k^T * scale, the padding masked out, softmax, times v.
With Triton kernels (CUDA): the padded K/V laid out as a paged cache of one block per sequence
(block b = sequence b, block size = the longest context), read by the serving engine's paged
decode kernel (`ops.kv_attention.paged`), which takes any head width up to 512 (Gemma 4's full
layers). The padding copy reads each sequence's visible K/V once more per layer: a paged layout
of the hybrid caches would avoid it (future work).
"""

from __future__ import annotations

import torch
from torch.nn.utils.rnn import pad_sequence

from .. import ops


def padded_decode_attention(q: torch.Tensor, keys: list[torch.Tensor],
                            values: list[torch.Tensor], scale: float,
                            kernels: bool | None = None) -> torch.Tensor:
    """q [B, H, D]: row b is sequence b's new token, which sees exactly keys[b] / values[b]
    [K, S_b, D] (its visible positions, its own last). Returns [B, H, D] in q's dtype.
    kernels: the paged decode kernel (None: where ops run Triton kernels; True on CPU: the
    Triton interpreter, for tests)."""
    if kernels if kernels is not None else ops.fast_kernels(q.device):
        return _paged_kernel(q, keys, values, scale)
    b, h, d = q.shape
    kh = keys[0].shape[0]
    lens = torch.tensor([k.shape[1] for k in keys], device=q.device)
    # [B, S, K, D], zero past each sequence's S_b
    k = pad_sequence([x.transpose(0, 1) for x in keys], batch_first=True).float()
    v = pad_sequence([x.transpose(0, 1) for x in values], batch_first=True).float()
    qg = q.float().reshape(b, kh, h // kh, d)  # heads of one kv group together, as GQA maps
    scores = torch.einsum("bgrd,bsgd->bgrs", qg * scale, k)
    pad = torch.arange(k.shape[1], device=q.device)[None, :] >= lens[:, None]  # [B, S]
    probs = torch.softmax(scores.masked_fill(pad[:, None, None, :], -torch.inf), dim=-1)
    return torch.einsum("bgrs,bsgd->bgrd", probs, v).reshape(b, h, d).to(q.dtype)


def _paged_kernel(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                  scale: float) -> torch.Tensor:
    """The paged decode kernel over the padded K/V: [K, B*S, D] with sequence b's positions at
    slots [b*S, b*S + S_b), block table [[0], [1], ...], block size S, context lengths S_b."""
    from ..ops.kv_attention.paged import paged_attention

    b = q.shape[0]
    kh, _, d = keys[0].shape

    def flat(xs: list[torch.Tensor]) -> torch.Tensor:  # [B, S, K, D] -> [K, B*S, D]
        x = pad_sequence([t.transpose(0, 1) for t in xs], batch_first=True)
        return x.permute(2, 0, 1, 3).reshape(kh, -1, d)

    s = max(k.shape[1] for k in keys)
    lens = torch.tensor([k.shape[1] for k in keys], dtype=torch.int32).to(q.device)
    tables = torch.arange(b, dtype=torch.int32, device=q.device)[:, None]
    return paged_attention(q, flat(keys), flat(values), tables, lens, s, scale)
