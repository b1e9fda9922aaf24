"""The decode MoE kernels (mlxr.ops.moe.decode_experts) under the CPU interpreter, against
their torch twins on fresh random stacked experts: every quant mode the experts ship in
(affine 4/8-bit x group 32/64/128, mxfp4, nvfp4 with and without a per-expert global scale,
mxfp8) and unquantized ("dense") bf16 / f32 experts, the three activations (SiLU-GLU,
gpt-oss's clamped SwiGLU, Gemma 4's GeGLU with gelu's tanh approximation), expert biases,
float32 and bf16 routing weights, the routed scale, ragged rows (F, E not multiples of the
row block).

Tolerances, float32 activations (every rounding to the activation dtype is then exact):
* a projection row: fp32 products and sums in another order than the twin's matmul, plus the
  folded affine bias: |y - ref| <= B = 2*K*2^-24 * A, A = |x| @ (|q*s| + |b|)^T (as
  tests/test_triton_qmm.py); a bias add adds one rounding, eps*|y|.
* gate/up -> h = act(g, u): the error of g moves h by at most |dh/dg| * B_g, that of u by
  |dh/du| * B_u; the kernel's exp-based activation differs from torch's by a few ulps of h.
  silu(g) * u: |dh/dg| <= 1.1 |u|, |dh/du| = |silu(g)|. gpt-oss: h = (clip(u) + 1) * gc*sig(a gc),
  |d(gc sig(a gc))/dg| <= 1 + a|gc|/4, |dh/du| <= |gc sig(a gc)|. gelu_tanh(g) * u:
  |gelu'(g)| <= 1.13, |dh/du| = |gelu(g)|; the kernel's tanh (1 - 2 / (e^2z + 1)) and its
  fp32 z are a few eps off torch's, absolutely, times 0.5 |g u|: 8 eps |g u|. Plus 16 eps |h|.
* dense experts: a row is the same fp32 dot, B = 2*K*2^-24 * |x| @ |W|^T (bf16 weights widen
  exactly).
* down + combine: sum_j |w_j| (B_j + eps |y_j|) + k eps sum_j |w_j y_j| (another summation
  order over the k slots), times the routed scale, plus eps |out| (the scale's rounding).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_triton_qmm import abs_bound, random_weight

from mlxr.ops.moe import reference as moe_reference
from mlxr.ops.moe import decode_experts as D
from mlxr.ops.moe.operands import dense_experts

INTERPRETER_ONLY = True  # tests/conftest.py: the interpreter is on without a GPU

EPS = 2.0**-24
QUANTS = [("affine", b, g, False) for b in (4, 8) for g in (32, 64, 128)] + [
    ("mxfp4", 4, 32, False), ("nvfp4", 4, 16, False), ("nvfp4", 4, 16, True),
    ("mxfp8", 8, 32, False)]
DENSE = [("dense", 16, 0, False), ("dense", 32, 0, False)]  # bf16 / f32 weights, unquantized


def stacked(mode, bits, group, gs, x, n, k, seed, bias=False) -> D.ExpertQuant:
    """X random experts [n, k] stacked as the file holds them; per-expert global scales.
    mode "dense": float weights (bits 16: bf16, 32: f32)."""
    if mode == "dense":
        g = torch.Generator().manual_seed(seed)
        w = (torch.randn(x, n, k, generator=g) * 0.1).to(
            torch.bfloat16 if bits == 16 else torch.float32)
        eb = torch.randn(x, n, generator=g) * 0.5 if bias else None
        return dense_experts(w, eb)
    parts = [random_weight(mode, bits, group, n, k, seed + 17 * e) for e in range(x)]
    g = torch.Generator().manual_seed(seed)
    w, s = torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts])
    b = torch.stack([p[2] for p in parts]) if mode == "affine" else None
    gsc = torch.rand(x, generator=g) * 4 + 0.5 if gs else None
    eb = torch.randn(x, n, generator=g) * 0.5 if bias else None
    return D.ExpertQuant(w, s, b, gsc, eb, mode, bits, group)


def row_bounds(xs, pe, q: D.ExpertQuant) -> torch.Tensor:
    """B [P, N] for row r of xs through expert pe[r] (float64)."""
    _, _, k = q.shape
    out = []
    for r in range(xs.shape[0]):
        e = int(pe[r])
        if q.mode == "dense":
            out.append(2 * k * EPS * (xs[r:r + 1].double().abs() @ q.w[e].double().abs().t()))
            continue
        gs = None if q.global_scale is None else q.global_scale[e]
        a, _ = abs_bound(xs[r:r + 1], q.w[e], q.scales[e],
                         None if q.biases is None else q.biases[e], gs, q.mode, q.bits, q.group)
        out.append(2 * k * EPS * a)
    return torch.cat(out)


def random_ids(t, topk, x, g) -> torch.Tensor:
    """Distinct experts per token, as top-k selects them."""
    return torch.stack([torch.randperm(x, generator=g)[:topk] for _ in range(t)])


def assert_within(y, ref, tol, what):
    err = (y.double() - ref.double()).abs()
    assert torch.isfinite(y).all(), what
    assert (err <= tol + 1e-30).all(), (f"{what}: max err {err.max().item():.3g}, worst "
                                        f"err/tol {(err / (tol + 1e-30)).max().item():.3g}")


def check_gate_up(q_args, act, t, topk, seed, bias=False, f=40, k=128, experts=5, fn=None,
                  ref_fn=None):
    """fn / ref_fn: (x, ids, gate, up, act, alpha, limit) -> h (default: the decode kernel
    and its twin)."""
    mode, bits, group, gs = q_args
    gate = stacked(mode, bits, group, gs, experts, f, k, seed, bias)
    up = stacked(mode, bits, group, gs, experts, f, k, seed + 1, bias)
    g = torch.Generator().manual_seed(seed + 2)
    x = torch.randn(t, k, generator=g)
    ids = random_ids(t, topk, experts, g)
    alpha, limit = 1.702, 2.0  # a low limit: the clamps are taken on random data
    fn = fn or (lambda *a: D.moe_gate_up(*a, block_n=16))
    h = fn(x, ids, gate, up, act, alpha, limit)
    ref = (ref_fn or D.moe_gate_up_ref)(x, ids, gate, up, act, alpha, limit)
    assert h.shape == (t * topk, f) and h.dtype == x.dtype
    xs, pe = x.repeat_interleave(topk, 0), ids.reshape(-1)
    gv = D.expert_matmul_ref(xs, pe, gate, torch.float32).double()
    uv = D.expert_matmul_ref(xs, pe, up, torch.float32).double()
    bg = row_bounds(xs, pe, gate) + EPS * gv.abs()
    bu = row_bounds(xs, pe, up) + EPS * uv.abs()
    extra = 0.0
    if act == "silu":
        dg, du = 1.1 * (uv.abs() + bu), moe_reference.expert_act(gv, uv, "silu").abs() / (
            uv.abs().clamp_min(1e-300)) + 1.1 * bg
    elif act == "gelu_tanh":
        dg = 1.13 * (uv.abs() + bu)
        du = torch.nn.functional.gelu(gv, approximate="tanh").abs() + 1.13 * bg
        extra = 8 * EPS * (gv.abs() + bg) * (uv.abs() + bu)
    else:
        gc = gv.clamp(max=limit)
        glu = gc * torch.sigmoid(alpha * gc)
        dg = (uv.clamp(-limit, limit).abs() + 1 + bu) * (1 + alpha * (gc.abs() + bg) / 4)
        du = glu.abs() + (1 + alpha * (gc.abs() + bg) / 4) * bg
    tol = dg * bg + du * bu + extra + 16 * EPS * ref.double().abs()
    assert_within(h, ref, tol, f"gate_up {mode} {bits}b g{group} gs={gs} {act}")
    return tol


@pytest.mark.parametrize("q_args", QUANTS)
def test_gate_up_silu(q_args):
    check_gate_up(q_args, "silu", 3, 2, 11 + q_args[1] + q_args[2])


@pytest.mark.parametrize("q_args", DENSE)
def test_gate_up_dense(q_args):
    """Unquantized stacked experts (bf16 / f32 checkpoints) on the decode kernels."""
    check_gate_up(q_args, "silu", 3, 2, 19)


@pytest.mark.parametrize("q_args", [("affine", 4, 64, False), ("dense", 16, 0, False)])
def test_gate_up_gelu_tanh(q_args):
    """Gemma 4's GeGLU experts (gelu with tanh approximation, mlx's gelu_approx), quantized
    and bf16. The bound separates it from the exact (erf) gelu: a kernel computing that one
    (or a wrong tanh constant) fails it."""
    tol = check_gate_up(q_args, "gelu_tanh", 3, 2, 29)
    gate = stacked(*q_args, 5, 40, 128, 29)  # check_gate_up's operands again
    up = stacked(*q_args, 5, 40, 128, 30)
    g = torch.Generator().manual_seed(31)
    x = torch.randn(3, 128, generator=g)
    ids = random_ids(3, 2, 5, g)
    xs, pe = x.repeat_interleave(2, 0), ids.reshape(-1)
    gv = D.expert_matmul_ref(xs, pe, gate, torch.float32)
    uv = D.expert_matmul_ref(xs, pe, up, torch.float32)
    h = D.moe_gate_up(x, ids, gate, up, "gelu_tanh", block_n=16)
    exact = torch.nn.functional.gelu(gv) * uv
    assert ((h - exact).abs().double() > tol).any(), "gelu_tanh not told from the exact gelu"


@pytest.mark.parametrize("q_args", [("affine", 4, 64, False), ("mxfp4", 4, 32, False)])
def test_gate_up_swiglu_with_bias(q_args):
    """gpt-oss: the clamped SwiGLU over expert-biased gate/up (mxfp4 is what it ships in)."""
    check_gate_up(q_args, "swiglu_oai", 2, 3, 5, bias=True)


def check_down(q_args, t, topk, seed, wdtype=torch.float32, scale=1.0, bias=False, e=40,
               f=128, experts=5, fn=None):
    """fn: (h, ids, w, down, out_dtype, scale) -> y (default: the decode kernel)."""
    mode, bits, group, gs = q_args
    down = stacked(mode, bits, group, gs, experts, e, f, seed, bias)
    g = torch.Generator().manual_seed(seed + 3)
    h = torch.randn(t * topk, f, generator=g)
    ids = random_ids(t, topk, experts, g)
    w = torch.softmax(torch.randn(t, topk, generator=g), -1).to(wdtype)
    fn = fn or (lambda *a: D.moe_down(*a, block_n=16))
    y = fn(h, ids, w, down, torch.float32, scale)
    ref = D.moe_down_ref(h, ids, w, down, torch.float32, scale)
    assert y.shape == (t, e)
    pe = ids.reshape(-1)
    yv = D.expert_matmul_ref(h, pe, down, torch.float32).double().reshape(t, topk, e)
    b = (row_bounds(h, pe, down).reshape(t, topk, e) + EPS * yv.abs())
    wa = w.double().abs().unsqueeze(-1)
    tol = (wa * b).sum(1) + topk * EPS * (wa * yv.abs()).sum(1)
    tol = tol * abs(scale) + EPS * ref.double().abs()
    assert_within(y, ref, tol, f"down {mode} {bits}b g{group} gs={gs}")


@pytest.mark.parametrize("q_args", QUANTS + DENSE)
def test_down(q_args):
    check_down(q_args, 2, 3, 23 + q_args[1] * q_args[2])


def test_down_bias_scale_bf16_weights():
    """Expert biases, the routed scale after the cast, and bf16 routing weights (the softmax
    routers' dtype in a bf16 model: the kernel's products round only in a bf16 model)."""
    check_down(("affine", 8, 64, False), 3, 2, 7, torch.bfloat16, 2.5, bias=True)
    check_down(("nvfp4", 4, 16, True), 1, 4, 9, scale=0.75)


def test_down_single_token_many_slots():
    """Decode b=1 with k = 8 of 12 experts (every slot of the static loop)."""
    check_down(("affine", 4, 64, False), 1, 8, 31, experts=12)


def test_kernels_read_device_ids_without_host_sync():
    """The ids and weights stay tensors (no .item()/.tolist() in the launchers): the same
    call with other ids in the same tensors gives the other experts' outputs."""
    q = stacked("affine", 4, 64, False, 4, 16, 64, 3)
    x = torch.randn(1, 64)
    ids = torch.tensor([[0, 1]])
    a = D.moe_gate_up(x, ids, q, q, "silu", block_n=16)
    ids.copy_(torch.tensor([[2, 3]]))
    b = D.moe_gate_up(x, ids, q, q, "silu", block_n=16)
    ref = D.moe_gate_up_ref(x, torch.tensor([[2, 3]]), q, q, "silu")
    assert not torch.allclose(a, b)
    torch.testing.assert_close(b, ref, rtol=1e-5, atol=1e-5)


def test_errors():
    q = stacked("affine", 4, 64, False, 2, 16, 64, 1)
    r = stacked("affine", 8, 64, False, 2, 16, 64, 1)
    with pytest.raises(ValueError, match="share"):
        D.moe_gate_up(torch.randn(1, 64), torch.tensor([[0]]), q, r, "silu")
    with pytest.raises(ValueError, match="activation"):
        D.moe_gate_up(torch.randn(1, 64), torch.tensor([[0]]), q, q, "gelu")
    with pytest.raises(ValueError, match="fit"):
        D.moe_down(torch.randn(2, 8), torch.tensor([[0, 1]]), torch.ones(1, 2), q,
                   torch.float32)


@pytest.mark.parametrize("q_args", [("affine", 3, 32, False), ("affine", 6, 64, False)])
def test_straddling_widths(q_args):
    """3/6-bit codes straddle words (units of 3 words) and their groups are not a power of
    two words: the tile still takes a power-of-two number of groups."""
    check_gate_up(q_args, "silu", 2, 2, 13)
    check_down(q_args, 2, 2, 17)
