"""The test suite reads nothing outside the repository: its assets are in tests/assets, each listed
with its provenance and hash in tests/assets/MANIFEST.md, and reached only through the `assets`
fixture."""

from __future__ import annotations

import gzip
import hashlib
import re
from pathlib import Path

import pytest

from conftest import ASSETS, CLOSED, ROOT

MANIFEST = ASSETS / "MANIFEST.md"
SECTION = re.compile(r"^## `(?P<dir>[^`]+)/`$")
ROW = re.compile(
    r"^\| `(?P<file>[^`]+)` \| (?P<stored>[\d,]+) \| (?P<how>copy|gzip) \| (?P<bytes>[\d,]+) \| "
    r"`(?P<sha>[0-9a-f]{64})` \|"
)
# A path into the folder beside the checkout where the assets used to live ("../shared",
# ROOT.parent / "shared", ...).
OUTSIDE_PATH = re.compile(r"""(["'/\\])shared(["'/\\])""")


def manifest_rows() -> dict[str, dict[str, str]]:
    rows, section = {}, None
    for line in MANIFEST.read_text(encoding="utf-8").splitlines():
        if m := SECTION.match(line):
            section = m["dir"]
        elif (m := ROW.match(line)) and section:
            rows[f"{section}/{m['file']}"] = m.groupdict()
    return rows


def test_manifest_lists_every_asset_with_its_size_and_hash():
    rows = manifest_rows()
    on_disk = {
        p.relative_to(ASSETS).as_posix() for p in ASSETS.rglob("*") if p.is_file()
    } - {"MANIFEST.md"}
    assert set(rows) == on_disk, (sorted(on_disk - set(rows)), sorted(set(rows) - on_disk))
    total = 0
    for name, row in rows.items():
        data = (ASSETS / name).read_bytes()
        assert len(data) == int(row["stored"].replace(",", "")), name
        total += len(data)
        if row["how"] == "gzip":
            assert name.endswith(".gz"), name
            data = gzip.decompress(data)
        assert len(data) == int(row["bytes"].replace(",", "")), name
        assert hashlib.sha256(data).hexdigest() == row["sha"], name
    stated = re.search(r"Total: (\d+) files, ([\d,]+) bytes", MANIFEST.read_text(encoding="utf-8"))
    assert stated and (int(stated[1]), int(stated[2].replace(",", ""))) == (len(rows), total)


def test_fixture_shows_gzipped_assets_unpacked(assets):
    rows = manifest_rows()
    packed = [name for name, row in rows.items() if row["how"] == "gzip"]
    assert packed
    for name in packed:
        plain = assets / name.removesuffix(".gz")
        assert hashlib.sha256(plain.read_bytes()).hexdigest() == rows[name]["sha"], name
    assert not assets.resolve().is_relative_to(ASSETS.resolve())  # a copy: tests cannot edit it


def test_no_test_names_a_path_outside_the_repository():
    """conftest.py is the one file that names the old asset folder (to close it)."""
    sources = [*(ROOT / "tests").rglob("*.py"), *(ROOT / "scripts").rglob("*.py"), ROOT / ".ci/run"]
    offenders = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in sources
        if p.name != "conftest.py"
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if OUTSIDE_PATH.search(line) and p != Path(__file__)
    ]
    assert not offenders


def test_the_old_asset_folder_is_closed():
    """Reading below ../shared fails in every test, whether or not it exists on this machine."""
    with pytest.raises(PermissionError, match="outside the repository"):
        (CLOSED / "assets" / "MANIFEST.md").read_bytes()
    with pytest.raises(PermissionError, match="outside the repository"):
        list(CLOSED.iterdir())
