"""Per-layer fallback: the layers mlxr declines run on onnxruntime's CPU provider, the rest on
mlxr's decoder, in one forward.

A part of a layer can go instead of the whole (`OrtSubRegion`, see mlxr.onnx.mlp): an
unknown op between the MLP norm and its projections, or in the MLP's activation; mlxr runs
the rest of that layer and hands onnxruntime just the boundary tensors.

A declined layer (an op mlxr has no translation for, a QMoE it cannot take, ...) becomes an
`OrtRegion`: one onnxruntime session over that layer's own subgraph (`chain.LayerCut`: from
its normed input x and stream h to the attention's residual sum h_mid and the MLP output m),
with the layer's initializers copied in. mlxr computes x and h, hands them across (numpy,
the graph's activation dtype), and continues from (h_mid, m) with its own add + norm; the
layer's KV stays in mlxr's cache (past fed in, the new rows of present written back). The
region's MatMulNBits run with accuracy_level=0 (float activations), the numerics of the
mlxr layers around it, not ORT's int8-activation path; a sliding-window attention with a
window-sized buffer (sliding_window_cache=1) reads mlxr's full cache instead, which gives the
same attention.

`RegionDecoder` is mlxr's Decoder for one sequence at a time (the single-request path, and
the serving engine's per-sequence caches, as for the hybrid families); with MLXR_TRACE each
step shows the mlxr segments and the onnxruntime regions as spans.
"""

from __future__ import annotations

import time

import numpy as np
import onnx
import torch

from ..harness import trace
from ..engine.kv_cache import SequenceCache
from ..errors import MlxrError, ModelFormatError
from ..models.decoder import Decoder, Step
from .chain import LayerCut
from .fallback import NP_TYPES, ort_run, ort_session
from .folder import KVNames
from .graph import OnnxGraph
from .mlp import SubRegion

NP_INT = {onnx.TensorProto.INT64: np.int64, onnx.TensorProto.INT32: np.int32}


class StepClock:
    """Where the current step's mlxr segment began (for the trace spans)."""

    def __init__(self):
        self.t0, self.first = 0, 0

    def restart(self) -> None:
        self.t0, self.first = time.perf_counter_ns(), 0

    def close(self, upto: str, next_first: int) -> None:
        now = time.perf_counter_ns()
        trace.complete("mlxr", self.t0, now, {"layers": f"{self.first}..{upto}"})
        self.t0, self.first = now, next_first


def region_model(g: OnnxGraph, cut: LayerCut, kv: KVNames, act_elem: int) -> bytes:
    """The serialized subgraph of layer `cut` with its initializers inside."""
    allowed = {"attention_mask", "position_ids", kv.past_key, kv.past_value}
    odd = sorted(set(cut.graph_inputs) - allowed)
    if odd:
        raise ModelFormatError(f"{g.path.name}: layer {cut.index} reads graph inputs {odd}: "
                               "it cannot run as a region")
    model_in = {v.name: v for v in g.model.graph.input}
    model_out = {v.name: v for v in g.model.graph.output}
    inputs = [onnx.helper.make_tensor_value_info(v, act_elem, None) for v in (cut.x, cut.h)]
    inputs += [model_in[v] for v in cut.graph_inputs]
    outputs = [onnx.helper.make_tensor_value_info(v, act_elem, None) for v in (cut.h_mid, cut.m)]
    outputs += [model_out[v] for v in (kv.present_key, kv.present_value)]
    return subgraph_model(g, cut.nodes, inputs, outputs, f"layer{cut.index}")


def subgraph_model(g: OnnxGraph, nodes, inputs: list, outputs: list, name: str) -> bytes:
    """The serialized graph of `nodes` (of `g`, in graph order) between the value infos
    `inputs` and `outputs`, with the initializers they read inside."""
    copies = []
    for n in nodes:
        c = onnx.NodeProto()
        c.CopyFrom(n)
        for a in c.attribute:
            # float activations, as mlxr's layers; a window-sized KV buffer becomes mlxr's
            # full cache (the attention is the same: the window masks the rest)
            if (c.op_type, a.name) in (("MatMulNBits", "accuracy_level"),
                                       ("GroupQueryAttention", "sliding_window_cache")):
                a.i = 0
        copies.append(c)
    names = {i for n in nodes for i in n.input if i in g.inits}
    inits = [g.tensor_proto(x) for x in sorted(names)]
    graph = onnx.helper.make_graph(copies, name, inputs, outputs, inits)
    m = onnx.helper.make_model(graph, opset_imports=list(g.model.opset_import))
    m.ir_version = g.model.ir_version
    return m.SerializeToString()


class OrtRegion:
    """`Layer.external` for one declined layer: its subgraph on onnxruntime's CPU provider."""

    def __init__(self, g: OnnxGraph, cut: LayerCut, kv: KVNames, clock: StepClock):
        self.cut, self.kv, self.clock = cut, kv, clock
        act = g.inputs[kv.past_key].elem
        self.np_dtype = NP_TYPES.get(act)
        if self.np_dtype is None:
            raise ModelFormatError(f"{g.path.name}: activations of type {act} are not "
                                   "float32/16")
        self.int_types = {v: NP_INT.get(g.inputs[v].elem, np.int64) for v in cut.graph_inputs
                          if v in ("attention_mask", "position_ids")}
        self.session = ort_session(g.path, model=region_model(g, cut, kv, act))
        self.path = g.path
        self.wanted = [cut.h_mid, cut.m, kv.present_key, kv.present_value]

    def __call__(self, x: torch.Tensor, h: torch.Tensor, i: int, pool,
                 slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x, h [T, E] of one sequence whose cache slots are its positions (RegionDecoder)."""
        self.clock.close(str(i - 1), i + 1)
        t, start = x.shape[0], int(slots[0])
        with trace.span("onnxruntime", {"layer": i, "tokens": t}):
            kc, vc = pool.k[i], pool.v[i]
            feeds = {self.cut.x: self._np(x)[None], self.cut.h: self._np(h)[None],
                     self.kv.past_key: self._np(kc[:, :start])[None],
                     self.kv.past_value: self._np(vc[:, :start])[None]}
            for name, dt in self.int_types.items():
                feeds[name] = (np.ones((1, start + t), dt) if name == "attention_mask" else
                               np.arange(start, start + t, dtype=dt)[None])
            h_mid, m, pk, pv = ort_run(self.session, self.path, self.wanted, feeds)
            kc[:, start:start + t] = torch.from_numpy(pk[0, :, start:]).to(kc.dtype)
            vc[:, start:start + t] = torch.from_numpy(pv[0, :, start:]).to(vc.dtype)
            out = (torch.from_numpy(h_mid[0]).to(h.dtype), torch.from_numpy(m[0]).to(h.dtype))
        self.clock.t0 = time.perf_counter_ns()
        return out

    def _np(self, t: torch.Tensor) -> np.ndarray:
        return t.detach().float().cpu().numpy().astype(self.np_dtype, copy=False)


class OrtSubRegion:
    """`Layer.mlp_input` / `Layer.mlp_act` for a part of a layer mlxr declines
    (`mlp.SubRegion`): its nodes on onnxruntime's CPU provider, fed the boundary tensors
    ([T, width] each, one sequence: a batch of one for the graph)."""

    def __init__(self, g: OnnxGraph, r: SubRegion, act_elem: int, clock: StepClock):
        self.region, self.clock = r, clock
        self.np_dtype = NP_TYPES.get(act_elem)
        if self.np_dtype is None:
            raise ModelFormatError(f"{g.path.name}: activations of type {act_elem} are not "
                                   "float32/16")
        io = [onnx.helper.make_tensor_value_info(v, act_elem, None)
              for v in (*r.inputs, r.output)]
        self.path = g.path
        self.session = ort_session(g.path, model=subgraph_model(
            g, r.nodes, io[:-1], io[-1:], f"layer{r.layer}_{r.where.replace(' ', '_')}"))

    def __call__(self, *xs: torch.Tensor) -> torch.Tensor:
        r = self.region
        self.clock.close(f"{r.layer} ({r.where})", r.layer)
        with trace.span("onnxruntime", {"layer": r.layer, "part": r.where,
                                        "tokens": xs[0].shape[0]}):
            feeds = {name: x.detach().float().cpu().numpy().astype(self.np_dtype)[None]
                     for name, x in zip(r.inputs, xs)}
            out = ort_run(self.session, self.path, [r.output], feeds)[0][0]
            y = torch.from_numpy(out).to(device=xs[0].device, dtype=xs[0].dtype)
        self.clock.t0 = time.perf_counter_ns()
        return y


class RegionDecoder(Decoder):
    """mlxr's decoder with some layers on onnxruntime: one sequence per forward."""

    clock: StepClock

    @classmethod
    def wrap(cls, d: Decoder, clock: StepClock) -> RegionDecoder:
        out = cls(d.config, d.embed, d.layers, d.norm, d.lm_head, d.dtype, d.device)
        out.clock = clock
        return out

    def new_cache(self, capacity: int) -> SequenceCache:
        c = self.config
        return SequenceCache(c.num_layers, c.num_kv_heads, c.head_dim, self.dtype, self.device,
                             capacity)

    def forward_batch(self, ids: torch.Tensor, caches: list) -> torch.Tensor:
        """One decode token for each sequence (ids [B]): one forward each."""
        return torch.stack([self.forward(ids[j:j + 1], c, last_only=True)[0]
                            for j, c in enumerate(caches)])

    def forward_step(self, ids: torch.Tensor, step: Step, pool) -> torch.Tensor:
        sp = step.spans
        if step.paged is not None or len(sp) != 1 or sp[0].slot_range != (
                0, sp[0].q_start + sp[0].q_len):
            raise MlxrError("a graph partly on onnxruntime runs one sequence per step")
        self.clock.restart()
        logits = super().forward_step(ids, step, pool)
        self.clock.close("head", 0)
        return logits

    def forward_static(self, *args, **kw):
        raise MlxrError("CUDA graphs are not available for a graph partly on onnxruntime")

    forward_paged = forward_static
