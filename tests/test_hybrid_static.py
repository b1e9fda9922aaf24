"""The hybrid caches' bounded memory and the capturable decode step, on CPU.

* gemma4's sliding-window layers keep a ring of `sliding_window` K/V slots: every position's
  float32 logits still match mlx-lm's (1e-3 of the range, test_parity_hybrid's tolerance) when
  the prompt runs in chunks that straddle the ring's wrap, one chunk longer than the whole
  window; the ring's memory stops growing at the window while full layers keep growing.
* `forward_static` (the CUDA-graph decode step: position on the device, K/V written at slot
  pos % slots, states updated in place) gives the eager step's logits within 1e-4 of the range
  (whole-buffer masked attention sums in another order) and the same greedy tokens, through
  several wraps of the ring, with no buffer reallocated.
"""

from __future__ import annotations

import numpy as np
import pytest

mlx_ref = pytest.importorskip("mlx_ref")
hyb = pytest.importorskip("mlx_ref_hybrid")

import torch  # noqa: E402

import mlxr  # noqa: E402
from mlxr.engine.cuda_graph import graphable  # noqa: E402
from mlxr.engine.kv_cache import new_cache  # noqa: E402

F32_TOL = 1e-3
_built: dict = {}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    def get(family: str):
        if family not in _built:
            path = hyb.make_model(tmp_path_factory.mktemp(family), family,
                                  dict(bits=4, group_size=64))
            prompt = mlx_ref.stable_prompt(family, "ring", 320)
            ref = mlx_ref.reference(path, prompt)
            _built[family] = (mlxr.load(path, device="cpu", dtype="float32"), ref)
        return _built[family]

    return get


def _ring_bytes(cache, windowed: bool) -> int:
    return sum(t.numel() * t.element_size()
               for s, k, v in zip(cache.shapes, cache.k, cache.v) if k is not None
               and (s.window is not None) == windowed for t in (k, v))


@pytest.mark.parametrize("family", ["gemma4_text", "gemma4"])
def test_sliding_ring_chunks_match_mlx_lm_and_memory_stops_growing(built, family):
    model, ref = built(family)
    dec = model.decoder
    window = next(w for w in dec.config.layer_window if w is not None)
    seq = ref.prompt + ref.greedy
    assert len(seq) > 5 * window
    # chunk ends 3 and 10 straddle the first wrap (at 8), 11 -> 30 is longer than the window
    cuts = [0, 3, 10, 11, 30, 31, 47, len(seq)]
    cache = new_cache(dec, 4)  # small: the ring also grows to its window first
    rows, ring, full = [], [], []
    with torch.inference_mode():
        for a, z in zip(cuts, cuts[1:]):
            rows.append(dec.forward(torch.tensor(seq[a:z]), cache).numpy())
            ring.append(_ring_bytes(cache, True))
            full.append(_ring_bytes(cache, False))
            assert all(k.shape[1] <= window for s, k in zip(cache.shapes, cache.k)
                       if k is not None and s.window is not None)
    ours, want = np.concatenate(rows), ref.logits32
    err = np.abs(ours - want).max(-1) / mlx_ref.logit_range(want)
    assert err.max() <= F32_TOL, f"worst position {err.argmax()}: {err.max():.2e} of range"
    # past the window the rings hold exactly `window` slots each (float32 K and V); the full
    # layers' buffers keep growing
    bound = sum(2 * s.kv_heads * window * s.head_dim * 4 for s in cache.shapes
                if s is not None and s.window is not None)
    past = [b for b, z in zip(ring, cuts[1:]) if z >= window]
    assert len(past) == 6 and set(past) == {bound}
    assert full[-1] > full[1]


@pytest.mark.parametrize("family", ["qwen3_5", "gemma4_text", "gemma4", "qwen3_next",
                                    "gemma4_moe"])
def test_static_decode_step_equals_eager(built, family):
    model, ref = built(family)
    dec = model.decoder
    seq = ref.prompt + ref.greedy
    n0, cap = 20, 64
    eager, static = new_cache(dec, cap), new_cache(dec, cap)
    tables = {}
    for rope in dec.ropes:
        tables.setdefault(id(rope.spec), rope.cos_sin(0, cap))
    buffers = [t for t in (*static.k, *static.v, *static.conv, *static.ssm) if t is not None]
    ptrs = [t.data_ptr() for t in buffers]
    with torch.inference_mode():
        dec.forward(torch.tensor(seq[:n0]), eager, last_only=True)
        dec.forward(torch.tensor(seq[:n0]), static, last_only=True)
        for p in range(n0, len(seq)):
            want = dec.forward(torch.tensor([seq[p]]), eager, last_only=True)[0]
            got = dec.forward_static(torch.tensor([seq[p]]), torch.tensor([p]), static.pool,
                                     tables)[0]
            tol = 1e-4 * float(want.max() - want.min())
            assert torch.allclose(got, want, rtol=0, atol=tol), f"position {p}"
        # free-running greedy: the static step feeds its own argmax back, as the graph does
        ids, pos = torch.tensor([seq[n0 - 1]]), torch.tensor([n0 - 1])
        static.length = 0  # a fresh sequence in the same buffers, as GraphCache reuses them
        dec.forward(torch.tensor(seq[:n0 - 1]), static)
        tokens = []
        for _ in range(len(seq) - n0):
            ids = dec.forward_static(ids, pos, static.pool, tables)[0].argmax(-1, keepdim=True)
            pos.add_(1)
            tokens.append(int(ids))
    assert [t.data_ptr() for t in buffers] == ptrs  # updated in place, never reallocated
    assert tokens == list(model.generate(seq[:n0], max_tokens=len(tokens), ignore_eos=True))


@pytest.mark.parametrize("family", ["qwen3_5", "gemma4", "qwen3_next", "gemma4_moe"])
@pytest.mark.parametrize("kernels", [True, False])
def test_hybrids_are_graphable_on_cuda(built, family, kernels, monkeypatch):
    """On CUDA the single-sequence decode of the hybrids is captured like the dense path's;
    a MoE family only where its blocks run the MoE kernels (the torch path groups tokens by
    expert on the host)."""
    dec = built(family)[0].decoder
    assert not graphable(dec)  # CPU
    monkeypatch.setattr(dec, "device", torch.device("cuda"))
    moe = [ly.moe for ly in dec.layers if ly.moe is not None]
    for block in moe:
        monkeypatch.setattr(block, "capturable", lambda device: kernels)
    monkeypatch.delenv("MLXR_HYBRID_GRAPHS", raising=False)
    monkeypatch.delenv("MLXR_MOE_GRAPHS", raising=False)
    assert graphable(dec) is (kernels or not moe)  # captured by default
    monkeypatch.setenv("MLXR_MOE_GRAPHS", "0")
    assert graphable(dec) is (not moe)
    monkeypatch.setenv("MLXR_HYBRID_GRAPHS", "0")
    assert not graphable(dec)


@pytest.mark.parametrize("family", ["qwen3_5", "gemma4"])
@pytest.mark.parametrize("length", [4, 8, 20])
def test_snapshot_copy_resumes_bit_identically(built, family, length):
    """A cache copied to its own length (a prefix snapshot: rings not yet wrapped, exactly
    full, and wrapped) and copied again into a larger one continues exactly as the original."""
    model, ref = built(family)
    dec = model.decoder
    seq = ref.prompt + ref.greedy
    cache = new_cache(dec, 4)
    with torch.inference_mode():
        dec.forward(torch.tensor(seq[:length]), cache)
        snap = cache.copy(length)
        assert snap.capacity == length and snap.nbytes() <= cache.nbytes()
        resumed = snap.copy(64)
        for a, z in ((length, length + 7), (length + 7, length + 8)):
            want = dec.forward(torch.tensor(seq[a:z]), cache)
            got = dec.forward(torch.tensor(seq[a:z]), resumed)
            assert torch.equal(got, want), (a, z)
