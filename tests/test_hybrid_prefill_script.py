"""scripts/hybrid_prefill_gpu.py's --tiny mode (CPU, the padded prefill uncaptured) runs its
check parts end to end on a tiny qwen3_5: float32 and bf16 lines all ok, the padded forward
equal to itself uncaptured, no FAIL."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tiny_mode_checks_pass(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "hybrid_prefill_gpu.py"),
                        str(tmp_path), "--tiny", "--shapes", "qwen3.5-2b"],
                       capture_output=True, text=True, env=env, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "FAIL" not in out and "SKIP" not in out, out[-3000:]
    lines = [ln for ln in out.splitlines() if ln.startswith("check tiny-qwen3.5-2b")]
    assert len(lines) == 2 + 6, out[-3000:]  # float32 at 2 lengths, bf16 at 6
    assert all("cap==nocap 0.0e+00" in ln and "greedy 9/9 ok" in ln for ln in lines), out
