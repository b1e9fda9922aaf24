"""Prefill / large-batch MoE on the tensor cores' library GEMM: every expert of a projection
dequantized to a dense bf16 stack [X, N, K] by the dense prefill's Triton dequant
(`matmul.prefill_dequant`, the stack read as [X*N, K/pack] rows), then `torch._grouped_mm`
(CUTLASS on sm90) over the (token, slot) pairs sorted by expert.

Steps, P = T*k pairs: sort the pairs by expert (stable: token order inside an expert), the
groups' ends `offs` = cumsum of the per-expert counts (int32, on the device: no host read, so
the step can be captured in a CUDA graph); gather x's rows [P, K]; gate and up as two grouped
GEMMs [P, F] (+ expert biases, rounded as the twin adds them), `moe_reference.expert_act`,
down [P, E] (+ bias), the rows scattered back to pair order and `moe_reference.combine` (the
same order as the Triton paths). The dequantized stacks are plain `torch.empty` buffers: the
caching allocator hands each layer the previous layer's blocks.

Numerics: the weights rounded once to bf16 (the grouped Triton kernel rounds them the same
way: its twin `grouped_experts.moe_grouped_ref`, `round_weights=True`, is this path's twin),
fp32 accumulation inside the GEMM, outputs rounded to bf16. The difference to the Triton
grouped kernel is the fp32 summation order only (and, on the GPU, a fused multiply-add in
the affine dequant that may move a weight by one bf16 unit where the fp32 value lies on a
rounding boundary). bf16 only: fp32 (the exact mode) and fp16 stay on the Triton kernel.

Selection (`mm_takes`): env MLXR_MOE_GROUPED = "mm" (default), "triton" or "fused"
(`grouped_fused`, the in-kernel dequant grouped GEMM); at least
MLXR_MOE_MM_MIN_PAIRS pairs (default 0: every batch past the decode kernels); while a CUDA
graph is being captured (the serving engine's batch buckets) only if MLXR_MOE_MM_GRAPHS is
not "0" (capture of the path is checked by scripts/moe_gpu_perf.py).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from . import reference as moe_reference
from .operands import ExpertQuant, check_pair

FP_FORMATS = {"mxfp4": (4, 32), "nvfp4": (4, 16), "mxfp8": (8, 32)}  # quant.fp.FP_MODES
AFFINE_BITS = (2, 3, 4, 5, 6, 8)  # prefill_dequant.DEQUANT_BITS


def grouped_mode() -> str:
    """MLXR_MOE_GROUPED: "auto" (default: `grouped_fused` where it reads the stacks, mm where
    it measured faster, see `ops.moe_experts`), "mm" (dequant + torch._grouped_mm), "fused"
    (`grouped_fused`) or "triton" (the grouped kernel of `grouped_experts`)."""
    mode = os.environ.get("MLXR_MOE_GROUPED", "auto").lower()
    return mode if mode in ("auto", "mm", "triton", "fused") else "auto"


def mm_min_pairs() -> int:
    """MLXR_MOE_MM_MIN_PAIRS: the fewest (token, slot) pairs that take the mm path."""
    return int(os.environ.get("MLXR_MOE_MM_MIN_PAIRS", "0"))


def dequant_takes(q: ExpertQuant) -> bool:
    """Whether `dequant_experts` reads this stack (the dense prefill dequant's formats, or
    unquantized "dense" experts: their weights as they are, cast once if not bf16)."""
    if q.mode == "dense":
        return True
    if q.mode == "affine":
        return q.bits in AFFINE_BITS and q.group in (32, 64, 128) and q.biases is not None
    return FP_FORMATS.get(q.mode) == (q.bits, q.group)


def _device_ok(dev: torch.device) -> bool:
    if dev.type != "cuda":
        return True  # the CPU build of _grouped_mm (tests, under the interpreter)
    return torch.cuda.get_device_capability(dev) >= (9, 0)


def _graphs_ok(dev: torch.device) -> bool:
    if dev.type != "cuda" or os.environ.get("MLXR_MOE_MM_GRAPHS", "1") != "0":
        return True
    return not torch.cuda.is_current_stream_capturing()


def mm_takes(x: Tensor, pairs: int, gate: ExpertQuant, up: ExpertQuant,
             down: ExpertQuant) -> bool:
    """Whether `moe_grouped_mm` serves this call (see the module doc)."""
    return (grouped_mode() in ("mm", "auto") and hasattr(torch, "_grouped_mm")
            and x.dtype == torch.bfloat16 and pairs >= mm_min_pairs()
            and all(dequant_takes(q) and q.shape[1] % 8 == 0 and q.shape[2] % 8 == 0
                    for q in (gate, up, down))
            and _device_ok(x.device) and _graphs_ok(x.device))


def dequant_experts(q: ExpertQuant, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """All X experts of q as dense [X, N, K] in dtype: one Triton pass over the stack as
    [X*N, K*bits/32] rows (nvfp4: each expert's global scale, one per N rows)."""
    from ..matmul.prefill_dequant import dequant_affine, dequant_fp

    if q.mode == "dense":
        return q.w if q.w.dtype == dtype else q.w.to(dtype)
    x, n, k = q.shape
    w = q.w.reshape(x * n, -1)
    s = q.scales.reshape(x * n, -1)
    if q.mode == "affine":
        flat = dequant_affine(w, s, q.biases.reshape(x * n, -1), k, q.bits, q.group, dtype)
    else:
        gs = q.global_scale
        flat = dequant_fp(w, s, None if gs is None else gs.float().contiguous(), q.mode, dtype,
                          gs_rows=0 if gs is None else n)
    return flat.view(x, n, k)


def sort_pairs(ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """ids [T, k] -> (order [P] long: pair indices sorted by expert, stable; experts [P]
    long: each sorted pair's expert; offs int32 [X]: each expert's end row)."""
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))  # bincount without its host read of max(ids)
    return order, flat.index_select(0, order), torch.cumsum(counts, 0).to(torch.int32)


def _project(rows: Tensor, w: Tensor, offs: Tensor, q: ExpertQuant, experts: Tensor) -> Tensor:
    """rows [P, K] (sorted by expert) @ w[e]^T -> [P, N] in rows.dtype, + the expert bias
    (rounded, as `expert_matmul_ref` adds it)."""
    y = torch._grouped_mm(rows, w.transpose(1, 2), offs=offs)
    if q.bias is not None:
        y = y + q.bias.index_select(0, experts).to(y.dtype)
    return y


def _check(x: Tensor, q: ExpertQuant) -> None:
    if x.dim() != 2 or x.shape[1] != q.shape[2]:
        raise ValueError(f"moe_grouped_mm: input {tuple(x.shape)} does not match K = "
                         f"{q.shape[2]}")


def _gate_up_sorted(x: Tensor, k: int, order: Tensor, experts: Tensor, offs: Tensor,
                    gate: ExpertQuant, up: ExpertQuant, act: str, alpha: float,
                    limit: float) -> Tensor:
    """h [P, F] of the pairs in sorted order (x's row pair // k for each)."""
    rows = x.index_select(0, order // k)  # [P, K] the sorted pairs' tokens
    g = _project(rows, dequant_experts(gate, x.dtype), offs, gate, experts)
    u = _project(rows, dequant_experts(up, x.dtype), offs, up, experts)
    return moe_reference.expert_act(g, u, act, alpha, limit)


def moe_grouped_mm_gate_up(x: Tensor, ids: Tensor, gate: ExpertQuant, up: ExpertQuant,
                           act: str, alpha: float = 1.702, limit: float = 7.0) -> Tensor:
    """h [T*k, F] in pair order, as `grouped_experts.moe_grouped_gate_up` (twin:
    `moe_grouped_gate_up_ref`)."""
    check_pair(gate, up)
    _check(x, gate)
    order, experts, offs = sort_pairs(ids, gate.shape[0])
    hs = _gate_up_sorted(x, ids.shape[1], order, experts, offs, gate, up, act, alpha, limit)
    return torch.empty_like(hs).index_copy_(0, order, hs)


def moe_grouped_mm_down(h: Tensor, ids: Tensor, down: ExpertQuant) -> Tensor:
    """y [T*k, E]: row p of h through expert ids.flat[p] (+ bias), as
    `grouped_experts.moe_grouped_down` (twin: `moe_grouped_down_ref`)."""
    _check(h, down)
    order, experts, offs = sort_pairs(ids, down.shape[0])
    ys = _project(h.index_select(0, order), dequant_experts(down, h.dtype), offs, down, experts)
    return torch.empty_like(ys).index_copy_(0, order, ys)


def moe_grouped_mm(x: Tensor, ids: Tensor, weights: Tensor, gate: ExpertQuant,
                   up: ExpertQuant, down: ExpertQuant, act: str, alpha: float, limit: float,
                   out_dtype: torch.dtype, routed_scale: float = 1.0) -> Tensor:
    """The routed experts' weighted sum [T, E] for x [T, K] (bf16), ids / weights [T, k]:
    `grouped_experts.moe_grouped`'s contract (its twin: `moe_grouped_ref`). Equal to
    `moe_grouped_mm_gate_up`, `moe_grouped_mm_down` and the combine, without the round trip
    of h through pair order."""
    check_pair(gate, up)
    _check(x, gate)
    if down.shape[2] != gate.shape[1]:
        raise ValueError(f"moe_grouped_mm: down {down.shape} does not take F = "
                         f"{gate.shape[1]}")
    t, k = ids.shape
    order, experts, offs = sort_pairs(ids, gate.shape[0])
    h = _gate_up_sorted(x, k, order, experts, offs, gate, up, act, alpha, limit)
    ys = _project(h, dequant_experts(down, x.dtype), offs, down, experts)  # [P, E] sorted
    y = torch.empty_like(ys).index_copy_(0, order, ys)
    return moe_reference.combine(y.reshape(t, k, -1), weights, out_dtype, routed_scale)
