"""MoE families on CUDA against the CPU float32 path: tiny mlx-lm-made models of every MoE test
case, loaded on both devices in float32, teacher-forced logits compared (1e-3 of each
position's range, the CPU parity bound), and a bf16 CUDA load checked for finite logits.

    PYTHONPATH=. python scripts/moe_gpu_check.py DIR

Models already in DIR/<family>-<quant> are used as they are (made elsewhere, e.g. where mlx
is installed); the others are made there (mlx-lm needed).
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import mlxr  # noqa: E402

# test_parity_moe.CASES (imported from there where mlx is installed)
CASES = [("qwen3_moe", q) for q in ("bf16", "q4g64", "q8g64", "mxfp4")] + [
    ("mixtral", "bf16"), ("mixtral", "q4g64")] + [
    ("gpt_oss", q) for q in ("bf16", "q4g64", "mxfp4", "mxfp4_q8")] + [
    ("laguna", q) for q in ("bf16", "laguna_nvfp4", "q4g64", "nvfp4_gs", "mxfp8")]
VOCAB = 320  # mlx_ref.BASE["vocab_size"]


def main() -> None:
    out = Path(sys.argv[1])
    worst = 0.0
    for mode in ("split", "stacked"):
        os.environ["MLXR_MOE"] = mode
        print(f"-- experts {mode}")
        worst = max(worst, check(out))
    print(f"worst {worst:.2e} ({'ok' if worst <= 1e-3 else 'FAIL'})")


def check(out: Path) -> float:
    worst = 0.0
    for family, quant in CASES:
        path = out / f"{family}-{quant}"
        if not (path / "config.json").is_file():
            import mlx_ref

            mlx_ref.make_model(path, family, quant)
        rng = random.Random(0)
        seq = [rng.randrange(VOCAB) for _ in range(40)]
        cpu = mlxr.load(path, device="cpu", dtype="float32").logits(seq).numpy()
        gpu = mlxr.load(path, device="cuda", dtype="float32").logits(seq).numpy()
        err = (np.abs(gpu - cpu).max(-1) / (cpu.max(-1) - cpu.min(-1))).max()
        bf16 = mlxr.load(path, device="cuda").logits(seq)
        worst = max(worst, err)
        print(f"{family:10s} {quant:13s} cuda-vs-cpu f32 {err:.2e}  bf16 finite "
              f"{bool(torch.isfinite(bf16).all())}", flush=True)
    return worst


if __name__ == "__main__":
    main()
