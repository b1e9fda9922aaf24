"""The package, its tests, benchmarks and scripts pass ruff with the project's rules
(pyproject.toml: pyflakes, syntax errors, lines within 100 characters)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_clean():
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "mlxr", "tests",
                        "benchmarks", "scripts"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
