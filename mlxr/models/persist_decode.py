"""The single-token decode step with one launch per layer (`mlxr.ops.triton_persist`).

Each layer runs as one persistent kernel that walks the layer's phases (norm + qkv GEMV, q/k
norm + RoPE + KV write, attention, split merge, o GEMV, norm + gate_up GEMV, act + down GEMV)
with a grid-wide barrier between phases, instead of ~10 launches: batch-1 decode of a small
model is launch-bound (docs/perf.md). Every phase is the body of the kernel the generic loop
launches for it, so the values are those of the fused step (`mlxr.models.fused_decode`: the
norms in the GEMV prologues), which differ from the generic loop's only in the norm
statistics' summation order.

Opt-in (`MLXR_DECODE_PERSIST=1`, read when a step is built or captured) and not yet timed:
the grid barrier's cost on the H200 is what `benchmarks/gpu_persist_probe.py` measures first.
Serves what `fused_decode.structure_ok` accepts, without sliding-window layers, every
projection of one group size.
"""

from __future__ import annotations

import os

import torch

from . import fused_decode


def eligible(dec) -> bool:
    if os.environ.get("MLXR_DECODE_PERSIST") != "1" or os.environ.get("MLXR_Q4GEMV") == "0":
        return False
    if not fused_decode.structure_ok(dec) or any(w is not None for w in dec.config.layer_window):
        return False
    groups = {lin.weight.spec.group_size for layer in dec.layers
              for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down_proj)}
    return len(groups) == 1


def run(dec, ids: torch.Tensor, tables: dict, pool, slots: torch.Tensor,
        visible: torch.Tensor) -> torch.Tensor:
    """One token (ids [1], device) at cache slot `slots` [1]; visible [S] bool, the keys it
    attends to. Returns logits float32 [1, V]."""
    from ..ops import triton_persist, triton_q4gemv

    c = dec.config
    names = ("qkv", "o_proj", "gate_up", "down_proj")
    group = dec.layers[0].qkv.weight.spec.group_size
    counter = triton_persist.new_counter(dec.device)  # a memset per CUDA-graph replay
    h = dec.embed_tokens(ids).reshape(-1)  # [E]
    m = None  # the MLP output not yet added to h
    for i, layer in enumerate(dec.layers):
        rope = dec.ropes[i]
        cos, sin = tables[id(rope.spec)]
        qw = {n: (getattr(layer, n).weight.q4, getattr(layer, n).weight.q4_sb) for n in names}
        h, m = triton_persist.decode_layer(h, m, layer, qw, cos, sin, rope.spec.traditional,
                                           rope.scale, pool.k[i], pool.v[i], slots, visible, c,
                                           group, counter)
    head = dec.head.weight
    logits = torch.empty(dec.head.out_features, dtype=torch.float32, device=dec.device)
    triton_q4gemv.q4gemv(h, head.q4, head.scales, head.biases, group=head.spec.group_size,
                         sb=head.q4_sb, r=m, norm=dec.norm, eps=c.rms_norm_eps,
                         offset=c.norm_offset, h_out=torch.empty_like(h), out=logits)
    return dec.cap_logits(logits)[None]
