"""Gemma 4's per-layer-input branch in two launches (mlxr.ops.layer.residual_gemv,
on CUDA by default) vs its twins (mlxr.ops.reference.residual_linear_act and
linear_residual_norm, composing the reference residual norm, the GEMV's fp32 twin
`decode_experts.expert_matmul_ref` and the gated activation), under the CPU interpreter on
fresh random data; and a Gemma 4 model's logits on the kernels vs on the composed ops.

Formats: every one `decode_rows._rows` reads (affine 4/8-bit, nvfp4 with a global scale,
mxfp4, dense). Activations float32 and float16 (the interpreter truncates bf16 casts).
Tolerances (derived): h' is `residual_norm`'s arithmetic (tests/test_triton_residual_norm.py's
bounds: fp32 1e-5 of the row's largest term, fp16 one ulp of it per rounding point, 3 points).
The GEMV differs from its twin only by fp32 summation order: K * eps32 * sum|w x| per output,
far below the output rounding, so y rounds to the twin's value or a neighbour: g within two
ulps of the activation dtype relative to |act(y)| * |up| plus that bound. The last residual
norm: `residual_norm`'s bounds on the rows of y, which are the twin's within one ulp.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from hybrid_configs import FAMILIES  # noqa: E402
from test_triton_fused import gen  # noqa: E402
from test_triton_moe_decode import stacked  # noqa: E402

import mlxr  # noqa: E402
from mlxr import ops  # noqa: E402
from mlxr.models import cpu_gemma4_decode  # noqa: E402
from mlxr.ops import reference as R  # noqa: E402
from mlxr.ops import tickets  # noqa: E402
from mlxr.ops.layer import residual_gemv as K  # noqa: E402
from mlxr.ops.moe import decode_experts as D  # noqa: E402

INTERPRETER_ONLY = True  # tests/conftest.py: the interpreter is on without a GPU

FORMATS = [("affine", 4, 64, False), ("affine", 8, 32, False), ("nvfp4", 4, 16, True),
           ("mxfp4", 4, 32, False), ("dense", 32, 0, False)]
DTYPES = (torch.float32, torch.float16)


def _linear(q: D.ExpertQuant, dtype: torch.dtype) -> tuple[SimpleNamespace, callable]:
    """A Linear-like object over expert 0 of q (what `linear_stack` reads: a QuantWeight's
    packed words, scales, biases, global scale; or a float weight) and its twin x -> y."""
    if q.mode == "dense":
        weight = q.w[0]
    else:
        weight = SimpleNamespace(
            packed=q.w[0], scales=q.scales[0], global_scale=(
                None if q.global_scale is None else q.global_scale[0]),
            biases=None if q.biases is None else q.biases[0],
            spec=SimpleNamespace(mode=q.mode, bits=q.bits, group_size=q.group))

    def twin(x: torch.Tensor) -> torch.Tensor:
        return D.expert_matmul_ref(x, torch.zeros(x.shape[0], dtype=torch.long), q, dtype)

    return SimpleNamespace(weight=weight, bias=None), twin


def _ulp(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 2**-10


def _within(out: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = (out.float() - ref.float()).abs()
    assert torch.isfinite(out.float()).all()
    assert (err <= tol).all(), f"max err {float(err.max()):.3g}, min tol {float(tol.min()):.3g}"


def _rowmax(*ts: torch.Tensor) -> torch.Tensor:
    return torch.stack([t.float().abs().amax(-1, keepdim=True) for t in ts]).amax(0)


def _gemv_bound(x: torch.Tensor, q: D.ExpertQuant) -> torch.Tensor:
    """K * eps32 * |x| @ |W|^T: the fp32 summation-order bound of each output."""
    w = D.expert_f32(q, torch.zeros(1, dtype=torch.long)).abs()
    return q.shape[2] * 2**-23 * (x.float().abs() @ w.t())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,act", [(1, "gelu_tanh"), (3, "silu")])
def test_residual_linear_act(fmt, dtype, m, act):
    e, n, layers = 192, 40, 3  # 40 rows: a partial row tile
    q = stacked(*fmt, 1, n, e, 5 + m)
    lin, twin = _linear(q, dtype)
    g = gen(("rla", fmt, str(dtype), m))
    h = (torch.randn(m, e, generator=g) * 2).to(dtype)
    a = (torch.randn(m, e, generator=g) * 0.3).to(dtype)
    w = (torch.rand(e, generator=g) + 0.5).to(dtype)
    up = torch.randn(m, layers, n, generator=g).to(dtype)[:, 1]  # a strided view, as ple[:, i]
    got_h, got_g = K.residual_linear_act(h, a, w, 1e-6, lin, up, act)
    ref_h, ref_g = R.residual_linear_act(h, a, w, 1e-6, twin, up, act)
    ulp = _ulp(dtype)
    dh = 3 * ulp * _rowmax(h, ref_h)
    _within(got_h, ref_h, dh)
    y = twin(ref_h)
    act_y = R.gated_act(y.float(), torch.ones_like(y, dtype=torch.float32), act).abs()
    # y's error: the summation order, and h''s error carried through |W| (act' <= 1.2)
    y_err = _gemv_bound(ref_h, q) + _gemv_bound(dh.expand_as(ref_h), q) / (e * 2**-23)
    tol = (2 * ulp * act_y + 1.2 * y_err) * up.float().abs() + 1e-6
    _within(got_g, ref_g, tol)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,scaled,nxt,chunk", [(1, True, True, 1024), (2, False, False, 1024),
                                                (4, True, False, 1024), (2, True, True, 64)])
def test_linear_residual_norm(monkeypatch, fmt, dtype, m, scaled, nxt, chunk):
    """chunk 64: the last program walks the 160-wide rows in three chunks."""
    from mlxr.ops.layer import residual_tail
    monkeypatch.setattr(residual_tail, "CHUNK", chunk)
    k, e = 64, 160  # 160 rows over several programs: the last ticket's program norms the row
    q = stacked(*fmt, 1, e, k, 9 + m)
    lin, twin = _linear(q, dtype)
    g = gen(("lrn", fmt, str(dtype), m, scaled, nxt))
    x = torch.randn(m, 2 * k, generator=g).to(dtype)[:, k:]  # strided rows
    h = (torch.randn(m, e, generator=g) * 4).to(dtype)
    w = (torch.rand(e, generator=g) + 0.5).to(dtype)
    s = (torch.rand(1, generator=g) + 0.5).to(dtype) if scaled else None
    w2 = torch.randn(e, generator=g).to(dtype) if nxt else None
    got_h, got_x = K.linear_residual_norm(x, lin, h, w, 1e-6, s, w2)
    ref_h, ref_x = R.linear_residual_norm(x, twin, h, w, 1e-6, s, w2)
    ulp = _ulp(dtype)
    y = R.rms_norm(twin(x), w, 1e-6)
    points = 5 if scaled else 4  # residual_norm's points and the GEMV's output rounding
    _within(got_h, ref_h, points * ulp * _rowmax(h, y, ref_h) * (float(s) if scaled else 1.0))
    assert (got_x is None) == (not nxt)
    if nxt:
        _within(got_x, ref_x, (points + 2) * ulp * _rowmax(ref_x) * 2 + 1e-6)
    assert int(tickets.counters(torch.device("cpu"), tickets.RESIDUAL).abs().sum()) == 0


def test_declines_what_it_cannot_take():
    """A Linear with a bias, prefill-sized rows, a shape mismatch: None (the ops compose)."""
    q = stacked("affine", 4, 64, False, 1, 32, 128, 1)
    lin, _ = _linear(q, torch.float32)
    h, a, w = torch.randn(2, 128), torch.randn(2, 128), torch.ones(128)
    assert K.residual_linear_act(h, a, w, 1e-6, lin, torch.randn(2, 32), "silu") is not None
    biased = SimpleNamespace(weight=lin.weight, bias=torch.zeros(32))
    assert K.residual_linear_act(h, a, w, 1e-6, biased, torch.randn(2, 32), "silu") is None
    assert K.residual_linear_act(h, a, w, 1e-6, lin, torch.randn(2, 16), "silu") is None
    big = K.MAX_ROWS + 1
    assert K.residual_linear_act(torch.randn(big, 128), torch.randn(big, 128), w, 1e-6, lin,
                                 torch.randn(big, 32), "silu") is None
    assert K.linear_residual_norm(torch.randn(2, 32), lin, h, w, 1e-6) is None  # K != 128


@pytest.fixture
def model(tmp_path_factory, make_checkpoint):
    """gemma4_text with per-layer inputs, 4-bit g32 (the branch's weights quantized)."""
    path = make_checkpoint.write_hybrid(FAMILIES["gemma4_text"],
                                        tmp_path_factory.mktemp("gemma4-ple"), (4, 32, "affine"))
    m = mlxr.load(path, device="cpu", dtype="float32")
    assert m.decoder.ple is not None
    return m


def test_gemma4_logits_on_the_kernels(model, monkeypatch):
    """The model's float32 logits over a 9-token prompt with the branch on the kernels (as on
    CUDA with the switch on) within 1e-4 of each position's range of the composed ops', the
    greedy tokens equal; every layer took both kernels."""
    monkeypatch.setattr(cpu_gemma4_decode, "plan", lambda dec, rows: None)  # the generic loop
    monkeypatch.setattr(K, "MAX_ROWS", 16)  # the 9 rows on the kernels (CUDA caps them at 4)
    ids = torch.tensor([random.Random(4).randrange(320) for _ in range(9)])
    ref = model.decoder.forward(ids, model.decoder.new_cache())
    calls = []

    def first(*a):
        calls.append("gate")
        return K.residual_linear_act(*a)

    def second(*a):
        calls.append("proj")
        return K.linear_residual_norm(*a)

    monkeypatch.setattr(ops, "residual_linear_act", first)
    monkeypatch.setattr(ops, "linear_residual_norm", second)
    got = model.decoder.forward(ids, model.decoder.new_cache())
    n = model.decoder.config.num_layers
    assert calls.count("gate") == calls.count("proj") == n
    span = (ref.amax(-1) - ref.amin(-1)).unsqueeze(-1)
    assert ((got - ref).abs() <= 1e-4 * span).all()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
