"""MoE families on CUDA against the CPU float32 path: tiny mlx-lm-made models of every MoE test
case, loaded on both devices in float32, teacher-forced logits compared (1e-3 of each
position's range, the CPU parity bound), and a bf16 CUDA load checked for finite logits.

    PYTHONPATH=. python scripts/moe_gpu_check.py OUT_DIR
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import mlx_ref  # noqa: E402
import mlxr  # noqa: E402
from test_parity_moe import CASES  # noqa: E402


def main() -> None:
    out = Path(sys.argv[1])
    worst = 0.0
    for family, quant in CASES:
        path = mlx_ref.make_model(out / f"{family}-{quant}", family, quant)
        rng = random.Random(0)
        seq = [rng.randrange(mlx_ref.BASE["vocab_size"]) for _ in range(40)]
        cpu = mlxr.load(path, device="cpu", dtype="float32").logits(seq).numpy()
        gpu = mlxr.load(path, device="cuda", dtype="float32").logits(seq).numpy()
        err = (np.abs(gpu - cpu).max(-1) / (cpu.max(-1) - cpu.min(-1))).max()
        bf16 = mlxr.load(path, device="cuda").logits(seq)
        worst = max(worst, err)
        print(f"{family:10s} {quant:13s} cuda-vs-cpu f32 {err:.2e}  bf16 finite "
              f"{bool(torch.isfinite(bf16).all())}", flush=True)
    print(f"worst {worst:.2e} ({'ok' if worst <= 1e-3 else 'FAIL'})")


if __name__ == "__main__":
    main()
