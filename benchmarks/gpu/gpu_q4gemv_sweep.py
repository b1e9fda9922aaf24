"""H200 workbench for the 4-bit decode GEMV (mlxr.ops.matmul.decode_gemv_q4) against tinygemm.

    PYTHONPATH=. python benchmarks/gpu/gpu_q4gemv_sweep.py [--shapes 8B|0.6B|all] [--budget-s 240]
        [--json OUT.json]

For each real decode shape (M = 1, 4-bit g64, bf16): checks the kernel against its fp32 twin
(max error over sum |x||w|, share of bf16 outputs identical), then times tinygemm and every
launch shape (rows per program x words per tile) in CUDA graphs
over enough weight copies to exceed the L2, and reports us and GB/s (packed words + scales +
biases); then the default launch with the decode step's prologue against the unfused pair.
Also times the one-time repack of the largest weight.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from gpu_timing import L2_BYTES, graph_time_us

from mlxr.ops.matmul import decode_gemv_q4 as Q
from mlxr.quant import cuda_copies as qcopies

SHAPES = {
    "8B": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
           "down": (4096, 14336), "head": (128256, 4096)},
    "0.6B": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024),
             "down": (1024, 3072), "head": (151936, 1024)},
}
GROUP = 64


def weights(n, k, copies):
    out = []
    for _ in range(copies):
        w = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device="cuda")
        s = (torch.randn(n, k // GROUP, device="cuda") * 0.02).to(torch.bfloat16)
        b = (torch.randn(n, k // GROUP, device="cuda") * 0.1).to(torch.bfloat16)
        out.append((w, s, b))
    return out


def variants(n, k):
    """(config, paired scales?) launches: rows per program (4, 8, the default's) x tile (the
    default's, 128 and 512 words where they divide a row), paired scale/bias loads and .cg
    weights (the second sweep's winners); the default launch first."""
    d = Q.default_config(n, k)
    yield d, True
    for wt in sorted({d.wt, 128, 512} & {t for t in (128, 256, 512) if (k // 8) % t == 0},
                     reverse=True):
        for bn in sorted({4, 8, d.block_n}):
            cfg = Q.Q4Config(block_n=bn, wt=wt, cg=True)
            if cfg != d:
                yield cfg, True


def prologue(name, n, k, wrs) -> dict:
    """The default launch with its decode-step prologue (rms_norm(h + r) before qkv, gate_up
    and the head; act(gate) * up before down) against the unfused pair (the add+norm or
    gated-act kernel, then the plain GEMV), and the plain GEMV alone; us per call."""
    from mlxr.ops.layer import add_norm_qkv_rope, norm_rope_act

    if name == "o":
        return {}
    dt = torch.bfloat16
    x2 = torch.randn(2 * k, device="cuda").to(dt)
    h, r, nw = x2[:k].clone(), x2[k:].clone(), torch.ones(k, device="cuda", dtype=dt)
    ho = torch.empty(k, device="cuda", dtype=dt)
    outs = [torch.empty(n, device="cuda", dtype=dt) for _ in wrs]

    def gemv(a, o, x, **kw):
        return Q.q4gemv(x, *a[:3], group=GROUP, out=o, sb=a[3], **kw)

    if name == "down":
        fused = [lambda a=a, o=o: gemv(a, o, x2, act="silu") for a, o in zip(wrs, outs)]
        unfused = [lambda a=a, o=o: gemv(a, o, norm_rope_act.gated_act(
            x2[:k].view(1, k), x2[k:].view(1, k), "silu").view(k)) for a, o in zip(wrs, outs)]
    else:
        fused = [lambda a=a, o=o: gemv(a, o, h, r=r, norm=nw, eps=1e-6, h_out=ho)
                 for a, o in zip(wrs, outs)]
        unfused = [lambda a=a, o=o: gemv(a, o, add_norm_qkv_rope.add_rms_norm(
            h.view(1, k), r.view(1, k), nw, 1e-6)[1].view(k)) for a, o in zip(wrs, outs)]
    plain = [lambda a=a, o=o: gemv(a, o, h) for a, o in zip(wrs, outs)]
    return {"fused_us": round(graph_time_us(fused), 2),
            "unfused_us": round(graph_time_us(unfused), 2),
            "plain_us": round(graph_time_us(plain), 2)}


def check(n, k, w, s, b, x) -> dict:
    from mlxr.ops.matmul.generic_qmm import dequant_f32

    wr = Q.repack(w)
    deq = dequant_f32(w, s, b, None, "affine", 4, GROUP)
    exact = x.double() @ deq.double().t()
    scale = x.double().abs() @ deq.double().abs().t()
    ref = Q.q4gemv_ref(x, wr, s, b, group=GROUP)
    y = Q.q4gemv(x, wr, s, b, group=GROUP)
    err = ((y.double() - exact).abs() - 2.0 ** -8 * exact.abs()).clamp(min=0) / scale
    return {"max_err_over_scale": float(err.max()),
            "identical_to_twin": float((y == ref).float().mean())}


def sweep(shapes: list[str], budget_s: float, only: str | None = None) -> list[dict]:
    rows = []
    items = [(m, name, nk) for m in shapes for name, nk in SHAPES[m].items()
             if only is None or name in only.split(",")]
    per = budget_s / len(items)
    for model, name, (n, k) in items:
        t0 = time.time()
        nbytes = n * k // 2 + 2 * n * (k // GROUP) * 2
        copies = max(1, min(16, -(-2 * L2_BYTES // nbytes)))
        ws = weights(n, k, copies)
        x = torch.randn(k, device="cuda").to(torch.bfloat16)
        row = {"model": model, "shape": name, "n": n, "k": k, "mb": round(nbytes / 1e6, 2),
               "check": check(n, k, *ws[0], x)}
        packs = [qcopies.tinygemm_pack(w, s, b) for w, s, b in ws]
        x2 = x.view(1, -1)
        tg = graph_time_us([lambda p=p, x2=x2: torch._weight_int4pack_mm(x2, p[0], GROUP, p[1])
                            for p in packs])
        row["tinygemm_us"] = round(tg, 2)
        row["tinygemm_gb_s"] = round(nbytes / tg / 1e3, 1)
        del packs
        wrs = [(Q.repack(w), s, b, Q.pair_scales(s, b)) for w, s, b in ws]
        res = []
        for cfg, sb in variants(n, k):
            if time.time() - t0 > per:
                break
            outs = [torch.empty(n, device="cuda", dtype=torch.bfloat16) for _ in wrs]
            us = graph_time_us([lambda a=a, o=o, c=cfg, p=sb, x=x: Q.q4gemv(
                x, *a[:3], group=GROUP, out=o, config=c, sb=a[3] if p else None)
                for a, o in zip(wrs, outs)])
            res.append((cfg.label() + f"_sb{int(sb)}", round(us, 2),
                        round(nbytes / us / 1e3, 1)))
        res.sort(key=lambda r: r[1])
        row["best"] = res[:6]
        row["default"] = Q.default_config(n, k).label() + "_sb1"
        row["default_us"] = next((r[1] for r in res if r[0] == row["default"]), None)
        row["prologue"] = prologue(name, n, k, wrs)
        print(json.dumps(row), flush=True)
        rows.append(row)
        del ws, wrs
        torch.cuda.empty_cache()
    return rows


def repack_time() -> dict:
    n, k = SHAPES["8B"]["head"]
    w = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device="cuda")
    Q.repack(w)
    torch.cuda.synchronize()
    t = time.perf_counter()
    Q.repack(w)
    torch.cuda.synchronize()
    return {"repack_8B_head_ms": round((time.perf_counter() - t) * 1e3, 2),
            "mb": round(w.numel() * 4 / 1e6, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="all")
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--only", help="comma-separated shape names (qkv,o,gate_up,down,head)")
    ap.add_argument("--json")
    a = ap.parse_args()
    shapes = list(SHAPES) if a.shapes == "all" else [a.shapes]
    out = {"repack": repack_time()}
    print(json.dumps(out["repack"]), flush=True)
    out["sweep"] = sweep(shapes, a.budget_s, a.only)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
