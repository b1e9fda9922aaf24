"""The MoE dequant + torch._grouped_mm path (mlxr.ops.moe.grouped_mm) under the CPU
interpreter (the stacked dequant is Triton; _grouped_mm is torch's CPU build), against the
grouped kernel's twins on fresh random stacked experts; and which path `ops.moe_experts` takes.

* The stacked dequant equals the twin's weights (fp32 dequant rounded to bf16) bit for bit:
  the dense prefill dequant is bit-exact in fp32 and rounds once.
* bf16 activations (the path serves bf16 only). Tolerances with r = 2^-7 (one bf16 unit
  relative: two values a rounding apart may land on either side of a tie): a projection row
  B = 2*K*2^-24 * A (fp32 sums in another order, as the decode tests) + r |y| (its rounding),
  + r |y| more with an expert bias; h = act(g, u) through its derivatives (silu: 1.1 |u|,
  |silu g|) + 4 r |h| (silu and the product each round); down + combine as the decode test's:
  sum_j |w_j| (B_j + carried h error) + (k + 1) r sum_j |w_j y_j|, times the routed scale,
  + r |out|.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_triton_moe_decode import assert_within, random_ids, row_bounds, stacked
from test_triton_qmm import abs_bound

from mlxr import ops
from mlxr.ops.matmul.generic_qmm import dequant_f32
from mlxr.ops.moe import decode_split, grouped_experts as G, grouped_fused as F, grouped_mm as M

INTERPRETER_ONLY = True  # tests/conftest.py: the interpreter is on without a GPU

R = 2.0**-7
BF = torch.bfloat16
QUANTS = [("affine", 4, 64, False), ("affine", 8, 32, False), ("affine", 3, 128, False),
          ("mxfp4", 4, 32, False), ("nvfp4", 4, 16, True), ("nvfp4", 4, 16, False),
          ("mxfp8", 8, 32, False)]


@pytest.mark.parametrize("q_args", QUANTS)
def test_dequant_experts_bit_exact(q_args):
    q = stacked(*q_args, 3, 32, 128, 5 + q_args[1])
    got = M.dequant_experts(q, BF)
    want = torch.stack([dequant_f32(q.w[e], q.scales[e],
                                    None if q.biases is None else q.biases[e],
                                    None if q.global_scale is None else q.global_scale[e],
                                    *q_args[:3]).to(BF) for e in range(3)])
    assert got.dtype == BF and torch.equal(got, want)


def _h_tol(xs, pe, gate, up, href):
    gv = G.expert_matmul_ref(xs, pe, gate, BF, round_weights=True).double()
    uv = G.expert_matmul_ref(xs, pe, up, BF, round_weights=True).double()
    extra = 2 if gate.bias is not None else 1
    bg = row_bounds(xs, pe, gate) + extra * R * gv.abs()
    bu = row_bounds(xs, pe, up) + extra * R * uv.abs()
    dg, du = 1.1 * (uv.abs() + bu), torch.nn.functional.silu(gv).abs() + 1.1 * bg
    return dg * bg + du * bu + 4 * R * href.double().abs()


def _case(q_args, t, topk, experts, seed, bias=False, e=64, f=64):
    gate, up = (stacked(*q_args, experts, f, e, seed + s, bias) for s in (0, 1))
    down = stacked(*q_args, experts, e, f, seed + 2, bias)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, e, generator=g).to(BF)
    ids = random_ids(t, topk, experts, g)
    w = torch.softmax(torch.randn(t, topk, generator=g), -1)
    return gate, up, down, x, ids, w


def check_routed_sum(q_args, t, topk, experts, seed, bias=False, mm=M.moe_grouped_mm):
    """The mm path's h and routed sum vs the twins (bounds: the module doc)."""
    gate, up, down, x, ids, w = _case(q_args, t, topk, experts, seed, bias)
    xs, pe = x.repeat_interleave(topk, 0), ids.reshape(-1)
    href = G.moe_grouped_gate_up_ref(x, ids, gate, up, "silu")
    dh = _h_tol(xs, pe, gate, up, href)
    assert_within(M.moe_grouped_mm_gate_up(x, ids, gate, up, "silu"), href, dh, "mm gate_up")
    out = mm(x, ids, w, gate, up, down, "silu", 1.702, 7.0, BF, 1.5)
    ref = G.moe_grouped_ref(x, ids, w, gate, up, down, "silu", 1.702, 7.0, BF, 1.5)
    if down.mode == "dense":  # |dh| @ |W|^T
        carried = torch.cat([dh[r:r + 1] @ down.w[i].double().abs().t()
                             for r, i in enumerate(pe.tolist())])
    else:
        carried = torch.cat([abs_bound(dh[r:r + 1].float(), down.w[i], down.scales[i],
                                       None if down.biases is None else down.biases[i],
                                       None if down.global_scale is None
                                       else down.global_scale[i], *q_args[:3])[0]
                             for r, i in enumerate(pe.tolist())])
    yv = G.expert_matmul_ref(href, pe, down, BF, round_weights=True).double()
    extra = 2 if bias else 1
    b = (carried + row_bounds(href, pe, down) + extra * R * yv.abs()).reshape(t, topk, -1)
    wa = w.double().abs().unsqueeze(-1)
    tol = (wa * b).sum(1) + (topk + 1) * R * (wa * yv.abs().reshape(t, topk, -1)).sum(1)
    assert_within(out, ref, tol * 1.5 + R * ref.double().abs(), f"mm routed sum {q_args}")


@pytest.mark.parametrize("q_args", QUANTS[:2] + QUANTS[3:5] + QUANTS[6:])
def test_mm_vs_twin(q_args):
    check_routed_sum(q_args, 9, 2, 4, 11 + q_args[1])


def test_mm_dense_experts():
    """Unquantized bf16 experts: their weights go to _grouped_mm as they are."""
    gate, up, down, x, ids, w = _case(("dense", 16, 0, False), 4, 2, 3, 5)
    assert M.dequant_experts(gate, BF) is gate.w
    check_routed_sum(("dense", 16, 0, False), 7, 2, 3, 6)


def test_mm_bias_and_unused_experts():
    """Expert biases; 16 experts for 6 pairs: most groups empty (offs repeat)."""
    check_routed_sum(("affine", 4, 64, False), 3, 2, 16, 3, bias=True)


def test_mm_pieces_compose():
    """moe_grouped_mm == its gate_up and down pieces and the combine, bit for bit."""
    gate, up, down, x, ids, w = _case(("affine", 4, 64, False), 6, 3, 5, 8)
    h = M.moe_grouped_mm_gate_up(x, ids, gate, up, "silu")
    y = M.moe_grouped_mm_down(h, ids, down).reshape(6, 3, -1)
    whole = M.moe_grouped_mm(x, ids, w, gate, up, down, "silu", 1.702, 7.0, BF, 1.0)
    assert torch.equal(whole, ops.moe_combine(y, w, BF))


def test_mutation_is_caught(monkeypatch):
    """A grouping off by one row (offs shifted) breaks the bound."""
    real = M.sort_pairs

    def shifted(ids, n):
        order, experts, offs = real(ids, n)
        return order, experts, torch.clamp(offs - 1, min=0).to(torch.int32).clone().index_fill_(
            0, torch.tensor([n - 1]), int(offs[-1]))

    monkeypatch.setattr(M, "sort_pairs", shifted)
    with pytest.raises(AssertionError):
        check_routed_sum(("affine", 4, 64, False), 9, 2, 4, 12)


class _Calls:
    def __init__(self):
        self.paths = []

    def __call__(self, name):
        def fn(*a, **kw):
            self.paths.append(name)
            return a[0]
        return fn


MM = {"MLXR_MOE_GROUPED": "mm"}


def _dispatched(monkeypatch, pairs: int, dtype, split: str = "split") -> set[str]:
    """The paths `ops.moe_experts` took for a step of `pairs` (token, slot) pairs, every
    kernel replaced by a recorder (the split kernels recorded as `split`)."""
    from mlxr.ops.moe import decode_onepass as O

    calls = _Calls()
    monkeypatch.setattr(O, "moe_gate_up_onepass", calls("onepass"))
    monkeypatch.setattr(O, "moe_down_onepass", calls("onepass"))
    monkeypatch.setattr(decode_split, "moe_gate_up_split", calls(split))
    monkeypatch.setattr(decode_split, "moe_down_split", calls(split))
    monkeypatch.setattr(M, "moe_grouped_mm", calls("mm"))
    monkeypatch.setattr(G, "moe_grouped", calls("triton"))
    monkeypatch.setattr(F, "moe_grouped_fused", calls("fused"))
    q = stacked("affine", 4, 64, False, 4, 16, 64, 1)
    ids = torch.zeros(pairs // 2, 2, dtype=torch.long)
    ops.moe_experts(torch.zeros(pairs // 2, 64, dtype=dtype), ids, ids.float(), q, q, q,
                    "silu", 1.702, 7.0, dtype)
    return set(calls.paths)


@pytest.mark.parametrize("dtype,pairs,env,want", [
    (BF, 16, {}, "decode"), (BF, 18, {}, "fused"), (BF, 18, MM, "mm"),
    (torch.float32, 18, {}, "triton"), (torch.float16, 18, {}, "triton"),
    (BF, 18, {"MLXR_MOE_GROUPED": "triton"}, "triton"),
    (BF, 18, {**MM, "MLXR_MOE_MM_MIN_PAIRS": "20"}, "triton"),
    (BF, 20, {**MM, "MLXR_MOE_MM_MIN_PAIRS": "20"}, "mm"),
    (BF, 32, {"MLXR_MOE_DECODE_MAX_PAIRS": "32"}, "decode"),
    (BF, 34, {**MM, "MLXR_MOE_DECODE_MAX_PAIRS": "32"}, "mm")])
def test_dispatch(monkeypatch, dtype, pairs, env, want):
    """ops.moe_experts: decode kernels up to the crossover; beyond, bf16 takes the fused
    grouped GEMM by default and mm when the env says so (unless the pairs are below
    MLXR_MOE_MM_MIN_PAIRS), the Triton kernel else."""
    for k in ("MLXR_MOE_GROUPED", "MLXR_MOE_MM_MIN_PAIRS", "MLXR_MOE_DECODE_MAX_PAIRS"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("MLXR_MOE_DECODE", "split")  # the split kernels' crossover
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert _dispatched(monkeypatch, pairs, dtype, split="decode") == {want}


@pytest.mark.parametrize("pairs,env,want", [
    (2, {}, "onepass"), (16, {}, "onepass"), (64, {}, "onepass"), (66, {}, "fused"),
    (16, {"MLXR_MOE_DECODE": "split"}, "split"), (18, {"MLXR_MOE_DECODE": "split"}, "fused"),
    (32, {"MLXR_MOE_DECODE_MAX_PAIRS": "16"}, "fused"), (18, {"COUNTERS": 1}, "fused"),
    (16, {"COUNTERS": 1}, "split")])
def test_default_dispatch_is_onepass(monkeypatch, pairs, env, want):
    """The default (session 23, from an H100's per-layer timings): the onepass kernels up to
    64 pairs; past their counters the split kernels up to their 16 pairs; beyond, the grouped
    GEMM. MLXR_MOE_DECODE=split gives the older dispatch back."""
    from mlxr.ops.moe import decode_onepass as O

    for k in ("MLXR_MOE_GROUPED", "MLXR_MOE_DECODE", "MLXR_MOE_DECODE_MAX_PAIRS"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        if k == "COUNTERS":  # a step that does not fit the onepass counters
            monkeypatch.setattr(O, "fits", lambda *a, **kw: False)
        else:
            monkeypatch.setenv(k, v)
    assert _dispatched(monkeypatch, pairs, BF) == {want}
