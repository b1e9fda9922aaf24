"""The residual step after a projection, run by the projection kernel's own last program
(its "tail"): `reference.residual_norm` (sandwich norms, Gemma: h' = (h + rms_norm(y))
[* scalar], x = rms_norm(h') with the next norm's weight) of the kernel's output y [M, E],
without a launch of its own.

The projection's rows are spread over many programs and the norm needs the whole row, so
after storing its rows of y each program takes a ticket from an int32 counter (an integer
atomic, acq_rel at GPU scope, after a CTA barrier: `mlxr.ops.tickets`, region RESIDUAL); the
program that draws the last ticket reads y back (`.cg`: from L2) and runs the residual step
over each row with the rounding points of the standalone kernel
(`residual_norm._residual_norm_kernel`), then
resets the counter for the next launch. The norm's sum of squares is one `tl.sum` over the
row in another layout than theirs, so a bf16 output may land one ulp away.

Used by Gemma 4's per-layer-input projection (`residual_gemv.linear_residual_norm`), where
it is measured faster. Hung off the decode GEMVs (q4gemv, q4tc) behind every o_proj and
down it was slower on an H100 (0.53-0.99x, docs/perf.md session 26) and was removed.

`launch_args` gives a kernel the step's arguments, `_tail` is what its programs call.
"""

from __future__ import annotations

from torch import Tensor

from .. import tickets
from .norm_rope_act import HAVE_TRITON, _p2

if HAVE_TRITON:
    import triton
    import triton.language as tl

CHUNK = 1024  # columns the last program walks at a time


def launch_args(h: Tensor, weight: Tensor, eps: float, scalar: Tensor | None,
                next_weight: Tensor | None, h_out: Tensor, x_out: Tensor | None) -> dict:
    """`_tail`'s arguments for the step over h [M, E] (contiguous, one dtype with the
    weights): h' to h_out, its next norm to x_out (None: no next norm)."""
    return dict(ctr_ptr=tickets.counters(h.device, tickets.RESIDUAL), th_ptr=h, tw_ptr=weight,
                tsc_ptr=scalar if scalar is not None else weight,
                tw2_ptr=next_weight if next_weight is not None else weight,
                tho_ptr=h_out, txo_ptr=x_out if x_out is not None else h_out,
                t_eps=float(eps), T_CHUNK=min(CHUNK, _p2(h.shape[-1])),
                T_SCALE=scalar is not None, T_NEXT=x_out is not None)


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
    def _tail(y_ptr, sy, rows, E, tickets, ctr_ptr, th_ptr, tw_ptr, tsc_ptr, tw2_ptr, tho_ptr,
              txo_ptr, t_eps, T_CHUNK: tl.constexpr, T_SCALE: tl.constexpr,
              T_NEXT: tl.constexpr):
        """Called by every program of a projection after it stored its part of y (rows
        [rows, E], row stride sy): the program that draws the last of `tickets` runs the
        residual step over the rows and resets the counter. The rows go in T_CHUNK-wide
        chunks (a few registers a thread, so the kernel's own register budget and occupancy
        do not change), each pass storing what the next reads back (a CTA barrier between
        them): the statistic of y, then h' (stored), then its norm."""
        tl.debug_barrier()
        done = tl.atomic_add(ctr_ptr, 1, sem="acq_rel", scope="gpu")
        if done == tickets - 1:
            dt = tho_ptr.dtype.element_ty
            for r in range(rows):
                yr, hr = y_ptr + r * sy, th_ptr + r * E
                ho, xo = tho_ptr + r * E, txo_ptr + r * E
                inv_y = tl.rsqrt(_sum_sq(yr, E, T_CHUNK, ".cg") + t_eps)
                for c0 in range(0, E, T_CHUNK):  # h' = h + rms_norm(y) [* scalar]
                    cols = c0 + tl.arange(0, T_CHUNK)
                    cm = cols < E
                    y = tl.load(yr + cols, mask=cm, other=0.0, cache_modifier=".cg")
                    h = tl.load(hr + cols, mask=cm, other=0.0).to(tl.float32)
                    w = tl.load(tw_ptr + cols, mask=cm, other=0.0).to(tl.float32)
                    yn = ((y.to(tl.float32) * inv_y).to(dt).to(tl.float32) * w).to(dt)
                    s = (h + yn.to(tl.float32)).to(dt)
                    if T_SCALE:
                        s = (s.to(tl.float32) * tl.load(tsc_ptr).to(tl.float32)).to(dt)
                    tl.store(ho + cols, s, mask=cm)
                if T_NEXT:  # rms_norm(h', next weight): (h' * inv) rounded, times w, rounded
                    tl.debug_barrier()  # this CTA's stores of h' before its threads read them
                    inv = tl.rsqrt(_sum_sq(ho, E, T_CHUNK, "") + t_eps)
                    for c0 in range(0, E, T_CHUNK):
                        cols = c0 + tl.arange(0, T_CHUNK)
                        cm = cols < E
                        x = tl.load(ho + cols, mask=cm, other=0.0).to(tl.float32)
                        w2 = tl.load(tw2_ptr + cols, mask=cm, other=0.0).to(tl.float32)
                        tl.store(xo + cols, ((x * inv).to(dt).to(tl.float32) * w2).to(dt),
                                 mask=cm)
            tl.store(ctr_ptr, 0)
