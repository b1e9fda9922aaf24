"""The ONNX fuzzer in CI (issue 30; the fuzzer itself is tests/fuzz_onnx.py): a fixed seed and
a bounded number of cases per seed kind (six tiny exports), ~30 s on 2 cores. A longer run:

    MLXR_FUZZ_ONNX=1500 MLXR_FUZZ_SEED=3 python -m pytest -s tests/test_fuzz_onnx.py

Every mutated folder must load, generate and run one session step, or fail with a one-line
mlxr error; no worker may crash, hang or run past its memory limit. The summary (cases per
seed kind, outcomes, findings) is printed."""

from __future__ import annotations

import json
import os

import pytest

import fuzz_onnx

pytest.importorskip("onnxruntime_genai")
pytest.importorskip("mobius")

SEED = int(os.environ.get("MLXR_FUZZ_SEED", "1"))


def test_fuzz_onnx_folders():
    summary = fuzz_onnx.fuzz_onnx(int(os.environ.get("MLXR_FUZZ_ONNX", "150")), SEED)
    print("\n" + json.dumps(summary, indent=1))
    assert summary["findings"] == [], summary["findings"]
    for kind, outcomes in summary["outcomes"].items():
        assert set(outcomes) <= {"ok", "error"}, (kind, outcomes)
