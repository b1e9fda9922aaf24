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
from ..ops.cpu import fused, gdn, twins
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


@dataclass(frozen=True)
class _MlpPlan:
    """The dense MLPs' projections per layer (None: a MoE layer) and the activation's table
    (`fused.act_table`)."""

    gate_up: list[Callable[[Tensor], Tensor] | None]
    down: list[Callable[[Tensor], Tensor] | None]
    act: Tensor


def _mlp_plan(dec) -> _MlpPlan | None:
    """None where the fused calls do not give this decoder's values (`fused.ready`: checked
    once, bit for bit against their torch twins) or its dtype is not bf16."""
    plan = getattr(dec, "_cpu_mlp_plan", False)
    if plan is False:
        c = dec.config
        ok = (dec.dtype == torch.bfloat16 and fused.ready(c.hidden_size, 1, 1, 64, 64, False,
                                                          False, c.hidden_act)
              and all(w.dtype == torch.bfloat16 for ly in dec.layers
                      for w in (ly.input_norm, ly.mlp_norm)) and dec.norm.dtype == torch.bfloat16)
        plan = None
        if ok:
            dense = [ly.moe is None for ly in dec.layers]
            plan = _MlpPlan([cpu_decode._matmul(ly.gate_up) if d else None
                             for ly, d in zip(dec.layers, dense, strict=True)],
                            [cpu_decode._matmul(ly.down_proj) if d else None
                             for ly, d in zip(dec.layers, dense, strict=True)],
                            fused.act_table(c.hidden_act))
        dec._cpu_mlp_plan = plan
    return plan


def layers(dec, h: Tensor, mixer) -> Tensor | None:
    """`Qwen35Decoder._layers` for a decode step (rows h [B, E], one token of each sequence):
    the residual adds with their RMSNorms and act(gate) * up in one C call each (`fused`:
    the torch path's values bit for bit), the projections called directly. None where that
    does not serve (the caller runs `_layers`)."""
    plan = _mlp_plan(dec)
    if plan is None or not fused.enabled() or h.dtype != torch.bfloat16:
        return None
    eps = dec.config.rms_norm_eps
    h, x = fused.add_rms_norm(h.clone(), None, dec.layers[0].input_norm, eps)
    for i, layer in enumerate(dec.layers):
        h, x = fused.add_rms_norm(h, mixer(i, layer, x).contiguous(), layer.mlp_norm, eps)
        if layer.moe is not None:
            r = layer.moe(x)
        else:
            r = plan.down[i](fused.act_mul(plan.gate_up[i](x).contiguous(), plan.act))
        nxt = dec.layers[i + 1].input_norm if i + 1 < len(dec.layers) else dec.norm
        h, x = fused.add_rms_norm(h, r.contiguous(), nxt, eps)
    return x
