"""Plain-torch twins of `native`'s and `fused`'s kernels: the same signatures and the same
arithmetic in torch ops (`native`'s: float32 throughout, one rounding at the end; `fused`'s: the
lean decode step's torch path itself, which they reproduce bit for bit). They are the tests'
oracle and what runs where the extension was not built."""

from __future__ import annotations

import torch
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
