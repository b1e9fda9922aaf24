"""One token's selected MoE experts in one C call (`i4moe_run` in i4mm.c).

A decode step of a MoE layer runs, per selected expert (k of them, 8 for Qwen3-30B-A3B),
gate_up, act(gate) * up and down: per expert two i4mm calls, the activation and ~10 torch
calls around them from Python, ~40 µs per expert beside its ~260 µs of GEMVs on the dev box
(docs/perf.md, "Session 22"), and with more than one thread an OpenMP fork and join per GEMV.
Here the k experts' gate_up GEMVs, their activations and their down GEMVs run in one call,
one parallel region, threads over the experts' 64-row blocks: each GEMV is i4mm's M = 1
block routine with the same group sums, and the activation is `fused.act_mul`'s table, so
the outputs are a loop of `native.i4mm` + `fused.act_mul` + `native.i4mm` bit for bit
(tests/test_cpu_experts.py). The weighted combine stays with the caller (`ops.moe_combine`,
one torch call). `twins.i4_experts` is the torch twin.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import fused, native

_Pair = tuple[Tensor, Tensor]  # (int4 copy uint8 [N / 64, K, 32], pairs [K / G, N, 2] bf16)


def serves(e: int, f: int, group: int, act: str) -> bool:
    """Whether `I4Experts` can run experts of hidden e and expert width f in bf16 with this
    activation: i4mm serves both projections ([2F, E] and [E, F]) and the activation has a
    table (`fused.act_table`: silu)."""
    return (native.i4mm_serves(2 * f, e, group) and native.i4mm_serves(e, f, group)
            and fused.act_table(act) is not None)


def _shaped(weights: list[_Pair], n: int, k: int, group: int) -> bool:
    """Every (int4 copy, pairs) of `weights` holds an [n, k] weight as i4mm reads it."""
    return all(p.dtype == torch.uint8 and p.is_contiguous() and p.numel() * 2 == n * k
               and s.dtype == torch.bfloat16 and s.is_contiguous()
               and tuple(s.shape) == (k // group, n, 2) for p, s in weights)


class I4Experts:
    """Every expert of a MoE block bound once (a table [X, 4] of pointers: each expert's
    gate_up int4 copy and pairs, then its down's; the tensors kept alive here); a call runs
    the selected ones."""

    def __init__(self, gate_up: list[_Pair], down: list[_Pair], group: int, act: str,
                 pairs: str = "zeros"):
        n2, e = gate_up[0][1].shape[1], gate_up[0][1].shape[0] * group
        f = n2 // 2
        if not (len(gate_up) == len(down) and serves(e, f, group, act)
                and _shaped(gate_up, n2, e, group) and _shaped(down, e, f, group)):
            raise ValueError("mlxr.ops.cpu: experts not served by i4moe")
        self.keep = (gate_up, down, fused.act_table(act))
        self.ptrs = torch.tensor([[gp.data_ptr(), gs.data_ptr(), dp.data_ptr(), ds.data_ptr()]
                                  for (gp, gs), (dp, ds) in zip(gate_up, down, strict=True)],
                                 dtype=torch.int64)
        self.e, self.f, self.group, self.mode = e, f, group, native.I4_PAIRS[pairs]
        self.tab = self.keep[2]
        self.fn = native._module().i4moe

    def __call__(self, x: Tensor, ids: Tensor) -> Tensor:
        """x [1, E] bf16, ids [k] int64 -> each slot's expert output [k, E] bf16."""
        if x.shape != (1, self.e) or x.dtype != torch.bfloat16 or ids.dim() != 1 \
                or ids.dtype != torch.int64:
            raise ValueError(f"mlxr.ops.cpu: x {tuple(x.shape)} {x.dtype}, ids {ids.dtype}")
        x, ids = x.contiguous(), ids.contiguous()
        y = torch.empty(ids.shape[0], self.e, dtype=torch.bfloat16)
        self.fn(x.data_ptr(), ids.data_ptr(), ids.shape[0], self.ptrs.shape[0],
                self.ptrs.data_ptr(), self.e, self.f, self.group, self.mode, self.tab.data_ptr(),
                y.data_ptr(), torch.get_num_threads())
        return y


def i4_experts(x: Tensor, ids: Tensor, gate_up: list[_Pair], down: list[_Pair], group: int,
               act: str, pairs: str = "zeros") -> Tensor:
    """x [1, E] bf16 through the experts ids [k] (gate_up[e], down[e]: int4 copy and pairs
    as `native.i4mm` takes them): [k, E] bf16. Callers check `serves` first."""
    return I4Experts(gate_up, down, group, act, pairs)(x, ids)
