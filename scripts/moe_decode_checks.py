"""The correctness half of scripts/moe_decode_gpu.py (see its docstring): the operands both
halves build (router Linears, expert stacks, shared experts), the budget clock, and the checks
of the onepass kernels, the one-launch router and the shared-expert fold against their twins
and today's paths, the CUDA-graph replays, determinism and batch invariance.
"""

from __future__ import annotations

import time
import traceback

import torch

from mlxr import ops
from mlxr.config import QuantSpec
from mlxr.layers import Linear
from mlxr.ops.moe import decode_experts as D
from mlxr.ops.moe import decode_onepass as O
from mlxr.ops.moe import router as RT
from mlxr.quant.weight import QuantWeight

START = time.time()
BUDGET = [420.0]
DRY = False  # --dry-run: the CPU under TRITON_INTERPRET=1, tiny shapes (a smoke test)


def say(msg: str) -> None:
    print(msg, flush=True)


def left() -> float:
    return BUDGET[0] - (time.time() - START)


def gated(name: str, need: float = 5.0) -> bool:
    if left() < need:
        say(f"SKIP {name} (budget)")
        return False
    return True


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
            verdict = "ok" if same else ("differs (the interpreter's bf16 casts truncate)"
                                         if DRY else "FAIL")
            say(f"  fold {mode:6s} T={t:2d}: == kernels apart {verdict}; "
                f"vs today's shared path max err {err:.2e} of the range")
            bad = bad if (same or DRY) and err < 0.02 else float("inf")
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


def apart(x, ids, gate, up, cfg):
    """The onepass gate/up with gate and up in two tile loops (`decode_onepass.PAIRED` off)."""
    O.PAIRED = False
    try:
        return O.moe_gate_up_onepass(x, ids, gate, up, "silu", config=cfg)
    finally:
        O.PAIRED = True
