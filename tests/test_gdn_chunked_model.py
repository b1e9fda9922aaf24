"""The chunked gated delta rule in the model (MLXR_GDN_CHUNKED=1; on the CPU the torch twin
`reference.gated_delta_chunked`): a qwen3_5 model made, quantized and saved by mlx-lm
(`mlx_ref_hybrid`), with a prompt of 150 tokens (two full chunks and a partial one).

* float32 logits at every position within 1e-3 of the range of mlx-lm's (its sequential
  order; test_parity_hybrid's tolerance: the same float32 math summed in another order), and
  the same greedy argmax except at near-ties;
* a prompt prefilled in chunks that take the chunked form (>= 64 tokens) and the sequential
  one (< 64) between them, the recurrent state carried, gives each chunk end the whole
  forward's logits within 1e-4 of the range (test_parity_hybrid's incremental tolerance);
* a sequence resumed from a cache snapshot taken at a chunk end equals the whole forward.
"""

from __future__ import annotations

import numpy as np
import pytest

mlx_ref = pytest.importorskip("mlx_ref")
hyb = pytest.importorskip("mlx_ref_hybrid")

import torch  # noqa: E402

import mlxr  # noqa: E402
from mlxr.engine.kv_cache import new_cache  # noqa: E402
from mlxr.ops.recurrent import reference as R  # noqa: E402

F32_TOL, STEP_TOL = 1e-3, 1e-4


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    path = hyb.make_model(tmp_path_factory.mktemp("qwen3_5"), "qwen3_5",
                          dict(bits=4, group_size=64))
    prompt = mlx_ref.stable_prompt("qwen3_5", "chunked", 320, n=150)
    ref = mlx_ref.reference(path, prompt, max_tokens=4)
    return mlxr.load(path, device="cpu", dtype="float32"), ref


@pytest.fixture(autouse=True)
def chunked(monkeypatch):
    monkeypatch.setenv("MLXR_GDN_CHUNKED", "1")


def _err(got: np.ndarray, want: np.ndarray) -> float:
    return float((np.abs(got - want).max(-1) / mlx_ref.logit_range(want)).max())


def test_logits_match_mlx_lm(built):
    model, ref = built
    seq = ref.prompt + ref.greedy
    ours = model.logits(seq).numpy()
    assert _err(ours, ref.logits32) <= F32_TOL
    tie = mlx_ref.top2_margin(ref.logits32) < 2 * F32_TOL * mlx_ref.logit_range(ref.logits32)
    assert ((ours.argmax(-1) == ref.logits32.argmax(-1)) | tie).all()


def test_chunks_and_a_resumed_snapshot_equal_the_whole_forward(built, monkeypatch):
    model, ref = built
    seen = []  # tokens of each chunked call: the form runs where it should
    twin = R.gated_delta_chunked
    monkeypatch.setattr(R, "gated_delta_chunked", lambda *a: seen.append(a[0].shape[1])
                        or twin(*a))
    dec, seq = model.decoder, ref.prompt
    full = model.logits(seq).numpy()
    cuts = [0, 64, 70, 150]  # chunked (64 tokens), sequential (6), chunked (80)
    cache = new_cache(dec, len(seq) + 4)
    got, snap = [], None
    with torch.inference_mode():
        for a, z in zip(cuts, cuts[1:]):
            got.append(dec.forward(torch.tensor(seq[a:z]), cache, last_only=True)[0].numpy())
            if z == 70:
                snap = cache.copy(z)  # a prefix snapshot, as the engine's prefix cache takes
        resumed = dec.forward(torch.tensor(seq[70:]), snap.copy(len(seq)),
                              last_only=True)[0].numpy()
    want = full[[z - 1 for z in cuts[1:]]]
    assert seen and set(seen) == {64, 80, 150}, seen  # the whole forward, chunks, the resume
    assert _err(np.stack(got), want) <= STEP_TOL
    assert _err(resumed[None], full[-1:]) <= STEP_TOL
