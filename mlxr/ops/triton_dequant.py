"""Triton dequantization of MLX affine 2/4/8-bit weights to a dense matrix (the prefill path:
dequantize once per call into scratch, then a cuBLAS GEMM). Reference: mlxr.quant.dequantize."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, b_ptr, out_ptr, N, K: tl.constexpr, BITS: tl.constexpr,
                    G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """out[n, k] = s[n, k // G] * code(n, k) + b[n, k // G] (fp32, rounded once)."""
    PER: tl.constexpr = 32 // BITS  # codes per 32-bit word
    WORDS: tl.constexpr = K // PER
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    words = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    rmask = rows < N
    wmask = rmask[:, None] & (words[None, :] < WORDS)
    w = tl.load(w_ptr + rows[:, None] * WORDS + words[None, :], mask=wmask, other=0)
    shifts = tl.arange(0, PER) * BITS
    q = (w[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)  # [BN, BW, PER]
    cols = words[:, None] * PER + tl.arange(0, PER)[None, :]  # [BW, PER]
    g = cols // G
    mask = wmask[:, :, None] & (cols[None, :, :] < K)
    sp = rows[:, None, None] * (K // G) + g[None, :, :]
    s = tl.load(s_ptr + sp, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + sp, mask=mask, other=0.0).to(tl.float32)
    out = q.to(tl.float32) * s + b
    tl.store(out_ptr + rows[:, None, None] * K + cols[None, :, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


def dequant_affine(packed: Tensor, scales: Tensor, biases: Tensor, in_features: int, bits: int,
                   group_size: int, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """packed int32 [N, K*bits/32], scales/biases [N, K/G] -> [N, K] in `dtype`."""
    n, k = packed.shape[0], in_features
    out = torch.empty(n, k, dtype=dtype, device=packed.device)
    bn, bw = 16, 32
    grid = (triton.cdiv(n, bn), triton.cdiv(k * bits // 32, bw))
    _dequant_kernel[grid](packed, scales, biases, out, n, K=k, BITS=bits, G=group_size,
                          BLOCK_N=bn, BLOCK_W=bw)
    return out
