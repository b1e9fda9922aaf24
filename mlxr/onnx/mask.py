"""The attention-mask reformat subgraph every decoder export carries: GroupQueryAttention's
`seqlens_k` (= valid tokens - 1 per row, int32 [B]) and `total_sequence_length` (= the mask's
length, int32 scalar) computed from `attention_mask` with a handful of standard ops.

Rather than trusting node names, mlxr evaluates the subgraph on a probe mask with numpy and
checks it computes exactly those two values; its nodes are then claimed (mlxr derives both
from the mask itself)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from .graph import OnnxGraph

MASK_OPS = {"Constant", "ReduceSum", "Sub", "Add", "Cast", "Shape", "Gather", "Squeeze",
            "Unsqueeze"}
_NP = {onnx.TensorProto.INT32: np.int32, onnx.TensorProto.INT64: np.int64,
       onnx.TensorProto.FLOAT: np.float32}


MAX_CONSTANT = 1 << 16  # elements of a Constant node mlxr reads (shapes, axes, indices)
MAX_DEPTH = 32  # the reformat is ~6 ops deep; a longer chain (or a cycle) is not it


class NotMask(Exception):
    """The value is not computed from the mask by the ops above."""


def _eval(g: OnnxGraph, name: str, mask: np.ndarray, seen: set[int], memo: dict,
          depth: int = 0):
    if depth > MAX_DEPTH:
        raise NotMask(name)
    if name in memo:
        return memo[name]
    if name == "attention_mask":
        return mask
    if name in g.inits:
        init = g.inits[name]
        if init.numel > 16:
            raise NotMask(name)
        v = g.tensor(name).numpy()
        memo[name] = v
        return v
    n = g.producer.get(name)
    if n is None or n.op_type not in MASK_OPS or n.domain not in ("", "ai.onnx"):
        raise NotMask(name)
    seen.add(id(n))
    a = {x.name: onnx.helper.get_attribute_value(x) for x in n.attribute}
    if n.op_type == "Constant":
        out = constant_value(a)
        if out is None or out.size > 16:
            raise NotMask(name)
    else:
        xs = [_eval(g, i, mask, seen, memo, depth + 1) if i else None for i in n.input]
        out = _apply(n.op_type, a, xs)
    memo[name] = out
    return out


def constant_value(a: dict) -> np.ndarray | None:
    """A Constant node's value: a tensor (`value`) or, as Mobius writes them, a plain
    `value_int` / `value_ints` (int64 scalar / 1-D)."""
    if "value" in a:
        t = a["value"]
        # small inline tensors only: a hostile `value` may be another attribute type, huge
        # dims, or external data (which numpy_helper would read relative to the working dir)
        if not isinstance(t, onnx.TensorProto) or t.data_location == onnx.TensorProto.EXTERNAL \
                or any(not 0 <= d <= MAX_CONSTANT for d in t.dims) \
                or int(np.prod(t.dims)) > MAX_CONSTANT:
            return None
        try:
            return numpy_helper.to_array(t)
        except (ValueError, TypeError, KeyError):
            return None
    v = a.get("value_int", a.get("value_ints"))  # of another type: a float (inf), bytes
    if isinstance(v, int) or (isinstance(v, list) and len(v) <= MAX_CONSTANT
                              and all(isinstance(x, int) for x in v)):
        return np.asarray(v, dtype=np.int64)
    return None


def _apply(op: str, a: dict, xs: list) -> np.ndarray:
    x = xs[0]
    if op == "ReduceSum":
        axes = tuple(int(v) for v in (xs[1] if len(xs) > 1 and xs[1] is not None
                                      else a.get("axes", range(x.ndim))))
        return np.asarray(x.sum(axis=axes, keepdims=bool(a.get("keepdims", 1))))
    if op in ("Sub", "Add"):
        return np.asarray(x - xs[1] if op == "Sub" else x + xs[1])
    if op == "Cast":
        if a.get("to") not in _NP:
            raise NotMask(op)
        return np.asarray(x).astype(_NP[a["to"]])
    if op == "Shape":
        return np.asarray(x.shape, dtype=np.int64)[a.get("start", 0):a.get("end")]
    if op == "Gather":
        return np.take(x, xs[1], axis=a.get("axis", 0))
    axes = tuple(int(v) for v in (xs[1] if len(xs) > 1 and xs[1] is not None
                                  else a.get("axes", ())))
    return np.squeeze(x, axes or None) if op == "Squeeze" else np.expand_dims(x, axes)


def check_mask_inputs(g: OnnxGraph, seqlens: str, total: str) -> set[int] | None:
    """ids of the subgraph's nodes if `seqlens`/`total` are the standard values of the mask,
    else None."""
    probe = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=np.int64)
    seen: set[int] = set()
    try:
        memo: dict = {}
        s, t = _eval(g, seqlens, probe, seen, memo), _eval(g, total, probe, seen, memo)
    except (NotMask, ValueError, TypeError, IndexError, AttributeError):
        return None
    ok = (s.dtype == np.int32 and s.tolist() == [2, 4] and t.dtype == np.int32
          and t.size == 1 and int(t.reshape(())) == 5)
    return seen if ok else None
