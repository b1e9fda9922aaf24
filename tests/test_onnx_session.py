"""mlxr.onnx.InferenceSession vs onnxruntime: the graph's own feeds, outputs in the graph's
shapes and dtypes, a prompt and decode steps; feeds mlxr does not compute (padding) answered
by onnxruntime; one session used from two threads at once is refused.

Tolerances as in test_onnx_parity (fp32: 1e-4, fp16: 1e-2, relative to the largest |value|);
the reference disables ORT's int8-activation MatMulNBits path (accuracy_level=0)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import mlxr.onnx
from mlxr.errors import MlxrError
from onnx_ref import empty_past, fp32_reference, session, step_feeds


def _close(got: np.ndarray, want: np.ndarray, tol: float) -> bool:
    return (got.shape == want.shape and got.dtype == want.dtype and
            np.abs(got.astype(np.float32) - want.astype(np.float32)).max()
            <= tol * max(1.0, np.abs(want.astype(np.float32)).max()))


@pytest.mark.parametrize("name,tol", [("llama_int4_cpu", 1e-4), ("qwen2_int4_cpu", 1e-4),
                                      ("llama_dml", 1e-2)])
def test_prompt_and_decode_steps_match_onnxruntime(onnx_exports, name, tol):
    ref = fp32_reference(onnx_exports / name)
    ours = mlxr.onnx.InferenceSession(onnx_exports / name)
    assert ours.claimed
    assert [i.name for i in ours.get_inputs()] == [i.name for i in ref.get_inputs()]
    names = [o.name for o in ref.get_outputs()]
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 384, (2, 7))  # a batch of two prompts
    past, start = empty_past(ref, 2), 0
    for step in range(4):
        feeds = step_feeds(ref, ids, past, start)
        want = dict(zip(names, ref.run(names, feeds)))
        got = dict(zip(names, ours.run(names, feeds)))
        for n in names:
            assert _close(got[n], want[n], tol), (step, n)
        start += ids.shape[1]
        past = {k.replace("present.", "past_key_values."): v for k, v in want.items()
                if k.startswith("present.")}
        ids = want["logits"][:, -1].argmax(-1)[:, None]
    only = ours.run(["present.1.value"], feeds)
    assert len(only) == 1 and only[0].shape == want["present.1.value"].shape


def test_padded_mask_is_answered_by_onnxruntime(onnx_exports):
    """Right-padded rows are outside mlxr's growing-cache step: the session hands them to
    onnxruntime on the same file, so the outputs are the file's own."""
    folder = onnx_exports / "llama_int4_cpu"
    ref, ours = session(folder / "model.onnx"), mlxr.onnx.InferenceSession(folder)
    feeds = step_feeds(ref, np.array([[5, 6, 7, 8], [9, 10, 0, 0]]), empty_past(ref, 2), 0)
    feeds["attention_mask"][1, 2:] = 0
    want, got = ref.run(["logits"], feeds)[0], ours.run(["logits"], feeds)[0]
    assert np.array_equal(got, want)


def test_bad_feeds_are_clear_errors(onnx_exports):
    folder = onnx_exports / "llama_int4_cpu"
    ours = mlxr.onnx.InferenceSession(folder)
    feeds = step_feeds(ours, np.array([[5, 6]]), empty_past(session(folder / "model.onnx"), 1),
                       0)
    with pytest.raises(MlxrError, match="is int32"):
        ours.run(None, {**feeds, "input_ids": feeds["input_ids"].astype(np.int32)})
    with pytest.raises(MlxrError, match="missing"):
        ours.run(None, {k: v for k, v in feeds.items() if k != "attention_mask"})
    with pytest.raises(MlxrError, match="unknown output"):
        ours.run(["nope"], feeds)
    with pytest.raises(MlxrError, match="shape"):
        ours.run(None, {**feeds, "past_key_values.0.key": np.zeros((1, 3, 0, 32), np.float32)})


def test_two_threads_on_one_session_get_an_error(onnx_exports):
    folder = onnx_exports / "llama_int4_cpu"
    ours = mlxr.onnx.InferenceSession(folder)
    feeds = step_feeds(ours, np.array([[5, 6, 7]]),
                       empty_past(session(folder / "model.onnx"), 1), 0)
    inside, release = threading.Event(), threading.Event()
    forward = ours._decoder.forward

    def slow_forward(*a, **kw):  # hold the first run inside the decoder
        inside.set()
        release.wait(30)
        return forward(*a, **kw)

    ours._decoder.forward = slow_forward
    results: list = []
    t = threading.Thread(target=lambda: results.append(ours.run(["logits"], feeds)))
    t.start()
    assert inside.wait(30)
    with pytest.raises(MlxrError, match="another thread"):
        ours.run(["logits"], feeds)
    release.set()
    t.join(30)
    assert len(results) == 1 and results[0][0].shape == (1, 3, 384)
    ours._decoder.forward = forward
    assert ours.run(["logits"], feeds)[0].shape == (1, 3, 384)  # usable again


def test_scales_follow_the_compute_dtype(onnx_exports):
    """MatMulNBits scales reach the decoder in a 16-bit compute dtype as MLX files ship them
    (the decode GEMVs read 16-bit scale/bias pairs), and stay float32 in float32 mode; both
    models still agree on the prompt's logits within bf16 noise."""
    import torch

    import mlxr

    ids = [5, 17, 42, 7, 99]
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        m = mlxr.load(onnx_exports / "qwen2_int4_cpu", device="cpu", dtype=dtype)
        for qw in m.decoder.quant_weights():
            assert qw.scales.dtype == qw.biases.dtype == dtype, (dtype, qw.name)
        out[dtype] = m.logits(ids).float()
    bf16, f32 = out[torch.bfloat16], out[torch.float32]
    assert (bf16 - f32).abs().max() <= 0.05 * f32.abs().max()
