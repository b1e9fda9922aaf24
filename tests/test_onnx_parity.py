"""ONNX decoders through mlxr.load vs onnxruntime's CPU provider on the same file.

Exports come from the ONNX Runtime GenAI builder at test time (conftest `onnx_exports`; tiny
random weights, 2 layers, hidden 128). The reference disables ORT's int8-activation MatMulNBits
path (accuracy_level=0, see tests/onnx_ref.py): mlxr computes in float.

Tolerances (relative to the largest |logit|):
* fp32 exports: both sides dequantize the same codes into float32 and differ only in
  summation order: ~K*u per dot product (K <= 256, u = 6e-8: 1.5e-5), over ~8 matmul/norm
  stages -> 1e-4.
* fp16 exports: ORT rounds every activation to fp16 (u = 4.9e-4) over ~10 stages -> 1e-2;
  mlxr computes them in float32.
Greedy tokens must agree until ORT's top-2 gap falls under twice the tolerance (a near tie,
where either choice is correct); free-running generation is compared the same way.
"""

from __future__ import annotations

import numpy as np
import pytest

import mlxr
from mlxr.onnx import inspect
from onnx_ref import fp32_reference, greedy, prompt_logits, unfold_qk_norm

TOL_FP32, TOL_FP16 = 1e-4, 1e-2
# name -> (relative tolerance, what the export exercises)
EXPORTS = {
    "llama_int4_cpu": TOL_FP32,  # packed QKV MatMulNBits, GQA RoPE in-op, SkipSLN
    "qwen2_int4_cpu": TOL_FP32,  # + q/k/v bias Add after the packed projection
    "qwen3_int4_cpu": TOL_FP32,  # + Split, Reshape/SLN/Reshape per-head q/k norms
    "llama_tied_shared": TOL_FP32,  # GatherBlockQuantized on the LM head's own weight
    "llama_int4_gather": TOL_FP32,  # GatherBlockQuantized on a signed INT4 table
    "llama_int4_zp128": TOL_FP32,  # uint8 zero points, block 128
    "llama_fp32": TOL_FP32,  # plain MatMul
    "llama_fp16": TOL_FP16,  # fp16 I/O and scales
    "llama_dml": TOL_FP16,  # separate q/k/v, standalone RotaryEmbedding, position_ids
    "qwen3_fp16": TOL_FP16,  # q/k norms folded into GroupQueryAttention (inputs 14/15)
    "gptoss_int4_cpu": TOL_FP32,  # QMoE, attention sinks, a sliding layer, biases
}
PROMPT = [1, 40, 7, 199, 23, 310, 5, 88, 142, 61, 250, 3, 99, 17, 230, 44, 8, 300, 12, 76]


def reference(root, name):
    # ORT CPU refuses GQA's folded q/k norms: its reference moves them back out of the op
    return unfold_qk_norm(root / name) if name == "qwen3_fp16" else fp32_reference(root / name)


@pytest.mark.parametrize("name", list(EXPORTS))
def test_whole_graph_is_claimed(onnx_exports, name):
    ins = inspect(onnx_exports / name)
    assert ins.report.complete, ins.report.lines()
    assert ins.translation is not None
    c = ins.translation.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == (2, 128, 4, 2)
    assert c.tie_word_embeddings == (name == "llama_tied_shared")
    assert c.qkv_bias == (name in ("qwen2_int4_cpu", "gptoss_int4_cpu"))
    assert (c.moe is not None) == c.attn_sinks == (name == "gptoss_int4_cpu")
    assert c.qk_norm == name.startswith("qwen3")
    assert (ins.translation.position_ids == "position_ids") == (name == "llama_dml")


@pytest.mark.parametrize("name", list(EXPORTS))
def test_prompt_logits_match_onnxruntime(onnx_exports, name):
    ref = prompt_logits(reference(onnx_exports, name), PROMPT)
    model = mlxr.load(onnx_exports / name, device="cpu", dtype="float32")
    got = model.logits(PROMPT).numpy()
    tol = EXPORTS[name] * np.abs(ref).max()
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() <= tol
    top2 = np.sort(ref, -1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * tol
    assert clear.sum() >= len(PROMPT) // 2
    assert (got.argmax(-1) == ref.argmax(-1))[clear].all()


@pytest.mark.parametrize("name", ["llama_int4_cpu", "qwen3_int4_cpu", "llama_tied_shared",
                                  "llama_int4_zp128", "llama_dml", "qwen3_fp16",
                                  "gptoss_int4_cpu"])
def test_greedy_generation_matches_onnxruntime(onnx_exports, name):
    n = 16
    want, rows = greedy(reference(onnx_exports, name), PROMPT[:6], n)
    model = mlxr.load(onnx_exports / name, device="cpu", dtype="float32")
    got = list(model.generate(PROMPT[:6], max_tokens=n, ignore_eos=True))
    assert len(got) == n
    for i, (a, b, row) in enumerate(zip(got, want, rows)):
        top2 = np.sort(row)[-2:]
        if top2[1] - top2[0] <= 2 * EXPORTS[name] * np.abs(row).max():
            break  # a near tie: both tokens are right, the sequences may part here
        assert a == b, f"token {i}: mlxr {a}, onnxruntime {b}"


def test_text_generation_and_chat_template_come_from_the_folder(onnx_exports):
    model = mlxr.load(onnx_exports / "llama_int4_cpu", device="cpu", dtype="float32")
    assert model.eos_token_ids[0] == 2
    ids = model.tokenizer.encode("hello quick brown fox")
    chunks = list(model.stream("hello quick brown fox", max_tokens=5, temperature=0.0))
    assert sum(len(c.token_ids) for c in chunks) >= 1
    assert isinstance("".join(c.text for c in chunks), str)
    text = model.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                               add_generation_prompt=True)
    assert "<|user|>hi" in text and text.endswith("<|assistant|>")
    assert len(ids) > 0


def _edit_attention(folder, change) -> None:
    import onnx

    m = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    for n in m.graph.node:
        if n.op_type == "GroupQueryAttention":
            change(n)
    onnx.save(m, str(folder / "model.onnx"))


@pytest.mark.parametrize("attr,value", [("local_window_size", 5), ("softcap", 0.75),
                                        ("rotary_interleaved", 1), ("scale", 0.05)])
def test_attention_variants_match_onnxruntime(onnx_exports, tmp_path, attr, value):
    """GroupQueryAttention's sliding window (W keys including the current one), logit
    soft-cap, interleaved rotary and explicit scale, set on the llama export's nodes: mlxr's
    attention must follow each as ORT does."""
    import onnx

    from onnx_ref import copy_folder

    folder = copy_folder(onnx_exports / "llama_int4_cpu", tmp_path / "m")

    def change(n):
        for a in list(n.attribute):
            if a.name == attr:
                n.attribute.remove(a)
        n.attribute.append(onnx.helper.make_attribute(attr, value))

    _edit_attention(folder, change)
    ins = inspect(folder)
    assert ins.report.complete, ins.report.lines()
    ref = prompt_logits(fp32_reference(folder), PROMPT)
    got = mlxr.load(folder, device="cpu", dtype="float32").logits(PROMPT).numpy()
    assert np.abs(got - ref).max() <= TOL_FP32 * np.abs(ref).max()
    base = prompt_logits(fp32_reference(onnx_exports / "llama_int4_cpu"), PROMPT)
    assert np.abs(base - ref).max() > 100 * TOL_FP32 * np.abs(ref).max()  # the edit matters


def test_bare_onnx_file_loads_without_genai_config(onnx_exports):
    """A bare decoder .onnx (no genai_config.json): layers and KV names come from the graph."""
    path = onnx_exports / "llama_int4_cpu" / "model.onnx"
    got = mlxr.load(path, device="cpu", dtype="float32").logits(PROMPT[:8]).numpy()
    want = mlxr.load(path.parent, device="cpu", dtype="float32").logits(PROMPT[:8]).numpy()
    assert np.array_equal(got, want)


def test_mlx_path_never_imports_onnx():
    import subprocess
    import sys

    code = ("import sys, mlxr; m = mlxr.load('mlxr/bundled/stories260K', device='cpu'); "
            "list(m.generate([1, 2], max_tokens=2)); "
            "assert not [k for k in sys.modules if k.split('.')[0] in ('onnx', 'onnxruntime')]")
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_onnx_rms_normalization_matches_onnxruntime(onnx_exports, tmp_path):
    """Mobius emits the standard RMSNormalization (opset 23+) for the first norm where the
    builder emits ORT's SimplifiedLayerNormalization: both are claimed as the same norm."""
    import onnx

    from onnx_ref import copy_folder

    folder = copy_folder(onnx_exports / "llama_int4_cpu", tmp_path / "m")
    m = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    next(o for o in m.opset_import if o.domain in ("", "ai.onnx")).version = 23
    n = next(n for n in m.graph.node if n.op_type == "SimplifiedLayerNormalization")
    n.op_type = "RMSNormalization"
    onnx.save(m, str(folder / "model.onnx"))
    assert inspect(folder).report.complete
    ref = prompt_logits(fp32_reference(folder), PROMPT)
    got = mlxr.load(folder, device="cpu", dtype="float32").logits(PROMPT).numpy()
    assert np.abs(got - ref).max() <= TOL_FP32 * np.abs(ref).max()


def test_separate_qkv_with_rotary_in_attention(onnx_exports, tmp_path):
    """Mobius' layout: separate q/k/v projections feeding GroupQueryAttention with RoPE in the
    op. Made from the DML export by folding its RotaryEmbedding nodes into the attention."""
    import onnx

    from onnx_ref import copy_folder

    folder = copy_folder(onnx_exports / "llama_dml", tmp_path / "m")
    m = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    g = m.graph
    ropes = {n.output[0]: n for n in g.node if n.op_type == "RotaryEmbedding"}
    for n in g.node:
        if n.op_type == "GroupQueryAttention":
            cos, sin = ropes[n.input[0]].input[2:4]
            n.input[0], n.input[1] = ropes[n.input[0]].input[0], ropes[n.input[1]].input[0]
            n.input[7], n.input[8] = cos, sin
            next(a for a in n.attribute if a.name == "do_rotary").i = 1
    kept = [n for n in g.node if n.op_type != "RotaryEmbedding"]
    g.ClearField("node")
    g.node.extend(kept)
    inputs = [i for i in g.input if i.name != "position_ids"]
    g.ClearField("input")
    g.input.extend(inputs)
    onnx.save(m, str(folder / "model.onnx"))
    ins = inspect(folder)
    assert ins.report.complete and ins.translation.position_ids is None
    ref = prompt_logits(fp32_reference(folder), PROMPT)
    got = mlxr.load(folder, device="cpu", dtype="float32").logits(PROMPT).numpy()
    assert np.abs(got - ref).max() <= TOL_FP16 * np.abs(ref).max()


def test_dense_exports_prefill_on_early_tiles_in_bf16(onnx_exports):
    """Weights repacked from a dense export take the CPU prefill tiles from 17 rows
    (`QuantWeight.tiles_early`, quant.cpu.i4_max_m); a QMoE export keeps the MLX rule. The
    bf16 prompt (20 rows: the tiles where the compiled dequant serves) stays within bf16 noise
    of the float32 one, with the same argmax at the last position."""
    import torch

    from mlxr.quant import cpu

    bf16 = mlxr.load(onnx_exports / "llama_int4_cpu", device="cpu", dtype="bfloat16")
    qws = bf16.decoder.quant_weights()
    assert qws and all(qw.tiles_early for qw in qws)
    assert any(cpu.i4_max_m(qw) == cpu.I4_MAX_M_DEQ for qw in qws) == any(
        cpu.deq_serves(qw) for qw in qws)
    got = bf16.logits(PROMPT).float()
    want = mlxr.load(onnx_exports / "llama_int4_cpu", device="cpu",
                     dtype="float32").logits(PROMPT).float()
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
    assert torch.equal(got[-1].argmax(), want[-1].argmax())
    moe = mlxr.load(onnx_exports / "gptoss_int4_cpu", device="cpu", dtype="bfloat16")
    assert not any(qw.tiles_early for qw in moe.decoder.quant_weights())
