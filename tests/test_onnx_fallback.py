"""Graphs mlxr does not fully claim run on onnxruntime's CPU provider, with a claim report
naming each declined op, how many and why (MLXR_ONNX_CLAIM_DEBUG=1 and `mlxr show`)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnx
import pytest

import mlxr
from mlxr.onnx.fallback import OrtDecoder
from onnx_ref import copy_folder, greedy, prompt_logits, session

PROMPT = [1, 40, 7, 199, 23, 310, 5, 88]


@pytest.fixture(scope="module")
def odd_graph(onnx_exports, tmp_path_factory):
    """The llama export with an op mlxr has no translation for in the middle of layer 0:
    Softsign(o_proj) - Softsign(o_proj) + o_proj (so the values stay those of a decoder)."""
    folder = copy_folder(onnx_exports / "llama_int4_cpu",
                         tmp_path_factory.mktemp("odd") / "llama_odd")
    m = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    g = m.graph
    o = next(n for n in g.node if n.op_type == "MatMulNBits" and "layers.0/attn/o_proj"
             in n.name)
    out = o.output[0]
    o.output[0] = out + "/raw"
    extra = [onnx.helper.make_node("Softsign", [out + "/raw"], [out + "/ss"], name="odd/ss"),
             onnx.helper.make_node("Sub", [out + "/ss", out + "/ss"], [out + "/zero"],
                                   name="odd/sub"),
             onnx.helper.make_node("Add", [out + "/raw", out + "/zero"], [out], name="odd/add")]
    i = list(g.node).index(o)
    nodes = list(g.node)
    g.ClearField("node")
    g.node.extend(nodes[:i + 1] + extra + nodes[i + 1:])
    onnx.save(m, str(folder / "model.onnx"))
    return folder


def test_unclaimed_op_runs_on_onnxruntime(odd_graph, capfd, monkeypatch):
    monkeypatch.setenv("MLXR_ONNX_CLAIM_DEBUG", "1")
    model = mlxr.load(odd_graph, device="cpu", dtype="float32")
    err = capfd.readouterr().err
    assert "declined ai.onnx:Softsign x1: mlxr has no translation for this op" in err
    assert isinstance(model.decoder, OrtDecoder)
    ref = session(odd_graph / "model.onnx")  # the same file, int8 activations and all
    assert np.array_equal(model.logits(PROMPT).numpy(), prompt_logits(ref, PROMPT))
    want, _ = greedy(ref, PROMPT, 10)
    assert list(model.generate(PROMPT, max_tokens=10, ignore_eos=True)) == want


def test_fallback_session_is_onnxruntime(odd_graph):
    ours = mlxr.onnx.InferenceSession(odd_graph)
    assert not ours.claimed
    ref = session(odd_graph / "model.onnx")
    from onnx_ref import empty_past, step_feeds

    feeds = step_feeds(ref, np.array([PROMPT]), empty_past(ref, 1), 0)
    names = [o.name for o in ref.get_outputs()]
    for a, b in zip(ours.run(names, feeds), ref.run(names, feeds)):
        assert np.array_equal(a, b)


def test_mlxr_show_prints_the_claim_report(odd_graph, onnx_exports):
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-m", "mlxr", "show", str(odd_graph)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "declined 1 of" in out.stdout and "ai.onnx:Softsign x1" in out.stdout
    out = subprocess.run([sys.executable, "-m", "mlxr", "show",
                          str(onnx_exports / "qwen3_int4_cpu" / "model.onnx")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "claimed all 51 nodes" in out.stdout and "qk norm True" in out.stdout


def test_attention_sinks_are_declined_and_run_on_onnxruntime(onnx_exports, tmp_path):
    """GroupQueryAttention with head_sink (gpt-oss's sinks) is valid but not in mlxr's
    attention: declined with that reason, and the graph's answer comes from onnxruntime."""
    folder = copy_folder(onnx_exports / "llama_int4_cpu", tmp_path / "sinks")
    m = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    m.graph.initializer.append(onnx.helper.make_tensor("sinks", onnx.TensorProto.FLOAT, [4],
                                                       [0.5, -1.0, 2.0, 0.0]))
    for n in m.graph.node:
        if n.op_type == "GroupQueryAttention":
            while len(n.input) < 12:
                n.input.append("")
            n.input[11] = "sinks"
    onnx.save(m, str(folder / "model.onnx"))
    ins = mlxr.onnx.inspect(folder)
    assert ins.report.lines() == ["declined com.microsoft:GroupQueryAttention x2: input "
                                  "head_sink (sinks) is not in mlxr's attention"]
    model = mlxr.load(folder, device="cpu", dtype="float32")
    assert isinstance(model.decoder, OrtDecoder)
    ref = session(folder / "model.onnx")
    assert np.array_equal(model.logits(PROMPT).numpy(), prompt_logits(ref, PROMPT))


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
