"""Prefill's dequantization from the q4tc copy (`prefill_dequant.dequant_copy`, what a weight
whose MLX words were dropped runs) against the words' own (`dequant_affine`), per 8B / 0.6B
projection and width: us per call (CUDA graphs over copies larger than the L2, median) and the
output's bf16 GB/s (each writes 2 B per weight; they read 0.5 B per code and plane).

    python benchmarks/gpu/gpu_dequant_copy.py            # 4-bit and 8-bit (two planes)
    python benchmarks/gpu/gpu_dequant_copy.py 4 3        # the widths to time
"""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gpu_timing import L2_BYTES, graph_time_us  # noqa: E402

from mlxr.config import QuantSpec  # noqa: E402
from mlxr.ops.matmul.decode_gemv_tc import repack  # noqa: E402
from mlxr.ops.matmul.decode_gemv_tc_layout import repack_codes  # noqa: E402
from mlxr.ops.matmul.prefill_dequant import dequant_affine, dequant_copy  # noqa: E402
from mlxr.quant.fp import nibble_planes  # noqa: E402

SHAPES = {"8b_qkv": (6144, 4096), "8b_o": (4096, 4096), "8b_gate_up": (28672, 4096),
          "8b_down": (4096, 14336), "0.6b_qkv": (4096, 1024), "0.6b_gate_up": (6144, 1024),
          "0.6b_down": (1024, 3072)}


def main(widths: list[int]) -> None:
    dev, group = "cuda", 64
    g = torch.Generator(device=dev).manual_seed(0)
    for bits in widths:
        for name, (n, k) in SHAPES.items():
            w = torch.randint(-(2**31), 2**31, (n, k * bits // 32), generator=g, device=dev,
                              dtype=torch.int64).to(torch.int32)
            s = (torch.rand(n, k // group, generator=g, device=dev) * 1e-3).bfloat16()
            b = (torch.randn(n, k // group, generator=g, device=dev) * 1e-2).bfloat16()
            if bits == 4:
                copy, p = repack(w), 1
            else:
                c = nibble_planes(QuantSpec("affine", bits, group), w, s, b, k)[0]
                copy, p = repack_codes(c), c.shape[1] // k
            nrot = max(1, -(-2 * L2_BYTES // (n * k * 2)))  # outputs alone exceed the L2
            outs = [None] * nrot
            want = dequant_affine(w, s, b, k, bits, group)
            got = dequant_copy(copy, s, b, bits, group, p)
            same = torch.equal(want.view(torch.int16), got.view(torch.int16))

            def run(f):
                return [lambda i=i: outs.__setitem__(i, f()) for i in range(nrot)]

            ta = graph_time_us(run(lambda: dequant_affine(w, s, b, k, bits, group)))
            tc = graph_time_us(run(lambda: dequant_copy(copy, s, b, bits, group, p)))
            gb = n * k * 2 / 1e3
            print(f"{bits}-bit {name:13s} words {ta:7.1f} us ({gb / ta:5.0f} GB/s)  copy "
                  f"{tc:7.1f} us ({gb / tc:5.0f} GB/s)  x{tc / ta:.2f}  bit-identical {same}",
                  flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [4, 8])
