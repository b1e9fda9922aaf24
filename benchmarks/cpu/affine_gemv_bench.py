"""The affine 4-bit g64 decode GEMV on the CPU: mlxr's compiled `i4mm` against torch's int4
kernel (`_weight_int4pack_mm_for_cpu`), both reading the same int4 copy, per real shape.

    PYTHONPATH=$PWD python benchmarks/cpu/affine_gemv_bench.py [--threads 1] [--ms 1 4 16]
        [--cpu-time] [--shapes "0.6b qkv" ...] [--tiles]

Weights stream from DRAM as in a decode step: each shape is held in enough copies to pass
128 MiB (beyond the L3) and every call reads the next copy. The two kernels alternate by
round; a round's figure is the mean over all copies, the printed one the best of `--rounds`.
GB/s counts the bytes read (0.5 B per weight + scale and zero, 4 B per group). The read
bandwidth beside it is a float32 `sum` over 256 MiB (torch, same threads). `--cpu-time` times
the process's CPU time instead of the wall (with `--threads 1` on a shared box: the work done,
not the waits for a core). Prefill sizes (`--ms 32 128 512`) add `i4mm/16`, i4mm called on
16-row chunks of x, and `--tiles` the path `quant.cpu.linear` takes from `I4_MAX_M` rows on:
the codes decoded from the int4 copy and dequantized in torch (`dequant_rows`) and one bf16
`x @ W^T` (oneDNN; AMX where the CPU has it) over the whole matrix, and `tiles/c`, the tiles
from mlxr's compiled dequant (`native.i4deq`, the same values) cut as `tiled_linear` cuts
them (4 MiB of bf16 rows per tile past 8 MiB).
"""

from __future__ import annotations

import argparse
import time

import torch

from mlxr.ops.cpu import native
from mlxr.quant import cpu, int4pack
from mlxr.quant.affine import unpack_codes

# (name, out, in): Qwen3-0.6B's qkv, o, gate_up, down, tied head; Llama-3.1-8B's o (its qkv
# is 6144 x 4096), gate / up (one of the two halves of gate_up) and down
SHAPES = [("0.6b qkv", 4096, 1024), ("0.6b o", 1024, 2048), ("0.6b gate_up", 6144, 1024),
          ("0.6b down", 1024, 3072), ("0.6b head", 151936, 1024), ("8b o", 4096, 4096),
          ("8b up", 14336, 4096), ("8b down", 4096, 14336)]


def copy_of(n: int, k: int, group: int, seed: int) -> tuple[torch.Tensor, ...]:
    """(int4 copy, its scales and zeros, MLX's scales, biases) of a random weight."""
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, generator=g)
    s = (torch.rand(n, k // group, generator=g) * 0.02 + 1e-3).to(torch.bfloat16)
    b = (torch.randn(n, k // group, generator=g) * 0.1).to(torch.bfloat16)
    return int4pack.pack(unpack_codes(words, 4, k)), int4pack.scales_and_zeros(s, b), s, b


CLOCK = [time.perf_counter]


def per_call(fn, copies: list) -> float:
    t0 = CLOCK[0]()
    for c in copies:
        fn(*c)
    return (CLOCK[0]() - t0) / len(copies)


def tiles(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, b: torch.Tensor,
          g: int) -> torch.Tensor:
    """`quant.cpu.tiled_linear` on one tile as torch did it (`QuantWeight.dequant_rows`: the
    copy's codes decoded, then bf16(bf16(q * s) + b)), then x @ W^T."""
    n, k = s.shape[0], x.shape[1]
    q = int4pack.decode_rows(w, k, 0, n).to(torch.bfloat16).view(n, k // g, g)
    return x @ (q * s.unsqueeze(-1)).add_(b.unsqueeze(-1)).view(n, k).t()


def tiles_c(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, b: torch.Tensor,
            g: int) -> torch.Tensor:
    """`quant.cpu.tiled_linear` with mlxr's dequant: one tile up to SMALL_BYTES of bf16, else
    tiles of TILE_BYTES rows."""
    n = s.shape[0]
    step = n if n * x.shape[1] * 2 <= cpu.SMALL_BYTES else max(
        64, cpu.TILE_BYTES // (x.shape[1] * 2) // 64 * 64)
    return torch.cat([x @ native.i4deq(w, s, b, g, r0, min(r0 + step, n)).t()
                      for r0 in range(0, n, step)], dim=1)


def chunked(x: torch.Tensor, w: torch.Tensor, sz: torch.Tensor, g: int) -> torch.Tensor:
    """i4mm on 16-row chunks of x."""
    return torch.cat([native.i4mm(x[i:i + 16], w, sz, g, torch.bfloat16)
                      for i in range(0, x.shape[0], 16)])


def read_bandwidth() -> float:
    buf = torch.ones(64 << 20)
    buf.sum()
    best = min(per_call(lambda: buf.sum(), [()] * 3) for _ in range(3))
    return buf.numel() * 4 / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ms", type=int, nargs="*", default=[1, 4, 16])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--shapes", nargs="*", help="names from SHAPES (default: all)")
    ap.add_argument("--cpu-time", action="store_true")
    ap.add_argument("--tiles", action="store_true", help="add the dequantized-tile arm")
    a = ap.parse_args()
    if a.cpu_time:
        CLOCK[0] = time.process_time
    torch.set_num_threads(a.threads)
    if not native.i4mm_serves(64, 64, a.group):
        raise SystemExit("mlxr's i4mm is not built for this CPU / torch (native.i4mm_serves)")
    print(f"torch {torch.__version__}, threads {a.threads}, read bandwidth (fp32 sum) "
          f"{read_bandwidth():.1f} GB/s, {'CPU time' if a.cpu_time else 'wall'}")
    print(f"{'shape':>13} {'out':>6} {'in':>6} {'M':>3} {'torch us':>9} {'GB/s':>6} "
          f"{'i4mm us':>8} {'GB/s':>6} {'speedup':>7} {'GMAC/s':>6}  other arms us")
    g = a.group
    for name, n, k in SHAPES:
        if a.shapes and name not in a.shapes:
            continue
        nbytes = n * k // 2 + n * (k // g) * 4
        copies = [copy_of(n, k, g, c) for c in range(max(2, -(-(128 << 20) // nbytes)))]
        for m in a.ms:
            x = torch.randn(m, k).to(torch.bfloat16)
            arms = {"torch": lambda w, sz, s, b: int4pack.mm(x, w, g, sz),
                    "i4mm": lambda w, sz, s, b: native.i4mm(x, w, sz, g, torch.bfloat16)}
            if m > 16:
                arms["i4mm/16"] = lambda w, sz, s, b: chunked(x, w, sz, g)
            if a.tiles:
                arms["tiles"] = lambda w, sz, s, b: tiles(x, w, s, b, g)
                arms["tiles/c"] = lambda w, sz, s, b: tiles_c(x, w, s, b, g)
            best = {arm: float("inf") for arm in arms}
            for _ in range(a.rounds):
                for arm, fn in arms.items():
                    best[arm] = min(best[arm], per_call(fn, copies))
            t, c = best["torch"], best["i4mm"]
            more = " ".join(f"{arm} {v * 1e6:.0f}" for arm, v in best.items()
                            if arm not in ("torch", "i4mm"))
            print(f"{name:>13} {n:6d} {k:6d} {m:3d} {t * 1e6:9.1f} {nbytes / t / 1e9:6.1f} "
                  f"{c * 1e6:8.1f} {nbytes / c / 1e9:6.1f} {t / c:6.2f}x "
                  f"{m * n * k / c / 1e9:6.1f}  {more}", flush=True)


if __name__ == "__main__":
    main()
