"""`mlxr.load` for ONNX decoders: validate the graph, decide what mlxr claims, and build the
same Model as for MLX files -- mlxr's decoder for what it claims, with any layer it declines
on onnxruntime's CPU provider (`regions`), or onnxruntime for the whole graph when what it
declines lies outside the layers (the claim report says which, and why)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from ..harness import trace
from ..errors import ModelFormatError
from ..models.loader import build_decoder
from .claim import ClaimReport, check_node, check_opsets, debug_enabled, print_report
from .fallback import OrtDecoder, fallback_config
from .folder import KVNames, OnnxFolder, kv_names, resolve
from .graph import OnnxGraph
from .regions import OrtRegion, OrtSubRegion, RegionDecoder, StepClock
from .rope import TableRope
from .translate import Translation, translate
from .walk import Decline

log = logging.getLogger(__name__)


@dataclass
class Inspection:
    """A validated graph, what mlxr claims of it, and (if everything) its translation."""

    files: OnnxFolder
    graph: OnnxGraph
    report: ClaimReport
    kv: list[KVNames]
    logits: str
    translation: Translation | None


def inspect(path) -> Inspection:
    files = resolve(path)
    g = OnnxGraph(files.model)
    check_opsets(g)
    kv = kv_names(g, files.meta)
    logits = _logits_name(g, files.meta)
    report = ClaimReport()
    refused = {}
    for node in g.nodes:
        why = check_node(g, node)
        if why is not None:
            report.declined.append((node, why))
            refused[id(node)] = why
    translation = None
    try:
        translation = translate(g, report, files.meta, kv, refused)
    except Decline as d:
        report.declined.append((d.node, d.reason))
    else:
        inside = {id(n) for cut, _ in translation.external.values() for n in cut.nodes}
        inside |= {id(n) for r, _ in translation.subregions for n in r.nodes}
        rest = [n for n in g.nodes if id(n) not in report.claimed and id(n) not in inside]
        for n in rest:
            report.declined.append((n, "not part of the recognised decoder structure"))
        if rest or any(id(n) not in inside for n, _ in report.declined if n is not None):
            translation = None
        else:
            report.regions = [(i, why) for i, (_, why) in sorted(translation.external.items())]
            report.parts = [(r.layer, r.describe(), why) for r, why in translation.subregions]
    if translation is None:
        report.claimed.clear()
    if debug_enabled():
        print_report(report, len(g.nodes), files.model.name)
    return Inspection(files, g, report, kv, logits, translation)


def _logits_name(g: OnnxGraph, meta: dict) -> str:
    dec = meta.get("decoder") if isinstance(meta.get("decoder"), dict) else {}
    outs = dec.get("outputs") or {}
    name = outs.get("logits", "logits") if isinstance(outs, dict) else None
    if not isinstance(name, str):
        raise ModelFormatError(f"genai_config.json: key 'model.decoder.outputs.logits' must be "
                               f"an output name, got {name!r:.80}")
    if name not in g.outputs:
        raise ModelFormatError(f"{g.path.name}: no '{name}' output: not a decoder graph")
    return name


def build_translated(ins: Inspection, dtype: torch.dtype, device: torch.device):
    """mlxr's decoder from a complete translation; logs the repack time."""
    t = ins.translation
    t0 = time.perf_counter()
    clock = StepClock()
    external = {i: OrtRegion(ins.graph, cut, ins.kv[i], clock)
                for i, (cut, _) in t.external.items()}
    t.checkpoint.set_scale_dtype(dtype if dtype in (torch.bfloat16, torch.float16)
                                 else torch.float32)
    decoder = build_decoder(t.checkpoint, t.config, dtype, device, external=external)
    for r, _ in t.subregions:
        layer = decoder.layers[r.layer]
        hook = OrtSubRegion(ins.graph, r, ins.graph.inputs[ins.kv[0].past_key].elem, clock)
        if r.where == "MLP input":
            layer.mlp_input = hook
        else:
            layer.mlp_act = hook
    if external or t.subregions:
        if device.type != "cpu":
            log.warning("%s: layers (or parts of layers) %s run on onnxruntime's CPU "
                        "provider (tensors cross to the CPU and back each step)",
                        ins.files.model.name,
                        sorted(set(external) | {r.layer for r, _ in t.subregions}))
        decoder = RegionDecoder.wrap(decoder, clock)
    tables = {}
    ropes = []
    for spec, (cos, sin) in zip(t.config.layer_rope, t.rope_tables):
        if (cos, sin) not in tables:
            tables[(cos, sin)] = TableRope(spec, ins.graph.tensor(cos).float(),
                                           ins.graph.tensor(sin).float(), device)
        ropes.append(tables[(cos, sin)])
    decoder.ropes = ropes
    log.info("%s: translated in %.3f s (weight repack %.3f s)", ins.files.model.name,
             time.perf_counter() - t0, t.checkpoint.repack_s[0])
    return decoder


def load_onnx(path, device: torch.device, dtype: torch.dtype, weights: bool = True) -> tuple:
    """An ONNX decoder folder or file as the arguments of a `mlxr.model.Model` (path, config,
    generation config, decoder, dtype, device; see mlxr.load, which builds the Model)."""
    ins = inspect(path)
    if ins.translation is not None:
        config = ins.translation.config
        for line in ins.report.lines():
            log.warning("%s: %s", ins.files.model.name, line)
        decoder = build_translated(ins, dtype, device) if weights else None
        if decoder is not None and all(layer.moe is None for layer in decoder.layers):
            for qw in decoder.quant_weights():  # dense: CPU prefill tiles from 17 rows
                qw.tiles_early = True  # (quant.cpu.i4_max_m says why)
    else:
        config = fallback_config(ins.graph, ins.files.meta, ins.kv, ins.logits)
        for line in ins.report.lines():
            log.warning("%s: %s", ins.files.model.name, line)
        decoder = OrtDecoder(ins.graph, config, ins.kv, ins.logits) if weights else None
        if decoder is not None:
            dtype, device = decoder.dtype, decoder.device
    if decoder is not None:
        trace.instrument(decoder)
    return ins.files.folder, config, dict(ins.files.search), decoder, dtype, device


def describe(path) -> list[str]:
    """`mlxr show` lines for an ONNX decoder: file, claim summary, each declined op."""
    ins = inspect(path)
    g = ins.graph
    lines = [f"onnx: {ins.files.model}", f"nodes: {len(g.nodes)}, layers: {len(ins.kv)}",
             f"claim: {ins.report.summary(len(g.nodes))}"]
    lines += [f"  {x}" for x in ins.report.lines()]
    if ins.translation is not None:
        c = ins.translation.config
        lines.append(f"decoder: hidden {c.hidden_size}, heads {c.num_heads}/{c.num_kv_heads}, "
                     f"head dim {c.head_dim}, vocab {c.vocab_size}, tied "
                     f"{c.tie_word_embeddings}, qk norm {c.qk_norm}")
    return lines
