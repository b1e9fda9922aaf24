"""ONNX initializers as an mlxr checkpoint: the translator names each weight the way
`mlxr.models.loader` expects (HF module paths, MLX affine tensors) and the loader validates and
builds the decoder from it exactly as from safetensors. Repacks run lazily, once per node, when
the loader asks for a tensor; `repack_s` is their total time."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import onnx
import torch

from ..checkpoint import TensorInfo
from ..errors import ModelFormatError
from .graph import OnnxGraph
from .repack import AffineWeight, block_affine, group_size, signed_int4_to_unsigned

FLOAT_NAMES = {onnx.TensorProto.FLOAT: "F32", onnx.TensorProto.FLOAT16: "F16",
               onnx.TensorProto.BFLOAT16: "BF16"}


class Projection:
    """The weight [N, K] of one MatMulNBits / MatMul / GatherBlockQuantized / Gather node (rows
    = outputs), read and repacked on first use."""

    def __init__(self, g: OnnxGraph, node: onnx.NodeProto, timer: list[float]):
        self.g, self.node, self._timer = g, node, timer
        self._value: AffineWeight | torch.Tensor | None = None
        op = node.op_type
        if op == "MatMulNBits":
            a = {x.name: onnx.helper.get_attribute_value(x) for x in node.attribute}
            self.bits, self.block = a.get("bits", 4), a["block_size"]
            self.rows, self.cols = a["N"], a["K"]
        elif op == "MatMul":
            w = g.inits[node.input[1]]
            if len(w.shape) != 2 or w.elem not in FLOAT_NAMES:
                raise ModelFormatError(f"node {node.name!r}: MatMul weight must be a 2-D float "
                                       f"initializer, got {list(w.shape)}")
            self.bits, (self.cols, self.rows) = 0, w.shape
        elif op == "Gather":
            w = g.inits[node.input[0]]
            if len(w.shape) != 2 or w.elem not in FLOAT_NAMES:
                raise ModelFormatError(f"node {node.name!r}: embedding table must be a 2-D "
                                       f"float initializer, got {list(w.shape)}")
            self.bits, (self.rows, self.cols) = 0, w.shape
        else:  # GatherBlockQuantized: rows = vocabulary
            a = {x.name: onnx.helper.get_attribute_value(x) for x in node.attribute}
            self.bits, self.block = a.get("bits", 4), a.get("block_size", 128)
            data = self.gbq_data()
            self.rows = data[1][0]
            # typed int4/uint4 shapes count elements, uint8 shapes count packed bytes
            self.cols = data[1][1] * (1 if data[0].elem in _INT4 else 8 // self.bits)
            if self.cols % self.block:
                raise ModelFormatError(f"node {node.name!r}: row length {self.cols} is not a "
                                       f"multiple of block_size {self.block}")

    @property
    def quantized(self) -> bool:
        return self.bits > 0

    def gbq_data(self):
        """(initializer, shape as gathered) of a GatherBlockQuantized table, through the
        builder's Reshape of the LM head's MatMulNBits weight (shared embedding)."""
        name = self.node.input[0]
        init = self.g.inits.get(name)
        if init is not None:
            return init, init.shape
        src = self.g.producer.get(name)
        if src is not None and src.op_type == "Reshape" and src.input[0] in self.g.inits:
            init = self.g.inits[src.input[0]]
            if len(init.shape) == 3:
                return init, (init.shape[0], init.shape[1] * init.shape[2])
        raise ModelFormatError(f"node {self.node.name!r}: GatherBlockQuantized data is neither "
                               "an initializer nor a reshaped one")

    def value(self) -> AffineWeight | torch.Tensor:
        if self._value is None:
            t0 = time.perf_counter()
            self._value = self._read()
            self._timer[0] += time.perf_counter() - t0
        return self._value

    def _read(self) -> AffineWeight | torch.Tensor:
        g, node, op = self.g, self.node, self.node.op_type
        if op == "MatMul":
            return g.tensor(node.input[1]).t().contiguous()
        if op == "Gather":
            return g.tensor(node.input[0])
        where = f"node {node.name!r}"
        if op == "MatMulNBits":
            zp = node.input[3] if len(node.input) > 3 and node.input[3] else None
            return block_affine(g.tensor(node.input[1]).reshape(self.rows, -1),
                                g.tensor(node.input[2]), None if zp is None else g.tensor(zp),
                                self.bits, self.block, 2.0 ** (self.bits - 1), where)
        init, shape = self.gbq_data()
        data = g.tensor(init.name).reshape(shape[0], -1)
        default = 2.0 ** (self.bits - 1)
        if init.elem == onnx.TensorProto.INT4:
            data, default = signed_int4_to_unsigned(data), 8.0
        elif init.elem == onnx.TensorProto.UINT4:
            default = 0.0
        zp = node.input[3] if len(node.input) > 3 and node.input[3] else None
        if zp is not None and init.elem in _INT4:
            return _fail(where, "typed int4 zero points are not supported")
        s = g.tensor(node.input[2])
        if s.numel() != self.rows * (self.cols // self.block):
            raise ModelFormatError(f"{where}: scales {list(s.shape)} do not match the table "
                                   f"[{self.rows}, {self.cols}] in blocks of {self.block}")
        return block_affine(data, s, None if zp is None else g.tensor(zp), self.bits,
                            self.block, default, where)


_INT4 = {onnx.TensorProto.INT4, onnx.TensorProto.UINT4}


def _fail(where: str, why: str):
    raise ModelFormatError(f"{where}: {why}")


class OnnxCheckpoint:
    """The `Checkpoint` interface (`tensors`, `load`) over translated ONNX weights."""

    def __init__(self, path: Path):
        self.path = path
        self.tensors: dict[str, TensorInfo] = {}
        self._read: dict[str, Callable[[], torch.Tensor]] = {}
        self.repack_s = [0.0]
        self.scale_dtype = torch.float32
        self.scale_names: list[str] = []

    def add(self, name: str, dtype: str, shape: tuple[int, ...],
            read: Callable[[], torch.Tensor]) -> None:
        nbytes = 4 if dtype in ("F32", "U32") else 2
        for d in shape:
            nbytes *= d
        self.tensors[name] = TensorInfo(name, dtype, tuple(shape), self.path, 0, nbytes)
        self._read[name] = read

    def add_projection(self, path: str, proj: Projection, a: int, b: int) -> None:
        """Rows [a, b) of `proj` as module `path` (weight, or weight/scales/biases)."""
        if not proj.quantized:
            init = proj.g.inits[proj.node.input[1 if proj.node.op_type == "MatMul" else 0]]
            self.add(path + ".weight", FLOAT_NAMES[init.elem], (b - a, proj.cols),
                     lambda: proj.value()[a:b])
            return
        groups = proj.cols // group_size(proj.block)
        self.add(path + ".weight", "U32", (b - a, proj.cols * proj.bits // 32),
                 lambda: proj.value().words[a:b])
        for part in ("scales", "biases"):
            self.add(f"{path}.{part}", "F32", (b - a, groups),
                     lambda part=part: getattr(proj.value(), part)[a:b].to(self.scale_dtype))
            self.scale_names.append(f"{path}.{part}")

    def set_scale_dtype(self, dtype: torch.dtype) -> None:
        """Hand the repacked scales and biases over in `dtype`. A 16-bit compute dtype gets them
        in that dtype, as MLX files ship them: mlxr's decode GEMVs read (scale, bias) pairs of
        16 bits (`decode_gemv_q4.pair_scales`); float32 pairs fall back to a path ~15% slower
        at decode (H200, 0.6B). float32 compute keeps them exact."""
        self.scale_dtype = dtype
        name = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}[dtype]
        for n in self.scale_names:
            if n not in self.tensors:  # dropped by a `restore`
                continue
            info = self.tensors[n]
            self.tensors[n] = TensorInfo(n, name, info.shape, info.file, 0,
                                         info.nbytes * dtype.itemsize // 4)

    def snapshot(self) -> tuple[dict, dict]:
        return dict(self.tensors), dict(self._read)

    def restore(self, snap: tuple[dict, dict]) -> None:
        self.tensors, self._read = dict(snap[0]), dict(snap[1])

    def load(self, name: str) -> torch.Tensor:
        return self._read[name]()
