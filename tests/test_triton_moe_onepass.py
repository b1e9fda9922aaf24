"""The one-launch split-K decode MoE kernels (mlxr.ops.moe.decode_onepass) under the CPU
interpreter, against the decode kernels' torch twins on fresh random stacked experts, every
expert format at T in {1, 2, 5, 16}.

They sum the same K chunks as `decode_split` (each chunk by `_expert_rows`, the chunks in order),
so tests/test_triton_moe_decode.py's bounds hold unchanged. The ticket counters are checked to
be back at zero after every launch (the next launch, or the next CUDA graph replay, relies on
it), and a token's output must not depend on the other tokens of its batch.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_triton_moe_decode import check_down, check_gate_up, random_ids, stacked

from mlxr.ops.moe import decode_onepass as O
from mlxr.ops.moe.decode_split import DecodeConfig

INTERPRETER_ONLY = True  # tests/conftest.py: the interpreter is on without a GPU

FORMATS = [("affine", 4, 64, False), ("affine", 4, 32, False), ("affine", 8, 64, False),
           ("mxfp4", 4, 32, False), ("nvfp4", 4, 16, True), ("mxfp8", 8, 32, False),
           ("dense", 16, 0, False)]
TS = [(1, 8), (2, 8), (5, 3), (16, 1)]


def _counters_zero():
    cpu = torch.device("cpu")
    return all(int(O.counters(cpu, r).abs().sum()) == 0 for r in range(3))


@pytest.mark.parametrize("q_args", FORMATS)
@pytest.mark.parametrize("t,topk", TS)
def test_gate_up_onepass(q_args, t, topk):
    cfg = DecodeConfig(16, 2, 4)
    check_gate_up(q_args, "silu", t, topk, 3 + q_args[1] + q_args[2] + t, k=128, experts=9,
                  fn=lambda *a: O.moe_gate_up_onepass(*a, config=cfg))
    assert _counters_zero()


@pytest.mark.parametrize("q_args", FORMATS)
@pytest.mark.parametrize("t,topk", TS)
def test_down_onepass(q_args, t, topk):
    cfg = DecodeConfig(16, 2, 4)
    check_down(q_args, t, topk, 5 + q_args[1] * q_args[2] + t, experts=9,
               fn=lambda *a: O.moe_down_onepass(*a, config=cfg))
    assert _counters_zero()


@pytest.mark.parametrize("cfg", [DecodeConfig(16, 1, 4), DecodeConfig(None, 4, 4),
                                 DecodeConfig(8, 3, 2)])
def test_configs_swiglu_bias_scale(cfg):
    """No split (the fused epilogue without counters), a 4-way split, an uneven request (3
    of the 4 groups: `chunks` takes 2); gpt-oss's clamped SwiGLU with expert biases; the
    routed scale and bf16 routing weights in down."""
    check_gate_up(("mxfp4", 4, 32, False), "swiglu_oai", 2, 3, 7, bias=True,
                  fn=lambda *a: O.moe_gate_up_onepass(*a, config=cfg))
    check_down(("affine", 4, 32, False), 3, 2, 7, torch.bfloat16, 2.5, bias=True,
               fn=lambda *a: O.moe_down_onepass(*a, config=cfg))
    assert _counters_zero()


def test_gelu_tanh():
    check_gate_up(("affine", 8, 32, False), "gelu_tanh", 2, 2, 17,
                  fn=lambda *a: O.moe_gate_up_onepass(*a, config=DecodeConfig(16, 4, 4)))


def test_batch_invariance_and_device_ids():
    """Token 0's output alone equals its row in a batch of 5, bit for bit; new ids written
    into the same tensor give the other experts' outputs (nothing read on the host)."""
    gate = stacked("affine", 4, 64, False, 8, 32, 128, 1)
    up = stacked("affine", 4, 64, False, 8, 32, 128, 2)
    down = stacked("affine", 4, 32, False, 8, 128, 32, 3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 128, generator=g)
    ids = random_ids(5, 3, 8, g)
    w = torch.softmax(torch.randn(5, 3, generator=g), -1)
    cfg = DecodeConfig(8, 2, 4)

    def block(xx, ii, ww):
        h = O.moe_gate_up_onepass(xx, ii, gate, up, "silu", config=cfg)
        return O.moe_down_onepass(h, ii, ww, down, torch.float32, config=cfg)

    many = block(x, ids, w)
    one = block(x[:1], ids[:1].clone(), w[:1])
    assert torch.equal(one[0], many[0])
    ids1 = ids[:1].clone()
    a = block(x[:1], ids1, w[:1])
    ids1.copy_(ids[1:2])
    b = block(x[:1], ids1, w[:1])
    assert not torch.equal(a, b)
    assert torch.equal(b, block(x[:1], ids[1:2].clone(), w[:1]))


def test_counters_bound():
    """The workspace holds a counter per (pair, row tile): the decode shapes fit (16 pairs of
    Qwen3-30B-A3B's 768 rows in tiles of 8), a launch past it is refused."""
    assert O._tiles_fit(16, 2048, 8)
    assert not O._tiles_fit(16, 1 << 20, 1)


@pytest.mark.parametrize("q_args", [("affine", 4, 64, False), ("nvfp4", 4, 16, False),
                                    ("dense", 16, 0, False)])
def test_shared_expert_in_the_launches(q_args):
    """The shared expert folded into both launches equals, bit for bit, the same kernels run
    on the routed pairs and on the shared expert as a one-expert top-1 stack, then added as
    `MoeBlock` adds them (each in the activation dtype): the fold changes no sum."""
    t, topk, f, k, e = 3, 2, 64, 128, 40
    gate, up = (stacked(*q_args, 6, f, k, s) for s in (1, 2))
    down = stacked(*q_args, 6, k, f, 3)
    sg, su = (stacked(*q_args, 1, f, k, s) for s in (4, 5))
    sd = stacked(*q_args, 1, k, f, 6)
    g = torch.Generator().manual_seed(e)
    x = torch.randn(t, k, generator=g)
    ids = random_ids(t, topk, 6, g)
    w = torch.softmax(torch.randn(t, topk, generator=g), -1)
    cfg = DecodeConfig(8, 2, 4)
    h = O.moe_gate_up_onepass(x, ids, gate, up, "silu", config=cfg, shared=(sg, su))
    zero, one = torch.zeros(t, 1, dtype=torch.long), torch.ones(t, 1)
    assert torch.equal(h[:t * topk], O.moe_gate_up_onepass(x, ids, gate, up, "silu", config=cfg))
    assert torch.equal(h[t * topk:], O.moe_gate_up_onepass(x, zero, sg, su, "silu", config=cfg))
    y = O.moe_down_onepass(h, ids, w, down, torch.float32, 2.5, config=cfg, shared=sd)
    routed = O.moe_down_onepass(h[:t * topk], ids, w, down, torch.float32, 2.5, config=cfg)
    alone = O.moe_down_onepass(h[t * topk:], zero, one, sd, torch.float32, config=cfg)
    assert torch.equal(y, routed + alone)
    assert _counters_zero()
    with pytest.raises(ValueError, match="fit"):
        O.moe_down_onepass(h[:-1], ids, w, down, torch.float32, config=cfg, shared=sd)
    assert not O.shared_fits(gate, stacked(*q_args, 1, f + 8, k, 7))


def test_shared_stacks_of_linears():
    """A shared expert's Linears as one-expert stacks: gate and up the halves of the stacked
    [gate; up] rows (views), down whole; a bias or a missing weight declines."""
    from mlxr.layers import Linear
    from mlxr.ops.moe.operands import shared_stacks

    gu, dn = torch.randn(64, 32), torch.randn(32, 32)
    gate, up, down = shared_stacks(Linear(gu), Linear(dn))
    assert torch.equal(gate.w[0], gu[:32]) and torch.equal(up.w[0], gu[32:])
    assert torch.equal(down.w[0], dn) and gate.shape == (1, 32, 32)
    assert O.shared_fits(gate, gate) and not O.shared_fits(
        gate, shared_stacks(Linear(gu, torch.ones(64)), Linear(dn))[0])
    assert shared_stacks(Linear(gu), None) is None


@pytest.mark.parametrize("q_args", [("affine", 4, 64, False), ("affine", 3, 32, False),
                                    ("nvfp4", 4, 16, True), ("mxfp8", 8, 32, False)])
def test_paired_rows_equal_apart(q_args, monkeypatch):
    """Gate and up in one tile loop (`decode_rows`) sum each row as two `_expert_rows` calls
    do: the same h, bit for bit (3-bit: codes straddling words)."""
    gate, up = (stacked(*q_args, 5, 40, 128, s) for s in (1, 2))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 128, generator=g)
    ids = random_ids(2, 3, 5, g)
    for cfg in (DecodeConfig(16, 1, 4), DecodeConfig(16, 2, 4)):
        paired = O.moe_gate_up_onepass(x, ids, gate, up, "silu", config=cfg)
        monkeypatch.setattr(O, "PAIRED", False)
        apart = O.moe_gate_up_onepass(x, ids, gate, up, "silu", config=cfg)
        monkeypatch.setattr(O, "PAIRED", True)
        assert torch.equal(paired, apart)


def test_dispatch_falls_back_past_the_counters(monkeypatch):
    """MLXR_MOE_DECODE=onepass with more pairs than the counters hold at the default row
    blocks: `ops.moe_experts` takes the split kernels instead of raising."""
    from mlxr import ops

    q = stacked("affine", 4, 64, False, 4, 32, 64, 1)
    d = stacked("affine", 4, 32, False, 4, 64, 32, 2)
    ids = torch.tensor([[0, 3]])
    assert O.fits(ids, q, d) and O.fits(ids, q, d, True)
    monkeypatch.setattr(O, "ONEPASS_GATE_UP", DecodeConfig(1, 1, 4))
    monkeypatch.setattr(O, "TILES", 1)
    assert not O.fits(ids, q, d)
    monkeypatch.setenv("MLXR_MOE_DECODE", "onepass")
    x = torch.randn(1, 64)
    w = torch.full((1, 2), 0.5)
    y = ops.moe_experts(x, ids, w, q, q, d, "silu", 1.702, 7.0, torch.float32)
    monkeypatch.setenv("MLXR_MOE_DECODE", "split")
    assert torch.equal(y, ops.moe_experts(x, ids, w, q, q, d, "silu", 1.702, 7.0,
                                          torch.float32))


@pytest.mark.parametrize("q_args", [("affine", 4, 64, False), ("nvfp4", 4, 16, True),
                                    ("dense", 16, 0, False)])
def test_equal_to_the_split_kernels(q_args):
    """At the same split the onepass kernels sum exactly what `decode_split`'s two launches
    sum (its chunks by `_expert_rows`, here by `decode_rows`; the chunks and slots in the same
    order): bit-equal outputs."""
    from mlxr.ops.moe import decode_split as S

    gate, up = (stacked(*q_args, 5, 64, 128, s) for s in (1, 2))
    down = stacked(*q_args, 5, 128, 64, 3)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 128, generator=g)
    ids = random_ids(2, 3, 5, g)
    w = torch.softmax(torch.randn(2, 3, generator=g), -1)
    for cfg in (DecodeConfig(16, 2, 4), DecodeConfig(16, 1, 4)):
        h = O.moe_gate_up_onepass(x, ids, gate, up, "silu", config=cfg)
        assert torch.equal(h, S.moe_gate_up_split(x, ids, gate, up, "silu", config=cfg))
        y = O.moe_down_onepass(h, ids, w, down, torch.float32, 2.5, config=cfg)
        assert torch.equal(y, S.moe_down_split(h, ids, w, down, torch.float32, 2.5, config=cfg))
