"""CPU benchmark of QuantWeight.linear (fast bf16 mode). Run: python
benchmarks/cpu/bench_qmatmul_cpu.py

Prints ms per call, GB/s of quantized bytes read (QuantWeight.nbytes / time) and GFLOP/s
(2*M*out*in / time) for a few LLM-ish shapes at M=1 (decode) and M=512 (prefill).
"""

from __future__ import annotations

import argparse
import time

import torch

from mlxr.config import QuantSpec
from mlxr.quant import QuantWeight

SHAPES = [(1024, 1024), (3072, 1024), (1024, 3072), (151936, 1024)]  # (out, in)


def make(out_f: int, in_f: int, bits: int, group: int, dtype=torch.bfloat16) -> QuantWeight:
    g = torch.Generator().manual_seed(out_f * 7 + in_f + bits)
    words = torch.randint(-(2**31), 2**31, (out_f, in_f * bits // 32), generator=g,
                          dtype=torch.int64).to(torch.int32)
    scales = (torch.rand(out_f, in_f // group, generator=g) * 0.01).to(torch.bfloat16)
    biases = (-torch.rand(out_f, in_f // group, generator=g) * 0.05).to(torch.bfloat16)
    return QuantWeight.from_tensors(words, scales, biases, QuantSpec("affine", bits, group),
                                    compute_dtype=dtype)


def bench(fn, min_time: float = 0.3, max_iter: int = 200) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        dt = time.perf_counter() - t0
        if dt > min_time or n >= max_iter:
            return dt / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--ms", type=int, nargs="*", default=[1, 512])
    ap.add_argument("--bits", type=int, nargs="*", default=[4, 8])
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"{'bits':>4} {'out':>7} {'in':>5} {'M':>4} {'path':>6} {'ms':>9} {'GB/s':>7} "
          f"{'GFLOP/s':>8}")
    for bits in a.bits:
        for out_f, in_f in SHAPES:
            qw = make(out_f, in_f, bits, 64)
            for m in a.ms:
                x = torch.randn(m, in_f).to(torch.bfloat16)
                dt = bench(lambda: qw.linear(x))
                path = "i4mm" if qw.i4 is not None and m < 32 else "tiled"
                print(f"{bits:>4} {out_f:>7} {in_f:>5} {m:>4} {path:>6} {dt * 1e3:9.3f} "
                      f"{qw.nbytes / dt / 1e9:7.2f} {2 * m * out_f * in_f / dt / 1e9:8.1f}",
                      flush=True)


if __name__ == "__main__":
    main()
