"""The gated DeltaNet decode step in one launch (mlxr.ops.recurrent.gated_delta_decode) vs its
torch twin (reference.gated_delta_decode: the reference ops composed), CPU interpreter, fresh
random data; then a tiny qwen3_5 with every op forced onto the kernels vs the reference path.

Cases: value heads sharing key heads (GQA ratio 2) or not, a value dim that is not a power of
two (masked tiles), B = 1 and 3, bf16 and float32, five steps in a row so that the conv state
rolls past its whole width and the recurrent state carries.

Tolerances (derived):
* float32: both sides compute the same float32 steps; they differ in the order of the Dk / Dv
  sums (conv taps: the same order, FMA contraction may change the last bit) and in the last
  ulps of rsqrt / exp / sigmoid. As in test_triton_recurrent, a sum of n terms is off by
  <= n * 2^-24 of the sum of |terms|, carried (not amplified: |k| = 1, g and beta in (0, 1))
  over the steps: with Dk, Dv <= 48 and 5 steps, <= 5 * 48 * 2^-24 ~ 1.4e-5 of the scale;
  checked at 2e-5 * max|ref| + 1e-6, state and output alike. The conv state is a copy: equal.
* bf16: the kernel rounds to bf16 where the twin does, to nearest even (by hand: the
  interpreter's own cast truncates). A rounded value can then differ only where the float32
  values, off by the bound above, straddle a rounding midpoint: 1 ulp there (<= 2^-7 of the
  value). On the output's path 4 roundings follow each other (y, its norm, times the weight,
  times SiLU(z)): elementwise <= 4 ulps (4 * 2^-7 |ref|) plus the float32 bound. Such
  straddles are rare (a float32 bound of ~2^-19 against a bf16 ulp of 2^-8 relative: about 1
  value in 2^11), so at most 2% of the outputs may differ at all: a mutated rounding point
  (a rounding left out or added) moves about half of them.
* The model check (float32): logits within 1e-4 of each position's range, test_triton_layer's
  bound for the fused dispatch (the same math summed in other orders), greedy tokens equal.
"""

from __future__ import annotations

import copy
import zlib

import pytest
import torch

pytest.importorskip("triton")

from mlxr import ops  # noqa: E402
from mlxr.ops.recurrent import gated_delta_decode as K  # noqa: E402
from mlxr.ops.recurrent import reference as R  # noqa: E402

INTERPRETER_ONLY = True

ULP = 2.0**-7
STEPS = 5


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _layer(hk, hv, dk, dv, dtype, g, width=4):
    """One layer's weights: conv [C, W], a_log [Hv] float32, dt_bias [Hv], norm [Dv]."""
    c = 2 * hk * dk + hv * dv
    return ((torch.randn(c, width, generator=g) * 0.5).to(dtype),
            torch.randn(hv, generator=g) * 0.5,
            torch.randn(hv, generator=g).to(dtype),
            (1 + 0.1 * torch.randn(dv, generator=g)).to(dtype))


def _run(fn, heads, dtype, bsz, g, steps=STEPS):
    """`steps` decode steps of fn from random states; returns (outs, conv state, state, the
    conv state before)."""
    hk, hv, dk, dv = heads
    conv, a_log, dt_bias, norm = _layer(hk, hv, dk, dv, dtype, g)
    c, width = conv.shape
    conv_state = torch.randn(bsz, width - 1, c, generator=g).to(dtype)
    state = torch.randn(bsz, hv, dv, dk, generator=g) * 0.3
    projs = [torch.randn(bsz, c + hv * dv + 2 * hv, generator=g).to(dtype)
             for _ in range(steps)]
    before = conv_state.clone()
    outs = [fn(p, conv_state, state, conv, a_log, dt_bias, norm, heads, 1e-6) for p in projs]
    return torch.stack(outs), conv_state, state, before


def _check(got, want, dtype):
    (y, cs, s, _), (y_ref, cs_ref, s_ref, _) = got, want
    assert y.dtype == dtype and y.shape == y_ref.shape
    assert torch.equal(cs, cs_ref)
    assert (s - s_ref).abs().max() <= 2e-5 * s_ref.abs().max() + 1e-6
    tol = 2e-5 * y_ref.float().abs().max() + 1e-6
    if dtype == torch.bfloat16:
        tol = tol + 4 * ULP * y_ref.float().abs()
        assert (y != y_ref).float().mean() <= 0.02
    assert ((y.float() - y_ref.float()).abs() <= tol).all()


HEADS = [(2, 4, 32, 48), (2, 2, 32, 32)]  # GQA ratio 2 with Dv not a power of two; ratio 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bsz", [1, 3])
@pytest.mark.parametrize("heads", HEADS)
def test_fused_decode_matches_twin(dtype, bsz, heads):
    key = (dtype, bsz, heads)
    got = _run(K.gated_delta_decode, heads, dtype, bsz, _gen(*key))
    want = _run(R.gated_delta_decode, heads, dtype, bsz, _gen(*key))
    assert not torch.equal(got[1], got[3])  # the conv state rolled
    _check(got, want, dtype)


@pytest.mark.parametrize("mutation", ["q_scale", "rounding"])
def test_a_mutated_kernel_fails_the_check(mutation, monkeypatch):
    """The checks above see a wrong constant (q's scale Dk^-1 swapped for k's Dk^-0.5) and
    the rounding points left out (the kernel run in float32, its bf16 output rounded once at
    the end)."""
    if mutation == "q_scale":
        consts = K.qk_norm_constants
        monkeypatch.setattr(K, "qk_norm_constants",
                            lambda dk: (consts(dk)[0], consts(dk)[2], consts(dk)[2]))
        dtype = torch.float32
    else:
        dtype = torch.bfloat16
        orig = K._gdn_decode_kernel

        class NoRound:  # the kernel with its output dtype set to float32 (no bf16 roundings)
            def __getitem__(self, grid):
                def launch(*args, **kw):
                    out = args[10]
                    f32 = torch.empty(out.shape, dtype=torch.float32)
                    args = args[:10] + (f32,) + args[11:]
                    orig[grid](*args, **dict(kw, OUT=0))
                    out.copy_(f32)
                return launch

        monkeypatch.setattr(K, "_gdn_decode_kernel", NoRound())
    heads = HEADS[0]
    got = _run(K.gated_delta_decode, heads, dtype, 1, _gen("mut", dtype))
    want = _run(R.gated_delta_decode, heads, dtype, 1, _gen("mut", dtype))
    with pytest.raises(AssertionError):
        _check(got, want, dtype)


def test_unsupported_operands_take_the_twin(monkeypatch):
    """A state tile beyond MAX_TILE or a state not float32 contiguous: the dispatch composes
    the reference ops (no kernel launch)."""
    monkeypatch.setattr(ops, "_fast", lambda x: True)
    monkeypatch.setattr(K, "gated_delta_decode", lambda *a: pytest.fail("kernel launched"))
    heads = (1, 1, 256, 128)
    hk, hv, dk, dv = heads
    got = _run(ops.gated_delta_decode, heads, torch.float32, 1, _gen("big"), steps=2)
    want = _run(R.gated_delta_decode, heads, torch.float32, 1, _gen("big"), steps=2)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.fixture(scope="module")
def tiny_qwen35(tmp_path_factory, make_checkpoint):
    from hybrid_configs import FAMILIES

    import mlxr

    path = tmp_path_factory.mktemp("qwen3_5-q4")
    make_checkpoint.write_hybrid(copy.deepcopy(FAMILIES["qwen3_5"]), path, (4, 64, "affine"))
    return mlxr.load(path, device="cpu", dtype="float32")


def test_model_decode_on_kernels_matches_reference_path(tiny_qwen35, monkeypatch):
    """A tiny qwen3_5 (2 gated DeltaNet layers, GQA ratio 2): prefill, then decode steps
    through `forward_static` (the graph's step) with every op forced onto the Triton kernels
    and the fused mixer step, vs the reference path's whole forward; then greedy decoding on
    the kernels vs the reference path."""
    from mlxr.engine.kv_cache import new_cache
    from mlxr.ops.layer import norm_rope_act

    model, dec = tiny_qwen35, tiny_qwen35.decoder
    seq = [int(x) for x in torch.randint(0, 320, (14,), generator=_gen("seq"))]
    p0 = 8
    with torch.inference_mode():
        want = dec.forward(torch.tensor(seq), new_cache(dec, 16))
        ref_tokens = list(model.generate(seq[:p0], max_tokens=4, ignore_eos=True))
        monkeypatch.setattr(ops, "_fast", lambda x: True)
        monkeypatch.setattr(ops, "_fused", norm_rope_act)
        calls = []
        kernel = K.gated_delta_decode
        monkeypatch.setattr(K, "gated_delta_decode", lambda *a: calls.append(1) or kernel(*a))
        cache = new_cache(dec, 16)
        rope = dec.ropes[0]
        tables = {id(rope.spec): rope.cos_sin(0, 16)}
        got = [dec.forward(torch.tensor(seq[:p0]), cache)]
        for p in range(p0, len(seq)):
            got.append(dec.forward_static(torch.tensor(seq[p:p + 1]), torch.tensor([p]),
                                          cache.pool, tables))
        got = torch.cat(got)
        tokens = list(model.generate(seq[:p0], max_tokens=4, ignore_eos=True))
    n_gdn = sum(t == "linear_attention" for t in dec.spec.layer_types)
    assert len(calls) == n_gdn * (len(seq) - p0 + 3)  # the fused step ran at every decode
    tol = 1e-4 * (want.amax(-1) - want.amin(-1))[:, None]
    assert ((got - want).abs() <= tol).all(), float((got - want).abs().max())
    assert tokens == ref_tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_decode_on_pool_rows_matches_twin(dtype):
    """With `rows`, row b's states are rows[b] of state pools, read and written in place
    (the serving engine's slot pool): the same as the twin on the gathered states, and the
    pool's other rows untouched."""
    heads, g = HEADS[0], _gen("rows", dtype)
    hk, hv, dk, dv = heads
    conv, a_log, dt_bias, norm = _layer(hk, hv, dk, dv, dtype, g)
    c, width = conv.shape
    conv_pool = torch.randn(5, width - 1, c, generator=g).to(dtype)
    ssm_pool = torch.randn(5, hv, dv, dk, generator=g) * 0.3
    rows = torch.tensor([3, 0, 4])
    conv_want, ssm_want = conv_pool[rows].clone(), ssm_pool[rows].clone()
    for _ in range(2):
        proj = torch.randn(3, c + hv * dv + 2 * hv, generator=g).to(dtype)
        want = R.gated_delta_decode(proj, conv_want, ssm_want, conv, a_log, dt_bias, norm,
                                    heads, 1e-6)
        before = (conv_pool.clone(), ssm_pool.clone())
        got = K.gated_delta_decode(proj, conv_pool, ssm_pool, conv, a_log, dt_bias, norm,
                                   heads, 1e-6, rows)
        _check((got, conv_pool[rows], ssm_pool[rows], None),
               (want, conv_want, ssm_want, None), dtype)
        for r in (1, 2):
            assert torch.equal(conv_pool[r], before[0][r])
            assert torch.equal(ssm_pool[r], before[1][r])
