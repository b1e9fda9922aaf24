"""The MoE router in one launch: the router GEMV, the scoring, top-k and the weights' scaling
for T <= MAX_TOKENS tokens, writing expert ids [T, k] (int64) and weights [T, k] on the device.

Replaces the router Linear plus `moe.reference.route`'s torch ops (softmax, topk with its sort,
gather, sum, divide: several launches each) at decode. Grid (T, E / BLOCK_E): program (t, b)
computes router rows b*BLOCK_E.. for token t (`decode_rows._rows`: a bf16 / f16 / f32
weight, or affine / fp codes with their group scales; fp32 sums rounded to the router's output
dtype, plus the Linear's bias rounded again, as `Linear` computes y + bias) and stores them as
fp32 in a scratch row [T, E]. The last program of token t to finish (a ticket counter, as
`decode_onepass`; one program per token when BLOCK_E >= E needs none) reads the token's E logits
and runs `reference.route`'s arithmetic for the router kind, in its dtypes:

* softmax_topk (Qwen3-MoE): fp32 softmax (max, exp(l - max), their sum, divided) rounded to the
  logits' dtype; top-k of the rounded gates; norm_topk: w / sum(w), the sum in fp32 rounded to
  the dtype, the quotient rounded.
* topk_softmax (Mixtral, gpt-oss): top-k of the logits, fp32 softmax over those k, rounded.
* sigmoid_topk (Laguna): fp32 scores sigmoid(s) or sqrt(softplus(s)) of the (tanh soft-capped)
  logits; the selection on scores + e_score_correction_bias; weights the scores at the ids over
  their fp32 sum.

Top-k: k rounds of (maximum, lowest index holding it), so ids come in descending value order,
ties to the lowest index; torch.topk (the twin) returns the same set on CUDA for ties at the
boundary (its radix select takes the equal values in index order) but may order tied values
otherwise; on the CPU its tie order is unspecified. On CUDA exp / tanh are libdevice's (CUDA's
expf, as torch's kernels) and divisions and square roots are IEEE-rounded, so from equal logits
the weights equal the twin's but for the softmax sum's fp32 order.

Twin: `moe_router_ref` (the router Linear's arithmetic in fp32, rounded, then
`reference.route`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import decode_experts as D
from . import reference as moe_reference
from .operands import ExpertQuant, linear_stack
from .. import tickets
from ..matmul.codes import HAVE_TRITON
from ..tickets import counters
from ..matmul.generic_qmm import _next_pow2

if HAVE_TRITON:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from .decode_experts import _biased, _expert_gs
    from .decode_rows import _rows
    from ..layer.norm_rope_act import _interpret

ROUTERS = {"softmax_topk": 0, "topk_softmax": 1, "sigmoid_topk": 2}
MAX_TOKENS = 16


def router_quant(weight, bias: Tensor | None = None) -> ExpertQuant | None:
    """A router Linear's weight (and bias) as the one-expert stack the kernel reads
    (`operands.linear_stack`), or None."""
    return linear_stack(weight, bias)


def moe_router_ref(x: Tensor, q: ExpertQuant, router: str, top_k: int, norm_topk: bool = False,
                   softcap: float = 0.0, score_func: str = "sigmoid",
                   correction_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Twin of `moe_router`: logits = x @ W^T in fp32 (the expert stack's one matrix),
    rounded to x.dtype, plus the bias (rounded), then `reference.route`."""
    e0 = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
    logits = D.expert_matmul_ref(x, e0, q, x.dtype)
    return moe_reference.route(logits, router, top_k, norm_topk, softcap, score_func,
                               correction_bias)


if HAVE_TRITON:

    @triton.jit
    def _exp(v, INTERP: tl.constexpr):
        if INTERP:
            r = tl.exp(v)
        else:  # CUDA's expf, as torch's softmax and sigmoid (tl.exp is ex2.approx)
            r = libdevice.exp(v)
        return r

    @triton.jit
    def _tanh(v, INTERP: tl.constexpr):
        if INTERP:
            r = 1.0 - 2.0 / (tl.exp(2.0 * v) + 1.0)
        else:
            r = libdevice.tanh(v)
        return r

    @triton.jit
    def _log1p(v, INTERP: tl.constexpr):
        if INTERP:
            r = tl.log(1.0 + v)
        else:  # CUDA's log1pf, as torch's logaddexp
            r = libdevice.log1p(v)
        return r

    @triton.jit
    def _select(lg_ptr, ids_ptr, w_ptr, cb_ptr, t, E, softcap,
                E_PAD: tl.constexpr, TOPK: tl.constexpr, K_PAD: tl.constexpr,
                ROUTER: tl.constexpr, NORM: tl.constexpr, SCORE: tl.constexpr,
                SOFTCAP: tl.constexpr, HAS_CB: tl.constexpr, DT: tl.constexpr,
                INTERP: tl.constexpr):
        """Token t's ids and weights from its E logits (fp32 holding DT values) at lg_ptr."""
        idx = tl.arange(0, E_PAD)
        emask = idx < E
        lg = tl.load(lg_ptr + idx, mask=emask, other=float("-inf"), cache_modifier=".cg")
        if ROUTER == 0:  # softmax over all E in fp32, rounded; select on the rounded gates
            ex = _exp(lg - tl.max(lg, axis=0), INTERP)
            ex = tl.where(emask, ex, 0.0)
            val = tl.div_rn(ex, tl.sum(ex, axis=0)).to(DT).to(tl.float32)
            sel = tl.where(emask, val, float("-inf"))
        elif ROUTER == 1:  # select on the logits, softmax over the k selected
            val = lg
            sel = lg
        else:
            s = lg
            if SOFTCAP:
                s = _tanh(tl.div_rn(s, softcap), INTERP) * softcap
            if SCORE == 0:  # sigmoid
                val = tl.div_rn(1.0, 1.0 + _exp(-s, INTERP))
            else:  # sqrt(softplus(s)), softplus as logaddexp(s, 0)
                m = tl.maximum(s, 0.0)
                val = tl.sqrt_rn(m + _log1p(_exp(-tl.abs(s), INTERP), INTERP))
            sel = val
            if HAS_CB:
                sel = val + tl.load(cb_ptr + idx, mask=emask, other=0.0).to(tl.float32)
            sel = tl.where(emask, sel, float("-inf"))
        kk = tl.arange(0, K_PAD)
        wv = tl.zeros([K_PAD], dtype=tl.float32)
        iv = tl.zeros([K_PAD], dtype=tl.int64)
        for j in tl.static_range(TOPK):  # the maximum, ties to the lowest index
            best = tl.max(sel, axis=0)
            i = tl.min(tl.where(sel == best, idx, E_PAD), axis=0)
            hit = idx == i
            wv = tl.where(kk == j, tl.sum(tl.where(hit, val, 0.0), axis=0), wv)
            iv = tl.where(kk == j, i.to(tl.int64), iv)
            sel = tl.where(hit, float("-inf"), sel)
        kmask = kk < TOPK
        if ROUTER == 0:
            if NORM:
                tot = tl.sum(tl.where(kmask, wv, 0.0), axis=0).to(DT).to(tl.float32)
                wv = tl.div_rn(wv, tot).to(DT).to(tl.float32)
        elif ROUTER == 1:
            v = tl.where(kmask, wv, float("-inf"))
            ev = tl.where(kmask, _exp(v - tl.max(v, axis=0), INTERP), 0.0)
            wv = tl.div_rn(ev, tl.sum(ev, axis=0)).to(DT).to(tl.float32)
        else:
            wv = tl.div_rn(wv, tl.sum(tl.where(kmask, wv, 0.0), axis=0))
        tl.store(ids_ptr + t * TOPK + kk, iv, mask=kmask)
        tl.store(w_ptr + t * TOPK + kk, wv.to(w_ptr.dtype.element_ty), mask=kmask)

    @triton.jit
    def _router_kernel(
        x_ptr, w_ptr, s_ptr, b_ptr, gs_ptr, bias_ptr, cb_ptr, lg_ptr, ctr_ptr,
        ids_ptr, wout_ptr, E, stride_x, softcap,
        H: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, MODE: tl.constexpr,
        HAS_GS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_CB: tl.constexpr,
        NB: tl.constexpr, E_PAD: tl.constexpr, TOPK: tl.constexpr, K_PAD: tl.constexpr,
        ROUTER: tl.constexpr, NORM: tl.constexpr, SCORE: tl.constexpr,
        SOFTCAP: tl.constexpr, BLOCK_E: tl.constexpr, GT: tl.constexpr,
        INTERP: tl.constexpr,
    ):
        t = tl.program_id(0)
        b = tl.program_id(1)
        rn = b * BLOCK_E + tl.arange(0, BLOCK_E)
        nmask = rn < E
        DT: tl.constexpr = x_ptr.dtype.element_ty
        acc = _rows(x_ptr + t.to(tl.int64) * stride_x, w_ptr, s_ptr, b_ptr,
                    _expert_gs(gs_ptr, 0, HAS_GS), rn, E, H, BITS, GROUP, MODE, BLOCK_E, GT, H)
        lg = _biased(acc, bias_ptr, rn, nmask, HAS_BIAS, DT)
        row = lg_ptr + t.to(tl.int64) * E
        tl.store(row + rn, lg, mask=nmask)
        if NB == 1:
            tl.debug_barrier()
            _select(row, ids_ptr, wout_ptr, cb_ptr, t, E, softcap, E_PAD, TOPK,
                    K_PAD, ROUTER, NORM, SCORE, SOFTCAP, HAS_CB, DT, INTERP)
        else:
            tl.debug_barrier()
            done = tl.atomic_add(ctr_ptr + t, 1, sem="acq_rel", scope="gpu")
            if done == NB - 1:
                _select(row, ids_ptr, wout_ptr, cb_ptr, t, E, softcap, E_PAD, TOPK,
                        K_PAD, ROUTER, NORM, SCORE, SOFTCAP, HAS_CB, DT, INTERP)
                tl.store(ctr_ptr + t, 0)


def default_block(e: int, device: torch.device) -> int:
    """Router rows per program: 4 on CUDA (32 programs per token for 128 experts: the 8-bit
    router's 256 KB read by many SMs), all of them in the interpreter (one program)."""
    if device.type != "cuda":
        return _next_pow2(e)
    return 4


def moe_router(x: Tensor, q: ExpertQuant, router: str, top_k: int, norm_topk: bool = False,
               softcap: float = 0.0, score_func: str = "sigmoid",
               correction_bias: Tensor | None = None, block_e: int | None = None,
               num_warps: int = 4) -> tuple[Tensor, Tensor]:
    """x [T, H] (T <= MAX_TOKENS) through the router q (`router_quant`) -> ids [T, k] int64
    and weights [T, k] (x.dtype for the softmax routers, float32 for sigmoid_topk), as
    `moe_router_ref`. block_e: router rows per program (default `default_block`)."""
    if router not in ROUTERS:
        raise ValueError(f"unknown router {router!r}")
    _, e, h = q.shape
    t = x.shape[0]
    if x.dim() != 2 or x.shape[1] != h or t > MAX_TOKENS or not 0 < top_k <= e:
        raise ValueError(f"moe_router: x {tuple(x.shape)}, {e} experts x {h}, top_k {top_k}")
    x = x.contiguous()
    ids = torch.empty(t, top_k, dtype=torch.long, device=x.device)
    wdt = torch.float32 if router == "sigmoid_topk" else x.dtype
    w = torch.empty(t, top_k, dtype=wdt, device=x.device)
    if t == 0:
        return ids, w
    be = block_e or default_block(e, x.device)
    nb = triton.cdiv(e, be)
    lg = torch.empty(t, e, dtype=torch.float32, device=x.device)
    dummy = D._scales(q)
    b, gs, bias = D._gs_bias(q, dummy)
    cb = dummy if correction_bias is None else correction_bias.contiguous()
    _router_kernel[(t, nb)](
        x, D._words_i32(q.w), D._scales(q), b, gs, bias, cb, lg,
        counters(x.device, tickets.MOE_ROUTER),
        ids, w, e, x.stride(0), float(softcap), H=h, BITS=q.bits, GROUP=q.group,
        MODE=D.KERNEL_MODE[q.mode], HAS_GS=q.global_scale is not None,
        HAS_BIAS=q.bias is not None, HAS_CB=correction_bias is not None, NB=nb,
        E_PAD=_next_pow2(e), TOPK=top_k, K_PAD=_next_pow2(top_k), ROUTER=ROUTERS[router],
        NORM=bool(norm_topk), SCORE=0 if score_func == "sigmoid" else 1,
        SOFTCAP=softcap > 0, BLOCK_E=be, GT=D._gt(h, q.bits, q.group), INTERP=_interpret(),
        num_warps=num_warps)
    return ids, w
