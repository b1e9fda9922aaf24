"""mlxr's compiled dequant of torch's int4 copy (`native.i4deq`, the CPU tiles' source) against
its plain-torch twin and against `QuantWeight.dequant_rows`: bit for bit (the same two bf16
operations per weight, bf16(bf16(q * s) + b)), so the bound is exact equality; one group's
scale doubled, its zero point off by one code (b + s), or all codes shifted by one must not
compare equal."""

from __future__ import annotations

import pytest
import torch

from mlxr.ops.cpu import native, twins
from mlxr.quant import int4pack

pytestmark = pytest.mark.skipif(
    not native.i4deq_serves(torch.ones(1, dtype=torch.bfloat16),
                            torch.ones(1, dtype=torch.bfloat16), 64, torch.bfloat16),
    reason="i4deq not built for this CPU / torch packing")


def _weight(n, k, group, g):
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    s = (torch.rand(n, k // group, generator=g) * 0.02 + 1e-3).to(torch.bfloat16)
    s[0, 0] = -s[0, 0]  # a negative scale; scales over several binades below
    s = s * torch.exp2(torch.randint(-6, 7, s.shape, generator=g)).to(torch.bfloat16)
    b = (torch.randn(n, k // group, generator=g) * 0.1).to(torch.bfloat16)
    return codes, s, b


def _mlx(codes, s, b, group):
    """MLX's affine dequant in bf16, as `QuantWeight.dequant_rows` evaluates it."""
    n, k = codes.shape
    w = codes.to(torch.bfloat16).view(n, k // group, group) * s.unsqueeze(-1)
    return w.add_(b.unsqueeze(-1)).view(n, k)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [(0, 192), (64, 128), (128, 192)])
def test_i4deq_matches_twin_and_mlx(group, rows):
    g = torch.Generator().manual_seed(group + rows[0])
    codes, s, b = _weight(192, 512, group, g)
    packed = int4pack.pack(codes)
    r0, r1 = rows
    got = native.i4deq(packed, s, b, group, r0, r1)
    want = _mlx(codes, s, b, group)[r0:r1]
    assert torch.equal(twins.i4deq(packed, s, b, group, r0, r1), want)
    assert torch.equal(got, want)
    bad_s = s.clone()
    bad_s[r0, 1] *= 2
    assert not torch.equal(native.i4deq(packed, bad_s, b, group, r0, r1), want)
    bad_b = b.clone()
    bad_b[r1 - 1, -1] += s[r1 - 1, -1]
    assert not torch.equal(native.i4deq(packed, s, bad_b, group, r0, r1), want)
    shifted = int4pack.pack((codes + 1) & 15)
    assert not torch.equal(native.i4deq(shifted, s, b, group, r0, r1), want)


@pytest.mark.parametrize("n,m,bits", [(192, 40, 4), (320, 200, 4), (192, 24, 3)])
def test_tiles_take_i4deq(n, m, bits, monkeypatch):
    """`quant.cpu.tiled_linear` of a 4-bit (3-bit: the codes as nibbles) bf16 weight builds
    its tiles with i4deq (the
    torch-built tiles' values: the same output bit for bit), also across several tiles and a
    row range not on 64-row blocks, and `linear` takes them above I4MM_MAX_M rows with
    `MLXR_CPU_DEQ_ROWS=1` (from I4_MAX_M rows by default);
    `MLXR_CPU_DEQ=0` or the kernels off keeps torch's."""
    from mlxr.config import QuantSpec
    from mlxr.quant import QuantWeight, cpu

    g = torch.Generator().manual_seed(n)
    k = 1024
    words = torch.randint(-2**31, 2**31 - 1, (n, k * bits // 32), dtype=torch.int32,
                          generator=g)
    s = (torch.rand(n, k // 64, generator=g) * 0.02 + 1e-3).to(torch.bfloat16)
    b = (torch.randn(n, k // 64, generator=g) * 0.1).to(torch.bfloat16)
    qw = QuantWeight.from_tensors(words, s, b, QuantSpec("affine", bits, 64))
    assert qw.i4 is not None and cpu.deq_serves(qw) and cpu.i4_max_m(qw) == cpu.I4_MAX_M[1]
    qw.tiles_early = True  # a weight repacked from ONNX: the tiles from 17 rows by default
    assert cpu.i4_max_m(qw) == cpu.I4_MAX_M_DEQ
    monkeypatch.setenv("MLXR_CPU_DEQ_ROWS", "0")
    assert cpu.i4_max_m(qw) == cpu.I4_MAX_M[1]
    qw.tiles_early = False
    monkeypatch.setenv("MLXR_CPU_DEQ_ROWS", "1")  # the tiles from 17 rows (opt-in)
    assert cpu.i4_max_m(qw) == cpu.I4_MAX_M_DEQ
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    calls = []
    real = native.i4deq
    monkeypatch.setattr(native, "i4deq", lambda *a: calls.append(a[-2:]) or real(*a))
    monkeypatch.setattr(cpu, "SMALL_BYTES", 0)  # several tiles
    monkeypatch.setattr(qw, "tile_rows", lambda *a: 96)  # tiles cut inside 64-row blocks
    got = cpu.tiled_linear(qw, x)
    assert calls and calls[0] == (0, 128)
    assert torch.equal(qw.linear(x), got)  # more than I4MM_MAX_M rows: the tiles
    monkeypatch.setenv("MLXR_CPU_DEQ", "0")
    assert not cpu.deq_serves(qw)
    assert torch.equal(got, cpu.tiled_linear(qw, x))
    assert cpu.i4_max_m(qw) == cpu.I4_MAX_M[1]
    monkeypatch.setenv("MLXR_CPU_DEQ", "1")
    monkeypatch.setenv("MLXR_CPU_KERNELS", "0")
    assert not cpu.deq_serves(qw)
