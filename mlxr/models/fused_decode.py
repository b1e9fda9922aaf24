"""The single-token decode step with each projection's preceding op fused into its GEMV.

`Decoder.forward_static` (the single request's CUDA-graph decode step) runs this instead of the
generic layer loop when every projection qualifies (`eligible`): per layer

    qkv  = W_qkv  @ rms_norm(h + m_prev)      (writes h += m_prev)
    q    = qkv_rope_write(qkv)                (q/k norm, RoPE, KV-cache write)
    o    = W_o    @ attend(q)
    gu   = W_gu   @ rms_norm(h + o)           (writes h += o)
    m    = W_down @ act(gate) * up

i.e. 7 launches instead of 10 (`mlxr.ops.triton_fgemv`: batch-1 decode of a small model is
launch-bound, docs/perf.md). The values of every intermediate vector are those of the generic
loop (same rounding points); only the GEMVs' fp32 summation order differs from the generic
path's matmul kernels, so greedy tokens can differ at near-ties.

Opt-in (`MLXR_DECODE_FGEMV=1`, read when a step is built or captured): on the H200 the fused
GEMV is faster than tinygemm on o_proj but still slower on qkv, gate_up, down and the LM head
(0.6B: 4.2-6.3 vs 3.5-4.5 us; docs/perf.md), so the step as a whole is not yet faster (0.6B
decode 1,054 vs 1,093 tok/s). The GPU parity test of graph decode against prefill passed with
it on, on every fixture it serves.
"""

from __future__ import annotations

import os

import torch

from ..layers import Linear
from ..quant import QuantWeight


def _qualifies(lin, dtype: torch.dtype) -> bool:
    from ..ops import triton_fgemv

    if not isinstance(lin, Linear) or lin.bias is not None:
        return False
    qw = lin.weight
    return (isinstance(qw, QuantWeight) and qw.spec.mode == "affine" and qw.packed is not None
            and qw.global_scale is None and qw.compute_dtype == dtype
            and triton_fgemv.supported(qw.spec.bits, qw.spec.group_size, qw.in_features, dtype))


def eligible(dec) -> bool:
    """Whether `run` can serve this decoder: CUDA with the Triton kernels, bf16/fp16, every
    projection (and the LM head) an affine 2/4/8-bit QuantWeight without bias, no sandwich
    norms or fp16 residual clipping, and the opt-in switch set. Cached on the decoder; the
    switch is read each time."""
    if os.environ.get("MLXR_DECODE_FGEMV", "0") != "1":
        return False
    ok = getattr(dec, "_fgemv_eligible", None)
    if ok is None:
        from .. import ops

        c, dt = dec.config, dec.dtype
        ok = (dec.device.type == "cuda" and ops.fast_kernels(dec.device)
              and dt in (torch.bfloat16, torch.float16) and not c.clip_residual_fp16
              and _qualifies(dec.head, dt)
              and all(layer.post_attn_norm is None and layer.post_mlp_norm is None
                      and all(_qualifies(p, dt) for p in (layer.qkv, layer.o_proj,
                                                          layer.gate_up, layer.down_proj))
                      for layer in dec.layers))
        dec._fgemv_eligible = ok
    return ok


def _gemv(lin: Linear, **kw) -> torch.Tensor:
    from ..ops import triton_fgemv

    qw = lin.weight
    return triton_fgemv.fgemv(qw.packed, qw.scales, qw.biases, bits=qw.spec.bits,
                              group=qw.spec.group_size, **kw)


def run(dec, ids: torch.Tensor, tables: dict, pool, slots: torch.Tensor, attend) -> torch.Tensor:
    """One token (ids [1], device) through the decoder as `Decoder._run` computes it; K/V
    written at cache slot `slots` [1]. Returns logits float32 [1, V]."""
    from .. import ops

    c = dec.config
    eps, off = c.rms_norm_eps, c.norm_offset
    h = dec.embed_tokens(ids).reshape(-1)  # [E]
    m = None  # the MLP output not yet added to h
    for i, layer in enumerate(dec.layers):
        h_next = h if m is None else torch.empty_like(h)
        qkv = _gemv(layer.qkv, x=h, r=m, norm=layer.input_norm, eps=eps, offset=off,
                    h_out=h_next)
        h = h_next
        rope = dec.ropes[i]
        cos, sin = tables[id(rope.spec)]
        q = ops.qkv_rope_write(qkv[None], c.num_heads, c.num_kv_heads, c.head_dim,
                               layer.q_norm, layer.k_norm, eps, off, rope.scale, cos, sin,
                               rope.spec.traditional, pool.k[i], pool.v[i], slots)
        o = _gemv(layer.o_proj, x=attend(i, q).reshape(-1).contiguous())
        h_next = torch.empty_like(h)
        gu = _gemv(layer.gate_up, x=h, r=o, norm=layer.mlp_norm, eps=eps, offset=off,
                   h_out=h_next)
        h = h_next
        m = _gemv(layer.down_proj, x=gu, act=c.hidden_act)
    logits = torch.empty(dec.head.out_features, dtype=torch.float32, device=dec.device)
    _gemv(dec.head, x=h, r=m, norm=dec.norm, eps=eps, offset=off, h_out=torch.empty_like(h),
          out=logits)
    return dec.cap_logits(logits)[None]
