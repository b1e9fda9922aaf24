"""Token embedding rows of an MLX affine-quantized table (2/4/8-bit words as shipped), in one
Triton launch: `QuantWeight.embed` on CUDA.

Why a kernel: the torch composition (gather words, scales and biases; shift and mask the codes;
cast; multiply; add) is ~10 launches. In the single request's decode graph they were 10 of
the 268 kernels per token of Qwen3-0.6B (H200 profile: ~20 us of GPU time plus a launch gap
each, against ~780 us per token).

Values are `QuantWeight.dequant_rows`' bit for bit: with scales in the output dtype mlx's
`R(R(q*s) + b)` (the product rounded to the dtype, then the sum), else `q*s + b` in fp32
rounded once. Scales are bf16 / fp16 and the output bf16 / fp16 (the exact mode's fp32 rows
keep the torch path): q*s is then exact in fp32 (8 + 11 significant bits at most), so an FMA
contraction gives the same fp32 values as separate operations.

ids are trusted: device ids come from our sampler (argmax < V) or from prompts range-checked
on the host (`QuantWeight.embed`). A row outside [0, V) is not read; its output is 0.

The Triton interpreter (TRITON_INTERPRET=1) truncates fp32 -> bf16 casts (`_round` rounds
with integer ops there).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..matmul.generic_qmm import HAVE_TRITON, _interpret

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from ..matmul.weight_tiles import _round

EMBED_BITS = (2, 4, 8)  # widths whose codes never straddle a word
_HALF = (torch.bfloat16, torch.float16)

if HAVE_TRITON:

    @triton.jit
    def _embed_kernel(ids_ptr, w_ptr, s_ptr, b_ptr, out_ptr, V, K: tl.constexpr,
                      BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
                      TWO_ROUND: tl.constexpr, EXACT_ROUND: tl.constexpr):
        """Grid (id, block of K): out[i, k] for BLOCK_K codes of row ids[i]. Words [BW] ->
        codes [BW, PER] (code j of a word at bits j*BITS, little-endian) -> [BLOCK_K] in k
        order; scale and bias gathered per code (the same group's addresses: L1 hits)."""
        PER: tl.constexpr = 32 // BITS
        BW: tl.constexpr = BLOCK_K // PER
        i = tl.program_id(0).to(tl.int64)
        row = tl.load(ids_ptr + i)
        ok = (row >= 0) & (row < V)
        rw = tl.program_id(1) * BW + tl.arange(0, BW)
        wd = tl.load(w_ptr + row * (K // PER) + rw, mask=ok & (rw < K // PER), other=0)
        sh = tl.arange(0, PER) * BITS
        q = tl.reshape((wd[:, None] >> sh[None, :]) & ((1 << BITS) - 1), [BLOCK_K])
        rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        km = ok & (rk < K)
        g = row * (K // GROUP) + rk // GROUP
        s = tl.load(s_ptr + g, mask=km, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + g, mask=km, other=0.0).to(tl.float32)
        DT: tl.constexpr = out_ptr.dtype.element_ty
        if TWO_ROUND:
            ws = _round(q.to(tl.float32) * s, DT, EXACT_ROUND).to(tl.float32)
            out = _round(ws + b, DT, EXACT_ROUND)
        else:
            out = _round(q.to(tl.float32) * s + b, DT, EXACT_ROUND)
        tl.store(out_ptr + i * K + rk, out, mask=rk < K)


def supported(words: Tensor, scales: Tensor, biases: Tensor | None, bits: int, group: int,
              dtype: torch.dtype) -> bool:
    """2/4/8-bit affine words int32 [V, K*bits/32] with bf16 / fp16 scales and biases
    [V, K/group]; bf16 / fp16 output."""
    return (HAVE_TRITON and bits in EMBED_BITS and biases is not None
            and words.dtype in (torch.int32, torch.uint32) and words.dim() == 2
            and scales.shape == biases.shape and scales.dim() == 2
            and scales.shape[0] == words.shape[0]
            and words.shape[1] * 32 == scales.shape[1] * group * bits
            and scales.dtype in _HALF and biases.dtype in _HALF and dtype in _HALF)


def embed_rows(words: Tensor, scales: Tensor, biases: Tensor, ids: Tensor, bits: int,
               group: int, dtype: torch.dtype) -> Tensor:
    """Rows ids [n] (long, on the words' device) of the table -> [n, K] in `dtype`; see the
    module docstring for the values (`embed_rows_ref` is the plain-torch twin)."""
    if not supported(words, scales, biases, bits, group, dtype):
        raise ValueError(f"embed_rows: {bits}-bit g{group} words {tuple(words.shape)} "
                         f"{words.dtype}, scales {tuple(scales.shape)}, {dtype}")
    v, k = scales.shape[0], scales.shape[1] * group
    n = ids.numel()
    out = torch.empty(n, k, dtype=dtype, device=words.device)
    if n == 0:
        return out
    block_k = min(1024, triton.next_power_of_2(k))
    _embed_kernel[(n, triton.cdiv(k, block_k))](
        ids.reshape(-1).to(torch.int64).contiguous(), words.view(torch.int32).contiguous(),
        scales.contiguous(), biases.contiguous(), out, v, K=k, BITS=bits, GROUP=group,
        BLOCK_K=block_k, TWO_ROUND=scales.dtype == dtype, EXACT_ROUND=_interpret(),
        num_warps=4)
    return out


def embed_rows_ref(words: Tensor, scales: Tensor, biases: Tensor, ids: Tensor, bits: int,
                   group: int, dtype: torch.dtype) -> Tensor:
    """Plain torch, `embed_rows`' signature: unpack the gathered rows, then `R(R(q*s) + b)` in
    `dtype` where the scales are in it, else fp32 rounded once."""
    from ...quant.affine import unpack_codes

    idx = ids.reshape(-1).to(torch.int64)
    k = scales.shape[1] * group
    q = unpack_codes(words[idx], bits, k)
    n = q.shape[0]
    wd = dtype if scales.dtype == dtype else torch.float32
    w = q.to(wd).view(n, k // group, group) * scales[idx].to(wd).unsqueeze(-1)
    w = w + biases[idx].to(wd).unsqueeze(-1)
    return w.view(n, k).to(dtype)


__all__ = ["EMBED_BITS", "embed_rows", "embed_rows_ref", "supported"]
