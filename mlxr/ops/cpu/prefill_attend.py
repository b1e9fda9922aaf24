"""Causal attention of a whole prompt on the CPU in the cache's bf16, through torch's flash
kernel (`is_causal=True`: no mask tensor, the blocks above the diagonal skipped).

The reference (`ops.reference.attention`) widens q/K/V to float32 and passes a bool [T, S]
mask: on this session's dev box (AVX-512 BF16 / AMX) a 0.6B layer at 512 tokens takes ~16 ms
that way against ~4.6 ms here (docs/perf.md, "Session 21: CPU prefill attention"). torch's
bf16 flash kernel rounds the probabilities to bf16 before P . V, so ~40 % of the outputs land
one bf16 step from the reference's: it runs only where `native.prefill_attend_enabled` says
(by default in layers whose matmuls run mlxr's kernels, whose sums already differ), never in
the float32 exact mode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def takes(q: Tensor, q_start: int, k_start: int, s: int, window, softcap, sinks) -> bool:
    """Whether `attention` below computes what `reference.attention` would for these
    arguments (up to bf16 rounding): a whole prompt from position 0 (q [T, H, D] with T > 1
    against its own T keys), bf16, no window, soft-cap or sinks."""
    t = q.shape[0]
    return (q.device.type == "cpu" and q.dtype == torch.bfloat16 and q_start == k_start == 0
            and t == s and t > 1 and window is None and softcap is None and sinks is None)


def attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """q [T, H, D], k/v [K, T, D] (bf16, key j at position j) -> [T, H, D] bf16: causal GQA
    attention (head h reads kv head h // (H / K))."""
    h, kh = q.shape[1], k.shape[0]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None],
                                         is_causal=True, scale=scale, enable_gqa=h != kh)[0]
    return out.transpose(0, 1)
