"""The mixture-of-experts MLP block: router, the selected experts, the shared expert.

One block for every family; `config_moe.MoeSpec` holds the variant (router kind, weighting,
routed scaling, shared expert and its gate, expert activation and biases). Experts are stored
either per expert (`Linear`s over slices of the file's stacked [X, out, in] tensors: the CPU,
whose int4 kernel then serves each expert) or stacked as in the file (`StackedExperts`: the
default on CUDA). Either way a step reads only the weights of the experts its tokens
selected; stacked, a step of at most GATHER_PAIRS (token, expert) pairs (decode) gathers
them by the device-side ids, with no host synchronisation.

On CUDA with Triton kernels, stacked experts (quantized, or bf16 / f16 / f32 as the kernels'
"dense" mode) run the MoE kernels instead
(`ops.moe_experts`: the decode kernels for a few pairs, the grouped GEMM beyond): no host
synchronisation at any batch size, so the block can be captured in CUDA graphs
(`MoeBlock.capturable`). The torch path stays the CPU path and the kernels' spec.
"""

from __future__ import annotations

import torch

from .. import ops
from ..config import QuantSpec
from ..config.moe import MoeSpec
from ..layers import Linear
from ..quant.dequant import dequantize
from . import cpu_moe_decode

GATHER_PAIRS = 16  # stacked experts: up to this many (token, slot) pairs gather on the device


class StackedExperts:
    """One projection of all X experts as the file stacks it: a float weight [X, out, in], or
    packed words [X, out, in*bits/32] with scales (and affine biases) [X, out, in/group] and
    an nvfp4 global scale [X]; plus an optional bias [X, out]."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, spec: QuantSpec | None = None,
                 scales: torch.Tensor | None = None, biases: torch.Tensor | None = None,
                 global_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None):
        self.weight, self.spec, self.dtype, self.bias = weight, spec, dtype, bias
        # float32 compute: affine scales / biases in float32 (QuantWeight's exact mode)
        wide = spec is not None and spec.mode == "affine" and dtype == torch.float32
        self.scales = scales.float() if wide else scales
        self.biases = biases.float() if wide and biases is not None else biases
        self.global_scale = global_scale

    def quant(self):
        """The stack as the MoE kernels take it (`ops.ExpertQuant`; float weights as the
        "dense" mode), or None (a format the kernels do not read)."""
        if self.spec is None:
            q = ops.moe_dense_experts(self.weight, self.bias)
            return q if ops.moe_kernels_take(q) else None
        q = ops.ExpertQuant(self.weight, self.scales, self.biases, self.global_scale, self.bias,
                            self.spec.mode, self.spec.bits, self.spec.group_size)
        return q if ops.moe_kernels_take(q) else None

    def dense(self, ids: torch.Tensor) -> torch.Tensor:
        """The weights of experts ids [P] (device long) in the compute dtype [P, out, in]."""
        if self.spec is None:
            return self.weight.index_select(0, ids)

        def pick(t):
            return None if t is None else t.index_select(0, ids)

        return dequantize(pick(self.weight), pick(self.scales), pick(self.biases), self.spec,
                          global_scale=pick(self.global_scale), dtype=self.dtype)

    def rows(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Rows x [n, in] through expert e (its weight dequantized once): [n, out]."""
        y = x @ self.dense(torch.tensor([e], device=x.device))[0].t()
        return y if self.bias is None else y + self.bias[e]

    def __call__(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Row p of x [P, in] through expert ids[p]: [P, out]."""
        y = torch.bmm(self.dense(ids), x.unsqueeze(-1)).squeeze(-1)
        return y if self.bias is None else y + self.bias.index_select(0, ids)


class MoeBlock:
    """x [N, E] -> [N, E]: the routed experts' weighted sum (times the routed scale), plus
    the shared expert (times its sigmoid gate, where the family has one)."""

    def __init__(self, spec: MoeSpec, router: Linear, correction_bias: torch.Tensor | None,
                 gate_up: list, down: list, shared_gate_up=None,
                 shared_down: Linear | None = None, shared_gate: Linear | None = None):
        # per expert: gate_up[e] expert e's [gate | up] projection (a Linear, or a
        # decoder.Fused where gate and up could not be stacked) -> [n, 2F], down[e]
        # [n, F] -> [n, E]; stacked: gate_up = [gate, up], down = [down] (StackedExperts)
        self.spec, self.router, self.correction_bias = spec, router, correction_bias
        self.gate_up, self.down = gate_up, down
        self.shared_gate_up, self.shared_down = shared_gate_up, shared_down
        self.shared_gate = shared_gate
        # (gate, up, down) ExpertQuant for the MoE kernels, None where they do not apply
        self.quant = None
        if isinstance(down[0], StackedExperts) and spec.expert_act in ops.MOE_KERNEL_ACTS:
            qs = (gate_up[0].quant(), gate_up[1].quant(), down[0].quant())
            if all(q is not None for q in qs) and ops.moe_gate_up_pair(qs[0], qs[1]):
                self.quant = qs
        # None: the kernels on CUDA with Triton (ops.fast_kernels); True / False forces them
        # (True on CPU: the Triton interpreter, for tests)
        self.kernels: bool | None = None

    def use_kernels(self, device: torch.device) -> bool:
        """Whether this block's experts run the MoE kernels on `device`."""
        if self.quant is None or self.kernels is False:
            return False
        return bool(self.kernels) or ops.fast_kernels(device)

    def capturable(self, device: torch.device) -> bool:
        """Whether a step of this block can be captured in a CUDA graph: the kernels never
        read anything back on the host (the torch path groups pairs by expert on the host)."""
        return self.use_kernels(device)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, E] -> expert ids [N, k] (long) and weights [N, k]."""
        s = self.spec
        if self.use_kernels(x.device):  # the router in one launch (opt-in, ops.moe_router)
            fused = ops.moe_router(x, self.router.weight, self.router.bias, s.router, s.top_k,
                                   s.norm_topk, s.router_softcap, s.score_func,
                                   self.correction_bias)
            if fused is not None:
                return fused
        return ops.moe_route(self.router(x), s.router, s.top_k, s.norm_topk,
                             s.router_softcap, s.score_func, self.correction_bias)

    def experts(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each token's selected experts' outputs [N, k, E]: the (token, slot) pairs grouped
        by expert, one matmul per expert that some token selected (the others' weights are
        not read)."""
        s = self.spec
        n, k = ids.shape
        flat = ids.reshape(-1)
        if not isinstance(self.down[0], StackedExperts) and cpu_moe_decode.takes(x):
            return cpu_moe_decode.experts(self, x, ids)
        if isinstance(self.down[0], StackedExperts) and n * k <= GATHER_PAIRS:
            xs = x.repeat_interleave(k, dim=0)  # [N*k, E], pairs in (token, slot) order
            gate, up = (p(flat, xs) for p in self.gate_up)
            h = ops.moe_expert_act(gate, up, s.expert_act, s.act_alpha, s.act_limit)
            return self.down[0](flat, h).reshape(n, k, -1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=s.num_experts)
        used = counts.nonzero().flatten()
        y = x.new_empty(n * k, x.shape[-1])
        start = 0
        for e, c in zip(used.tolist(), counts[used].tolist()):
            pairs = order[start:start + c]
            start += c
            gate, up = self._gate_up(e, x.index_select(0, pairs // k))
            h = ops.moe_expert_act(gate, up, s.expert_act, s.act_alpha, s.act_limit)
            y.index_copy_(0, pairs, self._down(e, h))
        return y.reshape(n, k, -1)

    def _gate_up(self, e: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's gate and up projections of rows x [n, E]."""
        if not isinstance(self.down[0], StackedExperts):
            return self.gate_up[e](x).chunk(2, dim=-1)
        return tuple(p.rows(e, x) for p in self.gate_up)

    def _down(self, e: int, h: torch.Tensor) -> torch.Tensor:
        st = self.down[0]
        return st.rows(e, h) if isinstance(st, StackedExperts) else self.down[e](h)

    def shared_quant(self) -> tuple | None:
        """The shared expert's (gate, up, down) as one-expert stacks for the MoE kernels
        (`ops.moe_experts_shared`), or None: no shared expert, a gated one, or weights the
        kernels do not read. Built once (views of the Linears' words)."""
        if not hasattr(self, "_shared_q"):
            self._shared_q = None
            if self.shared_down is not None and self.shared_gate is None:
                self._shared_q = ops.moe_shared_stacks(self.shared_gate_up, self.shared_down)
        return self._shared_q

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        s = self.spec
        ids, w = self.route(x)
        if self.use_kernels(x.device) and self.shared_down is not None:
            y = ops.moe_experts_shared(x, ids, w, *self.quant, self.shared_quant(),
                                       s.expert_act, x.dtype, s.routed_scale)
            if y is not None:  # routed + shared in the kernels' two launches
                return y
        if self.use_kernels(x.device):
            out = ops.moe_experts(x, ids, w, *self.quant, s.expert_act, s.act_alpha,
                                  s.act_limit, x.dtype, s.routed_scale)
        else:
            out = ops.moe_combine(self.experts(x, ids), w, x.dtype, s.routed_scale)
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
        experts = [p for p in (*self.gate_up, *self.down) if not isinstance(p, StackedExperts)]
        parts = [self.router, *experts]
        parts += [p for p in (self.shared_gate_up, self.shared_down, self.shared_gate)
                  if p is not None]
        return parts
