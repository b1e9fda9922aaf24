"""The MoE block's tensors: router, stacked experts, shared expert, checked against the config.

Experts come as mlx-lm saves them (its `sanitize` stacks per-expert tensors): one tensor per
projection, `<block>.<experts>.{gate,up,down}_proj.weight` [X, out, in] (float) or packed
[X, out, in*bits/32] with scales (and affine biases) [X, out, in/group], nvfp4 optionally a
per-expert `global_scale` [X] float32; gpt-oss adds `.bias` [X, out]. Each is checked whole
against the config (shape, dtype) before it is read, then sliced per expert.
"""

from __future__ import annotations

import os

import torch

from ..config import ModelConfig
from .moe import MoeBlock, StackedExperts


def _expert_parts(b, path: str, experts: int, out: int, inp: int, bias: bool,
                  stacked: bool) -> list | StackedExperts:
    """Expert e's weight (a float [out, in] or a RawQuant of its slices) and its bias, for
    e < experts; or, `stacked`, all of them as the file holds them."""
    w = b.weight(path, out, inp, lead=(experts,))
    bs = (b.float_tensor(path + ".bias", (experts, out)) if bias else None)
    if stacked and not b.dry_run:
        if isinstance(w, torch.Tensor):
            return StackedExperts(w, b.dtype, bias=bs)
        dev = b.device
        return StackedExperts(w.weight.to(dev), b.dtype, w.spec, w.scales.to(dev),
                              None if w.biases is None else w.biases.to(dev),
                              None if w.global_scale is None else w.global_scale.to(dev), bs)
    parts = []
    for e in range(experts):
        we = w[e] if isinstance(w, torch.Tensor) else w._replace(
            weight=w.weight[e], scales=w.scales[e],
            biases=None if w.biases is None else w.biases[e],
            global_scale=None if w.global_scale is None else w.global_scale[e])
        parts.append((we, None if bs is None else bs[e]))
    return parts


def build_moe(b, c: ModelConfig, i: int, model: str = "model.") -> MoeBlock | None:
    """Layer i's MoE block from builder `b` (`loader._Builder`); None on a dry run (every
    tensor checked, none read). `model`: the text model's prefix (the hybrid wrappers' files
    hold it under language_model.model.). Experts are stacked (`StackedExperts`) on CUDA,
    per expert elsewhere; env MLXR_MOE=stacked|split chooses."""
    s = c.moe
    e, f, x = c.hidden_size, s.expert_size, s.num_experts
    p = f"{model}layers.{i}." + (f"{s.block}." if s.block else "")
    ex = p + s.experts_path + "."
    router = b.linear([(p + s.router_path, x, e, s.router_bias)])
    corr = None
    if s.correction_bias:
        name = p + "gate.e_score_correction_bias"
        b.float_tensor(name, (x,))  # checked; read in float32 below
        if not b.dry_run:  # mlx-lm keeps it in float32 (cast_predicate); bf16 widens exactly
            corr = b.load(name).to(device=b.device, dtype=torch.float32)
    mode = os.environ.get("MLXR_MOE", "stacked" if b.cuda else "split")
    if mode not in ("stacked", "split"):
        raise ValueError(f"MLXR_MOE={mode!r}: expected stacked or split")
    stacked = mode == "stacked"
    gates = _expert_parts(b, ex + "gate_proj", x, f, e, s.expert_bias, stacked)
    ups = _expert_parts(b, ex + "up_proj", x, f, e, s.expert_bias, stacked)
    downs = _expert_parts(b, ex + "down_proj", x, e, f, s.expert_bias, stacked)
    shared = [None, None]
    if s.shared_size:
        sp = p + "shared_expert."
        shared = [b.linear([(sp + "gate_proj", s.shared_size, e, False),
                            (sp + "up_proj", s.shared_size, e, False)], glu=True),
                  b.linear([(sp + "down_proj", e, s.shared_size, False)])]
    shared_gate = b.linear([(p + "shared_expert_gate", 1, e, False)]) if s.shared_gate else None
    if b.dry_run:
        return None
    if stacked:
        return MoeBlock(s, router, corr, [gates, ups], [downs], *shared, shared_gate)
    gate_up = [b.stack([g, u], [gb, ub] if gb is not None else [None, None], glu=True)
               for (g, gb), (u, ub) in zip(gates, ups)]
    down = [b.stack([d], [db]) for d, db in downs]
    return MoeBlock(s, router, corr, gate_up, down, *shared, shared_gate)

