"""`mlxr.ops.layer.embed_rows` (the quantized embedding's one-launch row gather) against its torch
twin and against `QuantWeight.dequant_rows` (the engine's own rows): bit for bit, on fresh
random words, every width it takes, each group size, bf16 / fp16 scales and outputs (the
interpreter on CPU, the PTX on a GPU)."""

from __future__ import annotations

import zlib

import pytest
import torch

pytest.importorskip("triton")

from mlxr.config import QuantSpec
from mlxr.ops.layer import embed_rows as E
from mlxr.quant import QuantWeight

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def table(key, v: int, k: int, bits: int, group: int, sdt: torch.dtype):
    """Random MLX words [V, K*bits/32] (any int32 is a valid word) with scales and biases of
    the table's dtype, biases of both signs and magnitudes above the scales (rounding at the
    sum matters)."""
    g = torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))
    w = torch.randint(-2**31, 2**31 - 1, (v, k * bits // 32), dtype=torch.int32, generator=g)
    s = (torch.rand(v, k // group, generator=g) * 0.05 + 1e-3).to(sdt)
    b = (torch.randn(v, k // group, generator=g) * 0.3).to(sdt)
    return w, s, b


@pytest.mark.parametrize("bits", E.EMBED_BITS)
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("sdt,dt", [(torch.bfloat16, torch.bfloat16),
                                    (torch.float16, torch.float16),
                                    (torch.float16, torch.bfloat16)])
def test_embed_rows_bit_exact(bits, group, sdt, dt):
    v, k = 37, 384 if group != 128 else 2304  # 2304: more than one 1024-code block, a tail
    w, s, b = table((bits, group, str(sdt), str(dt)), v, k, bits, group, sdt)
    ids = torch.tensor([0, 36, 5, 5, 17, 2])
    assert E.supported(w, s, b, bits, group, dt)
    out = E.embed_rows(w.to(DEV), s.to(DEV), b.to(DEV), ids.to(DEV), bits, group, dt).cpu()
    ref = E.embed_rows_ref(w, s, b, ids, bits, group, dt)
    assert out.dtype == dt and out.shape == (6, k)
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))
    if sdt == dt:  # the engine's rows: QuantWeight.dequant_rows on the CPU
        qw = QuantWeight.from_tensors(w, s, b, QuantSpec("affine", bits, group),
                                      compute_dtype=dt, matmul=False)
        rows = qw.dequant_rows(ids)
        assert torch.equal(ref.view(torch.int16), rows.view(torch.int16))


def test_embed_rows_two_roundings_matter():
    """The twin's R(R(q*s) + b) differs from one fp32 rounding on some entries of this table,
    so the bit-exact test above separates the two orders."""
    w, s, b = table("two", 64, 512, 4, 64, torch.bfloat16)
    ids = torch.arange(64)
    two = E.embed_rows_ref(w, s, b, ids, 4, 64, torch.bfloat16)
    q = E.embed_rows_ref(w, s.float(), b.float(), ids, 4, 64, torch.float32)
    assert not torch.equal(two, q.to(torch.bfloat16))


def test_embed_rows_out_of_range_id_reads_nothing():
    w, s, b = table("oob", 8, 256, 4, 64, torch.bfloat16)
    ids = torch.tensor([3, 8, -1])
    out = E.embed_rows(w.to(DEV), s.to(DEV), b.to(DEV), ids.to(DEV), 4, 64,
                       torch.bfloat16).cpu()
    assert torch.equal(out[0], E.embed_rows_ref(w, s, b, ids[:1], 4, 64, torch.bfloat16)[0])
    assert not out[1:].any()


def test_embed_rows_refuses_what_it_does_not_take():
    w, s, b = table("bad", 8, 256, 4, 64, torch.bfloat16)
    assert not E.supported(w, s, b, 3, 64, torch.bfloat16)  # 3-bit codes straddle words
    assert not E.supported(w, s, None, 4, 64, torch.bfloat16)
    assert not E.supported(w, s.float(), b.float(), 4, 64, torch.bfloat16)  # fp32 scales
    assert not E.supported(w, s, b, 4, 64, torch.float32)  # the exact mode keeps torch's path
    assert not E.supported(w[:, :-1], s, b, 4, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="embed_rows"):
        E.embed_rows(w, s, b, torch.tensor([0]), 4, 32, torch.bfloat16)
