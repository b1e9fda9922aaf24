"""The one-launch MoE router (mlxr.ops.moe.router) under the CPU interpreter, against its torch
twin (the router's fp32 GEMV rounded to the activation dtype, then `moe.reference.route`) on
fresh random routers (x scaled to logits within +-4: no softmax underflows to tied zeros):
bf16-free formats (float32 / float16 activations: the interpreter's bf16
casts truncate), every router kind, T in {1, 2, 5, 16}, one program per token and several (the
ticket counter's path).

In float32 the logits differ from the twin's only by the fp32 summation order (~1e-7
relative), so on random data (no near-ties) the ids must equal the twin's in the same order and
the weights agree to 256 eps relative (logits of a few units: their errors of ~H eps move
exp(l - max) by as much relative). Ties go to the lowest index (the kernel's rule, documented in
the module; torch.topk on the CPU does not promise an order): checked on logits with planted
ties against a stable descending sort.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_triton_moe_decode import stacked

from mlxr.ops.moe import decode_experts as D
from mlxr.ops.moe import decode_onepass as O
from mlxr.ops.moe import router as R
from mlxr.ops.moe.operands import dense_experts

INTERPRETER_ONLY = True  # tests/conftest.py: the interpreter is on without a GPU

FORMATS = [("affine", 8, 64, False), ("affine", 4, 32, False), ("nvfp4", 4, 16, True),
           ("mxfp4", 4, 32, False), ("dense", 32, 0, False)]
ROUTERS = [("softmax_topk", dict(norm_topk=True)), ("softmax_topk", {}),
           ("topk_softmax", {}), ("sigmoid_topk", dict(correction=True)),
           ("sigmoid_topk", dict(softcap=3.0, score_func="sqrtsoftplus"))]


def _case(q_args, router, kw, t, seed, e=40, h=128, block_e=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = stacked(*q_args, 1, e, h, seed)
    kw = dict(kw)
    if kw.pop("correction", False):
        kw["correction_bias"] = torch.randn(e, generator=g) * 0.05
    x = torch.randn(t, h, generator=g)
    e0 = torch.zeros(t, dtype=torch.long)
    x = (x * 4 / D.expert_matmul_ref(x, e0, q, torch.float32).abs().max()).to(dtype)
    ids, w = R.moe_router(x, q, router, 6, block_e=block_e, **kw)
    rids, rw = R.moe_router_ref(x, q, router, 6, **kw)
    assert ids.dtype == torch.long and w.dtype == rw.dtype
    assert torch.equal(ids, rids), f"{router} {q_args}: ids {ids} != {rids}"
    # the logits' fp32 order (~H eps |logit|, carried through exp) plus the ops' roundings
    tol = 256 * torch.finfo(dtype).eps * rw.abs().float() + 1e-30
    assert ((w.float() - rw.float()).abs() <= tol).all(), (w, rw)
    assert all(int(O.counters(torch.device("cpu"), r).abs().sum()) == 0 for r in range(3))


@pytest.mark.parametrize("q_args", FORMATS)
@pytest.mark.parametrize("router,kw", ROUTERS)
def test_router_one_program(q_args, router, kw):
    for t in (1, 2, 5, 16):
        _case(q_args, router, kw, t, 11 + t + q_args[1])


@pytest.mark.parametrize("router,kw", ROUTERS)
@pytest.mark.parametrize("t", [1, 2, 16])
def test_router_ticket_counter(router, kw, t):
    """Several programs per token (8 rows each): the last to finish selects."""
    _case(("affine", 8, 64, False), router, kw, t, 7 + t, block_e=8)


def test_router_float16_and_bias():
    """float16 activations (gates and weights rounded to float16) and a Linear bias (gpt-oss's
    router): the bias is added to the rounded logits and rounded again."""
    q = stacked("affine", 8, 32, False, 1, 32, 64, 3)
    q = q._replace(bias=torch.randn(1, 32) * 0.3)
    x = torch.randn(2, 64)
    x = (x * 3 / D.expert_matmul_ref(x, torch.zeros(2, dtype=torch.long), q,
                                     torch.float32).abs().max()).half()
    for router in ("softmax_topk", "topk_softmax"):
        ids, w = R.moe_router(x, q, router, 4, norm_topk=True)
        rids, rw = R.moe_router_ref(x, q, router, 4, norm_topk=True)
        assert torch.equal(ids, rids) and w.dtype == torch.float16
        torch.testing.assert_close(w, rw, rtol=2e-3, atol=1e-4)


def test_ties_go_to_the_lowest_index():
    """Equal logits: the kernel takes them in index order (values descending)."""
    e, h = 16, 32
    w = torch.zeros(1, e, h)
    w[0, [3, 5, 9, 12], 0] = 1.0  # logits 2.0 at experts 3, 5, 9, 12; 0 elsewhere
    w[0, 7, 0] = 2.0  # 4.0 at 7
    q = dense_experts(w)
    x = torch.zeros(1, h)
    x[0, 0] = 2.0
    for router in ("softmax_topk", "topk_softmax", "sigmoid_topk"):
        ids, _ = R.moe_router(x, q, router, 3, block_e=4)
        assert ids.tolist() == [[7, 3, 5]], router
        logits = x @ w[0].t()
        want = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :3]
        assert torch.equal(ids, want)


def test_router_quant_takes_linears():
    """A float router weight and the words of a quantized one; None where there are none."""
    dense = torch.randn(8, 64)
    q = R.router_quant(dense, torch.zeros(8))
    assert q.mode == "dense" and q.w.shape == (1, 8, 64) and q.bias.shape == (1, 8)

    class NoWords:
        packed = None
        spec = None

    assert R.router_quant(NoWords()) is None


def test_errors():
    q = stacked("affine", 8, 64, False, 1, 16, 64, 1)
    with pytest.raises(ValueError, match="router"):
        R.moe_router(torch.randn(1, 64), q, "softmax", 2)
    with pytest.raises(ValueError, match="top_k"):
        R.moe_router(torch.randn(17, 64), q, "softmax_topk", 2)
