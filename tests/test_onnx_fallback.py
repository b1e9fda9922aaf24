"""What mlxr does not claim runs on onnxruntime's CPU provider: a declined layer as its own
subgraph session between mlxr's layers, anything outside the layers as the whole graph; the
claim report names each declined op, how many, why, and which layers ran where
(MLXR_ONNX_CLAIM_DEBUG=1 and `mlxr show`)."""

from __future__ import annotations

import os
import subprocess
import sys

import json

import numpy as np
import onnx
import pytest
import torch

import mlxr
from decode_checks import run_ids
from mlxr.harness import trace
from mlxr.onnx.fallback import OrtDecoder
from mlxr.onnx.regions import RegionDecoder
from onnx_ref import (assert_matches_ort, copy_folder, fp32_reference, greedy, odd_copy,
                      prompt_logits, session)

PROMPT = [1, 40, 7, 199, 23, 310, 5, 88]
TOL = 1e-4  # fp32 export, float activations on both sides (see test_onnx_parity)


@pytest.fixture(scope="module")
def odd_graph(onnx_exports, tmp_path_factory):
    """The llama export with an unclaimable op in layer 0's attention output."""
    return odd_copy(onnx_exports / "llama_int4_cpu", tmp_path_factory.mktemp("odd") / "odd",
                    "layers.0/attn/o_proj")


def _close(got: np.ndarray, ref: np.ndarray) -> None:
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() <= TOL * np.abs(ref).max()


@pytest.mark.parametrize("where,layer", [("layers.0/attn/o_proj", 0),
                                         ("layers.1/mlp/down_proj", 1),
                                         ("layers.1/attn/qkv_proj", 1)])
def test_unclaimed_op_runs_its_layer_on_onnxruntime(onnx_exports, tmp_path, capfd,
                                                    monkeypatch, where, layer):
    """The layer holding the op runs on onnxruntime, the other layer, embedding and head on
    mlxr; logits and greedy tokens are those of onnxruntime on the whole file."""
    folder = odd_copy(onnx_exports / "llama_int4_cpu", tmp_path / "odd", where)
    monkeypatch.setenv("MLXR_ONNX_CLAIM_DEBUG", "1")
    model = mlxr.load(folder, device="cpu", dtype="float32")
    err = capfd.readouterr().err
    assert "declined ai.onnx:Softsign x1: mlxr has no translation for this op" in err
    assert (f"layer {layer}: onnxruntime CPU (Softsign: mlxr has no translation for this op)"
            in err)
    assert isinstance(model.decoder, RegionDecoder)
    ext = [i for i, lay in enumerate(model.decoder.layers) if lay.external is not None]
    assert ext == [layer]
    assert_matches_ort(model, folder, PROMPT, TOL)


def test_region_carries_the_layer(odd_graph, onnx_exports):
    """The onnxruntime region computes the layer (not a pass-through): without the layer the
    logits are far from the reference."""
    model = mlxr.load(odd_graph, device="cpu", dtype="float32")
    region = model.decoder.layers[0].external
    ref = prompt_logits(fp32_reference(odd_graph), PROMPT)
    model.decoder.layers[0].external = lambda x, h, i, pool, slots: (h, torch.zeros_like(h))
    skipped = model.logits(PROMPT).numpy()
    assert np.abs(skipped - ref).max() > 100 * TOL * np.abs(ref).max()
    model.decoder.layers[0].external = region
    _close(model.logits(PROMPT).numpy(), ref)


def test_regions_are_trace_spans(odd_graph, tmp_path):
    model = mlxr.load(odd_graph, device="cpu", dtype="float32")
    path = tmp_path / "trace.json"
    trace.start(str(path))
    try:
        list(model.generate(PROMPT, max_tokens=3, ignore_eos=True))
    finally:
        trace.stop()
    events = json.loads(path.read_text())["traceEvents"]
    ort_spans = [e for e in events if e["name"] == "onnxruntime"]
    mlxr_spans = [e for e in events if e["name"] == "mlxr"]
    assert [e["args"]["layer"] for e in ort_spans] == [0, 0, 0]
    assert [e["args"]["tokens"] for e in ort_spans] == [len(PROMPT), 1, 1]
    # per step: the embedding before the region, layer 1 and the head after it
    assert [e["args"]["layers"] for e in mlxr_spans] == ["0..-1", "1..head"] * 3
    assert all(e["dur"] > 0 for e in ort_spans + mlxr_spans)


def test_fallback_session_mixes_mlxr_and_onnxruntime(odd_graph):
    ours = mlxr.onnx.InferenceSession(odd_graph)
    assert ours.claimed
    ref = fp32_reference(odd_graph)
    from onnx_ref import empty_past, step_feeds

    feeds = step_feeds(ref, np.array([PROMPT]), empty_past(ref, 1), 0)
    names = [o.name for o in ref.get_outputs()]
    for a, b in zip(ours.run(names, feeds), ref.run(names, feeds)):
        _close(a, b)


def test_op_outside_the_layers_sends_the_graph_to_onnxruntime(onnx_exports, tmp_path):
    """An unclaimable op after the LM head is in no layer: the whole graph runs on
    onnxruntime, as the file computes it."""
    folder = odd_copy(onnx_exports / "llama_int4_cpu", tmp_path / "head", "lm_head")
    model = mlxr.load(folder, device="cpu", dtype="float32")
    assert isinstance(model.decoder, OrtDecoder)
    ins = mlxr.onnx.inspect(folder)
    assert "declined ai.onnx:Softsign x1: mlxr has no translation for this op" in \
        ins.report.lines()
    assert not ins.report.regions
    ref = session(folder / "model.onnx")  # the same file, int8 activations and all
    assert np.array_equal(model.logits(PROMPT).numpy(), prompt_logits(ref, PROMPT))
    want, _ = greedy(ref, PROMPT, 10)
    assert list(model.generate(PROMPT, max_tokens=10, ignore_eos=True)) == want


def test_mlxr_show_prints_the_claim_report(odd_graph, onnx_exports):
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-m", "mlxr", "show", str(odd_graph)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "onnxruntime's CPU provider layer(s) 0" in out.stdout
    assert "ai.onnx:Softsign x1" in out.stdout
    assert "layer 0: onnxruntime CPU (Softsign" in out.stdout
    out = subprocess.run([sys.executable, "-m", "mlxr", "show",
                          str(onnx_exports / "qwen3_int4_cpu" / "model.onnx")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "claimed all 51 nodes" in out.stdout and "qk norm True" in out.stdout


def _with_sinks(src, dst, layers: set[int]):
    folder = copy_folder(src, dst)
    m = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    m.graph.initializer.append(onnx.helper.make_tensor("sinks", onnx.TensorProto.FLOAT, [4],
                                                       [0.5, -1.0, 2.0, 0.0]))
    gqas = [n for n in m.graph.node if n.op_type == "GroupQueryAttention"]
    for i, n in enumerate(gqas):
        if i in layers:
            while len(n.input) < 12:
                n.input.append("")
            n.input[11] = "sinks"
    onnx.save(m, str(folder / "model.onnx"))
    return folder


def test_attention_sinks_match_onnxruntime(onnx_exports, tmp_path):
    """GroupQueryAttention's head_sink (gpt-oss's sinks: one more logit per head in the
    softmax, no value) is mlxr's attention sinks."""
    folder = _with_sinks(onnx_exports / "llama_int4_cpu", tmp_path / "sinks", {0, 1})
    ins = mlxr.onnx.inspect(folder)
    assert ins.report.complete, ins.report.lines()
    assert ins.translation.config.attn_sinks
    ref = prompt_logits(fp32_reference(folder), PROMPT)
    _close(mlxr.load(folder, device="cpu", dtype="float32").logits(PROMPT).numpy(), ref)
    base = prompt_logits(fp32_reference(onnx_exports / "llama_int4_cpu"), PROMPT)
    assert np.abs(base - ref).max() > 100 * TOL * np.abs(ref).max()  # the sinks matter


def test_a_layer_unlike_the_others_runs_on_onnxruntime(onnx_exports, tmp_path):
    """Sinks on layer 1 only: mlxr's decoder has one attention variant for all layers, so
    layer 1 is left to onnxruntime, with that reason."""
    folder = _with_sinks(onnx_exports / "llama_int4_cpu", tmp_path / "sinks1", {1})
    ins = mlxr.onnx.inspect(folder)
    assert ins.report.lines() == ["layer 1: onnxruntime CPU (the layer differs from the others "
                                  "in heads, scale, softcap, sinks, MoE, norms or biases)"]
    ref = prompt_logits(fp32_reference(folder), PROMPT)
    _close(mlxr.load(folder, device="cpu", dtype="float32").logits(PROMPT).numpy(), ref)


def test_extra_graph_output_is_declined(onnx_exports, tmp_path):
    """A graph that also exports a hidden state is not only a decoder: mlxr's decoder cannot
    produce that output, so the graph runs on onnxruntime."""
    folder = copy_folder(onnx_exports / "llama_int4_cpu", tmp_path / "extra")
    m = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    hidden = next(n for n in m.graph.node if n.op_type == "SimplifiedLayerNormalization")
    m.graph.output.append(onnx.helper.make_tensor_value_info(hidden.output[0],
                                                             onnx.TensorProto.FLOAT, None))
    onnx.save(m, str(folder / "model.onnx"))
    ins = mlxr.onnx.inspect(folder)
    assert ins.translation is None
    assert ins.report.lines()[0].startswith("declined graph x1: graph inputs/outputs [")


def test_serving_engine_batches_a_graph_partly_on_onnxruntime(odd_graph):
    """The serving engine runs a RegionDecoder one sequence per forward (its own caches, as
    for the hybrid families): concurrent greedy requests give each request's own tokens."""
    from mlxr.engine import EngineRequest, LLMEngine
    from mlxr.text.sampling import SamplingParams

    model = mlxr.load(odd_graph, device="cpu", dtype="float32")
    prompts = [PROMPT, PROMPT[3:], [5, 6, 7]]
    n = 6
    engine = LLMEngine(model, max_num_seqs=3, max_num_batched_tokens=8)
    assert engine.seq_caches is not None
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    outs = run_ids(engine, [EngineRequest(p, params) for p in prompts])
    for p, got in zip(prompts, outs):
        assert got == list(model.generate(p, max_tokens=n, ignore_eos=True))
