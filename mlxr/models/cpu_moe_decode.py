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
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .. import ops
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


def experts(block, x: Tensor, ids: Tensor) -> Tensor:
    """`MoeBlock.experts` for per-expert projections: x [N, E], ids [N, k] -> each token's
    selected experts' outputs [N, k, E]."""
    s = block.spec
    n, k = ids.shape
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
