"""A gated DeltaNet decode step between the two projections in one C call (`gdn.c`): conv and
SiLU, the q / k L2 norms, the gates, the delta-rule update of the float32 state with its
readout, and the gated RMSNorm, for the lean CPU step (mlxr/models/cpu_hybrid_decode.py).

It reads and writes the state once (the torch step passes over it four times: 1 MB per layer
and token on the 0.8B shape) and replaces ~25 torch calls per layer. Every elementwise value
rounds as the torch step's (`twins.gdn_step`); the two float32 dot products per state row (S k
and S q) sum in another order than torch's bmm and the decay's exp is libm's, so outputs and
states agree with the torch step's within float32 summation bounds, not bit for bit
(tests/test_cpu_gdn.py). Hence the switch (`enabled`), as for the attention kernel.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import Tensor

from . import fused, native


def enabled(served: bool) -> bool:
    """Whether a layer's step runs the kernel (`served`: its projections run mlxr's own
    matmul kernels, so its values already follow mlxr's summation order). Env `MLXR_CPU_GDN`
    (read per step): "1" on, "0" off; unset, on for served layers only (`native.attend_enabled`'s
    policy)."""
    env = os.environ.get("MLXR_CPU_GDN", "")
    return native.enabled() and (env == "1" or (served and env != "0"))


@functools.cache
def _tables() -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
    """(silu, sigmoid, softplus) bf16 and silu float32 of every bf16 bit pattern, torch's own
    values, or None where torch's vector and scalar loops disagree on some input."""
    silu, sig = fused.act_table("silu"), fused.act_table("sigmoid")
    sp = fused.torch_values(lambda x: torch.logaddexp(x, torch.zeros((), dtype=x.dtype)))
    silu32 = fused.torch_values(lambda x: F.silu(x.float()))
    tabs = (silu, sig, sp, silu32)
    return None if any(t is None for t in tabs) else tabs


def ready() -> bool:
    """The extension was built, torch's sum order was found (`fused.lanes`) and the tables
    hold."""
    return native.enabled() and fused.lanes() > 0 and _tables() is not None


def step(proj: Tensor, conv_state: Tensor, ssm: Tensor, conv_w: Tensor, neg_decay: Tensor,
         dt_bias: Tensor, norm_w: Tensor, heads: tuple[int, int, int, int],
         eps: float) -> Tensor:
    """`twins.gdn_step` in one C call (bf16 only; callers check `ready` first): proj [B, P]
    bf16 with unit column stride -> [B, Hv Dv] bf16; the states updated in place."""
    hk, hv, dk, dv = heads
    bsz, p = proj.shape
    c = 2 * hk * dk + hv * dv
    w = conv_w.shape[0]
    ok = (proj.dtype == conv_state.dtype == dt_bias.dtype == norm_w.dtype == torch.bfloat16
          and proj.stride(1) == 1 and p == c + hv * dv + 2 * hv and hv % hk == 0
          and conv_state.is_contiguous() and tuple(conv_state.shape) == (bsz, w - 1, c)
          and ssm.dtype == conv_w.dtype == neg_decay.dtype == torch.float32
          and ssm.is_contiguous() and tuple(ssm.shape) == (bsz, hv, dv, dk)
          and conv_w.is_contiguous() and tuple(conv_w.shape) == (w, c) and w >= 2
          and neg_decay.is_contiguous() and dt_bias.is_contiguous() and norm_w.is_contiguous()
          and neg_decay.numel() == dt_bias.numel() == hv and norm_w.numel() == dv)
    if not ok:
        raise ValueError("mlxr.ops.cpu.gdn: shapes, dtypes or layout")
    silu, sig, sp, silu32 = _tables()
    inv = dk**-0.5
    out = torch.empty(bsz, hv * dv, dtype=torch.bfloat16)
    native._module().gdn_step(
        proj.data_ptr(), proj.stride(0), bsz, hk, hv, dk, dv, c, w, conv_state.data_ptr(),
        ssm.data_ptr(), conv_w.data_ptr(), neg_decay.data_ptr(), dt_bias.data_ptr(),
        norm_w.data_ptr(), silu.data_ptr(), sig.data_ptr(), sp.data_ptr(), silu32.data_ptr(),
        _bf16(inv**2), _bf16(inv), 1e-6 * inv**2, eps, fused.lanes(), out.data_ptr(),
        torch.get_num_threads())
    return out


@functools.cache
def _bf16(v: float) -> float:
    """v rounded to bf16, as the torch step's scalar tensors hold it."""
    return float(torch.tensor(v, dtype=torch.bfloat16))
