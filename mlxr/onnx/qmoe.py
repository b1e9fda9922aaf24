"""QMoE (onnxruntime's quantized mixture-of-experts op) onto mlxr's MoE block (gpt-oss's).

What the CPU provider computes (verified against onnxruntime 1.32, the graphs the GenAI
builder writes for gpt-oss): router logits [T, X] (a projection + bias + Reshape(-1, X)
feeding input 1); the k largest logits, softmax over those k (for normalize_routing_weights
0 and 1 alike); per chosen expert h = W1 x + b1 with W1's rows interleaved [g0, u0, g1, u1,
...] (swiglu_fusion=1), a = (clamp(u, -limit, limit) + beta) * g' * sigmoid(alpha * g') with
g' = min(g, limit), y = W2 a + b2; out = sum of the k weighted y. With beta = 1 that is
`MoeSpec(router="topk_softmax", expert_act="swiglu_oai")` exactly.

Weights: fc1 uint8 [X, 2F, E*bits/8], scales [X, 2F, E/block] (fc2: [X, E, F*bits/8],
[X, E, F/block]) quantized like MatMulNBits (codes LSB first, default zero point
2^(bits-1)), so each expert's rows repack to MLX affine words as MatMulNBits' do; the
interleaved rows split into gate_proj (even) and up_proj (odd) stacks [X, F, ...].
"""

from __future__ import annotations

import math
import time

import onnx
import torch

from ..config.moe import MoeSpec
from .claim import MS, attrs, input_name
from ..errors import ModelFormatError
from .graph import FLOAT_TYPES, OnnxGraph, type_name
from .repack import AffineWeight, block_affine, group_size
from .walk import PROJ_OPS, Decline, Walk
from .weights import OnnxCheckpoint

class _Experts:
    """One QMoE's fc1 / fc2 repacked once: gate, up and down as MLX affine stacks."""

    def __init__(self, g: OnnxGraph, node: onnx.NodeProto, x: int, e: int, f: int, bits: int,
                 block: int, timer: list[float]):
        self.g, self.node, self.shape = g, node, (x, e, f, bits, block)
        self._timer = timer
        self._value: dict[str, AffineWeight] | None = None

    def value(self) -> dict[str, AffineWeight]:
        if self._value is None:
            t0 = time.perf_counter()
            self._value = self._read()
            self._timer[0] += time.perf_counter() - t0
        return self._value

    def _stack(self, w: int, s: int, zp: int, rows: int) -> AffineWeight:
        g, (x, _, _, bits, block) = self.g, self.shape
        zero = input_name(self.node, zp)
        data = g.tensor(input_name(self.node, w)).reshape(x * rows, -1)
        aw = block_affine(data, g.tensor(input_name(self.node, s)).reshape(x * rows, -1),
                          None if not zero else g.tensor(zero).reshape(x * rows, -1), bits,
                          block, 2.0 ** (bits - 1), f"node {self.node.name!r}")
        return AffineWeight(*(t.reshape(x, rows, -1) for t in aw))

    def _read(self) -> dict[str, AffineWeight]:
        _, e, f, _, _ = self.shape
        fc1 = self._stack(2, 3, 11, 2 * f)
        rows = {"gate_proj": slice(0, None, 2), "up_proj": slice(1, None, 2)}
        out = {k: AffineWeight(*(t[:, r].contiguous() for t in fc1)) for k, r in rows.items()}
        out["down_proj"] = self._stack(5, 6, 12, e)
        return out


def translate_qmoe(w: Walk, ck: OnnxCheckpoint, x: str, p: str, at: onnx.NodeProto,
                   moe: onnx.NodeProto) -> tuple[str, dict]:
    """The layer's MoE (QMoE reading the norm output x, routed by a projection of x) as
    mlxr tensors under `p`mlp.; returns (the MoE's output, its properties)."""
    g, a = w.g, attrs(moe)
    if moe.input[0] != x or len(w.consumers(x)) != 2:
        raise Decline(at, "the MoE norm's output does not feed exactly the router and QMoE")
    router, rbias = _router(w, moe.input[1])
    if router.node.input[0] != x:
        raise Decline(router.node, "the router does not read the layer's norm")
    computed = [i for i in (2, 3, 4, 5, 6, 7, 11, 12)
                if input_name(moe, i) and input_name(moe, i) not in g.inits]
    if computed:  # the claim declined these already; its layer may still be walked
        raise Decline(moe, f"inputs {computed} are computed at run time, not initializers")
    wt, sc = g.inits[moe.input[2]], g.inits[moe.input[3]]
    bits, block, k = a.get("expert_weight_bits", 4), a["block_size"], a.get("k", 1)
    nx, two_f = wt.shape[0], wt.shape[1]
    e, f = router.cols, two_f // 2
    if wt.shape != (nx, two_f, e * bits // 8) or two_f % 2 or sc.elem not in FLOAT_TYPES:
        raise Decline(moe, f"fc1 {list(wt.shape)} does not fit hidden {e}")
    w2 = g.inits[moe.input[5]]
    if w2.shape != (nx, e, f * bits // 8) or router.rows != nx:
        raise Decline(moe, f"fc2 {list(w2.shape)} / router {router.rows} do not fit {nx} "
                           f"experts of width {f}")
    if not 1 <= k <= nx or e % block or f % block or e % 32 or f % 32:
        raise Decline(moe, f"k={k}, hidden {e}, expert width {f}, block {block} do not fit "
                           "mlxr's block")
    for i, shape in ((3, (nx, two_f, e // block)), (6, (nx, e, f // block)),
                     (4, (nx, two_f)), (7, (nx, e))):
        name = input_name(moe, i)
        if name and (g.inits[name].numel != shape[0] * shape[1] * (shape[2] if len(shape) > 2
                                                                   else 1)
                     or g.inits[name].elem not in FLOAT_TYPES):
            raise Decline(moe, f"input {i} {list(g.inits[name].shape)} is not {list(shape)}")
    base = p + "mlp."
    ck.add_projection(base + "router", router, 0, nx)
    _bias(ck, g, base + "router.bias", rbias, (nx,))
    experts = _Experts(g, moe, nx, e, f, bits, block, ck.repack_s)
    groups = {"gate_proj": e, "up_proj": e, "down_proj": f}
    outs = {"gate_proj": f, "up_proj": f, "down_proj": e}
    for name in ("gate_proj", "up_proj", "down_proj"):
        path, n, cols = base + "experts." + name, outs[name], groups[name]
        gs = cols // group_size(block)
        ck.add(path + ".weight", "U32", (nx, n, cols * bits // 32),
               lambda name=name: experts.value()[name].words)
        for part in ("scales", "biases"):
            ck.add(f"{path}.{part}", "F32", (nx, n, gs),
                   lambda name=name, part=part: getattr(experts.value()[name], part))
    fc1_bias, fc2_bias = input_name(moe, 4), input_name(moe, 7)

    def gate_up_bias(rows: slice):
        return lambda: g.tensor(fc1_bias).reshape(nx, two_f)[:, rows].float().contiguous()

    if fc1_bias:
        ck.add(base + "experts.gate_proj.bias", "F32", (nx, f), gate_up_bias(slice(0, None, 2)))
        ck.add(base + "experts.up_proj.bias", "F32", (nx, f), gate_up_bias(slice(1, None, 2)))
    else:
        for name in ("gate_proj", "up_proj"):
            _bias(ck, g, base + f"experts.{name}.bias", None, (nx, f))
    _bias(ck, g, base + "experts.down_proj.bias", fc2_bias or None, (nx, e))
    w.claim(moe)
    props = dict(experts=nx, k=k, width=f, alpha=float(a.get("activation_alpha", 1.0)),
                 limit=float(a.get("swiglu_limit", float("inf"))))
    return moe.output[0], props


def _bias(ck: OnnxCheckpoint, g: OnnxGraph, name: str, init: str | None,
          shape: tuple[int, ...]) -> None:
    if init is None:
        ck.add(name, "F32", shape, lambda: torch.zeros(shape))
    else:
        info = g.inits[init]
        if info.numel != math.prod(shape) or info.elem not in FLOAT_TYPES:
            raise ModelFormatError(f"{g.path.name}: initializer '{init}' is "
                                   f"{type_name(info.elem)}{list(info.shape)}, not the float "
                                   f"bias {list(shape)} of its QMoE")
        ck.add(name, "F32", shape, lambda: g.tensor(init).reshape(shape).float())


def _router(w: Walk, v: str):
    """The router projection behind QMoE's router_probs: Reshape(-1, X) <- [bias Add] <-
    projection; returns (Projection, bias initializer or None)."""
    r = w.g.producer.get(v)
    if r is not None and r.op_type == "Reshape":
        w.claim(r)
        v = r.input[0]
        r = w.g.producer.get(v)
    bias = None
    if r is not None and r.op_type == "Add":
        b = [i for i in r.input if i in w.g.inits]
        if len(b) != 1:
            raise Decline(r, "an Add before the router logits that is not a bias")
        bias = b[0]
        w.claim(r)
        r = w.g.producer.get([i for i in r.input if i != bias][0])
    if r is None or r.op_type not in PROJ_OPS:
        raise Decline(r, "the router logits are not a projection of the layer's norm")
    return w.proj(r), bias


def moe_spec(props: dict, layers: int) -> MoeSpec:
    m = props["moe"]
    return MoeSpec(m["experts"], m["k"], m["width"], (True,) * layers, router="topk_softmax",
                   router_bias=True, expert_act="swiglu_oai", act_alpha=m["alpha"],
                   act_limit=m["limit"], expert_bias=True, router_path="router",
                   experts_path="experts")


def is_qmoe(n: onnx.NodeProto) -> bool:
    return n.op_type == "QMoE" and n.domain == MS
