"""Triton twins of the small per-layer ops (`mlxr.ops.reference`): one launch each.

Same signatures and numerics as the reference (the spec): float32 math, results rounded to the
dtype the reference produces, at the same points:

* `rms_norm`: y = (x32 * rsqrt(mean(x32^2) + eps)) rounded to x.dtype, times (weight + offset)
  formed (and rounded) in the weight dtype; the product is rounded to promote(x, weight). Rows
  are [BLOCK_M, BLOCK_E] tiles (a whole row per tile, E <= 16384 in one tile; several short
  rows, e.g. per-head q/k norms, per program). x may be a strided [N, E] or [N, H, D] view
  (last dim contiguous), e.g. q/k straight out of the fused qkv split.
* `rope`: one program per (token, block of heads); rotate-half or interleaved pairs in fp32,
  the unrotated tail copied.
* `gated_act`: act(gate) in fp32 rounded to gate.dtype (as F.silu / F.gelu return it), then
  the product with up in fp32 rounded once more, exactly the two roundings torch makes. gelu_tanh
  uses 0.5x(1 + tanh(z)) = x * sigmoid(2z) (an identity, no tanh intrinsic needed).
The Triton interpreter (TRITON_INTERPRET=1) truncates fp32 -> bf16 casts; CUDA rounds to nearest.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - torch-only installs
    HAVE_TRITON = False

ACTS = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "sigmoid": 3}


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl(device: torch.device) -> bool:
    """Programmatic dependent launch for the single-request decode chain, opt-in (env
    MLXR_PDL=1, read at every call, i.e. when a CUDA graph is captured): the norm, gated-act
    and attention-combine kernels let the next grid launch early
    (`griddepcontrol.launch_dependents`), and `decode_gemv_q4` / `decode_gemv_tc` launch with
    PDL, stream their first weight tile, then wait for that grid (`griddepcontrol.wait`: all
    its writes visible) before touching anything else. Hopper and later, never in the
    interpreter. H200 (docs/perf.md): greedy tokens and logits bit-identical, but decode
    with q4gemv +1.4% (Qwen3-0.6B) / -1% (Llama-8B), with q4tc a tie / -2.2%, so off by
    default."""
    return (device.type == "cuda" and not _interpret() and os.environ.get("MLXR_PDL", "") == "1"
            and _hopper(device.index if device.index is not None else torch.cuda.current_device()))


def _p2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _warps(elems: int) -> int:
    return (1 if elems <= 256 else 2 if elems <= 512 else 4 if elems <= 2048
            else 8 if elems <= 8192 else 16)


if HAVE_TRITON:

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, o_ptr, n_rows, n1, s0, s1, eps, offset,
                         E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                         HAS_OFFSET: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_E)
        cmask = cols < E
        m = (rows < n_rows)[:, None] & cmask[None, :]
        base = (rows // n1).to(tl.int64) * s0 + (rows % n1).to(tl.int64) * s1
        x = tl.load(x_ptr + base[:, None] + cols[None, :], mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0)  # before the reduction's barriers
        r = tl.rsqrt(tl.sum(x * x, axis=1) / E + eps)
        y = (x * r[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
        if HAS_OFFSET:
            w = (w.to(tl.float32) + offset).to(w_ptr.dtype.element_ty)
        out = (y * w.to(tl.float32)[None, :]).to(o_ptr.dtype.element_ty)
        tl.store(o_ptr + rows.to(tl.int64)[:, None] * E + cols[None, :], out, mask=m)

    @triton.jit
    def _rope_kernel(x_ptr, c_ptr, s_ptr, o_ptr, H, sx0, sx1, sc0,
                     R: tl.constexpr, D: tl.constexpr, TRAD: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        i = tl.arange(0, BLOCK_R)
        hm = h < H
        im = i < R
        m = hm[:, None] & im[None, :]
        xrow = x_ptr + t * sx0 + h.to(tl.int64)[:, None] * sx1
        orow = o_ptr + (t * H + h.to(tl.int64)[:, None]) * D
        if TRAD:
            lo = 2 * i
            hi = 2 * i + 1
        else:
            lo = i
            hi = i + R
        x1 = tl.load(xrow + lo[None, :], mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(xrow + hi[None, :], mask=m, other=0.0).to(tl.float32)
        c = tl.load(c_ptr + t * sc0 + i, mask=im, other=0.0)[None, :]
        s = tl.load(s_ptr + t * sc0 + i, mask=im, other=0.0)[None, :]
        tl.store(orow + lo[None, :], (x1 * c - x2 * s).to(o_ptr.dtype.element_ty), mask=m)
        tl.store(orow + hi[None, :], (x1 * s + x2 * c).to(o_ptr.dtype.element_ty), mask=m)
        if BLOCK_P > 0:  # unrotated tail (partial rotary)
            j = 2 * R + tl.arange(0, BLOCK_P)
            pm = hm[:, None] & (j < D)[None, :]
            tl.store(orow + j[None, :], tl.load(xrow + j[None, :], mask=pm), mask=pm)

    @triton.jit
    def _act(g, ACT: tl.constexpr):
        """act(g) in fp32 for g fp32 (ACTS: silu, gelu with exact erf, gelu_tanh, sigmoid)."""
        if ACT == 0:  # silu: x / (1 + exp(-x))
            a = g / (1.0 + tl.exp(-g))
        elif ACT == 1:  # gelu, exact erf
            a = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))
        elif ACT == 2:  # gelu_tanh: 0.5 x (1 + tanh(z)) == x / (1 + exp(-2z))
            z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            a = g / (1.0 + tl.exp(-2.0 * z))
        else:  # sigmoid (qwen3_5's attention output gate)
            a = 1.0 / (1.0 + tl.exp(-g))
        return a

    @triton.jit
    def _gated(g, u, ACT: tl.constexpr, DT: tl.constexpr):
        """act(g) rounded to DT, times u, in fp32 (not rounded): `ops.gated_act`'s arithmetic
        for g, u fp32 holding DT values. Shared by `_gated_act_kernel`, q4gemv's act prologue
        and q4tc's act epilogue, so the three round alike."""
        return _act(g, ACT).to(DT).to(tl.float32) * u

    @triton.jit
    def _gated_act_kernel(g_ptr, u_ptr, o_ptr, sg, su, F, ACT: tl.constexpr,
                          BLOCK: tl.constexpr, TRIGGER: tl.constexpr):
        if TRIGGER:  # the next grid (a PDL-launched GEMV) may start streaming its weights
            tl.extra.cuda.gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = c < F
        g = tl.load(g_ptr + row * sg + c, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * su + c, mask=m, other=0.0).to(tl.float32)
        y = _gated(g, u, ACT, g_ptr.dtype.element_ty)
        tl.store(o_ptr + row * F + c, y.to(o_ptr.dtype.element_ty), mask=m)

# ============================================================================ host wrappers
def rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float = 0.0) -> Tensor:
    e = x.shape[-1]
    if x.stride(-1) != 1 or x.dim() > 3:
        x = x.contiguous()
    if x.dim() == 3:
        n1, s0, s1 = x.shape[1], x.stride(0), x.stride(1)
    elif x.dim() == 2:
        n1, s0, s1 = 1, x.stride(0), 0
    else:
        n1, s0, s1 = 1, e, 0
    n_rows = x.numel() // e if e else 0
    w = weight.contiguous()
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, w.dtype), device=x.device)
    if n_rows == 0:
        return out
    block_e = _p2(e)
    block_m = max(1, min(_p2(n_rows), 4096 // block_e))
    _rms_norm_kernel[(triton.cdiv(n_rows, block_m),)](
        x, w, out, n_rows, n1, s0, s1, float(eps), float(offset), E=e, BLOCK_M=block_m,
        BLOCK_E=block_e, HAS_OFFSET=bool(offset), num_warps=_warps(block_m * block_e))
    return out


def rope(x: Tensor, cos: Tensor, sin: Tensor, traditional: bool) -> Tensor:
    t, h, d = x.shape
    r = cos.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    sc0 = 0 if cos.shape[0] == 1 else cos.stride(0)
    block_r = _p2(r)
    block_h = max(1, min(_p2(h), 2048 // (2 * block_r)))
    p = d - 2 * r
    _rope_kernel[(t, triton.cdiv(h, block_h))](
        x, cos, sin, out, h, x.stride(0), x.stride(1), sc0, R=r, D=d, TRAD=bool(traditional),
        BLOCK_H=block_h, BLOCK_R=block_r, BLOCK_P=_p2(p) if p > 0 else 0,
        num_warps=_warps(block_h * block_r * 2))
    return out


def gated_act(gate: Tensor, up: Tensor, act: str) -> Tensor:
    if act not in ACTS:
        raise ValueError(f"unknown activation {act!r}")
    shape, f = gate.shape, gate.shape[-1]
    if gate.dim() != 2 or gate.stride(-1) != 1:
        gate = gate.reshape(-1, f).contiguous()
    if up.dim() != 2 or up.stride(-1) != 1:
        up = up.reshape(-1, f).contiguous()
    n = gate.shape[0]
    out = torch.empty((n, f), dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    if out.numel():
        block = min(1024, _p2(f))
        _gated_act_kernel[(n, triton.cdiv(f, block))](
            gate, up, out, gate.stride(0), up.stride(0), f, ACT=ACTS[act], BLOCK=block,
            TRIGGER=pdl(out.device), num_warps=_warps(block))
    return out.reshape(shape)


__all__ = ["HAVE_TRITON", "gated_act", "rms_norm",
           "rope"]
