"""The CPU decode step: one new token per sequence, with the generic layer loop's numbers and
fewer, larger torch ops.

`Decoder.forward_step` runs this instead of `Decoder._run` on the CPU when every sequence of the
step adds one token and the decoder qualifies (`eligible`): the single request's decode and the
serving engine's decode batches. A decode step of Qwen3-0.6B spent about half its time outside
the int4 GEMVs: attention, and ~110 torch calls per layer of a few microseconds each
(docs/perf.md, "CPU decode"). Per layer this runs the same arithmetic in two thirds of the
calls:

* projections call torch's int4 kernel directly (`_matmul`: no reshape / dtype / dispatch
  wrapper per call; other storages keep `Linear`);
* the q and k heads are normed (each with its own weight, stacked [H + K, D] at build time) and
  rotated in one pass over [N, H + K, D] instead of one per tensor;
* RoPE is `x * C + swap(x) * S` with C = [cos, cos], S = [-sin, sin] gathered from tables
  built once: in float32 each term rounds as `x1 * c - x2 * s` does (a negated product is
  exact), so the rotated values are the reference's bit for bit.

Every intermediate is rounded where `ops.reference` rounds it. With env `MLXR_CPU_KERNELS=0`
the logits equal the generic loop's bit for bit (tests/test_cpu_decode.py). By default the
compiled kernels (`mlxr.ops.cpu`) also run, for bf16:

* around the GEMVs (`fused`: the residual adds with the RMSNorms, the q/k norms with RoPE and
  the cache write, act(gate) * up): the torch path's values bit for bit, in one C call each
  instead of ~50 torch calls per layer (tests/test_cpu_fused.py; `MLXR_CPU_FUSED=0` off);
* the matmuls where they measured faster (`qmm` for `quant.cpu.KERNEL_ROWS`, `i4mm` over the
  int4 copy of affine weights up to `quant.cpu.I4MM_MAX_M` rows; in both paths);
* attention (`native.attend_enabled`: by default in layers whose matmuls run those kernels):
  q . K in float32 reading the bf16 cache in place (torch needs float32 copies of the K/V
  slices, or a bf16 GEMM that rounds the scores), float32 softmax and P . V, rounded where
  the reference rounds.

The kernel matmuls and attention sum float32 terms in another order, so an output can round
to the neighbouring bf16 value: the logits stay within the bf16 tolerance of the generic
loop's (measured < 0.5% of the logit range; tests/test_cpu_kernels.py).

Not taken (the generic loop runs): the float32 exact mode (its parity path stays as it is),
sliding windows, logit soft-caps, attention sinks, head gates, sandwich norms and gemma3's
fp16 residual clipping. Env `MLXR_CPU_DECODE=0` (read per step) selects the generic loop, for
A/B runs (benchmarks/cpu/cpu_decode_bench.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import ops
from ..layers import Linear
from ..ops.cpu import fused, native, twins
from ..quant import QuantWeight


def enabled() -> bool:
    return os.environ.get("MLXR_CPU_DECODE", "") != "0"


def _matmul(lin) -> Callable[[Tensor], Tensor]:
    """x [N, in] (compute dtype, contiguous) -> [N, out] for one projection: torch's int4
    kernel called directly where `QuantWeight.linear` would call it for a few rows (the same
    kernel, the same inputs: the same values), else the projection itself."""
    qw = lin.weight if isinstance(lin, Linear) and lin.bias is None else None
    from ..quant import cpu

    if isinstance(qw, QuantWeight) and qw.ckern is not None:  # mlxr.ops.cpu's kernel
        kern = qw.ckern
        return lambda x: kern(x) if x.shape[0] <= kern.max_m and native.enabled() else lin(x)
    if not (isinstance(qw, QuantWeight) and qw.i4 is not None and qw.dense is None
            and qw.device.type == "cpu"):
        return lin
    w, sz, g, planes, max_m = qw.i4, qw.i4_sz, qw.spec.group_size, qw.planes, cpu.i4_max_m(qw)
    mm = torch._weight_int4pack_mm_for_cpu

    def one_plane(x: Tensor) -> Tensor:
        return mm(x, w, g, sz) if x.shape[0] < max_m else lin(x)

    def two_planes(x: Tensor) -> Tensor:  # plane 0 against x, plane 1 against x again
        return mm(x.repeat(1, 2), w, g, sz) if x.shape[0] < max_m else lin(x)

    return one_plane if planes == 1 else two_planes


@dataclass(frozen=True)
class _LayerPlan:
    qkv: Callable[[Tensor], Tensor]
    o: Callable[[Tensor], Tensor]
    gate_up: Callable[[Tensor], Tensor] | None
    down: Callable[[Tensor], Tensor] | None
    qk_norm: Tensor | None  # [H + K, D]: q_norm's row for each q head, then k_norm's (+offset)
    served: bool  # qkv runs mlxr's own matmul kernel (`native.attend_enabled` reads it)


@dataclass(frozen=True)
class _Plan:
    layers: list[_LayerPlan]
    head: Callable[[Tensor], Tensor]
    norms: list[Tensor]  # [E] each: input_norm, mlp_norm per layer, then the final norm (+off)
    fused: bool  # `mlxr.ops.cpu.fused` gives this decoder's values (checked at build)
    act: Tensor | None  # fused.act_table of the activation


@dataclass(frozen=True)
class _Rope:
    """Per rope spec: C = [cos, cos] and S = [-sin, sin] ([P, 2R] float32; traditional: the
    pairs interleaved), P the rope table's positions when built."""

    c: Tensor
    s: Tensor
    traditional: bool


def eligible(dec) -> bool:
    """Whether `run` serves this decoder (cached on it): CPU, a 16-bit compute dtype, no layer
    computed elsewhere (an ONNX region), no layer with a window, soft-cap, sinks, head gate,
    sandwich norms or fp16 residual clipping, no rope pre-scale or length-dependent (dynamic)
    frequencies, at most 64 query heads per kv head (more take the reference's SDPA branch)."""
    ok = getattr(dec, "_cpu_decode_ok", None)
    if ok is None:
        c = dec.config
        ok = (dec.device.type == "cpu" and dec.dtype in (torch.bfloat16, torch.float16)
              and not c.clip_residual_fp16 and c.attn_logit_softcap is None
              and all(w is None for w in c.layer_window)
              and max(c.heads(i) for i in range(len(dec.layers))) <= 64 * c.num_kv_heads
              and all(r.scale == 1.0 and not r.dynamic for r in dec.ropes)
              and all(layer.post_attn_norm is None and layer.post_mlp_norm is None
                      and layer.sinks is None and layer.head_gate is None
                      and not _elsewhere(layer)
                      and (layer.q_norm is None) == (layer.k_norm is None)
                      for layer in dec.layers))
        dec._cpu_decode_ok = ok
    return ok


def _elsewhere(layer) -> bool:
    """Whether (part of) the layer is computed outside mlxr's kernels (an ONNX region)."""
    return (layer.external is not None or layer.mlp_input is not None
            or layer.mlp_act is not None)


def served(lin) -> bool:
    qw = lin.weight if isinstance(lin, Linear) else None
    return isinstance(qw, QuantWeight) and qw.ckern is not None


def _plan(dec) -> _Plan:
    plan = getattr(dec, "_cpu_decode_plan", None)
    if plan is None:
        c, off = dec.config, dec.config.norm_offset
        layers = []
        for i, layer in enumerate(dec.layers):
            qk = None
            if layer.q_norm is not None:
                qn = layer.q_norm + off if off else layer.q_norm  # as rms_norm forms it
                kn = layer.k_norm + off if off else layer.k_norm
                qk = torch.cat([qn.expand(c.heads(i), -1), kn.expand(c.num_kv_heads, -1)])
            dense = layer.moe is None
            layers.append(_LayerPlan(_matmul(layer.qkv), _matmul(layer.o_proj),
                                   _matmul(layer.gate_up) if dense else None,
                                   _matmul(layer.down_proj) if dense else None, qk,
                                   served(layer.qkv)))
        norms = [w + off if off else w for layer in dec.layers
                 for w in (layer.input_norm, layer.mlp_norm)]
        norms.append(dec.norm + off if off else dec.norm)
        fz = dec.dtype == torch.bfloat16 and all(w.dtype == torch.bfloat16 for w in norms) \
            and all(fused.ready(c.hidden_size, c.heads(i), c.num_kv_heads, c.head_dim,
                                _rope_tables(dec.ropes[i], 1).c.shape[-1],
                                dec.ropes[i].spec.traditional, layer.q_norm is not None,
                                c.hidden_act) for i, layer in enumerate(dec.layers))
        dec._cpu_decode_plan = plan = _Plan(layers, _matmul(dec.head), norms, fz,
                                            fused.act_table(c.hidden_act) if fz else None)
    return plan


def _rope_tables(rope, need: int) -> _Rope:
    """C / S tables of a layer's rope covering positions [0, need), grown with its table."""
    cached = getattr(rope, "_cpu_cs", None)
    if cached is not None and cached.c.shape[0] >= need:
        return cached
    cos, sin = rope.cos_sin(0, max(need, 4096))
    if rope.spec.traditional:  # pairs (2i, 2i + 1): [c0, c0, c1, c1, ...], [-s0, s0, ...]
        c = cos.repeat_interleave(2, dim=-1)
        s = torch.stack((-sin, sin), dim=-1).flatten(-2)
    else:  # halves (i, i + R)
        c, s = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
    rope._cpu_cs = cached = _Rope(c.contiguous(), s.contiguous(), rope.spec.traditional)
    return cached


def _attend(q: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
    """One token's attention over its whole context: q [H, D], keys/values [K, S, D] (cache
    dtype) -> [H, D]; `reference.attention`'s decode branch (every key visible)."""
    kh, _, d = keys.shape
    qg = q.reshape(kh, -1, d).float()  # [K, rep, D]: head h = kv * rep + r
    scores = torch.bmm(qg * scale, keys.float().transpose(1, 2))  # [K, rep, S]
    out = torch.bmm(torch.softmax(scores, dim=-1), values.float())
    return out.reshape(-1, d).to(q.dtype)


def run(dec, ids: Tensor, step, pool) -> Tensor:
    """`Decoder.forward_step` for a step whose spans each add one token (ids [N]): logits
    float32 [rows, V], equal to the generic loop's."""
    c, plan = dec.config, _plan(dec)
    n, d = ids.shape[0], c.head_dim
    eps, off = c.rms_norm_eps, c.norm_offset
    pos = [sp.q_start for sp in step.spans]
    pos_t = torch.tensor(pos)
    tabs: dict[int, tuple[_Rope, Tensor, Tensor]] = {}
    for rope in dec.ropes:
        if id(rope.spec) not in tabs:
            rt = _rope_tables(rope, max(pos) + 1)
            tabs[id(rope.spec)] = (rt, rt.c.index_select(0, pos_t).unsqueeze(1),
                                   rt.s.index_select(0, pos_t).unsqueeze(1))
    slots = step.write_slots
    fz = (plan.fused and fused.enabled() and slots.dtype == torch.int64 and slots.is_contiguous()
          and int(slots.min()) >= 0)
    top = int(slots.max()) if fz else 0  # the C side writes the caches at these slots
    h = dec.embed_tokens(ids)
    fz = fz and h.dtype == torch.bfloat16
    if fz:  # layer.c's calls (`mlxr.ops.cpu.fused`): the same values in fewer calls
        h, x = fused.add_rms_norm(h.contiguous(), None, plan.norms[0], eps)
    else:
        x = ops.rms_norm(h, dec.layers[0].input_norm, eps, off)
    for i, (layer, lp) in enumerate(zip(dec.layers, plan.layers, strict=True)):
        heads, kvh = c.heads(i), c.num_kv_heads
        rt, cs, sn = tabs[id(dec.ropes[i].spec)]
        kc, vc = pool.k[i], pool.v[i]
        qkv = lp.qkv(x)
        if fz and qkv.dtype == kc.dtype == vc.dtype == torch.bfloat16 and kc.is_contiguous() \
                and vc.is_contiguous() and top < min(kc.shape[1], vc.shape[1]):
            q = fused.qk_rope(qkv.contiguous(), heads, kvh, lp.qk_norm, eps, rt.c, rt.s,
                              rt.traditional, pos_t, kc, vc, slots)
        else:
            qkv = qkv.view(n, heads + 2 * kvh, d)
            qk = twins.norm_rope(qkv[:, :heads + kvh], lp.qk_norm, eps, rt.traditional, cs, sn)
            kc.index_copy_(1, slots, qk[:, heads:].transpose(0, 1))
            vc.index_copy_(1, slots, qkv[:, heads + kvh:].transpose(0, 1))
            q = qk[:, :heads]
        a = _attention(c, q, kc, vc, step.spans, lp.served).reshape(n, heads * d)
        h, x = _add_norm(fz, h, lp.o(a), plan.norms[2 * i + 1], layer.mlp_norm, eps, off)
        if lp.gate_up is not None:
            gu = lp.gate_up(x)
            if fz and gu.dtype == torch.bfloat16:
                m = lp.down(fused.act_mul(gu, plan.act))
            else:
                gate, up = gu.chunk(2, dim=-1)
                m = lp.down(ops.gated_act(gate, up, c.hidden_act).contiguous())
        else:
            m = layer.moe(x)
        last = i + 1 == len(dec.layers)
        if last and step.logits_rows is not None:
            h, m = h.index_select(0, step.logits_rows), m.index_select(0, step.logits_rows)
        w = dec.norm if last else dec.layers[i + 1].input_norm
        h, x = _add_norm(fz, h, m, plan.norms[2 * i + 2], w, eps, off)
    return dec.cap_logits(plan.head(x).float())


def _add_norm(fz: bool, h: Tensor, r: Tensor, w_fused: Tensor, w: Tensor, eps: float,
              off: float) -> tuple[Tensor, Tensor]:
    """`ops.add_rms_norm(h, r, w, eps, off)`: one fused call where `fz` and r is in h's
    dtype (w_fused: w with the offset added, as the reference forms it)."""
    if fz and r.dtype == h.dtype:
        return fused.add_rms_norm(h, r.contiguous(), w_fused, eps)
    return ops.add_rms_norm(h, r, w, eps, off)


def _attention(c, q: Tensor, kc: Tensor, vc: Tensor, spans, served: bool) -> Tensor:
    """Each span's new token attending over its context: q [N, H, D] -> [N, H, D]; the
    compiled kernel where `native.attend_enabled(served)`."""
    heads = q.shape[1]
    outs = []
    kern = native.attend_enabled(served) and kc.is_contiguous() and vc.is_contiguous()
    for r, sp in enumerate(spans):
        ctx = sp.q_start + 1
        if kern:  # bf16 K/V read in place, float32 math (`native.attend`)
            a0 = sp.slot_range[0] if sp.slot_range is not None else 0
            sl = None if sp.slot_range is not None else sp.slots[:ctx].to(torch.int64)
            outs.append(native.attend(q[r].contiguous(), kc, vc, sl, a0, ctx, c.attn_scale))
            continue
        if sp.slot_range is not None:
            a = sp.slot_range[0]
            keys, values = kc[:, a:a + ctx], vc[:, a:a + ctx]
        else:
            sl = sp.slots[:ctx]
            keys, values = kc.index_select(1, sl), vc.index_select(1, sl)
        outs.append(_attend(q[r, :heads], keys, values, c.attn_scale))
    return outs[0].unsqueeze(0) if len(outs) == 1 else torch.stack(outs)
