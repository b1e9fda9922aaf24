"""The lean CPU decode step (`mlxr.models.cpu_decode`) against the generic layer loop: the same
logits and K/V bit for bit (it keeps every rounding), single and batched, and the cases it
declines."""

from __future__ import annotations

import pytest
import torch

from mlxr.config import ModelConfig, QuantSpec, RopeSpec
from mlxr.engine.kv_cache import new_cache
from mlxr.layers import Embedding, Linear, Rope
from mlxr.models import cpu_decode
from mlxr.models.decoder import Decoder, Layer, SeqSpan, Step
from mlxr.ops import reference
from mlxr.ops.cpu import twins
from mlxr.quant import QuantWeight


def tiny_decoder(kind: str, bits: int = 4, dtype=torch.bfloat16, traditional: bool = False,
                 rotary: int = 32, norm_offset: float = 0.0, window: int | None = None,
                 seed: int = 0) -> Decoder:
    """Random affine `bits`-bit weights (torch's int4 copy on the CPU in bf16: 4-bit one
    nibble plane, 8-bit two). qwen3: q/k norms and a tied head; llama: neither."""
    g = torch.Generator().manual_seed(seed)
    e, h, kh, d, f, v, n_layers, group = 128, 4, 2, 32, 192, 80, 2, 32
    spec = RopeSpec(rotary, 10000.0, traditional=traditional, scaling=None,
                    max_position_embeddings=256)
    qwen = kind == "qwen3"
    c = ModelConfig(
        model_type=kind, vocab_size=v, hidden_size=e, num_layers=n_layers, num_heads=h,
        num_kv_heads=kh, head_dim=d, intermediate_size=f, rms_norm_eps=1e-6,
        max_position_embeddings=256, tie_word_embeddings=qwen, qk_norm=qwen,
        norm_offset=norm_offset, embed_scale=None, hidden_act="silu", sandwich_norm=False,
        attn_scale=d ** -0.5, attn_logit_softcap=None, final_logit_softcap=None,
        clip_residual_fp16=False, layer_rope=(spec,) * n_layers,
        layer_window=(window,) * n_layers)

    def quant(n, k):
        words = torch.randint(-2**31, 2**31 - 1, (n, k * bits // 32), dtype=torch.int32,
                              generator=g)
        top = 2 ** bits - 1
        s = (torch.rand(n, k // group, generator=g) * 0.3 / top).to(dtype)
        b = (-top / 2 * s.float() + torch.randn(n, k // group, generator=g) * 0.01).to(dtype)
        return QuantWeight.from_tensors(words, s, b, QuantSpec("affine", bits, group),
                                        compute_dtype=dtype, device="cpu")

    def norm(size):
        return (torch.randn(size, generator=g) * 0.2 + 1.0 - norm_offset).to(dtype)

    layers = [Layer(norm(e), Linear(quant((h + 2 * kh) * d, e)), Linear(quant(e, h * d)),
                    norm(e), Linear(quant(2 * f, e)), Linear(quant(e, f)),
                    norm(d) if qwen else None, norm(d) if qwen else None)
              for _ in range(n_layers)]
    head = None if qwen else Linear(quant(v, e))
    return Decoder(c, Embedding(quant(v, e)), layers, norm(e), head, dtype, torch.device("cpu"))


def _decode(dec, ids, prompt_len, lean: bool, monkeypatch):
    """Prefill ids[:prompt_len], then decode the rest one token at a time on one path: the
    logits of each decode step and the final caches."""
    monkeypatch.setenv("MLXR_CPU_DECODE", "1" if lean else "0")
    cache = new_cache(dec, 32)
    rows = []
    with torch.inference_mode():
        dec.forward(ids[:prompt_len], cache)
        for p in range(prompt_len, len(ids)):
            rows.append(dec.forward(ids[p:p + 1], cache, last_only=True))
    return torch.cat(rows), cache


CASES = [("qwen3", 4, False, 32, 0.0), ("qwen3", 8, True, 32, 1.0), ("llama", 4, False, 16, 0.0),
         ("llama", 3, True, 32, 0.0)]


@pytest.mark.parametrize("kind,bits,traditional,rotary,offset", CASES)
def test_lean_step_equals_generic(kind, bits, traditional, rotary, offset, monkeypatch):
    """Decode steps through cpu_decode.run give the generic loop's logits and K/V bit for bit
    (q/k norms with and without the gemma offset, traditional and half RoPE, partial rotary,
    one and two nibble planes); the step is in fact taken."""
    monkeypatch.setenv("MLXR_CPU_KERNELS", "0")  # the torch paths: bit for bit (the kernels'
    # attention sums in another order: tests/test_cpu_kernels.py)
    dec = tiny_decoder(kind, bits, traditional=traditional, rotary=rotary, norm_offset=offset)
    ids = torch.tensor([3, 17, 42, 5, 9, 61, 2, 77])
    want, cache_want = _decode(dec, ids, 3, False, monkeypatch)
    calls = []
    real = cpu_decode.run
    monkeypatch.setattr(cpu_decode, "run", lambda *a: calls.append(1) or real(*a))
    got, cache_got = _decode(dec, ids, 3, True, monkeypatch)
    assert len(calls) == len(ids) - 3
    assert torch.equal(got, want)
    for i in range(len(dec.layers)):
        assert torch.equal(cache_got.pool.k[i], cache_want.pool.k[i])
        assert torch.equal(cache_got.pool.v[i], cache_want.pool.v[i])
    # the logits tell tokens apart: another token's are not within a hair of these
    other, _ = _decode(dec, torch.tensor([3, 17, 42, 6, 9, 61, 2, 77]), 3, True, monkeypatch)
    assert not torch.allclose(other[0], want[0], atol=1e-2)


@pytest.mark.parametrize("traditional,rotary", [(False, 32), (True, 32), (False, 16),
                                                (True, 8)])
def test_norm_rope_equals_reference(traditional, rotary):
    """twins.norm_rope, the lean step's torch path (stacked q/k norm weights, x * C + swap(x)
    * S) vs reference.rms_norm and reference.rope on fresh random heads and positions: bit for
    bit."""
    g = torch.Generator().manual_seed(rotary + traditional)
    n, h, kh, d = 3, 4, 2, 32
    spec = RopeSpec(rotary, 10000.0, traditional=traditional, scaling=None,
                    max_position_embeddings=4096)
    rope = Rope(spec, torch.device("cpu"))
    qk = (torch.randn(n, h + kh, d, generator=g) * 3).bfloat16()
    qn, kn = (torch.randn(d, generator=g) + 1).bfloat16(), (torch.randn(d, generator=g)).bfloat16()
    pos = torch.tensor([0, 517, 3001])
    cos, sin = rope.cos_sin(0, 4096)
    cos, sin = cos[pos], sin[pos]
    want = torch.cat([reference.rope(reference.rms_norm(qk[:, :h], qn, 1e-6), cos, sin,
                                     traditional),
                      reference.rope(reference.rms_norm(qk[:, h:], kn, 1e-6), cos, sin,
                                     traditional)], dim=1)
    rt = cpu_decode._rope_tables(rope, 4096)
    w = torch.cat([qn.expand(h, -1), kn.expand(kh, -1)])
    got = twins.norm_rope(qk, w, 1e-6, traditional, rt.c[pos].unsqueeze(1),
                          rt.s[pos].unsqueeze(1))
    assert torch.equal(got, want)


def _step(spans_at: list[tuple[int, int, int]], cap: int, gather: set[int] = frozenset()):
    """A decode Step of sequences (slot base a, position p, token row): one token each at
    position p, its context in slots [a, a + p]; sequences in `gather` give it as slots."""
    spans, slots = [], []
    for b, (a, p) in enumerate(spans_at):
        if b in gather:
            spans.append(SeqSpan(p, 1, slots=torch.arange(a, a + p + 1)))
        else:
            spans.append(SeqSpan(p, 1, slot_range=(a, a + p + 1)))
        slots.append(a + p)
    return Step(spans, torch.tensor(slots))


@pytest.mark.parametrize("lean", [True, False])
def test_batch_equals_single(lean, monkeypatch):
    """Three sequences of different lengths decoding in one step (one given by gathered slots,
    as the paged engine gives them) get each sequence's logits run alone, bit for bit."""
    monkeypatch.setenv("MLXR_CPU_DECODE", "1" if lean else "0")
    dec = tiny_decoder("qwen3", 4, seed=1)
    g = torch.Generator().manual_seed(5)
    cap, lens = 24, [5, 9, 2]
    prompts = [torch.randint(0, 80, (n,), generator=g) for n in lens]
    nxt = torch.randint(0, 80, (3,), generator=g)
    cache = new_cache(dec, 3 * cap)
    singles = []
    with torch.inference_mode():
        for b, pr in enumerate(prompts):
            st = Step([SeqSpan(0, len(pr), slot_range=(b * cap, b * cap + len(pr)))],
                      torch.arange(b * cap, b * cap + len(pr)))
            dec.forward_step(pr, st, cache.pool)
        base = [k.clone() for k in cache.pool.k], [v.clone() for v in cache.pool.v]
        for b in range(3):
            singles.append(dec.forward_step(nxt[b:b + 1], _step([(b * cap, lens[b])], cap),
                                            cache.pool))
        for i in range(len(dec.layers)):  # back to the prompts' state
            cache.pool.k[i].copy_(base[0][i])
            cache.pool.v[i].copy_(base[1][i])
        both = dec.forward_step(nxt, _step([(b * cap, n) for b, n in enumerate(lens)], cap, {1}),
                                cache.pool)
    assert torch.equal(both, torch.cat(singles))


def test_declined_cases(monkeypatch):
    """The float32 exact mode and sliding windows keep the generic loop; MLXR_CPU_DECODE=0
    turns the step off."""
    assert cpu_decode.eligible(tiny_decoder("qwen3"))
    assert not cpu_decode.eligible(tiny_decoder("qwen3", dtype=torch.float32))
    assert not cpu_decode.eligible(tiny_decoder("qwen3", window=4))
    dec = tiny_decoder("llama")
    monkeypatch.setenv("MLXR_CPU_DECODE", "0")
    monkeypatch.setattr(cpu_decode, "run", lambda *a: pytest.fail("lean step taken"))
    cache = new_cache(dec, 8)
    with torch.inference_mode():
        dec.forward(torch.tensor([1, 2]), cache)
        dec.forward(torch.tensor([3]), cache)
