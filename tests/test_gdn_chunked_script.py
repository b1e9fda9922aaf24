"""scripts/gdn_chunked_gpu.py's CPU-checkable parts: its --tiny mode (the Triton interpreter,
tiny shapes) runs every part end to end; the chunked kernel passes its checks against the
sequential one, and the tiny model's greedy tokens agree with the chunked form on and off."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
INTERPRETER_ONLY = True


def test_tiny_mode_runs_every_part(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gdn_chunked_gpu.py"),
                        str(tmp_path), "--tiny", "--budget", "600"], capture_output=True,
                       text=True, env=env, timeout=900)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "all ok" in out and "FAIL" not in out, out[-3000:]
    checks = [ln for ln in out.splitlines() if ln.startswith("tiny gqa2")]
    assert len(checks) == 4 and all(ln.endswith(" ok") for ln in checks), checks
    assert "greedy tokens same (near-tie rule) True" in out, out[-2000:]
