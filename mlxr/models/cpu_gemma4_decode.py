"""The CPU decode step of Gemma 4 (gemma4_text, gemma4's text part): `Gemma4Decoder._layers`
for a step of a few rows with the generic loop's values bit for bit, in fewer, larger calls.

A Gemma-4-E2B decode step (35 layers) spends ~25 ms of one core outside its GEMVs (docs/perf.md,
"Session 22: Gemma 4 CPU decode"): eight RMSNorms per layer (the four sandwich norms, q / k / v
and the next input norm), ~8 torch calls each, the GeGLU's gelu and product, and the
projections' wrappers. Here, for bf16:

* every RMSNorm is one C call (`fused.add_rms_norm` with no residual, rows [N, E] or the heads
  as rows [N H, D]): torch's float32 sum order and roundings (`fused.lanes`), checked at
  build against the torch twins (`fused.ready`);
* the residual adds and the layer scalar stay torch's bf16 ops (one call each; a norm's input
  is the sum rounded to bf16, so splitting the add from the norm changes no value);
* gelu_tanh(gate) * up is one C call over the [gate | up] projection (`fused.act_mul`) with
  the table of torch's vector-loop values (`fused.vector_act_table`), taken where every MLP's
  width is a multiple of `fused.VECTOR_ROW` (torch runs no scalar tail there);
* the projections call mlxr's or torch's int4 kernel directly (`cpu_decode._matmul`), also in
  the attention closures (`projections`) and for the LM head.

float32 models take only the direct projections (the same kernels on the same inputs). MoE
layers (the 26B-A4B variant) keep the generic loop. Env `MLXR_CPU_DECODE=0` (read per step)
selects the generic loop, `MLXR_CPU_FUSED=0` the torch norms and activation; `MLXR_CPU_ATTEND=1`
(off by default: another summation order) the compiled decode attention (`attention_fn`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import ops
from ..ops.cpu import fused, native
from ..ops.recurrent.reference import _scalar
from ..quant import QuantWeight
from . import cpu_decode

MAX_ROWS = 16  # a decode step's rows (one per sequence); prefill keeps the generic loop


@dataclass(frozen=True)
class _LayerPlan:
    """One layer's projections, named as `Gemma4Layer`'s (x [N, in] -> [N, out]); kv None on a
    KV-shared layer, ple_gate / ple_proj None without per-layer embeddings."""

    q_proj: Callable[[Tensor], Tensor]
    kv: Callable[[Tensor], Tensor] | None
    o_proj: Callable[[Tensor], Tensor]
    gate_up: Callable[[Tensor], Tensor]
    down_proj: Callable[[Tensor], Tensor]
    ple_gate: Callable[[Tensor], Tensor] | None
    ple_proj: Callable[[Tensor], Tensor] | None


@dataclass(frozen=True)
class _Plan:
    """layers: per layer; head: the LM head; fused: the C norms serve this decoder (bf16,
    checked); act: `fused.vector_act_table` of the MLP activation, None where it does not serve
    (then torch's gated_act)."""

    layers: list[_LayerPlan]
    head: Callable[[Tensor], Tensor]
    fused: bool
    act: Tensor | None


def _in_features(lin) -> int:
    w = getattr(lin, "weight", None)
    if isinstance(w, QuantWeight):
        return w.in_features
    return w.shape[-1] if isinstance(w, Tensor) else -1


def _build(dec) -> _Plan | None:
    if any(ly.moe is not None for ly in dec.layers):
        return None
    c, mm = dec.config, cpu_decode._matmul
    lps = [_LayerPlan(mm(ly.q_proj), None if ly.kv is None else mm(ly.kv), mm(ly.o_proj),
                      mm(ly.gate_up), mm(ly.down_proj),
                      None if ly.ple_gate is None else mm(ly.ple_gate),
                      None if ly.ple_proj is None else mm(ly.ple_proj)) for ly in dec.layers]
    norms = [dec.norm] + [w for ly in dec.layers
                          for w in (ly.input_norm, ly.post_attn_norm, ly.pre_mlp_norm,
                                    ly.post_mlp_norm, ly.q_norm, ly.k_norm, ly.ple_norm)
                          if w is not None]
    dims = {c.hidden_size, *dec.spec.head_dims} | ({dec.spec.ple_dim} if dec.ple else set())
    fz = (dec.dtype == torch.bfloat16 and all(w.dtype == torch.bfloat16 for w in norms)
          and all(fused.ready(e, 1, 1, 64, 64, False, False, "silu") for e in dims))
    widths = {_in_features(ly.down_proj) for ly in dec.layers}
    act = None
    if fz and all(w > 0 and w % fused.VECTOR_ROW == 0 for w in widths):
        act = fused.vector_act_table(c.hidden_act)
    return _Plan(lps, mm(dec.head), fz, act)


def plan(dec, rows: int) -> _Plan | None:
    """The lean plan for a step of `rows` rows (built once per decoder), or None where the
    generic loop runs: not the CPU, switched off, Triton kernels forced (tests), a prefill,
    MoE layers."""
    if (dec.device.type != "cpu" or rows > MAX_ROWS or not cpu_decode.enabled()
            or ops.fast_kernels(dec.device)):
        return None
    p = getattr(dec, "_cpu_gemma4_plan", False)
    if p is False:
        p = dec._cpu_gemma4_plan = _build(dec)
    return p


def projections(dec, rows: int) -> list:
    """Per layer, an object with the projections as `Gemma4Layer` names them: the lean plan's
    direct calls, or the layers themselves."""
    p = plan(dec, rows)
    return dec.layers if p is None else p.layers


def norm_fn(p: _Plan | None) -> Callable[[Tensor, Tensor, float], Tensor]:
    """`ops.rms_norm(x, w, eps)` over x [..., D]: one C call where the plan's norms serve."""
    if p is None or not p.fused or not fused.enabled():
        return ops.rms_norm

    def norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
        if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
            return ops.rms_norm(x, w, eps)
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        return fused.add_rms_norm(rows, None, w, eps)[1].view(x.shape)

    return norm


def attention_fn(p: _Plan | None):
    """`ops.attention` for the lean step: one token's attention (every key it is given
    visible: the caller passes the window's positions) on the compiled kernel
    (`native.attend`: float32 scores, softmax and sums, in another summation order than
    the reference's bmm) where env `MLXR_CPU_ATTEND=1`; off by default, since it can move a
    near-tie greedy token (the divergence: docs/perf.md, "Session 22: Gemma 4 CPU decode")."""
    if p is None or os.environ.get("MLXR_CPU_ATTEND", "") != "1" or not native.enabled():
        return ops.attention

    def attention(q: Tensor, keys: Tensor, values: Tensor, start: int, lo: int, scale: float,
                  window: int | None) -> Tensor:
        wide = (torch.float32, torch.bfloat16)
        if q.shape[0] != 1 or lo + keys.shape[1] != start + 1 or q.dtype not in wide \
                or keys.dtype not in wide or values.dtype != keys.dtype:
            return ops.attention(q, keys, values, start, lo, scale, window)
        out = native.attend(q[0].contiguous(), keys.contiguous(), values.contiguous(), None, 0,
                            keys.shape[1], scale)
        return out.unsqueeze(0)

    return attention


def _mlp(p: _Plan, lp: _LayerPlan, x: Tensor, act: str) -> Tensor:
    gu = lp.gate_up(x)
    if p.act is not None and fused.enabled() and gu.dtype == torch.bfloat16:
        return lp.down_proj(fused.act_mul(gu.contiguous(), p.act))
    gate, up = gu.chunk(2, dim=-1)
    return lp.down_proj(ops.gated_act(gate, up, act))


def layers(dec, p: _Plan, ids: Tensor, attend) -> Tensor:
    """`Gemma4Decoder._layers` (the same arguments, the same values): h [N, E] before the final
    norm."""
    c = dec.config
    eps, norm = c.rms_norm_eps, norm_fn(p)
    h = _scalar(dec.embed(ids), c.embed_scale)
    ple = dec._per_layer_inputs(ids, h) if dec.ple is not None else None
    x = norm(h, dec.layers[0].input_norm, eps)
    for i, (ly, lp) in enumerate(zip(dec.layers, p.layers, strict=True)):
        h = h + norm(attend(i, ly, x), ly.post_attn_norm, eps)
        h = h + norm(_mlp(p, lp, norm(h, ly.pre_mlp_norm, eps), c.hidden_act),
                     ly.post_mlp_norm, eps)
        if ple is not None:
            g = ops.gated_act(lp.ple_gate(h), ple[:, i], c.hidden_act)
            h = h + norm(lp.ple_proj(g), ly.ple_norm, eps)
        h = h * ly.scalar
        if i + 1 < len(dec.layers):
            x = norm(h, dec.layers[i + 1].input_norm, eps)
    return h
