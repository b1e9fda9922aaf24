"""mlxr's compiled CPU kernels (`mlxr.ops.cpu`) against their plain-torch twins on fresh random
data, the torch fallback when the extension is absent, and a tiny mlx-lm model decoded with the
kernels on and off against mlx-lm.

Tolerances (derived): both sides sum float32 terms in different orders, so each is within
gamma_n * T of the exact sum (T = the sum of the terms' magnitudes, gamma_n ~ n * 2^-24 for n
terms in a chain); the kernel's affine path also carries an offset of 128 per code (bf16 code
values 128 + q, the offset's sum taken off per group), which is in T. A bf16 output adds one
rounding on each side: one bf16 ulp (2^-7 of the value at most) between them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mlxr.ops.cpu import native, twins

pytestmark = pytest.mark.skipif(not native.available(), reason="mlxr's CPU kernels not built")

U = 2.0 ** -24
FORMATS = [("affine", 4, 32), ("affine", 4, 64), ("affine", 4, 128), ("affine", 8, 32),
           ("affine", 8, 64), ("affine", 2, 64), ("affine", 3, 32), ("affine", 5, 64),
           ("affine", 6, 128), ("mxfp4", 4, 32), ("nvfp4", 4, 16), ("mxfp8", 8, 32)]


def _weight(mode, bits, group, n, k, g):
    words = torch.randint(-2**31, 2**31 - 1, (n, k * bits // 32), dtype=torch.int32, generator=g)
    if mode == "mxfp8":  # no NaN codes (0x7F / 0xFF)
        b = words.view(torch.uint8)
        b[(b & 0x7F) == 0x7F] = 0x3F
    if mode == "affine":
        s = (torch.rand(n, k // group, generator=g) * 0.02 + 1e-3).to(torch.bfloat16)
        return words, s, (torch.randn(n, k // group, generator=g) * 0.1).to(torch.bfloat16)
    lo, hi = (0, 0x7E) if mode == "nvfp4" else (115, 135)
    return words, torch.randint(lo, hi, (n, k // group), dtype=torch.uint8, generator=g), None


def _bound(x, words, scales, biases, mode, bits, group, gm):
    """gamma_n * T per output [M, N] (see the module docstring), n = K + groups + 8."""
    m, k = x.shape
    n = words.shape[0]
    a = twins.qmm(x.abs(), words, scales.abs() if mode == "affine" else scales,
                  biases.abs() if biases is not None else None, mode, bits, group, gm,
                  torch.float32).abs()
    if mode == "affine":  # the kernel's offset: 128 * |s| * sum|x'| per group (8-bit: x' has
        xs = x.abs().float().view(m, k // group, group).sum(-1)  # x and 16 x per code)
        a = a + 128 * (17 if bits == 8 else 1) * xs @ scales.float().abs().t()
    else:  # fp codes are signed: the twin of |x| with |codes| is not available; bound by max
        a = a + x.abs().float().sum(-1, keepdim=True) * 448 * a.new_ones(1, n)
    return 2 * (k + k // group + 8) * U * a


@pytest.mark.parametrize("mode,bits,group", FORMATS)
@pytest.mark.parametrize("m", [1, 3, 6])
def test_qmm_matches_twin(mode, bits, group, m):
    g = torch.Generator().manual_seed(bits * 1000 + group + m)
    n, k = 40, 256
    words, s, b = _weight(mode, bits, group, n, k, g)
    gm = 0.37 if mode == "nvfp4" else 1.0
    for xdt in (torch.bfloat16, torch.float32):
        x = torch.randn(m, k, generator=g).to(xdt)
        want = twins.qmm(x, words, s, b, mode, bits, group, gm, torch.float32)
        tol = _bound(x, words, s, b, mode, bits, group, gm)
        got = native.qmm(x, words, s, b, mode, bits, group, gm, torch.float32)
        assert ((got - want).abs() <= tol).all(), ((got - want).abs() / tol).max()
        got16 = native.qmm(x, words, s, b, mode, bits, group, gm, torch.bfloat16)
        want16 = want.to(torch.bfloat16).float()
        # two float32 values within tol round to bf16 values at most one ulp (2^-7 |v|) apart
        assert ((got16.float() - want16).abs() <= tol + 2 ** -7 * want16.abs()).all()
    if mode == "affine":  # the bound is tight enough to see a bias off by one scale
        bad = twins.qmm(x, words, s, (b.float() + s.float()).to(torch.bfloat16), mode, bits,
                        group, gm, torch.float32)
        assert not ((got - bad).abs() <= tol).all()


def _int4_copy(n, k, group, g):
    """torch's int4 copy of a random affine 4-bit weight: (packed, sb [K / G, N, 2] (scale,
    bias), sz [K / G, N, 2] (scale, zero): torch's kernel's)."""
    from mlxr.quant import int4pack
    from mlxr.quant.affine import unpack_codes

    words, s, b = _weight("affine", 4, group, n, k, g)
    return (int4pack.pack(unpack_codes(words, 4, k)), int4pack.scales_and_biases(s, b),
            int4pack.scales_and_zeros(s, b))


def _i4_bound(x, sb, group):
    """gamma_n * T (module docstring) for i4mm and its twin, n = K + groups + 8, sb's pairs
    (scale, bias or zero): every term either side forms is at most |x| (31 |s| + |b|) per code
    (s * sum(q x), q <= 15, and b * sum(x) or (z - 8 s) * sum(x); torch's int4 kernel's
    ((q - 8) s + z) x)."""
    m, k = x.shape
    s, b = sb[..., 0].float().abs(), sb[..., 1].float().abs()  # [K / G, N]
    xa = x.float().abs().view(m, k // group, group).sum(-1)  # [M, K / G]
    return 2 * (k + k // group + 8) * U * (xa @ (31 * s + b))


@pytest.mark.skipif(not native.i4mm_serves(64, 64, 64), reason="i4mm not built for this CPU")
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 16])
@pytest.mark.parametrize("pairs", ["zeros", "biases", "tiles"])
def test_i4mm_matches_twin_and_torch(group, m, pairs):
    """i4mm over torch's int4 copy with its zeros, MLX's scales and biases, or the tiles'
    weights (`native.i4mm` `pairs`) against its twin (float32, the bound above), in bf16
    within one rounding more, and against torch's own int4 kernel on the same copy (each
    side's float32 error, a half ulp of bf16 rounding each, and for "biases" torch's zero
    rounded to bf16: |sum(x_g)| |z - (b + 8 s)| per group; "tiles": against x . w for the
    tiles' weights, `native.i4deq`); a bias (zero) off by one scale fails, in the twin and in
    the kernel."""
    from mlxr.quant import int4pack

    g = torch.Generator().manual_seed(group * 100 + m)
    n, k = 192, 512  # three 64-row blocks
    packed, sb, sz = _int4_copy(n, k, group, g)
    sbz = sz if pairs == "zeros" else sb
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    want = twins.i4mm(x, packed, sbz, group, torch.float32, pairs)
    tol = _i4_bound(x, sbz, group)
    got = native.i4mm(x, packed, sbz, group, torch.float32, pairs)
    assert ((got - want).abs() <= tol).all(), ((got - want).abs() / tol).max()
    got16 = native.i4mm(x, packed, sbz, group, torch.bfloat16, pairs).float()
    assert ((got16 - want).abs() <= tol + 2 ** -8 * want.abs()).all()
    if pairs == "tiles":
        s16, b16 = sb[..., 0].t().contiguous(), sb[..., 1].t().contiguous()
        theirs = x.float() @ native.i4deq(packed, s16, b16, group, 0, n).float().t()
        dz = torch.zeros_like(sb[..., 0], dtype=torch.float32)
    else:
        theirs = int4pack.mm(x, packed, group, sz).float()
        s, b = sb[..., 0].double(), sb[..., 1].double()
        dz = (sz[..., 1].double() - (b + 8 * s)).abs().float() * (pairs == "biases")
    xa = x.float().abs().view(m, k // group, group).sum(-1)
    assert ((got16 - theirs).abs() <= 2 * tol + xa @ dz + 2 ** -7 * want.abs()).all()
    bad_pairs = sbz.clone()
    bad_pairs[..., 1] = (sbz[..., 1].float() + sbz[..., 0].float()).to(torch.bfloat16)
    bad = twins.i4mm(x, packed, bad_pairs, group, torch.float32, pairs)
    assert not ((got - bad).abs() <= tol).all()
    bad_got = native.i4mm(x, packed, bad_pairs, group, torch.float32, pairs)
    assert not ((bad_got - want).abs() <= tol).all()


@pytest.mark.skipif(not native.i4mm_serves(64, 64, 64), reason="i4mm not built for this CPU")
def test_i4mm_rows_do_not_depend_on_the_batch():
    """Each row of a 1..16-row call equals that row alone, bit for bit (as torch's int4
    kernel: the engine's batch-equals-single checks rely on it); x spans many binades so
    that another summation order would show."""
    g = torch.Generator().manual_seed(7)
    packed, sb, sz = _int4_copy(128, 1024, 64, g)
    x = (torch.randn(16, 1024, generator=g)
         * torch.exp(3 * torch.randn(16, 1024, generator=g))).to(torch.bfloat16)
    for sbz, pairs in ((sz, "zeros"), (sb, "biases"), (sb, "tiles")):
        alone = torch.cat([native.i4mm(x[i:i + 1], packed, sbz, 64, torch.float32, pairs)
                           for i in range(16)])
        for m in (2, 3, 4, 5, 16):
            got = native.i4mm(x[:m], packed, sbz, 64, torch.float32, pairs)
            assert torch.equal(got, alone[:m]), (m, pairs)


@pytest.mark.skipif(not native.i4mm_serves(64, 64, 64), reason="i4mm not built for this CPU")
@pytest.mark.parametrize("bits", [4, 8, 3])
@pytest.mark.parametrize("pairs", ["zeros", "biases", "tiles"])
def test_affine_weights_take_i4mm(bits, pairs, monkeypatch):
    """An affine weight's `linear` runs i4mm up to I4MM_MAX_M rows of x (over both nibble
    planes for 8-bit: x once per plane), within the bound above plus a bf16 ulp of the twin
    on the int4 copy's zeros or (env MLXR_CPU_I4_PAIRS at load) the planes' own scales and
    biases (`affine.plane_scales`, counted in the weight's bytes; "tiles" only where the
    tiles come from `native.i4deq`, else "zeros"), and above that the tiles
    where mlxr's dequant builds them and `i4_max_m` sends them, else torch's int4 kernel on
    the same copy (the same call as before: equal). With the kernels off at load the weight
    gets none."""
    monkeypatch.setenv("MLXR_CPU_I4_PAIRS", pairs)
    from mlxr.config import QuantSpec
    from mlxr.quant import QuantWeight, cpu, int4pack
    from mlxr.quant.affine import plane_scales

    g = torch.Generator().manual_seed(bits)
    n, k = 128, 256
    words, s, b = _weight("affine", bits, 64, n, k, g)
    qw = QuantWeight.from_tensors(words, s, b, QuantSpec("affine", bits, 64))
    assert isinstance(qw.ckern, native.I4Matmul) and qw.ckern.max_m == cpu.I4MM_MAX_M
    if pairs == "tiles" and not cpu.deq_serves(qw):
        pairs = "zeros"
    sb = qw.i4_sz if pairs == "zeros" else int4pack.scales_and_biases(*plane_scales(s, b, bits))
    assert (qw.ckern.words is not None) == (pairs != "zeros")
    calls = []
    real = qw.ckern.fn
    qw.ckern.fn = lambda *a: calls.append(a[1]) or real(*a)
    for m in (1, cpu.I4MM_MAX_M, cpu.I4MM_MAX_M + 1):
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        xp = x.repeat(1, qw.planes)
        got = qw.linear(x)
        if m > cpu.I4MM_MAX_M:
            tiles = cpu.i4_max_m(qw) <= m
            theirs = int4pack.mm(xp, qw.i4, 64, qw.i4_sz)
            assert torch.equal(got, cpu.tiled_linear(qw, x) if tiles else theirs)
        else:
            want = twins.i4mm(xp, qw.i4, sb, 64, torch.float32, pairs)
            tol = _i4_bound(xp, sb, 64) + 2 ** -7 * want.abs()
            assert ((got.float() - want).abs() <= tol).all()
    assert calls == [1, cpu.I4MM_MAX_M]
    monkeypatch.setenv("MLXR_CPU_KERNELS", "0")
    off = QuantWeight.from_tensors(words, s, b, QuantSpec("affine", bits, 64))
    assert off.ckern is None and off.i4 is not None


@pytest.mark.skipif(not native.i4mm_serves(64, 64, 64), reason="i4mm not built for this CPU")
@pytest.mark.parametrize("n", [160, 208])
def test_split_i4_rows_not_a_multiple_of_64(n, monkeypatch):
    """A 4-bit weight of N % 64 != 0 rows (qwen3_5's DeltaNet in_proj: 8224) takes `SplitI4`:
    its whole 64-row blocks on i4mm, read in place, within i4mm's bound of the twin; the last
    rows on torch's int4 kernel, equal to its call over the whole copy; its own bytes in the
    weight's count. Other pairs modes keep torch's kernel (no ckern)."""
    from mlxr.config import QuantSpec
    from mlxr.quant import QuantWeight, cpu, int4pack

    if not int4pack.head_blocks():
        pytest.skip("this torch lays out N % 64 != 0 copies otherwise")
    g = torch.Generator().manual_seed(n)
    k, n64 = 256, n // 64 * 64
    words, s, b = _weight("affine", 4, 64, n, k, g)
    qw = QuantWeight.from_tensors(words, s, b, QuantSpec("affine", 4, 64))
    assert isinstance(qw.ckern, cpu.SplitI4) and qw.ckern.max_m == cpu.I4MM_MAX_M
    for m in (1, 5, cpu.I4MM_MAX_M):
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        got = qw.linear(x)
        whole = int4pack.mm(x, qw.i4, 64, qw.i4_sz)
        assert torch.equal(got[:, n64:], whole[:, n64:])
        head = qw.i4.reshape(-1)[:n64 * k // 2].view(n64 // 64, k, 32)
        sb = qw.i4_sz[:, :n64].contiguous()
        want = twins.i4mm(x, head, sb, 64, torch.float32, "zeros")
        tol = _i4_bound(x, sb, 64) + 2 ** -7 * want.abs()
        assert ((got[:, :n64].float() - want).abs() <= tol).all()
    monkeypatch.setenv("MLXR_CPU_I4_PAIRS", "biases")
    other = QuantWeight.from_tensors(words, s, b, QuantSpec("affine", 4, 64))
    assert other.ckern is None and other.nbytes + qw.ckern.words.numel() == qw.nbytes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 2)])
@pytest.mark.parametrize("gathered", [False, True])
@pytest.mark.parametrize("d", [32, 128, 256])
def test_attend_matches_twin(dtype, heads, kv_heads, gathered, d):
    """float32 scores / softmax / sum on both sides: the scores within 2 (D + 8) u of
    sum|q k| * scale, the output (a convex combination of V rows) within 2 (S + D + 8) u
    max|V| plus the scores' error times max|V|; bf16 adds one ulp (2^-7 |v|). The
    exponentials (1 ulp on the kernel's vector path) are inside the S term. D 128 / 256 take
    the bf16 vector path (one and two V passes per kv head)."""
    g = torch.Generator().manual_seed(heads * 10 + kv_heads + gathered + d)
    p, length, start = 64, 37, 5
    q = torch.randn(heads, d, generator=g).to(dtype)
    kc = torch.randn(kv_heads, p, d, generator=g).to(dtype)
    vc = torch.randn(kv_heads, p, d, generator=g).to(dtype)
    slots = torch.randperm(p, generator=g)[:length] if gathered else None
    scale = d ** -0.5
    got = native.attend(q, kc, vc, slots, start, length, scale)
    want = twins.attend(q, kc, vc, slots, start, length, scale)
    vmax = vc.float().abs().max()
    score_err = 2 * (d + 8) * U * (q.float().abs().sum(-1).max() * kc.float().abs().max()) * scale
    tol = (2 * (length + d + 8) * U + 2 * score_err) * vmax
    err = (got.float() - want.float()).abs()
    if dtype == torch.bfloat16:
        tol = tol + 2 ** -7 * want.float().abs()
    assert (err <= tol).all(), (err / tol).max()
    short = None if slots is None else slots[:-1]
    wrong = twins.attend(q, kc, vc, short, start, length - 1, scale)  # one position short
    assert not ((got.float() - wrong.float()).abs() <= tol).all()


def _mxfp4_weight(seed: int):
    from mlxr.config import QuantSpec
    from mlxr.quant import QuantWeight

    g = torch.Generator().manual_seed(seed)
    words, scales, _ = _weight("mxfp4", 4, 32, 96, 256, g)
    return QuantWeight.from_tensors(words, scales, None, QuantSpec("mxfp4", 4, 32))


def test_fallback_without_the_extension(monkeypatch):
    """With the extension reported absent, an mxfp4 weight gets no kernel and decodes on
    torch's int4 planes, and the lean step's attention runs the reference; with it, the
    kernel serves a few rows (torch's path above its cutoff) and attention runs the kernel:
    the same values within the bounds above."""
    from test_cpu_decode import _decode, tiny_decoder

    x = torch.randn(20, 256).to(torch.bfloat16)
    with_k = _mxfp4_weight(1)
    assert with_k.ckern is not None and with_k.i4 is not None
    ids = torch.tensor([3, 17, 42, 5, 9, 61, 2, 77])
    got, _ = _decode(tiny_decoder("qwen3"), ids, 3, True, monkeypatch)
    got_x = with_k.linear(x)
    monkeypatch.setattr(native, "_module", lambda: None)
    assert not native.available() and not native.enabled()
    without = _mxfp4_weight(1)
    assert without.ckern is None and without.i4 is not None
    want_x = without.linear(x)
    w = without.dequantize(torch.float32)
    tol = 2 * (256 + 16) * U * (x.float().abs() @ w.abs().t()) + 2 ** -7 * want_x.float().abs()
    assert ((got_x.float() - want_x.float()).abs() <= tol).all()
    want, _ = _decode(tiny_decoder("qwen3"), ids, 3, True, monkeypatch)
    rng = want.max(-1).values - want.min(-1).values
    assert ((got - want).abs().max(-1).values <= 0.05 * rng).all()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_lean_step_takes_the_kernels(monkeypatch):
    """The lean step's attention runs the compiled kernel by default where the layer's
    matmuls run mlxr's kernels (i4mm here), not where they run torch's (weights loaded with
    MLXR_CPU_KERNELS=0: the step stays the reference's bit for bit, greedy output with it);
    MLXR_CPU_ATTEND=0 / 1 force it off / on. The generic loop (reference attention) gives the
    same logits within the bf16 bound."""
    from test_cpu_decode import _decode, tiny_decoder

    monkeypatch.delenv("MLXR_CPU_ATTEND", raising=False)
    dec = tiny_decoder("llama", seed=3)
    monkeypatch.setenv("MLXR_CPU_KERNELS", "0")
    torch_dec = tiny_decoder("llama", seed=3)
    monkeypatch.setenv("MLXR_CPU_KERNELS", "1")
    ids = torch.tensor([3, 17, 42, 5, 9, 61, 2, 77])
    want, _ = _decode(dec, ids, 3, False, monkeypatch)
    calls = {"attend": 0}
    real = native.attend
    monkeypatch.setattr(native, "attend",
                        lambda *a: calls.__setitem__("attend", calls["attend"] + 1) or real(*a))
    per_run = (len(ids) - 3) * len(dec.layers)
    _decode(torch_dec, ids, 3, True, monkeypatch)
    assert calls["attend"] == 0
    got, _ = _decode(dec, ids, 3, True, monkeypatch)
    assert calls["attend"] == per_run
    rng = want.max(-1).values - want.min(-1).values
    assert ((got - want).abs().max(-1).values <= 0.05 * rng).all()
    monkeypatch.setenv("MLXR_CPU_ATTEND", "0")
    _decode(dec, ids, 3, True, monkeypatch)
    assert calls["attend"] == per_run
    monkeypatch.setenv("MLXR_CPU_ATTEND", "1")
    _decode(torch_dec, ids, 3, True, monkeypatch)
    assert calls["attend"] == 2 * per_run


mlx_ref = pytest.importorskip("mlx_ref")


def _decode_logits(path, seq, dtype):
    """mlxr's teacher-forced logits, one token per step (decode: the kernels' row counts)."""
    import mlxr
    from mlxr.engine.kv_cache import new_cache

    model = mlxr.load(path, device="cpu", dtype=dtype)
    dec = model.decoder
    cache = new_cache(dec, len(seq) + 1)
    with torch.inference_mode():
        rows = [dec.forward(torch.tensor(seq[p:p + 1]), cache, last_only=True)
                for p in range(len(seq))]
    return torch.cat(rows).float().numpy(), dec


_models: dict = {}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    def get(quant):
        if quant not in _models:
            path = mlx_ref.make_model(tmp_path_factory.mktemp(quant), "qwen3", quant)
            prompt = mlx_ref.stable_prompt("qwen3", quant, mlx_ref.BASE["vocab_size"])
            _models[quant] = path, mlx_ref.reference(path, prompt)
        return _models[quant]

    return get


@pytest.mark.parametrize("quant", ["q4g64", "mxfp4"])
@pytest.mark.parametrize("kernels", ["1", "0"])
def test_decode_against_mlx_lm(built, quant, kernels, monkeypatch):
    """Decode with the kernels on (the default: attention, and the matmuls: i4mm for q4g64,
    qmm for mxfp4) and off:
    float32 logits within 1e-3 of each position's range of mlx-lm's (the kernels do not serve
    float32: the same path either way), bf16 within test_parity's bar (1.5x mlx-lm's own bf16
    error + 1% of the range), greedy tokens teacher-forced equal to mlx-lm's except at
    near-ties of that bar."""
    monkeypatch.setenv("MLXR_CPU_KERNELS", kernels)
    monkeypatch.setenv("MLXR_CPU_ATTEND", kernels)
    path, ref = built(quant)
    seq = ref.prompt + ref.greedy
    scale = mlx_ref.logit_range(ref.logits32)
    ours32, _ = _decode_logits(path, seq, "float32")
    assert (np.abs(ours32 - ref.logits32).max(-1) / scale).max() <= 1e-3
    ours, dec = _decode_logits(path, seq, "bfloat16")
    assert (dec.layers[0].qkv.weight.ckern is not None) == (kernels == "1")
    err = (np.abs(ours - ref.logits32).max(-1) / scale).max()
    mlx_err = (np.abs(ref.logits_bf16 - ref.logits32).max(-1) / scale).max()
    bar = 1.5 * mlx_err + 0.01
    assert err <= bar, f"bf16 error {err:.3f} vs mlx-lm's {mlx_err:.3f}"
    tie = mlx_ref.top2_margin(ref.logits32) < 2 * bar * scale
    differ = ours.argmax(-1) != ref.logits32.argmax(-1)
    assert not (differ & ~tie).any(), np.where(differ & ~tie)
