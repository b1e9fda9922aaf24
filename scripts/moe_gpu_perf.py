"""MoE expert paths on the H200: correctness of every new path against its twin, then ms per
layer of every candidate at the Qwen3-30B-A3B and Laguna-XS-2.1 expert shapes, the best per
batch size (the defaults to set), then prefill / decode of an 8-layer Qwen3-30B-A3B-shaped
checkpoint under each path. One line per measurement; a failing case prints FAIL and the
script goes on. Sections past --budget seconds are skipped (printed as SKIP).

    PYTHONPATH=. python scripts/moe_gpu_perf.py [--ckpt DIR] [--skip check,sweep,bench]
    PYTHONPATH=. TRITON_INTERPRET=1 python scripts/moe_gpu_perf.py --dry-run   (CPU, tiny)
    PYTHONPATH=. python scripts/moe_gpu_perf.py --only grouped [--budget 100]
      (the in-kernel dequant grouped GEMM vs mm only: scripts/moe_grouped_perf.py)

Paths: "triton" (the grouped Triton kernel, `moe.grouped_experts`), "mm" (dequant +
torch._grouped_mm, `moe.grouped_mm`), "dec g<bn,split,warps> d<bn,split,warps>" (the decode
kernels, `moe.decode_split`: gate/up split 1 and down split 0 are the fused kernels; None
block = the heuristic). Timing: each call captured CUDA_GRAPH_CALLS times in one CUDA graph
(launch overhead out, as in the decode graph), median of 3 replays; eager if capture fails
(printed). GB/s counts the quantized bytes of the experts the call touches; TFLOP/s 3
matmuls of 2*E*F per pair. Correctness tolerance (bf16): scripts/moe_gpu_kernels.py's
derived bounds with r = 2^-7 (one bf16 unit: roundings of values a summation order apart
may land on either side of a tie); err/tol <= 1 is ok.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))

from mlxr import ops  # noqa: E402
from mlxr.ops.moe import decode_split as S  # noqa: E402
from mlxr.ops.moe import grouped_experts as G  # noqa: E402
from mlxr.ops.moe import grouped_mm as M  # noqa: E402
from mlxr.ops.moe import reference as moe_reference  # noqa: E402
from mlxr.ops.moe.operands import ExpertQuant  # noqa: E402

R = 2.0**-7
FORMATS = {"affine": (4, 64), "mxfp4": (4, 32), "nvfp4": (4, 16)}
GATE_UP_CFGS = [S.DecodeConfig(None, 1, 4), S.DecodeConfig(16, 1, 8), S.DecodeConfig(8, 1, 4),
                S.DecodeConfig(32, 1, 4), S.DecodeConfig(16, 2, 4), S.DecodeConfig(16, 4, 4),
                S.DecodeConfig(8, 4, 4), S.DecodeConfig(32, 4, 4), S.DecodeConfig(16, 8, 4),
                S.DecodeConfig(32, 8, 8), S.DecodeConfig(64, 4, 8)]
DOWN_CFGS = [S.DecodeConfig(None, 0, 4), S.DecodeConfig(16, 0, 8), S.DecodeConfig(None, 1, 4),
             S.DecodeConfig(16, 1, 4), S.DecodeConfig(32, 1, 4), S.DecodeConfig(16, 2, 4),
             S.DecodeConfig(32, 2, 4), S.DecodeConfig(64, 1, 8), S.DecodeConfig(16, 4, 4)]
# checked on CUDA: each kernel variant (fused with other warps, split-K, pair-parallel)
CHECK_GATE_UP = [GATE_UP_CFGS[i] for i in (1, 6, 9)]
CHECK_DOWN = [DOWN_CFGS[i] for i in (1, 3, 6, 8)]
# (name, experts, F, E, top-k, mode, global scale)
SHAPES = [("qwen3-30b-a3b", 128, 768, 2048, 8, "affine", False),
          ("laguna-xs-2.1", 256, 512, 2048, 8, "nvfp4", False)]
TS = [512, 1, 2048, 64, 2, 8, 16, 32, 256]  # the most wanted first (a budget may cut)
DECODE_MAX_T = 64  # the decode kernels are timed up to T*k = 512 pairs
CUDA_GRAPH_CALLS = 10
START = time.time()


def say(msg: str) -> None:
    print(msg, flush=True)


def cfg_name(c: S.DecodeConfig) -> str:
    return f"{c.block_n or 0},{c.split},{c.num_warps}"


def gpu_stack(mode: str, x: int, n: int, k: int, dev, gs: bool = False,
              seed: int = 0) -> ExpertQuant:
    """Random stacked experts made on the device (the sweep's real shapes)."""
    bits, group = FORMATS[mode]
    g = torch.Generator(device=dev).manual_seed(seed)
    w = torch.randint(-2**31, 2**31 - 1, (x, n, k * bits // 32), generator=g, device=dev,
                      dtype=torch.int32)
    ng = k // group
    b = None
    if mode == "affine":
        s = (torch.rand(x, n, ng, generator=g, device=dev) * 0.02 + 0.005).bfloat16()
        b = (-7.5 * s.float()).bfloat16()
    elif mode == "nvfp4":
        s = torch.randint(0x20, 0x48, (x, n, ng), generator=g, device=dev, dtype=torch.uint8)
    else:
        s = torch.randint(118, 126, (x, n, ng), generator=g, device=dev, dtype=torch.uint8)
    gsc = torch.rand(x, generator=g, device=dev) * 4 + 0.5 if gs else None
    return ExpertQuant(w, s, b, gsc, None, mode, bits, group)


def run_path(name: str, x, ids, w, gate, up, down):
    """One MoE layer's experts by the named path -> [T, E]."""
    if name == "triton":
        return G.moe_grouped(x, ids, w, gate, up, down, "silu", 1.702, 7.0, x.dtype)
    if name == "mm":
        return M.moe_grouped_mm(x, ids, w, gate, up, down, "silu", 1.702, 7.0, x.dtype)
    gcfg, dcfg = name
    h = S.moe_gate_up_split(x, ids, gate, up, "silu", 1.702, 7.0, config=gcfg)
    return S.moe_down_split(h, ids, w, down, x.dtype, 1.0, config=dcfg)


def time_call(fn, dev) -> tuple[float, bool]:
    """(seconds per call, captured in a CUDA graph)."""
    fn()
    if dev.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0, False
    torch.cuda.synchronize()
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(CUDA_GRAPH_CALLS):
                fn()
        run, calls, graphed = graph.replay, CUDA_GRAPH_CALLS, True
    except Exception:  # not capturable: eager timing
        torch.cuda.synchronize()
        run, calls, graphed = fn, 1, False
    ts = []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3 / calls)
    return statistics.median(ts), graphed


# ====================================================================== correctness
def check_mode(mode: str, dev, x_: int, e: int, f: int, ts, seed: int) -> float:
    import moe_gpu_kernels as K

    bits, group = FORMATS[mode]
    g = torch.Generator().manual_seed(seed)
    gsc = mode == "nvfp4"
    gate, up = (K.random_stack(mode, bits, group, x_, f, e, g, dev, gs=gsc) for _ in range(2))
    down = K.random_stack(mode, bits, group, x_, e, f, g, dev, gs=gsc)
    worst = 0.0
    for t, k in ts:
        tag = f"{mode} T={t} k={k}"
        x = torch.randn(t, e, generator=g).to(dev, torch.bfloat16)
        ids = torch.stack([torch.randperm(x_, generator=g)[:k] for _ in range(t)]).to(dev)
        w = torch.softmax(torch.randn(t, k, generator=g), -1).to(dev)
        xs, pe = x.repeat_interleave(k, 0), ids.reshape(-1)
        href = G.moe_grouped_gate_up_ref(x, ids, gate, up, "silu")
        tol = K.h_tol(xs, pe, gate, up, href, "silu", 1.702, 7.0, R, True)
        worst = max(worst, K._within(f"mm gate_up {tag}", M.moe_grouped_mm_gate_up(
            x, ids, gate, up, "silu"), href, tol))
        yref = moe_reference.combine(G.moe_grouped_down_ref(href, ids, down).reshape(t, k, -1),
                                     w, torch.bfloat16)
        y = moe_reference.combine(M.moe_grouped_mm_down(href, ids, down).reshape(t, k, -1),
                                  w, torch.bfloat16)
        tol = K.down_tol(href, ids, w, down, yref, 1.0, R, True)
        worst = max(worst, K._within(f"mm down+combine {tag}", y, yref, tol))
        whole = M.moe_grouped_mm(x, ids, w, gate, up, down, "silu", 1.702, 7.0, torch.bfloat16)
        parts = moe_reference.combine(M.moe_grouped_mm_down(
            M.moe_grouped_mm_gate_up(x, ids, gate, up, "silu"), ids, down).reshape(t, k, -1),
            w, torch.bfloat16)
        say(f"  mm whole == pieces {tag}: {'ok' if torch.equal(whole, parts) else 'DIFF (info)'}")
        if t * k > 256:
            continue
        href = S.D.moe_gate_up_ref(x, ids, gate, up, "silu")
        htol = K.h_tol(xs, pe, gate, up, href, "silu", 1.702, 7.0, R, False)
        yref = S.D.moe_down_ref(href, ids, w, down, torch.bfloat16)
        dtol = K.down_tol(href, ids, w, down, yref, 1.0, R, False)
        for c in CHECK_GATE_UP:
            h = S.moe_gate_up_split(x, ids, gate, up, "silu", config=c)
            worst = max(worst, K._within(f"dec gate_up {cfg_name(c)} {tag}", h, href, htol))
        for c in CHECK_DOWN:
            y = S.moe_down_split(href, ids, w, down, torch.bfloat16, config=c)
            worst = max(worst, K._within(f"dec down {cfg_name(c)} {tag}", y, yref, dtol))
    return worst


def check_graphs(dev) -> None:
    """The mm path and a split decode config captured in a CUDA graph: a replay with new
    ids equals the eager call."""
    for name in ("mm", (S.DecodeConfig(16, 4, 4), S.DecodeConfig(16, 2, 4))):
        try:
            gate, up = (gpu_stack("affine", 16, 256, 512, dev, seed=s) for s in (1, 2))
            down = gpu_stack("affine", 16, 512, 256, dev, seed=3)
            t = 40 if name == "mm" else 1
            x = torch.randn(t, 512, device=dev, dtype=torch.bfloat16)
            ids = torch.stack([torch.randperm(16, device=dev)[:4] for _ in range(t)])
            w = torch.full((t, 4), 0.25, device=dev)
            run_path(name, x, ids, w, gate, up, down)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = run_path(name, x, ids, w, gate, up, down)
            ids.copy_(torch.stack([torch.randperm(16, device=dev)[:4] for _ in range(t)]))
            graph.replay()
            same = torch.equal(out, run_path(name, x, ids, w, gate, up, down))
            say(f"  {'mm' if name == 'mm' else 'dec split'} in a CUDA graph, replay with new "
                f"ids == eager: {'ok' if same else 'FAIL'}")
        except Exception as exc:
            say(f"  graph capture {name if name == 'mm' else 'dec split'}: FAIL {exc!r}")


def check(dev, dry: bool) -> None:
    say("== correctness vs twins, bf16 (err/tol <= 1 ok)")
    shapes = [(3, 2)] if dry else [(2, 8), (64, 4), (512, 2)]
    x_, e, f = (4, 128, 64) if dry else (16, 512, 256)
    worst = 0.0
    for i, mode in enumerate(FORMATS):
        try:
            worst = max(worst, check_mode(mode, dev, x_, e, f, shapes, 200 + i))
        except Exception:
            say(f"  {mode}: FAIL (exception)\n{traceback.format_exc()}")
            worst = float("inf")
    if dev.type == "cuda":
        check_graphs(dev)
    say(f"correctness worst err/tol {worst:.3f} ({'ok' if worst <= 1 else 'FAIL'})")


# ====================================================================== sweep
def sweep_shape(shape, dev, ts, budget: float) -> dict:
    name, x_, f, e, k, mode, gs = shape
    gate, up = (gpu_stack(mode, x_, f, e, dev, gs, s) for s in (1, 2))
    down = gpu_stack(mode, x_, e, f, dev, gs, 3)
    per_expert = sum(t.nbytes for q in (gate, up, down)
                     for t in (q.w, q.scales, q.biases, q.global_scale) if t is not None) / x_
    best = {}
    for t in ts:
        if time.time() - START > budget:
            say(f"  {name} T={t}: SKIP (time budget)")
            continue
        x = torch.randn(t, e, device=dev, dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(x_, device=dev)[:k] for _ in range(t)])
        w = torch.softmax(torch.randn(t, k, device=dev), -1).bfloat16()
        touched = per_expert * len(torch.unique(ids))
        flops = 3 * 2 * e * f * t * k
        paths = ["triton", "mm"]
        if t <= DECODE_MAX_T:
            paths.append((GATE_UP_CFGS[0], DOWN_CFGS[0]))
        if t * k <= 128:
            paths += [(c, DOWN_CFGS[0]) for c in GATE_UP_CFGS[1:]]
            paths += [(GATE_UP_CFGS[0], c) for c in DOWN_CFGS[1:]]
        res = {}
        for p in paths:
            label = p if isinstance(p, str) else f"dec g{cfg_name(p[0])} d{cfg_name(p[1])}"
            try:
                sec, graphed = time_call(lambda p=p: run_path(p, x, ids, w, gate, up, down),
                                         dev)
            except Exception as exc:
                say(f"  {name} T={t:5d} {label:28s} FAIL {exc!r}"[:300])
                continue
            res[label] = sec
            say(f"  {name} T={t:5d} {label:28s} {sec * 1e3:9.3f} ms/layer "
                f"{touched / sec / 1e12:6.2f} TB/s {flops / sec / 1e12:7.2f} TFLOP/s"
                f"{'' if graphed else ' (eager)'}")
        if res:
            best[t] = res
        if t == 1:  # the router beside the experts (torch softmax + topk, not fused)
            logits = torch.randn(1, x_, device=dev, dtype=torch.bfloat16)
            sec, _ = time_call(lambda: ops.moe_route(logits, "softmax_topk", k, True), dev)
            say(f"  {name} T=    1 router softmax+topk (torch) {sec * 1e6:8.1f} us")
    return best


def _best_decode(best: dict, kind: str, ts) -> str | None:
    """The gate_up (kind "g") or down ("d") config with the least summed time over ts."""
    tot: dict[str, float] = {}
    for t in ts:
        base = best.get(t, {})
        ref = base.get(f"dec g{cfg_name(GATE_UP_CFGS[0])} d{cfg_name(DOWN_CFGS[0])}")
        if ref is None:
            continue
        cfgs = GATE_UP_CFGS if kind == "g" else DOWN_CFGS
        for c in cfgs:
            lab = (f"dec g{cfg_name(c)} d{cfg_name(DOWN_CFGS[0])}" if kind == "g"
                   else f"dec g{cfg_name(GATE_UP_CFGS[0])} d{cfg_name(c)}")
            if lab in base:
                tot[cfg_name(c)] = tot.get(cfg_name(c), 0.0) + base[lab]
    return min(tot, key=tot.get) if tot else None


def summarize(name: str, best: dict, k: int) -> dict:
    say(f"== best per T, {name}")
    for t, res in sorted(best.items()):
        lab = min(res, key=res.get)
        say(f"  T={t:5d} ({t * k:6d} pairs): {lab:28s} {res[lab] * 1e3:.3f} ms/layer "
            f"(x48 layers: {48 * res[lab] * 1e3:.1f} ms, estimate)")
    out = {"gate_up": _best_decode(best, "g", [1, 2]), "down": _best_decode(best, "d", [1, 2])}
    dec_max = 0
    for t, res in sorted(best.items()):
        dec = min((v for lab, v in res.items() if lab.startswith("dec")), default=None)
        grouped = min((res[p] for p in ("mm", "triton") if p in res), default=None)
        if dec is not None and grouped is not None and dec < grouped:
            dec_max = t * k
    out["decode_max_pairs"] = dec_max
    mm_min = None
    for t, res in sorted(best.items()):
        if "mm" in res and "triton" in res and res["mm"] < res["triton"]:
            mm_min = t * k
            break
    out["mm_min_pairs"] = mm_min
    return out


def sweep(dev, dry: bool, budget: float) -> dict:
    say("== ms per MoE layer (experts only: no router), bf16")
    shapes = [("tiny", 8, 64, 128, 2, "affine", False)] if dry else SHAPES
    ts = [1, 16] if dry else TS
    picks = {}
    for shape in shapes:
        try:
            best = sweep_shape(shape, dev, ts, budget)
            picks[shape[0]] = summarize(shape[0], best, shape[4])
        except Exception:
            say(f"  {shape[0]}: FAIL\n{traceback.format_exc()}")
    say("== defaults to set (per shape; MLXR_MOE_GATE_UP / MLXR_MOE_DOWN = block,split,warps)")
    for name, p in picks.items():
        say(f"  {name}: MLXR_MOE_GATE_UP={p['gate_up']} MLXR_MOE_DOWN={p['down']} "
            f"MLXR_MOE_DECODE_MAX_PAIRS={p['decode_max_pairs']} "
            f"MLXR_MOE_MM_MIN_PAIRS={p['mm_min_pairs']} (None: mm never won)")
    return picks


# ====================================================================== bench
def make_checkpoint(ckpt: Path) -> subprocess.Popen | None:
    """Start writing the bench checkpoint (CPU work, beside the GPU sections)."""
    if (ckpt / "config.json").is_file():
        return None
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    log = open(ckpt.parent / "make_checkpoint.log", "wb")  # the child's output
    return subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "make_checkpoint.py"),
                             "qwen3-30b-a3b", str(ckpt), "--layers", "8"],
                            stdout=log, stderr=subprocess.STDOUT)


def bench(ckpt: Path, maker: subprocess.Popen | None, picks: dict, budget: float) -> None:
    import random

    import mlxr
    from mlxr.engine.cuda_graph import GraphDecoder
    from mlxr.engine.kv_cache import new_cache

    say("== 8-layer qwen3-30b-a3b checkpoint, MLXR_MOE_GRAPHS=1 (tok/s of 8 layers; the "
        "48-layer figure is an estimate: per-layer time x 48)")
    if maker is not None:
        left = max(1.0, budget + 60 - (time.time() - START))
        if maker.wait(timeout=left):
            log = (ckpt.parent / "make_checkpoint.log").read_text(errors="replace")
            raise RuntimeError(f"make_checkpoint failed: {log[-500:]}")
    os.environ["MLXR_MOE"] = "stacked"
    os.environ["MLXR_MOE_GRAPHS"] = "1"
    model = mlxr.load(ckpt, device="cuda")
    dec = model.decoder
    rng = random.Random(0)
    prompt = torch.tensor([rng.randrange(model.config.vocab_size) for _ in range(512)],
                          device="cuda")
    cache = new_cache(dec, 1024)
    dev = torch.device("cuda")

    def prefill():
        cache.length = 0
        with torch.inference_mode():
            return dec.forward(prompt, cache, last_only=True)

    for mode in ("triton", "mm", "fused"):
        os.environ["MLXR_MOE_GROUPED"] = mode
        try:
            sec, _ = time_call_eager(prefill, dev)
            say(f"  prefill 512, {mode:6s}: {512 / sec:9.1f} tok/s ({sec * 1e3:.1f} ms, 8 "
                f"layers; x6 for 48 layers: ~{512 / sec / 6:.0f} tok/s estimate)")
        except Exception as exc:
            say(f"  prefill 512, {mode}: FAIL {exc!r}"[:300])
    os.environ["MLXR_MOE_GROUPED"] = "mm"
    p = picks.get("qwen3-30b-a3b", {})
    variants = [("default", None, None)]
    if p.get("gate_up") or p.get("down"):
        variants.append(("best sweep", p.get("gate_up"), p.get("down")))
    first = int(prefill()[0].argmax())
    for label, gu, dn in variants:
        if time.time() - START > budget * 0.95:
            say(f"  decode {label}: SKIP (time budget)")
            continue
        for key, val in (("MLXR_MOE_GATE_UP", gu), ("MLXR_MOE_DOWN", dn)):
            if val:
                os.environ[key] = val
            else:
                os.environ.pop(key, None)
        try:
            prefill()
            graph = GraphDecoder(dec, cache)

            def decode():
                for _ in graph.greedy(first, 512, 128):
                    pass

            sec, _ = time_call_eager(decode, dev)
            say(f"  decode 128 (graph), {label} (g={gu} d={dn}): {128 / sec:8.1f} tok/s "
                f"(8 layers; /6 for 48 layers: ~{128 / sec / 6:.0f} tok/s estimate, head "
                f"counted 6x)")
        except Exception as exc:
            say(f"  decode {label}: FAIL {exc!r}"[:300])


def time_call_eager(fn, dev) -> tuple[float, bool]:
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", type=Path, default=Path("/tmp/mlxr-moe-perf/qwen3-30b-a3b-L8"))
    ap.add_argument("--skip", default="", help="comma list of check,sweep,bench")
    ap.add_argument("--budget", type=float, default=280.0,
                    help="seconds for the whole run: the sweep stops at 60%%, the bench "
                         "starts before 75%%")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, interpreter")
    ap.add_argument("--only", choices=["grouped"], help="grouped: the fused grouped GEMM vs "
                    "mm alone (scripts/moe_grouped_perf.py), within --budget")
    a = ap.parse_args()
    skip = set(filter(None, a.skip.split(",")))
    dev = torch.device("cpu" if a.dry_run else "cuda")
    if a.only == "grouped":
        import moe_grouped_perf

        if not a.dry_run:
            say(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
        moe_grouped_perf.run(dev, a.dry_run, a.budget)
        return
    if a.dry_run:  # every section's code, one candidate of each kind
        global GATE_UP_CFGS, DOWN_CFGS, CHECK_GATE_UP, CHECK_DOWN
        GATE_UP_CFGS, DOWN_CFGS = GATE_UP_CFGS[::5], DOWN_CFGS[::3]
        CHECK_GATE_UP, CHECK_DOWN = GATE_UP_CFGS[1:], DOWN_CFGS[1:]
        skip.add("bench")
    else:
        say(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, "
            f"_grouped_mm {hasattr(torch, '_grouped_mm')}")
    picks: dict = {}
    maker = None if "bench" in skip else make_checkpoint(a.ckpt)
    if "check" not in skip:
        check(dev, a.dry_run)
    if "sweep" not in skip:
        picks = sweep(dev, a.dry_run, a.budget * 0.6)
    if "bench" not in skip and time.time() - START > a.budget * 0.75:
        say("bench: SKIP (time budget)")
    elif "bench" not in skip:
        try:
            bench(a.ckpt, maker, picks, a.budget)
        except Exception:
            say(f"bench: FAIL\n{traceback.format_exc()}")
    say(f"done in {time.time() - START:.0f} s; ops dispatch: {ops.moe_experts.__module__}")


if __name__ == "__main__":
    main()
