"""The single-token decode step with the op before each projection fused into its GEMV.

`Decoder.forward_static` (the single request's CUDA-graph decode step) runs this instead of the
generic layer loop when every projection qualifies (`eligible`): per layer

    qkv  = W_qkv  @ rms_norm(h + m_prev)      (writes h += m_prev)
    q    = qkv_rope_write(qkv)                (q/k norm, RoPE, KV-cache write)
    o    = W_o    @ attend(q)
    gu   = W_gu   @ rms_norm(h + o)           (writes h += o)
    m    = W_down @ act(gate) * up

i.e. three launches fewer per layer than the generic loop's (two add+norm kernels and the
gated activation go into the GEMVs' prologues: `mlxr.ops.matmul.decode_gemv_q4`). Every intermediate
vector is rounded where the generic loop rounds it; the norm's sum of squares is reduced in
another order than the add+norm kernel's, so a near-tie can pick another greedy token.

Opt-in (`MLXR_DECODE_FUSED=1`, read when a step is built or captured): on the H200 each program
recomputing its x tiles (and the norm's statistic) costs more than the launch it saves, except
on the smallest shapes: 0.6B decode 1,114 -> 1,121 tok/s, 8B 417 -> 311 (docs/perf.md).
"""

from __future__ import annotations

import os

import torch

from ..layers import Linear
from ..quant import QuantWeight


def _qualifies(lin, dtype: torch.dtype) -> bool:
    """A bias-free 4-bit projection with q4gemv's decode copy (built at load on CUDA)."""
    if not isinstance(lin, Linear) or lin.bias is not None:
        return False
    qw = lin.weight
    return (isinstance(qw, QuantWeight) and qw.q4 is not None
            and qw.compute_dtype == dtype)


def eligible(dec) -> bool:
    """Whether `run` serves this decoder: MLXR_DECODE_FUSED=1 and not MLXR_Q4GEMV=0 (read each
    time), CUDA with the Triton kernels, bf16/fp16, every projection (and the LM head) a 4-bit
    QuantWeight with a q4gemv copy and no bias, no sandwich norms or fp16 residual clipping
    (cached on the decoder)."""
    if os.environ.get("MLXR_DECODE_FUSED") != "1" or os.environ.get("MLXR_Q4GEMV") == "0":
        return False
    ok = getattr(dec, "_fused_eligible", None)
    if ok is None:
        from .. import ops

        c, dt = dec.config, dec.dtype
        ok = (dec.device.type == "cuda" and ops.fast_kernels(dec.device)
              and dt in (torch.bfloat16, torch.float16) and not c.clip_residual_fp16
              and _qualifies(dec.head, dt)
              and all(layer.post_attn_norm is None and layer.post_mlp_norm is None
                      and layer.moe is None and layer.head_gate is None
                      and layer.sinks is None and not c.layer_heads
                      and layer.mlp_input is None and layer.mlp_act is None
                      and all(_qualifies(p, dt) for p in (layer.qkv, layer.o_proj,
                                                          layer.gate_up, layer.down_proj))
                      for layer in dec.layers))
        dec._fused_eligible = ok
    return ok


def _gemv(lin: Linear, x: torch.Tensor, **kw) -> torch.Tensor:
    from ..ops.matmul import decode_gemv_q4

    qw = lin.weight
    return decode_gemv_q4.q4gemv(x, qw.q4, qw.scales, qw.biases, group=qw.spec.group_size,
                                sb=qw.q4_sb, **kw)


def run(dec, ids: torch.Tensor, tables: dict, pool, slots: torch.Tensor, attend) -> torch.Tensor:
    """One token (ids [1], device) through the decoder as `Decoder._run` computes it; K/V
    written at cache slot `slots` [1], which is also its position (tables: whole RoPE tables,
    indexed by it in the RoPE kernel). Returns logits float32 [1, V]."""
    from .. import ops

    c = dec.config
    eps, off = c.rms_norm_eps, c.norm_offset
    h = dec.embed_tokens(ids).reshape(-1)  # [E]
    m = None  # the MLP output not yet added to h
    for i, layer in enumerate(dec.layers):
        h_next = None if m is None else torch.empty_like(h)
        qkv = _gemv(layer.qkv, h, r=m, norm=layer.input_norm, eps=eps, offset=off,
                    h_out=h_next)
        h = h if h_next is None else h_next
        rope = dec.ropes[i]
        cos, sin = tables[id(rope.spec)]
        q = ops.qkv_rope_write(qkv[None], c.num_heads, c.num_kv_heads, c.head_dim,
                               layer.q_norm, layer.k_norm, eps, off, rope.scale, cos, sin,
                               rope.spec.traditional, pool.k[i], pool.v[i], slots, slots)
        o = _gemv(layer.o_proj, attend(i, q).reshape(-1))
        h_next = torch.empty_like(h)
        gu = _gemv(layer.gate_up, h, r=o, norm=layer.mlp_norm, eps=eps, offset=off,
                   h_out=h_next)
        h = h_next
        m = _gemv(layer.down_proj, gu, act=c.hidden_act)
    logits = torch.empty(dec.head.out_features, dtype=torch.float32, device=dec.device)
    _gemv(dec.head, h, r=m, norm=dec.norm, eps=eps, offset=off, h_out=torch.empty_like(h),
          out=logits)
    return dec.cap_logits(logits)[None]
