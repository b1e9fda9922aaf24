"""Recognise a decoder in an ONNX graph from its data flow and translate it into mlxr's
ModelConfig and weights: embedding, per-layer attention and MLP, final norm, LM head.

The walk starts at `input_ids`, follows the residual stream through the norms, and traces
every GroupQueryAttention's inputs back to its projections (`mlxr.onnx.walk`). Every node it
consumes is claimed; anything unexpected raises Decline (the node and why), and the graph then
runs on onnxruntime instead."""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx

from ..config import ModelConfig
from .chain import LayerCut, residual_stream
from .claim import MS, ClaimReport, attrs, input_name
from .graph import FLOAT_TYPES, OnnxGraph
from .mask import check_mask_inputs
from .qmoe import is_qmoe, moe_spec, translate_qmoe
from .folder import KVNames
from .mlp import SubRegion, translate_mlp
from .walk import (PROJ_OPS, Decline, Traced, Walk, add_bias, fit_rope_base, float_name,
                   rope_spec)
from .weights import OnnxCheckpoint, Projection

SKIP = {"SkipSimplifiedLayerNormalization"}


def _embedding(w: Walk, g: OnnxGraph):
    if "input_ids" not in g.inputs:
        raise Decline(None, "the graph has no input_ids input")
    cons = w.consumers("input_ids")
    if len(cons) != 1 or cons[0].op_type not in ("Gather", "GatherBlockQuantized"):
        raise Decline(cons[0] if cons else None, "input_ids does not feed one embedding gather")
    e = cons[0]
    if e.op_type == "Gather" and (e.input[0] not in g.inits or e.input[1] != "input_ids"
                                  or attrs(e).get("axis", 0) != 0):
        raise Decline(e, "input_ids is not gathered from an embedding table")
    if e.op_type == "GatherBlockQuantized" and e.input[1] != "input_ids":
        raise Decline(e, "input_ids is not the gathered indices")
    w.claim(e)
    if e.op_type == "GatherBlockQuantized":
        src = g.producer.get(e.input[0])
        if src is not None:
            w.claim(src)
    return e


def _attention(w: Walk, gqa: onnx.NodeProto, x: str, a: dict):
    """Trace one layer's q/k/v; returns (heads, kv heads, head dim, traced q, k, v)."""
    nq, nkv = a["num_heads"], a["kv_num_heads"]
    ins = list(gqa.input) + [""] * 17
    if ins[1] and ins[2]:
        q, k, v = (w.trace(ins[j], gqa) for j in range(3))
        d = q.n // nq
    elif not ins[1] and not ins[2]:
        t = w.trace(ins[0], gqa)
        d = t.n // (nq + 2 * nkv)
        sizes = (nq * d, nkv * d, nkv * d)
        if t.norm or t.rope:
            raise Decline(gqa, "a norm or rotary on packed QKV")
        q, k, v = (Traced(t.proj, t.start + sum(sizes[:j]), sizes[j], None if t.bias is None
                           else (t.bias[0], t.bias[1] + sum(sizes[:j])), None, None)
                   for j in range(3))
    else:
        raise Decline(gqa, "only one of key/value is given")
    if (q.n, k.n, v.n) != (nq * d, nkv * d, nkv * d) or d < 2 or d % 2:
        raise Decline(gqa, f"q/k/v widths {q.n}/{k.n}/{v.n} do not fit {nq}/{nkv} heads")
    for t in (q, k, v):
        if t.proj.node.input[0] != x:
            raise Decline(t.proj.node, "attention projection does not read the layer's norm")
    if v.norm or v.rope or bool(q.norm) != bool(k.norm) or bool(q.rope) != bool(k.rope):
        raise Decline(gqa, "q/k norms or rotary are not applied to q and k alike")
    return nq, nkv, d, q, k, v


def _rope(w: Walk, gqa: onnx.NodeProto, a: dict, q: Traced, k: Traced, d: int):
    """(cos, sin) initializer names and interleaving of the layer's rotary embedding."""
    g = w.g
    if a.get("do_rotary", 0):
        if q.rope:
            raise Decline(q.rope, "rotary applied twice (RotaryEmbedding and in attention)")
        cos, sin = input_name(gqa, 7), input_name(gqa, 8)
        if cos not in g.inits or sin not in g.inits:
            raise Decline(gqa, "rotary cos/sin caches are not initializers")
        inter = bool(a.get("rotary_interleaved", 0))
    elif q.rope:
        ra, rb = attrs(q.rope), attrs(k.rope)
        if list(q.rope.input[1:]) != list(k.rope.input[1:]) or ra != rb:
            raise Decline(k.rope, "q and k use different rotary tables")
        if input_name(q.rope, 1) not in g.inputs:
            raise Decline(q.rope, "rotary positions are not a graph input")
        cos, sin = input_name(q.rope, 2), input_name(q.rope, 3)
        inter = bool(ra.get("interleaved", 0))
        if cos not in g.inits or sin not in g.inits:
            raise Decline(q.rope, "rotary cos/sin caches are not initializers")
        rot = ra.get("rotary_embedding_dim", 0)
        if rot not in (0, 2 * g.inits[cos].shape[-1]) or (ra.get("num_heads", 0) and
                                                         ra["num_heads"] * d != q.n):
            raise Decline(q.rope, "rotary dims / heads disagree with the attention")
    else:
        raise Decline(gqa, "attention without rotary embedding")
    c, s = g.inits[cos], g.inits[sin]
    if len(c.shape) != 2 or c.shape != s.shape or 2 * c.shape[1] > d or c.elem != s.elem:
        raise Decline(gqa, f"cos/sin caches {list(c.shape)}/{list(s.shape)} do not fit head "
                           f"dim {d}")
    return cos, sin, inter


def _add_traced(w: Walk, ck, path: str, t: Traced, bias: bool) -> None:
    ck.add_projection(path, t.proj, t.start, t.start + t.n)
    if bias:
        add_bias(w, ck, path, t.bias, t.n)


def _norm_tensor(w: Walk, ck, name: str, node: onnx.NodeProto, size: int) -> None:
    init = w.norm_weight(node, size)
    ck.add(name, float_name(w.g.inits[init].elem), (size,), lambda: w.g.tensor(init))


def _skip_norm(w: Walk, value: str, residual: str, at: onnx.NodeProto) -> onnx.NodeProto:
    n = w.one(value, SKIP, at)
    if n.domain != MS or sorted(n.input[:2]) != sorted([value, residual]):
        raise Decline(n, "residual add + norm does not combine the expected values")
    return n


@dataclass
class Translation:
    config: ModelConfig
    checkpoint: OnnxCheckpoint
    rope_tables: list[tuple[str, str]]  # per layer: (cos, sin) initializer names
    position_ids: str | None  # graph input feeding standalone RotaryEmbedding nodes
    # layers left to onnxruntime: index -> (the layer's cut, why)
    external: dict[int, tuple[LayerCut, str]] = field(default_factory=dict)
    # parts of mlxr's layers left to onnxruntime, and why (the declined ops in them)
    subregions: list[tuple[SubRegion, str]] = field(default_factory=list)


def _qk_norms(w: Walk, ck, gqa, a: dict, p: str, q: Traced, k: Traced, d: int) -> bool:
    """Per-head q/k RMSNorm weights: from the traced norm nodes or GQA's own inputs 14/15."""
    if q.norm:
        _norm_tensor(w, ck, p + "self_attn.q_norm.weight", q.norm, d)
        _norm_tensor(w, ck, p + "self_attn.k_norm.weight", k.norm, d)
        return True
    ins = list(gqa.input) + [""] * 17
    if not ins[14] and not ins[15]:
        return False
    e = w.g.inits
    for j, name, key in ((14, "q_norm", "q_norm_epsilon"), (15, "k_norm", "k_norm_epsilon")):
        init = ins[j]
        if init not in e or e[init].shape != (d,):
            raise Decline(gqa, f"{name} weight is not an initializer of {d} values")
        w.eps.add(a.get(key, a.get("qk_norm_epsilon", 1e-6)))
        ck.add(p + f"self_attn.{name}.weight", float_name(e[init].elem), (d,),
               lambda init=init: w.g.tensor(init))
    return True


def _layer(w: Walk, gqa, i: int, x: str, h: str, names: KVNames, last: bool):
    """Translate layer i (its input norm output x, residual h); returns (the next norm output,
    residual, this layer's properties, rope spec, (cos, sin), window)."""
    g, ck, p, a = w.g, w.ck, f"model.layers.{i}.", attrs(gqa)
    nq, nkv, d, q, k, v = _attention(w, gqa, x, a)
    hidden = q.proj.cols
    qkv_bias = any(t.bias for t in (q, k, v))
    for name, t in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
        _add_traced(w, ck, p + "self_attn." + name, t, qkv_bias)
    qk_norm = _qk_norms(w, ck, gqa, a, p, q, k, d)
    sinks = gqa.input[11] if len(gqa.input) > 11 and gqa.input[11] else None
    if sinks:  # head_sink: one more logit per head in the softmax (gpt-oss's sinks)
        s = g.inits.get(sinks)
        if s is None or s.shape != (nq,) or s.elem not in FLOAT_TYPES:
            raise Decline(gqa, f"head_sink is not an initializer of num_heads={nq} floats")
        ck.add(p + "self_attn.sinks", float_name(g.inits[sinks].elem), (nq,),
               lambda: g.tensor(sinks))
    cos, sin, inter = _rope(w, gqa, a, q, k, d)
    w.claim(gqa, *(t.rope for t in (q, k) if t.rope))
    ins = list(gqa.input)
    if (ins[3], ins[4], gqa.output[1], gqa.output[2]) != (
            names.past_key, names.past_value, names.present_key, names.present_value):
        raise Decline(gqa, f"attention KV is not {names} of the graph's I/O")
    o_node = w.one(gqa.output[0], PROJ_OPS, gqa)
    o_proj = w.proj(o_node)
    o, ob = w.linear_out(o_node)
    ck.add_projection(p + "self_attn.o_proj", o_proj, 0, o_proj.rows)
    if ob is not None:
        add_bias(w, ck, p + "self_attn.o_proj", (ob, 0), o_proj.rows)
    post = _skip_norm(w, o, h, o_node)
    _norm_tensor(w, ck, p + "post_attention_layernorm.weight", post, hidden)
    h, x = _residual(post), post.output[0]
    moe = [n for n in w.consumers(x) if is_qmoe(n)]
    if moe:
        m, moe_props = translate_qmoe(w, ck, x, p, post, moe[0])
        inter_size, mlp_bias = moe_props["width"], False
    else:
        (m, inter_size, mlp_bias), moe_props = translate_mlp(w, ck, x, h, p, post, i), None
    nxt = _skip_norm(w, m, h, post)
    _norm_tensor(w, ck, "model.norm.weight" if last else
                 f"model.layers.{i + 1}.input_layernorm.weight", nxt, hidden)
    props = dict(nq=nq, nkv=nkv, d=d, scale=a.get("scale", 0.0) or d ** -0.5,
                 cap=a.get("softcap", 0.0) or None, hidden=hidden, qk_norm=qk_norm,
                 qkv_bias=qkv_bias, o_bias=ob is not None, mlp_bias=mlp_bias, inter=inter_size,
                 sinks=sinks is not None, moe=moe_props)
    rows = g.inits[cos].shape[0]
    ct, st = g.tensor(cos).float(), g.tensor(sin).float()
    base = fit_rope_base(ct[1].tolist() if rows > 1 else [],
                         st[1].tolist() if rows > 1 else [], 2 * ct.shape[1])
    win = a.get("local_window_size", -1)
    return (nxt.output[0], None if last else _residual(nxt), props,
            rope_spec(2 * ct.shape[1], base, inter, rows), (cos, sin), win if win > 0 else None)


def _residual(norm: onnx.NodeProto) -> str:
    if len(norm.output) < 4 or not norm.output[3]:
        raise Decline(norm, "the residual sum (output 3) is not produced")
    return norm.output[3]


def translate(g: OnnxGraph, report: ClaimReport, meta: dict, kv: list[KVNames],
              refused: dict[int, str] | None = None) -> Translation:
    """The decoder in `g` as mlxr config + checkpoint, claiming nodes in `report`.
    `meta`: genai_config.json's model section (or {}); kv: the graph's KV names per layer;
    refused: id() of nodes the claim declined -> why. A layer holding such a node, or one the
    walk does not recognise, is left to onnxruntime (`Translation.external`); anything
    outside the layers must translate, else Decline."""
    refused = refused or {}
    w = Walk(g, report)
    gqas = [n for n in g.nodes if n.op_type == "GroupQueryAttention" and n.domain == MS]
    if not gqas:
        raise Decline(None, "no GroupQueryAttention: not a recognised decoder")
    if any(n.input[5:7] != gqas[0].input[5:7] for n in gqas):
        raise Decline(gqas[0], "layers read different seqlens_k / total_sequence_length")
    mask_nodes = check_mask_inputs(g, input_name(gqas[0], 5), input_name(gqas[0], 6))
    if mask_nodes is None:
        raise Decline(gqas[0], "seqlens_k / total_sequence_length are not the standard values "
                               "of attention_mask")
    w.claimed |= mask_nodes
    embed = _embedding(w, g)
    stream = residual_stream(g, embed, len(kv))
    if stream is None:
        raise Decline(embed, f"the residual stream is not a first norm and two skip norms per "
                             f"layer for {len(kv)} KV layers")
    hidden = w.g.inits[stream.first_norm.input[1]].shape[0] if len(
        stream.first_norm.input) > 1 and stream.first_norm.input[1] in g.inits else 0
    _norm_tensor(w, w.ck, "model.layers.0.input_layernorm.weight", stream.first_norm, hidden)
    props, ropes, windows, tables, external = None, {}, {}, {}, {}
    for cut in stream.layers:
        i, last = cut.index, cut.index == len(kv) - 1
        _norm_tensor(w, w.ck, "model.norm.weight" if last else
                     f"model.layers.{i + 1}.input_layernorm.weight", cut.end, hidden)
        snap, why = w.snapshot(), None
        try:
            this, rope, table, win = _claim_layer(w, cut, kv[i], last, props)
            # declined ops outside the layer's sub-regions send the whole layer to ORT
            parts = w.subregions[len(snap[3]):]
            why = _refusal(cut.nodes, refused, mask_nodes | _inside(parts))
        except Decline as d:
            why = _refusal(cut.nodes, refused, mask_nodes) or d.reason
        if why is not None:
            w.restore(snap)
            external[i] = why
        else:
            props = props or this
            ropes[i], tables[i], windows[i] = rope, table, win
    if props is None:
        raise Decline(None, "no layer is translated (every layer runs on onnxruntime)")
    ref = min(ropes)  # declined layers' rope / window entries are placeholders, never read
    n = len(kv)
    ropes = [ropes.get(i, ropes[ref]) for i in range(n)]
    tables = [tables.get(i, tables[ref]) for i in range(n)]
    windows = [windows.get(i) for i in range(n)]
    head = w.one(stream.layers[-1].end.output[0], PROJ_OPS, None)
    head_proj = w.proj(head)
    out = head.output[0]
    cast = [n for n in w.consumers(out) if n.op_type == "Cast"]
    if out not in g.outputs and len(cast) == 1 and cast[0].output[0] in g.outputs:
        w.claim(cast[0])
        out = cast[0].output[0]
    if out not in g.outputs or (len(head.input) > 5 and head.input[5]):
        raise Decline(head, "the LM head does not produce a graph output without bias")
    tied = _embedding_weights(w, w.ck, embed, head, head_proj, props["hidden"])
    if not tied:
        w.ck.add_projection("lm_head", head_proj, 0, head_proj.rows)
    if len(w.eps) != 1:
        raise Decline(None, f"norms use different epsilons {sorted(w.eps)}")
    config = _config(g, meta, props, n, head_proj.rows, tied, w.eps.pop(), ropes, windows)
    positions = _positions(w)
    _check_io(g, kv, out, positions or ("position_ids" if "position_ids" in g.inputs and
                                        external else None))
    return Translation(config, w.ck, tables, positions,
                       {i: (stream.layers[i], why) for i, why in external.items()},
                       [(r, _refusal(r.nodes, refused, mask_nodes) or r.why)
                        for r in w.subregions])


def _refusal(nodes, refused: dict[int, str], skip: set[int]) -> str | None:
    """The claim's reasons for the declined nodes among `nodes` (those in `skip` aside)."""
    why = sorted({f"{n.op_type}: {refused[id(n)]}" for n in nodes
                  if id(n) in refused and id(n) not in skip})
    return "; ".join(why) or None


def _inside(parts: list[SubRegion]) -> set[int]:
    return {id(n) for r in parts for n in r.nodes}


def _claim_layer(w: Walk, cut: LayerCut, names: KVNames, last: bool, props: dict | None):
    """Translate one layer; Decline unless it is mlxr's whole: every node of the cut claimed
    and its properties those of the layers already translated."""
    gqa = [n for n in cut.nodes if n.op_type == "GroupQueryAttention" and n.domain == MS]
    if len(gqa) != 1:
        raise Decline(None, f"{len(gqa)} GroupQueryAttention nodes in the layer")
    x, _, this, rope, table, win = _layer(w, gqa[0], cut.index, cut.x, cut.h, names, last)
    if x != cut.end.output[0]:
        raise Decline(cut.end, "the layer does not end at the residual stream's norm")
    inside = _inside([r for r in w.subregions if r.layer == cut.index])
    rest = [n for n in cut.nodes if id(n) not in w.claimed and id(n) not in inside]
    if rest:
        raise Decline(rest[0], f"{len(rest)} nodes ({', '.join(sorted({n.op_type for n in rest}))})"
                               " are not part of the recognised layer")
    if props is not None and props != this:
        raise Decline(gqa[0], "the layer differs from the others in heads, scale, softcap, "
                              "sinks, MoE, norms or biases")
    return this, rope, table, win


def _check_io(g: OnnxGraph, kv: list[KVNames], logits: str, positions: str | None) -> None:
    """The graph's I/O must be exactly what mlxr's decoder computes and consumes."""
    cache = {n for k in kv for n in (k.past_key, k.past_value)}
    want_in = {"input_ids", "attention_mask"} | cache | ({positions} if positions else set())
    want_out = {logits} | {n for k in kv for n in (k.present_key, k.present_value)}
    if set(g.inputs) != want_in or set(g.outputs) != want_out:
        extra = sorted((set(g.inputs) - want_in) | (set(g.outputs) - want_out))
        raise Decline(None, f"graph inputs/outputs {extra or 'missing'} are not the "
                            "decoder's (input_ids, attention_mask, KV, logits)")


def _embedding_weights(w: Walk, ck, embed, head, head_proj, hidden: int) -> bool:
    """Add the embedding table; True when it is the LM head's own weight (tied)."""
    w.weights_constant(embed)
    ep = Projection(w.g, embed, ck.repack_s)
    if ep.cols != hidden or ep.rows != head_proj.rows:
        raise Decline(embed, f"embedding [{ep.rows}, {ep.cols}] does not fit hidden {hidden} "
                             f"and vocabulary {head_proj.rows}")
    tied = (embed.op_type == "GatherBlockQuantized" and head.op_type == "MatMulNBits"
            and ep.gbq_data()[0].name == head.input[1] and embed.input[2] == head.input[2]
            and embed.input[3:4] == head.input[3:4])
    ck.add_projection("model.embed_tokens", head_proj if tied else ep, 0, ep.rows)
    return tied


def _positions(w: Walk) -> str | None:
    names = {t.input[1] for t in w.g.nodes if t.op_type == "RotaryEmbedding"
             and id(t) in w.claimed}
    return names.pop() if len(names) == 1 else None


def _config(g: OnnxGraph, meta: dict, glob: dict, layers: int, vocab: int, tied: bool,
            eps: float, ropes, windows) -> ModelConfig:
    eos = meta.get("eos_token_id")
    eos = tuple(x for x in (eos if isinstance(eos, list) else [eos])
                if isinstance(x, int) and not isinstance(x, bool) and x >= 0)
    bos = meta.get("bos_token_id")
    past = g.inputs.get("past_key_values.0.key")
    return ModelConfig(
        model_type=str(meta.get("type") or "onnx"), vocab_size=vocab,
        hidden_size=glob["hidden"], num_layers=layers, num_heads=glob["nq"],
        num_kv_heads=glob["nkv"], head_dim=glob["d"], intermediate_size=glob["inter"],
        rms_norm_eps=eps, max_position_embeddings=min(r.max_position_embeddings for r in ropes),
        tie_word_embeddings=tied, qkv_bias=glob["qkv_bias"], o_bias=glob["o_bias"],
        mlp_bias=glob["mlp_bias"], qk_norm=glob["qk_norm"], attn_sinks=glob["sinks"],
        moe=moe_spec(glob, layers) if glob["moe"] else None,
        attn_scale=glob["scale"],
        attn_logit_softcap=glob["cap"], layer_rope=tuple(ropes), layer_window=tuple(windows),
        bos_token_id=bos if isinstance(bos, int) and not isinstance(bos, bool) else None,
        eos_token_ids=eos, torch_dtype=None if past is None else
        {1: "float32", 10: "float16", 16: "bfloat16"}.get(past.elem))
