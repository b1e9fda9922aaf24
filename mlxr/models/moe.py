"""The mixture-of-experts MLP block: router, the selected experts, the shared expert.

One block for every family; `config_moe.MoeSpec` holds the variant (router kind, weighting,
routed scaling, shared expert and its gate, expert activation and biases). Experts are
stored per expert (`Linear`s over the file's stacked [X, out, in] tensors, sliced at load),
so a step touches only the weights of the experts its tokens selected.
"""

from __future__ import annotations

import torch

from .. import ops
from ..config_moe import MoeSpec
from ..layers import Linear


class MoeBlock:
    """x [N, E] -> [N, E]: the routed experts' weighted sum (times the routed scale), plus
    the shared expert (times its sigmoid gate, where the family has one)."""

    def __init__(self, spec: MoeSpec, router: Linear, correction_bias: torch.Tensor | None,
                 gate_up: list, down: list[Linear], shared_gate_up=None,
                 shared_down: Linear | None = None, shared_gate: Linear | None = None):
        # gate_up[e]: expert e's [gate | up] projection (a Linear, or a decoder.Fused where
        # gate and up could not be stacked) -> [n, 2F]; down[e]: [n, F] -> [n, E]
        self.spec, self.router, self.correction_bias = spec, router, correction_bias
        self.gate_up, self.down = gate_up, down
        self.shared_gate_up, self.shared_down = shared_gate_up, shared_down
        self.shared_gate = shared_gate

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, E] -> expert ids [N, k] (long) and weights [N, k]."""
        s = self.spec
        return ops.moe_route(self.router(x), s.router, s.top_k, s.norm_topk,
                             s.router_softcap, s.score_func, self.correction_bias)

    def experts(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each token's selected experts' outputs [N, k, E]: the (token, slot) pairs grouped
        by expert, one matmul per expert that some token selected (the others' weights are
        not read)."""
        s = self.spec
        n, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=s.num_experts)
        used = counts.nonzero().flatten()
        y = x.new_empty(n * k, x.shape[-1])
        start = 0
        for e, c in zip(used.tolist(), counts[used].tolist()):
            pairs = order[start:start + c]
            start += c
            gate, up = self.gate_up[e](x.index_select(0, pairs // k)).chunk(2, dim=-1)
            h = ops.moe_expert_act(gate, up, s.expert_act, s.act_alpha, s.act_limit)
            y.index_copy_(0, pairs, self.down[e](h))
        return y.reshape(n, k, -1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ids, w = self.route(x)
        out = ops.moe_combine(self.experts(x, ids), w, x.dtype, self.spec.routed_scale)
        if self.shared_down is None:
            return out
        gate, up = self.shared_gate_up(x).chunk(2, dim=-1)
        shared = self.shared_down(ops.gated_act(gate, up, "silu"))
        if self.shared_gate is not None:
            shared = torch.sigmoid(self.shared_gate(x)) * shared
        return out + shared

    def linears(self) -> list:
        """Every projection of the block (router, experts, shared expert), for
        `Decoder.quant_weights`."""
        parts = [self.router, *self.gate_up, *self.down]
        parts += [p for p in (self.shared_gate_up, self.shared_down, self.shared_gate)
                  if p is not None]
        return parts
