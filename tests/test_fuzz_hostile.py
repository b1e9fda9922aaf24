"""mlxr's fuzzer in CI (issue 34; the fuzzer itself is tests/fuzz_hostile.py): a fixed seed and
a bounded number of inputs, ~60-90 s on 2 cores. A longer run:

    MLXR_FUZZ_FOLDERS=2000 MLXR_FUZZ_FAMILY_FOLDERS=2000 MLXR_FUZZ_REQUESTS=20000 \\
        MLXR_FUZZ_SEED=7 python -m pytest -s tests/test_fuzz_hostile.py
(MLXR_FUZZ_FAMILY_FOLDERS: cases for each MoE / hybrid family of tests/fuzz_families.py;
MLXR_FUZZ_SWEEP_STRIDE=1 runs all of tests/fuzz_sweep.py's cases, ~5 min.)

Every folder must load and compute finite logits, or fail with an mlxr error; every request
must get a status below 500 within its timeout while a valid request beside it succeeds; no
worker may hang or run past its memory limit. The summaries (inputs tried, outcomes,
findings) are printed."""

from __future__ import annotations

import json
import os

import pytest

import fuzz_hostile
import fuzz_requests

pytest.importorskip("mlx_ref")

SEED = int(os.environ.get("MLXR_FUZZ_SEED", "1"))


def _report(summary: dict) -> None:
    print("\n" + json.dumps(summary, indent=1))


def test_fuzz_model_folders():
    summary = fuzz_hostile.fuzz_folders(int(os.environ.get("MLXR_FUZZ_FOLDERS", "150")), SEED)
    _report(summary)
    assert summary["findings"] == [], summary["findings"]
    assert set(summary["outcomes"]) <= {"ok", "error"}


def test_fuzz_family_folders():
    """The MoE and hybrid families' folders (tests/fuzz_families.py), a few cases each."""
    import fuzz_families

    n = int(os.environ.get("MLXR_FUZZ_FAMILY_FOLDERS", "150"))
    summary = fuzz_hostile.fuzz_folders(n, SEED, tuple(fuzz_families.FAMILIES[1:]))
    _report(summary)
    assert summary["findings"] == [], summary["findings"]
    assert set(summary["outcomes"]) <= {"ok", "error"}


def test_sweep_family_folders():
    """Every 40th case of tests/fuzz_sweep.py's deterministic sweep over every family's folder
    (MLXR_FUZZ_SWEEP_STRIDE=1: all ~12,700)."""
    import fuzz_families
    import fuzz_sweep

    stride = int(os.environ.get("MLXR_FUZZ_SWEEP_STRIDE", "40"))
    summary = fuzz_sweep.sweep(tuple(fuzz_families.FAMILIES), stride)
    _report(summary)
    assert summary["findings"] == [], summary["findings"]
    assert set(summary["outcomes"]) <= {"ok", "error"}


def test_fuzz_requests():
    summary = fuzz_requests.fuzz_requests(int(os.environ.get("MLXR_FUZZ_REQUESTS", "2000")), SEED)
    _report(summary)
    assert summary["findings"] == [], summary["findings"]
    assert not any(k.startswith(("5", "exception", "hang", "crash")) for k in summary["outcomes"])
