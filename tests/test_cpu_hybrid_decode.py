"""The lean CPU decode steps of the hybrid and MoE families against the generic paths: the gated
DeltaNet step (`cpu_hybrid_decode.delta_step`) and the one-token MoE expert loop
(`cpu_moe_decode`) keep every rounding of the generic code, so logits, K/V and recurrent states
are equal bit for bit (float32 and bf16, several decode steps, single sequences and the
engine's decode batches), and the lean paths are in fact taken."""

from __future__ import annotations

import pytest
import torch

import mlxr
from mlxr.config.hybrid import GatedDeltaSpec
from mlxr.engine.kv_cache import new_cache
from mlxr.layers import Linear
from mlxr.models import cpu_hybrid_decode, cpu_moe_decode
from mlxr.models.gated_delta import GatedDeltaMixer
from mlxr.ops.cpu import fused
from mlxr.ops.recurrent import reference as recurrent
from decode_checks import counted


def _mixer(hk: int, hv: int, dtype: torch.dtype, seed: int) -> GatedDeltaMixer:
    g = torch.Generator().manual_seed(seed)
    d, e, w = 32, 48, 4  # Dk * Dv >= 400: torch's BLAS bmm, not its small-size loop
    spec = GatedDeltaSpec(("linear_attention",), hk, hv, d, d, w)
    out_in = spec.conv_dim + spec.value_dim + 2 * hv

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(dtype)

    return GatedDeltaMixer(spec, Linear(rnd(out_in, e, s=e**-0.5)), rnd(spec.conv_dim, w, s=0.5),
                           torch.randn(hv, generator=g) * 0.5, rnd(hv), rnd(d, s=0.2) + 1,
                           Linear(rnd(e, spec.value_dim, s=spec.value_dim**-0.5)), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hk,hv,batch", [(2, 2, 1), (2, 4, 1), (2, 4, 3)])
def test_delta_step_equals_mixer(hk, hv, batch, dtype):
    """Five tokens through the lean step and through `GatedDeltaMixer.__call__` from the same
    random states: outputs, conv states and float32 recurrent states equal bit for bit (Hv = Hk
    and Hv = 2 Hk, one and three sequences)."""
    m = _mixer(hk, hv, dtype, seed=hk + hv + batch)
    s = m.spec
    g = torch.Generator().manual_seed(1)
    conv = torch.randn(batch, s.conv_kernel - 1, s.conv_dim, generator=g).to(dtype)
    ssm = torch.randn(batch, hv, s.v_head_dim, s.k_head_dim, generator=g) * 0.3
    conv2, ssm2 = conv.clone(), ssm.clone()
    for _ in range(5):
        x = torch.randn(batch, 48, generator=g).to(dtype)
        want = m(x[:, None], conv, ssm)[:, 0]
        got = cpu_hybrid_decode.delta_step(m, x, conv2, ssm2)
        assert torch.equal(got, want)
        assert torch.equal(conv2, conv) and torch.equal(ssm2, ssm)


def test_readout_layout_keeps_the_products():
    """The reference's readout (q as a transposed row) against a float64 S q: within the
    float32 summation bound 2 (Dk - 1) u sum |S q| (u = 2^-24), so the layout changes only the
    order of the Dk sums."""
    g = torch.Generator().manual_seed(3)
    hv, d = 4, 128
    state = torch.randn(1, hv, d, d, generator=g)
    q = torch.randn(1, 1, hv, d, generator=g)
    k = torch.zeros(1, 1, hv, d)  # no update: y = S q of the initial state
    ones = torch.ones(1, 1, hv)
    y = recurrent.gated_delta(q, k, torch.zeros(1, 1, hv, d), ones, ones, state.clone())
    s64, q64 = state[0].double(), q[0, 0].double()
    exact = torch.einsum("hij,hj->hi", s64, q64)
    bound = 2 * (d - 1) * 2.0**-24 * torch.einsum("hij,hj->hi", s64.abs(), q64.abs())
    assert ((y[0, 0].double() - exact).abs() <= bound).all()


def test_delta_step_rejects_a_strided_state():
    m = _mixer(2, 2, torch.float32, seed=0)
    s = m.spec
    ssm = torch.zeros(1, 2, s.k_head_dim, s.v_head_dim).transpose(2, 3)
    with pytest.raises(ValueError, match="contiguous float32"):
        cpu_hybrid_decode.delta_step(m, torch.zeros(1, 48), torch.zeros(1, 3, s.conv_dim), ssm)


HYBRID = ["qwen3_5", "qwen3_next", "qwen3_5_moe", "gemma4_moe"]  # built by mlx_ref_hybrid
MOE = ["qwen3_moe", "gpt_oss", "laguna"]  # built by mlx_ref


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """family -> its tiny 4-bit g64 checkpoint, made by mlx-lm once per module."""
    paths: dict = {}

    def get(family: str):
        if family not in paths:
            out = tmp_path_factory.mktemp(family)
            if family in HYBRID:
                hyb = pytest.importorskip("mlx_ref_hybrid")
                paths[family] = hyb.make_model(out, family, dict(bits=4, group_size=64))
            else:
                paths[family] = pytest.importorskip("mlx_ref").make_model(out, family, "q4g64")
        return paths[family]

    return get


def _decode(model, prompt: list[int], steps: int, lean: bool, monkeypatch):
    """Prefill `prompt`, then `steps` greedy one-token forwards: each step's logits and the
    final cache. The DeltaNet step between the projections on torch (`MLXR_CPU_GDN=0`: the
    compiled step sums in another order, tests/test_cpu_gdn.py)."""
    monkeypatch.setenv("MLXR_CPU_DECODE", "1" if lean else "0")
    monkeypatch.setenv("MLXR_CPU_GDN", "0")
    dec = model.decoder
    cache = dec.new_cache(64) if hasattr(dec, "new_cache") else new_cache(dec, 64)
    rows = []
    with torch.inference_mode():
        logits = dec.forward(torch.tensor(prompt), cache, last_only=True)
        for _ in range(steps):
            logits = dec.forward(logits.argmax(-1).reshape(1), cache, last_only=True)
            rows.append(logits)
    return torch.cat(rows), cache


def _tensors(cache) -> list:
    if hasattr(cache, "ssm"):
        return [t for t in (*cache.k, *cache.v, *cache.conv, *cache.ssm) if t is not None]
    return [*cache.pool.k, *cache.pool.v]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", HYBRID + MOE)
def test_lean_decode_equals_generic(built, family, dtype, monkeypatch):
    """Six greedy decode steps after a 13-token prompt on the lean paths and on the generic
    ones (MLXR_CPU_DECODE=0): logits, K/V and recurrent states equal bit for bit, and the
    lean DeltaNet step / MoE loop ran at every step of every such layer (its torch step:
    `_decode`)."""
    model = mlxr.load(built(family), device="cpu", dtype=dtype)
    prompt = [(7 * i + 3) % 300 for i in range(13)]
    want, want_cache = _decode(model, prompt, 6, False, monkeypatch)
    delta = counted(monkeypatch, cpu_hybrid_decode, "delta_step")
    moe = counted(monkeypatch, cpu_moe_decode, "experts")
    got, got_cache = _decode(model, prompt, 6, True, monkeypatch)
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(_tensors(got_cache), _tensors(want_cache)))
    dec = model.decoder
    layers = dec.layers
    n_delta = sum(type(getattr(la, "mixer", None)).__name__ == "GatedDeltaMixer"
                  for la in layers)
    n_moe = sum(getattr(la, "moe", None) is not None for la in layers)
    assert len(delta) == 6 * n_delta
    assert len(moe) >= 6 * n_moe > 0 or (n_moe == 0 and not moe)
    if n_delta and dtype == "bfloat16" and fused.ready(8, 1, 1, 64, 64, False, False, "silu"):
        assert dec._cpu_mlp_plan is not None  # the fused residual / norm / MLP loop ran


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "qwen3_5_moe"])
def test_lean_batched_decode_equals_generic(built, family, monkeypatch):
    """The engine's decode batch (`forward_batch`, three sequences of different lengths, bf16):
    the lean step's logits and states equal the generic ones bit for bit (the fused residual
    / norm / MLP loop included where the extension is built)."""
    model = mlxr.load(built(family), device="cpu", dtype="bfloat16")
    dec = model.decoder
    prompts = [[(5 * i + j) % 300 for i in range(n)] for j, n in ((1, 9), (2, 4), (3, 13))]
    monkeypatch.setenv("MLXR_CPU_GDN", "0")
    out = {}
    for lean in (False, True):
        monkeypatch.setenv("MLXR_CPU_DECODE", "1" if lean else "0")
        caches = [dec.new_cache(32) for _ in prompts]
        rows = []
        with torch.inference_mode():
            for c, p in zip(caches, prompts):
                dec.forward(torch.tensor(p), c, last_only=True)
            ids = torch.tensor([11, 22, 33])
            for _ in range(4):
                logits = dec.forward_batch(ids, caches)
                rows.append(logits)
                ids = logits.argmax(-1)
        out[lean] = torch.cat(rows), [t for c in caches for t in _tensors(c)]
    assert torch.equal(out[True][0], out[False][0])
    assert all(torch.equal(a, b) for a, b in zip(out[True][1], out[False][1]))


@pytest.mark.parametrize("family", MOE)
def test_lean_moe_rows_equal_generic(built, family, monkeypatch):
    """A MoE block over five rows (the engine's decode batch; experts shared between rows):
    the host-grouped loop's outputs equal the generic loop's bit for bit."""
    model = mlxr.load(built(family), device="cpu", dtype="bfloat16")
    blocks = [la.moe for la in model.decoder.layers if la.moe is not None]
    x = torch.randn(5, model.decoder.config.hidden_size,
                    generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    for blk in blocks:
        ids = blk.route(x)[0]
        assert len(set(ids.reshape(-1).tolist())) < ids.numel()  # some expert has 2+ rows
        monkeypatch.setenv("MLXR_CPU_DECODE", "0")
        want = blk.experts(x, ids)
        monkeypatch.setenv("MLXR_CPU_DECODE", "1")
        assert torch.equal(blk.experts(x, ids), want)
