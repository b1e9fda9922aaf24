"""The fused layer glue (mlxr.ops.layer.add_norm_qkv_rope: add_rms_norm, qkv_rope_write) vs the
reference compositions, in the CPU interpreter, and the decoder built on them vs the previous
composition.

Tolerances (elementwise; see tests/test_triton_fused.py for the derivations):
* add_rms_norm: s is one fp32 add rounded to the dtype: fp32 exact, bf16 exactly the
  interpreter's truncation of h + r (so within 1 ulp of torch's round-to-nearest). y is checked
  against rms_norm of the kernel's own s, with rms_norm's tolerance.
* qkv_rope_write, fp32: 1e-5 relative to the rotated pair's norm (a rotation preserves it) and
  the value, + 1e-6. bf16: every rounding point before RoPE (norm: y and the product; offset:
  weight + offset, truncated by the interpreter; rope_scale: the scaled value) may land one ulp
  (2^-7 relative) away, which the rotation carries as 2^-7 of the pair's norm; RoPE's own
  output rounding is one ulp of the value. v and every untouched cache slot are bit exact.
* The emulation test replays the reference's rounding points with truncating casts and wants
  most outputs bit-identical (a missing or extra rounding point fails it).
* Decoder, reference ops: the new layer loop runs the same torch ops in the same order as the
  previous one (kept below as `old_logits`), so logits are bit-identical. Fused dispatch
  (interpreter) in fp32: 1e-4 of each position's logit range.
"""

from __future__ import annotations


import pytest
import torch

pytest.importorskip("triton")

from test_triton_fused import check, gen, interp_exact, trunc_bf16

from mlxr import ops
from mlxr.config import ModelConfig, RopeSpec
from mlxr.engine.kv_cache import new_cache
from mlxr.layers import Embedding, Linear
from mlxr.models.decoder import Decoder, Layer
from mlxr.ops import reference as R
from mlxr.ops.layer import norm_rope_act
from mlxr.ops.layer import add_norm_qkv_rope as L

INTERPRETER_ONLY = True  # tests/conftest.py: the interpreter is on without a GPU

DTYPES = (torch.float32, torch.bfloat16)


# ---------------------------------------------------------------------------- add_rms_norm
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("n,e,strided", [(3, 200, False), (1, 1024, False), (5, 48, True)])
def test_add_rms_norm(dtype, offset, n, e, strided):
    g = gen(("add-rms", str(dtype), offset, n, e, strided))
    h = (torch.randn(n, e, generator=g) * 3).to(dtype)
    r = (torch.randn(n, e + 16 if strided else e, generator=g) * 2).to(dtype)[:, :e]
    w = (torch.randn(e, generator=g) * 0.5).to(dtype)
    s, y = L.add_rms_norm(h, r, w, 1e-5, offset)
    s_ref, y_ref = R.add_rms_norm(h, r, w, 1e-5, offset)
    assert s.dtype == s_ref.dtype == dtype and y.dtype == y_ref.dtype
    if dtype == torch.float32:
        assert torch.equal(s, s_ref)
        check(y, y_ref, 1e-5, 1e-6)
    else:
        assert torch.equal(s.float(), trunc_bf16(h.float() + r.float()))
        check(s, s_ref, 2**-7, 0.0)
        check(y, R.rms_norm(s, w, 1e-5, offset), (3 if offset else 2) * 2**-7, 2**-20)


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_add_rms_norm_rounding_points(offset):
    g = gen(("add-rms-exact", offset))
    h = (torch.randn(4, 256, generator=g) * 3).to(torch.bfloat16)
    r = torch.randn(4, 256, generator=g).to(torch.bfloat16)
    w = torch.randn(256, generator=g).to(torch.bfloat16)
    s32 = trunc_bf16(h.float() + r.float())
    y = trunc_bf16(s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + 1e-5))
    w32 = trunc_bf16(w.float() + offset) if offset else w.float()
    interp_exact(L.add_rms_norm(h, r, w, 1e-5, offset)[1], trunc_bf16(y * w32))


# ---------------------------------------------------------------------------- qkv_rope_write
def qkv_case(seed, dtype, n, h, kh, d, r, norm, offset, s=13, one_angle=False):
    g = gen(seed)
    width = (h + 2 * kh) * d
    qkv = (torch.randn(n, width + 24, generator=g) * 2).to(dtype)[:, 5:5 + width]  # strided
    assert qkv.stride(0) == width + 24
    qn = kn = None
    if norm:
        qn = (torch.randn(d, generator=g) * 0.5 + (0 if offset else 1)).to(dtype)
        kn = (torch.randn(d, generator=g) * 0.5 + (0 if offset else 1)).to(dtype)
    ang = torch.rand(1 if one_angle else n, r, generator=g) * 50
    kc = torch.randn(kh, s, d, generator=g).to(dtype)
    vc = torch.randn(kh, s, d, generator=g).to(dtype)
    slots = torch.randperm(s, generator=g)[:n]
    return qkv, qn, kn, ang.cos(), ang.sin(), kc, vc, slots


def run_both(case, h, kh, d, offset, scale, trad):
    qkv, qn, kn, cos, sin, kc, vc, slots = case
    kc_f, vc_f, kc_r, vc_r = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    args = (h, kh, d, qn, kn, 1e-6, offset, scale, cos, sin, trad)
    q_f = L.qkv_rope_write(qkv, *args, kc_f, vc_f, slots)
    q_r = R.qkv_rope_write(qkv, *args, kc_r, vc_r, slots)
    return q_f, kc_f, vc_f, q_r, kc_r, vc_r


def pair_norm(x: torch.Tensor, r: int, trad: bool) -> torch.Tensor:
    """Per element of x [..., D]: the norm of its rotated pair (the tail: its own |value|)."""
    x = x.float()
    lo, hi = (x[..., 0:2 * r:2], x[..., 1:2 * r:2]) if trad else (x[..., :r], x[..., r:2 * r])
    pn = (lo * lo + hi * hi).sqrt()
    pairs = torch.stack((pn, pn), -1).flatten(-2) if trad else torch.cat((pn, pn), -1)
    return torch.cat((pairs, x[..., 2 * r:].abs()), -1)


def check_rope_out(out, ref, r, trad, n_pre):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    o, e = out.float(), ref.float()
    assert torch.isfinite(o).all()
    pn = pair_norm(ref, r, trad)
    if ref.dtype == torch.float32:
        tol = 1e-5 * (pn + e.abs()) + 1e-6
    else:
        tol = 2**-7 * (n_pre * pn + e.abs()) + 2**-20
    bad = (o - e).abs() > tol
    assert not bad.any(), f"{int(bad.sum())} / {bad.numel()}; max err {(o - e).abs().max():.3g}"


SHAPES = [(1, 4, 4, 32, 16), (3, 6, 2, 48, 12), (2, 4, 1, 80, 20)]  # N, H, K, D, R


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm,offset", [(False, 0.0), (True, 0.0), (True, 1.0)])
@pytest.mark.parametrize("scale", [1.0, 1.25])
@pytest.mark.parametrize("trad", [False, True])
@pytest.mark.parametrize("n,h,kh,d,r", SHAPES)
def test_qkv_rope_write(dtype, norm, offset, scale, trad, n, h, kh, d, r):
    """MHA / GQA, full / partial rotary, strided qkv, random slots; untouched slots stay."""
    seed = ("qkv", str(dtype), norm, offset, scale, trad, n, h, kh, d, r)
    case = qkv_case(seed, dtype, n, h, kh, d, r, norm, offset)
    slots = case[-1]
    q_f, kc_f, vc_f, q_r, kc_r, vc_r = run_both(case, h, kh, d, offset, scale, trad)
    n_pre = (2 + (offset != 0)) * norm + (scale != 1.0)
    check_rope_out(q_f, q_r, r, trad, n_pre)
    k_f, k_r = kc_f[:, slots].transpose(0, 1), kc_r[:, slots].transpose(0, 1)
    check_rope_out(k_f, k_r, r, trad, n_pre)
    assert torch.equal(vc_f, vc_r)
    kept = torch.ones(kc_f.shape[1], dtype=torch.bool)
    kept[slots] = False
    assert torch.equal(kc_f[:, kept], case[5][:, kept])
    assert torch.equal(vc_f[:, kept], case[6][:, kept])
    if not norm and scale == 1.0:  # the unrotated tail is copied bit for bit
        assert torch.equal(q_f[..., 2 * r:], q_r[..., 2 * r:])


def test_qkv_rope_write_one_angle_row():
    """cos/sin [1, R] (the graph step's gathered row) broadcast over the tokens."""
    case = qkv_case("one-angle", torch.float32, 3, 4, 2, 32, 16, True, 0.0, one_angle=True)
    q_f, kc_f, _, q_r, kc_r, _ = run_both(case, 4, 2, 32, 0.0, 1.0, False)
    check_rope_out(q_f, q_r, 16, False, 0)
    check_rope_out(kc_f, kc_r, 16, False, 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qkv_rope_write_positions_index_the_tables(dtype):
    """cos / sin as whole tables [P, R] and `positions` [N]: the same q and cache bits as the
    rows gathered first (kernel and reference), and as the reference on those rows."""
    n, h, kh, d, r, p = 3, 4, 2, 48, 16, 40
    qkv, qn, kn, _, _, kc, vc, slots = qkv_case(("pos", str(dtype)), dtype, n, h, kh, d, r,
                                                True, 0.0)
    ang = torch.rand(p, r, generator=gen(("pos-ang", str(dtype)))) * 50
    cos, sin = ang.cos(), ang.sin()
    pos = torch.tensor([37, 2, 19])
    args = (h, kh, d, qn, kn, 1e-6, 0.0, 1.25)
    outs = []
    for op, tables in ((L.qkv_rope_write, True), (L.qkv_rope_write, False),
                       (R.qkv_rope_write, True)):
        k2, v2 = kc.clone(), vc.clone()
        if tables:
            q = op(qkv, *args, cos, sin, False, k2, v2, slots, pos)
        else:
            q = op(qkv, *args, cos[pos], sin[pos], False, k2, v2, slots)
        outs.append((q, k2, v2))
    for a, b in zip(outs[0], outs[1]):
        assert torch.equal(a, b)
    check_rope_out(outs[0][0], outs[2][0], r, False, 3)
    assert torch.equal(outs[0][2], outs[2][2])


@pytest.mark.parametrize("trad", [False, True])
def test_qkv_rope_write_rounding_points(trad):
    """bf16, norm with offset, pre-scale, partial rotary: the reference's rounding points
    replayed with the interpreter's truncating cast."""
    n, h, kh, d, r, offset, scale = 3, 4, 2, 48, 16, 1.0, 1.25
    qkv, qn, kn, cos, sin, kc, vc, slots = qkv_case(("qkv-exact", trad), torch.bfloat16, n, h,
                                                    kh, d, r, True, offset)
    q = L.qkv_rope_write(qkv, h, kh, d, qn, kn, 1e-6, offset, scale, cos, sin, trad, kc, vc,
                         slots)

    def emulate(x, w):  # x [N, heads, D] bf16
        x32 = x.float()
        y = trunc_bf16(x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6))
        y = trunc_bf16(y * trunc_bf16(w.float() + offset))
        y = torch.cat((trunc_bf16(y[..., :2 * r] * scale), y[..., 2 * r:]), -1)
        return trunc_bf16(R.rope(y, cos, sin, trad).float())  # fp32 in: no rounding inside

    q_in, k_in, _ = qkv.reshape(n, h + 2 * kh, d).split([h, kh, kh], 1)
    interp_exact(q, emulate(q_in, qn))
    interp_exact(kc[:, slots].transpose(0, 1), emulate(k_in, kn))


# ---------------------------------------------------------------------------- decoder
def tiny_decoder(kind: str, dtype: torch.dtype) -> Decoder:
    """Random float weights. llama: plain GQA; qwen3: q/k norms; gemma3: norm offset, sandwich
    norms, embedding scale, yarn pre-scale, partial interleaved rotary, a sliding layer,
    softcaps, fp16 residual clipping, tied head."""
    g = gen(("decoder", kind))
    e, h, kh, d, f, v, n_layers = 64, 4, 2, 16, 96, 50, 2
    gemma = kind == "gemma3"
    spec = RopeSpec(d // 2 if gemma else d, 10000.0, traditional=gemma,
                    scaling={"rope_type": "yarn", "factor": 4.0,
                             "original_max_position_embeddings": 32} if gemma else None,
                    max_position_embeddings=128)
    c = ModelConfig(
        model_type=kind, vocab_size=v, hidden_size=e, num_layers=n_layers, num_heads=h,
        num_kv_heads=kh, head_dim=d, intermediate_size=f, rms_norm_eps=1e-6,
        max_position_embeddings=128, tie_word_embeddings=gemma, qk_norm=kind != "llama",
        norm_offset=1.0 if gemma else 0.0, embed_scale=e ** 0.5 if gemma else None,
        hidden_act="gelu_tanh" if gemma else "silu", sandwich_norm=gemma, attn_scale=d ** -0.5,
        attn_logit_softcap=20.0 if gemma else None, final_logit_softcap=15.0 if gemma else None,
        clip_residual_fp16=gemma, layer_rope=(spec,) * n_layers,
        layer_window=(None, 5) if gemma else (None,) * n_layers)

    def mat(rows, cols):
        return Linear((torch.randn(rows, cols, generator=g) * cols ** -0.5).to(dtype))

    def norm(size):
        return (torch.randn(size, generator=g) * 0.2 + (0.0 if gemma else 1.0)).to(dtype)

    layers = [Layer(norm(e), mat((h + 2 * kh) * d, e), mat(e, h * d), norm(e), mat(2 * f, e),
                    mat(e, f), norm(d) if c.qk_norm else None, norm(d) if c.qk_norm else None,
                    norm(e) if gemma else None, norm(e) if gemma else None)
              for _ in range(n_layers)]
    embed = Embedding((torch.randn(v, e, generator=g) * (0.1 if gemma else 1.0)).to(dtype))
    return Decoder(c, embed, layers, norm(e), None if gemma else mat(v, e), dtype,
                   torch.device("cpu"))


def old_logits(dec: Decoder, ids: torch.Tensor, last_only: bool = False) -> torch.Tensor:
    """The layer loop as it was before the fused ops (reference ops, one sequence from
    position 0, KV written by slice into a fresh cache): the oracle."""
    c, n = dec.config, ids.shape[0]
    pool = new_cache(dec, 64).pool
    h = dec.embed(ids)
    if dec._embed_scale is not None:
        h = h * dec._embed_scale
    eps, off = c.rms_norm_eps, c.norm_offset

    def residual(h, r):
        if c.clip_residual_fp16 and h.dtype == torch.float16:
            bound = torch.finfo(torch.float16).max
            return (h.float() + r.float()).clamp(-bound, bound).half()
        return h + r

    for i, layer in enumerate(dec.layers):
        rope = dec.ropes[i]
        cos, sin = rope.cos_sin(0, n)
        x = R.rms_norm(h, layer.input_norm, eps, off)
        q, k, v = layer.qkv(x).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.reshape(n, c.num_heads, c.head_dim)
        k = k.reshape(n, c.num_kv_heads, c.head_dim)
        v = v.reshape(n, c.num_kv_heads, c.head_dim)
        if layer.q_norm is not None:
            q = R.rms_norm(q, layer.q_norm, eps, off)
            k = R.rms_norm(k, layer.k_norm, eps, off)
        if rope.scale != 1.0:
            r = rope.spec.dims
            q = torch.cat((q[..., :r] * rope.scale, q[..., r:]), dim=-1)
            k = torch.cat((k[..., :r] * rope.scale, k[..., r:]), dim=-1)
        q = R.rope(q, cos, sin, rope.spec.traditional)
        k = R.rope(k, cos, sin, rope.spec.traditional)
        kc, vc = pool.k[i], pool.v[i]
        kc[:, :n] = k.transpose(0, 1)
        vc[:, :n] = v.transpose(0, 1)
        a = R.attention(q, kc[:, :n], vc[:, :n], 0, 0, c.attn_scale, c.layer_window[i],
                        c.attn_logit_softcap)
        o = layer.o_proj(a.reshape(n, c.q_size))
        if layer.post_attn_norm is not None:
            o = R.rms_norm(o, layer.post_attn_norm, eps, off)
        h = residual(h, o)
        x = R.rms_norm(h, layer.mlp_norm, eps, off)
        gate, up = layer.gate_up(x).split(c.intermediate_size, dim=-1)
        m = layer.down_proj(R.gated_act(gate, up, c.hidden_act))
        if layer.post_mlp_norm is not None:
            m = R.rms_norm(m, layer.post_mlp_norm, eps, off)
        h = residual(h, m)
    if last_only:
        h = h.index_select(0, torch.tensor([n - 1]))
    h = R.rms_norm(h, dec.norm, eps, off)
    logits = (dec.lm_head(h) if dec.lm_head is not None else dec.embed.as_linear(h)).float()
    if c.final_logit_softcap is not None:
        logits = torch.tanh(logits / c.final_logit_softcap) * c.final_logit_softcap
    return logits


IDS = torch.tensor([3, 17, 42, 5, 9, 31, 0, 22, 48, 11, 7, 29])


@pytest.mark.parametrize("kind,dtype", [("llama", torch.float32), ("llama", torch.bfloat16),
                                        ("qwen3", torch.float32), ("qwen3", torch.bfloat16),
                                        ("gemma3", torch.float32), ("gemma3", torch.bfloat16),
                                        ("gemma3", torch.float16)])
def test_decoder_reference_path_is_bit_identical(kind, dtype):
    dec = tiny_decoder(kind, dtype)
    want = old_logits(dec, IDS)
    assert torch.isfinite(want).all() and want.std() > 0.01
    with torch.inference_mode():
        got = dec.forward(IDS, new_cache(dec, 64))
        last = dec.forward(IDS, new_cache(dec, 64), last_only=True)  # rows: fused final add
    assert torch.equal(got, want)
    assert torch.equal(last, old_logits(dec, IDS, last_only=True))


@pytest.mark.parametrize("kind", ["llama", "qwen3", "gemma3"])
def test_decoder_fused_dispatch(kind, monkeypatch):
    """Every op through the Triton kernels (interpreter): a prefill through `forward`, then
    graph-style decode steps through `forward_static`, vs the old composition."""
    dec = tiny_decoder(kind, torch.float32)
    want = old_logits(dec, IDS)
    monkeypatch.setattr(ops, "_fast", lambda x: True)
    monkeypatch.setattr(ops, "_fused", norm_rope_act)
    cap, p0 = 16, 8
    cache = new_cache(dec, cap)
    tables = {id(rope.spec): rope.cos_sin(0, cap) for rope in dec.ropes}
    with torch.inference_mode():
        got = [dec.forward(IDS[:p0], cache)]
        for p in range(p0, len(IDS)):
            got.append(dec.forward_static(IDS[p:p + 1], torch.tensor([p]), cache.pool, tables))
    got = torch.cat(got)
    tol = 1e-4 * (want.amax(-1) - want.amin(-1))[:, None]
    assert ((got - want).abs() <= tol).all(), float((got - want).abs().max())
