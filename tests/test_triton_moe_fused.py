"""The in-kernel dequant grouped MoE GEMM (mlxr.ops.moe.grouped_fused) under the CPU
interpreter, against the grouped kernel's torch twins on fresh random stacked experts: the
quant modes it reads (affine 2/4/8-bit, mxfp4, nvfp4 with and without global scales, mxfp8,
dense bf16 / f32), both operand orders (x @ W^T and W @ x^T), K tiles smaller than a group
(the scale offsets advance every GROUP / BLOCK_K tiles) and larger (several groups per tile),
ragged N, expert biases, the three activations, the whole routed sum in float32 and bf16.

Tolerances are the decode / grouped tests' (tests/test_triton_moe_decode.py,
tests/test_triton_moe_mm.py): float32 activations make every rounding to x.dtype exact, so
only the dot's fp32 summation order differs (2*K*2^-24 * A per projection, carried through
the activation); bf16: the mm path's bounds with r = 2^-7.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_triton_moe_decode import (EPS, assert_within, check_down, check_gate_up, random_ids,
                                    row_bounds, stacked)
from test_triton_moe_mm import check_routed_sum

from mlxr import ops
from mlxr.ops.moe import grouped_experts as G
from mlxr.ops.moe import grouped_fused as F
from mlxr.ops.moe import grouped_mm as M
from mlxr.ops.moe import reference as moe_reference

INTERPRETER_ONLY = True  # tests/conftest.py: the interpreter is on without a GPU

BF = torch.bfloat16
CFG = F.FusedConfig(block_m=16, block_n=32, block_k=64, num_stages=1)
CFG_XW = F.FusedConfig(block_m=16, block_n=32, block_k=64, num_stages=1, w_as_a=False)
CFG_K32 = F.FusedConfig(block_m=16, block_n=32, block_k=32, num_stages=1)
QUANTS = [("affine", 4, 64, False), ("affine", 8, 32, False), ("affine", 2, 128, False),
          ("mxfp4", 4, 32, False), ("nvfp4", 4, 16, True), ("nvfp4", 4, 16, False),
          ("mxfp8", 8, 32, False)]
DENSE = [("dense", 16, 0, False), ("dense", 32, 0, False)]


def fused_gate_up(cfg):
    return lambda *a: F.moe_fused_gate_up(*a, config=cfg)


@pytest.mark.parametrize("q_args", QUANTS + DENSE)
def test_gate_up(q_args):
    """40 rows of F over a 32-row tile: ragged N; 9 tokens x 2 over 3 experts."""
    check_gate_up(q_args, "silu", 9, 2, 41 + q_args[1] + q_args[2], experts=3,
                  fn=fused_gate_up(CFG), ref_fn=G.moe_grouped_gate_up_ref)


@pytest.mark.parametrize("cfg", [CFG_XW, CFG_K32], ids=["x_at_wT", "block_k_32"])
@pytest.mark.parametrize("q_args", [("affine", 4, 128, False), ("nvfp4", 4, 16, True)])
def test_gate_up_configs(cfg, q_args):
    """x @ W^T; K tiles of 32 inside 128-groups (scales advance every 4th tile) and over
    two 16-groups."""
    check_gate_up(q_args, "silu", 7, 2, 13 + q_args[2], experts=3, fn=fused_gate_up(cfg),
                  ref_fn=G.moe_grouped_gate_up_ref)


def test_gate_up_swiglu_bias_gelu():
    """gpt-oss's clamped SwiGLU with expert biases (mxfp4), Gemma 4's GeGLU (dense bf16); 24
    pairs of one expert over two row blocks."""
    check_gate_up(("mxfp4", 4, 32, False), "swiglu_oai", 24, 2, 3, bias=True, experts=2,
                  fn=fused_gate_up(CFG), ref_fn=G.moe_grouped_gate_up_ref)
    check_gate_up(("dense", 16, 0, False), "gelu_tanh", 6, 2, 4, experts=2,
                  fn=fused_gate_up(CFG_XW), ref_fn=G.moe_grouped_gate_up_ref)


@pytest.mark.parametrize("q_args", QUANTS[:1] + QUANTS[3:5] + DENSE[:1])
def test_down(q_args):
    mode, bits, group, gs = q_args
    t, topk, experts, e, f = 7, 2, 3, 40, 128
    down = stacked(mode, bits, group, gs, experts, e, f, 61 + bits, bias=True)
    g = torch.Generator().manual_seed(5)
    h = torch.randn(t * topk, f, generator=g)
    ids = random_ids(t, topk, experts, g)
    y = F.moe_fused_down(h, ids, down, config=CFG)
    ref = G.moe_grouped_down_ref(h, ids, down)
    tol = row_bounds(h, ids.reshape(-1), down) + 2 * EPS * ref.double().abs()
    assert_within(y, ref, tol, f"fused down {mode} {bits}b g{group}")


def whole(cfg):
    """(h, ids, w, down, out_dtype, scale) -> the fused down launch (h's rows gathered in
    pair order) and the combine, in check_down's signature."""
    def fn(h, ids, w, down, out_dtype, scale):
        y = F.moe_fused_down(h, ids, down, config=cfg)
        return moe_reference.combine(y.reshape(*ids.shape, -1), w, out_dtype, scale)
    return fn


@pytest.mark.parametrize("q_args", [("affine", 8, 64, False), ("nvfp4", 4, 16, True)])
def test_down_combined(q_args):
    """down + combine vs the decode twin's routed sum (bf16 routing weights, routed scale)."""
    check_down(q_args, 3, 2, 7, torch.bfloat16, 2.5, bias=True, fn=whole(CFG))


@pytest.mark.parametrize("q_args", [("affine", 4, 64, False), ("mxfp4", 4, 32, False),
                                    ("nvfp4", 4, 16, True), ("dense", 16, 0, False)])
def test_routed_sum_bf16(q_args):
    """The whole path (h in block order, the routing weight in down's epilogue, the slot
    sum) vs the twin in bf16, the mm path's bounds."""
    check_routed_sum(q_args, 9, 2, 4, 11 + q_args[1],
                     mm=lambda *a: F.moe_grouped_fused(*a, config=CFG))


def test_whole_equals_pieces_bit_for_bit():
    """moe_grouped_fused == its gate_up and down launches and moe_reference.combine, bf16,
    bit for bit: the same rows in the same K order, and the epilogue's weighted products are
    torch's (bf16 weights: rounded to bf16; float32 weights: float32 products)."""
    q = ("affine", 4, 64, False)
    gate, up = (stacked(*q, 5, 64, 128, s, True) for s in (1, 2))
    down = stacked(*q, 5, 128, 64, 3, True)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(11, 128, generator=g).to(BF)
    ids = random_ids(11, 3, 5, g)
    for wdt in (BF, torch.float32):
        w = torch.softmax(torch.randn(11, 3, generator=g), -1).to(wdt)
        out = F.moe_grouped_fused(x, ids, w, gate, up, down, "silu", 1.702, 7.0, BF, 1.5,
                                  config=CFG)
        h = F.moe_fused_gate_up(x, ids, gate, up, "silu", config=CFG)
        y = F.moe_fused_down(h, ids, down, config=CFG).reshape(11, 3, -1)
        assert torch.equal(out, moe_reference.combine(y, w, BF, 1.5)), wdt


def test_routing_weights_matter():
    """A mutation check: the same call with the slots' weights swapped moves the output
    past the bound (the epilogue really reads each pair's own weight)."""
    q = ("affine", 4, 64, False)
    gate, up = (stacked(*q, 4, 64, 64, s) for s in (1, 2))
    down = stacked(*q, 4, 64, 64, 3)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=g)
    ids = random_ids(5, 2, 4, g)
    w = torch.tensor([[0.9, 0.1]] * 5)
    ref = G.moe_grouped_ref(x, ids, w, gate, up, down, "silu", 1.702, 7.0, torch.float32)
    out = F.moe_grouped_fused(x, ids, w, gate, up, down, "silu", 1.702, 7.0, torch.float32,
                              config=CFG)
    bad = F.moe_grouped_fused(x, ids, w.flip(1), gate, up, down, "silu", 1.702, 7.0,
                              torch.float32, config=CFG)
    tol = 1e-4 * ref.abs().max()
    assert (out - ref).abs().max() <= tol < (bad - ref).abs().max()


def test_unused_blocks_empty_and_unsupported():
    """More experts than pairs (most blocks unused); zero tokens; 3-bit codes refused."""
    q = ("affine", 4, 64, False)
    gate, up = (stacked(*q, 16, 64, 64, s) for s in (1, 2))
    x = torch.randn(1, 64)
    ids = torch.tensor([[3, 11]])
    h = F.moe_fused_gate_up(x, ids, gate, up, "silu", config=CFG)
    torch.testing.assert_close(h, G.moe_grouped_gate_up_ref(x, ids, gate, up, "silu"),
                               rtol=1e-5, atol=1e-5)
    out = F.moe_grouped_fused(x[:0], ids[:0], ids[:0].float(), gate, up,
                              stacked(*q, 16, 64, 64, 3), "silu", 1.702, 7.0, torch.float32)
    assert out.shape == (0, 64)
    q3 = stacked("affine", 3, 32, False, 2, 32, 64, 1)
    assert not F.fused_takes(q3) and F.fused_takes(gate)
    with pytest.raises(ValueError, match="not fused"):
        F.moe_fused_gate_up(x, ids % 2, q3, q3, "silu", config=CFG)


@pytest.mark.parametrize("bits,want", [(4, "fused"), (3, "triton")])
def test_dispatch(monkeypatch, bits, want):
    """MLXR_MOE_GROUPED=fused: past the decode kernels, the fused path for the codes it
    reads, the older grouped kernel for the rest; the default stays mm."""
    monkeypatch.setenv("MLXR_MOE_GROUPED", "fused")
    monkeypatch.setenv("MLXR_MOE_DECODE_MAX_PAIRS", "16")  # past the decode kernels
    calls = []
    monkeypatch.setattr(F, "moe_grouped_fused", lambda *a, **k: calls.append("fused"))
    monkeypatch.setattr(G, "moe_grouped", lambda *a, **k: calls.append("triton"))
    monkeypatch.setattr(M, "moe_grouped_mm", lambda *a, **k: calls.append("mm"))
    q = stacked("affine", bits, 32 if bits == 3 else 64, False, 4, 16, 64, 1)
    ids = torch.zeros(9, 2, dtype=torch.long)
    ops.moe_experts(torch.zeros(9, 64, dtype=BF), ids, ids.float(), q, q, q, "silu", 1.702,
                    7.0, BF)
    assert calls == [want]
    monkeypatch.delenv("MLXR_MOE_GROUPED")
    assert M.grouped_mode() == "auto"


@pytest.mark.parametrize("dtype,mode,tokens,want", [
    (BF, "affine", 9, "fused"), (torch.float32, "affine", 9, "triton"),
    (BF, "mxfp4", 9, "fused"), (BF, "mxfp4", 4097, "mm")])
def test_auto_dispatch(monkeypatch, dtype, mode, tokens, want):
    """The default (auto): the fused kernel in bf16 compute, for fp4 stacks only up to
    8192 pairs (mm measured faster beyond); float32 keeps the grouped kernel."""
    monkeypatch.delenv("MLXR_MOE_GROUPED", raising=False)
    monkeypatch.setenv("MLXR_MOE_DECODE_MAX_PAIRS", "16")  # past the decode kernels
    calls = []
    monkeypatch.setattr(F, "moe_grouped_fused", lambda *a, **k: calls.append("fused"))
    monkeypatch.setattr(G, "moe_grouped", lambda *a, **k: calls.append("triton"))
    monkeypatch.setattr(M, "moe_grouped_mm", lambda *a, **k: calls.append("mm"))
    monkeypatch.setattr(M, "mm_takes", lambda x, *a: x.dtype == BF)  # its bf16 condition
    q = stacked(mode, 4, 32 if mode == "mxfp4" else 64, False, 4, 16, 64, 1)
    ids = torch.zeros(tokens, 2, dtype=torch.long)
    ops.moe_experts(torch.zeros(tokens, 64, dtype=dtype), ids, ids.float(), q, q, q, "silu",
                    1.702, 7.0, dtype)
    assert calls == [want]
