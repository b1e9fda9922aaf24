"""Shared test fixtures.

The project's test assets (real tokenizers, chat templates, stories260K) live in `shared/` beside
the repository checkout, both for developers and in CI.
"""

import os
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run (and are tested) in the interpreter. Set before any module
# imports triton: the mode is fixed when kernels are decorated.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pytest_collection_modifyitems(config, items):
    """Modules that set INTERPRETER_ONLY = True check kernels with tolerances that assume the
    interpreter's truncating bf16 casts. With a GPU they are skipped unless TRITON_INTERPRET=1
    is set for the run: a module that switched the interpreter on itself would switch it on
    for every later test of the process (the mode is fixed when kernels are decorated)."""
    if INTERPRETING:
        return
    skip = pytest.mark.skip(reason="interpreter-only kernel checks (run with TRITON_INTERPRET=1)")
    for item in items:
        if getattr(getattr(item, "module", None), "INTERPRETER_ONLY", False):
            item.add_marker(skip)


ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
ASSETS = SHARED / "assets"


@pytest.fixture(scope="session")
def assets() -> Path:
    assert ASSETS.is_dir(), f"test assets not found at {ASSETS} (shared/ must sit beside the repo)"
    return ASSETS


@pytest.fixture(scope="session")
def onnx_exports(tmp_path_factory) -> Path:
    """Tiny random-weight decoder exports made by the ONNX Runtime GenAI model builder (every
    variant of tests/onnx_build.py, one subprocess per test session, ~10-40 s)."""
    import subprocess
    import sys

    root = tmp_path_factory.mktemp("onnx_exports")
    log = root / "build.log"
    with open(log, "w") as f:
        r = subprocess.run([sys.executable, str(Path(__file__).parent / "onnx_build.py"),
                            str(root)], stdout=f, stderr=subprocess.STDOUT, timeout=900)
    assert r.returncode == 0, f"ONNX export build failed:\n{log.read_text()[-3000:]}"
    return root
