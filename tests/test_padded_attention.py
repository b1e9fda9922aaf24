"""`padded_decode_attention` (the hybrids' batched serving decode) equals one reference
attention per sequence: same float32 math, only the sums' order differs (1e-5 of the outputs'
scale, float32 rounding over at most a few hundred terms, is a wide margin)."""

from __future__ import annotations

import pytest
import torch

from mlxr.models.padded_attention import padded_decode_attention
from mlxr.ops.reference import attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 1), (4, 2), (2, 2)])
def test_padded_equals_per_sequence(dtype, heads, kv_heads):
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    lens, d = [1, 9, 4, 130], 32
    q = torch.randn(len(lens), heads, d, generator=g).to(dtype)
    keys = [torch.randn(kv_heads, n, d, generator=g).to(dtype) for n in lens]
    values = [torch.randn(kv_heads, n, d, generator=g).to(dtype) for n in lens]
    got = padded_decode_attention(q, keys, values, 0.3)
    for b, n in enumerate(lens):
        want = attention(q[b:b + 1], keys[b], values[b], n - 1, 0, 0.3)[0]
        # float32 inside both; bf16 outputs may differ by one rounding step (2^-8 relative)
        tol = 1e-5 if dtype == torch.float32 else 2**-7
        assert torch.allclose(got[b].float(), want.float(), rtol=tol, atol=tol), b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,heads,kv_heads", [(32, 4, 2), (512, 2, 1)])
def test_paged_kernel_equals_torch_path(dtype, d, heads, kv_heads):
    """The CUDA path (the paged decode kernel over the padded K/V; the Triton interpreter
    here) against the torch path on fp32 inputs (the exact answer): fp32 within 1e-5 of
    max|v| (sums in another order); bf16 within 2^-7 (max|v| + |out|) (tests/test_triton_paged:
    p rounded to bf16 before P.V, the output rounded once). Gemma 4's 512-wide heads too."""
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(d + heads)
    lens = [1, 21, 5]
    q = torch.randn(len(lens), heads, d, generator=g).to(dtype)
    keys = [torch.randn(kv_heads, n, d, generator=g).to(dtype) for n in lens]
    values = [torch.randn(kv_heads, n, d, generator=g).to(dtype) for n in lens]
    got = padded_decode_attention(q, keys, values, 1.0, kernels=True).float()
    want = padded_decode_attention(q.float(), [k.float() for k in keys],
                                   [v.float() for v in values], 1.0, kernels=False)
    vmax = max(float(v.float().abs().max()) for v in values)
    tol = 1e-5 * vmax if dtype == torch.float32 else 2**-7 * (vmax + want.abs())
    assert ((got - want).abs() <= tol).all(), float((got - want).abs().max())
