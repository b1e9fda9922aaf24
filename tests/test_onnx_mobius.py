"""Mobius exports (tests/mobius_build.py, built at test time) through mlxr vs onnxruntime's CPU
provider on the same file.

Mobius writes the decoder differently from the GenAI builder: separate q/k/v MatMulNBits
(GGUF int4) or one concatenated MatMul (fp32 `build`), the standard RMSNormalization (opset
24) for the first norm, Constant `value_int` nodes and an initializer index in the mask
subgraph, named (unused) mean / inv_std outputs on every SkipSimplifiedLayerNormalization,
a GatherBlockQuantized embedding (Q4_1: with uint8 zero points), and no genai_config.json from
`build-gguf` (the bare model.onnx is loaded). mlxr claims every node of each.

Tolerances (relative to the largest |logit|), as in test_onnx_parity: the reference disables
ORT's int8-activation path (accuracy_level=0), so fp32 exports differ only in summation order
(~K*u per dot product, K <= 256, u = 6e-8, over ~8 stages: 1e-4); the fp16 export rounds
every activation to fp16 on ORT's side (u = 4.9e-4 over ~10 stages: 1e-2). Greedy tokens must
agree until ORT's top-2 gap falls under twice the tolerance (a near tie).
"""

from __future__ import annotations

import numpy as np
import pytest

import mlxr
from mlxr.onnx import inspect
from onnx_ref import empty_past, fp32_reference, greedy, prompt_logits, step_feeds

TOL_FP32, TOL_FP16 = 1e-4, 1e-2
# name -> (tolerance, MatMulNBits count, what the export exercises)
EXPORTS = {
    "mobius_llama_f32": (TOL_FP32, 0),  # plain MatMul, q/k/v concatenated into one
    "mobius_qwen3_f32": (TOL_FP32, 0),  # + Reshape / RMSNormalization / Reshape q/k norms
    "mobius_llama_q4_0": (TOL_FP32, 15),  # separate q/k/v int4, GBQ embedding
    "mobius_llama_q4_1": (TOL_FP32, 15),  # + uint8 zero points (MatMulNBits and GBQ)
    "mobius_llama_q4_0_fp16": (TOL_FP16, 15),  # fp16 I/O and scales ("cuda" flavour)
}
PROMPT = [1, 40, 7, 199, 23, 310, 5, 88, 142, 61, 250, 3, 99, 17, 230, 44, 8, 300, 12, 76]


def model_path(root, name):
    """The folder where Mobius wrote genai_config.json (`build`), else the bare model.onnx
    (`build-gguf` writes none; the reference's rewritten copy sits beside it)."""
    folder = root / name
    return folder if (folder / "genai_config.json").is_file() else folder / "model.onnx"


@pytest.mark.parametrize("name", list(EXPORTS))
def test_whole_graph_is_claimed(mobius_exports, name):
    ins = inspect(model_path(mobius_exports, name))
    assert ins.report.complete, ins.report.lines()
    ops = [n.op_type for n in ins.graph.nodes]
    assert ops.count("MatMulNBits") == EXPORTS[name][1]
    assert "RMSNormalization" in ops  # the ONNX-standard norm, not ORT's own
    c = ins.translation.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == (2, 128, 4, 2)
    assert c.qk_norm == (name == "mobius_qwen3_f32")
    assert c.torch_dtype == ("float16" if name.endswith("fp16") else "float32")
    if "q4_1" in name:  # zero points on the projections and the embedding
        gbq = next(n for n in ins.graph.nodes if n.op_type == "GatherBlockQuantized")
        assert len(gbq.input) > 3 and gbq.input[3]


@pytest.mark.parametrize("name", list(EXPORTS))
def test_prompt_logits_match_onnxruntime(mobius_exports, name):
    """Teacher-forced: every row of the prompt's logits, and its argmax where not a tie."""
    ref = prompt_logits(fp32_reference(mobius_exports / name), PROMPT)
    got = mlxr.load(model_path(mobius_exports, name), device="cpu",
                    dtype="float32").logits(PROMPT).numpy()
    tol = EXPORTS[name][0] * np.abs(ref).max()
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() <= tol
    top2 = np.sort(ref, -1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * tol
    assert clear.sum() >= len(PROMPT) // 2
    assert (got.argmax(-1) == ref.argmax(-1))[clear].all()


@pytest.mark.parametrize("name", ["mobius_qwen3_f32", "mobius_llama_q4_0", "mobius_llama_q4_1",
                                  "mobius_llama_q4_0_fp16"])
def test_greedy_generation_matches_onnxruntime(mobius_exports, name):
    """Free-running: mlxr's own KV cache and decode steps against ORT's growing cache."""
    n, tol = 16, EXPORTS[name][0]
    want, rows = greedy(fp32_reference(mobius_exports / name), PROMPT[:6], n)
    model = mlxr.load(model_path(mobius_exports, name), device="cpu", dtype="float32")
    got = list(model.generate(PROMPT[:6], max_tokens=n, ignore_eos=True))
    assert len(got) == n
    for i, (a, b, row) in enumerate(zip(got, want, rows)):
        top2 = np.sort(row)[-2:]
        if top2[1] - top2[0] <= 2 * tol * np.abs(row).max():
            break  # a near tie: both tokens are right, the sequences may part here
        assert a == b, f"token {i}: mlxr {a}, onnxruntime {b}"


@pytest.mark.parametrize("name", ["mobius_llama_f32", "mobius_llama_q4_1",
                                  "mobius_llama_q4_0_fp16"])
def test_session_matches_onnxruntime(mobius_exports, name):
    """mlxr.onnx.InferenceSession on the graph's own feeds (a batch of two prompts, then
    decode steps fed ORT's presents): every output in the graph's shapes and dtypes."""
    tol = EXPORTS[name][0]
    ref = fp32_reference(mobius_exports / name)
    ours = mlxr.onnx.InferenceSession(model_path(mobius_exports, name))
    assert ours.claimed
    names = [o.name for o in ref.get_outputs()]
    ids = np.random.default_rng(0).integers(3, 384, (2, 7))
    past, start = empty_past(ref, 2), 0
    for step in range(3):
        feeds = step_feeds(ref, ids, past, start)
        want = dict(zip(names, ref.run(names, feeds)))
        got = dict(zip(names, ours.run(names, feeds)))
        for k in names:
            w, g = want[k], got[k]
            assert g.shape == w.shape and g.dtype == w.dtype, (step, k)
            w32 = w.astype(np.float32)
            assert np.abs(g.astype(np.float32) - w32).max() <= tol * max(
                1.0, np.abs(w32).max()), (step, k)
        start += ids.shape[1]
        past = {k.replace("present.", "past_key_values."): v for k, v in want.items()
                if k.startswith("present.")}
        ids = want["logits"][:, -1].argmax(-1)[:, None]
