"""A decode layer's work around its GEMVs in one C call each (`layer.c`): the residual add with
the next RMSNorm, the q/k norms with RoPE and the K/V cache write, and act(gate) * up.

They replace ~50 torch calls per layer of the lean step (mlxr/models/cpu_decode.py) and give
its values bit for bit: `layer.c` repeats each float32 operation of the torch path in its
order, including the one reduction (torch's CPU sum order for the RMSNorm's mean of squares,
whose vector width depends on the torch build: `lanes` finds it), and the activation is a table
of torch's own output for every bf16 value. `ready()` checks all of it against the torch twins
(`twins.py`) on random rows once per process and per shape, and the lean step takes the torch
path wherever it does not hold (or for float16 / float32, other activations, rows of 32,768 and
more: torch splits those sums over threads).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import Tensor

from . import native, twins

ACTS = {"silu": F.silu, "sigmoid": torch.sigmoid,  # gelu's vector and scalar paths differ
        "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}
VECTOR_ROW = 128  # rows whose width is a multiple of this run torch's vector loop only


def _k():
    return native._module()


def enabled() -> bool:
    """Read at each step: env `MLXR_CPU_FUSED=0` (or `MLXR_CPU_KERNELS=0`) selects the torch
    calls, for A/B runs (benchmarks/cpu/cpu_decode_bench.py)."""
    return native.enabled() and os.environ.get("MLXR_CPU_FUSED", "") != "0"


@functools.cache
def lanes() -> int:
    """The vector width of torch's float32 sum on this build (its cascade order is per lane),
    probed against torch on random rows; 0 when no width reproduces it."""
    if not native.available():
        return 0
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(n, generator=g).exp().pow(2) for n in (5, 8, 24, 40, 100, 1000)]
    for w in (8, 16, 4, 32):
        if all(_k().row_sum(x.data_ptr(), x.numel(), w) == x.view(1, -1).sum(-1).item()
               for x in rows):
            return w
    return 0


def _all_bf16() -> Tensor:
    return torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def torch_values(f) -> Tensor | None:
    """f of every bf16 bit pattern (torch's vector loop: [65536] in f's output dtype), or None
    where torch's scalar loop (a strided input) gives another value for some input (then a
    row's tail could round otherwise)."""
    allb = _all_bf16()
    vec = f(allb)
    scalar = f(allb.repeat_interleave(2)[::2])  # strided input: torch's scalar loop
    bits = torch.int16 if vec.element_size() == 2 else torch.int32
    a, b = vec.view(bits), scalar.view(bits)
    return vec if bool(((a == b) | (vec.isnan() & scalar.isnan())).all()) else None


@functools.cache
def act_table(act: str) -> Tensor | None:
    """bf16 act(v) for each bf16 bit pattern v ([65536 + 1] bf16, the last entry padding), or
    None where torch's vector and scalar loops disagree on some value (then a row's tail could
    round otherwise)."""
    f = ACTS.get(act)
    vec = None if f is None else torch_values(f)
    return None if vec is None else torch.cat((vec, vec.new_zeros(1)))  # + 1: layer.c's gather


@functools.cache
def vector_act_table(act: str) -> Tensor | None:
    """`act_table` as torch's vector loop gives each value (gelu_tanh's scalar loop rounds 4
    of the 65536 otherwise): exact for act(gate) * up where the gate's width is a multiple
    of `VECTOR_ROW` (torch covers such rows in whole vector steps, 2 x 32 lanes at most).
    Checked once: every bf16 value through `act_mul` and through torch in rows of that
    width, bit for bit; None where that fails or the activation is unknown."""
    f = ACTS.get(act)
    if f is None or not native.available():
        return None
    allb = _all_bf16()
    tab = torch.cat((f(allb), allb.new_zeros(1)))
    gate = allb.view(-1, VECTOR_ROW)
    up = torch.linspace(-3, 3, gate.numel()).to(torch.bfloat16).view_as(gate)
    gu = torch.cat((gate, up), -1)
    want, got = twins.act_mul(gu, act), act_mul(gu, tab)
    same = (want.view(torch.int16) == got.view(torch.int16)) | (want.isnan() & got.isnan())
    return tab if bool(same.all()) else None


def add_rms_norm(h: Tensor, r: Tensor | None, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(s, rms_norm(s) * w) for s = bf16(h + r) (r None: s = h), rows [N, E] bf16
    contiguous, w [E] bf16 (any norm offset already added, as the reference forms it).
    `ops.add_rms_norm`'s values; s is written into h."""
    n, e = h.shape
    x = torch.empty_like(h)
    _k().add_rms_norm(h.data_ptr(), 0 if r is None else r.data_ptr(),
                      0 if r is None else h.data_ptr(), w.data_ptr(), eps, x.data_ptr(), n, e,
                      lanes())
    return h, x


def qk_rope(qkv: Tensor, heads: int, kv_heads: int, w: Tensor | None, eps: float, cos: Tensor,
            sin: Tensor, traditional: bool, pos: Tensor, k_cache: Tensor, v_cache: Tensor,
            slots: Tensor) -> Tensor:
    """q [N, heads, D] from qkv [N, (heads + 2 kv_heads) D] (bf16): the heads normed by w
    [heads + kv_heads, D] (None: not normed), RoPE by the tables cos / sin [P, 2R] float32
    (`cpu_decode._Rope`) at rows pos [N] (long); k and v written to k_cache / v_cache
    [kv_heads, P', D] at slots [N] (long)."""
    n, d = qkv.shape[0], k_cache.shape[-1]
    q = torch.empty(n, heads, d, dtype=qkv.dtype)
    _k().qk_rope(qkv.data_ptr(), n, heads, kv_heads, d, cos.shape[-1], int(traditional),
                 0 if w is None else w.data_ptr(), eps, lanes(), cos.data_ptr(),
                 sin.data_ptr(), pos.data_ptr(), slots.data_ptr(), q.data_ptr(),
                 k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0))
    return q


def act_mul(gu: Tensor, tab: Tensor) -> Tensor:
    """act(gate) * up for gu [N, 2I] = [gate | up] (bf16 contiguous), tab = `act_table`."""
    n, i2 = gu.shape
    out = torch.empty(n, i2 // 2, dtype=gu.dtype)
    _k().act_mul(gu.data_ptr(), n, i2 // 2, tab.data_ptr(), out.data_ptr())
    return out


@functools.cache
def ready(e: int, heads: int, kv_heads: int, d: int, r2: int, traditional: bool, normed: bool,
          act: str) -> bool:
    """Whether the fused calls give the torch twins' values for this layer shape (hidden e,
    heads / kv heads of width d, rotated r2 of them, per-head norms or not, the activation),
    checked bit for bit on random rows once per process."""
    if not lanes() or act_table(act) is None or e >= 32768 or d >= 32768:
        return False
    g = torch.Generator().manual_seed(e + d)

    def rnd(*shape, scale=1.0):
        x = torch.randn(*shape, generator=g) * scale
        return (x * torch.randn(*shape, generator=g).exp()).to(torch.bfloat16)

    n, p = 3, 7
    h, r, w = rnd(n, e), rnd(n, e, scale=4.0), rnd(e)
    want = twins.add_rms_norm(h.clone(), r, w, 1e-6)
    got = add_rms_norm(h.clone(), r, w, 1e-6)
    ok = all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    ang = torch.rand(p, r2 // 2, generator=g) * 6.3
    if traditional:
        cos = ang.cos().repeat_interleave(2, -1)
        sin = torch.stack((-ang.sin(), ang.sin()), -1).flatten(-2)
    else:
        cos, sin = torch.cat((ang.cos(),) * 2, -1), torch.cat((-ang.sin(), ang.sin()), -1)
    qkv = rnd(n, (heads + 2 * kv_heads) * d, scale=3.0)
    wq = rnd(heads + kv_heads, d) if normed else None
    pos, slots = torch.tensor([0, 6, 3]), torch.tensor([5, 1, 2])
    caches = [torch.zeros(kv_heads, p, d, dtype=torch.bfloat16) for _ in range(4)]
    q0 = twins.qk_rope(qkv, heads, kv_heads, wq, 1e-6, cos, sin, traditional, pos,
                       caches[0], caches[1], slots)
    q1 = qk_rope(qkv, heads, kv_heads, wq, 1e-6, cos, sin, traditional, pos, caches[2],
                 caches[3], slots)
    ok &= torch.equal(q0, q1) and torch.equal(caches[0], caches[2])
    ok &= torch.equal(caches[1], caches[3])
    gu = rnd(n, 2 * 64, scale=3.0)
    return ok and torch.equal(act_mul(gu, act_table(act)), twins.act_mul(gu, act))
