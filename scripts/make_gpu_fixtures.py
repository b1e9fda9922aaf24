"""Write tiny mlx-lm-made models and mlx-lm's reference outputs for the GPU parity run.

mlx does not run on the GPU machine, so the references are made here and travel with the tree:

    python scripts/make_gpu_fixtures.py .gpu_fixtures
    MLXR_GPU_FIXTURES=.gpu_fixtures python -m pytest tests/test_gpu.py   # on the GPU machine
"""

from __future__ import annotations

import random
import sys
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import mlx_ref  # noqa: E402

CASES = [(f, "q4g64") for f in mlx_ref.FAMILIES] + [
    ("qwen3", q) for q in mlx_ref.QUANTS if q != "q4g64"] + [("llama", "bf16"), ("gemma2", "bf16")
                                                              ] + [
    ("qwen3_wide", q) for q in ("q4g64", "q2g64", "q3g64", "q5g64", "q6g64", "q8g64", "q4g32",
                                "mxfp4", "nvfp4", "mxfp8")]


def main(out: Path) -> None:
    for family, quant in CASES:
        d = out / f"{family}-{quant}"
        mlx_ref.make_model(d / "model", family, quant)
        rng = random.Random(zlib.crc32(f"{family}/{quant}".encode()))
        prompt = [rng.randrange(mlx_ref.BASE["vocab_size"]) for _ in range(24)]
        r = mlx_ref.reference(d / "model", prompt)
        np.savez(d / "reference.npz", prompt=np.array(r.prompt), greedy=np.array(r.greedy),
                 logits32=r.logits32, logits_bf16=r.logits_bf16)
        print(d)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
