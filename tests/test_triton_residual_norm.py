"""The sandwich-normed residual kernel (mlxr.ops.layer.residual_norm) vs its plain-torch twin
(mlxr.ops.reference.residual_norm), CPU interpreter, fresh random data; and Gemma 4 on it.

Tolerances (derived):
* fp32: the same fp32 operations in another order (the sum of squares, rsqrt): a few ulps of
  the largest term of each row, 1e-5 * max|term| per output element (the terms of h' are h and
  the normed branch; x = rms_norm(h') inherits h''s error over rms(h') plus its own).
* bf16: every rounding point replayed with the interpreter's truncating cast must match
  exactly for >= 90% of the elements and within one bf16 ulp per rounding point elsewhere
  (`interp_exact`: dropping or adding a rounding point fails it); against the torch twin (round
  to nearest) each rounding point may differ by one ulp, 2^-7 of the row's largest value: 3
  points for h' (y, y * w, the add), 4 with the scalar, then 2 more for x.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_triton_fused import gen, interp_exact, trunc_bf16  # noqa: E402

from mlxr import ops  # noqa: E402
from mlxr.ops import reference as R  # noqa: E402
from mlxr.ops.layer import norm_rope_act  # noqa: E402
from mlxr.ops.layer import residual_norm as K  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


def _inputs(shape: tuple, dtype: torch.dtype, seed) -> tuple:
    g = gen(seed)
    e = shape[-1]
    h = (torch.randn(shape, generator=g) * 4).to(dtype)
    a = (torch.randn(shape, generator=g) * 0.3).to(dtype)
    w = (torch.rand(e, generator=g) + 0.5).to(dtype)
    w2 = torch.randn(e, generator=g).to(dtype)
    s = (torch.rand(1, generator=g) + 0.5).to(dtype)
    return h, a, w, s, w2


def _row_max(*ts: torch.Tensor) -> torch.Tensor:
    return torch.stack([t.float().abs().amax(-1, keepdim=True) for t in ts]).amax(0)


def _within(out: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    err = (out.float() - ref.float()).abs()
    assert torch.isfinite(out.float()).all()
    assert (err <= tol).all(), f"max err {float(err.max()):.3g}, tol {float(tol.min()):.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("nxt", [False, True])
@pytest.mark.parametrize("shape", [(5, 96), (1, 1536), (2, 3, 200)])
def test_matches_twin(dtype, scaled, nxt, shape):
    h, a, w, s, w2 = _inputs(shape, dtype, (str(dtype), scaled, nxt, shape))
    s, w2 = (s if scaled else None), (w2 if nxt else None)
    got_h, got_x = K.residual_norm(h, a, w, 1e-6, s, w2)
    ref_h, ref_x = R.residual_norm(h, a, w, 1e-6, s, w2)
    y = R.rms_norm(a, w, 1e-6)
    points = 4 if scaled else 3
    ulp = 1e-5 if dtype == torch.float32 else 2**-7
    _within(got_h, ref_h, (1 if dtype == torch.float32 else points) * ulp
            * _row_max(h, y, ref_h) * (float(s) if scaled else 1.0))
    assert (got_x is None) == (not nxt)
    if nxt:
        _within(got_x, ref_x, (2 if dtype == torch.float32 else points + 2) * ulp
                * _row_max(ref_x) + 1e-6)


@pytest.mark.parametrize("scaled", [False, True])
def test_bf16_rounding_points(scaled):
    h, a, w, s, w2 = _inputs((6, 256), torch.bfloat16, ("points", scaled))
    s = s if scaled else None
    got_h, got_x = K.residual_norm(h, a, w, 1e-6, s, w2)

    def norm(x32: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        unit = trunc_bf16(x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6))
        return trunc_bf16(unit * w.float())

    emu_h = trunc_bf16(h.float() + norm(a.float(), w))
    if scaled:
        emu_h = trunc_bf16(emu_h * s.float())
    interp_exact(got_h, emu_h)
    interp_exact(got_x, norm(emu_h, w2))


def test_empty_rows():
    h, a, w, s, w2 = _inputs((0, 64), torch.float32, "empty")
    got_h, got_x = K.residual_norm(h, a, w, 1e-6, s, w2)
    assert got_h.shape == got_x.shape == (0, 64)


def test_dispatch(monkeypatch):
    """ops.residual_norm takes the kernel where the dtypes agree, else the reference's ops with
    the norms on their own kernel (bf16 rows, a float32 weight: a promoted result, as torch)."""
    monkeypatch.setattr(ops, "_fast", lambda x: True)
    monkeypatch.setattr(ops, "_fused", norm_rope_act)
    calls = []
    monkeypatch.setattr(K, "residual_norm", lambda *a: calls.append(a) or R.residual_norm(*a))
    h, a, w, s, w2 = _inputs((3, 64), torch.bfloat16, "dispatch")
    ops.residual_norm(h, a, w, 1e-6, s, w2)
    assert len(calls) == 1
    w32 = w.float()
    got_h, got_x = ops.residual_norm(h, a, w32, 1e-6, s, w2)
    ref_h, ref_x = R.residual_norm(h, a, w32, 1e-6, s, w2)
    assert len(calls) == 1 and got_h.dtype == ref_h.dtype == torch.float32
    _within(got_h, ref_h, 2 * 2**-7 * _row_max(ref_h))


@pytest.fixture(scope="module")
def gemma4_models(tmp_path_factory, make_checkpoint):
    import mlxr
    from hybrid_configs import FAMILIES

    out = {}
    for fam in ("gemma4", "gemma4_moe"):
        path = make_checkpoint.write_hybrid(FAMILIES[fam], tmp_path_factory.mktemp(fam), None)
        out[fam] = mlxr.load(path, device="cpu", dtype="float32").decoder
    return out


@pytest.mark.parametrize("fam", ["gemma4", "gemma4_moe"])
def test_gemma4_prefill_on_the_kernels(gemma4_models, fam, monkeypatch):
    """A prompt through gemma4's layers with the small ops on their kernels, as on CUDA, equals
    the torch path within 1e-4 of each row's logit range (tests/decode_checks.py's bound for the
    same math in other summation orders); each layer's glue is three fused launches with the
    per-layer embeddings (attention, MLP, PLE branch), two without, each layer's input norm
    fused into the launch before it."""
    from mlxr.engine.kv_cache import new_cache

    dec = gemma4_models[fam]
    ids = torch.tensor([3, 17, 250, 9, 41, 41, 7, 300, 12, 5, 88, 64])  # past the window of 8
    with torch.inference_mode():
        want = dec.forward(ids, new_cache(dec, 32))
    monkeypatch.setattr(ops, "_fast", lambda x: True)
    monkeypatch.setattr(ops, "_fused", norm_rope_act)
    # the PLE branch composed (its residual norms counted here; its own two kernels,
    # on by default for short inputs, are tests/test_triton_residual_gemv.py's)
    monkeypatch.setenv("MLXR_GEMMA4_PLE_FUSED", "0")
    fused, norms = [], []
    real_fused, real_norm = K.residual_norm, norm_rope_act.rms_norm
    monkeypatch.setattr(K, "residual_norm", lambda *a: fused.append(a) or real_fused(*a))
    monkeypatch.setattr(norm_rope_act, "rms_norm", lambda *a: norms.append(a) or real_norm(*a))
    with torch.inference_mode():
        got = dec.forward(ids, new_cache(dec, 32))
    rng = (want.amax(-1) - want.amin(-1))[:, None]
    assert ((got - want).abs() <= 1e-4 * rng).all(), float(((got - want).abs() / rng).max())
    n, ple = dec.config.num_layers, dec.ple is not None
    moe = sum(ly.moe is not None for ly in dec.layers)
    assert len(fused) == (3 if ple else 2) * n + moe
    own_kv = sum(ly.kv is not None for ly in dec.layers)
    # the first input norm, q / k / v norms, the PLE projection's norm, the final norm, and
    # the experts' router / input / output norms
    assert len(norms) == 1 + n + 2 * own_kv + ple + 1 + 3 * moe
