"""Where an ONNX decoder's files are: an ONNX Runtime GenAI folder (genai_config.json naming
the decoder file, tokenizer files beside it), a folder with one .onnx file, or a bare .onnx.
Also the graph's I/O naming: which inputs are the KV cache of which layer."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import read_json
from ..errors import ModelFormatError

if TYPE_CHECKING:  # importing graph imports onnx; this module must not (mlxr.load probes it)
    from .graph import OnnxGraph


@dataclass(frozen=True)
class OnnxFolder:
    folder: Path
    model: Path  # the decoder .onnx
    meta: dict  # genai_config.json's "model" section ({} without one)
    search: dict  # genai_config.json's "search" section: sampling defaults


def is_onnx_model(path: Path) -> bool:
    """Whether mlxr.load should read `path` as an ONNX decoder."""
    path = Path(path)
    if path.is_file():
        return path.suffix == ".onnx"
    if not path.is_dir() or (path / "config.json").is_file():
        return False
    return (path / "genai_config.json").is_file() or any(path.glob("*.onnx"))


def resolve(path: Path) -> OnnxFolder:
    path = Path(path)
    if path.is_file():
        return OnnxFolder(path.parent, path, {}, {})
    if not path.is_dir():
        raise ModelFormatError(f"{path}: no such file or directory")
    cfg_path = path / "genai_config.json"
    if not cfg_path.is_file():
        models = sorted(path.glob("*.onnx"))
        if len(models) != 1:
            raise ModelFormatError(f"{path}: no genai_config.json and {len(models)} .onnx files "
                                   "(need exactly one)")
        return OnnxFolder(path, models[0], {}, {})
    raw = read_json(cfg_path)
    model = raw.get("model")
    decoder = model.get("decoder") if isinstance(model, dict) else None
    if not isinstance(decoder, dict):
        raise ModelFormatError("genai_config.json: key 'model.decoder' must be an object")
    name = decoder.get("filename", "model.onnx")
    if not isinstance(name, str) or Path(name).name != name or not name.endswith(".onnx"):
        raise ModelFormatError(f"genai_config.json: model.decoder.filename {name!r} must be a "
                               ".onnx file name inside the folder")
    search = raw.get("search") if isinstance(raw.get("search"), dict) else {}
    return OnnxFolder(path, path / name, model, search)


@dataclass(frozen=True)
class KVNames:
    """Graph names of one layer's KV cache (BNSH: [B, kv heads, length, head dim])."""

    past_key: str
    past_value: str
    present_key: str
    present_value: str


def kv_names(g: OnnxGraph, meta: dict) -> list[KVNames]:
    """Per layer, the past/present names (genai_config's patterns, else the builder's)."""
    dec = meta.get("decoder", {}) if isinstance(meta.get("decoder"), dict) else {}
    ins, outs = dec.get("inputs", {}) or {}, dec.get("outputs", {}) or {}
    for key, v in (("inputs", ins), ("outputs", outs)):
        if not isinstance(v, dict):
            raise ModelFormatError(f"genai_config.json: key 'model.decoder.{key}' must be an "
                                   f"object, got {type(v).__name__}")
    pats = [str(d.get(k, v)) for d, k, v in (
        (ins, "past_key_names", "past_key_values.%d.key"),
        (ins, "past_value_names", "past_key_values.%d.value"),
        (outs, "present_key_names", "present.%d.key"),
        (outs, "present_value_names", "present.%d.value"))]
    if any(p.count("%d") != 1 for p in pats):
        raise ModelFormatError("genai_config.json: KV name patterns must contain one %d")
    rx = re.compile("^" + re.escape(pats[0]).replace("%d", r"(\d+)") + "$")
    layers = sorted(int(m.group(1)) for n in g.inputs if (m := rx.match(n)))
    if layers != list(range(len(layers))):
        raise ModelFormatError(f"{g.path.name}: past KV inputs are not numbered 0..L-1")
    out = []
    for i in layers:
        k = KVNames(*(p.replace("%d", str(i)) for p in pats))
        if k.past_value not in g.inputs or k.present_key not in g.outputs \
                or k.present_value not in g.outputs:
            raise ModelFormatError(f"{g.path.name}: layer {i} lacks one of {k}")
        out.append(k)
    return out
