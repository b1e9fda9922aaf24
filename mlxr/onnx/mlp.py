"""One layer's dense MLP in an ONNX decoder, and the parts of it mlxr leaves to onnxruntime.

The MLP is found from its projections, not its activation: `down` is the projection whose
output (through a bias Add) the layer's closing skip norm adds to the stream, and gate / up are
the two projections between the MLP norm's output x and down that read one value v. What lies
between them is either mlxr's own (x == v; SiLU(gate) * up) or a sub-layer region
(`SubRegion`) that runs on onnxruntime while mlxr keeps the rest of the layer:

* "MLP input": the nodes from x to v [T, E] -- an odd norm variant or scaling on the norm's
  output (mlxr hands over x, continues with gate/up on v);
* "MLP activation": the nodes from (gate, up) [T, F] each to down's input [T, F] -- any
  activation other than SiLU (mlxr hands over its gate/up product halves, continues with down).

A region must be closed: nothing outside it reads a value computed inside (or its inputs), and
it reads no graph input, so the two boundary tensors are all that cross.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from .chain import between
from .walk import PROJ_OPS, Decline, Walk, add_bias

SKIP = {"SkipSimplifiedLayerNormalization"}


@dataclass(frozen=True)
class SubRegion:
    """Nodes of layer `layer` that onnxruntime computes from `inputs` ([T, width] each, in
    the order mlxr hands them over) to `output`; `why`: mlxr's structural reason."""

    layer: int
    where: str  # "MLP input" | "MLP activation"
    inputs: tuple[str, ...]
    output: str
    nodes: tuple[onnx.NodeProto, ...]
    why: str

    def describe(self) -> str:
        ops = sorted({n.op_type for n in self.nodes if n.op_type != "Constant"})
        n = len(self.nodes)
        return f"{self.where} ({n} node{'s' * (n != 1)}: {', '.join(ops)})"


def translate_mlp(w: Walk, ck, x: str, h_mid: str, p: str, at: onnx.NodeProto, layer: int):
    """gate/up/down of one layer from the MLP norm's output x (the stream after the attention:
    h_mid); returns (down output, F, biased). Sub-regions go to `w.subregions`."""
    g = w.g
    down = _down(w, h_mid, at)
    inner, gin = between(g, {x}, [down.input[0]])
    projs = [n for n in inner or () if n.op_type in PROJ_OPS]
    if inner is None or gin or len(projs) != 2 or projs[0].input[0] != projs[1].input[0]:
        raise Decline(at, "the MLP norm's output does not feed two projections that feed the "
                          "down projection (only gate/up MLPs are translated)")
    v = projs[0].input[0]
    if v != x:
        w.subregions.append(_region(w, layer, "MLP input", (x,), v, at,
                                    "ops between the MLP norm and its projections"))
    outs = [w.linear_out(n) for n in projs]
    gate = _silu_gate(w, [o for o, _ in outs], down)
    if gate is None:
        order = (0, 1)
        w.subregions.append(_region(w, layer, "MLP activation", (outs[0][0], outs[1][0]),
                                    down.input[0], at, "not SiLU(gate) * up"))
    else:
        order = (gate, 1 - gate)
    gp, upp, dp = w.proj(projs[order[0]]), w.proj(projs[order[1]]), w.proj(down)
    if gp.rows != upp.rows or dp.cols != gp.rows:
        raise Decline(down, "gate/up/down sizes disagree")
    dv, db = w.linear_out(down)
    biases = (outs[order[0]][1], outs[order[1]][1], db)
    biased = any(b is not None for b in biases)
    for name, pr, b in zip(("gate_proj", "up_proj", "down_proj"), (gp, upp, dp), biases):
        ck.add_projection(p + "mlp." + name, pr, 0, pr.rows)
        if biased:
            add_bias(w, ck, p + "mlp." + name, None if b is None else (b, 0), pr.rows)
    return dv, gp.rows, biased


def _down(w: Walk, h_mid: str, at: onnx.NodeProto) -> onnx.NodeProto:
    """The projection whose output, through a bias Add, the closing skip norm adds to h_mid."""
    end = w.one(h_mid, SKIP, at)
    m = [v for v in end.input[:2] if v != h_mid]
    src = w.g.producer.get(m[0]) if len(m) == 1 else None
    if src is not None and src.op_type == "Add":
        other = [i for i in src.input if i not in w.g.inits]
        if len(other) == 1 and len(src.input) == 2:
            src = w.g.producer.get(other[0])
    if src is None or src.op_type not in PROJ_OPS or w.linear_out(src)[0] != m[0]:
        raise Decline(end, "the MLP's output is not a down projection's")
    return src


def _silu_gate(w: Walk, outs: list[str], down: onnx.NodeProto) -> int | None:
    """Which of the two projection outputs is the gate of act(gate) * up with act = x *
    Sigmoid(x), feeding exactly `down` (its nodes claimed), or None."""
    for j in (0, 1):
        gv, uv = outs[j], outs[1 - j]
        cons = w.consumers(gv)
        sig = [n for n in cons if n.op_type == "Sigmoid"]
        if len(cons) != 2 or len(sig) != 1:
            continue
        act = [n for n in cons if n.op_type == "Mul"]
        if len(act) != 1 or sorted(act[0].input) != sorted([gv, sig[0].output[0]]):
            continue
        mul = w.consumers(act[0].output[0])
        if (len(mul) != 1 or mul[0].op_type != "Mul" or w.consumers(uv) != mul
                or sorted(mul[0].input) != sorted([act[0].output[0], uv])
                or w.consumers(sig[0].output[0]) != act or mul[0].output[0] != down.input[0]
                or w.consumers(mul[0].output[0]) != [down]):
            continue
        w.claim(sig[0], act[0], mul[0])
        return j
    return None


def _region(w: Walk, layer: int, where: str, inputs: tuple[str, ...], output: str,
            at: onnx.NodeProto, why: str) -> SubRegion:
    g = w.g
    nodes, gin = between(g, set(inputs), [output])
    if not nodes or gin:
        raise Decline(at, f"the {where} reads graph inputs {list(gin)}" if gin else
                      f"nothing computes the {where}")
    inside = {id(n) for n in nodes}
    for v in inputs:
        if any(id(c) not in inside for c in w.consumers(v)):
            raise Decline(at, f"'{v}' (input of the {where}) is also read outside it")
    for n in nodes:
        for o in n.output:
            if o and o != output and (o in g.outputs or any(
                    id(c) not in inside for c in w.consumers(o))):
                raise Decline(n, f"'{o}' (inside the {where}) is read outside it")
    return SubRegion(layer, where, inputs, output, nodes, why)
