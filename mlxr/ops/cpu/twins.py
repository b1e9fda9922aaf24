"""Plain-torch twins of `native`'s and `fused`'s kernels: the same signatures and the same
arithmetic in torch ops (`native`'s: float32 throughout, one rounding at the end; `fused`'s: the
lean decode step's torch path itself, which they reproduce bit for bit). They are the tests'
oracle and what runs where the extension was not built."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from mlxr.quant.affine import unpack_codes
from mlxr.quant.fp import E2M1, E4M3, E8M0


def qmm(x: Tensor, words: Tensor, scales: Tensor, biases: Tensor | None, mode: str, bits: int,
        group: int, global_mul: float, out_dtype: torch.dtype) -> Tensor:
    """`native.qmm` in torch: per group s * (x . q) + b * sum(x), summed over groups."""
    m, k = x.shape
    n = words.shape[0]
    w32 = words.contiguous().view(torch.uint8).view(n, -1).view(torch.int32)
    q = unpack_codes(w32, bits, k).to(torch.int64)  # [N, K]
    if mode == "affine":
        v = q.to(torch.float32)
        s = scales.to(torch.float32)
    else:
        v = (E4M3 if mode == "mxfp8" else E2M1)[q]
        s = (E4M3 if mode == "nvfp4" else E8M0)[scales.to(torch.int64)]
        if mode == "nvfp4":
            s = s * global_mul
    xg = x.to(torch.float32).view(m, k // group, group)
    dots = torch.einsum("mgj,ngj->mng", xg, v.view(n, k // group, group))  # [M, N, G]
    y = (dots * s).sum(-1)
    if mode == "affine":
        y = y + xg.sum(-1) @ biases.to(torch.float32).t()
    return y.to(out_dtype)


def i4mm(x: Tensor, packed: Tensor, sb: Tensor, group: int, out_dtype: torch.dtype,
         pairs: str = "zeros") -> Tensor:
    """`native.i4mm` in torch: the codes decoded from the int4 copy, per group s * (x . q) +
    b * sum(x) in float32 with sb's scales and biases ([K / G, N, 2]; "zeros": b = zero - 8 s
    from torch's zeros), summed over groups; "tiles": x . w in float32 for w = bf16(bf16(q *
    s) + b) (two bf16 ops, as `QuantWeight.dequant_rows`)."""
    from mlxr.quant import int4pack

    m, k = x.shape
    n = sb.shape[1]
    q = int4pack.decode_rows(packed, k, 0, n).to(torch.float32).view(n, k // group, group)
    if pairs == "tiles":
        s16, b16 = sb[..., 0].t().unsqueeze(-1), sb[..., 1].t().unsqueeze(-1)  # [N, K / G, 1]
        w = (q.to(torch.bfloat16) * s16 + b16).view(n, k)  # each op rounds to bf16
        return (x.to(torch.float32) @ w.float().t()).to(out_dtype)
    s, b = sb[..., 0].float(), sb[..., 1].float()  # [K / G, N]
    if pairs == "zeros":
        b = b - 8 * s
    xg = x.to(torch.float32).view(m, k // group, group)
    dots = torch.einsum("mgj,ngj->mgn", xg, q)  # [M, K / G, N]
    y = (dots * s).sum(1) + torch.einsum("mg,gn->mn", xg.sum(-1), b)
    return y.to(out_dtype)


def attend(q: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor | None, start: int,
           length: int, scale: float) -> Tensor:
    """`native.attend` in torch: the reference decode attention (float32 copies of the K/V)."""
    h, d = q.shape
    kh = k_cache.shape[0]
    if slots is None:
        keys, values = k_cache[:, start:start + length], v_cache[:, start:start + length]
    else:
        keys, values = k_cache.index_select(1, slots), v_cache.index_select(1, slots)
    qg = q.reshape(kh, h // kh, d).float()
    scores = torch.bmm(qg * scale, keys.float().transpose(1, 2))
    out = torch.bmm(torch.softmax(scores, dim=-1), values.float())
    return out.reshape(h, d).to(q.dtype)


def add_rms_norm(h: Tensor, r: Tensor | None, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """`fused.add_rms_norm` in torch: `ops.reference`'s residual add and RMSNorm."""
    from mlxr.ops import reference

    s = h if r is None else (h + r).to(h.dtype)
    return s, reference.rms_norm(s, w, eps)


def _swap(x: Tensor, traditional: bool) -> Tensor:
    """x [..., 2R] float32 with its rotation pairs swapped: halves, or neighbours."""
    r = x.shape[-1] // 2
    if traditional:
        return x.unflatten(-1, (r, 2)).flip(-1).flatten(-2)
    return torch.cat((x[..., r:], x[..., :r]), dim=-1)


def norm_rope(qk: Tensor, w: Tensor | None, eps: float, traditional: bool, c: Tensor,
              s: Tensor) -> Tensor:
    """The lean step's torch path (mlxr/models/cpu_decode.py) for the q and k heads qk [N, H +
    K, D] (compute dtype): per-head RMSNorm by the stacked weights w [H + K, D] (if any), then
    RoPE of the first 2R features as x * C + swap(x) * S, C = [cos, cos] and S = [-sin, sin]
    [N, 1, 2R] float32 (each term rounds as the reference's x1 * c - x2 * s: the same values
    as `reference.rms_norm` and `reference.rope`, bit for bit)."""
    if w is not None:
        x32 = qk.float()
        qk = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(qk.dtype) * w
    r2 = c.shape[-1]
    xr = qk[..., :r2].float()
    out = (xr * c + _swap(xr, traditional) * s).to(qk.dtype)
    return out if r2 == qk.shape[-1] else torch.cat((out, qk[..., r2:]), dim=-1)


def qk_rope(qkv: Tensor, heads: int, kv_heads: int, w: Tensor | None, eps: float, cos: Tensor,
            sin: Tensor, traditional: bool, pos: Tensor, k_cache: Tensor, v_cache: Tensor,
            slots: Tensor) -> Tensor:
    """`fused.qk_rope` in torch: `norm_rope` at the rows `pos` of the tables, then the cache
    writes."""
    n, d = qkv.shape[0], k_cache.shape[-1]
    x = qkv.view(n, heads + 2 * kv_heads, d)
    qk = norm_rope(x[:, :heads + kv_heads], w, eps, traditional, cos[pos].unsqueeze(1),
                   sin[pos].unsqueeze(1))
    k_cache.index_copy_(1, slots, qk[:, heads:].transpose(0, 1))
    v_cache.index_copy_(1, slots, x[:, heads + kv_heads:].transpose(0, 1))
    return qk[:, :heads].contiguous()


def act_mul(gu: Tensor, act: str) -> Tensor:
    """`fused.act_mul` in torch: `ops.reference.gated_act` of the two halves."""
    from mlxr.ops import reference

    gate, up = gu.chunk(2, dim=-1)
    return reference.gated_act(gate, up, act).contiguous()


def i4deq(packed: Tensor, scales: Tensor, biases: Tensor, group: int, r0: int,
          r1: int) -> Tensor:
    """`native.i4deq`: rows r0..r1 of torch's int4 copy (64-row blocks [N / 64, K, 32] bytes:
    byte j of column k = row j low nibble, row j + 32 high nibble) as bf16(bf16(q * s) + b)."""
    k = scales.shape[1] * group
    blk = packed.view(-1, k, 32)[r0 // 64: r1 // 64].transpose(1, 2)  # [B, 32, K]
    q = torch.cat([blk & 15, blk >> 4], dim=1).reshape(r1 - r0, k // group, group)
    s, b = scales[r0:r1].unsqueeze(-1), biases[r0:r1].unsqueeze(-1)
    return (q.to(torch.bfloat16) * s).add_(b).view(r1 - r0, k)


@functools.cache
def _qk_scale(hk: int, dk: int, dtype: torch.dtype) -> Tensor:
    """[2 Hk, 1]: Dk^-1 for the q heads, Dk^-0.5 for the k heads, rounded as the reference's
    scalars (`recurrent.l2norm_qk`)."""
    inv = dk**-0.5
    return torch.cat((torch.full((hk, 1), inv**2, dtype=dtype),
                      torch.full((hk, 1), inv, dtype=dtype)))


def _conv_silu(x: Tensor, state: Tensor, w: Tensor) -> Tensor:
    """`recurrent.conv1d_silu` for one token: x [B, C], state [B, W-1, C] (rolled in place),
    w [W, C] float32 -> silu(conv) [B, C] in x's dtype; the taps summed in the reference's
    order, tap 0 first."""
    seq = torch.cat((state, x.unsqueeze(1)), dim=1)  # [B, W, C]
    prod = seq.float() * w
    acc = prod[:, 0]
    for j in range(1, w.shape[0]):
        acc = acc + prod[:, j]
    state.copy_(seq[:, 1:])
    return F.silu(acc.to(x.dtype))


def _unit_rms(x: Tensor, eps: float) -> Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _recur(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> Tensor:
    """One token of the gated delta rule with the reference's ops. q, k [B, Hv, Dk] (key heads
    already repeated for their value heads), v [B, Hv, Dv], g [B, Hv] float32, beta [B, Hv];
    state [B, Hv, Dv, Dk] float32 contiguous, updated in place. Returns y [B, Hv, Dv] in q's
    dtype."""
    bsz, hv, dv = v.shape
    dk = k.shape[-1]
    s = state.view(bsz * hv, dv, dk)
    kt = k.float().reshape(bsz * hv, 1, dk)
    s.mul_(g.reshape(bsz * hv, 1, 1))
    kv = torch.bmm(s, kt.transpose(1, 2))  # [B*Hv, Dv, 1]
    delta = (v.float().reshape(bsz * hv, dv, 1) - kv) * beta.float().reshape(bsz * hv, 1, 1)
    s.baddbmm_(delta, kt)
    y = torch.bmm(s, q.float().reshape(bsz * hv, 1, dk).transpose(1, 2))  # as the reference
    return y.reshape(bsz, hv, dv).to(q.dtype)


def gdn_step(proj: Tensor, conv_state: Tensor, ssm: Tensor, conv_w: Tensor, neg_decay: Tensor,
             dt_bias: Tensor, norm_w: Tensor, heads: tuple[int, int, int, int],
             eps: float) -> Tensor:
    """`gdn.step` in torch, the lean CPU step's own arithmetic (the generic mixer's values bit
    for bit: tests/test_cpu_hybrid_decode.py): in_proj's rows proj [B, P] = [qkv (C) | z | b |
    a] -> out_proj's input [B, Hv Dv] in proj's dtype; conv_state [B, W-1, C] and ssm [B, Hv,
    Dv, Dk] (float32 contiguous) updated in place; conv_w [W, C] float32, neg_decay [Hv]
    float32 (-exp(A_log)), dt_bias [Hv], norm_w [Dv]; heads = (Hk, Hv, Dk, Dv)."""
    from mlxr.ops.recurrent import reference as recurrent

    hk, hv, dk, dv = heads
    bsz, kd, dtype = proj.shape[0], hk * dk, proj.dtype
    qkv, z, b, a = proj.split([2 * kd + hv * dv, hv * dv, hv, hv], -1)
    mixed = _conv_silu(qkv, conv_state, conv_w)
    qk = _unit_rms(mixed[:, :2 * kd].reshape(bsz, 2 * hk, dk), 1e-6 * (dk**-0.5)**2)
    qk = qk * _qk_scale(hk, dk, dtype)
    q, k = qk[:, :hk], qk[:, hk:]
    if hv > hk:
        q, k = q.repeat_interleave(hv // hk, 1), k.repeat_interleave(hv // hk, 1)
    sp = torch.logaddexp(a + dt_bias.to(dtype), _zero(dtype))
    g = torch.exp(neg_decay * sp.float())
    y = _recur(q, k, mixed[:, 2 * kd:].reshape(bsz, hv, dv), g, torch.sigmoid(b), ssm)
    out = recurrent.rms_norm_gated(y, z.reshape(bsz, hv, dv), norm_w, eps)
    return out.reshape(bsz, hv * dv)


@functools.cache
def _zero(dtype: torch.dtype) -> Tensor:
    return torch.zeros((), dtype=dtype)

def i4_experts(x: Tensor, ids: Tensor, gate_up: list, down: list, group: int, act: str,
               pairs: str = "zeros") -> Tensor:
    """`experts.i4_experts` in torch: per slot, `i4mm`'s twin through the expert's gate_up
    (rounded to bf16), act(gate) * up in torch's bf16 ops, then its down (rounded)."""
    from mlxr import ops

    outs = []
    for e in ids.tolist():
        gate, up = i4mm(x, *gate_up[e], group, torch.bfloat16, pairs).chunk(2, dim=-1)
        outs.append(i4mm(ops.moe_expert_act(gate, up, act), *down[e], group, torch.bfloat16,
                         pairs))
    return torch.cat(outs)
