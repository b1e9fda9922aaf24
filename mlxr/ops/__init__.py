"""The single dispatch point for compute ops.

`mlxr.ops.reference` holds the plain-torch versions (the spec, the CPU path, the test oracle). On
CUDA tensors, with triton importable and MLXR_KERNELS != "torch" (read at each call), the per-layer
ops run as one Triton launch each (`mlxr.ops.layer.norm_rope_act`), behind the same signatures;
`paged_attention` (the batched decode step over the paged cache) runs `mlxr.ops.kv_attention.paged`;
`add_rms_norm` and `qkv_rope_write` (a layer's glue between its matmuls, fused) run
`mlxr.ops.layer.add_norm_qkv_rope`; `residual_norm` (a sandwich-normed residual) runs
`mlxr.ops.layer.residual_norm`. `attention` (eager, host positions) always runs the reference.
"""

from __future__ import annotations

import os

import torch

from . import reference
from .moe import reference as moe_reference
from .recurrent import reference as recurrent_reference
from .moe.reference import combine as moe_combine
from .moe.reference import expert_act as moe_expert_act
from .moe.reference import head_gate
from .moe.reference import route as moe_route
from .reference import attention, paged_items, prefill_tile

from .moe.operands import KERNEL_ACTS as MOE_KERNEL_ACTS
from .moe.operands import ExpertQuant
from .moe.operands import dense_experts as moe_dense_experts
from .moe.operands import kernels_take as moe_kernels_take
from .moe.operands import shared_stacks as moe_shared_stacks
from .moe.operands import same_format as moe_gate_up_pair

# mlxr.ops.layer.norm_rope_act, imported at the first CUDA call (triton is slow to import)
_fused = None


def _fast(x) -> bool:
    global _fused
    if not x.is_cuda or os.environ.get("MLXR_KERNELS", "").lower() == "torch":
        return False
    if _fused is None:
        try:
            from .layer import norm_rope_act
        except ImportError:  # pragma: no cover
            norm_rope_act = False
        _fused = norm_rope_act if norm_rope_act and norm_rope_act.HAVE_TRITON else False
    return bool(_fused)


def rms_norm(x, weight, eps: float, offset: float = 0.0):
    """x [..., E] -> x / rms(x) * (offset + weight) (see reference.rms_norm)."""
    if _fast(x):
        return _fused.rms_norm(x, weight, eps, offset)
    return reference.rms_norm(x, weight, eps, offset)


def rope(x, cos, sin, traditional: bool):
    """Rotate the first 2*cos.shape[-1] features of x [T, H, D] (see reference.rope)."""
    if _fast(x):
        return _fused.rope(x, cos, sin, traditional)
    return reference.rope(x, cos, sin, traditional)


def gated_act(gate, up, act: str):
    """act(gate) * up (see reference.gated_act)."""
    if _fast(gate):
        return _fused.gated_act(gate, up, act)
    return reference.gated_act(gate, up, act)


def attention_masked(q, k, v, visible, scale: float, softcap: float | None = None,
                     sinks=None):
    """GQA attention under a key-visibility mask (see reference.attention_masked; `sinks`
    [H]: gpt-oss's extra logit per head)."""
    if _fast(q):
        from .kv_attention.masked import attention_masked as fast
        return fast(q, k, v, visible, scale, softcap, sinks)
    return reference.attention_masked(q, k, v, visible, scale, softcap, sinks)


def attention_at(q, k, v, positions, window: int | None, scale: float,
                 softcap: float | None = None, sinks=None):
    """attention_masked with the visibility from the rows' positions (device [T]), causal and
    windowed: key slot j at position j (see reference.attention_at)."""
    if _fast(q):
        from .kv_attention.masked import attention_at as fast
        return fast(q, k, v, positions, window, scale, softcap, sinks)
    return reference.attention_at(q, k, v, positions, window, scale, softcap, sinks)


def paged_attention(q, k, v, block_tables, ctx_lens, block_size: int, scale: float,
                    window: int | None = None, softcap: float | None = None, sinks=None):
    """Decode attention of B sequences over a paged cache (see reference.paged_attention)."""
    if _fast(q):
        from .kv_attention.paged import paged_attention as fast
        return fast(q, k, v, block_tables, ctx_lens, block_size, scale, window, softcap,
                    sinks=sinks)
    return reference.paged_attention(q, k, v, block_tables, ctx_lens, block_size, scale, window,
                                     softcap, sinks)


def add_rms_norm(h, r, weight, eps: float, offset: float = 0.0):
    """(h + r, rms_norm(h + r)): a residual add and the norm after it (see reference)."""
    if _fast(h):
        from .layer.add_norm_qkv_rope import add_rms_norm as fast
        return fast(h, r, weight, eps, offset)
    return reference.add_rms_norm(h, r, weight, eps, offset)


def residual_norm(h, a, weight, eps: float, scalar=None, next_weight=None):
    """(h + rms_norm(a)) [* scalar] and the next norm of it (see reference.residual_norm): one
    launch where the dtypes agree (`layer.residual_norm`)."""
    if not _fast(h):
        return reference.residual_norm(h, a, weight, eps, scalar, next_weight)
    from .layer import residual_norm as fused
    if fused.supported(h, a, weight, scalar, next_weight):
        return fused.residual_norm(h, a, weight, eps, scalar, next_weight)
    h = h + rms_norm(a, weight, eps)  # mixed dtypes: the reference's ops, the norms on Triton
    if scalar is not None:
        h = h * scalar
    return h, None if next_weight is None else rms_norm(h, next_weight, eps)


def residual_linear_act(h, a, weight, eps: float, linear, up, act: str):
    """(h', act(linear(h')) * up) for h' = h + rms_norm(a, weight) (see
    reference.residual_linear_act). On CUDA with decode-sized rows, one launch
    (`layer.residual_gemv`; MLXR_GEMMA4_PLE_FUSED=0, read at each call, turns it off); else
    residual_norm, linear and gated_act one by one."""
    if _fast(h) and _ple_fused():
        from .layer import residual_gemv
        out = residual_gemv.residual_linear_act(h, a, weight, eps, linear, up, act)
        if out is not None:
            return out
    return reference.residual_linear_act(h, a, weight, eps, linear, up, act,
                                         norm=residual_norm, gate=gated_act)


def _ple_fused() -> bool:
    """MLXR_GEMMA4_PLE_FUSED (default on: 1.08-1.15x on the branch, +2.3% Gemma-4-E2B decode
    on an H100, docs/perf.md session 26; bf16 values may round one ulp apart, =0 restores the
    composed ops)."""
    return os.environ.get("MLXR_GEMMA4_PLE_FUSED", "1") != "0"


def linear_residual_norm(x, linear, h, weight, eps: float, scalar=None, next_weight=None):
    """residual_norm(h, linear(x), weight, eps, scalar, next_weight) (see
    reference.linear_residual_norm); one launch as `residual_linear_act` says."""
    if _fast(h) and _ple_fused():
        from .layer import residual_gemv
        out = residual_gemv.linear_residual_norm(x, linear, h, weight, eps, scalar,
                                                 next_weight)
        if out is not None:
            return out
    return reference.linear_residual_norm(x, linear, h, weight, eps, scalar, next_weight,
                                          norm=residual_norm)


def qkv_rope_write(qkv, n_heads: int, n_kv_heads: int, head_dim: int, q_norm, k_norm,
                   eps: float, offset: float, rope_scale: float, cos, sin, traditional: bool,
                   k_cache, v_cache, slots, positions=None):
    """q/k norm, RoPE and the KV-cache write of a fused qkv projection; returns q [N, H, D]
    (see reference.qkv_rope_write; `positions`: cos / sin are tables indexed by them)."""
    args = (qkv, n_heads, n_kv_heads, head_dim, q_norm, k_norm, eps, offset, rope_scale, cos,
            sin, traditional, k_cache, v_cache, slots, positions)
    if _fast(qkv):
        from .layer.add_norm_qkv_rope import qkv_rope_write as fast
        return fast(*args)
    return reference.qkv_rope_write(*args)


def split_qkv_norm_rope_write(q, kv, n_heads: int, n_kv_heads: int, head_dim: int, q_norm,
                              k_norm, v_norm, eps: float, cos, sin, traditional: bool,
                              k_eq_v: bool, k_cache, v_cache, slots, positions=None):
    """Gemma 4's q/k/v norms, RoPE and KV-cache write (see reference.split_qkv_norm_rope_write).
    On CUDA with MLXR_GEMMA4_QKV_FUSED=1 (read at each call; a captured step keeps what it
    was captured with) one launch (`layer.add_norm_qkv_rope`), else the norm, RoPE and copy
    ops one by one (7 launches on an unshared layer, 2 on a KV-shared one)."""
    args = (q, kv, n_heads, n_kv_heads, head_dim, q_norm, k_norm, v_norm, eps, cos, sin,
            traditional, k_eq_v, k_cache, v_cache, slots, positions)
    if _fast(q) and os.environ.get("MLXR_GEMMA4_QKV_FUSED") == "1":
        from .layer.add_norm_qkv_rope import split_qkv_norm_rope_write as fast
        return fast(*args)
    return reference.split_qkv_norm_rope_write(*args, norm=rms_norm, rotate=rope)


def paged_prefill_attention(q, k, v, block_tables, items, block_size: int, scale: float,
                            window: int | None = None, softcap: float | None = None,
                            sinks=None):
    """Causal attention of a mixed batch over a paged cache, by tiles of rows (see
    reference.paged_prefill_attention; `paged_items` makes the tiles)."""
    if sinks is not None:
        return reference.paged_prefill_attention(q, k, v, block_tables, items, block_size,
                                                 scale, window, softcap, sinks)
    if _fast(q):
        from .kv_attention.paged import paged_prefill_attention as fast
        return fast(q, k, v, block_tables, items, block_size, scale, window, softcap)
    return reference.paged_prefill_attention(q, k, v, block_tables, items, block_size, scale,
                                             window, softcap)


def conv1d_silu(x, state, weight):
    """Causal depthwise conv + SiLU with its rolling state (see recurrent_reference.conv1d_silu)."""
    if _fast(x):
        from .recurrent.gated_delta_scan import conv1d_silu as fast
        return fast(x, state, weight)
    return recurrent_reference.conv1d_silu(x, state, weight)


GDN_CHUNKED_MIN_TOKENS = 64  # one chunk: shorter calls stay sequential


def gdn_chunked(tokens: int) -> bool:
    """Whether a gated delta rule over `tokens` new tokens runs in the chunked form:
    MLXR_GDN_CHUNKED=1 (read at each call; off by default: the sequential form is mlx-lm's
    order) and at least GDN_CHUNKED_MIN_TOKENS tokens."""
    return (os.environ.get("MLXR_GDN_CHUNKED", "0") == "1"
            and tokens >= GDN_CHUNKED_MIN_TOKENS)


def gated_delta(q, k, v, g, beta, state):
    """The gated delta rule over T tokens, float32 state updated in place (see
    recurrent_reference.gated_delta; the chunked form where `gdn_chunked(T)`)."""
    chunked = gdn_chunked(q.shape[1])
    if _fast(q):
        if chunked:
            from .recurrent.gated_delta_chunked import gated_delta_chunked as fast
        else:
            from .recurrent.gated_delta_scan import gated_delta as fast
        return fast(q, k, v, g, beta, state)
    if chunked:
        return recurrent_reference.gated_delta_chunked(q, k, v, g, beta, state)
    return recurrent_reference.gated_delta(q, k, v, g, beta, state)


def gated_delta_decode(proj, conv_state, ssm_state, conv_w, a_log, dt_bias, norm_w,
                       heads: tuple[int, int, int, int], eps: float, rows=None):
    """The gated DeltaNet mixer's decode step, projection rows [B, P] -> out_proj's input
    [B, Hv*Dv], states updated in place (`rows` [B]: at those rows of state pools): one
    Triton launch where the head dims fit (`recurrent.gated_delta_decode`), else the
    reference ops composed."""
    args = (proj, conv_state, ssm_state, conv_w, a_log, dt_bias, norm_w, heads, eps, rows)
    if _fast(proj):
        from .recurrent import gated_delta_decode as fused
        if fused.supported(proj, conv_state, ssm_state, conv_w, heads):
            return fused.gated_delta_decode(*args)
    return recurrent_reference.gated_delta_decode(*args)


def moe_experts(x, ids, weights, gate, up, down, act: str, alpha: float, limit: float,
                out_dtype, routed_scale: float = 1.0):
    """The routed experts' weighted sum [T, E] by the MoE kernels: x [T, E_in], ids / weights
    [T, k] on the device; the decode kernels up to `decode_split.decode_max_pairs` (token,
    slot) pairs (MLXR_MOE_DECODE, default onepass: `moe.decode_onepass`, gate/up and down +
    combine one launch each, up to 64 pairs; where a step does not fit its counters,
    `moe.decode_split` up to its 16; =split: `moe.decode_split`, launch configs from the env),
    beyond (MLXR_MOE_GROUPED, default auto): the
    in-kernel dequant grouped GEMM (`moe.grouped_fused`: 2/4/8-bit codes or dense experts,
    bf16 compute, `_fused_preferred`; =fused always), dequant + torch._grouped_mm in bf16
    (`moe.grouped_mm`; =mm always), else the grouped Triton GEMM (`moe.grouped_experts`:
    fp32, 3/5/6-bit; =triton always)."""
    from .moe import decode_split as dec
    from .moe import grouped_mm

    pairs, kernels = ids.numel(), dec.decode_kernels()  # (the env read once a call)
    if pairs <= dec.decode_max_pairs(kernels):
        from .moe import decode_onepass as one
        if kernels == "onepass" and one.fits(ids, gate, down):
            h = one.moe_gate_up_onepass(x, ids, gate, up, act, alpha, limit)
            return one.moe_down_onepass(h, ids, weights, down, out_dtype, routed_scale)
        if kernels != "onepass" or pairs <= dec.D.MAX_PAIRS:
            h = dec.moe_gate_up_split(x, ids, gate, up, act, alpha, limit)
            return dec.moe_down_split(h, ids, weights, down, out_dtype, routed_scale)
    args = (x, ids, weights, gate, up, down, act, alpha, limit, out_dtype, routed_scale)
    mode = grouped_mm.grouped_mode()
    if mode in ("auto", "fused"):
        from .moe import grouped_fused
        if (all(grouped_fused.fused_takes(q) for q in (gate, up, down))
                and (mode == "fused" or _fused_preferred(x, ids.numel(), gate))):
            return grouped_fused.moe_grouped_fused(*args)
    if grouped_mm.mm_takes(x, ids.numel(), gate, up, down):
        return grouped_mm.moe_grouped_mm(*args)
    from .moe.grouped_experts import moe_grouped
    return moe_grouped(*args)


def moe_experts_shared(x, ids, weights, gate, up, down, shared, act: str, out_dtype,
                       routed_scale: float = 1.0):
    """The routed experts' weighted sum plus the shared expert (its gate, up, down
    `ExpertQuant`s of one expert, a SiLU-GLU without a gate of its own) in the onepass
    kernels' two launches (`moe.decode_onepass`), or None where that does not apply: only
    with MLXR_MOE_DECODE=onepass, SiLU experts, at most `decode_max_pairs` pairs, the shared
    stacks in the routed ones' format and shape."""
    from .moe import decode_onepass as one
    from .moe import decode_split as dec

    if (dec.decode_kernels() != "onepass" or act != "silu" or shared is None
            or ids.numel() > dec.decode_max_pairs("onepass")
            or not one.fits(ids, gate, down, True)
            or not all(one.shared_fits(r, q) for r, q in zip((gate, up, down), shared))):
        return None
    h = one.moe_gate_up_onepass(x, ids, gate, up, act, shared=shared[:2])
    return one.moe_down_onepass(h, ids, weights, down, out_dtype, routed_scale,
                                shared=shared[2])


def moe_router(x, weight, bias, router: str, top_k: int, norm_topk: bool, softcap: float,
               score_func: str, correction_bias):
    """The router Linear (weight, bias) and `moe_route` in one launch (`moe.router`), or None
    where it does not apply: MLXR_MOE_ROUTER=torch (read at each call; default fused: 2.8-3.9x
    faster than the Linear and torch's route on an H100 at T = 1..16, same expert sets, ids
    in the same order but among tied scores), CUDA with Triton kernels, at most
    `router.MAX_TOKENS` rows, a weight format the kernel reads."""
    if (os.environ.get("MLXR_MOE_ROUTER", "fused").lower() != "fused" or not _fast(x)
            or x.shape[0] > 16):
        return None
    from .moe import router as fused_router
    q = fused_router.router_quant(weight, bias)
    if q is None or q.shape[2] != x.shape[1]:
        return None
    return fused_router.moe_router(x, q, router, top_k, norm_topk, softcap, score_func,
                                   correction_bias)


def _fused_preferred(x, pairs: int, gate) -> bool:
    """MLXR_MOE_GROUPED=auto: the fused grouped GEMM in bf16 compute (the dtype the H200
    checked and timed; float32 and float16 keep the grouped kernel); for fp4 / fp8 stacks
    up to 8192 pairs, where the H200 measured it ahead of mm (Qwen3-30B-A3B layer, T = 512:
    0.59 vs 0.99 ms; T = 2048, 16384 pairs: 1.58 vs 1.40); affine at every size (T = 2048:
    1.01 vs 1.43)."""
    if x.dtype != torch.bfloat16:
        return False
    return gate.mode in ("affine", "dense") or pairs <= 8192


def fast_kernels(device) -> bool:
    """Whether ops on `device` run as Triton kernels (every op capturable in a CUDA graph)."""
    return _fast(torch.empty(0, device=device))


__all__ = ["MOE_KERNEL_ACTS", "ExpertQuant", "add_rms_norm", "attention", "attention_at",
           "attention_masked",
           "conv1d_silu", "fast_kernels", "gated_act", "gated_delta", "gated_delta_decode",
           "gdn_chunked",
           "head_gate", "linear_residual_norm", "moe_combine", "moe_dense_experts",
           "moe_expert_act", "moe_experts",
           "moe_experts_shared",
           "moe_gate_up_pair", "moe_kernels_take", "moe_shared_stacks",
           "moe_reference", "moe_route", "moe_router", "paged_attention", "paged_items",
           "residual_linear_act",
           "paged_prefill_attention", "prefill_tile", "qkv_rope_write", "residual_norm", "rms_norm",
           "rope", "split_qkv_norm_rope_write"]
