"""The compiled CPU kernels are built wherever a C compiler is present at install (setup.py's
optional extension): without this check a failed build would only make tests/test_cpu_kernels.py
skip, and the suite would pass while testing nothing of them."""

from __future__ import annotations

import os
import platform
import shutil

import pytest

from mlxr.ops.cpu import native


def test_kernels_built_where_a_compiler_is():
    if shutil.which(os.environ.get("CC", "cc")) is None or platform.machine() not in (
            "x86_64", "AMD64"):
        pytest.skip("no C compiler for x86-64 here: mlxr runs its torch paths")
    assert native.available(), (
        "a C compiler is present but mlxr's CPU kernels were not built at install: "
        "`pip install -e .` (or `python setup.py build_ext --inplace`) builds them")
