"""The CPU expert loop of the MoE block for per-expert projections (the CPU's storage: each
expert a `Linear` whose int4 kernel reads only that expert's weights).

`MoeBlock.experts` runs `experts` here on the CPU. The generic loop groups the (token, slot)
pairs by expert with four tensor ops and two host reads (argsort, bincount, nonzero, .tolist()
twice), then per expert gathers its rows, runs the two projections through the `Linear`
wrapper and scatters the outputs back. A decode step of one token (k pairs, k distinct experts)
is ~10 torch calls per expert around its two GEMVs. Here the pairs are grouped on the host from
one read of the ids, a single token's row is used as it is (no gather, no scatter: the outputs
are concatenated in slot order), and the projections call torch's int4 kernel directly
(`cpu_decode._matmul`, built once per expert). Each expert sees the same rows in the same
order as in the generic loop, so the outputs are its bit for bit
(tests/test_cpu_hybrid_decode.py). `MLXR_CPU_DECODE=0` selects the generic loop.

A single token whose experts all run i4mm (bf16, affine int4 copies, silu) takes one C call
for its k experts instead (`mlxr.ops.cpu.experts`: gate_up, act * up and down of every
selected expert in one parallel region): the same values as the per-expert calls bit for bit
(tests/test_cpu_experts.py); env `MLXR_CPU_EXPERTS=0` (read per step) selects the per-expert
calls.
"""

from __future__ import annotations

from collections.abc import Callable

import os

import torch
from torch import Tensor

from .. import ops
from ..layers import Linear
from ..ops.cpu import experts as cpu_experts
from ..ops.cpu import native
from ..quant import QuantWeight
from . import cpu_decode

_Proj = Callable[[Tensor], Tensor]


def takes(x: Tensor) -> bool:
    """Whether `experts` serves a step on x's device (the caller checks that the block's
    experts are per-expert projections): CPU, not switched off, no Triton kernels forced."""
    return x.device.type == "cpu" and cpu_decode.enabled() and not ops.fast_kernels(x.device)


def _projections(block, e: int) -> tuple[_Proj, _Proj]:
    """Expert e's (gate_up, down) callables, made on first use."""
    table = getattr(block, "_cpu_expert_mm", None)
    if table is None:
        table = block._cpu_expert_mm = {}
    pair = table.get(e)
    if pair is None:
        pair = table[e] = (cpu_decode._matmul(block.gate_up[e]),
                           cpu_decode._matmul(block.down[e]))
    return pair


def _i4_kernel(lin) -> native.I4Matmul | None:
    """The projection's i4mm binding over one nibble plane, or None."""
    qw = lin.weight if isinstance(lin, Linear) and lin.bias is None else None
    kern = qw.ckern if isinstance(qw, QuantWeight) else None
    return kern if isinstance(kern, native.I4Matmul) and kern.planes == 1 else None


def _one_call(block) -> cpu_experts.I4Experts | None:
    """The block's experts bound for the one-call path (built once; None where some expert
    does not run i4mm over one plane, the experts differ in group or pairs, or the
    activation has no table)."""
    got = getattr(block, "_cpu_i4_experts", False)
    if got is not False:
        return got
    got = None
    kerns = [(_i4_kernel(g), _i4_kernel(d)) for g, d in zip(block.gate_up, block.down,
                                                           strict=True)]
    if kerns and all(g is not None and d is not None for g, d in kerns):
        modes = {(k.group, k.pairs) for pair in kerns for k in pair}
        if len(modes) == 1:
            (group, pairs), = modes
            try:
                got = cpu_experts.I4Experts([g.keep for g, _ in kerns],
                                            [d.keep for _, d in kerns], group,
                                            block.spec.expert_act, pairs)
            except ValueError:  # shapes or activation it does not serve
                got = None
    block._cpu_i4_experts = got
    return got


def _one_call_enabled() -> bool:
    return native.enabled() and os.environ.get("MLXR_CPU_EXPERTS", "") != "0"


def experts(block, x: Tensor, ids: Tensor) -> Tensor:
    """`MoeBlock.experts` for per-expert projections: x [N, E], ids [N, k] -> each token's
    selected experts' outputs [N, k, E]."""
    s = block.spec
    n, k = ids.shape
    if n == 1 and x.dtype == torch.bfloat16 and _one_call_enabled():
        kern = _one_call(block)
        if kern is not None:
            return kern(x, ids.reshape(-1)).unsqueeze(0)
    flat = ids.reshape(-1).tolist()
    groups: dict[int, list[int]] = {}
    for p, e in enumerate(flat):  # pairs in (token, slot) order within each expert
        groups.setdefault(e, []).append(p)

    def run(e: int, rows: Tensor) -> Tensor:
        gate_up, down = _projections(block, e)
        gate, up = gate_up(rows).chunk(2, dim=-1)
        return down(ops.moe_expert_act(gate, up, s.expert_act, s.act_alpha, s.act_limit))

    if n == 1 and len(groups) == k:  # one token, k distinct experts: its row as it is
        return torch.cat([run(e, x) for e in flat]).reshape(1, k, -1)
    y = x.new_empty(n * k, x.shape[-1])
    for e in sorted(groups):
        pairs = torch.tensor(groups[e])
        y.index_copy_(0, pairs, run(e, x.index_select(0, pairs // k)))
    return y.reshape(n, k, -1)
