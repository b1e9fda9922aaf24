"""Single-token decode GEMV with the op before it fused in: y[N] = f(x) @ W[N, K]^T.

Why it exists: batch-1 decode of a small model is launch-bound, not bandwidth-bound (Qwen3-0.6B:
~290 launches per token at ~3 us each against ~80 us of weight bytes; docs/perf.md). This kernel
takes the launch before each projection into its own prologue, so a layer runs 7 launches
instead of 10:

* PRO_NORM: x = rms_norm(h + r) (the residual add and the norm before qkv / gate_up); program 0
  also writes h + r to `h_out` (the new residual stream). Without r: x = rms_norm(h).
* PRO_ACT: x = act(g) * u from the gate_up output [2K] (gate first; before down_proj).
* plain: x [K] as given (o_proj, which follows attention).

The prologue rounds where the unfused ops round (`reference.add_rms_norm`, `gated_act`), so x is
the same bf16 vector they would produce, except that the norm's sum of squares is reduced in
another order (fp32; within rounding of the unfused kernel).

Weights are the MLX affine words as the file stores them (2/4/8-bit, no repack): int32 [N,
K*bits/32], scales/biases [N, K/G]. Each program owns BLOCK_N whole rows and walks K in tiles
of KT (no split-K, so no second launch), with the next tile's words loaded before the current
tile's arithmetic. For a [BLOCK_N, KT*bits/32] word tile, x is read de-interleaved by code
position j (x[t*KT + word*PER + j], a [KT*bits/32] vector in the word tile's column layout), so
code j of every word meets its x without a reshape: dq[n, word] += code_j * x_j, one FMA per
code after the in-place exponent trick (`_code`); then y += s_word * dq + b_word * sum_j x_j,
with each word's group scale and bias gathered per word. The first tile's weights are loaded
before anything that depends on the previous kernel, and with `gdc` (programmatic dependent
launch) before the grid-dependency wait, so that they can stream in while the previous kernel
drains. The result is rounded to x's dtype (as a bf16
matmul would return it), then stored in y's dtype.

Measured on the H200 (benchmarks/gpu_fgemv_sweep.py, docs/perf.md): the first body (codes
expanded to [BLOCK_N, KT/G, G] and reduced per group) was correct but 2-4x slower than tinygemm
at every shape (Qwen3-0.6B qkv 8.1 vs 3.3 us), bound by the reshape and reductions, not the
bytes; this body replaces it. Opt-in (mlxr.models.fused_decode) until it beats tinygemm.

`fgemv_ref` is the plain-torch twin with the same signature (the oracle of the tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from . import reference
from .triton_fused import ACTS, HAVE_TRITON, _interpret, _p2

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .triton_fused import _act

BITS = (2, 4, 8)


@dataclass(frozen=True)
class FgemvConfig:
    """Launch shape: BLOCK_N rows per program, KT codes of K per tile, warps, PDL."""
    block_n: int = 8
    kt: int = 1024
    num_warps: int = 4
    gdc: bool = False

    def label(self) -> str:
        return f"bn{self.block_n}_kt{self.kt}_w{self.num_warps}_g{int(self.gdc)}"


def default_config(n: int, k: int) -> FgemvConfig:
    """About 8K codes per tile (64 per thread at 4 warps), KT the largest power of two <= 2048
    dividing K, and at least ~2 programs per SM where N allows."""
    kt = min(2048, k & -k)
    block_n = max(1, 8192 // kt)
    while block_n > 1 and -(-n // block_n) < 256:
        block_n //= 2
    if _interpret():  # the interpreter runs programs one by one: few, large ones keep CI fast
        block_n = max(block_n, 32)
    return FgemvConfig(block_n=block_n, kt=kt)


def supported(bits: int, group: int, k: int, dtype: torch.dtype) -> bool:
    """Formats and shapes the kernel takes (affine 2/4/8-bit, K a multiple of 32 and of G)."""
    return (bits in BITS and group in (32, 64, 128) and k % max(32, group) == 0
            and dtype in (torch.bfloat16, torch.float16, torch.float32))


# ====================================================================== torch twin (oracle)
def fgemv_ref(w: Tensor, scales: Tensor, biases: Tensor, *, bits: int, group: int, x: Tensor,
              r: Tensor | None = None, norm: Tensor | None = None, eps: float = 0.0,
              offset: float = 0.0, h_out: Tensor | None = None, act: str | None = None,
              out: Tensor | None = None, config: FgemvConfig | None = None) -> Tensor:
    """y [N] = f(x) @ dequant(W)^T; f as the module docstring says. x [K] (or [2K] with act),
    r [K] or None, norm [K] (the RMSNorm weight) or None, h_out [K] receives x + r with a norm.
    `out` [N] (any float dtype) is written and returned when given."""
    from .triton_qmm import dequant_f32

    k = w.shape[1] * 32 // bits
    if act is not None:
        xin = reference.gated_act(x[:k], x[k:], act)
    elif norm is not None:
        s = x if r is None else (x + r).to(x.dtype)
        if h_out is not None:
            h_out.copy_(s)
        xin = reference.rms_norm(s, norm, eps, offset)
    else:
        xin = x
    y = (xin.float() @ dequant_f32(w, scales, biases, None, "affine", bits, group).t()).to(x.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


# ====================================================================== Triton kernel
if HAVE_TRITON:

    @triton.jit
    def _x_at(x_ptr, r_ptr, nw_ptr, h_ptr, k, rstd, offset, write_h, K: tl.constexpr,
              PRO: tl.constexpr, HAS_R: tl.constexpr, HAS_OFFSET: tl.constexpr,
              ACT: tl.constexpr):
        """The prologue's output x at indices k (any shape) as fp32 holding x.dtype values."""
        dt = x_ptr.dtype.element_ty
        v = tl.load(x_ptr + k).to(tl.float32)
        if PRO == 1:  # rms_norm(h + r): the rounding points of reference.add_rms_norm
            if HAS_R:
                v = (v + tl.load(r_ptr + k).to(tl.float32)).to(dt).to(tl.float32)
                tl.store(h_ptr + k, v.to(dt), mask=write_h)
            nw = tl.load(nw_ptr + k)
            if HAS_OFFSET:
                nw = (nw.to(tl.float32) + offset).to(nw_ptr.dtype.element_ty)
            v = ((v * rstd).to(dt).to(tl.float32) * nw.to(tl.float32)).to(dt).to(tl.float32)
        elif PRO == 2:  # act(gate) * up, gate_up = [gate | up]: reference.gated_act's roundings
            u = tl.load(x_ptr + K + k).to(tl.float32)
            v = (_act(v, ACT).to(dt).to(tl.float32) * u).to(dt).to(tl.float32)
        return v

    @triton.jit
    def _code(w, J: tl.constexpr, BITS: tl.constexpr, zero):
        """fp32 value of code J of each word: the field is masked in place and OR'ed with the
        exponent of 2^E (E = 23 - its position), so the float is exactly 2^E + q; one subtraction
        gives q (no int->float conversion, no shift for fields that end below bit 23). This is
        `triton_gemv._value`'s affine single-word case, but `zero`, a run-time 0, keeps the
        exponent in a register, so mask-and-or is one LOP3 (LOP3 takes one immediate; with both
        constants folded the compiler emits two: benchmarks/sass_report.py)."""
        SH: tl.constexpr = J * BITS
        MASK: tl.constexpr = (1 << BITS) - 1
        P: tl.constexpr = SH if SH + BITS <= 23 else SH - 9
        E: tl.constexpr = 23 - P
        src = w if SH + BITS <= 23 else w >> 9
        f = (src & (MASK << P)) | (((127 + E) << 23) + zero)
        return f.to(tl.float32, bitcast=True) - (1 << E)

    @triton.jit
    def _fgemv_kernel(x_ptr, r_ptr, nw_ptr, h_ptr, w_ptr, s_ptr, b_ptr, y_ptr, N, eps, offset,
                      zero, K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                      PRO: tl.constexpr, HAS_R: tl.constexpr, HAS_OFFSET: tl.constexpr,
                      ACT: tl.constexpr, BLOCK_N: tl.constexpr, KT: tl.constexpr,
                      BLOCK_E: tl.constexpr, GDC: tl.constexpr):
        pid = tl.program_id(0)
        PER: tl.constexpr = 32 // BITS  # codes per word
        KW: tl.constexpr = K * BITS // 32  # words per row
        WT: tl.constexpr = KT * BITS // 32  # words per row per tile
        WPG: tl.constexpr = GROUP // PER  # words per group
        NG: tl.constexpr = K // GROUP
        GT: tl.constexpr = KT // GROUP  # groups per tile
        NT: tl.constexpr = K // KT
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < N
        rn64 = rn.to(tl.int64)
        cols = tl.arange(0, WT)  # word of the tile; its codes are x[t*KT + cols*PER + j]
        wrow = w_ptr + rn64[:, None] * KW + cols[None, :]  # [BLOCK_N, WT]
        # each word's group scale / bias, gathered per word ([BLOCK_N, WT], L1-served repeats)
        srow = rn64[:, None] * NG + (cols // WPG)[None, :]
        wm = nmask[:, None]
        # tile 0's weights: independent of the previous kernel, so issued first
        w = tl.load(wrow, mask=wm, other=0)
        s = tl.load(s_ptr + srow, mask=wm, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + srow, mask=wm, other=0.0).to(tl.float32)
        if GDC:
            tl.extra.cuda.gdc_wait()
        rstd = 0.0
        if PRO == 1:  # the norm's statistic over the whole row of h + r
            e = tl.arange(0, BLOCK_E)
            em = e < K
            hv = tl.load(x_ptr + e, mask=em, other=0.0).to(tl.float32)
            if HAS_R:
                hv = (hv + tl.load(r_ptr + e, mask=em, other=0.0).to(tl.float32))
                hv = hv.to(x_ptr.dtype.element_ty).to(tl.float32)
            rstd = tl.rsqrt(tl.sum(hv * hv, axis=0) / K + eps)
        write_h = pid == 0
        acc = tl.zeros([BLOCK_N, WT], dtype=tl.float32)
        for t in tl.static_range(NT):
            if t + 1 < NT:  # the next tile's weights go out before this tile's arithmetic
                wn = tl.load(wrow + (t + 1) * WT, mask=wm, other=0)
                sn = tl.load(s_ptr + srow + (t + 1) * GT, mask=wm, other=0.0).to(tl.float32)
                bn = tl.load(b_ptr + srow + (t + 1) * GT, mask=wm, other=0.0).to(tl.float32)
            # per word: dot(q, x) over its PER codes in the word's own layout (x de-interleaved
            # by code position: no reshape, no layout conversion), then scale and bias once
            dq = tl.zeros([BLOCK_N, WT], dtype=tl.float32)
            xs = tl.zeros([WT], dtype=tl.float32)
            for j in tl.static_range(PER):
                xj = _x_at(x_ptr, r_ptr, nw_ptr, h_ptr, t * KT + cols * PER + j, rstd, offset,
                           write_h, K, PRO, HAS_R, HAS_OFFSET, ACT)  # [WT]
                dq += _code(w, j, BITS, zero) * xj[None, :]
                xs += xj
            acc += s * dq + b * xs[None, :]
            if t + 1 < NT:
                w, s, b = wn, sn, bn
        yv = tl.sum(acc, axis=1).to(x_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rn64, yv, mask=nmask)


def fgemv(w: Tensor, scales: Tensor, biases: Tensor, *, bits: int, group: int, x: Tensor,
          r: Tensor | None = None, norm: Tensor | None = None, eps: float = 0.0,
          offset: float = 0.0, h_out: Tensor | None = None, act: str | None = None,
          out: Tensor | None = None, config: FgemvConfig | None = None) -> Tensor:
    """See `fgemv_ref` (same signature and results, up to fp32 summation order). Vectors are
    1-D and contiguous; with a norm and r, h_out must be given (the new residual stream)."""
    n, kw = w.shape
    k = kw * 32 // bits
    assert supported(bits, group, k, x.dtype), (bits, group, k, x.dtype)
    assert x.is_contiguous() and x.dim() == 1 and x.shape[0] == (2 * k if act else k), x.shape
    assert scales.shape == biases.shape == (n, k // group), (scales.shape, n, k, group)
    if act is not None and norm is not None:
        raise ValueError("fgemv: one prologue at a time (act or norm)")
    pro = 2 if act is not None else (1 if norm is not None else 0)
    has_r = pro == 1 and r is not None
    if has_r:
        assert h_out is not None and r.is_contiguous() and r.shape == (k,), "h_out and r [K]"
    cfg = config or default_config(n, k)
    if k % cfg.kt or cfg.kt % group:
        raise ValueError(f"fgemv: tile {cfg.kt} must divide K={k} and be a multiple of {group}")
    y = out if out is not None else torch.empty(n, dtype=x.dtype, device=x.device)
    gdc = cfg.gdc and not _interpret()
    extra = {"launch_pdl": True} if gdc else {}
    _fgemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, r if has_r else x, norm if pro == 1 else x, h_out if has_r else x, w, scales, biases,
        y, n, float(eps), float(offset), 0, K=k, BITS=bits, GROUP=group, PRO=pro, HAS_R=has_r,
        HAS_OFFSET=bool(offset) and pro == 1, ACT=ACTS[act] if act else 0,
        BLOCK_N=cfg.block_n, KT=cfg.kt, BLOCK_E=_p2(k), GDC=gdc, num_warps=cfg.num_warps,
        **extra)
    return y
