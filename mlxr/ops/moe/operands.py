"""The MoE kernels' operands: one stacked expert projection as the file holds it, and the
checks that say whether the kernels read it. Free of triton (imported by `mlxr.ops` at start;
the kernels import triton lazily)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

KERNEL_MODES = ("affine", "mxfp4", "nvfp4", "mxfp8")  # codes.MODES
KERNEL_BITS = (2, 3, 4, 5, 6, 8)
KERNEL_ACTS = ("silu", "swiglu_oai", "gelu_tanh")  # decode_experts.ACTS
# unquantized experts: float weights [X, N, K] read as they are ("dense" mode)
DENSE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class ExpertQuant(NamedTuple):
    """One projection of all X experts as the file stacks it (N = out, K = in features).
    mode "dense": w is the float weight [X, N, K] itself, no scales (`dense_experts`)."""
    w: Tensor  # int32 / uint32 words [X, N, K*bits/32] (dense: float [X, N, K])
    scales: Tensor | None  # [X, N, K/group] (affine: float; fp modes: uint8; dense: None)
    biases: Tensor | None  # affine [X, N, K/group]
    global_scale: Tensor | None  # nvfp4 [X] float32
    bias: Tensor | None  # expert bias [X, N] (gpt-oss)
    mode: str
    bits: int
    group: int

    @property
    def shape(self) -> tuple[int, int, int]:
        """(X experts, N out features, K in features)."""
        if self.mode == "dense":
            return tuple(self.w.shape)
        x, n, _ = self.w.shape
        return x, n, self.scales.shape[-1] * self.group


def dense_experts(w: Tensor, bias: Tensor | None = None) -> ExpertQuant:
    """Unquantized stacked experts w [X, N, K] (bf16 / f16 / f32) as the kernels take them:
    one element per "word" (bits 32 gives the kernels' row stride K), one group per row."""
    return ExpertQuant(w, None, None, None, bias, "dense", 32, w.shape[-1])


def kernels_take(q: ExpertQuant) -> bool:
    """Whether the MoE kernels read this stacked projection."""
    if q.mode == "dense":
        return q.w.dim() == 3 and q.w.dtype in DENSE_DTYPES and q.scales is None
    return (q.mode in KERNEL_MODES and q.bits in KERNEL_BITS and q.w.dim() == 3
            and q.w.dtype in (torch.int32, torch.uint32) and q.shape[2] % 32 == 0
            and q.w.shape[2] * 32 == q.shape[2] * q.bits
            and (q.mode != "affine" or q.biases is not None))


def check_pair(a: ExpertQuant, b: ExpertQuant) -> None:
    """gate and up must match to share the fused gate/up launch."""
    if (a.shape != b.shape or a.mode != b.mode or a.bits != b.bits or a.group != b.group
            or (a.global_scale is None) != (b.global_scale is None)
            or (a.bias is None) != (b.bias is None)):
        raise ValueError("moe_gate_up: gate and up must share shape and quantization")


def same_format(a: ExpertQuant, b: ExpertQuant) -> bool:
    try:
        check_pair(a, b)
    except ValueError:
        return False
    return True


def linear_stack(weight, bias: Tensor | None = None) -> ExpertQuant | None:
    """A Linear's weight as a one-expert stack [1, N, K] the MoE kernels read (views, no
    copy): a float tensor [N, K], or a QuantWeight with its packed words (None where the
    loader dropped them, or the format is not one the kernels read); bias [N] as the expert
    bias."""
    if isinstance(weight, Tensor):
        if weight.dim() != 2:
            return None
        q = ExpertQuant(weight.unsqueeze(0), None, None, None, None, "dense", 32,
                        weight.shape[1])
    else:
        packed, sp = getattr(weight, "packed", None), getattr(weight, "spec", None)
        if packed is None or sp is None:
            return None
        gs = weight.global_scale
        q = ExpertQuant(packed.unsqueeze(0), weight.scales.unsqueeze(0),
                        None if weight.biases is None else weight.biases.unsqueeze(0),
                        None if gs is None else gs.reshape(1), None, sp.mode, sp.bits,
                        sp.group_size)
    if not kernels_take(q):
        return None
    return q._replace(bias=None if bias is None else bias.unsqueeze(0))


def shared_stacks(gate_up, down) -> tuple[ExpertQuant, ExpertQuant, ExpertQuant] | None:
    """A shared expert's Linears (gate_up: [gate; up] rows stacked, down) as one-expert
    (gate, up, down) stacks, or None where `linear_stack` reads either not."""
    g2 = linear_stack(getattr(gate_up, "weight", None), getattr(gate_up, "bias", None))
    d = linear_stack(getattr(down, "weight", None), getattr(down, "bias", None))
    if g2 is None or d is None or g2.shape[1] % 2:
        return None
    f = g2.shape[1] // 2

    def rows(t, a):
        return None if t is None else t[:, a:a + f]

    gate, up = (g2._replace(w=rows(g2.w, a), scales=rows(g2.scales, a),
                            biases=rows(g2.biases, a), bias=rows(g2.bias, a)) for a in (0, f))
    return gate, up, d
