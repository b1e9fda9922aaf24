"""The residual step after a projection, run by the projection kernel's own last program
(its "tail"): `reference.add_rms_norm` (h' = h + y, x = rms_norm(h')) or
`reference.residual_norm` (sandwich norms, Gemma: h' = (h + rms_norm(y)) [* scalar],
x = rms_norm(h')) of the kernel's output y [M, E], without a launch of its own.

The projection's rows are spread over many programs and the norm needs the whole row, so
after storing its rows of y each program takes a ticket from an int32 counter (an integer
atomic, acq_rel at GPU scope, after a CTA barrier: `mlxr.ops.tickets`, region RESIDUAL); the
program that draws the last ticket reads y back (`.cg`: from L2) and runs the residual step
over each row with the rounding points of the standalone kernels
(`add_norm_qkv_rope._add_rms_norm_kernel`, `residual_norm._residual_norm_kernel`), then
resets the counter for the next launch. The norm's sum of squares is one `tl.sum` over the
row in another layout than theirs, so a bf16 output may land one ulp away.

Used by Gemma 4's per-layer-input projection (`residual_gemv.linear_residual_norm`), where
it is measured faster. Hung off the decode GEMVs (q4gemv, q4tc) behind every o_proj and
down it was slower on an H100 (0.53-0.99x, docs/perf.md session 26) and was removed.

`TailArgs` carries the tensors; `launch_args` turns them into a kernel's arguments (TAIL
0 / 1 / 2 a constexpr).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .. import tickets
from .norm_rope_act import HAVE_TRITON, _p2

if HAVE_TRITON:
    import triton
    import triton.language as tl

ADD_NORM, SANDWICH = 1, 2  # TAIL values: add_rms_norm, residual_norm
MAX_E = 16384  # the residual row's length (the last program walks it in CHUNK columns)
CHUNK = 1024


@dataclass(frozen=True)
class TailArgs:
    """The residual step of a GEMV's output y [M, E]: mode ADD_NORM (h' = h + y, x =
    rms_norm(h', weight, eps, offset)) or SANDWICH (h' = (h + rms_norm(y, weight, eps))
    [* scalar], x = rms_norm(h', next_weight, eps) if next_weight). h [M, E] contiguous; the
    outputs h_out, x_out [M, E] (x_out None without a next norm)."""
    mode: int
    h: Tensor
    weight: Tensor
    eps: float
    h_out: Tensor
    x_out: Tensor | None
    offset: float = 0.0
    scalar: Tensor | None = None
    next_weight: Tensor | None = None


def takes(mode: int, h: Tensor, weight: Tensor, scalar: Tensor | None = None,
          next_weight: Tensor | None = None, offset: float = 0.0) -> bool:
    """Whether a tail serves this residual step over h [M, E]: one dtype throughout (the
    standalone kernels' precondition), rows the last program walks."""
    same = all(t.dtype == h.dtype for t in (weight, scalar, next_weight) if t is not None)
    e = h.shape[-1]
    return (same and h.dim() == 2 and h.is_contiguous() and e <= MAX_E
            and weight.shape == (e,) and (scalar is None or scalar.numel() == 1)
            and (next_weight is None or next_weight.shape == (e,))
            and (mode == ADD_NORM or not offset)
            and (mode == SANDWICH or (scalar is None and next_weight is None)))


def new_tail(mode: int, h: Tensor, weight: Tensor, eps: float, offset: float = 0.0,
             scalar: Tensor | None = None, next_weight: Tensor | None = None) -> TailArgs:
    """TailArgs with fresh outputs (x_out where the step has a norm after it)."""
    x_out = torch.empty_like(h) if mode == ADD_NORM or next_weight is not None else None
    return TailArgs(mode, h, weight, eps, torch.empty_like(h), x_out, offset, scalar,
                    next_weight)


def launch_args(tail: TailArgs | None, y: Tensor, device: torch.device) -> dict:
    """The GEMV kernels' tail arguments (dummies pointing at y without a tail)."""
    if tail is None:
        return dict(ctr_ptr=y, th_ptr=y, tw_ptr=y, tsc_ptr=y, tw2_ptr=y, tho_ptr=y, txo_ptr=y,
                    t_eps=0.0, t_off=0.0, TAIL=0, T_CHUNK=1, T_OFFSET=False,
                    T_SCALE=False, T_NEXT=False)
    t = tail
    e = t.h.shape[-1]
    return dict(ctr_ptr=tickets.counters(device, tickets.RESIDUAL), th_ptr=t.h, tw_ptr=t.weight,
                tsc_ptr=t.scalar if t.scalar is not None else t.weight,
                tw2_ptr=t.next_weight if t.next_weight is not None else t.weight,
                tho_ptr=t.h_out, txo_ptr=t.x_out if t.x_out is not None else t.h_out,
                t_eps=float(t.eps), t_off=float(t.offset), TAIL=t.mode,
                T_CHUNK=min(CHUNK, _p2(e)),
                T_OFFSET=bool(t.offset), T_SCALE=t.scalar is not None,
                T_NEXT=t.x_out is not None)


if HAVE_TRITON:

    @triton.jit
    def _sum_sq(src, E, CH: tl.constexpr, CM: tl.constexpr):
        """sum(x^2) / E over a row x at src (fp32 of its dtype's values), in CH-wide chunks."""
        sq = tl.zeros([CH], dtype=tl.float32)
        for c0 in range(0, E, CH):
            cols = c0 + tl.arange(0, CH)
            v = tl.load(src + cols, mask=cols < E, other=0.0, cache_modifier=CM).to(tl.float32)
            sq += v * v
        return tl.sum(sq, axis=0) / E

    @triton.jit
    def _norm_row(src, w_ptr, dst, inv, off, E, CH: tl.constexpr, OFFSET: tl.constexpr):
        """dst = rms_norm's values of the row at src (its statistic inv given): (x * inv)
        rounded, times the weight (+ offset formed in the weight's dtype), rounded."""
        dt = dst.dtype.element_ty
        for c0 in range(0, E, CH):
            cols = c0 + tl.arange(0, CH)
            cm = cols < E
            x = tl.load(src + cols, mask=cm, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + cols, mask=cm, other=0.0)
            if OFFSET:  # gemma's (1 + w)
                w = (w.to(tl.float32) + off).to(w_ptr.dtype.element_ty)
            tl.store(dst + cols, ((x * inv).to(dt).to(tl.float32) * w.to(tl.float32)).to(dt),
                     mask=cm)

    @triton.jit
    def _tail(y_ptr, sy, rows, E, tickets, ctr_ptr, th_ptr, tw_ptr, tsc_ptr, tw2_ptr, tho_ptr,
              txo_ptr, t_eps, t_off, TAIL: tl.constexpr, T_CHUNK: tl.constexpr,
              T_OFFSET: tl.constexpr, T_SCALE: tl.constexpr, T_NEXT: tl.constexpr):
        """Called by every program of a GEMV after it stored its part of y (rows [rows, E],
        row stride sy): the program that draws the last of `tickets` runs the residual step
        over the rows and resets the counter. E: the row length (the GEMV's N). The rows go
        in T_CHUNK-wide chunks (a few registers a thread, so the GEMV's own register budget
        and occupancy do not change), each pass storing what the next reads back (a CTA
        barrier between them): the sum of squares, then h' (stored), then its norm."""
        tl.debug_barrier()
        done = tl.atomic_add(ctr_ptr, 1, sem="acq_rel", scope="gpu")
        if done == tickets - 1:
            dt = tho_ptr.dtype.element_ty
            for r in range(rows):
                yr, hr = y_ptr + r * sy, th_ptr + r * E
                ho, xo = tho_ptr + r * E, txo_ptr + r * E
                if TAIL == 2:  # residual_norm: the statistic of y first
                    inv_y = tl.rsqrt(_sum_sq(yr, E, T_CHUNK, ".cg") + t_eps)
                for c0 in range(0, E, T_CHUNK):  # h' = h + y, or h + rms_norm(y) [* scalar]
                    cols = c0 + tl.arange(0, T_CHUNK)
                    cm = cols < E
                    y = tl.load(yr + cols, mask=cm, other=0.0, cache_modifier=".cg")
                    h = tl.load(hr + cols, mask=cm, other=0.0).to(tl.float32)
                    if TAIL == 1:
                        s = (h + y.to(tl.float32)).to(dt)
                    else:
                        w = tl.load(tw_ptr + cols, mask=cm, other=0.0).to(tl.float32)
                        yn = ((y.to(tl.float32) * inv_y).to(dt).to(tl.float32) * w).to(dt)
                        s = (h + yn.to(tl.float32)).to(dt)
                        if T_SCALE:
                            s = (s.to(tl.float32) * tl.load(tsc_ptr).to(tl.float32)).to(dt)
                    tl.store(ho + cols, s, mask=cm)
                if T_NEXT:
                    tl.debug_barrier()  # this CTA's stores of h' before its threads read them
                    inv = tl.rsqrt(_sum_sq(ho, E, T_CHUNK, "") + t_eps)
                    if TAIL == 1:
                        _norm_row(ho, tw_ptr, xo, inv, t_off, E, T_CHUNK, T_OFFSET)
                    else:
                        _norm_row(ho, tw2_ptr, xo, inv, t_off, E, T_CHUNK, False)
            tl.store(ctr_ptr, 0)
