"""Parity with mlx-lm for the hybrid families (qwen3_5, qwen3_5_moe, qwen3_next, gemma4_text,
gemma4 and its MoE variant): tiny random models made, quantized and saved by mlx-lm
(`mlx_ref_hybrid`), compared position by position.

Tolerances are test_parity's, for the same reasons: float32 logits within 1e-3 of each
position's logit range (both sides compute the same float32 math; they differ in summation
order only), argmax differences only at near-ties, bf16 no further from the float32 reference
than 1.5x mlx-lm's own bf16 run plus 1% of the range. Incremental paths (decode after prefill,
chunked prefill) against a whole forward: float32 1e-4 of the range (summation order of
different op shapes), bf16 5%.

The MoE families route each token to 2 of 4 experts: a float32 rounding difference (~2e-6 of
a range) could pick another expert only where two router scores lie that close; these
seeded models have no such near-tie (every position's float32 logits match to 1e-3), so no
expert-selection allowance is made here (test_parity_moe has one for its larger routers).
"""

from __future__ import annotations


import numpy as np
import pytest

mlx_ref = pytest.importorskip("mlx_ref")
hyb = pytest.importorskip("mlx_ref_hybrid")

import torch  # noqa: E402

import mlxr  # noqa: E402
from mlxr.engine.kv_cache import new_cache  # noqa: E402

F32_TOL = 1e-3
TIE_TOL = 2 * F32_TOL
MAX_TIE_FRACTION = 0.1
QUANTS = {"q4g64": dict(bits=4, group_size=64), "mxfp4": dict(mode="mxfp4"), "bf16": None}

MOE_FAMILIES = ["qwen3_5_moe", "qwen3_next", "gemma4_moe"]
FAMILIES = ["qwen3_5", "qwen3_5_untied", "gemma4_text", "gemma4"] + MOE_FAMILIES
CASES = ([(f, "q4g64") for f in FAMILIES] + [("qwen3_5", "bf16"), ("gemma4_text", "bf16")]
         + [(f, "mxfp4") for f in MOE_FAMILIES] + [("qwen3_next", "bf16"), ("gemma4_moe", "bf16")])


class Built:
    def __init__(self, path, ref):
        self.path, self.ref = path, ref
        self.model32 = mlxr.load(path, device="cpu", dtype="float32")
        self.seq = ref.prompt + ref.greedy


_cache: dict = {}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    def get(family: str, quant: str) -> Built:
        key = (family, quant)
        if key not in _cache:
            path = hyb.make_model(tmp_path_factory.mktemp(f"{family}-{quant}"), family,
                                  QUANTS[quant])
            prompt = mlx_ref.stable_prompt(family, quant, 320)
            _cache[key] = Built(path, mlx_ref.reference(path, prompt))
        return _cache[key]

    return get


@pytest.mark.parametrize("family,quant", CASES)
def test_float32_logits_and_greedy_match_mlx_lm(built, family, quant):
    b = built(family, quant)
    ref = b.ref.logits32
    ours = b.model32.logits(b.seq).numpy()
    assert ours.shape == ref.shape
    err = np.abs(ours - ref).max(-1) / mlx_ref.logit_range(ref)
    assert err.max() <= F32_TOL, f"worst position {err.argmax()}: {err.max():.2e} of range"
    tie = mlx_ref.top2_margin(ref) < TIE_TOL * mlx_ref.logit_range(ref)
    differ = ours.argmax(-1) != ref.argmax(-1)
    assert not (differ & ~tie).any(), f"argmax differs at {np.where(differ & ~tie)}"
    assert tie.mean() <= MAX_TIE_FRACTION
    gen = list(b.model32.generate(b.ref.prompt, max_tokens=len(b.ref.greedy)))
    n0 = len(b.ref.prompt) - 1
    for i, (g, r) in enumerate(zip(gen, b.ref.greedy)):
        if g != r:
            assert tie[n0 + i], f"greedy token {i} differs: {g} vs mlx-lm {r} (not a tie)"
            break
    else:
        assert len(gen) == len(b.ref.greedy)


@pytest.mark.parametrize("family,quant", CASES)
def test_default_dtype_close_to_reference(built, family, quant):
    b = built(family, quant)
    if b.ref.logits_bf16 is None:
        pytest.skip("mlx's CPU runs float (unquantized) experts only in float32")
    ours = mlxr.load(b.path, device="cpu").logits(b.seq).numpy()
    ref = b.ref.logits32
    scale = mlx_ref.logit_range(ref)
    ours_err = (np.abs(ours - ref).max(-1) / scale).max()
    mlx_err = (np.abs(b.ref.logits_bf16 - ref).max(-1) / scale).max()
    assert ours_err <= 1.5 * mlx_err + 0.01, f"bf16 error {ours_err:.3f} vs mlx-lm's {mlx_err:.3f}"


def _incremental(model, seq: list[int], cuts: list[int]) -> np.ndarray:
    """Logits of the last token of each chunk seq[cuts[j]:cuts[j+1]], one forward per chunk
    into the same cache (recurrent state and K/V carried)."""
    dec = model.decoder
    cache = new_cache(dec, 8)  # small: the chunks also exercise the cache's growth
    out = []
    with torch.inference_mode():
        for a, z in zip(cuts, cuts[1:]):
            out.append(dec.forward(torch.tensor(seq[a:z]), cache, last_only=True)[0].numpy())
    return np.stack(out)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 0.05)])
def test_prefill_then_decode_equals_full_recompute(built, family, dtype, tol):
    b = built(family, "q4g64")
    model = b.model32 if dtype == "float32" else mlxr.load(b.path, device="cpu", dtype=dtype)
    seq = b.seq[:40]
    full = model.logits(seq).numpy()
    cuts = [0, 20] + list(range(21, 41))
    step = _incremental(model, seq, cuts)
    want = full[[z - 1 for z in cuts[1:]]]
    err = np.abs(step - want).max(-1) / mlx_ref.logit_range(want)
    assert err.max() <= tol, f"{err.max():.2e}"
    margin_ok = mlx_ref.top2_margin(want) > 2 * tol * mlx_ref.logit_range(want)
    assert (step.argmax(-1) == want.argmax(-1))[margin_ok].all()


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_equals_whole(built, family):
    """A prompt prefilled in uneven chunks (conv and recurrent state, K/V carried across)
    gives every chunk end the logits of the whole prompt's forward."""
    b = built(family, "q4g64")
    seq = b.seq[:37]
    full = b.model32.logits(seq).numpy()
    cuts = [0, 5, 6, 13, 29, 37]
    got = _incremental(b.model32, seq, cuts)
    want = full[[z - 1 for z in cuts[1:]]]
    err = np.abs(got - want).max(-1) / mlx_ref.logit_range(want)
    assert err.max() <= 1e-4, f"{err.max():.2e}"


def test_fresh_sequence_resets_recurrent_state(built):
    """A cache reused from position 0 (the CUDA path reuses caches across requests) starts
    from zero recurrent state: the same prompt twice gives the same logits."""
    b = built("qwen3_5", "q4g64")
    dec = b.model32.decoder
    cache = new_cache(dec, 64)
    with torch.inference_mode():
        first = dec.forward(torch.tensor(b.seq[:12]), cache)
        cache.length = 0
        again = dec.forward(torch.tensor(b.seq[:12]), cache)
    assert torch.equal(first, again)


@pytest.mark.parametrize("family", ["qwen3_5", "gemma4", "qwen3_next", "gemma4_moe"])
def test_forward_batch_equals_single(built, family):
    """One decode token for several sequences at different positions (`forward_batch`, the
    serving engine's decode step) equals each sequence's own forward, float32 (batched
    projections sum in another order: 1e-4 of the range)."""
    b = built(family, "q4g64")
    dec = b.model32.decoder
    lens = [3, 17, 9]
    singles, caches = [], []
    with torch.inference_mode():
        for n in lens:
            one, two = new_cache(dec, 4), new_cache(dec, 4)
            dec.forward(torch.tensor(b.seq[:n]), one)
            dec.forward(torch.tensor(b.seq[:n]), two)
            singles.append(dec.forward(torch.tensor([b.seq[n]]), one)[0].numpy())
            caches.append(two)
        got = dec.forward_batch(torch.tensor([b.seq[n] for n in lens]), caches).numpy()
        want = np.stack(singles)
        err = np.abs(got - want).max(-1) / mlx_ref.logit_range(want)
        assert err.max() <= 1e-4, f"{err.max():.2e}"
        assert [c.length for c in caches] == [n + 1 for n in lens]
        # the caches advanced: a second batched step equals a second single step
        nxt = dec.forward_batch(torch.tensor([b.seq[n + 1] for n in lens]), caches).numpy()
        full = b.model32.logits(b.seq[:max(lens) + 2]).numpy()
        want2 = full[[n + 1 for n in lens]]
        assert (np.abs(nxt - want2).max(-1) / mlx_ref.logit_range(want2)).max() <= 1e-4


@pytest.mark.parametrize("family,quant", [("qwen3_5_moe", "q4g64"), ("qwen3_next", "q4g64"),
                                          ("gemma4_moe", "q4g64"), ("gemma4_moe", "bf16")])
def test_moe_kernels_equal_torch_path(built, family, quant, monkeypatch):
    """The hybrids' MoE block (shared expert with its sigmoid gate; Gemma 4's GeGLU experts,
    quantized and unquantized bf16 ones as the kernels' dense mode) on the MoE kernels (the
    Triton interpreter here, CUDA's path) equals its torch path: float32 logits within 1e-5
    of the range (fp32 sums in other orders), stacked experts."""
    b = built(family, quant)
    monkeypatch.setenv("MLXR_MOE", "stacked")
    model = mlxr.load(b.path, device="cpu", dtype="float32")
    blocks = [m for m in (getattr(ly, "moe", None) for ly in model.decoder.layers)
              if m is not None]
    blocks = [m.block if hasattr(m, "block") else m for m in blocks]  # gemma4's experts
    assert blocks and all(blk.quant is not None for blk in blocks)
    seq = b.seq[:24]
    for blk in blocks:
        blk.kernels = False
    want = model.logits(seq).numpy()
    for blk in blocks:
        blk.kernels = True
    got = model.logits(seq).numpy()
    err = np.abs(got - want).max(-1) / mlx_ref.logit_range(want)
    assert err.max() <= 1e-5, f"{err.max():.2e}"
