"""Walking an ONNX decoder graph backwards from its attention nodes (see mlxr.onnx.translate).

Nothing keys off node names or one exporter's fusions: the walk starts at `input_ids`, follows
the residual stream through the (Skip)SimplifiedLayerNormalization / RMSNormalization nodes,
and for every GroupQueryAttention traces its query/key/value inputs back to the projections
that read the layer's normed input -- through a packed-QKV Split, bias Adds, per-head q/k
RMSNorms (Reshape, norm, Reshape, or GQA's own norm inputs) and standalone RotaryEmbedding
nodes -- so builder CPU / fp16 / DML exports and Mobius-style separate q/k/v all map onto the
same decoder. Every node the walk consumes is claimed; anything else declines the graph
(`Decline`, with the node and the reason) and it runs on onnxruntime instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import onnx

from ..config import RopeSpec
from .claim import MS, ClaimReport, attrs
from .graph import FLOAT_TYPES, OnnxGraph
from .mask import constant_value
from .weights import FLOAT_NAMES, OnnxCheckpoint, Projection

PROJ_OPS = {"MatMulNBits", "MatMul"}
NORM_OPS = {"SimplifiedLayerNormalization", "RMSNormalization"}
# the inputs of each projection op that mlxr reads as constants (GatherBlockQuantized's table
# may also be a Reshape of one: Projection.gbq_data)
WEIGHT_INPUTS = {"MatMul": (1,), "MatMulNBits": (1, 2, 3), "Gather": (0,),
                 "GatherBlockQuantized": (2, 3)}


class Decline(Exception):
    """The graph is not (entirely) a decoder mlxr translates: `node` (or None) and why."""

    def __init__(self, node: onnx.NodeProto | None, reason: str):
        super().__init__(reason)
        self.node, self.reason = node, reason


@dataclass
class Traced:
    """One GroupQueryAttention input traced back to its projection rows [start, start+n)."""

    proj: Projection
    start: int
    n: int
    bias: tuple[str, int] | None  # (initializer, offset of row `start` in it)
    norm: onnx.NodeProto | None  # per-head RMSNorm (Reshape, norm, Reshape)
    rope: onnx.NodeProto | None  # standalone RotaryEmbedding


class Walk:
    def __init__(self, g: OnnxGraph, report: ClaimReport):
        self.g, self.claimed = g, report.claimed
        self.ck = OnnxCheckpoint(g.path)
        self._projs: dict[int, Projection] = {}
        self.eps: set[float] = set()
        self.subregions: list = []  # mlp.SubRegion: parts of layers left to onnxruntime

    def snapshot(self) -> tuple:
        """What a layer's walk may change, to undo it when the layer is declined."""
        return set(self.claimed), self.ck.snapshot(), set(self.eps), list(self.subregions)

    def restore(self, snap: tuple) -> None:
        claimed, ck, eps, subregions = snap
        self.claimed.clear()
        self.claimed.update(claimed)
        self.ck.restore(ck)
        self.eps, self.subregions = eps, subregions

    def claim(self, *nodes: onnx.NodeProto) -> None:
        for n in nodes:
            self.claimed.add(id(n))
            for i in n.input:  # Constant nodes feeding shapes / split sizes
                p = self.g.producer.get(i)
                if p is not None and p.op_type == "Constant":
                    self.claimed.add(id(p))

    def consumers(self, v: str) -> list[onnx.NodeProto]:
        return self.g.consumers.get(v, [])

    def one(self, v: str, ops: set[str], at: onnx.NodeProto) -> onnx.NodeProto:
        c = [n for n in self.consumers(v) if n.op_type in ops]
        if len(c) != 1:
            raise Decline(at, f"expected one {'/'.join(sorted(ops))} reading '{v}', "
                              f"found {len(c)}")
        return c[0]

    def weights_constant(self, node: onnx.NodeProto) -> None:
        """Decline a projection whose weight, scales or zero points are computed at run time
        (Projection reads them as initializers)."""
        for i in WEIGHT_INPUTS.get(node.op_type, ()):
            v = node.input[i] if i < len(node.input) else ""
            if v and v not in self.g.inits:
                raise Decline(node, f"input {i} '{v}' is computed at run time, not an "
                                    "initializer")

    def proj(self, node: onnx.NodeProto) -> Projection:
        self.weights_constant(node)
        p = self._projs.get(id(node))
        if p is None:
            p = self._projs[id(node)] = Projection(self.g, node, self.ck.repack_s)
        self.claim(node)
        return p

    def ints(self, v: str, at: onnx.NodeProto) -> list[int]:
        if v in self.g.inits and self.g.inits[v].numel <= 64:
            return [int(x) for x in self.g.tensor(v).flatten().tolist()]
        p = self.g.producer.get(v)
        if p is not None and p.op_type == "Constant":
            t = constant_value(attrs(p))
            if t is not None:
                return [int(x) for x in t.flatten().tolist()]
        raise Decline(at, f"'{v}' is not a constant")

    def norm_weight(self, node: onnx.NodeProto, size: int) -> str:
        j = 2 if node.op_type == "SkipSimplifiedLayerNormalization" else 1
        w = self.g.inits.get(node.input[j] if len(node.input) > j else "")
        if w is None or w.shape != (size,) or w.elem not in FLOAT_TYPES:
            raise Decline(node, f"norm weight is not a float initializer of {size} values")
        self.eps.add(attrs(node).get("epsilon", 1e-5))
        self.claim(node)
        return w.name

    def linear_out(self, node: onnx.NodeProto) -> tuple[str, str | None]:
        """A projection's output, through a bias Add if one follows: (value, bias init)."""
        out = node.output[0]
        cons = self.consumers(out)
        if len(cons) == 1 and cons[0].op_type == "Add":
            add = cons[0]
            other = [i for i in add.input if i != out]
            if len(other) == 1 and other[0] in self.g.inits:
                self.claim(add)
                return add.output[0], other[0]
        return out, None

    def trace(self, v: str, gqa: onnx.NodeProto) -> Traced:
        off, n, bias, norm, rope = 0, None, None, None, None
        for _ in range(16):
            p = self.g.producer.get(v)
            if p is None:
                raise Decline(gqa, f"attention input '{v}' is not computed from a projection")
            op = p.op_type
            if op in PROJ_OPS:
                proj = self.proj(p)
                if n is None:
                    n = proj.rows
                if off + n > proj.rows:
                    raise Decline(p, "split sizes exceed the projection's outputs")
                return Traced(proj, off, n, bias, norm, rope)
            if op == "RotaryEmbedding" and p.domain == MS and rope is None:
                rope, v = p, p.input[0]
            elif op == "Add" and bias is None:
                b = [i for i in p.input if i in self.g.inits]
                if len(b) != 1:
                    raise Decline(p, "an Add before attention that is not a bias")
                bias, v = (b[0], off), [i for i in p.input if i != b[0]][0]
            elif op == "Reshape" and norm is None:
                m = self.g.producer.get(p.input[0])
                r = m and self.g.producer.get(m.input[0])
                if m is None or m.op_type not in NORM_OPS or r is None or r.op_type != "Reshape":
                    raise Decline(p, "a Reshape before attention that is not a per-head norm")
                norm, v = m, r.input[0]
                self.claim(p, r)
            elif op == "Split":
                sizes = self._split_sizes(p)
                k = list(p.output).index(v)
                off, n = off + sum(sizes[:k]), sizes[k] if n is None else n
                v = p.input[0]
            else:
                raise Decline(p, f"{op} between a projection and attention is not recognised")
            self.claim(p)
        raise Decline(gqa, "attention input chain is too long")

    def _split_sizes(self, p: onnx.NodeProto) -> list[int]:
        a = attrs(p)
        if a.get("axis", 0) not in (-1, 2):
            raise Decline(p, "Split along an axis other than the features")
        if len(p.input) > 1 and p.input[1]:
            return self.ints(p.input[1], p)
        if "split" in a:
            return list(a["split"])
        raise Decline(p, "Split without explicit sizes")


def fit_rope_base(cos_row1: list[float], sin_row1: list[float], dims: int) -> float:
    """The RoPE base whose frequencies the table's position-1 row holds (informational: the
    decoder reads the table itself)."""
    if len(cos_row1) < 2:
        return 10000.0
    inv = math.atan2(sin_row1[1], cos_row1[1])
    return inv ** (-dims / 2) if inv > 0 else 10000.0


def float_name(elem: int) -> str:
    return FLOAT_NAMES.get(elem, "F32")


def rope_spec(dims: int, base: float, interleaved: bool, rows: int) -> RopeSpec:
    return RopeSpec(dims, base, interleaved, None, rows)


def add_bias(w: Walk, ck, path: str, bias: tuple[str, int] | None, n: int) -> None:
    """`path`.bias: n values of initializer bias[0] from offset bias[1], or zeros (None)."""
    g = w.g
    if bias is None:
        import torch

        ck.add(path + ".bias", "F32", (n,), lambda: torch.zeros(n))
        return
    name, off = bias
    if g.inits[name].numel < off + n or g.inits[name].elem not in (1, 10, 16):
        raise Decline(None, f"bias '{name}' is too short or not float")
    ck.add(path + ".bias", "F32", (n,), lambda: g.tensor(name).flatten()[off:off + n].float())
