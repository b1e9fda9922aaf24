"""Persistent-kernel building blocks for the single-request decode step: a grid-wide barrier and
a probe that runs a layer's four 4-bit GEMVs in one launch.

Why: batch-1 decode of a small model is launch-bound (Qwen3-0.6B: ~10 launches per layer,
~33 us per layer for ~9 MB of weights, i.e. ~3 us of bytes; docs/perf.md). A kernel whose
programs stay resident and walk a layer's phases, with a grid-wide barrier between phases,
pays one launch per layer instead; whether a barrier is cheaper than a launch on the H200 is
what `benchmarks/gpu_persist_probe.py` measures with `chain4` (not used by the engine).

`grid_sync`: every program of the launch must be resident at once (launch at most as many
programs as fit on the GPU at one time: `programs`), or the barrier never opens. The counter
is one int64 shared by all launches of kernels that cross the same number of barriers per
launch with the same grid; it only grows, so it needs no reset between launches or CUDA-graph
replays: a program reads it on entry, before its first arrival, when no program of this launch
can have passed the first barrier yet, so the value lies in [base, base + G) with base a
multiple of G * BARRIERS (the count after the previous launches), and barrier b opens at
base + G * (b + 1). The arrival is a release and the wait an acquire (gpu scope), after a
CTA barrier, so every thread's stores before the barrier are seen by every program after it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .triton_fused import HAVE_TRITON
from .triton_q4gemv import Q4Config, default_config, supported
from .triton_qmm import _sm_count

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .triton_q4gemv import _q4_rows


def new_counter(device) -> Tensor:
    """A zeroed barrier counter (int64 [1]) for `grid_sync` users."""
    return torch.zeros(1, dtype=torch.int64, device=device)


if HAVE_TRITON:

    @triton.jit
    def grid_base(cnt_ptr, BARRIERS: tl.constexpr):
        """The counter's value when this launch started (read on entry: see the module doc)."""
        g = tl.num_programs(0).to(tl.int64)
        start = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
        return start - start % (g * BARRIERS)

    @triton.jit
    def grid_sync(cnt_ptr, target):
        """Barrier: arrive, then wait until the counter reaches target (base + G * (b + 1))."""
        tl.debug_barrier()  # every thread's stores are issued before the arrival
        tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")
        while tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu") < target:
            pass
        tl.debug_barrier()

    @triton.jit
    def _gemv_phase(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, N, zero, K: tl.constexpr,
                    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, WT: tl.constexpr,
                    EVEN_N: tl.constexpr, ITERS: tl.constexpr):
        """Row blocks pid, pid + G, ... of y = x @ W^T (q4gemv's body, paired scales, .cg);
        ITERS = ceil(row blocks / G)."""
        pid = tl.program_id(0)
        g = tl.num_programs(0)
        for it in range(ITERS):
            rb = pid + it * g
            if rb * BLOCK_N < N:
                _q4_rows(rb, x_ptr, x_ptr, x_ptr, x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, N, 0.0,
                         0.0, zero, False, K, GROUP, BLOCK_N, WT, EVEN_N, True, True, False, 0,
                         False, False, 0)

    @triton.jit
    def _chain4_kernel(x_ptr, w0, s0, y0, w1, s1, y1, w2, s2, y2, w3, s3, y3, cnt_ptr,
                       N0, N1, N2, N3, zero, GROUP: tl.constexpr,
                       K0: tl.constexpr, BN0: tl.constexpr, WT0: tl.constexpr, EV0: tl.constexpr,
                       IT0: tl.constexpr,
                       K1: tl.constexpr, BN1: tl.constexpr, WT1: tl.constexpr, EV1: tl.constexpr,
                       IT1: tl.constexpr,
                       K2: tl.constexpr, BN2: tl.constexpr, WT2: tl.constexpr, EV2: tl.constexpr,
                       IT2: tl.constexpr,
                       K3: tl.constexpr, BN3: tl.constexpr, WT3: tl.constexpr, EV3: tl.constexpr,
                       IT3: tl.constexpr):
        """y0 = W0 x, y1 = W1 y0[:K1], y2 = W2 y1[:K2], y3 = W3 y2[:K3]: three barriers."""
        g = tl.num_programs(0).to(tl.int64)
        base = grid_base(cnt_ptr, 3)
        _gemv_phase(x_ptr, w0, s0, s0, y0, N0, zero, K0, GROUP, BN0, WT0, EV0, IT0)
        grid_sync(cnt_ptr, base + g)
        _gemv_phase(y0, w1, s1, s1, y1, N1, zero, K1, GROUP, BN1, WT1, EV1, IT1)
        grid_sync(cnt_ptr, base + 2 * g)
        _gemv_phase(y1, w2, s2, s2, y2, N2, zero, K2, GROUP, BN2, WT2, EV2, IT2)
        grid_sync(cnt_ptr, base + 3 * g)
        _gemv_phase(y2, w3, s3, s3, y3, N3, zero, K3, GROUP, BN3, WT3, EV3, IT3)

    @triton.jit
    def _sync_kernel(cnt_ptr, out_ptr, BARRIERS: tl.constexpr):
        """BARRIERS barriers and nothing else (their cost); program p adds p + 1 to out[b]
        before barrier b and checks, after it, that every program's share arrived."""
        g = tl.num_programs(0).to(tl.int64)
        pid = tl.program_id(0)
        base = grid_base(cnt_ptr, BARRIERS)
        ok = 1
        for b in tl.static_range(BARRIERS):
            tl.atomic_add(out_ptr + b, pid + 1, sem="relaxed", scope="gpu")
            grid_sync(cnt_ptr, base + g * (b + 1))
            seen = tl.atomic_add(out_ptr + b, 0, sem="relaxed", scope="gpu")
            ok = ok & (seen == g * (g + 1) // 2)
        tl.atomic_add(out_ptr + BARRIERS, 1 - ok, sem="relaxed", scope="gpu")


def programs(device, per_sm: int = 1) -> int:
    """How many programs a persistent launch may use: all resident at once (one per SM by
    default; the interpreter runs them one after another, so it gets one)."""
    if device.type != "cuda":
        return 1
    return per_sm * _sm_count(device)


def chain4(x: Tensor, weights: list[tuple[Tensor, Tensor, Tensor, int]], *, group: int,
           counter: Tensor, grid: int | None = None,
           configs: list[Q4Config] | None = None) -> list[Tensor]:
    """The probe: weights = 4 x (q4 words [N_i, K_i/8], (scale, bias) pairs [N_i, K_i/G, 2],
    biases (unused here; pairs carry them), N_i), each GEMV reading the first K_i outputs of the
    one before (K_0 = len(x)); one launch of `grid` programs (all resident: `programs`).
    Returns [y_0 .. y_3], the same bits as four q4gemv launches with the same configs."""
    if len(weights) != 4:
        raise ValueError("chain4: four weights")
    prev, ks = x.shape[0], []
    for words, sb, _, n in weights:
        k = words.shape[1] * 8
        if k > prev or not supported(group, k, x.dtype) or sb.shape != (n, k // group, 2):
            raise ValueError(f"chain4: a [{n}, {k}] weight after an input of {prev}")
        ks.append(k)
        prev = n
    # one num_warps for the whole launch: 128-word tiles (one warp) unless told otherwise
    cfgs = configs or [Q4Config(default_config(w[3], k).block_n, 128, cg=True)
                       for w, k in zip(weights, ks)]
    if len({c.num_warps for c in cfgs}) != 1:
        raise ValueError("chain4: every phase's tile must give the same num_warps")
    ys = [torch.empty(w[3], dtype=x.dtype, device=x.device) for w in weights]
    grid = grid or programs(x.device)
    args, meta = [], {}
    for i, ((words, sb, _, n), k, cfg, y) in enumerate(zip(weights, ks, cfgs, ys)):
        if (k // 8) % cfg.wt:
            raise ValueError(f"chain4: tile {cfg.wt} words must divide K/8 = {k // 8}")
        args += [words, sb, y]
        meta.update({f"K{i}": k, f"BN{i}": cfg.block_n, f"WT{i}": cfg.wt,
                     f"EV{i}": n % cfg.block_n == 0,
                     f"IT{i}": triton.cdiv(triton.cdiv(n, cfg.block_n), grid)})
    _chain4_kernel[(grid,)](x, *args, counter, *[w[3] for w in weights], 0, GROUP=group,
                            num_warps=cfgs[0].num_warps, num_stages=1, **meta)
    return ys


def sync_probe(counter: Tensor, barriers: int, grid: int | None = None) -> Tensor:
    """One launch crossing `barriers` barriers; returns out [barriers + 1] int64: out[b] = the
    sum of (program + 1) over programs before barrier b, out[-1] = how many programs saw a
    barrier open early (0 when it works)."""
    grid = grid or programs(counter.device)
    out = torch.zeros(barriers + 1, dtype=torch.int64, device=counter.device)
    _sync_kernel[(grid,)](counter, out, BARRIERS=barriers, num_warps=4)
    return out
