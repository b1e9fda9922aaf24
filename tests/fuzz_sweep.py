"""Deterministic sweeps over the families' tiny folders (tests/fuzz_hostile.py `sweep`): every
single edit of one kind, where the random campaign samples them. Each case is the unmutated
folder of a family (tests/fuzz_families.py) with one edit:

  config   each key of the text config (nested objects, e.g. rope_parameters.<type>.<key>,
           included) set to each of VALUES, or deleted;
  tensor   each kind of tensor (the first of each name up to its layer index) with its shape
           doubled, permuted or split, its dtype swapped for each other of the same width (the
           byte count still fits, so only the loader's dtype checks stand), dropped or renamed;
  quant    each kind of quantized module with a per-layer override of every mode / bits /
           group size mlx writes, or false.

A worker loads each, generates 3 tokens and checks the logits are finite, as the campaign's.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import tempfile
import time
from pathlib import Path

VALUES = [0, 1, 2, 3, 4, 7, 8, 16, 63, 65, 128, 1 << 20, 1 << 40, -1, 0.5, 1e308, None, True,
          "x", [], [0], [1] * 4, {"a": 1}]
SAME_WIDTH = [("F16", "BF16", "I16", "U16"), ("F32", "U32", "I32"),
              ("U8", "I8", "BOOL", "F8_E4M3", "F8_E5M2"), ("F64", "I64", "U64")]
QUANTS = [{"mode": "affine", "bits": b, "group_size": g} for b in (2, 3, 4, 5, 6, 8)
          for g in (32, 64, 128)] + [{"mode": m, "bits": b, "group_size": g} for m, b, g in (
              ("mxfp4", 4, 32), ("nvfp4", 4, 16), ("mxfp8", 8, 32))] + [False]
SKIP = ("model_type", "quantization", "quantization_config")


def _text(cfg: dict) -> dict:
    return cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg


def _paths(node: dict, prefix: tuple = ()) -> list[tuple]:
    """Key paths of a config object, nested objects' keys included (depth <= 3)."""
    out = []
    for k, v in node.items():
        if not prefix and k in SKIP:
            continue
        out.append((*prefix, k))
        if isinstance(v, dict) and len(prefix) < 2:
            out += _paths(v, (*prefix, k))
    return out


def _set(cfg: dict, path: tuple, value) -> dict:
    node = _text(cfg)
    for k in path[:-1]:
        node = node[k]
    if value is ...:
        del node[path[-1]]
    else:
        node[path[-1]] = json.loads(json.dumps(value))
    return cfg


def _kinds(names) -> list[str]:
    """The first name of each kind (layer indices collapsed)."""
    seen: dict[str, str] = {}
    for n in names:
        seen.setdefault(re.sub(r"\.\d+\.", ".N.", n), n)
    return list(seen.values())


def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write_header(path: Path, header: dict, data: bytes) -> None:
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    path.write_bytes(len(body).to_bytes(8, "little") + body + data)


def _tensor_edits(t: dict) -> list[tuple[str, object]]:
    shape, dtype = t["shape"], t["dtype"]
    edits: list[tuple[str, object]] = [("drop", None), ("rename", None)]
    if shape:
        edits += [("shape", [shape[0] * 2, *shape[1:]]), ("shape", shape[::-1]),
                  ("shape", [1, *shape]), ("shape", [math.prod(shape)])]
        if shape[-1] % 2 == 0:
            edits.append(("shape", [*shape[:-1], 2, shape[-1] // 2]))
    for group in SAME_WIDTH:
        if dtype in group:
            edits += [("dtype", d) for d in group if d != dtype]
    return edits


def cases(base: Path):
    """(label, edit(d)) for every sweep case of the folder `base`."""
    cfg = json.loads((base / "config.json").read_text())
    for path in _paths(_text(cfg)):
        for value in [*VALUES, ...]:
            yield (f"config {'.'.join(path)} = {value!r}",
                   lambda d, p=path, v=value: _edit_config(d, lambda c: _set(c, p, v)))
    header, _ = _header(base / "model.safetensors")
    names = [k for k in header if k != "__metadata__"]
    for name in _kinds(names):
        for what, value in _tensor_edits(header[name]):
            yield (f"tensor {name} {what} {value!r}",
                   lambda d, n=name, w=what, v=value: _edit_tensor(d, n, w, v))
    modules = _kinds(n[:-len(".scales")] for n in names if n.endswith(".scales"))
    for module in modules:
        for q in QUANTS:
            yield (f"quant {module} = {q!r}",
                   lambda d, m=module, q=q: _edit_config(d, lambda c: _quant(c, m, q)))


def _edit_config(d: Path, fn) -> None:
    path = d / "config.json"
    path.write_text(json.dumps(fn(json.loads(path.read_text()))))


def _quant(cfg: dict, module: str, q) -> dict:
    for key in ("quantization", "quantization_config"):
        if isinstance(cfg.get(key), dict):
            cfg[key][module] = q
    return cfg


def _edit_tensor(d: Path, name: str, what: str, value) -> None:
    path = d / "model.safetensors"
    header, data = _header(path)
    if what == "drop":
        del header[name]
    elif what == "rename":
        header[name + "x"] = header.pop(name)
    else:
        header[name][what] = value
    _write_header(path, header, data)


def sweep(families: tuple[str, ...], stride: int = 1) -> dict:
    """Every `stride`-th sweep case of each family's tiny folder (1: all), loaded and run by
    one worker."""
    import fuzz_hostile

    work = Path(tempfile.mkdtemp(prefix="mlxr-sweep-"))
    worker = fuzz_hostile._Worker("folders")
    tally: dict[str, int] = {}
    findings = []
    start = time.monotonic()
    try:
        for family in families:
            base, _ = fuzz_hostile._base(family, work / family)
            first = worker.ask(str(base), 120)
            if first["outcome"] != "ok":
                findings.append({"family": family, "case": "base", **first})
            for label, edit in list(cases(base))[::stride]:
                d = work / "case"
                shutil.copytree(base, d)
                edit(d)
                out = worker.ask(str(d), fuzz_hostile.CASE_TIMEOUT)
                tally[out["outcome"]] = tally.get(out["outcome"], 0) + 1
                record = {"family": family, "case": label, **out}
                fuzz_hostile._log("MLXR_FUZZ_LOG", record)
                if out["outcome"] not in ("ok", "error"):
                    findings.append(record)
                shutil.rmtree(d, ignore_errors=True)
    finally:
        worker.stop()
        shutil.rmtree(work, ignore_errors=True)
    return {"kind": "sweep", "families": list(families), "tried": sum(tally.values()),
            "outcomes": tally, "findings": findings,
            "seconds": round(time.monotonic() - start, 1)}
