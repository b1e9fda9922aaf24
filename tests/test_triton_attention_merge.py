"""The decode attention's splits merged by the split kernel's last program
(`kv_attention.masked`, MLXR_ATTN_MERGE=1) instead of the combine launch, under the CPU
interpreter: `_merge_splits`' arithmetic over the same partials (by chunks of the head's
features: the same per-feature sums), so the outputs equal
the two-launch path's bit for bit (the merge skips the acc of splits that saw no key, whose
weight is exp2(-inf) = 0 and acc 0: the same sums), over masks, positions with windows, sinks,
soft-caps, several row blocks and many empty splits; the ticket counters are back at zero
after every launch, and the budget (`merge_in_split`) keeps the combine launch beyond it.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from test_triton_fused import attn_case, gen  # noqa: E402

from mlxr.ops import tickets  # noqa: E402
from mlxr.ops.kv_attention import masked as A  # noqa: E402

INTERPRETER_ONLY = True  # tests/conftest.py: the interpreter is on without a GPU


class _Spy:
    """Counts the combine kernel's launches."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


def _both(monkeypatch, *args, **kw):
    spy = _Spy(A._attn_combine_kernel)
    monkeypatch.setattr(A, "_attn_combine_kernel", spy)
    monkeypatch.delenv("MLXR_ATTN_MERGE", raising=False)
    two = A.attention_masked_split(*args, **kw)
    assert spy.launches == 1
    monkeypatch.setenv("MLXR_ATTN_MERGE", "1")
    one = A.attention_masked_split(*args, **kw)
    monkeypatch.delenv("MLXR_ATTN_MERGE")
    assert spy.launches == 1  # merged in the split kernel: no combine launch
    assert int(tickets.counters(torch.device("cpu"), tickets.ATTENTION).abs().sum()) == 0
    return two, one


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rep,t", [(1, 1), (4, 1), (2, 3)])
@pytest.mark.parametrize("softcap", [None, 20.0])
@pytest.mark.parametrize("window", [None, 37])
def test_merge_equals_combine_masks(monkeypatch, dtype, rep, t, softcap, window):
    kh, s, d = 2, 150, 32
    q, k, v, vis = attn_case(("merge", str(dtype), rep, t, softcap, window), dtype, t, kh,
                             rep, s, d, window)
    for block_s, splits in ((16, 3), (16, 64)):  # 3 splits; one tile each (most empty)
        two, one = _both(monkeypatch, q, k, v, vis, 0.3, softcap, block_s, splits)
        assert torch.equal(one, two)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tile", [2048, 128])  # 128: the merge walks the head in 8-wide chunks
def test_merge_equals_combine_positions_and_sinks(monkeypatch, dtype, tile):
    """The decode graph's form (positions, a window) and gpt-oss's sinks; 40 rows over
    ATTN_MAX_BLOCK_M-row blocks: several row blocks, each its own ticket."""
    monkeypatch.setattr(A, "MERGE_TILE", tile)
    kh, rep, t, s, d = 2, 20, 2, 200, 64
    g = gen(("merge-pos", str(dtype)))
    q = torch.randn(t, kh * rep, d, generator=g).to(dtype)
    k = torch.randn(kh, s, d, generator=g).to(dtype)
    v = torch.randn(kh, s, d, generator=g).to(dtype)
    sinks = torch.randn(kh * rep, generator=g)
    pos = torch.tensor([120, 57])
    for window in (None, 64):
        two, one = _both(monkeypatch, q, k, v, None, 0.125, None, 16, 13, positions=pos,
                         window=window, sinks=sinks)
        assert torch.equal(one, two)


def test_merge_budget(monkeypatch):
    monkeypatch.setenv("MLXR_ATTN_MERGE", "1")
    assert A.merge_in_split(4, 32, 128)  # an 8B decode layer
    assert A.merge_in_split(8, 64, 128)  # Qwen3-30B-A3B: exactly at the budget
    assert not A.merge_in_split(8, 256, 512)  # Gemma 4's full layers: the combine launch
    monkeypatch.delenv("MLXR_ATTN_MERGE")
    assert not A.merge_in_split(4, 32, 128)  # opt-in
