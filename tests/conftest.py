"""Shared test fixtures.

The project's test assets (real tokenizers, chat templates, stories260K) live in `tests/assets`,
with their provenance and licences in `tests/assets/MANIFEST.md`. Tests reach them only through
the `assets` fixture; nothing outside the repository is read (a fresh clone passes on its own).
"""

import gzip
import os
import shutil
import sys
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
ASSETS = ROOT / "tests" / "assets"
# Where the assets lived before they moved into the repository. Opening anything below it fails
# the test, so a test that reads outside the repository cannot pass here and fail on a fresh clone.
CLOSED = ROOT.parent / "shared"
_CLOSED_ROOTS = tuple({str(CLOSED), os.path.realpath(CLOSED)})


def _refuse_closed(event: str, args: tuple) -> None:
    if event not in ("open", "os.listdir", "os.scandir") or not args:
        return
    if not isinstance(args[0], (str, bytes, os.PathLike)):
        return  # a file descriptor
    path = os.path.abspath(os.fsdecode(args[0]))
    for root in _CLOSED_ROOTS:
        if path == root or path.startswith(root + os.sep):
            raise PermissionError(
                f"{path}: tests read nothing outside the repository; use the `assets` fixture "
                "(tests/assets, listed in tests/assets/MANIFEST.md)"
            )


sys.addaudithook(_refuse_closed)


def unpacked_copy(src: Path, dst: Path) -> Path:
    """Copy the asset tree `src` to `dst`, also writing each `X.gz` unpacked as `X`: big text
    assets are stored gzipped, tests see them under their upstream names. A copy, so that no
    test can change the repository's files through the fixture."""
    for path in sorted(src.rglob("*")):
        if not path.is_file():
            continue
        out = dst / path.relative_to(src)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, out)
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as packed, open(out.with_suffix(""), "wb") as plain:
                shutil.copyfileobj(packed, plain)
    return dst


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> Path:
    """The test assets (tests/assets, gzipped files unpacked): the only way tests reach them."""
    assert ASSETS.is_dir(), f"test assets not found at {ASSETS}"
    return unpacked_copy(ASSETS, tmp_path_factory.mktemp("assets"))


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


@pytest.fixture(scope="session")
def mobius_exports(tmp_path_factory) -> Path:
    """Tiny random-weight decoders exported by Mobius (tests/mobius_build.py: fp32 `build`,
    GGUF Q4_0 / Q4_1 `build-gguf --keep-quantized`, an fp16 "cuda" one; one subprocess)."""
    import subprocess
    import sys

    root = tmp_path_factory.mktemp("mobius_exports")
    log = root / "build.log"
    with open(log, "w") as f:
        r = subprocess.run([sys.executable, str(Path(__file__).parent / "mobius_build.py"),
                            str(root)], stdout=f, stderr=subprocess.STDOUT, timeout=900)
    assert r.returncode == 0, f"Mobius export build failed:\n{log.read_text()[-3000:]}"
    return root


@pytest.fixture(scope="session")
def make_checkpoint():
    """benchmarks/make_checkpoint.py as a module (benchmarks/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_checkpoint",
                                                  ROOT / "benchmarks" / "make_checkpoint.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
