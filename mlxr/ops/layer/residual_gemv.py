"""Triton kernels of a decode GEMV joined to the sandwich-normed residual around it
(`mlxr.ops.reference.residual_linear_act` and `linear_residual_norm` are the specs).

Why: Gemma 4's per-layer-input branch runs, per layer and token, a residual norm, a small
GEMV (per_layer_input_gate, 256 x 1536 on E2B), the gated activation times the token's
per-layer input, a second small GEMV (per_layer_projection, 1536 x 256) and a residual norm
again: five launches whose weights take ~0.2 MB each, so the decode step is launch-bound
there. Here the branch takes two launches:

* `residual_linear_act`: h' = h + rms_norm(a, w), then g = act(h' @ W^T) * up. Grid (row
  tiles of W, tokens). Every program recomputes h' for its token (E values: the statistic is
  cheap next to a launch), writes it to h_out (all programs of a token write the same bytes),
  and after a CTA barrier reads it back as the GEMV's x; the GEMV is the MoE decode kernels'
  `decode_rows._rows` (every format they read), its sums rounded where `linear` rounds, and
  the activation `norm_rope_act._gated`'s (the rounding of `ops.gated_act`).
* `linear_residual_norm`: y = x @ W^T rounded, then (h + rms_norm(y, w)) [* scalar] and its
  norm for the next branch. Grid (row tiles of W, tokens); each program stores its rows of y,
  then runs the residual tail (`residual_tail._tail`, a counter per token): the
  program that draws the token's last ticket runs the residual step over its row of y.

Values equal the composed ops but for the GEMV's fp32 summation order (by groups of the
format, then across groups), so a bf16 output may differ from the composition's in its last
bit. On by default since the H100 measured it (1.08-1.15x on the branch, +2.3% Gemma-4-E2B
decode; `MLXR_GEMMA4_PLE_FUSED=0` restores the composed ops). For decode only (<= MAX_ROWS
tokens: every program re-reads its weight rows per token).

The Triton interpreter (TRITON_INTERPRET=1) truncates fp32 -> bf16 casts; CUDA rounds to nearest.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..moe import decode_experts as D
from .. import tickets
from ..moe.decode_rows import _rows
from ..moe.operands import ExpertQuant, kernels_take, linear_stack
from .norm_rope_act import ACTS, _gated, _p2
from . import residual_tail
from .residual_norm import _unit_rms
from .residual_tail import _tail

MAX_ROWS = 4  # tokens per call: measured faster at 1 and 4 (1.15x, 1.08x on an H100,
# shrinking with rows: each program re-reads its weight rows per token); more: composed ops
MAX_E = 8192  # the residual row is held in registers by one program


@triton.jit
def _residual_row(h_ptr, a_ptr, nw_ptr, off, cols, cmask, eps, E: tl.constexpr):
    """h + rms_norm(a, w) of one row [1, BLOCK_E] (fp32 holding dtype values):
    `_residual_norm_kernel`'s rounding points."""
    dt = h_ptr.dtype.element_ty
    m = cmask[None, :]
    a = tl.load(a_ptr + off + cols[None, :], mask=m, other=0.0).to(tl.float32)
    h = tl.load(h_ptr + off + cols[None, :], mask=m, other=0.0).to(tl.float32)
    w = tl.load(nw_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    y = (_unit_rms(a, eps, E, dt) * w[None, :]).to(dt).to(tl.float32)
    return (h + y).to(dt).to(tl.float32)


@triton.jit
def _residual_linear_act_kernel(h_ptr, a_ptr, nw_ptr, ho_ptr, w_ptr, s_ptr, b_ptr, gs_ptr,
                                u_ptr, g_ptr, N, su, eps, E: tl.constexpr,
                                BLOCK_E: tl.constexpr, BITS: tl.constexpr,
                                GROUP: tl.constexpr, MODE: tl.constexpr, HAS_GS: tl.constexpr,
                                BLOCK_N: tl.constexpr, GT: tl.constexpr, ACT: tl.constexpr):
    r = tl.program_id(1).to(tl.int64)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    dt = ho_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_E)
    cmask = cols < E
    hn = _residual_row(h_ptr, a_ptr, nw_ptr, r * E, cols, cmask, eps, E)
    # every program of the token stores the same h'; the barrier makes this CTA's stores
    # visible to its own threads before the GEMV reads them back in its own layout
    tl.store(ho_ptr + r * E + cols[None, :], hn.to(dt), mask=cmask[None, :])
    tl.debug_barrier()
    acc = _rows(ho_ptr + r * E, w_ptr, s_ptr, b_ptr, D._expert_gs(gs_ptr, 0, HAS_GS), rn, N, E,
                BITS, GROUP, MODE, BLOCK_N, GT, E)
    y = acc.to(dt).to(tl.float32)
    u = tl.load(u_ptr + r * su + rn, mask=nmask, other=0.0).to(tl.float32)
    tl.store(g_ptr + r * N + rn, _gated(y, u, ACT, dt).to(dt), mask=nmask)


@triton.jit
def _linear_residual_norm_kernel(x_ptr, w_ptr, s_ptr, b_ptr, gs_ptr, y_ptr, sx,
                                 K: tl.constexpr, E: tl.constexpr, BITS: tl.constexpr,
                                 GROUP: tl.constexpr, MODE: tl.constexpr,
                                 HAS_GS: tl.constexpr, BLOCK_N: tl.constexpr,
                                 GT: tl.constexpr, TICKETS: tl.constexpr, ctr_ptr, th_ptr,
                                 tw_ptr, tsc_ptr, tw2_ptr, tho_ptr, txo_ptr, t_eps,
                                 T_CHUNK: tl.constexpr, T_SCALE: tl.constexpr,
                                 T_NEXT: tl.constexpr):
    """Rows rn of y = x @ W^T for token r, then the residual step
    (`residual_tail._tail`, a counter per token) by the token's last program."""
    r = tl.program_id(1).to(tl.int64)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = _rows(x_ptr + r * sx, w_ptr, s_ptr, b_ptr, D._expert_gs(gs_ptr, 0, HAS_GS), rn, E, K,
                BITS, GROUP, MODE, BLOCK_N, GT, K)
    tl.store(y_ptr + r * E + rn, acc.to(y_ptr.dtype.element_ty), mask=rn < E)
    _tail(y_ptr + r * E, E, 1, E, TICKETS, ctr_ptr + r, th_ptr + r * E, tw_ptr, tsc_ptr,
          tw2_ptr, tho_ptr + r * E, txo_ptr + r * E, t_eps, T_CHUNK, T_SCALE, T_NEXT)


# ====================================================================== host wrappers
def _stack(linear, k: int, n: int) -> ExpertQuant | None:
    """The Linear's weight as `decode_rows._rows` reads it ([1, N, K] one-expert stack), or
    None (a bias, dropped words, a format the kernels do not read, another shape)."""
    if getattr(linear, "bias", None) is not None:
        return None
    q = getattr(linear, "_rows_stack", False)
    if q is False:  # views of the weight, made once (a decode step would redo six per call)
        q = linear_stack(getattr(linear, "weight", None))
        try:
            linear._rows_stack = q
        except AttributeError:
            pass
    if q is None or not kernels_take(q) or q.shape != (1, n, k):
        return None
    return q


def _block_n(n: int, tokens: int) -> int:
    """Rows per program: about 2 programs per SM over the tokens' grid, 2..16 rows."""
    return max(2, min(16, _p2(max(1, n * tokens // 264))))


def takes(rows: int, e: int, dtype: torch.dtype, *tensors: Tensor | None) -> bool:
    """Decode-sized inputs of one dtype whose residual row fits one program."""
    return (0 < rows <= MAX_ROWS and e <= MAX_E and dtype in (torch.bfloat16, torch.float16,
                                                              torch.float32)
            and all(t is None or t.dtype == dtype for t in tensors))


def _args(q: ExpertQuant) -> tuple:
    b, gs, _ = D._gs_bias(q, D._scales(q))
    return D._words_i32(q.w), D._scales(q), b, gs


def residual_linear_act(h: Tensor, a: Tensor, weight: Tensor, eps: float, linear,
                        up: Tensor, act: str) -> tuple[Tensor, Tensor] | None:
    """(h', act(linear(h')) * up) for h' = h + rms_norm(a, weight): h, a [M, E], up [M, N]
    (rows may be strided), in one launch; None where the kernel does not take the inputs."""
    m, e = h.shape
    n = up.shape[-1]
    q = _stack(linear, e, n)
    if (q is None or act not in ACTS or a.shape != h.shape or up.shape != (m, n)
            or weight.shape != (e,) or up.stride(-1) != 1
            or not takes(m, e, h.dtype, a, weight, up)):
        return None
    h, a = h.contiguous(), a.contiguous()
    ho = torch.empty_like(h)
    g = torch.empty((m, n), dtype=h.dtype, device=h.device)
    bn = _block_n(n, m)
    w, s, b, gs = _args(q)
    _residual_linear_act_kernel[(triton.cdiv(n, bn), m)](
        h, a, weight.contiguous(), ho, w, s, b, gs, up, g, n, up.stride(0), float(eps), E=e,
        BLOCK_E=_p2(e), BITS=q.bits, GROUP=q.group, MODE=D.KERNEL_MODE[q.mode],
        HAS_GS=q.global_scale is not None, BLOCK_N=bn, GT=D._gt(e, q.bits, q.group),
        ACT=ACTS[act], num_warps=4)
    return ho, g


def linear_residual_norm(x: Tensor, linear, h: Tensor, weight: Tensor, eps: float,
                         scalar: Tensor | None = None, next_weight: Tensor | None = None
                         ) -> tuple[Tensor, Tensor | None] | None:
    """residual_norm(h, linear(x), weight, eps, scalar, next_weight) for x [M, K], h [M, E] in
    one launch; None where the kernel does not take the inputs."""
    m, e = h.shape
    k = x.shape[-1]
    q = _stack(linear, k, e)
    if (q is None or x.shape[0] != m or x.stride(-1) != 1 or weight.shape != (e,)
            or (scalar is not None and scalar.numel() != 1)
            or (next_weight is not None and next_weight.shape != (e,))
            or not takes(m, e, h.dtype, x, weight, scalar, next_weight)):
        return None
    if m > tickets.REGION:
        return None
    bn = _block_n(e, m)
    tiles = triton.cdiv(e, bn)
    h = h.contiguous()
    ho = torch.empty_like(h)
    xo = torch.empty_like(h) if next_weight is not None else None
    y = torch.empty_like(h)
    w, s, b, gs = _args(q)
    _linear_residual_norm_kernel[(tiles, m)](
        x, w, s, b, gs, y, x.stride(0), K=k, E=e, BITS=q.bits, GROUP=q.group,
        MODE=D.KERNEL_MODE[q.mode], HAS_GS=q.global_scale is not None, BLOCK_N=bn,
        GT=D._gt(k, q.bits, q.group), TICKETS=tiles,
        **residual_tail.launch_args(h, weight.contiguous(), eps, scalar, next_weight, ho, xo),
        num_warps=4)
    return ho, xo
