"""The residual step after a decode GEMV, run by the GEMV's own last program (its "tail"):
`reference.add_rms_norm` (pre-norm families: h' = h + y, x = rms_norm(h')) or
`reference.residual_norm` (sandwich norms, Gemma: h' = (h + rms_norm(y)) [* scalar],
x = rms_norm(h')) of the GEMV's output y [M, E], without a launch of its own.

Why: at batch 1 every decode layer ends its attention and its MLP with a projection whose
output only feeds a residual add and a norm: one launch each (~1.2 µs of launch and drain
per kernel in a CUDA graph on the H200, docs/perf.md, plus the norm kernel's own memory
round trips), twice per layer. The GEMV's rows are spread over many programs, and the norm
needs the whole row, so the add cannot ride in each program: after storing its rows of y,
each program takes a ticket from an int32 counter (an integer atomic, acq_rel at GPU scope,
after a CTA barrier: `mlxr.ops.tickets`, region RESIDUAL); the program that
draws the last ticket reads y back (`.cg`: from L2) and runs the residual step over each row
with the rounding points of the standalone kernels (`add_norm_qkv_rope._add_rms_norm_kernel`,
`residual_norm._residual_norm_kernel`), then resets the counter for the next launch. The
norm's sum of squares is one `tl.sum` over the row in another layout than theirs, so a bf16
output may land one ulp away: hence opt-in (`MLXR_GEMV_TAIL=1`).

`TailArgs` carries the tensors; `launch_args` turns them (or None) into the kernels'
arguments, so the GEMV kernels take a tail with one constexpr (TAIL 0 / 1 / 2) and compile
the same code as before without one.
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
MAX_E = 8192  # one program holds a row of the residual stream


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


def takes(mode: int, h: Tensor, e: int, m: int, weight: Tensor, scalar: Tensor | None = None,
          next_weight: Tensor | None = None, offset: float = 0.0) -> bool:
    """Whether a tail serves this residual step: one dtype throughout (the standalone kernels'
    precondition), rows that fit a program."""
    same = all(t.dtype == h.dtype for t in (weight, scalar, next_weight) if t is not None)
    return (same and h.shape == (m, e) and h.is_contiguous() and e <= MAX_E
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
                    t_eps=0.0, t_off=0.0, TAIL=0, T_BLOCK_E=1, T_OFFSET=False,
                    T_SCALE=False, T_NEXT=False)
    t = tail
    e = t.h.shape[-1]
    return dict(ctr_ptr=tickets.counters(device, tickets.RESIDUAL), th_ptr=t.h, tw_ptr=t.weight,
                tsc_ptr=t.scalar if t.scalar is not None else t.weight,
                tw2_ptr=t.next_weight if t.next_weight is not None else t.weight,
                tho_ptr=t.h_out, txo_ptr=t.x_out if t.x_out is not None else t.h_out,
                t_eps=float(t.eps), t_off=float(t.offset), TAIL=t.mode, T_BLOCK_E=_p2(e),
                T_OFFSET=bool(t.offset), T_SCALE=t.scalar is not None,
                T_NEXT=t.x_out is not None)


if HAVE_TRITON:

    @triton.jit
    def _unit(x, eps, E, DT: tl.constexpr):
        """x [BLOCK_E] fp32 (zeros past E) -> x * rsqrt(mean(x^2) + eps) rounded to DT."""
        inv = tl.rsqrt(tl.sum(x * x, axis=0) / E + eps)
        return (x * inv).to(DT).to(tl.float32)

    @triton.jit
    def _tail(y_ptr, sy, rows, E, tickets, ctr_ptr, th_ptr, tw_ptr, tsc_ptr, tw2_ptr, tho_ptr,
              txo_ptr, t_eps, t_off, TAIL: tl.constexpr,
              T_BLOCK_E: tl.constexpr, T_OFFSET: tl.constexpr, T_SCALE: tl.constexpr,
              T_NEXT: tl.constexpr):
        """Called by every program of a GEMV after it stored its part of y (rows [rows, E],
        row stride sy): the program that draws the last of `tickets` runs the residual step
        over the rows and resets the counter. E: the row length (the GEMV's N)."""
        tl.debug_barrier()
        done = tl.atomic_add(ctr_ptr, 1, sem="acq_rel", scope="gpu")
        if done == tickets - 1:
            dt = tho_ptr.dtype.element_ty
            cols = tl.arange(0, T_BLOCK_E)
            cm = cols < E
            w = tl.load(tw_ptr + cols, mask=cm, other=0.0)
            if T_OFFSET:  # gemma's (1 + w), formed in the weight's dtype
                w = (w.to(tl.float32) + t_off).to(tw_ptr.dtype.element_ty)
            w = w.to(tl.float32)
            if T_NEXT:
                w2 = tl.load(tw2_ptr + cols, mask=cm, other=0.0).to(tl.float32)
            for r in range(rows):
                y = tl.load(y_ptr + r * sy + cols, mask=cm, other=0.0,
                            cache_modifier=".cg").to(tl.float32)
                h = tl.load(th_ptr + r * E + cols, mask=cm, other=0.0).to(tl.float32)
                if TAIL == 1:  # add_rms_norm
                    s = (h + y).to(dt)
                    tl.store(tho_ptr + r * E + cols, s, mask=cm)
                    x = (_unit(s.to(tl.float32), t_eps, E, dt) * w).to(dt)
                    tl.store(txo_ptr + r * E + cols, x, mask=cm)
                else:  # residual_norm: h + rms_norm(y) [* scalar], then the next norm
                    s = (h + (_unit(y, t_eps, E, dt) * w).to(dt).to(tl.float32)).to(dt)
                    if T_SCALE:
                        s = (s.to(tl.float32) * tl.load(tsc_ptr).to(tl.float32)).to(dt)
                    tl.store(tho_ptr + r * E + cols, s, mask=cm)
                    if T_NEXT:
                        x = (_unit(s.to(tl.float32), t_eps, E, dt) * w2).to(dt)
                        tl.store(txo_ptr + r * E + cols, x, mask=cm)
            tl.store(ctr_ptr, 0)
