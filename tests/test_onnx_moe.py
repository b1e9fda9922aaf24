"""gpt-oss exports (ONNX Runtime GenAI builder, tiny random weights): QMoE on mlxr's MoE block,
GroupQueryAttention's sinks, a sliding layer with a window-sized KV buffer; against
onnxruntime's CPU provider on the same file (float activations, see tests/onnx_ref.py).
Tolerance as test_onnx_parity's fp32 exports (1e-4 of the largest |logit|)."""

from __future__ import annotations

import numpy as np
import onnx

import mlxr
from decode_checks import run_ids
from mlxr.onnx import inspect
from mlxr.onnx.regions import RegionDecoder
from onnx_ref import copy_folder, empty_past, fp32_reference, prompt_logits, step_feeds

TOL = 1e-4
PROMPT = [1, 40, 7, 199, 23, 310, 5, 88, 142, 61, 250, 3, 99, 17, 230, 44, 8, 300, 12, 76]
NAME = "gptoss_int4_cpu"


def _close(got: np.ndarray, ref: np.ndarray) -> None:
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() <= TOL * np.abs(ref).max()


def test_export_is_claimed_as_a_moe_decoder(onnx_exports):
    ins = inspect(onnx_exports / NAME)
    assert ins.report.complete, ins.report.lines()
    c = ins.translation.config
    m = c.moe
    assert (m.num_experts, m.top_k, m.expert_size) == (4, 2, 128)
    assert (m.router, m.expert_act, m.act_limit) == ("topk_softmax", "swiglu_oai", 7.0)
    assert abs(m.act_alpha - 1.702) < 1e-6
    assert c.attn_sinks and c.qkv_bias and c.o_bias
    assert c.layer_window == (8, None)


def test_window_buffer_reference_is_the_full_cache(onnx_exports):
    """The reference runs the sliding layer on a full-length cache (sliding_window_cache=0):
    on the file itself, with the window-sized buffer it declares, the prompt's logits are
    the same -- what lets mlxr claim the layer as windowed attention over its own cache."""
    folder = onnx_exports / NAME
    ref = fp32_reference(folder)
    window_file = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    for n in window_file.graph.node:
        for a in n.attribute:
            if a.name == "accuracy_level":
                a.i = 0
    onnx.save(window_file, str(folder / "model_window.onnx"))
    from onnx_ref import session

    own = session(folder / "model_window.onnx")
    past = empty_past(own, 1)
    for part in ("key", "value"):  # layer 0's window-sized buffer: capacity 8, nothing valid
        past[f"past_key_values.0.{part}"] = np.zeros((1, 2, 8, 32), np.float32)
    got = own.run(["logits"], step_feeds(own, np.array([PROMPT]), past, 0))[0][0]
    assert np.array_equal(got, prompt_logits(ref, PROMPT))


def test_prompt_logits_match_onnxruntime(onnx_exports):
    model = mlxr.load(onnx_exports / NAME, device="cpu", dtype="float32")
    _close(model.logits(PROMPT).numpy(), prompt_logits(fp32_reference(onnx_exports / NAME),
                                                       PROMPT))


def _edit_moe(src, dst, layer: int, attr: str, value):
    folder = copy_folder(src, dst)
    m = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    n = [n for n in m.graph.node if n.op_type == "QMoE"][layer]
    next(a for a in n.attribute if a.name == attr).f = value
    onnx.save(m, str(folder / "model.onnx"))
    return folder


def test_moe_parameters_follow_the_graph(onnx_exports, tmp_path):
    """The clamp limit and the gate's sigmoid scale are read from the nodes (the same in both
    layers: mlxr's decoder has one MoE variant)."""
    folder = onnx_exports / NAME
    for j, (layer, attr, value) in enumerate([(0, "swiglu_limit", 0.5), (1, "swiglu_limit", 0.5),
                                              (0, "activation_alpha", 0.9),
                                              (1, "activation_alpha", 0.9)]):
        folder = _edit_moe(folder, tmp_path / f"m{j}", layer, attr, value)
    ref = prompt_logits(fp32_reference(folder), PROMPT)
    base = prompt_logits(fp32_reference(onnx_exports / NAME), PROMPT)
    assert np.abs(base - ref).max() > 100 * TOL * np.abs(ref).max()  # the edits matter
    assert inspect(folder).report.complete
    _close(mlxr.load(folder, device="cpu", dtype="float32").logits(PROMPT).numpy(), ref)


def test_a_moe_mlxr_cannot_take_runs_its_layer_on_onnxruntime(onnx_exports, tmp_path):
    """A SwiGLU with beta 0.5 is not gpt-oss's (mlxr's block adds 1): layer 1 runs on
    onnxruntime with that reason, the rest on mlxr, with onnxruntime's logits."""
    folder = _edit_moe(onnx_exports / NAME, tmp_path / "beta", 1, "activation_beta", 0.5)
    ins = inspect(folder)
    assert ins.report.lines() == [
        "declined com.microsoft:QMoE x1: a SwiGLU other than gpt-oss's (beta 1, limit before "
        "the activation)",
        "layer 1: onnxruntime CPU (QMoE: a SwiGLU other than gpt-oss's (beta 1, limit before "
        "the activation))"]
    model = mlxr.load(folder, device="cpu", dtype="float32")
    assert isinstance(model.decoder, RegionDecoder)
    _close(model.logits(PROMPT).numpy(), prompt_logits(fp32_reference(folder), PROMPT))


def test_the_sliding_layer_runs_as_a_region_on_mlxr_cache(onnx_exports, tmp_path):
    """Layer 0 (window-sized buffer) declined: its region reads mlxr's full cache; decode
    steps past the window still match."""
    folder = _edit_moe(onnx_exports / NAME, tmp_path / "beta0", 0, "activation_beta", 0.5)
    model = mlxr.load(folder, device="cpu", dtype="float32")
    assert [lay.external is not None for lay in model.decoder.layers] == [True, False]
    from onnx_ref import greedy

    want, rows = greedy(fp32_reference(folder), PROMPT[:10], 6)  # 16 positions: past the window
    got = list(model.generate(PROMPT[:10], max_tokens=6, ignore_eos=True))
    for i, (a, b, row) in enumerate(zip(got, want, rows)):
        top2 = np.sort(row)[-2:]
        if top2[1] - top2[0] <= 2 * TOL * np.abs(row).max():
            break
        assert a == b, f"token {i}: mlxr {a}, onnxruntime {b}"


def test_expert_zero_points_match_onnxruntime(onnx_exports, tmp_path):
    """QMoE's packed uint8 zero points (inputs 11/12, one code per block, LSB first) become
    the experts' MLX biases, as MatMulNBits' do."""
    folder = copy_folder(onnx_exports / NAME, tmp_path / "zp")
    m = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    rng = np.random.default_rng(0)
    inits = {t.name: t for t in m.graph.initializer}
    for n in [n for n in m.graph.node if n.op_type == "QMoE"]:
        while len(n.input) < 13:
            n.input.append("")
        for j, w, s in ((11, n.input[2], n.input[3]), (12, n.input[5], n.input[6])):
            experts, rows, _ = inits[w].dims
            blocks = inits[s].dims[2]
            zp = rng.integers(0, 256, (experts, rows, (blocks + 1) // 2), dtype=np.uint8)
            m.graph.initializer.append(onnx.numpy_helper.from_array(zp, f"{n.name}/zp{j}"))
            n.input[j] = f"{n.name}/zp{j}"
    onnx.save(m, str(folder / "model.onnx"))
    assert inspect(folder).report.complete
    ref = prompt_logits(fp32_reference(folder), PROMPT)
    base = prompt_logits(fp32_reference(onnx_exports / NAME), PROMPT)
    assert np.abs(base - ref).max() > 100 * TOL * np.abs(ref).max()  # the zero points matter
    _close(mlxr.load(folder, device="cpu", dtype="float32").logits(PROMPT).numpy(), ref)


def test_whole_graph_fallback_runs_window_buffers_as_full_caches(onnx_exports, tmp_path):
    """An op after the LM head sends the gpt-oss graph to onnxruntime whole; its sliding
    layer's window-sized buffer runs as a full-length one (the graph rewritten in memory),
    so mlxr's growing cache feeds it: tokens past the window equal the file's, and the
    serving engine runs it one sequence per forward."""
    from mlxr.engine import EngineRequest, LLMEngine
    from mlxr.onnx.fallback import OrtDecoder
    from mlxr.text.sampling import SamplingParams
    from onnx_ref import greedy, odd_copy, session

    folder = odd_copy(onnx_exports / NAME, tmp_path / "head", "lm_head")
    model = mlxr.load(folder, device="cpu", dtype="float32")
    assert isinstance(model.decoder, OrtDecoder)
    full = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    for n in full.graph.node:
        for a in n.attribute:
            if a.name == "sliding_window_cache":
                a.i = 0
    onnx.save(full, str(folder / "model_full.onnx"))
    want, _ = greedy(session(folder / "model_full.onnx"), PROMPT[:6], 12)  # 18 > window 8
    assert list(model.generate(PROMPT[:6], max_tokens=12, ignore_eos=True)) == want
    engine = LLMEngine(model, max_num_seqs=2)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = run_ids(engine, [EngineRequest(p, params) for p in (PROMPT[:6], PROMPT[6:9])])
    assert outs[0] == want
