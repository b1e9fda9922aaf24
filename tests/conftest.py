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

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
ASSETS = SHARED / "assets"


@pytest.fixture(scope="session")
def assets() -> Path:
    assert ASSETS.is_dir(), f"test assets not found at {ASSETS} (shared/ must sit beside the repo)"
    return ASSETS
