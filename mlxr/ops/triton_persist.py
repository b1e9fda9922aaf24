"""Persistent kernels for the single-request decode step: a grid-wide barrier, a probe that
runs a layer's four 4-bit GEMVs in one launch (`chain4`), and a whole decoder layer in one
launch (`decode_layer`, used by `mlxr.models.persist_decode`, opt-in).

Why: batch-1 decode of a small model is launch-bound (Qwen3-0.6B: ~10 launches per layer,
~33 us per layer for ~9 MB of weights, i.e. ~3 us of bytes; docs/perf.md). A kernel whose
programs stay resident and walk a layer's phases, with a grid-wide barrier between phases,
pays one launch per layer instead; whether a barrier is cheaper than a launch on the H200 is
what `benchmarks/gpu_persist_probe.py` measures first (`sync_probe`, `chain4`).

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
    def _gemv_phase(x_ptr, r_ptr, nw_ptr, h_ptr, w_ptr, sb_ptr, y_ptr, N, eps, offset, zero,
                    K: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                    WT: tl.constexpr, EVEN_N: tl.constexpr, ITERS: tl.constexpr,
                    PRO: tl.constexpr, HAS_R: tl.constexpr, HAS_OFFSET: tl.constexpr,
                    ACT: tl.constexpr):
        """Row blocks pid, pid + G, ... of y = f(x) @ W^T (q4gemv's body with its prologue
        PRO, paired scales, .cg; row block 0 writes the residual); ITERS = ceil(blocks / G)."""
        pid = tl.program_id(0)
        g = tl.num_programs(0)
        for it in range(ITERS):
            rb = pid + it * g
            if rb * BLOCK_N < N:
                _q4_rows(rb, x_ptr, r_ptr, nw_ptr, h_ptr, w_ptr, sb_ptr, sb_ptr, y_ptr, N, eps,
                         offset, zero, rb == 0, K, GROUP, BLOCK_N, WT, EVEN_N, True, True, False,
                         PRO, HAS_R, HAS_OFFSET, ACT)

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
        _gemv_phase(x_ptr, x_ptr, x_ptr, x_ptr, w0, s0, y0, N0, 0.0, 0.0, zero, K0, GROUP,
                    BN0, WT0, EV0, IT0, 0, False, False, 0)
        grid_sync(cnt_ptr, base + g)
        _gemv_phase(y0, y0, y0, y0, w1, s1, y1, N1, 0.0, 0.0, zero, K1, GROUP,
                    BN1, WT1, EV1, IT1, 0, False, False, 0)
        grid_sync(cnt_ptr, base + 2 * g)
        _gemv_phase(y1, y1, y1, y1, w2, s2, y2, N2, 0.0, 0.0, zero, K2, GROUP,
                    BN2, WT2, EV2, IT2, 0, False, False, 0)
        grid_sync(cnt_ptr, base + 3 * g)
        _gemv_phase(y2, y2, y2, y2, w3, s3, y3, N3, 0.0, 0.0, zero, K3, GROUP,
                    BN3, WT3, EV3, IT3, 0, False, False, 0)

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


# ====================================================================== a whole decode layer
if HAVE_TRITON:
    from .triton_fused import _attn_combine, _attn_split
    from .triton_layer import _qkv_rope_write

    @triton.jit
    def _layer_kernel(
            h_ptr, m_ptr, h0_ptr, h1_ptr, in_norm, mlp_norm, wqkv, sqkv, qkv_ptr, qn_ptr, kn_ptr,
            c_ptr, s_ptr, slot_ptr, q_ptr, kc_ptr, vc_ptr, vis_ptr, pacc_ptr, pml_ptr,
            attn_ptr, wo, so, o_ptr, wgu, sgu, gu_ptr, wd, sd, m_out_ptr, cnt_ptr,
            S, skc0, skc1, svc0, svc1, eps, offset, rope_scale, qk_scale, inv_cap, cap2, zero,
            E: tl.constexpr, F: tl.constexpr, H: tl.constexpr, KV: tl.constexpr,
            D: tl.constexpr, R: tl.constexpr, GROUP: tl.constexpr, WT: tl.constexpr,
            BN_QKV: tl.constexpr, BN_O: tl.constexpr, BN_GU: tl.constexpr, BN_D: tl.constexpr,
            HAS_M: tl.constexpr, HAS_OFFSET: tl.constexpr, TRAD: tl.constexpr,
            HAS_QKNORM: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_R: tl.constexpr,
            BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_S: tl.constexpr, TILES: tl.constexpr, NSPLIT: tl.constexpr,
            BLOCK_NS: tl.constexpr, SOFTCAP: tl.constexpr, DOT_F32: tl.constexpr,
            ACT: tl.constexpr, BARRIERS: tl.constexpr, IT_QKV: tl.constexpr,
            IT_ROPE: tl.constexpr, IT_ATT: tl.constexpr, IT_CMB: tl.constexpr,
            IT_O: tl.constexpr, IT_GU: tl.constexpr, IT_D: tl.constexpr):
        """One decode token through one layer (mlxr.models.persist_decode), phase by phase
        with a grid barrier between phases; items of a phase go to programs pid, pid + G, ..."""
        pid = tl.program_id(0)
        g = tl.num_programs(0)
        base = grid_base(cnt_ptr, BARRIERS)
        REP: tl.constexpr = H // KV
        HD: tl.constexpr = H * D
        NQKV: tl.constexpr = HD + 2 * KV * D
        b = 0
        # 1. qkv = W_qkv @ rms_norm(h + m); h0 = h + m (row block 0 writes it)
        _gemv_phase(h_ptr, m_ptr, in_norm, h0_ptr, wqkv, sqkv, qkv_ptr, NQKV, eps, offset, zero,
                    E, GROUP, BN_QKV, WT, NQKV % BN_QKV == 0, IT_QKV, 1, HAS_M, HAS_OFFSET,
                    0)
        b += 1
        grid_sync(cnt_ptr, base + g * b)
        # 2. q/k norm + RoPE; k and v into the cache at the token's slot
        for it in range(IT_ROPE):
            j = pid + it * g
            if j < H + KV:
                _qkv_rope_write(0, j, qkv_ptr, qn_ptr, kn_ptr, c_ptr, s_ptr, slot_ptr, q_ptr,
                                kc_ptr, vc_ptr, 0, 0, skc0, skc1, svc0, svc1, eps, offset,
                                rope_scale, H, KV, D, R, TRAD, HAS_QKNORM,
                                HAS_QKNORM and HAS_OFFSET, HAS_SCALE, BLOCK_R, BLOCK_P, BLOCK_D)
        b += 1
        grid_sync(cnt_ptr, base + g * b)
        # 3. attention: (kv head, split) items; 4. the splits merged per query head
        for it in range(IT_ATT):
            j = pid + it * g
            if j < KV * NSPLIT:
                _attn_split(j // NSPLIT, j % NSPLIT, 0, q_ptr, kc_ptr, vc_ptr, vis_ptr,
                            attn_ptr, pacc_ptr, pml_ptr, S, HD, D, skc0, skc1, svc0, svc1, 0,
                            qk_scale, inv_cap, cap2, 1, REP, H, D, BLOCK_M, BLOCK_D, BLOCK_S,
                            TILES, NSPLIT, SOFTCAP, NSPLIT == 1, DOT_F32)
        b += 1
        grid_sync(cnt_ptr, base + g * b)
        if NSPLIT > 1:
            for it in range(IT_CMB):
                j = pid + it * g
                if j < H:
                    _attn_combine(j, pacc_ptr, pml_ptr, attn_ptr, 1, REP, H, D, NSPLIT,
                                  BLOCK_NS, BLOCK_D)
            b += 1
            grid_sync(cnt_ptr, base + g * b)
        # 5. o = W_o @ attn
        _gemv_phase(attn_ptr, attn_ptr, attn_ptr, attn_ptr, wo, so, o_ptr, E, eps, offset, zero,
                    HD, GROUP, BN_O, WT, E % BN_O == 0, IT_O, 0, False, False, 0)
        b += 1
        grid_sync(cnt_ptr, base + g * b)
        # 6. gu = W_gu @ rms_norm(h0 + o); h1 = h0 + o
        _gemv_phase(h0_ptr, o_ptr, mlp_norm, h1_ptr, wgu, sgu, gu_ptr, 2 * F, eps, offset, zero,
                    E, GROUP, BN_GU, WT, (2 * F) % BN_GU == 0, IT_GU, 1, True, HAS_OFFSET, 0)
        b += 1
        grid_sync(cnt_ptr, base + g * b)
        # 7. m = W_down @ act(gate) * up
        _gemv_phase(gu_ptr, gu_ptr, gu_ptr, gu_ptr, wd, sd, m_out_ptr, E, eps, offset, zero, F,
                    GROUP, BN_D, WT, E % BN_D == 0, IT_D, 2, False, False, ACT)


def decode_layer(h: Tensor, m: Tensor | None, layer, qw: dict, cos: Tensor, sin: Tensor,
                 rope_traditional: bool, rope_scale: float, k_cache: Tensor, v_cache: Tensor,
                 slot: Tensor, visible: Tensor, cfg, group: int, counter: Tensor,
                 grid: int | None = None) -> tuple[Tensor, Tensor]:
    """One token (h [E] the residual stream, m [E] the previous MLP output or None) through one
    decoder layer in one launch; returns (h + m + o, m_out), what the generic loop computes
    (mlxr.models.decoder). qw: name -> (q4 words, (scale, bias) pairs) for qkv, o, gate_up,
    down; cos/sin [1, R] float32; k/v_cache [KV, S, D]; slot [1] long; visible [S] bool;
    cfg the ModelConfig; group the weights' group size; `counter` from `new_counter`; `grid`
    programs, all resident (4 warps, ~240 registers each at Qwen3-0.6B shapes, sm_90: at most
    two per SM; `programs` gives one)."""
    from .triton_fused import ACTS, _interpret, _p2, score_consts, split_plan

    dev, dt = h.device, h.dtype
    e, f, hq, kv, d = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
                       cfg.num_kv_heads, cfg.head_dim)
    r, s_len, rep = cos.shape[-1], k_cache.shape[1], hq // kv
    grid = grid or programs(dev)
    wt = 128  # 128-word tiles: every K here is a multiple of 1024
    # Rows per program: with one resident program per SM, a program should own about one row
    # block of each matrix (ceil(N / G) rows), or it walks several one DRAM round trip after
    # another with ~2 KB in flight each (Little's law wants MBs in flight across the GPU). The
    # caps keep the whole kernel within 255 registers without spills (sm_90 compiles,
    # benchmarks/sass_report.py layer): 16 rows for the norm phases at E <= 2048, else 8.
    caps = {"qkv": 16 if e <= 2048 else 8, "gate_up": 16 if e <= 2048 else 8, "o_proj": 8,
            "down_proj": 8}
    bns = {name: (64 if _interpret() else
                  min(caps[name], max(4, _p2(triton.cdiv(w.shape[0], grid)))))
           for name, (w, _) in qw.items()}
    h0 = torch.empty_like(h) if m is not None else h
    h1, m_out = torch.empty_like(h), torch.empty_like(h)
    qkv = torch.empty((hq + 2 * kv) * d, dtype=dt, device=dev)
    q = torch.empty(hq * d, dtype=dt, device=dev)
    attn, o = torch.empty(hq * d, dtype=dt, device=dev), torch.empty_like(h)
    gu = torch.empty(2 * f, dtype=dt, device=dev)
    block_d, block_s, per, nsplit = split_plan(s_len, d, kv)  # as attention_masked launches
    pacc = torch.empty((kv * nsplit * rep, d), dtype=torch.float32, device=dev)
    pml = torch.empty((kv * nsplit * rep, 2), dtype=torch.float32, device=dev)
    softcap = cfg.attn_logit_softcap
    qk_scale, inv_cap, cap2 = score_consts(cfg.attn_scale, softcap)
    qn, kn = layer.q_norm, layer.k_norm
    vis = visible.view(torch.uint8) if visible.dtype == torch.bool else visible

    def its(n_items):
        return triton.cdiv(n_items, grid)

    _layer_kernel[(grid,)](
        h, m if m is not None else h, h0, h1, layer.input_norm, layer.mlp_norm, *qw["qkv"],
        qkv, qn if qn is not None else h, kn if kn is not None else h,
        cos.float().contiguous(), sin.float().contiguous(), slot, q, k_cache, v_cache, vis,
        pacc, pml, attn, *qw["o_proj"], o, *qw["gate_up"], gu, *qw["down_proj"], m_out,
        counter, s_len, k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), float(cfg.rms_norm_eps), float(cfg.norm_offset), float(rope_scale),
        qk_scale, inv_cap, cap2, 0, E=e, F=f, H=hq, KV=kv, D=d, R=r, GROUP=group, WT=wt,
        BN_QKV=bns["qkv"], BN_O=bns["o_proj"], BN_GU=bns["gate_up"], BN_D=bns["down_proj"],
        HAS_M=m is not None, HAS_OFFSET=bool(cfg.norm_offset), TRAD=bool(rope_traditional),
        HAS_QKNORM=qn is not None, HAS_SCALE=rope_scale != 1.0, BLOCK_R=_p2(r),
        BLOCK_P=_p2(max(1, d - 2 * r)), BLOCK_D=block_d, BLOCK_M=max(16, _p2(rep)),
        BLOCK_S=block_s, TILES=per, NSPLIT=nsplit, BLOCK_NS=_p2(nsplit),
        SOFTCAP=softcap is not None, DOT_F32=dt == torch.float32 or _interpret(),
        ACT=ACTS[cfg.hidden_act], BARRIERS=6 if nsplit > 1 else 5,
        IT_QKV=its(triton.cdiv(qkv.shape[0], bns["qkv"])), IT_ROPE=its(hq + kv),
        IT_ATT=its(kv * nsplit), IT_CMB=its(hq), IT_O=its(triton.cdiv(e, bns["o_proj"])),
        IT_GU=its(triton.cdiv(2 * f, bns["gate_up"])),
        IT_D=its(triton.cdiv(e, bns["down_proj"])), num_warps=4, num_stages=1)
    return h1, m_out
