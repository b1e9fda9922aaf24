"""scripts/hybrid_gpu_perf.py's CPU-checkable parts: its --tiny mode (the Triton interpreter,
tiny shapes) runs every part end to end, the fused kernel passes its check against the twin,
and the fused and op-by-op decode paths give the same greedy tokens, with fewer ops per step
for the fused one."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
INTERPRETER_ONLY = True


def test_tiny_mode_runs_every_part(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "hybrid_gpu_perf.py"),
                        str(tmp_path), "--tiny"], capture_output=True, text=True, env=env,
                       timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "done: all ok" in out and "FAIL" not in out, out[-3000:]
    kernel_lines = [ln for ln in out.splitlines() if ln.startswith("tiny gqa2")]
    assert len(kernel_lines) == 4 and all(" ok " in ln for ln in kernel_lines)
    m = re.search(r"ops per step fused (\d+), op-by-op (\d+); greedy tokens same "
                  r"\(near-tie rule\) True", out)
    assert m and int(m[1]) < int(m[2]), out[-2000:]
