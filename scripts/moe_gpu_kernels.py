"""The MoE kernels against their torch twins on CUDA, random stacked experts of every expert
quant mode, float32 and bf16 activations (run by scripts/moe_gpu_check.py).

Tolerances (derived as in tests/test_triton_moe_decode.py, with r the rounding unit of the
activation dtype: 2^-24 float32, 2^-8 bf16):
* a projection row: fp32 sums in another order, 2*K*2^-24 * A with A = |x| @ |W|^T (|W| <=
  q|s| + |b| for affine: the same codes with |scales|, |biases|; fp modes: the codes with their
  sign bits cleared), plus r |y| (its rounding to the activation dtype may land on the other
  side of a tie: one unit in bf16) and r |y| more for an expert bias add;
* h = act(g, u): through the activation's derivatives (silu: 1.1 |u|, |silu g|; gpt-oss:
  (|clip u| + 1)(1 + a|g|/4), |g sig(a g)|), plus 16 r |h| (its 3-5 roundings);
* down + combine: sum_j |w_j| (B_j + r|y_j|) + (k + 1) r sum_j |w_j y_j|, times the routed
  scale, plus r |out|.
`moe_grouped` (align, both launches, combine) must equal its parts bit for bit.
"""

from __future__ import annotations

import torch

from mlxr.ops.moe import reference as moe_reference
from mlxr.ops.moe import decode_experts as D
from mlxr.ops.moe import grouped_experts as G
from mlxr.ops.moe.operands import ExpertQuant

QUANTS = [("affine", b, g) for b in (4, 8) for g in (32, 64, 128)] + [
    ("mxfp4", 4, 32), ("nvfp4", 4, 16), ("mxfp8", 8, 32)]


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [R, K] (4 or 8 bits) -> int32 words [R, K*bits/32], code j of a word at bits
    [j*bits, (j+1)*bits) (MLX's little-endian stream)."""
    per = 32 // bits
    c = codes.long().reshape(codes.shape[0], -1, per)
    words = (c << (torch.arange(per) * bits)).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def random_stack(mode: str, bits: int, group: int, x: int, n: int, k: int, g: torch.Generator,
                 dev, bias: bool = False, gs: bool = False) -> ExpertQuant:
    """X random experts [n, k] in the file's layout, on `dev`."""
    codes = torch.randint(0, 1 << bits, (x * n, k), generator=g)
    if mode == "mxfp8":  # 0x7F / 0xFF: NaN in mlx, never written by its quantizer
        codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes)
    w = pack_codes(codes, bits).reshape(x, n, -1)
    ng = k // group
    b = None
    if mode == "affine":
        s = (torch.randn(x, n, ng, generator=g) * 0.02).bfloat16()
        b = (torch.randn(x, n, ng, generator=g) * 0.1).bfloat16()
    elif mode == "nvfp4":  # positive E4M3 scale bytes, as the quantizer writes them
        s = torch.randint(0x20, 0x48, (x, n, ng), generator=g, dtype=torch.uint8)
    elif mode == "mxfp8":  # E8M0 around 2^-10: E4M3 codes reach 448
        s = torch.randint(110, 122, (x, n, ng), generator=g, dtype=torch.uint8)
    else:
        s = torch.randint(118, 134, (x, n, ng), generator=g, dtype=torch.uint8)
    gsc = torch.rand(x, generator=g) * 4 + 0.5 if gs else None
    eb = (torch.randn(x, n, generator=g) * 0.5).bfloat16() if bias else None

    def to(t):
        return None if t is None else t.to(dev)

    return ExpertQuant(to(w), to(s), to(b), to(gsc), to(eb), mode, bits, group)


def abs_stack(q: ExpertQuant) -> ExpertQuant:
    """A stack whose dequantized weights bound |W| elementwise (see the module docstring)."""
    if q.mode == "affine":
        return q._replace(scales=q.scales.abs(), biases=q.biases.abs(), bias=None)
    if q.mode == "dense":  # float weights: |W| itself (the fp-code masks below are for codes)
        return q._replace(w=q.w.abs(), bias=None)
    mask = 0x77777777 if q.bits == 4 else 0x7F7F7F7F  # E2M1 / E4M3 sign bits cleared
    w = (q.w.view(torch.int32) & mask)
    return q._replace(w=w, bias=None)


def row_bound(x: torch.Tensor, pe: torch.Tensor, q: ExpertQuant, y: torch.Tensor,
              r: float) -> torch.Tensor:
    """B [P, N] of row p of x through expert pe[p], float64."""
    k = q.shape[2]
    a = D.expert_matmul_ref(x.float().abs(), pe, abs_stack(q), torch.float32).double()
    extra = 2 if q.bias is not None else 1
    return 2 * k * 2.0**-24 * a + extra * r * y.double().abs()


def _within(name: str, y: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor) -> float:
    err = (y.double() - ref.double()).abs()
    worst = float((err / (tol + 1e-30)).max()) if err.numel() else 0.0
    ok = bool(torch.isfinite(y).all()) and worst <= 1.0
    print(f"  {name:44s} max err {float(err.max()) if err.numel() else 0:.2e}  "
          f"err/tol {worst:.3f}  {'ok' if ok else 'FAIL'}", flush=True)
    return worst if ok else float("inf")


def h_tol(xs, pe, gate, up, h, act, alpha, limit, r, round_weights) -> torch.Tensor:
    gv = D.expert_matmul_ref(xs, pe, gate, xs.dtype, round_weights).double()
    uv = D.expert_matmul_ref(xs, pe, up, xs.dtype, round_weights).double()
    bg, bu = row_bound(xs, pe, gate, gv, r), row_bound(xs, pe, up, uv, r)
    if act == "silu":
        dg = 1.1 * (uv.abs() + bu)
        du = torch.nn.functional.silu(gv).abs() + 1.1 * bg
    else:
        gc = gv.clamp(max=limit)
        d = 1 + alpha * (gc.abs() + bg) / 4
        dg = (uv.clamp(-limit, limit).abs() + 1 + bu) * d
        du = (gc * torch.sigmoid(alpha * gc)).abs() + d * bg
    return dg * bg + du * bu + 16 * r * h.double().abs()


def down_tol(h, ids, w, down, out, scale, r, round_weights) -> torch.Tensor:
    t, k = ids.shape
    pe = ids.reshape(-1)
    yv = D.expert_matmul_ref(h, pe, down, h.dtype, round_weights).double()
    b = row_bound(h, pe, down, yv, r).reshape(t, k, -1)
    yv = yv.reshape(t, k, -1)
    wa = w.double().abs().unsqueeze(-1)
    tol = (wa * b).sum(1) + (k + 1) * r * (wa * yv.abs()).sum(1)
    return tol * abs(scale) + r * out.double().abs()


def check_case(mode, bits, group, dtype, dev, seed: int, x_: int = 16, e: int = 1024,
               f: int = 384, shapes=((1, 8), (2, 4), (96, 4))) -> float:
    """Decode and grouped kernels of one quant mode and activation dtype vs their twins:
    x_ experts of [f, e] gate/up and [e, f] down, (tokens, top-k) shapes."""
    g = torch.Generator().manual_seed(seed)
    r = 2.0**-24 if dtype == torch.float32 else 2.0**-8
    gsc = mode == "nvfp4"
    gate, up = (random_stack(mode, bits, group, x_, f, e, g, dev, gs=gsc) for _ in range(2))
    down = random_stack(mode, bits, group, x_, e, f, g, dev, gs=gsc)
    worst = 0.0
    tag = f"{mode} {bits}b g{group} {str(dtype)[6:]}"
    for t, k in shapes:
        x = torch.randn(t, e, generator=g).to(dev, dtype)
        ids = torch.stack([torch.randperm(x_, generator=g)[:k] for _ in range(t)]).to(dev)
        w = torch.softmax(torch.randn(t, k, generator=g), -1).to(dev)
        grouped = t * k > D.MAX_PAIRS
        if grouped:
            h = G.moe_grouped_gate_up(x, ids, gate, up, "silu")
            href = G.moe_grouped_gate_up_ref(x, ids, gate, up, "silu")
        else:
            h = D.moe_gate_up(x, ids, gate, up, "silu")
            href = D.moe_gate_up_ref(x, ids, gate, up, "silu")
        xs, pe = x.repeat_interleave(k, 0), ids.reshape(-1)
        tol = h_tol(xs, pe, gate, up, href, "silu", 1.702, 7.0, r, grouped)
        worst = max(worst, _within(f"{tag} gate_up T={t} k={k}", h, href, tol))
        if grouped:
            y = G.moe_grouped(x, ids, w, gate, up, down, "silu", 1.702, 7.0, dtype, 2.5)
            y_h = moe_reference.combine(G.moe_grouped_down(href, ids, down).reshape(t, k, -1),
                                        w, dtype, 2.5)
        else:
            y = D.moe_down(href, ids, w, down, dtype, 2.5)
            y_h = y
        yref = D.moe_down_ref(href, ids, w, down, dtype, 2.5) if not grouped else \
            moe_reference.combine(G.moe_grouped_down_ref(href, ids, down).reshape(t, k, -1),
                                  w, dtype, 2.5)
        tol = down_tol(href, ids, w, down, yref, 2.5, r, grouped)
        worst = max(worst, _within(f"{tag} down+combine T={t} k={k}", y_h, yref, tol))
        if grouped:  # the whole routed sum is the two launches and the combine, exactly
            parts = moe_reference.combine(G.moe_grouped_down(h, ids, down).reshape(t, k, -1),
                                          w, dtype, 2.5)
            same = torch.equal(y, parts)
            print(f"  {tag} moe_grouped == its launches + combine: {'ok' if same else 'FAIL'}")
            worst = worst if same else float("inf")
    return worst


def check_gpt_oss(dev, seed: int) -> float:
    """mxfp4 with expert biases and the clamped SwiGLU (gpt-oss's experts), bf16."""
    g = torch.Generator().manual_seed(seed)
    x_, e, f, k = 8, 512, 256, 4
    gate, up = (random_stack("mxfp4", 4, 32, x_, f, e, g, dev, bias=True) for _ in range(2))
    worst = 0.0
    for t in (1, 40):
        x = torch.randn(t, e, generator=g).to(dev, torch.bfloat16)
        ids = torch.stack([torch.randperm(x_, generator=g)[:k] for _ in range(t)]).to(dev)
        grouped = t * k > D.MAX_PAIRS
        fn = G.moe_grouped_gate_up if grouped else D.moe_gate_up
        ref = G.moe_grouped_gate_up_ref if grouped else D.moe_gate_up_ref
        h = fn(x, ids, gate, up, "swiglu_oai", 1.702, 7.0)
        href = ref(x, ids, gate, up, "swiglu_oai", 1.702, 7.0)
        tol = h_tol(x.repeat_interleave(k, 0), ids.reshape(-1), gate, up, href, "swiglu_oai",
                    1.702, 7.0, 2.0**-8, grouped)
        worst = max(worst, _within(f"gpt-oss swiglu+bias T={t}", h, href, tol))
    return worst


def check_graph(dev) -> float:
    """The decode kernels captured in a CUDA graph: replays with new ids (written into the
    captured tensors) equal eager calls."""
    g = torch.Generator().manual_seed(1)
    gate, up = (random_stack("affine", 4, 64, 16, 256, 512, g, dev) for _ in range(2))
    down = random_stack("affine", 4, 64, 16, 512, 256, g, dev)
    x = torch.randn(1, 512, generator=g).to(dev, torch.bfloat16)
    ids = torch.tensor([[0, 1, 2, 3]], device=dev)
    w = torch.full((1, 4), 0.25, device=dev)

    def body():
        h = D.moe_gate_up(x, ids, gate, up, "silu")
        return D.moe_down(h, ids, w, down, torch.bfloat16)

    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = body()
    ids.copy_(torch.tensor([[9, 4, 15, 7]], device=dev))
    graph.replay()
    want = body()
    same = torch.equal(out, want)
    print(f"  decode kernels in a CUDA graph, replay with new ids == eager: "
          f"{'ok' if same else 'FAIL'}", flush=True)
    return 0.0 if same else float("inf")


def run(dev) -> float:
    worst = 0.0
    for i, (mode, bits, group) in enumerate(QUANTS):
        for dtype in (torch.float32, torch.bfloat16):
            worst = max(worst, check_case(mode, bits, group, dtype, dev, 100 + i))
    worst = max(worst, check_gpt_oss(dev, 7), check_graph(dev))
    return worst
