"""The residual stream of an ONNX decoder and the layer regions it cuts the graph into.

Every exporter writes the stream the same way: the embedding's output feeds the first RMS norm
(SimplifiedLayerNormalization / RMSNormalization), and from there each residual add is a
SkipSimplifiedLayerNormalization whose output 3 is the new stream and output 0 the normed
input of what follows -- two per layer (after the attention, after the MLP), the last one the
final norm. Layer i is then everything between its input norm and the skip norm that ends it:

    x_i, h_i   (normed input, stream)  ->  attention, o_proj, mid skip norm, MLP
               ->  h_mid_i (mid norm's output 3) and m_i (the MLP's output, the end norm's
                   other input)

That cut is what lets a layer run on onnxruntime while its neighbours run on mlxr: mlxr feeds
x_i and h_i and continues from h_mid_i + m_i with its own fused add + norm, exactly what the
end skip norm computes. Nothing here depends on node names.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from .claim import MS
from .graph import OnnxGraph

NORM_OPS = {"SimplifiedLayerNormalization", "RMSNormalization"}
SKIP = "SkipSimplifiedLayerNormalization"


@dataclass(frozen=True)
class LayerCut:
    """Layer i's boundary values and the nodes between them."""

    index: int
    x: str  # normed input [B, S, E]
    h: str  # residual stream in [B, S, E]
    h_mid: str  # stream after the attention's residual add
    m: str  # the MLP's (or MoE's) output, added to h_mid by the end norm
    start: onnx.NodeProto  # the norm that produces x (first norm, or a skip norm)
    mid: onnx.NodeProto  # the skip norm after the attention
    end: onnx.NodeProto  # the skip norm after the MLP (the next input norm / final norm)
    nodes: tuple[onnx.NodeProto, ...]  # the layer's own nodes, graph order
    graph_inputs: tuple[str, ...]  # graph inputs the layer reads (mask, KV, positions)


@dataclass(frozen=True)
class Stream:
    embedding: onnx.NodeProto
    first_norm: onnx.NodeProto
    layers: tuple[LayerCut, ...]


def residual_stream(g: OnnxGraph, embed: onnx.NodeProto, layers: int) -> Stream | None:
    """The layer cuts of a decoder of `layers` layers whose embedding is `embed`, or None when
    the stream is not the first-norm + 2-skip-norms-per-layer chain."""
    h = embed.output[0]
    first = [n for n in g.consumers.get(h, []) if n.op_type in NORM_OPS]
    if len(first) != 1:
        return None
    skips = []
    cur = h
    x = first[0].output[0]
    while True:
        nxt = [n for n in g.consumers.get(cur, []) if n.op_type == SKIP and n.domain == MS
               and cur in n.input[:2]]
        if len(nxt) != 1 or len(skips) > 2 * layers:
            return None
        skips.append(nxt[0])
        out = nxt[0].output
        if len(out) < 4 or not g.consumers.get(out[3]):  # the final norm (sum unused)
            break
        cur = out[3]
    if len(skips) != 2 * layers:
        return None
    cuts = []
    starts = [first[0]] + skips[1::2]
    for i in range(layers):
        start, mid, end = starts[i], skips[2 * i], skips[2 * i + 1]
        h_in = h if i == 0 else start.output[3]
        x = start.output[0]
        m = [v for v in end.input[:2] if v != mid.output[3]]
        if len(m) != 1:
            return None
        outs = [mid.output[3], m[0]]
        nodes, gin = between(g, {x, h_in}, outs)
        if nodes is None:
            return None
        cuts.append(LayerCut(i, x, h_in, mid.output[3], m[0], start, mid, end, nodes, gin))
    return Stream(embed, first[0], tuple(cuts))


def between(g: OnnxGraph, stop: set[str], outputs: list[str]):
    """Nodes computing `outputs` from the values `stop`, initializers and graph inputs, and
    which graph inputs they read; (None, ()) if they reach input_ids (not one layer)."""
    seen: set[int] = set()
    gin: set[str] = set()
    todo = list(outputs)
    while todo:
        v = todo.pop()
        if not v or v in stop or v in g.inits:
            continue
        if v in g.inputs:
            if v == "input_ids":
                return None, ()
            gin.add(v)
            continue
        n = g.producer.get(v)
        if n is None:
            return None, ()
        if id(n) in seen:
            continue
        seen.add(id(n))
        todo.extend(n.input)
    return tuple(n for n in g.nodes if id(n) in seen), tuple(sorted(gin))

