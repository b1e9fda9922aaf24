"""The CPU decode step of the gated DeltaNet layer (qwen3_5, qwen3_5_moe, qwen3_next): one new
token per sequence, the generic mixer's arithmetic in fewer, larger ops.

`Qwen35Decoder.forward` (a one-token step) and `forward_batch` (the engine's decode batches) call
`delta_step` instead of `GatedDeltaMixer.__call__` on the CPU. The generic path
(`ops.recurrent.reference`) spends ~0.3 ms of one core per layer and token outside the
two projections, in ~25 small torch calls around the four passes over the float32 state.
Between the projections this runs one of:

* `mlxr.ops.cpu.gdn.step`, one C call (bf16, where `gdn.enabled`: by default in layers whose
  projections run mlxr's own matmul kernels; env `MLXR_CPU_GDN`): the state read and written
  once, every elementwise value rounded as below, the two dot products per state row summed
  in another order than torch's bmm (within float32 summation bounds of the torch step's:
  tests/test_cpu_gdn.py);
* `mlxr.ops.cpu.twins.gdn_step`, the same arithmetic in torch, every rounding where the
  reference rounds it (logits and states equal the generic path's bit for bit:
  tests/test_cpu_hybrid_decode.py): the conv's W tap products one multiply by a float32
  [W, C] table built once, summed tap by tap in the reference's order; q and k L2-normed as
  one [B, 2Hk, Dk] tensor, their scales a per-head column rounded as the reference's
  scalars; the decay's -exp(A_log) a table.

The projections call mlxr's or torch's int4 kernel directly (`cpu_decode._matmul`).
`MLXR_CPU_DECODE=0` (read per step) selects the generic mixer, as for the dense lean step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import ops
from ..ops.cpu import gdn, twins
from . import cpu_decode
from .gated_delta import GatedDeltaMixer


def enabled(x: Tensor) -> bool:
    """Whether a decode step on x's device takes the lean path: CPU, not switched off, and no
    Triton kernels forced there (tests run them under the interpreter)."""
    return x.device.type == "cpu" and cpu_decode.enabled() and not ops.fast_kernels(x.device)


@dataclass(frozen=True)
class _DeltaPlan:
    """One mixer's tables: conv_w [W, C] float32 (tap j's weights as row j), neg_decay [Hv]
    float32 (-exp(A_log)); served: a projection runs mlxr's own matmul kernel (`gdn.enabled`);
    dtype: the compute dtype the plan was made for."""

    in_proj: Callable[[Tensor], Tensor]
    out_proj: Callable[[Tensor], Tensor]
    conv_w: Tensor
    neg_decay: Tensor
    served: bool
    dtype: torch.dtype


def _plan(m: GatedDeltaMixer, dtype: torch.dtype) -> _DeltaPlan:
    plan = getattr(m, "_cpu_delta_plan", None)
    if plan is None or plan.dtype != dtype:
        lins = [ln for proj in (m.in_proj, m.out_proj) for ln in getattr(proj, "parts", [proj])]
        served = any(cpu_decode.served(ln) for ln in lins)  # a Fused projection: its parts
        plan = _DeltaPlan(cpu_decode._matmul(m.in_proj), cpu_decode._matmul(m.out_proj),
                          m.conv.float().t().contiguous(), -torch.exp(m.a_log.float()),
                          served, dtype)
        m._cpu_delta_plan = plan
    return plan


def delta_step(m: GatedDeltaMixer, x: Tensor, conv_state: Tensor, ssm_state: Tensor) -> Tensor:
    """`GatedDeltaMixer.__call__` for one token per sequence: x [B, E] -> [B, E]; conv_state
    [B, W-1, C] and ssm_state [B, Hv, Dv, Dk] (float32, contiguous) overwritten with the states
    after the token."""
    s, p = m.spec, _plan(m, x.dtype)
    if ssm_state.dtype != torch.float32 or not ssm_state.is_contiguous():
        raise ValueError("delta_step: the state must be a contiguous float32 tensor")
    heads = (s.num_k_heads, s.num_v_heads, s.k_head_dim, s.v_head_dim)
    proj = p.in_proj(x)
    args = (proj, conv_state, ssm_state, p.conv_w, p.neg_decay, m.dt_bias, m.norm, heads, m.eps)
    if (x.dtype == torch.bfloat16 and gdn.enabled(p.served) and gdn.ready()
            and conv_state.is_contiguous()):
        return p.out_proj(gdn.step(*args))
    return p.out_proj(twins.gdn_step(*args))
