"""A validated, read-only view of an ONNX decoder graph and its (external) initializer data.

The .onnx file and its external data are untrusted like safetensors: the protobuf is parsed
without touching external data, every initializer's dtype, rank, dims and byte range is checked
before anything is read, and external data may only live in regular files inside the model's
folder. Errors are ModelFormatErrors naming the file and the tensor or node at fault.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import onnx
import torch
from google.protobuf.message import DecodeError
from onnx import TensorProto

from ..errors import ModelFormatError

MAX_PROTO_BYTES = 2 << 30  # protobuf's own limit; weights beyond it must be external
MAX_RANK = 8
MAX_DIM = 1 << 40
MAX_TENSOR_BYTES = 1 << 42
MAX_NODES = 1 << 20

# ONNX element type -> (torch dtype the bytes are read as, bits per element). 4-bit types stay
# packed bytes (two elements per byte, LSB first); the translator unpacks what it uses.
ELEM_TYPES: dict[int, tuple[torch.dtype, int]] = {
    TensorProto.FLOAT: (torch.float32, 32),
    TensorProto.FLOAT16: (torch.float16, 16),
    TensorProto.BFLOAT16: (torch.bfloat16, 16),
    TensorProto.DOUBLE: (torch.float64, 64),
    TensorProto.UINT8: (torch.uint8, 8),
    TensorProto.INT8: (torch.int8, 8),
    TensorProto.INT16: (torch.int16, 16),
    TensorProto.INT32: (torch.int32, 32),
    TensorProto.INT64: (torch.int64, 64),
    TensorProto.BOOL: (torch.bool, 8),
    TensorProto.UINT4: (torch.uint8, 4),
    TensorProto.INT4: (torch.uint8, 4),
}
FLOAT_TYPES = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16}


def type_name(elem: int) -> str:
    return TensorProto.DataType.Name(elem) if elem in TensorProto.DataType.values() else str(elem)


@dataclass(frozen=True)
class Initializer:
    """One constant tensor: shape and dtype validated; bytes in the proto or in `file`."""

    name: str
    elem: int  # ONNX element type
    shape: tuple[int, ...]
    nbytes: int
    file: Path | None = None  # external data file (None: the data is inside the proto)
    offset: int = 0

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class ValueInfo:
    """A graph input or output: element type and dims (int, or a symbolic name)."""

    name: str
    elem: int
    dims: tuple[int | str, ...]


def _nbytes(elem: int, shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return (n * ELEM_TYPES[elem][1] + 7) // 8


class OnnxGraph:
    """Nodes, graph I/O and initializers of one .onnx file, with producer/consumer maps."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.folder = self.path.parent
        self.model = _parse(self.path)
        g = self.model.graph
        if len(g.node) > MAX_NODES:
            raise ModelFormatError(f"{self.path.name}: {len(g.node)} nodes exceed {MAX_NODES}")
        self.opsets = {o.domain or "ai.onnx": o.version for o in self.model.opset_import}
        self.nodes = list(g.node)
        self.inputs = {v.name: _value_info(v, self.path) for v in g.input}
        self.outputs = {v.name: _value_info(v, self.path) for v in g.output}
        self.inits: dict[str, Initializer] = {}
        self._proto: dict[str, TensorProto] = {}
        for t in g.initializer:
            self.inits[t.name] = self._initializer(t)
            self._proto[t.name] = t
        for name in self.inits:
            self.inputs.pop(name, None)  # old exports list initializers as inputs too
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for n in self.nodes:
            for o in n.output:
                if o:
                    if o in self.producer or o in self.inits or o in self.inputs:
                        raise ModelFormatError(
                            f"{self.path.name}: value '{o}' is produced twice (node {n.name!r})")
                    self.producer[o] = n
            for i in n.input:
                if i:
                    self.consumers.setdefault(i, []).append(n)

    def _initializer(self, t: TensorProto) -> Initializer:
        where = f"{self.path.name}: initializer '{t.name}'"
        if t.data_type not in ELEM_TYPES:
            raise ModelFormatError(f"{where}: unsupported data type {type_name(t.data_type)}")
        if len(t.dims) > MAX_RANK or any(not 0 <= d <= MAX_DIM for d in t.dims):
            raise ModelFormatError(f"{where}: bad shape {list(t.dims)}")
        shape = tuple(int(d) for d in t.dims)
        nbytes = _nbytes(t.data_type, shape)
        if nbytes > MAX_TENSOR_BYTES:
            raise ModelFormatError(f"{where}: shape {list(shape)} is too large ({nbytes} bytes)")
        if t.data_location != TensorProto.EXTERNAL:
            if t.HasField("raw_data") and len(t.raw_data) != nbytes:
                raise ModelFormatError(f"{where}: raw_data has {len(t.raw_data)} bytes, "
                                       f"{type_name(t.data_type)}{list(shape)} needs {nbytes}")
            return Initializer(t.name, t.data_type, shape, nbytes)
        ext = {e.key: e.value for e in t.external_data}
        unknown = set(ext) - {"location", "offset", "length", "checksum", "basepath"}
        if unknown:
            raise ModelFormatError(f"{where}: unknown external_data keys {sorted(unknown)}")
        file = self._external_file(ext.get("location", ""), where)
        try:
            offset = int(ext.get("offset", "0"))
            length = int(ext["length"]) if "length" in ext else nbytes
        except ValueError:
            raise ModelFormatError(f"{where}: external offset/length are not integers") from None
        if length != nbytes:
            raise ModelFormatError(f"{where}: external length {length}, but "
                                   f"{type_name(t.data_type)}{list(shape)} needs {nbytes} bytes")
        size = file.stat().st_size
        if offset < 0 or offset + nbytes > size:
            raise ModelFormatError(f"{file.name}: initializer '{t.name}' bytes "
                                   f"[{offset}, {offset + nbytes}) lie outside the file "
                                   f"({size} bytes; truncated?)")
        return Initializer(t.name, t.data_type, shape, nbytes, file, offset)

    def _external_file(self, location: str, where: str) -> Path:
        """The external data file, which must be a regular file inside the model's folder."""
        rel = Path(location)
        if not location or "\0" in location or rel.is_absolute() or ".." in rel.parts:
            raise ModelFormatError(f"{where}: external data location {location!r} is not a "
                                   "relative path inside the model folder")
        try:
            file = (self.folder / rel).resolve()
            inside = file.is_relative_to(self.folder.resolve()) and file.is_file()
        except OSError:  # a name too long for the file system, a symlink loop
            inside = False
        if not inside:
            raise ModelFormatError(f"{where}: external data file {location!r} is missing or "
                                   "not a regular file inside the model folder")
        return file

    def tensor(self, name: str) -> torch.Tensor:
        """An initializer's data as a CPU tensor of its shape (4-bit types: the packed bytes,
        shape [..., ceil(last/2)])."""
        info = self.inits.get(name)
        if info is None:
            raise ModelFormatError(f"{self.path.name}: '{name}' is not an initializer (it is "
                                   "computed at run time), where a constant is needed")
        dtype, bits = ELEM_TYPES[info.elem]
        if info.file is None:
            raw = self._proto_bytes(self._proto[name], info)
        else:
            raw = bytearray(info.nbytes)
            with open(info.file, "rb") as f:
                got = f.seek(info.offset) == info.offset and f.readinto(raw)
            if got != info.nbytes:
                raise ModelFormatError(f"{info.file.name}: initializer '{name}' is truncated")
        raw = raw if isinstance(raw, bytearray) else bytearray(raw)  # writable, owned
        buf = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        if bits == 4:  # ONNX packs 4-bit elements over the flat tensor: rows must fill bytes
            last = info.shape[-1] if info.shape else 1
            if last % 2:
                raise ModelFormatError(f"initializer '{name}': 4-bit rows of odd length "
                                       f"{last} are not supported")
            return buf.reshape(*info.shape[:-1], last // 2)
        if dtype == torch.bool and bool((buf > 1).any()):
            raise ModelFormatError(f"initializer '{name}': BOOL bytes other than 0/1")
        return buf.view(dtype).reshape(info.shape)

    def tensor_proto(self, name: str) -> TensorProto:
        """An initializer as a self-contained TensorProto (external bytes read in), for the
        subgraphs mlxr hands to onnxruntime."""
        t = self._proto[name]
        if self.inits[name].file is None:
            return t
        info = self.inits[name]
        out = TensorProto(name=name, data_type=info.elem, dims=list(info.shape))
        out.raw_data = self.tensor(name).numpy().tobytes()
        return out

    @staticmethod
    def _proto_bytes(t: TensorProto, info: Initializer) -> bytes:
        if t.HasField("raw_data"):
            return t.raw_data
        from onnx import numpy_helper

        try:
            arr = numpy_helper.to_array(t)
        except (ValueError, TypeError) as e:
            raise ModelFormatError(f"initializer '{t.name}': unreadable data ({e})") from None
        raw = arr.tobytes()
        if len(raw) != info.nbytes:
            raise ModelFormatError(f"initializer '{t.name}': {len(raw)} data bytes, "
                                   f"shape {list(info.shape)} needs {info.nbytes}")
        return raw


def _parse(path: Path) -> onnx.ModelProto:
    if not path.is_file():
        raise ModelFormatError(f"{path}: not a regular file")
    size = path.stat().st_size
    if size > MAX_PROTO_BYTES:
        raise ModelFormatError(f"{path.name}: {size} bytes exceeds the protobuf limit")
    try:
        return onnx.load_model(str(path), load_external_data=False)
    except (DecodeError, ValueError, RuntimeError) as e:
        raise ModelFormatError(f"{path.name}: not a valid ONNX protobuf ({e})") from None


def _value_info(v: onnx.ValueInfoProto, path: Path) -> ValueInfo:
    t = v.type.tensor_type
    dims = []
    for d in t.shape.dim:
        if d.HasField("dim_value"):
            if not 0 <= d.dim_value <= MAX_DIM:
                raise ModelFormatError(f"{path.name}: graph value '{v.name}' has dimension "
                                       f"{d.dim_value}")
            dims.append(int(d.dim_value))
        else:
            dims.append(d.dim_param or "?")
    return ValueInfo(v.name, t.elem_type, tuple(dims))
