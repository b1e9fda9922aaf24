"""Triton kernel of a sandwich-normed residual (`mlxr.ops.reference.residual_norm` is the spec).

Gemma's layers norm each branch's output before adding it (h + norm(a)), may scale the sum
(Gemma 4's layer scalar) and norm it again for the next branch's input: four launches and
four [N, E] temporaries op by op, one launch and the two outputs here. Rounding points as the
ops: y = (a32 * rsqrt(mean(a32^2) + eps)) rounded, y * weight rounded, h + that rounded,
times the scalar rounded, then `rms_norm` of the result (rounded the same way). One program
per [BLOCK_M, BLOCK_E] tile of whole rows. Every tensor shares one dtype (the wrapper in
`mlxr.ops` composes the reference ops otherwise).

The Triton interpreter (TRITON_INTERPRET=1) truncates fp32 -> bf16 casts; CUDA rounds to nearest.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .norm_rope_act import _p2, _warps


@triton.jit
def _unit_rms(x, eps, E: tl.constexpr, DT: tl.constexpr):
    """x [BLOCK_M, BLOCK_E] fp32 (zeros past E) -> x * rsqrt(mean(x^2) + eps) rounded to DT,
    back in fp32 (rms_norm's first rounding point)."""
    inv = tl.rsqrt(tl.sum(x * x, axis=1) / E + eps)
    return (x * inv[:, None]).to(DT).to(tl.float32)


@triton.jit
def _residual_norm_kernel(h_ptr, a_ptr, w_ptr, s_ptr, w2_ptr, ho_ptr, xo_ptr, n_rows, eps,
                          E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                          HAS_SCALE: tl.constexpr, HAS_NEXT: tl.constexpr):
    dt = ho_ptr.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_E)
    cmask = cols < E
    m = (rows < n_rows)[:, None] & cmask[None, :]
    off = rows.to(tl.int64)[:, None] * E + cols[None, :]
    a = tl.load(a_ptr + off, mask=m, other=0.0).to(tl.float32)
    h = tl.load(h_ptr + off, mask=m, other=0.0).to(tl.float32)
    # weights go out with the rows: a load after the reduction's barriers costs a round trip
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    if HAS_NEXT:
        w2 = tl.load(w2_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    y = (_unit_rms(a, eps, E, dt) * w[None, :]).to(dt).to(tl.float32)
    h = (h + y).to(dt).to(tl.float32)
    if HAS_SCALE:
        h = (h * tl.load(s_ptr).to(tl.float32)).to(dt).to(tl.float32)
    tl.store(ho_ptr + off, h.to(dt), mask=m)
    if HAS_NEXT:
        x = (_unit_rms(h, eps, E, dt) * w2[None, :]).to(dt)
        tl.store(xo_ptr + off, x, mask=m)


def supported(h: Tensor, a: Tensor, weight: Tensor, scalar: Tensor | None,
              next_weight: Tensor | None) -> bool:
    """One dtype throughout, h / a the same shape, the scalar one element, weights [E]."""
    e = h.shape[-1]
    same = all(t.dtype == h.dtype for t in (a, weight, scalar, next_weight) if t is not None)
    return (same and a.shape == h.shape and weight.shape == (e,)
            and (scalar is None or scalar.numel() == 1)
            and (next_weight is None or next_weight.shape == (e,)))


def residual_norm(h: Tensor, a: Tensor, weight: Tensor, eps: float,
                  scalar: Tensor | None = None,
                  next_weight: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """(h + rms_norm(a, weight)) [* scalar] -> h' [..., E], and rms_norm(h', next_weight) (None
    without next_weight); see the module doc. Takes what `supported` accepts."""
    e = h.shape[-1]
    # rows [N, E]: a layer's activations already are (no view ops on the host path then)
    h2 = h if h.dim() == 2 and h.is_contiguous() else h.reshape(-1, e).contiguous()
    a2 = a if a.dim() == 2 and a.is_contiguous() else a.reshape(-1, e).contiguous()
    n_rows = h2.shape[0]
    ho = torch.empty(h2.shape, dtype=h.dtype, device=h.device)
    xo = torch.empty(h2.shape, dtype=h.dtype, device=h.device) if next_weight is not None else None
    if n_rows:
        block_e = _p2(e)
        block_m = max(1, min(_p2(n_rows), 4096 // block_e))
        _residual_norm_kernel[(triton.cdiv(n_rows, block_m),)](
            h2, a2, weight.contiguous(), scalar if scalar is not None else weight,
            next_weight.contiguous() if next_weight is not None else weight, ho,
            xo if xo is not None else ho, n_rows, float(eps), E=e, BLOCK_M=block_m,
            BLOCK_E=block_e, HAS_SCALE=scalar is not None, HAS_NEXT=next_weight is not None,
            num_warps=_warps(block_m * block_e))
    if h2 is not h:
        ho, xo = ho.view(h.shape), None if xo is None else xo.view(h.shape)
    return ho, xo
