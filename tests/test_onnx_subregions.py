"""Fallback regions smaller than a layer: an op mlxr has no translation for in a layer's MLP
sends only its neighbourhood to onnxruntime's CPU provider -- the MLP's activation (between
gate/up and down) or what lies between the MLP norm and the projections -- while mlxr runs
the rest of that layer (attention, KV cache, projections, residual adds) on its own kernels.

The injected ops change what the graph computes (tests/onnx_ref.py `with_unknown_ops`):
Softsign in place of the SiLU's Sigmoid, an LpNormalization on the MLP norm's output. So a
region that were skipped moves the logits far past the tolerance, and the parity checks can
fail. Tolerance as in test_onnx_parity (fp32 export, float activations on both sides: 1e-4 of
the largest logit); greedy tokens agree up to ORT's first near tie.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import mlxr
from mlxr.harness import trace
from mlxr.onnx.regions import RegionDecoder
from onnx_ref import assert_matches_ort, fp32_reference, prompt_logits, with_unknown_ops

PROMPT = [1, 40, 7, 199, 23, 310, 5, 88]
TOL = 1e-4
ACT = "layer 0 MLP activation (3 nodes: Mul, Softsign): onnxruntime CPU (Softsign: mlxr has " \
      "no translation for this op)"
NORM = "layer 1 MLP input (1 node: LpNormalization): onnxruntime CPU (LpNormalization: mlxr " \
       "has no translation for this op)"
CASES = {"activation": (dict(activation="layers.0/mlp"), [ACT]),
         "norm": (dict(norm="layers.1/post_attention_layernorm"), [NORM]),
         "both": (dict(activation="layers.0/mlp", norm="layers.1/post_attention_layernorm"),
                  [ACT, NORM])}


@pytest.fixture(scope="module")
def graphs(onnx_exports, tmp_path_factory):
    root = tmp_path_factory.mktemp("subregions")
    return {k: with_unknown_ops(onnx_exports / "llama_int4_cpu", root / k, **kw)
            for k, (kw, _) in CASES.items()}


def _close(got: np.ndarray, ref: np.ndarray) -> None:
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() <= TOL * np.abs(ref).max()


@pytest.mark.parametrize("case", list(CASES))
def test_region_is_part_of_a_layer(graphs, case):
    """The claim report names the op and the part of the layer; every layer stays mlxr's,
    with its projections, attention and cache; logits and greedy tokens are ORT's."""
    folder = graphs[case]
    ins = mlxr.onnx.inspect(folder)
    op = {"activation": ["Softsign"], "norm": ["LpNormalization"],
          "both": ["LpNormalization", "Softsign"]}[case]
    assert ins.report.lines() == [f"declined ai.onnx:{o} x1: mlxr has no translation for this "
                                  "op" for o in op] + CASES[case][1]
    assert not ins.report.regions
    assert "onnxruntime's CPU provider part(s) of layer(s)" in ins.report.summary(1)
    model = mlxr.load(folder, device="cpu", dtype="float32")
    assert isinstance(model.decoder, RegionDecoder)
    layers = model.decoder.layers
    assert all(lay.external is None and lay.qkv is not None for lay in layers)
    assert [(lay.mlp_act is not None, lay.mlp_input is not None) for lay in layers] == {
        "activation": [(True, False), (False, False)], "norm": [(False, False), (False, True)],
        "both": [(True, False), (False, True)]}[case]
    assert_matches_ort(model, folder, PROMPT, TOL)


def test_skipping_a_region_moves_the_logits(graphs):
    """Each region computes its part (not a pass-through): with mlxr's own SiLU in place of
    the activation region, or the norm's output passed straight on, the logits are far from
    onnxruntime's."""
    folder = graphs["both"]
    ref = prompt_logits(fp32_reference(folder), PROMPT)
    model = mlxr.load(folder, device="cpu", dtype="float32")
    act, norm = model.decoder.layers[0].mlp_act, model.decoder.layers[1].mlp_input
    _close(model.logits(PROMPT).numpy(), ref)
    for layer, name, skip in ((0, "mlp_act", lambda g, u: torch.nn.functional.silu(g) * u),
                              (1, "mlp_input", lambda x: x)):
        setattr(model.decoder.layers[layer], name, skip)
        moved = model.logits(PROMPT).numpy()
        assert np.abs(moved - ref).max() > 100 * TOL * np.abs(ref).max(), name
        model.decoder.layers[0].mlp_act, model.decoder.layers[1].mlp_input = act, norm


def test_regions_are_trace_spans(graphs, tmp_path):
    model = mlxr.load(graphs["both"], device="cpu", dtype="float32")
    path = tmp_path / "trace.json"
    trace.start(str(path))
    try:
        list(model.generate(PROMPT, max_tokens=2, ignore_eos=True))
    finally:
        trace.stop()
    events = json.loads(path.read_text())["traceEvents"]
    ort = [(e["args"]["layer"], e["args"]["part"], e["args"]["tokens"]) for e in events
           if e["name"] == "onnxruntime"]
    assert ort == [(0, "MLP activation", len(PROMPT)), (1, "MLP input", len(PROMPT)),
                   (0, "MLP activation", 1), (1, "MLP input", 1)]
    spans = [e["args"]["layers"] for e in events if e["name"] == "mlxr"]
    assert spans == ["0..0 (MLP activation)", "0..1 (MLP input)", "1..head"] * 2


def test_session_api_runs_the_regions(graphs):
    """mlxr.onnx.InferenceSession on a graph with both regions: the graph's own outputs,
    equal to onnxruntime's, for the prompt and a decode step."""
    from onnx_ref import empty_past, step_feeds

    ours = mlxr.onnx.InferenceSession(graphs["both"])
    assert ours.claimed
    ref = fp32_reference(graphs["both"])
    names = [o.name for o in ref.get_outputs()]
    feeds = step_feeds(ref, np.array([PROMPT]), empty_past(ref, 1), 0)
    want = ref.run(names, feeds)
    for a, b in zip(ours.run(names, feeds), want):
        _close(a, b)
    past = {k.replace("present.", "past_key_values."): v for k, v in zip(names, want)
            if k.startswith("present.")}
    feeds = step_feeds(ref, want[0][:, -1:].argmax(-1), past, len(PROMPT))
    for a, b in zip(ours.run(names, feeds), ref.run(names, feeds)):
        _close(a, b)
