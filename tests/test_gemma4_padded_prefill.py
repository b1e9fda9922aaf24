"""Gemma 4's padded prefill (`forward_padded`, the body of its prefill CUDA graph), on the CPU:
a prompt padded to its bucket gives the unpadded prompt's last logits, and the decode steps
after it (eager, and the graph's `forward_static`, past the ring's wrap) the same logits as
after an unpadded prefill: the padding's K/V is never seen. float32, within 1e-4 of each row's
logit range (tests/decode_checks.py's bound: the same math over other row counts)."""

from __future__ import annotations

import copy

import pytest
import torch
from hybrid_configs import FAMILIES

import mlxr
from mlxr.engine import cuda_graph
from mlxr.engine.kv_cache import new_cache

WINDOW = 16


@pytest.fixture(scope="module")
def dec(tmp_path_factory, make_checkpoint):
    cfg = copy.deepcopy(FAMILIES["gemma4"])  # PLE, KV sharing, k = v full layers
    cfg["text_config"]["sliding_window"] = WINDOW
    path = make_checkpoint.write_hybrid(cfg, tmp_path_factory.mktemp("gemma4-pad"), None)
    return mlxr.load(path, device="cpu", dtype="float32").decoder


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    rng = (want.amax(-1) - want.amin(-1))[..., None]
    assert ((got - want).abs() <= 1e-4 * rng).all(), float(((got - want).abs() / rng).max())


@pytest.mark.parametrize("n", [1, 11, WINDOW])
def test_padded_prefill_then_decode(dec, n):
    g = torch.Generator().manual_seed(n)
    seq = torch.randint(0, 320, (n + 12,), generator=g)
    cap = 32
    plain, padded = new_cache(dec, cap), new_cache(dec, cap)
    assert dec.pads_fit(padded, WINDOW) and not dec.pads_fit(padded, WINDOW + 1)
    ids = torch.zeros(WINDOW, dtype=torch.long)
    ids[:n] = seq[:n]
    padded.length = 5  # forward_padded starts the cache over
    tables = {id(r.spec): r.cos_sin(0, cap) for r in dec._rope_kinds}
    with torch.inference_mode():
        want = dec.forward(seq[:n], plain, last_only=True)
        got = dec.forward_padded(ids, torch.tensor([n - 1]), padded)
        _close(got, want)
        padded.length = n  # as PrefillGraph.run leaves it
        for p in range(n, n + 12):  # the 16-slot rings wrap at position 16
            want = dec.forward(seq[p:p + 1], plain, last_only=True)
            got = dec.forward_static(seq[p:p + 1], torch.tensor([p]), padded, tables)
            _close(got, want)


def test_padded_prefill_gate(dec, monkeypatch, tmp_path, make_checkpoint):
    """Opt-in by env; never where a ring would wrap, nor for the MoE variant."""
    cache = new_cache(dec, 64)
    monkeypatch.delenv("MLXR_HYBRID_PREFILL_GRAPHS", raising=False)
    assert not cuda_graph.padded_prefill(dec, cache, WINDOW)
    monkeypatch.setenv("MLXR_HYBRID_PREFILL_GRAPHS", "1")
    assert cuda_graph.padded_prefill(dec, cache, WINDOW)
    assert not cuda_graph.padded_prefill(dec, cache, 2 * WINDOW)
    path = make_checkpoint.write_hybrid(FAMILIES["gemma4_moe"], tmp_path, None)
    moe = mlxr.load(path, device="cpu", dtype="float32").decoder
    assert not cuda_graph.padded_prefill(moe, new_cache(moe, 64), 8)
