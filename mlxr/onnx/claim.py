"""Which nodes of an ONNX decoder mlxr can run, and why it declines the others.

Every contrib op is checked against the attributes and inputs of the schema mlxr was written
for (onnxruntime 1.32's com.microsoft ops, version 1): an attribute name outside that schema,
an invalid value (bits=3, a block size that is not a power of two, K/N that disagree with the
weight) or an EP-specific prepacked layout is a ModelFormatError naming the node -- the file
is not what mlxr (or the CPU provider) would compute correctly. A valid feature that mlxr's
decoder does not have (a quantized KV cache, a QMoE variant) is *declined* with a
reason: the layer holding it then runs on onnxruntime's CPU provider (`regions`), or the
whole graph where the node lies outside the layers.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from dataclasses import dataclass, field

import onnx

from ..errors import ModelFormatError
from .graph import FLOAT_TYPES, OnnxGraph, type_name

MS = "com.microsoft"
# attribute names of each op as of onnxruntime 1.32 (schema version 1 / ONNX opset noted)
SCHEMAS: dict[tuple[str, str], set[str]] = {
    (MS, "MatMulNBits"): {"K", "N", "accuracy_level", "bits", "block_size", "weight_prepacked"},
    (MS, "GroupQueryAttention"): {
        "causal", "do_rotary", "k_norm_epsilon", "k_quant_type", "kv_cache_bit_width",
        "kv_num_heads", "local_window_size", "num_heads", "q_norm_epsilon", "qk_norm_epsilon",
        "qk_output", "rotary_interleaved", "scale", "sliding_window_cache", "smooth_softmax",
        "softcap", "v_quant_type"},
    (MS, "SkipSimplifiedLayerNormalization"): {"epsilon"},
    (MS, "RotaryEmbedding"): {"interleaved", "is_packed_batching", "num_heads",
                              "rotary_embedding_dim", "scale"},
    (MS, "GatherBlockQuantized"): {"bits", "block_size", "gather_axis", "quantize_axis"},
    (MS, "QMoE"): {
        "accuracy_level", "activation_alpha", "activation_beta", "activation_type",
        "block_size", "expert_weight_bits", "fc1_expert_weight_bits", "fc2_expert_weight_bits",
        "fc3_expert_weight_bits", "k", "normalize_routing_weights", "quant_type",
        "swiglu_fusion", "swiglu_limit", "swiglu_limit_after_activation", "use_sparse_mixer",
        "weights_prepacked"},
    ("", "SimplifiedLayerNormalization"): {"axis", "epsilon", "stash_type"},
    ("", "RMSNormalization"): {"axis", "epsilon", "stash_type"},
}
# standard ops that appear in the decoder chain (the mask reformat, embedding, SiLU, biases,
# q/k-norm reshapes); they are claimed only where the translator finds them in that chain
PLAIN_OPS = {"Constant", "ReduceSum", "Sub", "Cast", "Shape", "Gather", "Mul", "Sigmoid", "Add",
             "Reshape", "Split", "MatMul", "Squeeze", "Unsqueeze"}
MAX_HEADS = 1024
MIN_GROUP = 32  # mlxr's affine kernels take groups of 32, 64 or 128
MAX_EPS = 1.0  # a norm epsilon is in [0, MAX_EPS]
MAX_FINITE = 3.4e38  # float32's range: float attributes that must be finite


def attrs(node: onnx.NodeProto) -> dict:
    try:
        return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    except ValueError as e:  # an attribute of an undefined type
        raise ModelFormatError(f"{where(node)}: unreadable attribute ({e})") from None


# the ops mlxr translates: their domain, and which inputs the schema requires (the translator
# indexes those; a node lacking one is invalid, and onnxruntime refuses it too)
HOME = {op: dom for dom, op in SCHEMAS} | {op: "" for op in PLAIN_OPS}
REQUIRED_INPUTS = {"MatMulNBits": 3, "GroupQueryAttention": 1,
                   "SkipSimplifiedLayerNormalization": 3, "SimplifiedLayerNormalization": 2,
                   "RMSNormalization": 2, "RotaryEmbedding": 4, "GatherBlockQuantized": 3,
                   "QMoE": 4, "Constant": 0, "Sigmoid": 1, "Cast": 1, "Shape": 1,
                   "Squeeze": 1, "Unsqueeze": 1, "ReduceSum": 1, "Split": 1}
# (the others take 2: binary ops, Gather, Reshape)
REQUIRED_AT = {"GroupQueryAttention": (5, 6), "QMoE": (5, 6)}  # required after optional ones


def _check_arity(node: onnx.NodeProto) -> None:
    need = [*range(REQUIRED_INPUTS.get(node.op_type, 2)), *REQUIRED_AT.get(node.op_type, ())]
    missing = [i for i in need if not input_name(node, i)]
    if missing:
        raise ModelFormatError(f"{where(node)}: required input(s) {missing} are missing "
                               f"({len(node.input)} given)")
    if not node.output or not node.output[0]:
        raise ModelFormatError(f"{where(node)}: output 0 is missing")


def _local_function(g: OnnxGraph, node: onnx.NodeProto) -> bool:
    return any(f.name == node.op_type and f.domain == node.domain for f in g.model.functions)


def where(node: onnx.NodeProto) -> str:
    return f"node {node.name or '(unnamed)'!r} ({node.op_type})"


def _int_attr(node, a: dict, key: str, default=None, lo: int = 0, hi: int = 1 << 40) -> int:
    v = a.get(key, default)
    if v is None:
        raise ModelFormatError(f"{where(node)}: required attribute '{key}' is missing")
    if not isinstance(v, int) or not lo <= v <= hi:
        raise ModelFormatError(f"{where(node)}: attribute {key}={v!r} is out of range "
                               f"[{lo}, {hi}]")
    return v


def _float_attr(node, a: dict, key: str, default: float, lo: float, hi: float) -> float:
    """A float attribute in [lo, hi] (NaN never is); onnxruntime reads an attribute of another
    type as an error and asserts on some out-of-range values (a negative QMoE swiglu_limit
    aborts the process in std::clamp), so both are refused before it sees the graph."""
    v = a.get(key, default)
    if not isinstance(v, float) or not lo <= v <= hi:
        raise ModelFormatError(f"{where(node)}: attribute {key}={v!r:.40} is invalid "
                               f"(a float in [{lo:g}, {hi:g}])")
    return v


def input_name(node: onnx.NodeProto, i: int) -> str:
    """The node's i-th input name, "" where it has fewer (an omitted optional input)."""
    return node.input[i] if i < len(node.input) else ""


def text(v):
    """A string attribute as str (bytes that are not UTF-8 replaced, not an error: they then
    match no known value); other types as they are."""
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else v


@dataclass
class ClaimReport:
    """Per node: claimed, or declined with a reason."""

    claimed: set[int] = field(default_factory=set)  # id() of claimed nodes
    # (node, or None for the graph as a whole, and why)
    declined: list[tuple[onnx.NodeProto | None, str]] = field(default_factory=list)
    # layers that run on onnxruntime while mlxr runs the rest: (layer index, why)
    regions: list[tuple[int, str]] = field(default_factory=list)
    # parts of mlxr's layers that run on onnxruntime: (layer index, which part, why)
    parts: list[tuple[int, str, str]] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not self.declined and not self.regions and not self.parts

    def lines(self) -> list[str]:
        """One line per (op, reason): how many nodes, and what to do about it; then one line
        per layer left to onnxruntime."""
        counts = Counter(("graph" if n is None else f"{n.domain or 'ai.onnx'}:{n.op_type}", why)
                         for n, why in self.declined)
        out = [f"declined {op} x{k}: {why}" for (op, why), k in sorted(counts.items())]
        return (out + [f"layer {i}: onnxruntime CPU ({why})" for i, why in self.regions]
                + [f"layer {i} {part}: onnxruntime CPU ({why})" for i, part, why in self.parts])

    def summary(self, total: int) -> str:
        if self.complete:
            return f"claimed all {total} nodes (mlxr's decoder)"
        if self.regions or self.parts:
            whole = ", ".join(str(i) for i, _ in self.regions)
            part = ", ".join(sorted({str(i) for i, _, _ in self.parts}))
            ort = " and ".join(x for x in (whole and f"layer(s) {whole}",
                                           part and f"part(s) of layer(s) {part}") if x)
            return (f"claimed {len(self.claimed)} of {total} nodes: mlxr runs the decoder, "
                    f"onnxruntime's CPU provider {ort}")
        return (f"declined {len(self.declined)} of {total} nodes: the whole graph runs on "
                "onnxruntime's CPU provider")


def check_opsets(g: OnnxGraph) -> None:
    v = g.opsets.get(MS)
    if v is not None and v != 1:
        raise ModelFormatError(f"{g.path.name}: opset com.microsoft version {v} is unknown to "
                               "mlxr (written for version 1)")


def check_node(g: OnnxGraph, node: onnx.NodeProto) -> str | None:
    """None if mlxr can translate the node, else why not. Raises ModelFormatError for a node
    that is invalid or laid out for one execution provider only."""
    key = (node.domain if node.domain != "ai.onnx" else "", node.op_type)
    home = HOME.get(node.op_type)
    if home is not None and key[0] != home and not _local_function(g, node):
        raise ModelFormatError(f"{where(node)}: domain {node.domain or 'ai.onnx'!r} has no "
                               f"{node.op_type} (it is a {home or 'ai.onnx'} op)")
    if home is not None:
        _check_arity(node)
    a = attrs(node)
    known = SCHEMAS.get(key)
    if known is not None:
        unknown = sorted(set(a) - known)
        if unknown:
            raise ModelFormatError(f"{where(node)}: attributes {unknown} are not in the "
                                   f"{node.op_type} schema mlxr knows (onnxruntime 1.32)")
    elif key[0] == "" and node.op_type in PLAIN_OPS:
        return None
    else:
        return "mlxr has no translation for this op"
    check = CHECKS.get(node.op_type)
    return check(g, node, a) if check else None


def _matmul_nbits(g: OnnxGraph, node, a: dict) -> str | None:
    k = _int_attr(node, a, "K", lo=1)
    n = _int_attr(node, a, "N", lo=1)
    bits = _int_attr(node, a, "bits", 4, 1, 8)
    bs = _int_attr(node, a, "block_size", lo=16, hi=1 << 16)
    _int_attr(node, a, "accuracy_level", 0, 0, 4)
    if _int_attr(node, a, "weight_prepacked", 0, 0, 255):
        raise ModelFormatError(f"{where(node)}: weight_prepacked={a['weight_prepacked']} is a "
                               "CUDA-only layout; export with matmulnbits_weights_prepacked=0")
    if bits not in (2, 4, 8) or bs & (bs - 1):
        raise ModelFormatError(f"{where(node)}: bits={bits}, block_size={bs}: expected bits in "
                               "2/4/8 and a power-of-two block size >= 16")
    kb = -(-k // bs)
    b = g.inits.get(input_name(node, 1))
    s = g.inits.get(input_name(node, 2))
    if b is None or s is None:
        return "weight or scales are computed at run time, not initializers"
    if b.elem != onnx.TensorProto.UINT8 or b.shape != (n, kb, bs * bits // 8):
        raise ModelFormatError(f"{where(node)}: B is {type_name(b.elem)}{list(b.shape)}, "
                               f"K={k} N={n} bits={bits} block_size={bs} need UINT8"
                               f"{[n, kb, bs * bits // 8]}")
    if s.elem not in FLOAT_TYPES or s.numel != n * kb:
        raise ModelFormatError(f"{where(node)}: scales {type_name(s.elem)}{list(s.shape)} do not "
                               f"hold N*k_blocks = {n * kb} floats")
    zp_name, bias_name = input_name(node, 3), input_name(node, 5)
    if zp_name:
        zp = g.inits.get(zp_name)
        if zp is None:
            return "zero points are computed at run time"
        packed = n * -(-kb * bits // 8)
        if not ((zp.elem == onnx.TensorProto.UINT8 and zp.numel == packed)
                or (zp.elem in FLOAT_TYPES and zp.numel == n * kb)):
            raise ModelFormatError(f"{where(node)}: zero_points {type_name(zp.elem)}"
                                   f"{list(zp.shape)} fit neither the packed uint8 nor the "
                                   "float layout")
    if input_name(node, 4):
        return "g_idx (act-order) is not supported"
    if bias_name:
        bias = g.inits.get(bias_name)
        if bias is None or bias.numel != n:
            return "bias is not an initializer of N values"
    if k % bs:
        return f"K={k} is not a multiple of block_size={bs} (padded last block)"
    if bs < MIN_GROUP:
        return f"block_size={bs}: mlxr's affine groups are 32 to 128 (larger blocks split)"
    return None


def _gqa(g: OnnxGraph, node, a: dict) -> str | None:
    nq = _int_attr(node, a, "num_heads", lo=1, hi=MAX_HEADS)
    nkv = _int_attr(node, a, "kv_num_heads", lo=1, hi=MAX_HEADS)
    if nq % nkv:
        raise ModelFormatError(f"{where(node)}: num_heads={nq} is not a multiple of "
                               f"kv_num_heads={nkv}")
    for key, lo, hi in (("do_rotary", 0, 1), ("rotary_interleaved", 0, 1), ("causal", 0, 1),
                        ("sliding_window_cache", 0, 1), ("qk_output", 0, 3),
                        ("smooth_softmax", -1, 1), ("local_window_size", -1, 1 << 24)):
        _int_attr(node, a, key, {"causal": 1, "smooth_softmax": -1,
                                 "local_window_size": -1}.get(key, 0), lo, hi)
    for key in ("q_norm_epsilon", "k_norm_epsilon", "qk_norm_epsilon"):
        _float_attr(node, a, key, 1e-6, 0.0, MAX_EPS)
    for key in ("scale", "softcap"):
        v = a.get(key, 0.0)
        if not isinstance(v, float) or v != v or abs(v) == float("inf") or v < 0:
            raise ModelFormatError(f"{where(node)}: attribute {key}={v!r} is invalid")
    for key in ("k_quant_type", "v_quant_type"):
        v = a.get(key, b"NONE")
        v = text(v)
        if v not in ("NONE", "PER_TENSOR", "PER_CHANNEL"):
            raise ModelFormatError(f"{where(node)}: {key}={v!r} is unknown")
        if v != "NONE":
            return "quantized KV cache (k/v_quant_type) is not in mlxr's attention"
    if a.get("causal", 1) != 1:
        return "non-causal attention"
    if a.get("smooth_softmax", -1) == 1:
        return "smooth_softmax (a zero sink logit) is not in mlxr's attention"
    if a.get("sliding_window_cache", 0) and a.get("local_window_size", -1) <= 0:
        return "window-sized KV buffers (sliding_window_cache=1) without a window"
    if a.get("qk_output", 0):
        return "qk_output is not supported"
    for i, what in ((9, "position_ids"), (10, "attention_bias"), (12, "k_scale"),
                    (13, "v_scale"), (16, "query_seqlens")):
        if input_name(node, i):
            return f"input {what} is not in mlxr's attention"
    sink_name = input_name(node, 11)
    sink = g.inits.get(sink_name) if sink_name else None
    if sink_name and (sink is None or sink.elem not in FLOAT_TYPES or sink.shape != (nq,)):
        return f"head_sink is not an initializer of num_heads={nq} floats"
    if len(node.input) > 17:
        raise ModelFormatError(f"{where(node)}: {len(node.input)} inputs, the schema has 17")
    if a.get("do_rotary", 0):
        cos, sin = g.inits.get(input_name(node, 7)), g.inits.get(input_name(node, 8))
        if cos is None or sin is None:
            return "rotary cos/sin caches are not initializers"
    return None


def _norm(g: OnnxGraph, node, a: dict) -> str | None:
    _float_attr(node, a, "epsilon", 1e-5, 0.0, MAX_EPS)
    if a.get("axis", -1) != -1:
        return f"normalization over axis {a['axis']} (only the last axis is supported)"
    if a.get("stash_type", 1) != 1:
        return "stash_type other than float32"
    if node.op_type == "SkipSimplifiedLayerNormalization" and input_name(node, 3):
        return "SkipSimplifiedLayerNormalization with a bias input"
    if node.op_type == "SkipSimplifiedLayerNormalization" and any(
            v in g.consumers or v in g.outputs for v in node.output[1:3] if v):
        return "mean / inv_std outputs are consumed"
    return None


def _rotary(g: OnnxGraph, node, a: dict) -> str | None:
    _int_attr(node, a, "interleaved", 0, 0, 1)
    _int_attr(node, a, "num_heads", 0, 0, MAX_HEADS)
    _int_attr(node, a, "rotary_embedding_dim", 0, 0, 1 << 16)
    if a.get("is_packed_batching", 0):
        return "packed batching is not supported"
    if a.get("scale", 1.0) != 1.0:
        return "a rotary scale other than 1"
    if g.inits.get(input_name(node, 2)) is None or g.inits.get(input_name(node, 3)) is None:
        return "rotary cos/sin caches are not initializers"
    return None


def _gather_bq(g: OnnxGraph, node, a: dict) -> str | None:
    bits = _int_attr(node, a, "bits", 4, 1, 8)
    bs = _int_attr(node, a, "block_size", 128, 16, 1 << 16)
    if bits not in (2, 4, 8) or bs & (bs - 1):
        raise ModelFormatError(f"{where(node)}: bits={bits}, block_size={bs} are invalid")
    if a.get("gather_axis", 0) != 0 or a.get("quantize_axis", 1) not in (1, -1):
        return "only row gathers of row-quantized tables are supported"
    if bs < MIN_GROUP:
        return f"block_size={bs}: mlxr's affine groups are 32 to 128 (larger blocks split)"
    return None


INF = float("inf")
# QMoE's integer attributes (type-checked; k bounded: the translator compares it)
QMOE_INTS = ("expert_weight_bits", "fc1_expert_weight_bits", "fc2_expert_weight_bits",
             "fc3_expert_weight_bits", "block_size", "swiglu_fusion", "use_sparse_mixer",
             "swiglu_limit_after_activation", "normalize_routing_weights", "weights_prepacked",
             "accuracy_level")


def _qmoe(g: OnnxGraph, node, a: dict) -> str | None:
    _int_attr(node, a, "k", 1, 1, 1 << 20)
    for key in QMOE_INTS:
        if key in a:
            _int_attr(node, a, key, lo=-(1 << 63), hi=(1 << 63) - 1)
    # onnxruntime clamps with std::clamp(u, -limit, limit): a negative limit (-inf included)
    # aborts the process; +inf (the default) means no clamp
    _float_attr(node, a, "swiglu_limit", INF, 0.0, INF)
    for key, default in (("activation_alpha", 1.702), ("activation_beta", 1.0)):
        _float_attr(node, a, key, default, -MAX_FINITE, MAX_FINITE)
    prepacked = a.get("weights_prepacked", -1)
    w, s = g.inits.get(input_name(node, 2)), g.inits.get(input_name(node, 3))
    raw = w is not None and s is not None and len(w.shape) == 3 and len(s.shape) >= 2 \
        and w.shape[1] == s.shape[1]
    if prepacked == 1 or (prepacked == -1 and w is not None and s is not None and not raw):
        raise ModelFormatError(f"{where(node)}: expert weights are in an EP-specific prepacked "
                               "layout; export with qmoe_weights_prepacked=0")
    return check_qmoe(g, node, a)


# inputs mlxr's block has no place for: fc3 (unfused SwiGLU), separate router weights, fp4 /
# fp8 global and activation scales
UNSUPPORTED_INPUTS = {8: "fc3 weights", 9: "fc3 scales", 10: "fc3 bias", 13: "fc3 zero points",
                      14: "router_weights", 15: "fc1 global scale", 16: "fc2 global scale",
                      17: "fc3 global scale", 18: "fc1 activation scale",
                      19: "fc2 activation scale", 20: "fc3 activation scale"}


def check_qmoe(g: OnnxGraph, node: onnx.NodeProto, a: dict) -> str | None:
    """Why mlxr's MoE block cannot compute this (valid, raw-layout) QMoE, or None."""
    act = a.get("activation_type", b"relu")
    act = text(act)
    quant = a.get("quant_type", b"int")
    quant = text(quant)
    bits = a.get("expert_weight_bits", 4)
    if act != "swiglu" or a.get("swiglu_fusion", 0) != 1:
        return (f"activation {act} (swiglu_fusion={a.get('swiglu_fusion', 0)}): mlxr's block "
                "takes interleaved SwiGLU experts")
    if a.get("activation_beta", 0.0) != 1.0 or a.get("swiglu_limit_after_activation", 0):
        return "a SwiGLU other than gpt-oss's (beta 1, limit before the activation)"
    if quant != "int" or bits not in (2, 4, 8) or any(
            a.get(f"fc{j}_expert_weight_bits", bits) != bits for j in (1, 2, 3)):
        return f"{quant} experts of {bits} bits (mlxr takes int 2/4/8-bit)"
    if a.get("use_sparse_mixer", 0):
        return "the sparse mixer router (Phi-MoE)"
    bs = a.get("block_size", 0)
    if not bs or bs & (bs - 1) or bs < 32:
        return f"block_size={bs}: mlxr's groups are 32 to 128 (larger blocks split)"
    for i, what in UNSUPPORTED_INPUTS.items():
        if input_name(node, i):
            return f"input {what} is not in mlxr's MoE block"
    names = [input_name(node, i) for i in (2, 3, 5, 6)]
    if not all(n in g.inits for n in names):
        return "expert weights or scales are computed at run time"
    for i in (4, 7, 11, 12):
        if input_name(node, i) and input_name(node, i) not in g.inits:
            return "expert biases or zero points are computed at run time"
    return None


CHECKS = {"MatMulNBits": _matmul_nbits, "GroupQueryAttention": _gqa,
          "SkipSimplifiedLayerNormalization": _norm, "SimplifiedLayerNormalization": _norm,
          "RMSNormalization": _norm, "RotaryEmbedding": _rotary,
          "GatherBlockQuantized": _gather_bq, "QMoE": _qmoe}


def debug_enabled() -> bool:
    return os.environ.get("MLXR_ONNX_CLAIM_DEBUG", "") not in ("", "0")


def print_report(report: ClaimReport, total: int, name: str) -> None:
    """The claim report on stderr (MLXR_ONNX_CLAIM_DEBUG=1)."""
    print(f"[mlxr onnx] {name}: {report.summary(total)}", file=sys.stderr)
    for line in report.lines():
        print(f"[mlxr onnx]   {line}", file=sys.stderr)
