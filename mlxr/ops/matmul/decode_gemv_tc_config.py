"""`decode_gemv_tc`'s launch policy: which weights and dtypes it takes (`supported`), its launch
shapes (`TcConfig`, `default_config`: the H200 sweeps' winners) and the rows of x one launch
takes (`max_rows`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from ..layer.norm_rope_act import _interpret

GROUPS = (32, 64, 128)  # affine; the fp4 copy also takes 16 (nvfp4)


@dataclass(frozen=True)
class TcConfig:
    """Launch shape: RT row tiles of 16 per program; each of num_warps warps takes U blocks of
    64 codes per iteration (WT = 128 * num_warps * U words of a row tile per iteration); the
    words of pf iterations ahead are in flight."""
    rt: int = 2
    u: int = 2
    num_warps: int = 4
    pf: int = 1  # word tiles in flight ahead of the one computed (1 or 2)
    stages: int = 0  # > 0: word tiles by TMA through shared memory, this many in flight
    unroll: int = 1  # K loop copies (2 with pf 2: the two tiles swap registers, no moves)
    maxnreg: int = 0  # > 0: registers per thread capped at this (ptxas .maxnreg)

    @property
    def wt(self) -> int:
        return 128 * self.num_warps * self.u

    def label(self) -> str:
        return (f"rt{self.rt}_u{self.u}_w{self.num_warps}_pf{self.pf}_s{self.stages}"
                + (f"_x{self.unroll}" if self.unroll > 1 else "")
                + (f"_r{self.maxnreg}" if self.maxnreg else ""))


def supported(group: int, n: int, k: int, dtype: torch.dtype, fp4: bool = False,
              fp8: bool = False) -> bool:
    """Affine 4-bit, group 32/64/128, N a multiple of 16, K a multiple of 512, bf16/fp16; fp4
    (`fp4_bits`): groups 16/32/64/128, bf16; fp8 (`fp8_words`): group 32 (mxfp8), bf16."""
    if fp8:
        return group == 32 and n % 16 == 0 and k % 512 == 0 and dtype == torch.bfloat16
    return ((group in GROUPS or (fp4 and group == 16)) and n % 16 == 0 and k % 512 == 0
            and dtype in ((torch.bfloat16,) if fp4 else (torch.bfloat16, torch.float16)))


def default_config(n: int, k: int, m: int = 1, fp8: bool = False) -> TcConfig:
    """The H200 sweeps' winners (benchmarks/gpu/q4tc_probe.py, docs/perf.md, 8B / 0.6B shapes)
    for m rows of x: LM heads 4 (K >= 4096) or 2 row tiles per program, 4 warps, two word
    tiles in flight, and for one row with K >= 4096 2 row tiles, 8 warps, two tiles, the K
    loop unrolled twice (8B head 77.8 vs 82.0 us); other tall matrices (gate_up) 2 row
    tiles, 4 warps; the long rows (K >= 3N: down) and the square 4096-row ones (8B o) 1 row
    tile, 16 warps (their 16-row programs are few: 16 warps each keep more loads in flight
    per SM; 8B down 16.3 vs 17.0 us with 8 warps and TMA, o 6.1 vs 7.8), and for one row
    with K >= 8192 (8B down) two tiles in flight, unrolled twice (15.2 vs 16.7 us); the rest
    1 row tile, 8 warps, two tiles in flight. The one-row launches were measured for one
    row only, so several rows keep the others. The fp8 copy (twice 4-bit's bytes per code)
    at one row, K >= 4096, N < 16384 (8B qkv, o, down): 1 row tile, 8 warps, two tiles in
    flight, unrolled twice (mxfp8 sweep: qkv 10.6 vs 11.3, o 8.4 vs 9.2, down 23.0 vs
    23.6 us). Env
    MLXR_Q4TC_STAGES=S sets S TMA stages (0: none) for every shape, for A/B runs.
    Blocks per iteration (num_warps * u) divide K / 64 (K is a multiple of 512)."""
    if _interpret():  # the interpreter runs programs one by one: few, large ones keep CI fast
        return TcConfig(rt=1 << max(0, min(8, n // 16).bit_length() - 1), u=1, num_warps=4)
    env = os.environ.get("MLXR_Q4TC_STAGES")  # an A/B switch: this many TMA stages for all
    if fp8 and m == 1 and k >= 4096 and n < 16384:
        cfg = TcConfig(rt=1, u=1, num_warps=8, pf=2, unroll=2)
    elif n >= 65536 and k >= 4096 and m == 1:
        cfg = TcConfig(rt=2, u=1, num_warps=8, pf=2, unroll=2)
    elif n >= 65536:
        cfg = TcConfig(rt=4 if k >= 4096 else 2, u=1, num_warps=4, pf=2)
    elif n >= 16384:
        cfg = TcConfig(rt=2, u=1, num_warps=4, pf=1)
    elif k >= 3 * n and k >= 8192 and (k // 64) % 16 == 0 and m == 1:
        cfg = TcConfig(rt=1, u=1, num_warps=16, pf=2, unroll=2)
    elif (k >= 3 * n or (n <= 4096 and k >= 4096)) and (k // 64) % 16 == 0:
        cfg = TcConfig(rt=1, u=1, num_warps=16, pf=1)
    else:
        cfg = TcConfig(rt=1, u=1, num_warps=8, pf=2)
    return cfg if env is None else dataclasses.replace(cfg, stages=int(env))


def max_rows(group: int) -> int:
    """Rows of x one launch takes: 8, 4 for group 32 (two columns per row and block), 2 for
    group 16 (four). `q4tc` takes more in launches of this many."""
    return {16: 2, 32: 4}.get(group, 8)
