"""onnxruntime (CPU provider) as the reference for the ONNX tests.

CPU exports set MatMulNBits accuracy_level=4, with which ORT quantizes activations to int8
per block before the int4 dot product (~0.5 % per matmul). mlxr computes in float, so the
parity reference *disables* that path: `fp32_reference` writes a copy of the graph with
accuracy_level=0 beside the original (same external data) and ORT runs that in float32.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

NP = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


def session(path: Path) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def fp32_reference(folder: Path) -> ort.InferenceSession:
    """ORT on the folder's model.onnx with accuracy_level=0 on every MatMulNBits, and
    full-length KV buffers where a sliding-window attention keeps a window-sized one
    (sliding_window_cache=0: the same attention, fed the growing cache of `greedy`; test_onnx_moe
    checks the two agree)."""
    out = folder / "model_acc0.onnx"
    if not out.is_file():
        m = onnx.load(str(folder / "model.onnx"), load_external_data=False)
        for n in m.graph.node:
            for a in n.attribute:
                if a.name in ("accuracy_level", "sliding_window_cache"):
                    a.i = 0
        onnx.save(m, str(out))
    return session(out)


def copy_folder(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model_acc0.onnx"))
    return dst


def empty_past(sess: ort.InferenceSession, batch: int) -> dict[str, np.ndarray]:
    feeds = {}
    for i in sess.get_inputs():
        if i.name.startswith("past_key_values."):
            _, kv, _, d = i.shape
            feeds[i.name] = np.zeros((batch, kv, 0, d if isinstance(d, int) else 32),
                                     NP[i.type])
    return feeds


def step_feeds(sess, ids: np.ndarray, past: dict, start: int) -> dict[str, np.ndarray]:
    b, s = ids.shape
    feeds = {"input_ids": ids.astype(np.int64),
             "attention_mask": np.ones((b, start + s), np.int64), **past}
    if any(i.name == "position_ids" for i in sess.get_inputs()):
        feeds["position_ids"] = np.tile(np.arange(start, start + s, dtype=np.int64), (b, 1))
    return feeds


def prompt_logits(sess, ids: list[int]) -> np.ndarray:
    """Teacher-forced logits [T, V] float32 of one prompt."""
    feeds = step_feeds(sess, np.array([ids]), empty_past(sess, 1), 0)
    return sess.run(["logits"], feeds)[0][0].astype(np.float32)


def greedy(sess, ids: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
    """n greedy tokens with a growing KV cache, and the logits each was chosen from."""
    names = [o.name for o in sess.get_outputs()]
    past, start, cur = empty_past(sess, 1), 0, np.array([ids])
    tokens, rows = [], []
    for _ in range(n):
        out = dict(zip(names, sess.run(names, step_feeds(sess, cur, past, start))))
        row = out["logits"][0, -1].astype(np.float32)
        tokens.append(int(row.argmax()))
        rows.append(row)
        start += cur.shape[1]
        past = {k.replace("present.", "past_key_values."): v for k, v in out.items()
                if k.startswith("present.")}
        cur = np.array([[tokens[-1]]])
    return tokens, rows


def unfold_qk_norm(folder: Path) -> ort.InferenceSession:
    """ORT CPU refuses GroupQueryAttention's q_norm_weight / k_norm_weight inputs (the fp16
    "CUDA" export folds Qwen3's per-head norms there). The reference moves them back out:
    Reshape [.., heads, D] -> SimplifiedLayerNormalization -> Reshape on q and k before the
    attention, with the same weights and epsilon -- what the CPU export computes."""
    out = folder / "model_unfolded.onnx"
    m = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    g = m.graph
    nodes = []
    for n in g.node:
        if n.op_type == "GroupQueryAttention" and len(n.input) > 15 and n.input[14]:
            a = {x.name: onnx.helper.get_attribute_value(x) for x in n.attribute}
            d = next(t for t in g.initializer if t.name == n.input[14]).dims[0]
            for j, w, key in ((0, n.input[14], "q_norm_epsilon"), (1, n.input[15],
                                                                   "k_norm_epsilon")):
                heads = a["num_heads"] if j == 0 else a["kv_num_heads"]
                eps = a.get(key, a.get("qk_norm_epsilon", 1e-6))
                base = f"{n.name}/unfold{j}"
                nodes += [
                    onnx.helper.make_node("Constant", [], [base + "/s1"], value=onnx.helper.
                                          make_tensor(base + "/s1v", 7, [3], [0, -1, d])),
                    onnx.helper.make_node("Constant", [], [base + "/s2"], value=onnx.helper.
                                          make_tensor(base + "/s2v", 7, [3],
                                                      [0, -1, heads * d])),
                    onnx.helper.make_node("Reshape", [n.input[j], base + "/s1"], [base + "/r1"]),
                    onnx.helper.make_node("SimplifiedLayerNormalization", [base + "/r1", w],
                                          [base + "/n"], epsilon=eps, axis=-1, stash_type=1),
                    onnx.helper.make_node("Reshape", [base + "/n", base + "/s2"],
                                          [base + "/out"]),
                ]
                n.input[j] = base + "/out"
            n.input[14] = n.input[15] = ""
            for key in ("q_norm_epsilon", "k_norm_epsilon", "qk_norm_epsilon"):
                for x in list(n.attribute):
                    if x.name == key:
                        n.attribute.remove(x)
        nodes.append(n)
    del g.node[:]
    g.node.extend(nodes)
    onnx.save(m, str(out))
    return session(out)


def odd_copy(src, dst, after: str):
    """A copy of the export with an op mlxr has no translation for after the node whose name
    contains `after`: Softsign(y) - Softsign(y) + y, so the values stay those of a decoder."""
    folder = copy_folder(src, dst)
    m = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    g = m.graph
    o = next(n for n in g.node if after in n.name)
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


def with_unknown_ops(src, dst, activation: str | None = None, norm: str | None = None):
    """A copy of the export with ops mlxr has no translation for, that change what it
    computes: in the MLP whose Sigmoid node's name contains `activation`, Softsign instead of
    the Sigmoid (act = gate * Softsign(gate)); after the skip norm whose name contains `norm`,
    an LpNormalization (p=2, last axis) of its output (the MLP reads x / |x|)."""
    folder = copy_folder(src, dst)
    m = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    g = m.graph
    nodes = list(g.node)
    if activation is not None:
        next(n for n in nodes if activation in n.name and n.op_type == "Sigmoid").op_type = \
            "Softsign"
    if norm is not None:
        o = next(n for n in nodes if norm in n.name)
        out = o.output[0]
        o.output[0] = out + "/raw"
        lp = onnx.helper.make_node("LpNormalization", [out + "/raw"], [out], name="odd/lpnorm",
                                   axis=-1, p=2)
        nodes.insert(nodes.index(o) + 1, lp)
    g.ClearField("node")
    g.node.extend(nodes)
    onnx.save(m, str(folder / "model.onnx"))
    return folder


def assert_matches_ort(model, folder: Path, prompt: list[int], tol: float,
                       tokens: int = 10) -> None:
    """mlxr's prompt logits within tol of the largest of ORT's (float32 export) and its greedy
    tokens ORT's up to the first near tie (top-2 margin <= 2 tol of the row's largest)."""
    ref = fp32_reference(folder)
    want_logits = prompt_logits(ref, prompt)
    got_logits = model.logits(prompt).numpy()
    assert got_logits.shape == want_logits.shape
    assert np.abs(got_logits - want_logits).max() <= tol * np.abs(want_logits).max()
    want, rows = greedy(ref, prompt, tokens)
    got = list(model.generate(prompt, max_tokens=tokens, ignore_eos=True))
    for i, (a, b, row) in enumerate(zip(got, want, rows)):
        top2 = np.sort(row)[-2:]
        if top2[1] - top2[0] <= 2 * tol * np.abs(row).max():
            break  # a near tie: either token is right
        assert a == b, f"token {i}: mlxr {a}, onnxruntime {b}"
