"""scripts/hybrid_engine_gpu.py's code on the CPU (`--device cpu`: its smoke mode, the graphs
mode run eagerly): the tiny-model check of one family and the bf16 three-way comparison on
that model pass, so the script the lead runs on the GPU does not rot."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_script_checks_pass_on_cpu(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "hybrid_engine_gpu.py"),
                        str(tmp_path / "qwen3_5-q4g64"), "--device", "cpu", "--only", "check",
                        "--families", "qwen3_5", "--tiny-dir", str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "done: all ok" in out and "FAIL" not in out, out[-3000:]
    assert "qwen3_5         f32 static-vs-own" in out
    assert "graphs == slots-eager True" in out
