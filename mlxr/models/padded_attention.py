"""Decode attention of B sequences whose K/V live in separate per-sequence caches (the hybrid
families' serving step): their visible K/V padded into one batch, one masked attention for all
B instead of one attention per sequence.

The math is `ops.reference.attention` for one query row, in float32 (as that reference runs on
CPU): scores = q k^T * scale, the padding masked out, softmax, times v. The padding copy reads
each sequence's visible K/V once more per layer: a paged layout would avoid it (future work).
"""

from __future__ import annotations

import torch
from torch.nn.utils.rnn import pad_sequence


def padded_decode_attention(q: torch.Tensor, keys: list[torch.Tensor],
                            values: list[torch.Tensor], scale: float) -> torch.Tensor:
    """q [B, H, D]: row b is sequence b's new token, which sees exactly keys[b] / values[b]
    [K, S_b, D] (its visible positions, its own last). Returns [B, H, D] in q's dtype."""
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
