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

import moe_decode_checks as C  # noqa: E402
from moe_decode_checks import (apart, gated, make_stacks, route_new, route_old,  # noqa: E402
                               router_linear, say, shared_linears, shared_old)
from mlxr import ops  # noqa: E402
from mlxr.ops.moe import decode_onepass as O  # noqa: E402
from mlxr.ops.moe import decode_split as S  # noqa: E402
from mlxr.ops.moe import router as RT  # noqa: E402
GRAPH_CALLS = 20
TS = (1, 2, 4, 8, 16)
# name, experts, F, H, k, (mode, bits, group, global scale), router (mode bits group | None:
# bf16), router kind, norm, score, correction bias, routed scale
SHAPES = [("qwen3-30b-a3b", 128, 768, 2048, 8, ("affine", 4, 64, False), ("affine", 8, 64),
           "softmax_topk", True, "sigmoid", False, 1.0),
          ("laguna-xs-2.1", 256, 512, 2048, 8, ("nvfp4", 4, 16, False), None,
           "sigmoid_topk", True, "sigmoid", True, 2.5)]


def time_call(fn) -> float:
    """us per call: GRAPH_CALLS calls captured in one CUDA graph, median of 3 replays (the
    dry run: one eager call)."""
    fn()
    if C.DRY:
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
# ====================================================================== correctness
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


def sweep(dev) -> None:
    """T = 1 at both shapes first (the most wanted), then T = 2, 8, 16; a shape's kernels
    compile at its first T (P is a runtime argument), so later T cost only their timing."""
    DC = S.DecodeConfig
    gcfgs = [DC(bn, s, nw) for bn in (16, 32, 64) for s in (1, 2, 4, 8) for nw in (4, 8)]
    acfgs = [DC(16, 4, 4), DC(32, 4, 4), DC(32, 2, 4), DC(32, 8, 8), DC(64, 4, 8),
             DC(16, 1, 4)]
    dcfgs = [DC(bn, s, nw) for bn in (16, 32, 64) for s in (1, 2, 3, 6) for nw in (4, 8)]
    rcfgs = [(be, nw) for be in (1, 2, 4, 8, 16, 32) for nw in (1, 2, 4)]
    if C.DRY:
        gcfgs, acfgs, dcfgs, rcfgs = gcfgs[:2], acfgs[:1], dcfgs[:2], rcfgs[:2]
    ops_ = {shape[0]: shape_operands(shape, dev) for shape in SHAPES}
    g = torch.Generator(device=dev).manual_seed(4)
    for t in (1,) if C.DRY else (1, 2, 8, 16):
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
                    if C.left() < 10:
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
    C.BUDGET[0] = args.budget
    skip = set(args.skip.split(","))
    global SHAPES, TS
    C.DRY = args.dry_run
    dev = torch.device("cpu" if C.DRY else "cuda")
    if C.DRY:
        SHAPES = [(s[0], 16, 64, 128, 4, s[5], None, *s[7:]) for s in SHAPES]
        TS = (1, 2)
    else:
        say(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    worst = 0.0
    if "check" not in skip:
        say("== check: onepass experts vs twins")
        worst = max(worst, C.check_experts(dev))
        say("== check: routers")
        worst = max(worst, C.check_routers(dev))
        say("== check: shared expert folded into the launches")
        worst = max(worst, C.check_shared(dev))
        if gated("graph / determinism"):
            say("== check: graphs, determinism, batch invariance")
            worst = max(worst, C.check_graph_determinism(dev))
        say(f"== check worst err/tol {worst:.3f}: {'ok' if worst <= 1 else 'FAIL'}")
    if "time" not in skip and gated("time"):
        say("== time per layer (CUDA graphs)")
        time_shapes(dev)
    if "sweep" not in skip and gated("sweep"):
        say("== sweep onepass configs (best 4 per shape / T)")
        sweep(dev)
    say(f"done in {time.time() - C.START:.0f} s")
    return 0 if worst <= 1 else 1


if __name__ == "__main__":
    sys.exit(main())
