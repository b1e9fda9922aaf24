"""The CPU decode step of the gated DeltaNet layer (qwen3_5, qwen3_5_moe, qwen3_next): one new
token per sequence, the generic mixer's arithmetic in fewer, larger torch ops.

`Qwen35Decoder.forward` (a one-token step) and `forward_batch` (the engine's decode batches) call
`delta_step` instead of `GatedDeltaMixer.__call__` on the CPU. The generic path
(`ops.recurrent.reference`) spends ~0.3 ms of one core per layer and token outside the
two projections, in ~25 small torch calls around the four passes over the float32 state. The
same arithmetic here, every rounding where the reference rounds it (logits and states equal the
generic path's bit for bit: tests/test_cpu_hybrid_decode.py):

* the conv's W tap products are one multiply by a float32 [W, C] table built once, summed tap
  by tap in the reference's order (the same roundings);
* q and k are L2-normed as one [B, 2Hk, Dk] tensor, their scales a per-head column rounded as
  the reference's scalars;
* the decay's -exp(A_log) is a table; the projections call torch's int4 kernel directly
  (`cpu_decode._matmul`).

`MLXR_CPU_DECODE=0` (read per step) selects the generic mixer, as for the dense lean step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import ops
from ..ops.recurrent import reference as recurrent
from . import cpu_decode
from .gated_delta import GatedDeltaMixer


def enabled(x: Tensor) -> bool:
    """Whether a decode step on x's device takes the lean path: CPU, not switched off, and no
    Triton kernels forced there (tests run them under the interpreter)."""
    return x.device.type == "cpu" and cpu_decode.enabled() and not ops.fast_kernels(x.device)


@dataclass(frozen=True)
class _DeltaPlan:
    """One mixer's tables. conv_w [W, C] float32 (tap j's weights as row j); qk_scale
    [2Hk, 1] compute dtype (Dk^-1 for the q heads, Dk^-0.5 for the k heads, rounded as the
    reference's scalars); neg_decay [Hv] float32 (-exp(A_log)); zero: a 0-d compute-dtype
    zero for softplus."""

    in_proj: Callable[[Tensor], Tensor]
    out_proj: Callable[[Tensor], Tensor]
    conv_w: Tensor
    qk_scale: Tensor
    neg_decay: Tensor
    zero: Tensor
    rms_eps: float


def _plan(m: GatedDeltaMixer, dtype: torch.dtype) -> _DeltaPlan:
    plan = getattr(m, "_cpu_delta_plan", None)
    if plan is None or plan.zero.dtype != dtype:
        s = m.spec
        inv = s.k_head_dim**-0.5
        scale = torch.cat((torch.full((s.num_k_heads, 1), inv**2, dtype=dtype),
                           torch.full((s.num_k_heads, 1), inv, dtype=dtype)))
        plan = _DeltaPlan(cpu_decode._matmul(m.in_proj), cpu_decode._matmul(m.out_proj),
                          m.conv.float().t().contiguous(), scale, -torch.exp(m.a_log.float()),
                          torch.zeros((), dtype=dtype), 1e-6 * inv**2)
        m._cpu_delta_plan = plan
    return plan


def _conv_silu(x: Tensor, state: Tensor, w: Tensor) -> Tensor:
    """`recurrent.conv1d_silu` for one token: x [B, C], state [B, W-1, C] (rolled in place),
    w [W, C] float32 -> silu(conv) [B, C] in x's dtype."""
    seq = torch.cat((state, x.unsqueeze(1)), dim=1)  # [B, W, C]
    prod = seq.float() * w
    acc = prod[:, 0]
    for j in range(1, w.shape[0]):  # the reference's order: tap 0 first
        acc = acc + prod[:, j]
    state.copy_(seq[:, 1:])
    return F.silu(acc.to(x.dtype))


def _unit_rms(x: Tensor, eps: float) -> Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _recur(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> Tensor:
    """One token of the gated delta rule. q, k [B, Hv, Dk] (key heads already repeated for
    their value heads), v [B, Hv, Dv], g [B, Hv] float32, beta [B, Hv]; state [B, Hv, Dv, Dk]
    float32 contiguous, updated in place with the reference's ops. Returns y [B, Hv, Dv] in
    q's dtype."""
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


def delta_step(m: GatedDeltaMixer, x: Tensor, conv_state: Tensor, ssm_state: Tensor) -> Tensor:
    """`GatedDeltaMixer.__call__` for one token per sequence: x [B, E] -> [B, E]; conv_state
    [B, W-1, C] and ssm_state [B, Hv, Dv, Dk] (float32, contiguous) overwritten with the states
    after the token."""
    s, p = m.spec, _plan(m, x.dtype)
    if ssm_state.dtype != torch.float32 or not ssm_state.is_contiguous():
        raise ValueError("delta_step: the state must be a contiguous float32 tensor")
    bsz, hk, hv, dk = x.shape[0], s.num_k_heads, s.num_v_heads, s.k_head_dim
    proj = p.in_proj(x)
    qkv, z, b, a = proj.split([s.conv_dim, s.value_dim, hv, hv], -1)
    mixed = _conv_silu(qkv, conv_state, p.conv_w)
    qk = _unit_rms(mixed[:, :2 * s.key_dim].reshape(bsz, 2 * hk, dk), p.rms_eps) * p.qk_scale
    q, k = qk[:, :hk], qk[:, hk:]
    if hv > hk:
        q, k = q.repeat_interleave(hv // hk, 1), k.repeat_interleave(hv // hk, 1)
    g = torch.exp(p.neg_decay * torch.logaddexp(a + m.dt_bias.to(a.dtype), p.zero).float())
    v = mixed[:, 2 * s.key_dim:].reshape(bsz, hv, s.v_head_dim)
    y = _recur(q, k, v, g, torch.sigmoid(b), ssm_state)
    out = recurrent.rms_norm_gated(y, z.reshape(bsz, hv, s.v_head_dim), m.norm, m.eps)
    return p.out_proj(out.reshape(bsz, s.value_dim))
