"""`scripts/moe_gpu_perf.py --only grouped`: the in-kernel dequant grouped GEMM
(`moe.grouped_fused`) on the H200 beside the default mm path (dequant + torch._grouped_mm),
one MoE layer's experts: values vs the twin, then ms per layer over a few launch configs.

Per shape and format, per T: x, ids (distinct experts per token), softmax weights; the twin
(`grouped_experts.moe_grouped_ref`'s math, vectorized per expert: weights dequantized once,
rounded to bf16 as the twin rounds them (`grouped_mm.dequant_experts`, bit for bit), fp32
matmuls) and its derived bound; then each path's output checked (err/tol <= 1 ok) and timed
in a CUDA graph (moe_gpu_perf.time_call). Bounds (bf16, r = 2^-7 as moe_gpu_perf): a
projection row 2*K*2^-24 |x| @ |W|^T + r |y|; h through silu's derivatives + 16 r |h|; the
routed sum: h's bound carried through |W_down|, down's own, (k + 1) r sum_j |w_j y_j|, r |out|.

Shapes: Qwen3-30B-A3B experts (128, 2048 -> 768 -> 2048, top-8) in affine 4-bit g64 (every
config of SWEEP), mxfp4 and nvfp4 with global scales (CHECK_CFG); Laguna-XS-2.1 (256 experts,
F 512) nvfp4 (CHECK_CFG). Sections past the budget print SKIP.
"""

from __future__ import annotations

import time

import torch

import moe_gpu_perf as P
from mlxr.ops.moe import grouped_fused as F
from mlxr.ops.moe import grouped_mm as M
from mlxr.ops.moe import reference as moe_reference

R = 2.0**-7
SWEEP = [F.FusedConfig(16, 128, 64, 4, 3, True), F.FusedConfig(32, 128, 64, 4, 3, True),
         F.FusedConfig(32, 128, 64, 8, 3, True), F.FusedConfig(64, 128, 64, 8, 3, True),
         F.FusedConfig(64, 128, 64, 4, 3, False), F.FusedConfig(16, 128, 128, 4, 3, True),
         F.FusedConfig(32, 128, 128, 8, 3, True)]
CHECK_CFG = F.FusedConfig(32, 128, 64, 8, 3, True)
TS = [512, 64, 2048, 16]
# (name, experts, F, E, top-k, mode, global scale, configs)
CASES = [("qwen3-30b-a3b", 128, 768, 2048, 8, "affine", False, SWEEP),
         ("qwen3-30b-a3b", 128, 768, 2048, 8, "mxfp4", False, [CHECK_CFG]),
         ("qwen3-30b-a3b", 128, 768, 2048, 8, "nvfp4", True, [CHECK_CFG]),
         ("laguna-xs-2.1", 256, 512, 2048, 8, "nvfp4", False, [CHECK_CFG])]
DRY = [("tiny", 8, 64, 128, 2, "affine", False, SWEEP[:1] + SWEEP[4:5]),
       ("tiny", 8, 64, 128, 2, "nvfp4", True, [CHECK_CFG])]


class Twin:
    """One projection's twin weights [X, N, K] fp32: the bf16-rounded dequantized values and
    an elementwise bound of |W| (`moe_gpu_kernels.abs_stack`)."""

    def __init__(self, q):
        import moe_gpu_kernels as K

        self.w = M.dequant_experts(q, torch.bfloat16).float()
        self.a = M.dequant_experts(K.abs_stack(q), torch.float32).abs()
        self.k = q.shape[2]

    def rows(self, x: torch.Tensor, pe: torch.Tensor, w: torch.Tensor,
             out_dtype: torch.dtype) -> torch.Tensor:
        """Row p of x through expert pe[p] of w [X, N, K]: fp32 matmuls, rounded to out_dtype."""
        y = torch.empty(x.shape[0], w.shape[1], device=x.device, dtype=out_dtype)
        order = torch.argsort(pe, stable=True)
        counts = torch.bincount(pe, minlength=w.shape[0]).tolist()
        start = 0
        for e, c in enumerate(counts):
            if c:
                idx = order[start:start + c]
                y[idx] = (x.index_select(0, idx).float() @ w[e].t()).to(out_dtype)
                start += c
        return y

    def value_bound(self, x, pe, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(twin rows in dtype, their bound B = 2*K*2^-24 |x| @ |W|^T + r |y|)."""
        y = self.rows(x, pe, self.w, dtype)
        b = 2 * self.k * 2.0**-24 * self.rows(x.float().abs(), pe, self.a, torch.float32)
        return y, b.double() + R * y.double().abs()


def reference(x, ids, w, twins) -> tuple[torch.Tensor, torch.Tensor]:
    """(the routed sum of the twin [T, E] bf16, its bound for another path's output)."""
    tg, tu, td = twins
    t, k = ids.shape
    xs, pe = x.repeat_interleave(k, 0), ids.reshape(-1)
    g, bg = tg.value_bound(xs, pe, x.dtype)
    u, bu = tu.value_bound(xs, pe, x.dtype)
    h = moe_reference.expert_act(g, u, "silu")
    gd, ud = g.double(), u.double()
    dh = 1.1 * (ud.abs() + bu) * bg + (torch.nn.functional.silu(gd).abs() + 1.1 * bg) * bu
    dh = dh + 16 * R * h.double().abs()
    y, by = td.value_bound(h, pe, x.dtype)
    carried = td.rows(dh.float(), pe, td.a, torch.float32).double()
    b = (carried + by).reshape(t, k, -1)
    wa = w.double().abs().unsqueeze(-1)
    out = moe_reference.combine(y.reshape(t, k, -1), w, x.dtype)
    tol = ((wa * b).sum(1) + (k + 1) * R * (wa * y.double().abs().reshape(t, k, -1)).sum(1))
    return out, tol * 1.5 + R * out.double().abs()


def within(y: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor) -> float:
    err = (y.double() - ref.double()).abs()
    worst = float((err / (tol + 1e-30)).max()) if err.numel() else 0.0
    return worst if bool(torch.isfinite(y).all()) else float("inf")


def run_case(case, dev, ts, start: float, budget: float) -> dict:
    name, x_, f, e, k, mode, gs, cfgs = case
    tag = f"{name} {mode}{' gs' if gs else ''}"
    gate, up = (P.gpu_stack(mode, x_, f, e, dev, gs, s) for s in (1, 2))
    down = P.gpu_stack(mode, x_, e, f, dev, gs, 3)
    twins = [Twin(q) for q in (gate, up, down)]
    per_expert = sum(t.nbytes for q in (gate, up, down)
                     for t in (q.w, q.scales, q.biases, q.global_scale) if t is not None) / x_
    best: dict = {}
    for t in ts:
        if time.time() - start > budget:
            P.say(f"  {tag} T={t}: SKIP (time budget)")
            continue
        g = torch.Generator(device=dev).manual_seed(t)
        x = torch.randn(t, e, device=dev, generator=g).bfloat16()
        ids = torch.argsort(torch.rand(t, x_, device=dev, generator=g), -1)[:, :k]
        w = torch.softmax(torch.randn(t, k, device=dev, generator=g), -1).bfloat16()
        ref, tol = reference(x, ids, w, twins)
        touched = per_expert * len(torch.unique(ids))
        flops = 3 * 2 * e * f * t * k
        paths = [("mm", None)] + [(c.label(), c) for c in cfgs]
        res = {}
        for label, cfg in paths:
            def call(cfg=cfg):
                if cfg is None:
                    return M.moe_grouped_mm(x, ids, w, gate, up, down, "silu", 1.702, 7.0,
                                            x.dtype)
                return F.moe_grouped_fused(x, ids, w, gate, up, down, "silu", 1.702, 7.0,
                                           x.dtype, config=cfg)
            try:
                worst = within(call(), ref, tol)
                sec, graphed = P.time_call(call, dev)
            except Exception as exc:
                P.say(f"  {tag} T={t:5d} {label:24s} FAIL {exc!r}"[:300])
                continue
            res[label] = sec
            P.say(f"  {tag} T={t:5d} {label:24s} err/tol {worst:6.3f} "
                  f"{'ok  ' if worst <= 1 else 'FAIL'} {sec * 1e3:8.3f} ms/layer "
                  f"{touched / sec / 1e12:5.2f} TB/s {flops / sec / 1e12:6.1f} TFLOP/s"
                  f"{'' if graphed else ' (eager)'}")
        best[t] = res
    return best


def dequant_probe(dev) -> None:
    """The mm path's dequant of all 128 Qwen experts alone (bytes in + out per second)."""
    q = P.gpu_stack("affine", 128, 768, 2048, dev, False, 1)
    moved = sum(t.nbytes for t in (q.w, q.scales, q.biases)) + 128 * 768 * 2048 * 2
    sec, _ = P.time_call(lambda: M.dequant_experts(q, torch.bfloat16), dev)
    P.say(f"  mm dequant of one 128-expert gate stack: {sec * 1e3:.3f} ms, "
          f"{moved / sec / 1e12:.2f} TB/s of traffic (3 stacks per layer)")


def run(dev, dry: bool, budget: float) -> None:
    start = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False
    P.say("== grouped MoE experts: fused (in-kernel dequant) vs mm, bf16; err/tol vs the twin")
    summary = []
    for case in DRY if dry else CASES:
        try:
            best = run_case(case, dev, [1, 16] if dry else TS, start, budget)
        except Exception as exc:
            P.say(f"  {case[0]} {case[5]}: FAIL {exc!r}"[:300])
            continue
        for t, res in sorted(best.items()):
            fused = {lab: s for lab, s in res.items() if lab != "mm"}
            if fused and "mm" in res:
                lab = min(fused, key=fused.get)
                summary.append(f"  {case[0]} {case[5]} T={t:5d}: mm {res['mm'] * 1e3:.3f} ms, "
                               f"best fused {lab} {fused[lab] * 1e3:.3f} ms "
                               f"({res['mm'] / fused[lab]:.2f}x)")
    if dev.type == "cuda" and time.time() - start < budget:
        dequant_probe(dev)
    P.say("== best fused config per T beside mm")
    for line in summary:
        P.say(line)
    P.say(f"grouped done in {time.time() - start:.0f} s")
