"""The grouped MoE GEMM (mlxr.ops.moe.grouped_experts) under the CPU interpreter: the pair
alignment's invariants, each launch against its torch twin on fresh random stacked experts in
every expert quant mode, and the whole routed sum.

Tolerances (float32 activations: the weights' rounding to x.dtype before tl.dot is exact):
* gate/up: the decode test's bound (tests/test_triton_moe_decode.py), the dot's fp32 sums in
  another order: 2*K*2^-24 * A per projection, through the activation's derivatives.
* down (pair rows, before the combine): 2*K*2^-24 * A + eps |y| (the bias add).
* the routed sum: h's bound carried through down (|dh| @ |W_down|^T), plus down's own, then
  the combine's (as the decode test's down bound).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_triton_moe_decode import (DENSE, EPS, QUANTS, assert_within, check_gate_up, random_ids,
                                    row_bounds, stacked)
from test_triton_qmm import abs_bound

from mlxr.ops.moe import decode_experts as D
from mlxr.ops.moe import grouped_experts as G

INTERPRETER_ONLY = True  # tests/conftest.py: the interpreter is on without a GPU

CFG = G.GroupedConfig(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=1)


@pytest.mark.parametrize("t,topk,experts,bm", [(1, 1, 4, 16), (5, 3, 8, 16), (40, 2, 3, 16),
                                               (7, 4, 4, 32)])
def test_align_pairs(t, topk, experts, bm):
    """Every pair once; each block's real pairs all of its expert, in token order; padding
    only at the end of an expert's run; unused blocks marked -1 and only past the used ones."""
    g = torch.Generator().manual_seed(t * 31 + topk)
    ids = random_ids(t, topk, experts, g)
    pairs, blocks = G.align_pairs(ids, experts, bm)
    p = t * topk
    nb = -(-p // bm) + min(experts, p)
    assert pairs.shape == (nb * bm,) and blocks.shape == (nb,)
    assert pairs.dtype == blocks.dtype == torch.int32
    real = pairs[pairs < p]
    assert sorted(real.tolist()) == list(range(p))
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=experts)
    used = int(((counts + bm - 1) // bm).sum())
    assert (blocks[:used] >= 0).all() and (blocks[used:] == -1).all()
    assert (pairs[used * bm:] == p).all()
    for b in range(used):
        row = pairs[b * bm:(b + 1) * bm]
        r = row[row < p]
        assert (flat[r.long()] == blocks[b]).all()
        assert (r[1:] > r[:-1]).all()  # stable: pair (= token) order inside an expert
        assert (row[len(r):] == p).all()  # padding after the real pairs
    assert blocks[:used].tolist() == sorted(blocks[:used].tolist())


def grouped_gate_up(*a):
    return G.moe_grouped_gate_up(*a, config=CFG)


@pytest.mark.parametrize("q_args", QUANTS)
def test_gate_up(q_args):
    check_gate_up(q_args, "silu", 9, 2, 41 + q_args[1] + q_args[2], experts=3,
                  fn=grouped_gate_up, ref_fn=G.moe_grouped_gate_up_ref)


@pytest.mark.parametrize("q_args", DENSE)
def test_gate_up_dense_gelu_tanh(q_args):
    """Gemma 4's MoE as bf16 / f32 checkpoints ship it: unquantized experts, GeGLU; 30 pairs
    over 2 experts: several row blocks per expert."""
    check_gate_up(q_args, "gelu_tanh", 15, 2, 43, experts=2, fn=grouped_gate_up,
                  ref_fn=G.moe_grouped_gate_up_ref)


def test_gate_up_swiglu_bias_multi_block():
    """gpt-oss's activation and biases; 24 pairs per expert: two row blocks of one expert."""
    check_gate_up(("mxfp4", 4, 32, False), "swiglu_oai", 24, 2, 3, bias=True, experts=2,
                  fn=grouped_gate_up, ref_fn=G.moe_grouped_gate_up_ref)


@pytest.mark.parametrize("q_args", QUANTS + DENSE)
def test_down(q_args):
    mode, bits, group, gs = q_args
    t, topk, experts, e, f = 7, 2, 3, 40, 128
    down = stacked(mode, bits, group, gs, experts, e, f, 61 + bits * group, bias=True)
    g = torch.Generator().manual_seed(5)
    h = torch.randn(t * topk, f, generator=g)
    ids = random_ids(t, topk, experts, g)
    y = G.moe_grouped_down(h, ids, down, config=CFG)
    ref = G.moe_grouped_down_ref(h, ids, down)
    tol = row_bounds(h, ids.reshape(-1), down) + 2 * EPS * ref.double().abs()
    assert_within(y, ref, tol, f"grouped down {mode} {bits}b g{group}")


def test_routed_sum_matches_twin_and_decode_kernels():
    """moe_grouped (align, both launches, combine) vs its twin, and vs the decode kernels on
    the same tokens (float32: the two paths differ only in summation order)."""
    q = ("nvfp4", 4, 16, True)
    t, topk, experts, e, f = 6, 2, 4, 32, 64
    gate, up = (stacked(*q, experts, f, e, s) for s in (1, 2))
    down = stacked(*q, experts, e, f, 3)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(t, e, generator=g)
    ids = random_ids(t, topk, experts, g)
    w = torch.softmax(torch.randn(t, topk, generator=g), -1)
    out = G.moe_grouped(x, ids, w, gate, up, down, "silu", 1.702, 7.0, torch.float32, 1.5,
                        config=CFG)
    ref = G.moe_grouped_ref(x, ids, w, gate, up, down, "silu", 1.702, 7.0, torch.float32, 1.5)
    xs, pe = x.repeat_interleave(topk, 0), ids.reshape(-1)
    gv = D.expert_matmul_ref(xs, pe, gate, torch.float32).double()
    uv = D.expert_matmul_ref(xs, pe, up, torch.float32).double()
    bg, bu = row_bounds(xs, pe, gate), row_bounds(xs, pe, up)
    dh = 1.1 * (uv.abs() + bu) * bg + (torch.nn.functional.silu(gv).abs() + 1.1 * bg) * bu
    h = G.moe_grouped_gate_up_ref(x, ids, gate, up, "silu", 1.702, 7.0)
    dh = dh + 16 * EPS * h.double().abs()
    carried = torch.cat([abs_bound(dh[r:r + 1].float(), down.w[i], down.scales[i], None,
                                   down.global_scale[i], *q[:3])[1]
                         for r, i in enumerate(pe.tolist())])
    yv = D.expert_matmul_ref(h, pe, down, torch.float32).double()
    b = (carried * 1.01 + row_bounds(h, pe, down) + EPS * yv.abs()).reshape(t, topk, e)
    wa = w.double().abs().unsqueeze(-1)
    tol = ((wa * b).sum(1) + topk * EPS * (wa * yv.abs().reshape(t, topk, e)).sum(1)) * 1.5
    tol = tol + EPS * ref.double().abs()
    assert_within(out, ref, tol, "moe_grouped vs twin")
    h_dec = D.moe_gate_up(x, ids, gate, up, "silu", block_n=16)
    dec = D.moe_down(h_dec, ids, w, down, torch.float32, 1.5, block_n=16)
    assert_within(out, dec, 2 * tol, "moe_grouped vs the decode kernels")


def test_unused_blocks_and_empty():
    """More experts than pairs (most blocks unused, their programs return); zero tokens."""
    q = ("affine", 4, 64, False)
    gate, up = (stacked(*q, 16, 32, 64, s) for s in (1, 2))
    x = torch.randn(1, 64)
    ids = torch.tensor([[3, 11]])
    h = G.moe_grouped_gate_up(x, ids, gate, up, "silu", config=CFG)
    torch.testing.assert_close(h, G.moe_grouped_gate_up_ref(x, ids, gate, up, "silu"),
                               rtol=1e-5, atol=1e-5)
    empty = G.moe_grouped_gate_up(x[:0], ids[:0], gate, up, "silu", config=CFG)
    assert empty.shape == (0, 32)
