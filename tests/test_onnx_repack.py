"""MatMulNBits and GatherBlockQuantized weights repacked into MLX affine layout, checked
against onnxruntime's own kernels on single-node graphs (fresh random codes, scales, zero
points and biases): 2/4/8 bits, block sizes 16-128, symmetric, packed uint8 and float zero
points, a bias; uint8 and signed INT4 embedding tables.

ORT runs with accuracy_level=0 (float32 activations). Both sides dequantize the same codes;
mlxr's affine form q*scale + (-scale*zp) rounds twice where (q - zp)*scale rounds once, and
the dot products sum in different orders: |err| <= ~K * 2u * sum|a*w| -- the tolerance is
1e-5 relative to the largest |output| (K <= 256, u = 6e-8: 3e-5 worst case, 1e-6 typical)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from mlxr.config import QuantSpec
from mlxr.onnx.claim import check_node
from mlxr.onnx.graph import OnnxGraph
from mlxr.onnx.repack import group_size
from mlxr.onnx.weights import Projection
from mlxr.quant import QuantWeight
from onnx_ref import session

MS = "com.microsoft"


def _save(tmp_path, nodes, inits, inputs, output, elem=TensorProto.FLOAT) -> OnnxGraph:
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info(
        output, elem, None)], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid(MS, 1)])
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    return OnnxGraph(path)


def _affine_linear(proj: Projection, x: torch.Tensor) -> torch.Tensor:
    w = proj.value()
    qw = QuantWeight.from_tensors(w.words, w.scales, w.biases,
                                  QuantSpec("affine", proj.bits, group_size(proj.block)),
                                  compute_dtype=torch.float32, device="cpu")
    return qw.linear(x)


@pytest.mark.parametrize("bits,block,zp,bias", [
    (4, 32, None, False), (4, 32, "uint8", True), (4, 128, "uint8", False),
    (4, 64, "float", False), (4, 256, "uint8", False), (2, 32, None, False),
    (2, 64, "uint8", True), (2, 32, "float", False), (8, 32, None, True),
    (8, 128, "uint8", False), (8, 256, None, False),
])
def test_matmul_nbits_matches_onnxruntime(tmp_path, bits, block, zp, bias):
    g = np.random.default_rng(bits * 1000 + block)
    n, k, m = 48, 256, 5
    kb = k // block
    b = g.integers(0, 256, (n, kb, block * bits // 8), dtype=np.uint8)
    scales = (g.random((n, kb), dtype=np.float32) * 0.1 + 0.01).astype(np.float32)
    inits = [helper.make_tensor("B", TensorProto.UINT8, b.shape, b.tobytes(), raw=True),
             helper.make_tensor("S", TensorProto.FLOAT, scales.shape, scales.tobytes(),
                                raw=True)]
    ins = ["A", "B", "S", "", "", ""]
    if zp == "uint8":
        z = g.integers(0, 256, (n, -(-kb * bits // 8)), dtype=np.uint8)
        inits.append(helper.make_tensor("Z", TensorProto.UINT8, z.shape, z.tobytes(), raw=True))
        ins[3] = "Z"
    elif zp == "float":
        z = g.random((n, kb), dtype=np.float32) * (2 ** bits - 1)
        inits.append(helper.make_tensor("Z", TensorProto.FLOAT, z.shape, z.tobytes(), raw=True))
        ins[3] = "Z"
    if bias:
        bv = g.standard_normal(n, dtype=np.float32)
        inits.append(helper.make_tensor("bias", TensorProto.FLOAT, [n], bv.tobytes(), raw=True))
        ins[5] = "bias"
    node = helper.make_node("MatMulNBits", ins, ["Y"], domain=MS, name="mm", K=k, N=n,
                            bits=bits, block_size=block, accuracy_level=0)
    graph = _save(tmp_path, [node], inits,
                  [helper.make_tensor_value_info("A", TensorProto.FLOAT, [m, k])], "Y")
    a = g.standard_normal((m, k), dtype=np.float32)
    want = session(graph.path).run(["Y"], {"A": a})[0]
    proj = Projection(graph, graph.nodes[0], [0.0])
    got = _affine_linear(proj, torch.from_numpy(a)).numpy()
    if bias:
        got = got + bv
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("elem,bits,zp", [(TensorProto.UINT8, 4, False),
                                          (TensorProto.UINT8, 4, True),
                                          (TensorProto.UINT8, 8, False),
                                          (TensorProto.INT4, 4, False)])
def test_gather_block_quantized_matches_onnxruntime(tmp_path, elem, bits, zp):
    g = np.random.default_rng(7 + bits)
    v, h, block = 40, 128, 32
    per = h if elem == TensorProto.INT4 else h * bits // 8
    data = g.integers(0, 256, (v, h // 2 if elem == TensorProto.INT4 else per), dtype=np.uint8)
    scales = (g.random((v, h // block), dtype=np.float32) * 0.1 + 0.01).astype(np.float32)
    inits = [helper.make_tensor("D", elem, [v, per], data.tobytes(), raw=True),
             helper.make_tensor("S", TensorProto.FLOAT, scales.shape, scales.tobytes(),
                                raw=True)]
    ins = ["D", "ids", "S"]
    if zp:
        z = g.integers(0, 256, (v, h // block * bits // 8), dtype=np.uint8)
        inits.append(helper.make_tensor("Z", TensorProto.UINT8, z.shape, z.tobytes(), raw=True))
        ins.append("Z")
    node = helper.make_node("GatherBlockQuantized", ins, ["E"], domain=MS, name="gbq",
                            bits=bits, block_size=block, gather_axis=0, quantize_axis=1)
    graph = _save(tmp_path, [node], inits,
                  [helper.make_tensor_value_info("ids", TensorProto.INT64, [6])], "E")
    ids = np.array([0, 3, 39, 7, 7, 21], np.int64)
    want = session(graph.path).run(["E"], {"ids": ids})[0]
    proj = Projection(graph, graph.nodes[0], [0.0])
    w = proj.value()
    qw = QuantWeight.from_tensors(w.words, w.scales, w.biases, QuantSpec("affine", bits, block),
                                  compute_dtype=torch.float32, device="cpu", matmul=False)
    got = qw.embed(torch.from_numpy(ids)).numpy()
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()


def test_block_16_is_declined(tmp_path):
    """mlxr's affine groups start at 32: a block-16 MatMulNBits runs on onnxruntime."""
    b = np.zeros((8, 4, 8), np.uint8)
    inits = [helper.make_tensor("B", TensorProto.UINT8, b.shape, b.tobytes(), raw=True),
             helper.make_tensor("S", TensorProto.FLOAT, [8, 4], bytes(128), raw=True)]
    node = helper.make_node("MatMulNBits", ["A", "B", "S"], ["Y"], domain=MS, name="mm", K=64,
                            N=8, bits=4, block_size=16)
    graph = _save(tmp_path, [node], inits,
                  [helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, 64])], "Y")
    assert "block_size=16" in check_node(graph, graph.nodes[0])
