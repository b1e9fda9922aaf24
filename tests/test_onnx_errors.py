"""Hostile or EP-specific ONNX files get a clear ModelFormatError naming the file and the
initializer or node at fault -- before any weight is read or any session is created."""

from __future__ import annotations

import json

import onnx
import pytest

import mlxr
from mlxr.errors import ModelFormatError
from onnx_ref import copy_folder

MS = "com.microsoft"


@pytest.fixture
def folder(onnx_exports, tmp_path):
    return copy_folder(onnx_exports / "llama_int4_cpu", tmp_path / "m")


def edit(folder, change) -> None:
    m = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    change(m.graph, m)
    onnx.save(m, str(folder / "model.onnx"))


def init(g, name: str):
    return next(t for t in g.initializer if t.name == name)


def node(g, op: str, part: str = ""):
    return next(n for n in g.node if n.op_type == op and part in n.name)


def set_attr(n, name: str, value) -> None:
    for a in list(n.attribute):
        if a.name == name:
            n.attribute.remove(a)
    n.attribute.append(onnx.helper.make_attribute(name, value))


def set_external(t, key: str, value: str) -> None:
    for e in t.external_data:
        if e.key == key:
            e.value = value


def expect(folder, match: str) -> None:
    with pytest.raises(ModelFormatError, match=match):
        mlxr.load(folder, device="cpu", dtype="float32")


def test_truncated_external_data(folder):
    data = folder / "model.onnx.data"
    data.write_bytes(data.read_bytes()[:200_000])
    expect(folder, r"model.onnx.data: initializer '.*' bytes \[\d+, \d+\) lie outside the "
                   r"file \(200000 bytes; truncated\?\)")


@pytest.mark.parametrize("key,value,match", [
    ("offset", str(10**15), "lie outside the file"),
    ("offset", "-64", "lie outside the file"),
    ("offset", "0x10", "not integers"),
    ("length", "7", "external length 7"),
    ("location", "../model.onnx.data", "not a relative path inside the model folder"),
    ("location", "/etc/hostname", "not a relative path inside the model folder"),
    ("location", "missing.data", "missing or not a regular file"),
])
def test_external_data_references(folder, key, value, match):
    edit(folder, lambda g, m: set_external(init(g, "lm_head.MatMul.weight_Q4"), key, value))
    expect(folder, "initializer 'lm_head.MatMul.weight_Q4'.*" + match if key != "offset"
           or value == "0x10" else match)


@pytest.mark.parametrize("dims,match", [([1 << 45], "bad shape"),
                                        ([1 << 30, 1 << 30, 1 << 30], "too large"),
                                        ([-4, 128], "bad shape")])
def test_absurd_dims(folder, dims, match):
    def change(g, m):
        t = init(g, "model.layers.0.input_layernorm.weight")
        del t.dims[:]
        t.dims.extend(dims)

    edit(folder, change)
    expect(folder, "initializer 'model.layers.0.input_layernorm.weight'.*" + match)


@pytest.mark.parametrize("op,part,attr,value,match", [
    ("MatMulNBits", "o_proj", "frobnicate", 1, r"attributes \['frobnicate'\] are not in the "
                                               "MatMulNBits schema"),
    ("MatMulNBits", "o_proj", "weight_prepacked", 1, "CUDA-only layout"),
    ("MatMulNBits", "o_proj", "bits", 3, "bits=3, block_size=32"),
    ("MatMulNBits", "o_proj", "block_size", 48, "block_size=48"),
    ("MatMulNBits", "o_proj", "K", 64, r"B is UINT8\[128, 4, 16\], K=64"),
    ("MatMulNBits", "o_proj", "accuracy_level", 9, "accuracy_level=9 is out of range"),
    ("GroupQueryAttention", "layers.1", "num_heads", 1 << 20, "num_heads=1048576 is out"),
    ("GroupQueryAttention", "layers.1", "kv_num_heads", 3, "not a multiple of kv_num_heads"),
    ("GroupQueryAttention", "layers.1", "k_quant_type", "FP2", "k_quant_type='FP2' is unknown"),
    ("GroupQueryAttention", "layers.1", "softcap", float("nan"), "softcap=nan is invalid"),
    ("SkipSimplifiedLayerNormalization", "layers.1", "epsilon", -1.0, "epsilon=-1.0 is invalid"),
])
def test_invalid_attributes_name_the_node(folder, op, part, attr, value, match):
    def change(g, m):
        n = node(g, op, part)
        set_attr(n, attr, value)

    edit(folder, change)
    expect(folder, rf"node '/model/[^']*{part}[^']*' \({op}\): .*{match}")


def test_unknown_contrib_opset_version(folder):
    def change(g, m):
        next(o for o in m.opset_import if o.domain == MS).version = 2

    edit(folder, change)
    expect(folder, "opset com.microsoft version 2 is unknown")


def test_prepacked_moe_layout_is_refused(folder):
    """A QMoE whose expert weights do not match their scales' layout (the CUDA export's
    CUTLASS prepacking, which the CPU provider runs silently wrong) is refused."""
    def change(g, m):
        for name, shape in (("fc1_w", [4, 128, 128]), ("fc1_s", [4, 256, 4]),
                            ("fc2_w", [4, 128, 64]), ("fc2_s", [4, 128, 4])):
            g.initializer.append(onnx.helper.make_tensor(
                name, onnx.TensorProto.UINT8 if name.endswith("w") else onnx.TensorProto.FLOAT,
                shape, bytes(int.__mul__(*shape[:2]) * shape[2] * (1 if name.endswith("w")
                                                                  else 4)), raw=True))
        x = node(g, "SkipSimplifiedLayerNormalization", "layers.1").output[0]
        g.node.append(onnx.helper.make_node(
            "QMoE", [x, x, "fc1_w", "fc1_s", "", "fc2_w", "fc2_s"], ["moe_out"], domain=MS,
            name="moe/QMoE", k=2, expert_weight_bits=4, block_size=32))

    edit(folder, change)
    expect(folder, r"node 'moe/QMoE' \(QMoE\): expert weights are in an EP-specific prepacked")


def test_not_a_protobuf(folder):
    (folder / "model.onnx").write_bytes(b"\x08\x07garbage" * 50)
    expect(folder, "model.onnx: not a valid ONNX protobuf")


def test_genai_config_cannot_point_outside_the_folder(folder):
    cfg = json.loads((folder / "genai_config.json").read_text())
    cfg["model"]["decoder"]["filename"] = "../model.onnx"
    (folder / "genai_config.json").write_text(json.dumps(cfg))
    expect(folder, "model.decoder.filename '../model.onnx' must be a .onnx file name")
