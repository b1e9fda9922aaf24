"""Gemma 4's lean CPU decode step (`cpu_gemma4_decode`) against the generic loop
(MLXR_CPU_DECODE=0): logits and K/V equal bit for bit (bf16 and float32, single sequences and
the engine's decode batches), and the lean loop, its C norms and GeGLU are in fact taken."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mlxr
from mlxr.models import cpu_gemma4_decode
from mlxr.ops.cpu import fused, native
from decode_checks import counted

FAMILIES = ["gemma4_text", "gemma4"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """family -> its tiny 4-bit g64 checkpoint, made by mlx-lm once per module."""
    hyb = pytest.importorskip("mlx_ref_hybrid")
    paths: dict = {}

    def get(family: str):
        if family not in paths:
            out = tmp_path_factory.mktemp(family)
            paths[family] = hyb.make_model(out, family, dict(bits=4, group_size=64))
        return paths[family]

    return get


def _decode(dec, prompt: list[int], steps: int, lean: bool, monkeypatch):
    monkeypatch.setenv("MLXR_CPU_DECODE", "1" if lean else "0")
    cache = dec.new_cache(64)
    rows = []
    with torch.inference_mode():
        logits = dec.forward(torch.tensor(prompt), cache, last_only=True)
        for _ in range(steps):
            logits = dec.forward(logits.argmax(-1).reshape(1), cache, last_only=True)
            rows.append(logits)
    return torch.cat(rows), [*cache.k, *cache.v]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_lean_decode_equals_generic(built, family, dtype, monkeypatch):
    """Twelve greedy steps after a 20-token prompt (past the sliding window of 8; a prefill of
    more rows than `MAX_ROWS`: the generic loop's): logits and the caches equal bit for bit;
    the lean loop ran every step, and in bf16 (extension built) its C norms and GeGLU did."""
    dec = mlxr.load(built(family), device="cpu", dtype=dtype).decoder
    prompt = [(7 * i + 3) % 300 for i in range(20)]
    want, want_k = _decode(dec, prompt, 12, False, monkeypatch)
    monkeypatch.setenv("MLXR_CPU_DECODE", "1")
    cpu_gemma4_decode.plan(dec, 1)  # built (and its checks run) before counting
    lean = counted(monkeypatch, cpu_gemma4_decode, "layers")
    gelu = counted(monkeypatch, fused, "act_mul")
    got, got_k = _decode(dec, prompt, 12, True, monkeypatch)
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(got_k, want_k, strict=True) if a is not None)
    assert len(lean) == 12
    if dtype == "bfloat16" and native.available() and fused.lanes():
        assert dec._cpu_gemma4_plan.fused and dec._cpu_gemma4_plan.act is not None
        assert len(gelu) == 12 * len(dec.layers)


@pytest.mark.parametrize("family", FAMILIES)
def test_lean_batched_decode_equals_generic(built, family, monkeypatch):
    """The engine's decode batch (`forward_batch`, three sequences of different lengths, bf16):
    logits and caches equal the generic loop's bit for bit."""
    dec = mlxr.load(built(family), device="cpu", dtype="bfloat16").decoder
    prompts = [[(5 * i + j) % 300 for i in range(n)] for j, n in ((1, 9), (2, 4), (3, 13))]
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
        out[lean] = torch.cat(rows), [t for c in caches for t in (*c.k, *c.v) if t is not None]
    assert torch.equal(out[True][0], out[False][0])
    assert all(torch.equal(a, b) for a, b in zip(out[True][1], out[False][1], strict=True))


@pytest.mark.parametrize("family", FAMILIES)
def test_attend_kernel_within_bf16_tolerance(built, family, monkeypatch):
    """`MLXR_CPU_ATTEND=1` (off by default): the compiled attention ran in every layer of every
    step, and the logits of the same six fed tokens stay within 2% of their range of the
    generic loop's (another float32 summation order, bf16 roundings after it)."""
    if not native.available():
        pytest.skip("the C extension is not built")
    dec = mlxr.load(built(family), device="cpu", dtype="bfloat16").decoder
    prompt = [(7 * i + 3) % 300 for i in range(20)]
    fed = [5, 77, 130, 9, 250, 41]
    monkeypatch.setenv("MLXR_CPU_DECODE", "0")
    want = _fed(dec, prompt, fed)
    monkeypatch.setenv("MLXR_CPU_DECODE", "1")
    monkeypatch.setenv("MLXR_CPU_ATTEND", "1")
    calls = counted(monkeypatch, native, "attend")
    got = _fed(dec, prompt, fed)
    assert len(calls) == len(fed) * len(dec.layers)
    span = float(want.max() - want.min())
    assert float((got - want).abs().max()) <= 0.02 * span


def _fed(dec, prompt: list[int], fed: list[int]) -> torch.Tensor:
    """The logits of each fed token after the prompt, [len(fed), V]."""
    cache = dec.new_cache(64)
    with torch.inference_mode():
        dec.forward(torch.tensor(prompt), cache, last_only=True)
        return torch.cat([dec.forward(torch.tensor([t]), cache, last_only=True) for t in fed])


def test_vector_gelu_tanh_table_matches_torch():
    """The gelu_tanh table (torch's vector-loop values): act_mul over fresh random rows of a
    `VECTOR_ROW`-multiple width equals torch's gelu(gate) * up bit for bit."""
    if not native.available():
        pytest.skip("the C extension is not built")
    tab = fused.vector_act_table("gelu_tanh")
    assert tab is not None
    g = torch.Generator().manual_seed(5)
    w = 3 * fused.VECTOR_ROW
    gu = (torch.randn(4, 2 * w, generator=g) * 4).to(torch.bfloat16)
    gate, up = gu.chunk(2, dim=-1)
    assert torch.equal(fused.act_mul(gu, tab), F.gelu(gate, approximate="tanh") * up)
