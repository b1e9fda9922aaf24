"""Validated safetensors reader for MLX / mlx-community checkpoints (single file or sharded).

Files are untrusted: every header is fully checked (framing, JSON, dtypes, shapes, byte ranges)
before any tensor data is touched, and every failure is a `ModelFormatError` naming the file and
the tensor or key at fault. MLX does not align tensor data (offsets may even be odd for BF16), so
`load` reads each tensor's bytes once, with pread, into a fresh torch-allocated (aligned) buffer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from mlxr import bounded_json
from mlxr.errors import ModelFormatError

INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 2**20  # real headers are < 10 MiB even for 100k-tensor shards
MAX_INDEX_BYTES = 100 * 2**20
MAX_TENSORS = 1_000_000  # per file
MAX_NAME_BYTES = 255  # a file name's limit on Linux (NAME_MAX) and macOS
MAX_RANK = 8
MAX_DIM = 2**40  # per dimension, inclusive
MAX_TENSOR_BYTES = 2**42  # 4 TiB; also bounded by the data section itself

# safetensors dtype -> (torch dtype, itemsize). U32 is returned as int32 (same bits): torch
# cannot shift uint32 ("rshift_cpu" not implemented), and the packed-weight kernels mask anyway.
# All targets are little-endian, like the file format, so bytes are reinterpreted as-is.
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "BOOL": (torch.bool, 1),
    "U8": (torch.uint8, 1),
    "I8": (torch.int8, 1),
    "I16": (torch.int16, 2),
    "I32": (torch.int32, 4),
    "U32": (torch.int32, 4),
    "I64": (torch.int64, 8),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "F32": (torch.float32, 4),
    "F64": (torch.float64, 8),
}


@dataclass(frozen=True)
class TensorInfo:
    """Where one validated tensor lives: `offset` is absolute in `file`, `nbytes` exact."""

    name: str
    dtype: str  # safetensors dtype string, a key of DTYPES
    shape: tuple[int, ...]
    file: Path
    offset: int
    nbytes: int


def _parse_json(raw: bytes, path: Path) -> Any:
    """Decode strict UTF-8 JSON (bounded: depth, numbers), rejecting duplicate keys."""
    return bounded_json.loads(raw, str(path), reject_duplicates=True)


def _is_int(x: Any) -> bool:
    return type(x) is int  # excludes bool (an int subclass) and floats like 4.0


def _tensor_info(name: str, entry: Any, path: Path, data_start: int, data_len: int) -> TensorInfo:
    """Validate one header entry; byte ranges are checked against the data section only."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise ModelFormatError(f"{where}: header entry is not an object")
    for key in ("dtype", "shape", "data_offsets"):
        if key not in entry:
            raise ModelFormatError(f"{where}: missing {key!r}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ModelFormatError(f"{where}: unsupported dtype {dtype!r} (known: {sorted(DTYPES)})")
    if not isinstance(shape, list) or len(shape) > MAX_RANK:
        raise ModelFormatError(f"{where}: shape must be a list of at most {MAX_RANK} ints")
    numel = 1
    for d in shape:
        if not _is_int(d) or not 0 <= d <= MAX_DIM:
            raise ModelFormatError(f"{where}: bad dimension {d!r} in shape {shape}")
        numel *= d  # Python int: cannot overflow (at most (2^40)^8)
    nbytes = numel * DTYPES[dtype][1]
    if nbytes > MAX_TENSOR_BYTES:
        raise ModelFormatError(f"{where}: shape {shape} is too large ({nbytes} bytes)")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_int, offsets))):
        raise ModelFormatError(f"{where}: data_offsets must be [begin, end] ints, got {offsets!r}")
    begin, end = offsets
    if not 0 <= begin <= end <= data_len:
        raise ModelFormatError(
            f"{where}: data_offsets {offsets} outside the data section of {data_len} bytes"
            " (file truncated?)"
        )
    if end - begin != nbytes:
        raise ModelFormatError(
            f"{where}: data_offsets span {end - begin} bytes but {dtype}{shape} needs {nbytes}"
        )
    return TensorInfo(name, dtype, tuple(shape), path, data_start + begin, nbytes)


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Read and fully validate one safetensors file's header.

    Returns (tensors by name in header order, `__metadata__` or {} when absent/null).
    No tensor data is read. Raises ModelFormatError on any inconsistency.
    """
    path = Path(path)
    if not path.is_file():  # also keeps open() from blocking on a FIFO
        raise ModelFormatError(f"{path}: not a regular file")
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise ModelFormatError(f"{path}: {size} bytes, too short for a safetensors file")
            n = int.from_bytes(f.read(8), "little")  # u64 LE header length
            if n > size - 8 or n > MAX_HEADER_BYTES:
                raise ModelFormatError(
                    f"{path}: header length {n} exceeds the file ({size} bytes)"
                    f" or the {MAX_HEADER_BYTES}-byte limit"
                )
            raw = f.read(n)
    except OSError as e:
        raise ModelFormatError(f"{path}: cannot read ({e})") from None
    if len(raw) != n:
        raise ModelFormatError(f"{path}: file changed while reading the header")
    header = _parse_json(raw, path)
    if not isinstance(header, dict):
        raise ModelFormatError(f"{path}: header is not a JSON object")

    metadata = header.pop("__metadata__", None)  # MLX writes null when saved without metadata
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise ModelFormatError(f"{path}: key '__metadata__' must be an object or null")
    for key, value in metadata.items():
        if not isinstance(value, str):
            raise ModelFormatError(f"{path}: __metadata__ key {key!r} has non-string value")
    if len(header) > MAX_TENSORS:
        raise ModelFormatError(f"{path}: {len(header)} tensors exceed the {MAX_TENSORS} limit")

    # The data section is bytes [8 + n, size) of the file.
    tensors = {name: _tensor_info(name, e, path, 8 + n, size - 8 - n) for name, e in header.items()}
    # Byte ranges must not share a byte (empty tensors own none). Gaps are harmless and allowed.
    ranges = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors.values() if t.nbytes)
    for (_, prev_end, prev), (begin, _, name) in zip(ranges, ranges[1:]):
        if begin < prev_end:
            raise ModelFormatError(f"{path}: tensor {name!r} overlaps tensor {prev!r}")
    return tensors, metadata


class Checkpoint:
    """All tensors of a model directory, validated; data is read on demand by `load`."""

    def __init__(
        self, files: list[Path], tensors: dict[str, TensorInfo], metadata: dict[str, str]
    ) -> None:
        self.files = files
        self.tensors = tensors
        self.metadata = metadata
        self._fds: dict[Path, int] = {}
        self._closed = False

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def load(self, name: str) -> torch.Tensor:
        """Read tensor `name` into a new, aligned CPU tensor of its dtype and shape.

        U32 tensors come back as torch.int32 holding the same bits (torch has no uint32 shifts).
        """
        if self._closed:
            raise ValueError("Checkpoint is closed")
        info = self.tensors.get(name)
        if info is None:
            where = self.files[0].parent if self.files else "checkpoint"
            raise ModelFormatError(f"{where}: no tensor {name!r} in the checkpoint")
        torch_dtype = DTYPES[info.dtype][0]
        buf = torch.empty(info.nbytes, dtype=torch.uint8)  # torch's allocator aligns to 64 bytes
        view = memoryview(buf.numpy())
        done = 0
        try:
            fd = self._fds.get(info.file)
            if fd is None:
                fd = self._fds[info.file] = os.open(info.file, os.O_RDONLY)
            while done < info.nbytes:  # pread may return short reads (e.g. 2 GiB per call)
                got = os.preadv(fd, [view[done:]], info.offset + done)
                if got == 0:
                    break
                done += got
        except OSError as e:
            raise ModelFormatError(f"{info.file}: tensor {name!r}: read failed ({e})") from None
        if done != info.nbytes:
            raise ModelFormatError(f"{info.file}: tensor {name!r}: file truncated after opening")
        if info.dtype == "BOOL" and bool((buf > 1).any()):
            raise ModelFormatError(f"{info.file}: tensor {name!r}: BOOL bytes other than 0/1")
        return buf.view(torch_dtype).reshape(info.shape)

    def close(self) -> None:
        """Close the file descriptors opened by `load`; later loads raise."""
        self._closed = True
        while self._fds:
            os.close(self._fds.popitem()[1])

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _read_index(index: Path) -> dict[str, str]:
    """weight_map of an index.json: tensor name -> shard file name (a bare name in the dir)."""
    if not index.is_file():
        raise ModelFormatError(f"{index}: not a regular file")
    try:
        size = index.stat().st_size
        if size > MAX_INDEX_BYTES:
            raise ModelFormatError(f"{index}: {size} bytes exceeds the {MAX_INDEX_BYTES} limit")
        doc = _parse_json(index.read_bytes(), index)
    except OSError as e:
        raise ModelFormatError(f"{index}: cannot read ({e})") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise ModelFormatError(f"{index}: key 'weight_map' missing or not an object")
    for name, file in weight_map.items():
        # Only plain names: no "../x", absolute paths or subfolders. Checked lexically, not with
        # resolve(), because Hugging Face cache snapshots are symlinks into a blobs/ folder.
        if not isinstance(file, str) or file in ("", ".", "..") or "/" in file or "\\" in file \
                or "\0" in file or len(file.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
            raise ModelFormatError(
                f"{index}: weight_map[{name!r}] = {file!r:.80} is not a file name inside the "
                "model dir"
            )
    return weight_map


def open_checkpoint(model_dir: Path) -> Checkpoint:
    """Validate every `model*.safetensors` in `model_dir` (plus shards named by the index).

    The index (`model.safetensors.index.json`) is optional, as in mlx-lm; when present, every
    shard it names must exist and hold the tensors it lists. A tensor in two shards is an error.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelFormatError(f"{model_dir}: not a directory")
    index = model_dir / INDEX_NAME
    weight_map = _read_index(index) if index.exists() else {}
    for file, name in {file: name for name, file in weight_map.items()}.items():
        if not (model_dir / file).is_file():
            raise ModelFormatError(f"{index}: shard {file!r} of tensor {name!r} does not exist")
    names = {p.name for p in model_dir.glob("model*.safetensors")} | set(weight_map.values())
    if not names:
        others = [p.name for p in model_dir.iterdir() if p.suffix in (".bin", ".gguf", ".pth")]
        hint = (
            f" (found {', '.join(sorted(others))}: PyTorch .bin / GGUF checkpoints are not"
            " supported; mlxr reads safetensors (mlx-community/HF format))"
            if others
            else ""
        )
        raise ModelFormatError(f"{model_dir}: no model*.safetensors files{hint}")

    files = [model_dir / name for name in sorted(names)]
    tensors: dict[str, TensorInfo] = {}
    metadata: dict[str, str] = {}
    for file in files:
        shard_tensors, shard_metadata = read_header(file)
        for name, info in shard_tensors.items():
            if name in tensors:
                raise ModelFormatError(
                    f"{file}: tensor {name!r} is also in {tensors[name].file.name}"
                )
            tensors[name] = info
        for key, value in shard_metadata.items():
            metadata.setdefault(key, value)  # shards agree in practice; the first one wins
    for name, file in weight_map.items():
        if name not in tensors or tensors[name].file.name != file:
            raise ModelFormatError(f"{index}: tensor {name!r} is not in its shard {file!r}")
    return Checkpoint(files, tensors, metadata)
