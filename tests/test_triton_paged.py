"""Paged decode attention (mlxr.ops.kv_attention.paged) vs reference.paged_attention: on the GPU
when there is one, else under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1).

Fresh random data: shuffled (non-consecutive) block tables, contexts of 1 token, exact block and
tile boundaries and ragged ends, GQA rep 1/2/4, sliding windows, softcap, single pass and split
contexts (combine). Stale slots (other sequences' blocks, the free pool) hold NaN, so any read
outside a sequence's visible positions shows up.

Tolerances: fp32, the same fp32 math in another order: 1e-5 * max|v|. bf16 against the reference
on fp32-upcast inputs (the exact answer): p rounded to bf16 before P.V (<= 2^-7 max|v|) and the
output rounded once (2^-7 |out|), plus 1 ulp for the interpreter's truncating casts.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from mlxr.ops import reference as R
from mlxr.ops.kv_attention import paged as P

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(seed, lens, kh, rep, d, bs, dtype):
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n in lens]
    nblocks = sum(need) + 3
    perm = torch.randperm(nblocks, generator=g).tolist()
    width = max(need) + 2
    tables = torch.full((len(lens), width), nblocks + 99, dtype=torch.int32)  # junk past the end
    at = 0
    for b, m in enumerate(need):
        tables[b, :m] = torch.tensor(perm[at:at + m], dtype=torch.int32)
        at += m
    k = torch.full((kh, nblocks * bs, d), float("nan"))
    v = torch.full((kh, nblocks * bs, d), float("nan"))
    for b, n in enumerate(lens):  # only each sequence's live positions hold numbers
        p = torch.arange(n)
        slots = tables[b, p // bs].long() * bs + p % bs
        k[:, slots] = torch.randn(kh, n, d, generator=g)
        v[:, slots] = torch.randn(kh, n, d, generator=g)
    q = torch.randn(len(lens), kh * rep, d, generator=g)
    return (q.to(DEV, dtype), k.to(DEV, dtype), v.to(DEV, dtype), tables.to(DEV),
            torch.tensor(lens, dtype=torch.int32, device=DEV))


def _assert_close(out, ref, v, dtype):
    """The tolerances of the module docstring (v's stale NaN slots excluded from max|v|)."""
    assert torch.isfinite(out).all()
    vmax = torch.nan_to_num(v.float(), nan=0.0).abs().max()
    if dtype == torch.float32:
        tol = 1e-5 * vmax
    else:
        tol = 2 ** -7 * vmax + 2 * 2 ** -7 * ref.abs() + 2 ** -20
    assert ((out.float() - ref).abs() <= tol).all(), (out.float() - ref).abs().max()


CASES = [  # lens, kv heads, rep, head dim, block size, window, softcap, splits
    ([1, 17, 64, 65], 2, 2, 16, 16, None, None, None),
    ([130, 5], 1, 4, 32, 16, None, None, 3),
    ([100, 1, 200], 2, 1, 16, 32, 40, None, None),
    ([77, 129], 2, 2, 24, 16, 64, 30.0, 2),
    ([3], 4, 2, 16, 16, None, 50.0, 5),
    # Gemma 4's heads: 512 wide (q.k by 128-wide slices, 16-key tiles), 256 wide (one dot)
    ([1, 40], 1, 2, 512, 16, None, None, 2),
    ([37], 2, 1, 256, 16, 20, None, None),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_paged_attention_matches_reference(case, dtype):
    lens, kh, rep, d, bs, window, softcap, splits = CASES[case]
    q, k, v, tables, ctx = _case(100 + case, lens, kh, rep, d, bs, dtype)
    scale = d ** -0.5
    out = P.paged_attention(q, k, v, tables, ctx, bs, scale, window, softcap, splits=splits)
    assert out.shape == q.shape and out.dtype == dtype
    ref = R.paged_attention(q.float(), k.float(), v.float(), tables, ctx, bs, scale, window,
                            softcap)
    _assert_close(out, ref, v, dtype)


def test_splits_agree_with_single_pass():
    q, k, v, tables, ctx = _case(7, [150, 33], 2, 2, 16, 16, torch.float32)
    one = P.paged_attention(q, k, v, tables, ctx, 16, 0.25, splits=1)
    many = P.paged_attention(q, k, v, tables, ctx, 16, 0.25, splits=4)
    assert (one - many).abs().max() <= 1e-5 * v.nan_to_num().abs().max()


@pytest.mark.parametrize("block_s,num_warps", [(16, 2), (32, 4), (128, 8)])
def test_launch_overrides_match_reference(block_s, num_warps):
    """The sweep's launch knobs (keys per tile smaller than, equal to and larger than a cache
    block of 32; warps) change nothing but speed: windowed, softcapped, split and single."""
    q, k, v, tables, ctx = _case(11, [150, 1, 97], 2, 2, 16, 32, torch.bfloat16)
    ref = R.paged_attention(q.float(), k.float(), v.float(), tables, ctx, 32, 0.25, 70, 30.0)
    for splits in (1, 3):
        out = P.paged_attention(q, k, v, tables, ctx, 32, 0.25, 70, 30.0, splits=splits,
                                block_s=block_s, num_warps=num_warps)
        _assert_close(out, ref, v, torch.bfloat16)


def test_reference_row_equals_contiguous_attention():
    """The reference is `attention` over each sequence's gathered context (the eager path)."""
    q, k, v, tables, ctx = _case(3, [40], 2, 2, 16, 16, torch.float32)
    p = torch.arange(40)
    slots = tables[0].cpu()[p // 16].long() * 16 + p % 16
    q, k, v = q.cpu(), k.cpu(), v.cpu()
    want = R.attention(q, k[:, slots], v[:, slots], 39, 0, 0.25)
    assert torch.equal(R.paged_attention(q, k, v, tables.cpu(), ctx.cpu(), 16, 0.25), want)


PREFILL = [  # context lengths, new tokens per sequence, kv heads, rep, head dim, block, window, cap
    ([40, 1, 90], [40, 1, 7], 2, 2, 16, 16, None, None),
    ([130, 20], [1, 20], 1, 4, 32, 16, 24, None),
    ([70, 33, 5], [70, 2, 5], 2, 1, 16, 32, None, 30.0),
    ([100], [65], 4, 2, 16, 16, 40, 20.0),
    ([40, 6], [40, 2], 1, 2, 512, 16, None, None),  # 512-wide heads
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(PREFILL)))
def test_paged_prefill_matches_reference(case, dtype):
    """Mixed batches: whole prompts, chunks continuing a prompt, decodes; tiles of
    ops.prefill_tile rows (a 65-token chunk spans several items)."""
    from mlxr import ops
    lens, news, kh, rep, d, bs, window, softcap = PREFILL[case]
    _, k, v, tables, _ = _case(200 + case, lens, kh, rep, d, bs, dtype)
    g = torch.Generator().manual_seed(case)
    q = torch.randn(sum(news), kh * rep, d, generator=g).to(DEV, dtype)
    spans, row = [], 0
    for s, (n, m) in enumerate(zip(lens, news)):
        spans.append((s, row, n - m, m))
        row += m
    items = ops.paged_items(spans, ops.prefill_tile(kh * rep, kh)).to(DEV)
    scale = d ** -0.5
    out = P.paged_prefill_attention(q, k, v, tables, items, bs, scale, window, softcap)
    ref = R.paged_prefill_attention(q.float(), k.float(), v.float(), tables, items, bs, scale,
                                    window, softcap)
    _assert_close(out, ref, v, dtype)
    # the reference itself: each sequence's rows equal `attention` over its gathered context
    s, r, p, n = spans[-1]
    x = torch.arange(0, p + n)
    slots = tables[s].cpu()[x // bs].long() * bs + x % bs
    lo = 0 if window is None else max(0, p - window + 1)
    want = R.attention(q[r:r + n].float().cpu(), k.float().cpu()[:, slots[lo:]],
                       v.float().cpu()[:, slots[lo:]], p, lo, scale, window, softcap)
    assert torch.allclose(ref[r:r + n].cpu(), want, atol=1e-6)


def test_paged_items_tiles():
    from mlxr import ops
    items = ops.paged_items([(0, 0, 5, 3), (1, 3, 0, 5)], 2).tolist()
    assert items == [[0, 0, 5, 2], [0, 2, 7, 1], [1, 3, 0, 2], [1, 5, 2, 2], [1, 7, 4, 1]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3])
def test_paged_attention_sinks(dtype, splits):
    """Sinks [H] (gpt-oss) in the paged decode kernel: counted once whatever the split
    count, windowed too, against the reference with the same sinks."""
    q, k, v, tables, ctx = _case(23, [1, 70, 130], 2, 2, 16, 16, dtype)
    sinks = torch.tensor([-3.0, 0.5, 2.0, 8.0], device=DEV).to(dtype)
    for window in (None, 40):
        out = P.paged_attention(q, k, v, tables, ctx, 16, 0.25, window, splits=splits,
                                sinks=sinks)
        ref = R.paged_attention(q.float(), k.float(), v.float(), tables, ctx, 16, 0.25,
                                window, None, sinks)
        _assert_close(out, ref, v, dtype)
    plain = P.paged_attention(q, k, v, tables, ctx, 16, 0.25, splits=splits)
    assert (plain.float() - ref).abs().max() > 0.05
