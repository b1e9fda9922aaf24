"""Reference parity with mlx-lm: every family and quantization mode, tiny random models made and
saved by mlx-lm itself, compared position by position.

Tolerances:
- float32 mode vs mlx-lm with every float parameter cast to float32 (codes untouched): both sides
  compute the same math in float32 and differ only in summation order, so logits agree to
  1e-3 of each position's logit range (measured: ~3e-6).
- A differing argmax is accepted only where the reference's top-two logits are closer than
  twice that tolerance (a near-tie no implementation can resolve); such ties are counted and
  may be at most 10% of positions (tiny random models loop, and loops breed near-ties).
- default bfloat16 mode: bf16 rounding (2^-8 relative per op) compounds through the layers of
  these chaotic random models, and mlx-lm's own bf16 run is off from its float32 run by several
  percent. We require our bf16 logits to be no further from the float32 reference than
  1.5x mlx-lm's own bf16 error (plus 1% of the range).
"""

from __future__ import annotations


import numpy as np
import pytest

mlx_ref = pytest.importorskip("mlx_ref")

import mlxr  # noqa: E402
from decode_checks import assert_static_step_equals_eager  # noqa: E402
from mlxr.engine.kv_cache import new_cache  # noqa: E402

F32_TOL = 1e-3
TIE_TOL = 2 * F32_TOL
MAX_TIE_FRACTION = 0.1

FAMILY_CASES = [(f, "q4g64") for f in mlx_ref.FAMILIES] + [(f, "bf16") for f in mlx_ref.FAMILIES]
QUANT_CASES = [("qwen3", q) for q in mlx_ref.QUANTS if q not in ("q4g64", "bf16")] + [
    ("llama", "mixed"), ("llama", "q3g32"), ("gemma3_text", "q6g128"), ("phi3", "nvfp4")]
CASES = FAMILY_CASES + QUANT_CASES


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
            path = mlx_ref.make_model(tmp_path_factory.mktemp(f"{family}-{quant}"), family, quant)
            prompt = mlx_ref.stable_prompt(family, quant, mlx_ref.BASE["vocab_size"])
            _cache[key] = Built(path, mlx_ref.reference(path, prompt))
        return _cache[key]

    return get


@pytest.mark.parametrize("family,quant", CASES)
def test_float32_logits_match_mlx_lm(built, family, quant):
    b = built(family, quant)
    ours = b.model32.logits(b.seq).numpy()
    ref = b.ref.logits32
    assert ours.shape == ref.shape
    err = np.abs(ours - ref).max(-1) / mlx_ref.logit_range(ref)
    assert err.max() <= F32_TOL, f"worst position {err.argmax()}: {err.max():.2e} of range"


@pytest.mark.parametrize("family,quant", CASES)
def test_float32_greedy_matches_mlx_lm(built, family, quant):
    b = built(family, quant)
    ref = b.ref.logits32
    ours = b.model32.logits(b.seq).numpy()
    tie = mlx_ref.top2_margin(ref) < TIE_TOL * mlx_ref.logit_range(ref)
    # Teacher-forced: every position, our argmax vs the reference's.
    differ = ours.argmax(-1) != ref.argmax(-1)
    assert not (differ & ~tie).any(), (
        f"argmax differs at non-tie positions {np.where(differ & ~tie)}"
    )
    assert tie.mean() <= MAX_TIE_FRACTION, f"{tie.sum()} near-ties in {len(tie)} positions"
    # Free-running greedy generation with the KV cache must reproduce mlx-lm's continuation
    # exactly, up to the first near-tie on its path (if any).
    gen = list(b.model32.generate(b.ref.prompt, max_tokens=len(b.ref.greedy)))
    n0 = len(b.ref.prompt) - 1
    for i, (g, r) in enumerate(zip(gen, b.ref.greedy)):
        if g != r:
            assert tie[n0 + i], f"greedy token {i} differs: {g} vs mlx-lm {r} (not a tie)"
            break
    else:
        assert len(gen) == len(b.ref.greedy)


@pytest.mark.parametrize("family,quant", FAMILY_CASES)
def test_default_dtype_close_to_reference(built, family, quant):
    b = built(family, quant)
    model = mlxr.load(b.path, device="cpu")
    ref = b.ref.logits32
    ours = model.logits(b.seq).numpy()
    scale = mlx_ref.logit_range(ref)
    ours_err = (np.abs(ours - ref).max(-1) / scale).max()
    mlx_err = (np.abs(b.ref.logits_bf16 - ref).max(-1) / scale).max()
    assert ours_err <= 1.5 * mlx_err + 0.01, f"bf16 error {ours_err:.3f} vs mlx-lm's {mlx_err:.3f}"


@pytest.mark.parametrize("family", list(mlx_ref.FAMILIES))
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 0.05)])
def test_prefill_then_decode_equals_full_recompute(built, family, dtype, tol):
    """Prefill part of the sequence, decode the rest token by token: every decoded position's
    logits equal a full teacher-forced forward (bf16: different op shapes round differently)."""
    b = built(family, "q4g64")
    model = b.model32 if dtype == "float32" else mlxr.load(b.path, device="cpu", dtype=dtype)
    # Dynamic NTK rescales RoPE by the current length, so decode and recompute differ by design
    # past max_position_embeddings (as in mlx-lm, whose incremental greedy we match above).
    seq = b.seq[:30] if family == "llama_dynamic" else b.seq[:40]
    full = model.logits(seq).numpy()
    dec = model.decoder
    cache = new_cache(dec, len(seq))
    import torch

    with torch.inference_mode():
        step = [dec.forward(torch.tensor(seq[:20]), cache, last_only=True)[0].numpy()]
        for t in seq[20:]:
            step.append(dec.forward(torch.tensor([t]), cache, last_only=True)[0].numpy())
    step = np.stack(step[:-1])
    want = full[19:-1]
    err = np.abs(step - want).max(-1) / mlx_ref.logit_range(want)
    assert err.max() <= tol, f"{err.max():.2e}"
    margin_ok = mlx_ref.top2_margin(want) > 2 * tol * mlx_ref.logit_range(want)
    assert (step.argmax(-1) == want.argmax(-1))[margin_ok].all()


@pytest.mark.parametrize("family", ["llama_sliding", "gemma2", "gemma3_text", "phi3", "qwen3"])
def test_static_decode_step_equals_eager(built, family):
    """The CUDA-graph decode step (`forward_static`: device-side positions, whole-capacity
    attention under a mask) computes the same logits as the eager step (run here on CPU)."""
    b = built(family, "q4g64")
    assert_static_step_equals_eager(b.model32.decoder, b.seq[:30])


@pytest.mark.parametrize("family,untied", [("llama", True), ("qwen3", False)])
def test_untied_embedding_is_gather_only(built, family, untied):
    """An untied quantized embedding is only gathered: the loader marks it so that no decode
    copies are built for it on CUDA; a tied one is also the LM head."""
    m = built(family, "q4g64").model32
    assert m.decoder.embed.weight.matmul is (not untied)
    assert all(ln.weight.matmul for ln in (m.decoder.layers[0].o_proj,))
