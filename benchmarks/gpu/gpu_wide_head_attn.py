"""Decode attention at Gemma 4's head widths (512 full-attention, 256 sliding) on one CUDA GPU:
the q.k dot by 128-wide slices (`masked.wide_head`, the default over 256) against one dot over
the head (MLXR_ATTN_DK=0, the launch before), for the single request's `attention_at` and the
serving engine's `paged_attention`.

    PYTHONPATH=.:benchmarks/gpu python benchmarks/gpu/gpu_wide_head_attn.py

Gemma-4-E2B shape: 8 query heads, 1 kv head, bf16. Each variant is checked against the fp32
reference (bf16 bound of tests/test_triton_fused.py: 2^-7 (max|v| + |exact|)) and timed as the
median CUDA-graph replay over LAYERS layers' caches (read from HBM). One line per variant; the
last line is JSON.
"""

from __future__ import annotations

import json
import os

import torch
from gpu_timing import graph_time_us

from mlxr.ops import reference as R
from mlxr.ops.kv_attention import masked as M
from mlxr.ops.kv_attention import paged as P

LAYERS = 8
H, KH = 8, 1
LOADS = [(1024, 600), (4096, 3000), (16384, 12000)]
VARIANTS = [("one-dot s32", "0", 32), ("one-dot s16", "0", 16), ("dk128 s16", "128", 16),
            ("dk128 s32", "128", 32), ("dk256 s16", "256", 16)]


def _env(dk: str, bs: int) -> None:
    os.environ["MLXR_ATTN_DK"] = dk
    os.environ["MLXR_ATTN_BLOCK_S"] = str(bs)


def _ok(out, exact, v) -> tuple[bool, float]:
    err = (out.float() - exact).abs()
    tol = 2 ** -7 * (v.float().abs().max() + exact.abs())
    return bool((err <= tol).all()), float(err.max())


def single(d: int, cap: int, pos: int, rows: list) -> None:
    g = torch.Generator().manual_seed(cap + d)
    caches = [(torch.randn(KH, cap, d, generator=g).to("cuda", torch.bfloat16),
               torch.randn(KH, cap, d, generator=g).to("cuda", torch.bfloat16))
              for _ in range(LAYERS)]
    q = torch.randn(1, H, d, generator=g).to("cuda", torch.bfloat16)
    p = torch.tensor([pos], device="cuda")
    k0, v0 = caches[0]
    exact = R.attention_at(q.float(), k0.float(), v0.float(), p, None, 1.0)
    gb = 2 * (pos + 1) * KH * d * 2 / 1e9
    for name, dk, bs in VARIANTS:
        try:
            _env(dk, bs)
            ok, err = _ok(M.attention_at(q, k0, v0, p, None, 1.0), exact, v0)
            us = graph_time_us([lambda k=k, v=v: M.attention_at(q, k, v, p, None, 1.0)
                                for k, v in caches])
        except Exception as e:  # noqa: BLE001 - fail soft: report and go on
            print(f"attention_at D={d} cap={cap} {name}: FAIL {type(e).__name__}: {e}")
            continue
        rows.append(dict(kernel="attention_at", d=d, cap=cap, pos=pos, variant=name,
                         us=round(us, 2), gb_s=round(gb / us * 1e6, 1), ok=ok, err=err))
        print(f"attention_at D={d} cap={cap:5d} pos={pos:5d} {name:12s} {us:8.2f} us/layer "
              f"{gb / us * 1e6:7.1f} GB/s max err {err:.2e} {'ok' if ok else 'FAIL'}",
              flush=True)


def paged(d: int, bsz: int, ctx: int, rows: list) -> None:
    g = torch.Generator().manual_seed(bsz + d)
    bs = 16
    nblk = bsz * (-(-ctx // bs))
    tables = torch.randperm(nblk, generator=g).reshape(bsz, -1).to("cuda", torch.int32)
    lens = torch.full((bsz,), ctx, dtype=torch.int32, device="cuda")
    caches = [(torch.randn(KH, nblk * bs, d, generator=g).to("cuda", torch.bfloat16),
               torch.randn(KH, nblk * bs, d, generator=g).to("cuda", torch.bfloat16))
              for _ in range(LAYERS)]
    q = torch.randn(bsz, H, d, generator=g).to("cuda", torch.bfloat16)
    k0, v0 = caches[0]
    exact = R.paged_attention(q.float(), k0.float(), v0.float(), tables, lens, bs, 1.0)
    gb = 2 * bsz * ctx * KH * d * 2 / 1e9
    for name, dk, blk in VARIANTS:
        try:
            os.environ["MLXR_ATTN_DK"] = dk

            def run(k, v, blk=blk):
                return P.paged_attention(q, k, v, tables, lens, bs, 1.0, block_s=blk)

            ok, err = _ok(run(k0, v0), exact, v0)
            us = graph_time_us([lambda k=k, v=v: run(k, v) for k, v in caches])
        except Exception as e:  # noqa: BLE001
            print(f"paged D={d} B={bsz} {name}: FAIL {type(e).__name__}: {e}")
            continue
        rows.append(dict(kernel="paged", d=d, batch=bsz, ctx=ctx, variant=name,
                         us=round(us, 2), gb_s=round(gb / us * 1e6, 1), ok=ok, err=err))
        print(f"paged D={d} B={bsz:3d} ctx={ctx:5d} {name:12s} {us:8.2f} us/layer "
              f"{gb / us * 1e6:7.1f} GB/s max err {err:.2e} {'ok' if ok else 'FAIL'}",
              flush=True)


def main() -> None:
    rows: list = []
    for d in (512, 256):
        for cap, pos in LOADS:
            single(d, cap, pos, rows)
        for bsz, ctx in ((8, 2048), (64, 1024)):
            paged(d, bsz, ctx, rows)
    os.environ.pop("MLXR_ATTN_DK", None)
    os.environ.pop("MLXR_ATTN_BLOCK_S", None)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
