"""MoE decode at T = 1..16 tokens on the GPU (issue #28): the one-launch router
(`mlxr.ops.moe.router`) and the one-launch split-K expert kernels (`mlxr.ops.moe.decode_onepass`)
against their torch twins and against the current paths, then per-layer timings in CUDA graphs.

    PYTHONPATH=. python scripts/moe_decode_gpu.py --budget 420 [--skip check,time,sweep]

Sections (each line printed as it comes; past --budget seconds the rest prints SKIP):
* check: every expert format (affine 4/8-bit g32/g64/g128, mxfp4, nvfp4 +- global scale,
  mxfp8, bf16 dense) x bf16 / f32 activations x T = 1, 2, 8, 16 (k = 8 of 32 experts):
  onepass gate_up / down vs the decode twins (scripts/moe_gpu_kernels.py's bounds, err/tol
  <= 1 is ok); the routers (Qwen3 8-bit softmax + norm, Laguna bf16 sigmoid + correction bias,
  gpt-oss 8-bit + bias topk_softmax, a sqrt-softplus soft-capped one) vs their twin (from the
  same fp32 logits) and vs the current path (router Linear + torch route): "ids" counts rows
  with the same ids in the same order, "sets" the same set, "w" the largest weight difference
  over rows with equal ids; then CUDA-graph replays with new inputs == eager, counters back
  at zero, 20 runs bit-identical, and batch invariance (token 0 alone == token 0 in a batch
  of 16).
* time: per MoE layer, median of 3 replays of a graph of 20 calls, us and GB/s (the bytes of
  the distinct experts / router rows read), at the Qwen3-30B-A3B (128 x [768, 2048] affine
  4-bit g64, 8-bit router) and Laguna-XS-2.1 (256 x [512, 2048] nvfp4, bf16 router, sigmoid +
  bias, routed scale 2.5) shapes, T = 1, 2, 4, 8, 16: router old (Linear + torch route) / new;
  gate_up old (decode_split default) / new; down old / new; block old / new (router +
  experts, the shared expert not included; Laguna's block+sh adds it: old = its Linears
  and the add, new = folded into the two onepass launches); experts* = the engine's dispatch today
  (`ops.moe_experts`: the decode kernels up to 16 pairs, the grouped GEMM beyond) vs onepass
  at any T: where onepass wins past 16 pairs, raise MLXR_MOE_DECODE_MAX_PAIRS with it.
* sweep: onepass gate_up (gate and up in one tile loop, and "gu apart": two loops) and
  down configs (block_n, split, warps) and router rows per program x warps, best per shape
  and T (set `decode_onepass.ONEPASS_*` /
  `router.default_block` from it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from mlxr import ops  # noqa: E402
from mlxr.config import QuantSpec  # noqa: E402
from mlxr.layers import Linear  # noqa: E402
from mlxr.ops.moe import decode_experts as D  # noqa: E402
from mlxr.ops.moe import decode_onepass as O  # noqa: E402
from mlxr.ops.moe import decode_split as S  # noqa: E402
from mlxr.ops.moe import router as RT  # noqa: E402
from mlxr.quant.weight import QuantWeight  # noqa: E402

START = time.time()
BUDGET = [420.0]
DRY = False  # --dry-run: the CPU under TRITON_INTERPRET=1, tiny shapes (a smoke test)
GRAPH_CALLS = 20
TS = (1, 2, 4, 8, 16)
# name, experts, F, H, k, (mode, bits, group, global scale), router (mode bits group | None:
# bf16), router kind, norm, score, correction bias, routed scale
SHAPES = [("qwen3-30b-a3b", 128, 768, 2048, 8, ("affine", 4, 64, False), ("affine", 8, 64),
           "softmax_topk", True, "sigmoid", False, 1.0),
          ("laguna-xs-2.1", 256, 512, 2048, 8, ("nvfp4", 4, 16, False), None,
           "sigmoid_topk", True, "sigmoid", True, 2.5)]


def say(msg: str) -> None:
    print(msg, flush=True)


def left() -> float:
    return BUDGET[0] - (time.time() - START)


def gated(name: str, need: float = 5.0) -> bool:
    if left() < need:
        say(f"SKIP {name} (budget)")
        return False
    return True


def time_call(fn) -> float:
    """us per call: GRAPH_CALLS calls captured in one CUDA graph, median of 3 replays (the
    dry run: one eager call)."""
    fn()
    if DRY:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            fn()
    graph.replay()
    ts = []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / GRAPH_CALLS)
    return statistics.median(ts)


# ====================================================================== operands
def router_linear(e: int, h: int, fmt, dev, g) -> Linear:
    """A router Linear as the loader builds it: a QuantWeight (its CUDA decode copies) or
    a bf16 tensor."""
    if fmt is None:
        return Linear((torch.randn(e, h, generator=g) * 0.05).to(dev, torch.bfloat16))
    import moe_gpu_kernels as K

    mode, bits, group = fmt
    q = K.random_stack(mode, bits, group, 1, e, h, g, "cpu")
    qw = QuantWeight.from_tensors(q.w[0], q.scales[0], q.biases[0],
                                  QuantSpec(mode, bits, group), device=dev, name="gate")
    return Linear(qw)


def route_old(lin: Linear, x, kind, k, norm, score, cb):
    return ops.moe_route(lin(x), kind, k, norm, 0.0, score, cb)


def route_new(lin: Linear, x, kind, k, norm, score, cb, block_e=None, warps=4):
    q = RT.router_quant(lin.weight, lin.bias)
    return RT.moe_router(x, q, kind, k, norm, 0.0, score, cb, block_e, warps)


# ====================================================================== correctness
def check_experts(dev) -> float:
    import moe_gpu_kernels as K

    worst = 0.0
    cases = [(m, b, g, gs) for m, b, g in K.QUANTS for gs in ((False, True) if m == "nvfp4"
                                                              else (False,))]
    cases.append(("dense", 16, 0, False))
    if DRY:
        cases = [cases[1], cases[-2], cases[-1]]
    for i, (mode, bits, group, gs) in enumerate(cases):
        for dtype in (torch.bfloat16,) if DRY else (torch.bfloat16, torch.float32):
            if not gated(f"check {mode} {bits}b g{group}"):
                return worst
            try:
                worst = max(worst, check_case(mode, bits, group, gs, dtype, dev, 300 + i,
                                              *((8, 128, 64) if DRY else ())))
            except Exception:
                traceback.print_exc()
                say(f"  FAIL {mode} {bits}b g{group} {dtype}: exception")
                worst = float("inf")
    return worst


def make_stacks(mode, bits, group, gs, x_, f, e, g, dev, dtype=torch.bfloat16):
    import moe_gpu_kernels as K

    if mode == "dense":
        def mk(n, k):
            w = (torch.randn(x_, n, k, generator=g) * 0.05).to(dev, dtype)
            return ops.moe_dense_experts(w)
        return mk(f, e), mk(f, e), mk(e, f)
    gate, up = (K.random_stack(mode, bits, group, x_, f, e, g, dev, gs=gs) for _ in range(2))
    return gate, up, K.random_stack(mode, bits, group, x_, e, f, g, dev, gs=gs)


def check_case(mode, bits, group, gs, dtype, dev, seed, x_=32, e=1024, f=384) -> float:
    import moe_gpu_kernels as K

    g = torch.Generator().manual_seed(seed)
    r = 2.0**-24 if dtype == torch.float32 else 2.0**-8
    gate, up, down = make_stacks(mode, bits, group, gs, x_, f, e, g, dev, dtype)
    tag = f"{mode} {bits}b g{group}{' gs' if gs else ''} {str(dtype)[6:]}"
    worst = 0.0
    for t in (1, 2) if DRY else (1, 2, 8, 16):
        k = 8
        x = torch.randn(t, e, generator=g).to(dev, dtype)
        ids = torch.stack([torch.randperm(x_, generator=g)[:k] for _ in range(t)]).to(dev)
        w = torch.softmax(torch.randn(t, k, generator=g), -1).to(dev)
        href = D.moe_gate_up_ref(x, ids, gate, up, "silu")
        xs, pe = x.repeat_interleave(k, 0), ids.reshape(-1)
        htol = K.h_tol(xs, pe, gate, up, href, "silu", 1.702, 7.0, r, False)
        h = O.moe_gate_up_onepass(x, ids, gate, up, "silu")
        worst = max(worst, K._within(f"{tag} gate_up T={t}", h, href, htol))
        if mode != "dense" and not torch.equal(h, apart(x, ids, gate, up, None)):
            say(f"  {tag} gate_up T={t}: paired != apart (info: another reduction layout)")
        yref = D.moe_down_ref(href, ids, w, down, dtype, 2.5)
        dtol = K.down_tol(href, ids, w, down, yref, 2.5, r, False)
        y = O.moe_down_onepass(href, ids, w, down, dtype, 2.5)
        worst = max(worst, K._within(f"{tag} down+combine T={t}", y, yref, dtol))
    return worst


def check_routers(dev) -> float:
    """The fused router vs its twin (same fp32 logits) and vs the current path."""
    bad = 0.0
    g = torch.Generator().manual_seed(5)
    cases = [("qwen3 8b softmax+norm", 128, 2048, 8, ("affine", 8, 64), "softmax_topk", True,
              "sigmoid", False, False),
             ("laguna bf16 sigmoid+bias", 256, 2048, 8, None, "sigmoid_topk", True, "sigmoid",
              True, False),
             ("gpt-oss 8b+bias topk_softmax", 32, 2880, 4, ("affine", 8, 64), "topk_softmax",
              False, "sigmoid", False, True),
             ("sqrtsoftplus bf16", 64, 1024, 6, None, "sigmoid_topk", True, "sqrtsoftplus",
              False, False)]
    if DRY:  # the CPU's QuantWeight drops the words the kernel reads: bf16 routers only
        cases = [(c[0], c[1], 256, *c[3:4], None, *c[5:]) for c in cases]
    for name, e, h, k, fmt, kind, norm, score, has_cb, has_bias in cases:
        if not gated(f"router {name}"):
            return bad
        lin = router_linear(e, h, fmt, dev, g)
        if has_bias:
            lin.bias = (torch.randn(e, generator=g) * 0.1).to(dev, torch.bfloat16)
        cb = (torch.randn(e, generator=g) * 0.01).to(dev) if has_cb else None
        for t in (1, 2) if DRY else (1, 2, 8, 16):
            x = torch.randn(t, h, generator=g).to(dev, torch.bfloat16)
            x = (x * (4 / lin(x).float().abs().max())).to(torch.bfloat16)  # logits within ~4
            ids, w = route_new(lin, x, kind, k, norm, score, cb)
            q = RT.router_quant(lin.weight, lin.bias)
            rids, rw = RT.moe_router_ref(x, q, kind, k, norm, 0.0, score, cb)
            oids, ow = route_old(lin, x, kind, k, norm, score, cb)
            for other, oi, owt in (("twin", rids, rw), ("current", oids, ow)):
                same = (ids == oi).all(1)
                sets = (ids.sort(1).values == oi.sort(1).values).all(1)
                dw = (w.float() - owt.float()).abs()[same].max().item() if same.any() else 0.0
                say(f"  router {name:30s} T={t:2d} vs {other:7s} ids {int(same.sum())}/{t} "
                    f"sets {int(sets.sum())}/{t} w {dw:.2e}")
                if other == "twin" and int(sets.sum()) < t - max(1, t // 8):
                    bad = float("inf")
    return bad


def check_shared(dev) -> float:
    """The shared expert folded into the onepass launches: bit-equal to the same kernels
    run apart (routed; the shared expert as a top-1 stack) and added; vs today's path (the
    Linears, another GEMV's sums): max error over the output's range."""
    bad = 0.0
    for mode, bits, group in (("nvfp4", 4, 16), ("affine", 4, 64), ("dense", 16, 0)):
        if not gated(f"check fold {mode}"):
            return bad
        g = torch.Generator().manual_seed(21)
        x_, f, h = (8, 64, 128) if DRY else (32, 512, 2048)
        gate, up, down = make_stacks(mode, bits, group, False, x_, f, h, g, dev)
        sgu, sdn = shared_linears(mode, bits, group, f, h, dev, g)
        sq = ops.moe_shared_stacks(sgu, sdn)
        if sq is None:  # the CPU's QuantWeight keeps no words (the dry run)
            say(f"  fold {mode}: SKIP (no words to read)")
            continue
        for t in (1, 2) if DRY else (1, 2, 8, 16):
            x = torch.randn(t, h, generator=g).to(dev, torch.bfloat16)
            ids = torch.stack([torch.randperm(x_, generator=g)[:8] for _ in range(t)]).to(dev)
            w = torch.softmax(torch.randn(t, 8, generator=g), -1).to(dev)
            hh = O.moe_gate_up_onepass(x, ids, gate, up, "silu", shared=sq[:2])
            y = O.moe_down_onepass(hh, ids, w, down, x.dtype, 2.5, shared=sq[2])
            p = t * 8
            zero = torch.zeros(t, 1, dtype=torch.long, device=dev)
            one = torch.ones(t, 1, device=dev)
            apart = (O.moe_down_onepass(hh[:p], ids, w, down, x.dtype, 2.5)
                     + O.moe_down_onepass(hh[p:], zero, one, sq[2], x.dtype))
            same = torch.equal(y, apart) and torch.equal(
                hh[p:], O.moe_gate_up_onepass(x, zero, sq[0], sq[1], "silu"))
            today = (O.moe_down_onepass(O.moe_gate_up_onepass(x, ids, gate, up, "silu"), ids,
                                        w, down, x.dtype, 2.5) + shared_old(x, sgu, sdn))
            err = float((y.float() - today.float()).abs().max() / today.float().abs().max())
            say(f"  fold {mode:6s} T={t:2d}: == kernels apart {'ok' if same else 'FAIL'}; "
                f"vs today's shared path max err {err:.2e} of the range")
            bad = bad if same and err < 0.02 else float("inf")
    return bad


def check_graph_determinism(dev) -> float:
    g = torch.Generator().manual_seed(9)
    n, f = (128, 64) if DRY else (2048, 768)
    gate, up, down = make_stacks("affine", 4, 64, False, 64, f, n, g, dev)
    lin = router_linear(64, n, None if DRY else ("affine", 8, 64), dev, g)
    x = torch.randn(16, n, generator=g).to(dev, torch.bfloat16)
    ok = True

    def block(xx):
        ids, w = route_new(lin, xx, "softmax_topk", 8, True, "sigmoid", None)
        hh = O.moe_gate_up_onepass(xx, ids, gate, up, "silu")
        return O.moe_down_onepass(hh, ids, w, down, torch.bfloat16)

    want = block(x)
    runs = [block(x) for _ in range(2 if DRY else 20)]
    same = all(torch.equal(r, want) for r in runs)
    say(f"  onepass + router 20 runs bit-identical: {'ok' if same else 'FAIL'}")
    ok &= same
    alone = block(x[:1].clone())
    inv = torch.equal(alone[0], want[0])
    say(f"  batch invariance (token 0 alone == in 16): {'ok' if inv else 'FAIL'}")
    ok &= inv
    if DRY:
        return 0.0 if ok else float("inf")
    xg = x[:2].clone()
    block(xg)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = block(xg)
    for i in range(3):
        xg.copy_(torch.randn(2, n, generator=g).to(dev, torch.bfloat16))
        graph.replay()
        eq = torch.equal(out, block(xg))
        say(f"  CUDA graph replay {i} with new x == eager: {'ok' if eq else 'FAIL'}")
        ok &= eq
    torch.cuda.synchronize()
    zero = all(int(O.counters(dev, r).abs().sum()) == 0 for r in range(3))
    say(f"  ticket counters back at zero: {'ok' if zero else 'FAIL'}")
    return 0.0 if ok and zero else float("inf")


# ====================================================================== timing
@triton.jit
def _touch_kernel(w_ptr, ids_ptr, out_ptr, NW: tl.constexpr, BLOCK: tl.constexpr):
    """The read roofline of the experts' words: program (pair, block) xors BLOCK words of
    expert ids[pair] (NW words each) into one int."""
    p = tl.program_id(0)
    b = tl.program_id(1)
    e = tl.load(ids_ptr + p).to(tl.int64)
    o = b * BLOCK + tl.arange(0, BLOCK)
    w = tl.load(w_ptr + e * NW + o, mask=o < NW, other=0, cache_modifier=".cg")
    tl.store(out_ptr + p * tl.num_programs(1) + b, tl.xor_sum(w, axis=0))


def touch(q, ids, block=2048):
    """Read every word of the experts of ids (one launch): the bandwidth roofline."""
    nw = q.w[0].numel()
    out = torch.empty(ids.numel(), triton.cdiv(nw, block), dtype=torch.int32,
                      device=q.w.device)
    _touch_kernel[(ids.numel(), triton.cdiv(nw, block))](q.w.view(torch.int32), ids, out,
                                                         NW=nw, BLOCK=block, num_warps=4)
    return out


def expert_bytes(q, ids) -> int:
    """Bytes of the distinct experts of ids in stack q (words, scales, biases)."""
    n = int(torch.unique(ids).numel())
    per = q.w[0].numel() * q.w.element_size()
    for t in (q.scales, q.biases):
        if t is not None:
            per += t[0].numel() * t.element_size()
    return n * per


def shape_operands(shape, dev, seed=1):
    name, x_, f, h, k, (mode, bits, group, gs), rfmt, kind, norm, score, has_cb, rs = shape
    g = torch.Generator().manual_seed(seed)
    gate, up, down = make_stacks(mode, bits, group, gs, x_, f, h, g, dev)
    lin = router_linear(x_, h, rfmt, dev, g)
    cb = (torch.randn(x_, generator=g) * 0.01).to(dev) if has_cb else None
    return gate, up, down, lin, cb


def shared_linears(mode, bits, group, f, h, dev, g):
    """A shared expert as the loader builds it: [gate; up] one Linear (glu), down."""
    import moe_gpu_kernels as K

    def lin(n, k, glu):
        if mode == "dense":
            return Linear((torch.randn(n, k, generator=g) * 0.05).to(dev, torch.bfloat16))
        q = K.random_stack(mode, bits, group, 1, n, k, g, "cpu")
        return Linear(QuantWeight.from_tensors(
            q.w[0], q.scales[0], None if q.biases is None else q.biases[0],
            QuantSpec(mode, bits, group), device=dev, name="shared_expert", glu=glu))

    return lin(2 * f, h, True), lin(h, f, False)


def shared_old(x, sgu, sdn):
    """`MoeBlock`'s shared expert today: the Linears, the activation between."""
    gg, uu = sgu(x).chunk(2, dim=-1)
    return sdn(ops.gated_act(gg, uu, "silu"))


def time_shapes(dev) -> None:
    say(f"{'shape':14s} {'T':>2s} {'what':10s} {'old us':>8s} {'new us':>8s} {'old GB/s':>9s} "
        f"{'new GB/s':>9s} {'x':>5s}")
    for shape in SHAPES:
        name, x_, f, h, k, fmt, rfmt, kind, norm, score, has_cb, rs = shape
        gate, up, down, lin, cb = shape_operands(shape, dev)
        sh = None
        if name.startswith("laguna"):  # its shared expert: nvfp4, F 512
            sgu, sdn = shared_linears(*fmt[:3], f, h, dev, torch.Generator().manual_seed(8))
            sh = (sgu, sdn, ops.moe_shared_stacks(sgu, sdn))
        g = torch.Generator(device=dev).manual_seed(3)
        for t in TS:
            if not gated(f"time {name} T={t}", 15):
                return
            x = torch.randn(t, h, device=dev, dtype=torch.bfloat16, generator=g)
            ids, w = route_old(lin, x, kind, k, norm, score, cb)
            hh = S.moe_gate_up_split(x, ids, gate, up, "silu")
            rq = RT.router_quant(lin.weight, lin.bias)
            rbytes = rq.w.numel() * rq.w.element_size() + sum(
                v.numel() * v.element_size() for v in (rq.scales, rq.biases) if v is not None)
            gu = expert_bytes(gate, ids) + expert_bytes(up, ids)
            dn = expert_bytes(down, ids)
            rows = [
                ("router", rbytes, lambda: route_old(lin, x, kind, k, norm, score, cb),
                 lambda: route_new(lin, x, kind, k, norm, score, cb)),
                ("gate_up", gu, lambda: S.moe_gate_up_split(x, ids, gate, up, "silu"),
                 lambda: O.moe_gate_up_onepass(x, ids, gate, up, "silu")),
                ("down", dn, lambda: S.moe_down_split(hh, ids, w, down, x.dtype, rs),
                 lambda: O.moe_down_onepass(hh, ids, w, down, x.dtype, rs)),
                ("block", rbytes + gu + dn, lambda: block_old(x, lin, gate, up, down, shape, cb),
                 lambda: block_new(x, lin, gate, up, down, shape, cb)),
                ("experts*", gu + dn, lambda: ops.moe_experts(x, ids, w, gate, up, down, "silu",
                                                              1.702, 7.0, x.dtype, rs),
                 lambda: O.moe_down_onepass(O.moe_gate_up_onepass(x, ids, gate, up, "silu"),
                                            ids, w, down, x.dtype, rs))]
            same = torch.equal(block_old(x, lin, gate, up, down, shape, cb),
                               O.moe_down_onepass(O.moe_gate_up_onepass(x, ids, gate, up, "silu"),
                                                  ids, w, down, x.dtype, rs))
            say(f"{name:14s} {t:2d} onepass (defaults) == today's kernels, same ids: "
                f"{'yes' if same else 'NO (info: another reduction layout on the GPU)'}")
            for q, what in ((gate, "touch gu"), (down, "touch dn")):
                us = time_call(lambda: touch(q, ids))
                nb = expert_bytes(q._replace(scales=None, biases=None), ids)
                say(f"{name:14s} {t:2d} {what:10s} {'':8s} {us:8.1f} {'':9s} {nb / us / 1e3:9.0f}"
                    f"   (words only, one projection: the read roofline)")
            if sh is not None:
                sgu, sdn, sq = sh
                sbytes = sum(expert_bytes(q, torch.zeros(1, device=dev)) for q in sq)
                rows.append(("block+sh", rbytes + gu + dn + sbytes,
                             lambda: block_old(x, lin, gate, up, down, shape, cb)
                             + shared_old(x, sgu, sdn),
                             lambda: block_new(x, lin, gate, up, down, shape, cb, shared=sq)))
            for what, nbytes, old, new in rows:
                try:
                    a, b = time_call(old), time_call(new)
                    say(f"{name:14s} {t:2d} {what:10s} {a:8.1f} {b:8.1f} {nbytes / a / 1e3:9.0f} "
                        f"{nbytes / b / 1e3:9.0f} {a / b:5.2f}")
                except Exception:
                    traceback.print_exc()
                    say(f"{name:14s} {t:2d} {what:10s} FAIL")


def block_old(x, lin, gate, up, down, shape, cb):
    _, _, _, _, k, _, _, kind, norm, score, _, rs = shape
    ids, w = route_old(lin, x, kind, k, norm, score, cb)
    hh = S.moe_gate_up_split(x, ids, gate, up, "silu")
    return S.moe_down_split(hh, ids, w, down, x.dtype, rs)


def block_new(x, lin, gate, up, down, shape, cb, gcfg=None, dcfg=None, block_e=None,
              shared=None):
    _, _, _, _, k, _, _, kind, norm, score, _, rs = shape
    ids, w = route_new(lin, x, kind, k, norm, score, cb, block_e)
    hh = O.moe_gate_up_onepass(x, ids, gate, up, "silu", config=gcfg,
                               shared=None if shared is None else shared[:2])
    return O.moe_down_onepass(hh, ids, w, down, x.dtype, rs, config=dcfg,
                              shared=None if shared is None else shared[2])


def apart(x, ids, gate, up, cfg):
    """The onepass gate/up with gate and up in two tile loops (`decode_onepass.PAIRED` off)."""
    O.PAIRED = False
    try:
        return O.moe_gate_up_onepass(x, ids, gate, up, "silu", config=cfg)
    finally:
        O.PAIRED = True


def sweep(dev) -> None:
    """T = 1 at both shapes first (the most wanted), then T = 2, 8, 16; a shape's kernels
    compile at its first T (P is a runtime argument), so later T cost only their timing."""
    C = S.DecodeConfig
    gcfgs = [C(bn, s, nw) for bn in (16, 32, 64) for s in (1, 2, 4, 8) for nw in (4, 8)]
    acfgs = [C(16, 4, 4), C(32, 4, 4), C(32, 2, 4), C(32, 8, 8), C(64, 4, 8), C(16, 1, 4)]
    dcfgs = [C(bn, s, nw) for bn in (16, 32, 64) for s in (1, 2, 3, 6) for nw in (4, 8)]
    rcfgs = [(be, nw) for be in (1, 2, 4, 8, 16, 32) for nw in (1, 2, 4)]
    if DRY:
        gcfgs, acfgs, dcfgs, rcfgs = gcfgs[:2], acfgs[:1], dcfgs[:2], rcfgs[:2]
    ops_ = {shape[0]: shape_operands(shape, dev) for shape in SHAPES}
    g = torch.Generator(device=dev).manual_seed(4)
    for t in (1,) if DRY else (1, 2, 8, 16):
        for shape in SHAPES:
            name, x_, f, h, k, fmt, rfmt, kind, norm, score, has_cb, rs = shape
            gate, up, down, lin, cb = ops_[name]
            if not gated(f"sweep {name} T={t}", 20):
                return
            x = torch.randn(t, h, device=dev, dtype=torch.bfloat16, generator=g)
            ids, w = route_old(lin, x, kind, k, norm, score, cb)
            hh = S.moe_gate_up_split(x, ids, gate, up, "silu")
            for what, cfgs, fn in (
                    ("gate_up", gcfgs, lambda c: O.moe_gate_up_onepass(x, ids, gate, up, "silu",
                                                                       config=c)),
                    ("gu apart", acfgs, lambda c: apart(x, ids, gate, up, c)),
                    ("down", dcfgs, lambda c: O.moe_down_onepass(hh, ids, w, down, x.dtype, rs,
                                                                 config=c)),
                    ("router", rcfgs, lambda c: route_new(lin, x, kind, k, norm, score, cb,
                                                          c[0], c[1]))):
                res = []
                for c in cfgs:
                    if left() < 10:
                        break
                    try:
                        res.append((time_call(lambda: fn(c)), c))
                    except Exception as exc:  # a config that does not compile / fit
                        say(f"  {name} T={t} {what} {c}: {type(exc).__name__}")
                res.sort(key=lambda r: r[0])
                top = "  ".join(f"{us:.1f}us {c}" for us, c in res[:4])
                say(f"best {name:14s} T={t:2d} {what:8s} {top}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=float, default=420.0)
    ap.add_argument("--skip", default="")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    BUDGET[0] = args.budget
    skip = set(args.skip.split(","))
    global DRY, SHAPES, TS
    DRY = args.dry_run
    dev = torch.device("cpu" if DRY else "cuda")
    if DRY:
        SHAPES = [(s[0], 16, 64, 128, 4, s[5], None, *s[7:]) for s in SHAPES]
        TS = (1, 2)
    else:
        say(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    worst = 0.0
    if "check" not in skip:
        say("== check: onepass experts vs twins")
        worst = max(worst, check_experts(dev))
        say("== check: routers")
        worst = max(worst, check_routers(dev))
        say("== check: shared expert folded into the launches")
        worst = max(worst, check_shared(dev))
        if gated("graph / determinism"):
            say("== check: graphs, determinism, batch invariance")
            worst = max(worst, check_graph_determinism(dev))
        say(f"== check worst err/tol {worst:.3f}: {'ok' if worst <= 1 else 'FAIL'}")
    if "time" not in skip and gated("time"):
        say("== time per layer (CUDA graphs)")
        time_shapes(dev)
    if "sweep" not in skip and gated("sweep"):
        say("== sweep onepass configs (best 4 per shape / T)")
        sweep(dev)
    say(f"done in {time.time() - START:.0f} s")
    return 0 if worst <= 1 else 1


if __name__ == "__main__":
    sys.exit(main())
