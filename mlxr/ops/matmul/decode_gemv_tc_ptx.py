"""The per-lane PTX of `decode_gemv_tc` (mma.sync chains, masked lane loads) as Triton functions,
each with its interpreter twin (TRITON_INTERPRET runs no PTX): the twins compute what the
warp's lanes compute together, so CI checks the kernel around them at the same semantics.
"""

from __future__ import annotations

from ..layer.norm_rope_act import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

# The PTX works on per-lane tensors (pack 1): element u of a [RT, WT/4] or [WT/4] tensor is
# lane u % 32 of warp u // 32 % num_warps, which is how Triton lays such tensors out (the word
# tile is loaded 16 bytes per thread as [RT, WT] and split into its 4 steps in registers).
# A pack of 4 elements would depend on which elements Triton puts in one thread, and Triton
# may lay a pure op out twice (seen: the x loads, in [1, 4] and [1, 1] layouts).
#
# _MMA4: one lane's mma chain over a block's 4 steps: $0-3 out (the D fragment: rows g, g + 8
# x columns 2tig, 2tig + 1), $4-7 the words of steps 0-3, $8-11 the masked x (b0 | b1 << 32),
# $12-15 C.
_STEP = """
shr.u32 t0, {w}, 4;
shr.u32 t1, {w}, 8;
shr.u32 t2, {w}, 12;
lop3.b32 a0, {w}, 0x000F000F, {magic}, 0xEA;
lop3.b32 a1, t0, 0x000F000F, {magic}, 0xEA;
lop3.b32 a2, t1, 0x000F000F, {magic}, 0xEA;
lop3.b32 a3, t2, 0x000F000F, {magic}, 0xEA;
mov.b64 {{b0, b1}}, {x};
mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32
  {{$0, $1, $2, $3}}, {{a0, a1, a2, a3}}, {{b0, b1}}, {{$0, $1, $2, $3}};
"""
# The same chain over E2M1 codes (`decode_gemv_tc_layout.fp4_bits`, bf16 only): register i's two
# values x 2^-126 by masks and shifts, then one bf16x2 multiply by 2^126 (exact, also for the
# subnormal +-0.5 codes; an fma with -0 addend, which sm_80 has too; its operands must be
# registers: k126 = (2^126, 2^126), nz = (-0, -0))
_STEP_FP4 = """
shl.b32 t0, {w}, 3;
shl.b32 t1, {w}, 6;
shl.b32 t2, {w}, 1;
shr.u32 t3, {w}, 3;
shr.u32 t4, {w}, 7;
and.b32 a0, {w}, 0x81C081C0;
and.b32 a1, t0, 0x81C081C0;
and.b32 a2, t1, 0x81C081C0;
and.b32 a3, t2, 0x80008000;
lop3.b32 a3, t3, 0x01800180, a3, 0xEA;
lop3.b32 a3, t4, 0x00400040, a3, 0xEA;
fma.rn.bf16x2 a0, a0, k126, nz;
fma.rn.bf16x2 a1, a1, k126, nz;
fma.rn.bf16x2 a2, a2, k126, nz;
fma.rn.bf16x2 a3, a3, k126, nz;
mov.b64 {{b0, b1}}, {x};
mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32
  {{$0, $1, $2, $3}}, {{a0, a1, a2, a3}}, {{b0, b1}}, {{$0, $1, $2, $3}};
"""
# The same chain over E4M3 codes (`decode_gemv_tc_layout.fp8_words`, bf16 only): a step's 8 codes
# are in two words, {w} (registers 0, 1) and {v} (registers 2, 3); registers 0 and 2 by one
# AND, 1 and 3 by two shifted pieces; the values x 2^-120, so one bf16x2 multiply by 2^120
# (k120) makes them exact (subnormals too)
_STEP_FP8 = """
shr.u32 t0, {w}, 4;
shl.b32 t1, {w}, 4;
shr.u32 t2, {v}, 4;
shl.b32 t3, {v}, 4;
and.b32 a0, {w}, 0x87F087F0;
and.b32 t0, t0, 0x07000700;
lop3.b32 a1, t1, 0x80F080F0, t0, 0xEA;
and.b32 a2, {v}, 0x87F087F0;
and.b32 t2, t2, 0x07000700;
lop3.b32 a3, t3, 0x80F080F0, t2, 0xEA;
fma.rn.bf16x2 a0, a0, k120, nz;
fma.rn.bf16x2 a1, a1, k120, nz;
fma.rn.bf16x2 a2, a2, k120, nz;
fma.rn.bf16x2 a3, a3, k120, nz;
mov.b64 {{b0, b1}}, {x};
mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32
  {{$0, $1, $2, $3}}, {{a0, a1, a2, a3}}, {{b0, b1}}, {{$0, $1, $2, $3}};
"""
# _ONES4: the column sums of the masked x over the 4 steps (A = 1): $0-1 out (columns 2tig,
# 2tig + 1), $2-5 x, $6-7 C.
_ONES = """
mov.b64 {{b0, b1}}, ${x};
mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32
  {{$0, $1, z2, z3}}, {{a0, a0, a0, a0}}, {{b0, b1}}, {{$0, $1, z2, z3}};
"""


def _asm_chain(regs: str, consts: dict[str, str], c: int, body: str) -> str:
    """An mma chain's asm block: its .b32 registers, constants moved into registers (mma and
    fma operands must be registers), the accumulators $0-3 set from C at $c.."""
    return ("{\n.reg .b32 " + regs + ";\n"
            + "".join(f"mov.b32 {r}, {v};\n" for r, v in consts.items())
            + "".join(f"mov.f32 ${i}, ${c + i};\n" for i in range(4)) + body + "}")


def _asm_mma4(ty: str) -> str:
    magic = "0x43004300" if ty == "bf16" else "0x64006400"
    body = "".join(_STEP.format(w=f"${4 + s}", x=f"${8 + s}", magic=magic, ty=ty)
                   for s in range(4))
    return _asm_chain("t0, t1, t2, a0, a1, a2, a3, b0, b1", {}, 12, body)


def _asm_mma4_fp4() -> str:
    body = "".join(_STEP_FP4.format(w=f"${4 + s}", x=f"${8 + s}") for s in range(4))
    return _asm_chain("t0, t1, t2, t3, t4, a0, a1, a2, a3, b0, b1, k126, nz",
                      {"k126": "0x7E807E80", "nz": "0x80008000"}, 12, body)


def _asm_mma4_fp8() -> str:
    """$0-3 out, $4-7 the first-half words of steps 0-3, $8-11 the second half's, $12-15 x,
    $16-19 C."""
    body = "".join(_STEP_FP8.format(w=f"${4 + s}", v=f"${8 + s}", x=f"${12 + s}")
                   for s in range(4))
    return _asm_chain("t0, t1, t2, t3, a0, a1, a2, a3, b0, b1, k120, nz",
                      {"k120": "0x7B807B80", "nz": "0x80008000"}, 16, body)


def _asm_ones4(ty: str) -> str:
    one = "0x3F803F80" if ty == "bf16" else "0x3C003C00"
    body = "".join(_ONES.format(x=2 + s, ty=ty) for s in range(4))
    return ("{\n.reg .b32 a0, b0, b1;\n.reg .f32 z2, z3;\nmov.b32 a0, %s;\n" % one
            + "mov.f32 $0, $6;\nmov.f32 $1, $7;\nmov.f32 z2, 0f00000000;\nmov.f32 z3, 0f00000000;\n"
            + body + "}")


# a lane's x: 16 bytes at $4 (steps 0, 1) where $6 is set and 16 bytes at $5 (steps 2, 3)
# where $7 is set; zeros elsewhere. {nc}: the read-only path, or `.cg` where x may be written
# by a grid still running when this one starts (PDL)
_LDX = """{{
.reg .pred p, q;
setp.ne.b32 p, $6, 0;
setp.ne.b32 q, $7, 0;
mov.b64 $0, 0;
mov.b64 $1, 0;
mov.b64 $2, 0;
mov.b64 $3, 0;
@p ld.global.{nc}.v2.b64 {{$0, $1}}, [$4];
@q ld.global.{nc}.v2.b64 {{$2, $3}}, [$5];
}}"""
# one 32-bit (scale, bias) pair at $1 where $2 is set, else 0
_LD32 = """{
.reg .pred p;
setp.ne.b32 p, $2, 0;
mov.b32 $0, 0;
@p ld.global.nc.b32 $0, [$1];
}"""

if HAVE_TRITON:
    # the PTX as constexpr globals (a jit function reads no other globals)
    MMA4_BF16 = tl.constexpr(_asm_mma4("bf16"))
    MMA4_F16 = tl.constexpr(_asm_mma4("f16"))
    MMA4_FP4 = tl.constexpr(_asm_mma4_fp4())
    MMA4_FP8 = tl.constexpr(_asm_mma4_fp8())
    ONES4_BF16 = tl.constexpr(_asm_ones4("bf16"))
    ONES4_F16 = tl.constexpr(_asm_ones4("f16"))
    LDX = tl.constexpr(_LDX.format(nc="nc"))
    LDX_CG = tl.constexpr(_LDX.format(nc="cg"))
    LD32 = tl.constexpr(_LD32)

    @triton.jit
    def _join4(a0, a1, a2, a3):
        """[..., n] x 4 -> [..., n, 4] (interpreter only)."""
        return tl.join(tl.join(a0, a2), tl.join(a1, a3)).reshape(a0.shape + [4])

    @triton.jit
    def _split4(t, NU: tl.constexpr):
        """[..., 4 NU] -> its elements 4u + s for s = 0..3, each [..., NU] (in registers: a
        thread holds 4 consecutive elements)."""
        a, b = tl.split(tl.reshape(t, t.shape[:-1] + [NU, 2, 2]))
        a0, a2 = tl.split(a)
        a1, a3 = tl.split(b)
        return a0, a1, a2, a3

    @triton.jit
    def _half(v, sh: tl.constexpr, F16: tl.constexpr):
        """The 16-bit float at bits [sh, sh + 16) of int64 v, as fp32 (interpreter only)."""
        bits = ((v >> sh) & 0xFFFF).to(tl.int32)
        if F16:
            return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return (bits << 16).to(tl.float32, bitcast=True)

    @triton.jit
    def _emu_bx(xm, NS: tl.constexpr, F16: tl.constexpr):
        """Masked x [WT] int64 (lane t = 4 col + tig, step (sh, sl); b0 | b1 << 32, each two
        16-bit values) -> B [NS, 8 (col), 64] in the k order (tig, sh, sl, m, hi)."""
        v = tl.reshape(xm, [NS, 8, 4, 2, 2])
        m0 = tl.join(_half(v, 0, F16), _half(v, 16, F16))  # [.., hi]
        m1 = tl.join(_half(v, 32, F16), _half(v, 48, F16))
        b = tl.permute(tl.join(m0, m1), [0, 1, 2, 3, 4, 6, 5])  # [.., m, hi]
        return tl.reshape(b, [NS, 8, 64])

    @triton.jit
    def _fp4_values(w):
        """Interpreter: the 8 E2M1 values of each word of an fp4 copy (`fp4_bits`) [..., 8] in
        nibble order (register i's value hi at i + 4 hi), as the PTX extracts them."""
        j = tl.arange(0, 8)
        i = (j % 4)[None, None, :]
        w3 = w[:, :, None]
        m = -2118090304  # 0x81C081C0 as int32 (and below 0x80008000), so the math stays int32
        r3 = (((w3 << 1) & -2147450880) | ((w3 >> 3) & 0x01800180)
              | ((w3 >> 7) & 0x00400040))
        r = tl.where(i == 0, w3 & m, tl.where(i == 1, (w3 << 3) & m,
                                              tl.where(i == 2, (w3 << 6) & m, r3)))
        h = (r >> (16 * (j // 4))[None, None, :]) & 0xFFFF
        return (h << 16).to(tl.float32, bitcast=True) * 8.507059173023462e37  # 2^126

    @triton.jit
    def _fp8_values(w, v):
        """Interpreter: the 8 E4M3 values of each step of an fp8 copy (`fp8_words`: words w of
        the first half, v of the second, [..., n]) [..., n, 8] in nibble order (register i's
        value hi at i + 4 hi), as the PTX extracts them."""
        j = tl.arange(0, 8)
        i = (j % 4)[None, None, :]
        w3 = w[:, :, None]
        v3 = v[:, :, None]
        m = -2014279696  # 0x87F087F0 as int32 (and 0x80F080F0 below), so the math stays int32
        u = tl.where(i < 2, w3, v3)
        b = ((u >> 4) & 0x07000700) | ((u << 4) & -2131722000)
        r = tl.where(i % 2 == 0, u & m, b)
        h = (r >> (16 * (j // 4))[None, None, :]) & 0xFFFF
        return (h << 16).to(tl.float32, bitcast=True) * 1.329227995784916e36  # 2^120

    @triton.jit
    def _emu_mma(q, x0, x1, x2, x3, c0, c1, c2, c3, RT: tl.constexpr, NU: tl.constexpr,
                 F16: tl.constexpr):
        """Interpreter: c + the 4-step mma chain of the fragment values q [RT, 4NU, 8] (a
        step's word's nibble order) and masked x [NU] per step."""
        NS: tl.constexpr = NU // 32
        # [RT, NS, g, tig, sh, sl, hi, m, h] -> [RT, NS, g, h, (tig, sh, sl, m, hi)]
        q = tl.reshape(q, [RT, NS, 8, 4, 2, 2, 2, 2, 2])
        q = tl.permute(q, [0, 1, 2, 8, 3, 4, 5, 7, 6])
        a = tl.reshape(q, [RT, NS, 8, 2, 1, 64])
        b = _emu_bx(tl.reshape(_join4(x0, x1, x2, x3), [4 * NU]), NS, F16)
        d = tl.sum(a * b[None, :, None, None, :, :], axis=5)  # [RT, NS, g, h, col]
        d = tl.reshape(d, [RT, NS, 8, 2, 4, 2])  # col = 2tig + e2
        d = tl.permute(d, [0, 1, 2, 4, 3, 5])  # [RT, NS, g, tig, h, e2]
        d0, d1, d2, d3 = _split4(tl.reshape(d, [RT, 4 * NU]), NU)
        return c0 + d0, c1 + d1, c2 + d2, c3 + d3

    @triton.jit
    def _mma4_fp8(w0, w1, w2, w3, v0, v1, v2, v3, x0, x1, x2, x3, c0, c1, c2, c3,
                  RT: tl.constexpr, NU: tl.constexpr, INTERP: tl.constexpr):
        """`_mma4` over an fp8 copy (bf16): each step's words w (registers 0, 1) and v (2, 3)
        [RT, NU]."""
        if INTERP:
            w = tl.reshape(_join4(w0, w1, w2, w3), [RT, 4 * NU])
            v = tl.reshape(_join4(v0, v1, v2, v3), [RT, 4 * NU])
            return _emu_mma(_fp8_values(w, v), x0, x1, x2, x3, c0, c1, c2, c3, RT, NU, False)
        else:
            return tl.inline_asm_elementwise(
                MMA4_FP8, "=f,=f,=f,=f,r,r,r,r,r,r,r,r,l,l,l,l,f,f,f,f",
                [w0, w1, w2, w3, v0, v1, v2, v3, x0, x1, x2, x3, c0, c1, c2, c3],
                dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)

    @triton.jit
    def _mma4(w0, w1, w2, w3, x0, x1, x2, x3, c0, c1, c2, c3, RT: tl.constexpr,
              NU: tl.constexpr, F16: tl.constexpr, INTERP: tl.constexpr,
              FP4: tl.constexpr = False):
        """c + the D fragments of each lane's 4-step mma chain: words w [RT, NU] and masked x
        [NU] per step; returns the 4 fragment values [RT, NU]. FP4: the words are an fp4 copy
        (E2M1 values, bf16 only) instead of affine codes (MAGIC + q)."""
        if INTERP:
            OFF: tl.constexpr = 1024.0 if F16 else 128.0
            w = tl.reshape(_join4(w0, w1, w2, w3), [RT, 4 * NU])
            if FP4:
                q = _fp4_values(w)
            else:
                sh = tl.arange(0, 8) * 4
                q = ((w[:, :, None] >> sh[None, None, :]) & 15).to(tl.float32) + OFF
            return _emu_mma(q, x0, x1, x2, x3, c0, c1, c2, c3, RT, NU, F16)
        else:
            return tl.inline_asm_elementwise(
                MMA4_FP4 if FP4 else MMA4_F16 if F16 else MMA4_BF16,
                "=f,=f,=f,=f,r,r,r,r,l,l,l,l,f,f,f,f",
                [w0, w1, w2, w3, x0, x1, x2, x3, c0, c1, c2, c3],
                dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)

    @triton.jit
    def _ones4(x0, x1, x2, x3, c0, c1, NU: tl.constexpr, F16: tl.constexpr,
               INTERP: tl.constexpr):
        """c + each lane's sums of the masked x [NU] over the 4 steps, for its columns 2tig
        and 2tig + 1."""
        if INTERP:
            NS: tl.constexpr = NU // 32
            b = _emu_bx(tl.reshape(_join4(x0, x1, x2, x3), [4 * NU]), NS, F16)
            xs = tl.reshape(tl.sum(b, axis=2), [NS, 1, 4, 2])  # col = 2tig + e2, any g
            z = tl.zeros([NS, 8, 4, 2], dtype=tl.float32)
            s0, s1 = tl.split(tl.reshape(z + xs, [NU, 2]))
            return c0 + s0, c1 + s1
        else:
            return tl.inline_asm_elementwise(
                ONES4_F16 if F16 else ONES4_BF16, "=f,=f,l,l,l,l,f,f",
                [x0, x1, x2, x3, c0, c1], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)

    @triton.jit
    def _ldx(x_ptr, xaddr, xo, on0, on1, INTERP: tl.constexpr, GDC: tl.constexpr = False):
        """A lane's masked x (int64: 4 values) for steps 0-3 at int64 offsets xo, xo + 1 (where
        on0) and xo + 8, xo + 9 (where on1): one 16-byte load per pair on the GPU. GDC (a PDL
        launch): through L2 (`.cg`), and not pure, so it stays after `griddepcontrol.wait`."""
        if INTERP:
            xi = x_ptr.to(tl.pointer_type(tl.int64), bitcast=True) + xo
            return (tl.load(xi, mask=on0, other=0), tl.load(xi + 1, mask=on0, other=0),
                    tl.load(xi + 8, mask=on1, other=0), tl.load(xi + 9, mask=on1, other=0))
        else:
            a = xaddr + xo.to(tl.int64) * 8
            return tl.inline_asm_elementwise(
                LDX_CG if GDC else LDX, "=l,=l,=l,=l,l,l,r,r",
                [a, a + 64, on0.to(tl.int32), on1.to(tl.int32)],
                dtype=(tl.int64, tl.int64, tl.int64, tl.int64), is_pure=not GDC, pack=1)

    @triton.jit
    def _ld32(p_ptr, paddr, idx, on, INTERP: tl.constexpr):
        """int32 at p + idx where `on`, else 0."""
        if INTERP:
            return tl.load(p_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + idx, mask=on,
                           other=0)
        else:
            return tl.inline_asm_elementwise(
                LD32, "=r,l,r", [paddr + idx.to(tl.int64) * 4, on.to(tl.int32)],
                dtype=tl.int32, is_pure=True, pack=1)
