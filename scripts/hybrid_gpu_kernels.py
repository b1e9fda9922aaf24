"""The hybrids' kernel paths on CUDA against their torch twins, one line per check (called by
scripts/hybrid_gpu_check.py; runnable alone: PYTHONPATH=. python scripts/hybrid_gpu_kernels.py).

Checked, each at Gemma 4's head widths (512 full, 256 sliding) and the hybrids' MoE shapes:
- attention_at (the decode graph's attention), paged decode and paged prefill attention, the
  padded batched decode on the paged kernel: CUDA float32 vs the CPU float32 reference within
  max(1e-5, S 2^-23) of max|v| (the same fp32 math over S keys in another order); CUDA
  bf16 (inputs rounded to bf16, the reference run on them in fp32) within
  2^-7 (max|v| + |exact|) (p rounded to bf16 before P.V, the output rounded once) plus 2^-7
  max|v| for CUDA's bf16 tensor-core dot of q.k (inputs exact, fp32 sums);
- the MoE decode and grouped kernels with Gemma 4's GeGLU (gelu_tanh) on 4-bit and on
  unquantized (dense) bf16 experts: CUDA vs the CPU twin at the same activation dtype,
  float32 within 1e-4 of the twin's max |value| (fp32 sums over K <= 128 in another order,
  far inside), bf16 within 2^-6 of it (h's bf16 roundings may flip at a boundary: one ulp,
  2^-8 relative, carried through down's sum of 96 terms).
Each check runs in its own try; a raise prints FAIL with the error and the rest go on.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mlxr.models.padded_attention import padded_decode_attention  # noqa: E402
from mlxr.ops import reference as R  # noqa: E402
from mlxr.ops.kv_attention import masked as M  # noqa: E402
from mlxr.ops.kv_attention import paged as P  # noqa: E402
from mlxr.ops.moe import decode_experts as D  # noqa: E402
from mlxr.ops.moe import grouped_experts as G  # noqa: E402
from mlxr.ops.moe.operands import dense_experts  # noqa: E402


def _line(name: str, fn) -> bool:
    try:
        err, tol = fn()
        ok = err <= tol
        print(f"kernel {name:48s} err {err:.2e} tol {tol:.2e}  {'ok' if ok else 'FAIL'}",
              flush=True)
        return ok
    except Exception as e:  # noqa: BLE001 - one line per check, then the next
        print(f"kernel {name:48s} FAIL {type(e).__name__}: {e}", flush=True)
        traceback.print_exc(limit=2)
        return False


def _attn_err(out, exact, vmax, dtype, keys: int) -> tuple[float, float]:
    """(worst err / elementwise tol, 1.0): the module docstring's bounds, fp32's at least
    keys * 2^-23 max|v| (sums of that many terms in another order)."""
    o, e = out.float().cpu(), exact.float().cpu()
    if dtype == torch.float32:
        tol = torch.full_like(e, max(1e-5, keys * 2**-23) * vmax)
    else:
        tol = 2**-7 * (2 * vmax + e.abs())
    return float(((o - e).abs() / tol).max()), 1.0


def _qkv(g, t, h, kh, s, d):
    return (torch.randn(t, h, d, generator=g), torch.randn(kh, s, d, generator=g),
            torch.randn(kh, s, d, generator=g))


def attention_checks() -> bool:
    ok = True
    for d in (512, 256):
        for dtype in (torch.float32, torch.bfloat16):
            tag = f"D={d} {str(dtype)[6:]}"
            g = torch.Generator().manual_seed(d)
            q, k, v = (x.to(dtype).float() for x in _qkv(g, 1, 8, 1, 3000, d))
            pos = torch.tensor([2500])
            exact = R.attention_at(q, k, v, pos, None, 1.0)

            def at(q=q, k=k, v=v, pos=pos, exact=exact, dtype=dtype):
                c = [x.to("cuda", dtype) for x in (q, k, v)]
                out = M.attention_at(*c, pos.cuda(), None, 1.0)
                return _attn_err(out, exact, float(v.abs().max()), dtype, 2501)

            ok &= _line(f"attention_at {tag} S=3000", at)
            lens = [1, 700, 2049]
            keys = [torch.randn(1, n, d, generator=g).to(dtype).float() for n in lens]
            vals = [torch.randn(1, n, d, generator=g).to(dtype).float() for n in lens]
            qb = torch.randn(len(lens), 8, d, generator=g).to(dtype).float()
            want = padded_decode_attention(qb, keys, vals, 1.0, kernels=False)

            def padded(keys=keys, vals=vals, qb=qb, want=want, dtype=dtype):
                cuda = [[x.to("cuda", dtype) for x in xs] for xs in (keys, vals)]
                out = padded_decode_attention(qb.to("cuda", dtype), *cuda, 1.0)
                vmax = max(float(x.abs().max()) for x in vals)
                return _attn_err(out, want, vmax, dtype, max(lens))

            ok &= _line(f"padded batched decode (paged kernel) {tag}", padded)
            ok &= _line(f"paged prefill {tag}", lambda d=d, dtype=dtype: _prefill(d, dtype))
    return ok


def _prefill(d: int, dtype) -> tuple[float, float]:
    g = torch.Generator().manual_seed(7 + d)
    bs, lens, news = 16, [300, 40], [100, 1]
    nblk = sum(-(-n // bs) for n in lens)
    tables = torch.randperm(nblk, generator=g).reshape(1, -1)
    tables = torch.stack([tables[0, :19], torch.cat((tables[0, 19:], tables[0, :16]))])
    k = torch.randn(1, nblk * bs, d, generator=g).to(dtype).float()
    v = torch.randn(1, nblk * bs, d, generator=g).to(dtype).float()
    q = torch.randn(sum(news), 8, d, generator=g).to(dtype).float()
    spans = [(0, 0, lens[0] - news[0], news[0]), (1, news[0], lens[1] - 1, 1)]
    items = R.paged_items(spans, R.prefill_tile(8, 1))
    exact = R.paged_prefill_attention(q, k, v, tables, items, bs, 1.0)
    out = P.paged_prefill_attention(*(x.to("cuda", dtype) for x in (q, k, v)),
                                    tables.int().cuda(), items.cuda(), bs, 1.0)
    return _attn_err(out, exact, float(v.abs().max()), dtype, max(lens))


def _experts(dense: bool, x: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    if dense:
        return dense_experts((torch.randn(x, n, k, generator=g) * 0.1).to(torch.bfloat16))
    codes = torch.randint(0, 16, (x, n, k // 8, 8), generator=g)
    words = (codes << (4 * torch.arange(8))).sum(-1)  # 8 codes per word, LSB first
    w = ((words + 2**31) % 2**32 - 2**31).to(torch.int32)
    s = (torch.randn(x, n, k // 64, generator=g) * 0.02).to(torch.bfloat16)
    b = (torch.randn(x, n, k // 64, generator=g) * 0.1).to(torch.bfloat16)
    return D.ExpertQuant(w, s, b, None, None, "affine", 4, 64)


def _to(q, dev):
    return q._replace(**{f: getattr(q, f).to(dev) for f in ("w", "scales", "biases")
                         if getattr(q, f) is not None})


def moe_checks() -> bool:
    ok = True
    for dense in (True, False):
        gate, up = _experts(dense, 8, 96, 128, 1), _experts(dense, 8, 96, 128, 2)
        down = _experts(dense, 8, 128, 96, 3)
        for t in (1, 40):  # the decode kernels, the grouped GEMM
            for dtype in (torch.float32, torch.bfloat16):
                g = torch.Generator().manual_seed(t)
                x = torch.randn(t, 128, generator=g)
                ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(t)])
                w = torch.softmax(torch.randn(t, 2, generator=g), -1)

                def run(x=x, ids=ids, w=w, dtype=dtype, gate=gate, up=up, down=down):
                    ref = G.moe_grouped_ref(x.to(dtype), ids, w, gate, up, down, "gelu_tanh",
                                            1.702, 7.0, torch.float32)
                    cq = [_to(q, "cuda") for q in (gate, up, down)]
                    out = D.moe_down(D.moe_gate_up(x.to("cuda", dtype), ids.cuda(), cq[0],
                                                   cq[1], "gelu_tanh"),
                                     ids.cuda(), w.cuda(), cq[2], torch.float32) if t <= 8 \
                        else G.moe_grouped(x.to("cuda", dtype), ids.cuda(), w.cuda(), *cq,
                                           "gelu_tanh", 1.702, 7.0, torch.float32)
                    rel = 1e-4 if dtype == torch.float32 else 2**-6
                    return (float((out.float().cpu() - ref).abs().max()),
                            rel * float(ref.abs().max()))

                kind = "decode" if t <= 8 else "grouped"
                what = "dense bf16" if dense else "affine 4-bit"
                ok &= _line(f"moe {kind} gelu_tanh {what} {str(dtype)[6:]}", run)
    return ok


def main() -> bool:
    return attention_checks() & moe_checks()


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    sys.exit(0 if main() else 1)
