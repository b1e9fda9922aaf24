"""A rank's view of a checkpoint: every tensor at the shape of its shard, read as that shard
only (safetensors' `get_slice`: the rest of the tensor is never read or materialized), so a
model larger than one device's memory loads across several.

The view has `Checkpoint`'s interface (`tensors`, `load`, `files`, `metadata`, `close`), so
the ordinary loader (`models.loader.build_decoder`) builds the local decoder from it against
the plan's local config; every shape check it makes then checks the shard.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from ..checkpoint import DTYPES, Checkpoint, TensorInfo
from ..errors import ModelFormatError
from .plan import ShardPlan, Split

MATRIX_SUFFIXES = ("weight", "scales", "biases")  # [..., out, in(/packing|/group)]


class ShardedCheckpoint:
    """`ckpt` as rank `plan.rank` of `plan.world` holds it."""

    def __init__(self, ckpt: Checkpoint, plan: ShardPlan):
        self.ckpt, self.plan = ckpt, plan
        self.files, self.metadata = ckpt.files, ckpt.metadata
        self._handles: dict[Path, object] = {}
        # name -> (axis index, [(start, stop)] in the stored tensor's units) or "zero"
        self._cuts: dict[str, tuple[int, list[tuple[int, int]]] | str] = {}
        self.tensors: dict[str, TensorInfo] = {}
        for name, info in ckpt.tensors.items():
            cut = self._cut(info)
            if cut is None:
                self.tensors[name] = info
                continue
            self._cuts[name] = cut
            if cut == "zero":
                self.tensors[name] = info
                continue
            axis, ranges = cut
            shape = list(info.shape)
            shape[axis] = sum(b - a for a, b in ranges)
            n = 1
            for s in shape:
                n *= s
            self.tensors[name] = replace(info, shape=tuple(shape),
                                         nbytes=n * DTYPES[info.dtype][1])

    def _split_of(self, name: str) -> tuple[Split, bool] | None:
        """(the module's Split, whether this tensor is a matrix of it) or None (replicated)."""
        splits = self.plan.splits
        if name in splits:  # a per-head vector named as its module (self_attn.sinks)
            return splits[name], False
        path, _, suffix = name.rpartition(".")
        s = splits.get(path)
        if s is None or suffix not in (*MATRIX_SUFFIXES, "bias"):
            return None  # replicated (norms, routers, an nvfp4 global scale)
        return s, suffix in MATRIX_SUFFIXES

    def _cut(self, info: TensorInfo):
        found = self._split_of(info.name)
        if found is None:
            return None
        split, matrix = found
        if split.axis == "in" and not matrix:
            # the bias of a row-parallel projection: the all-reduce sums N copies of it, so
            # rank 0 holds it and the others zeros
            return None if self.plan.rank == 0 else "zero"
        axis = len(info.shape) - (2 if matrix and split.axis == "out" else 1)
        if axis < 0:
            raise ModelFormatError(f"{info.file.name}: tensor '{info.name}' has shape "
                                   f"{list(info.shape)}: cannot be split by {split.axis}put")
        stored = info.shape[axis]
        ranges = []
        for a, b in split.ranges:
            if (a * stored) % split.size or (b * stored) % split.size:
                unit = split.size // stored if stored and split.size % stored == 0 else None
                what = ("a packed 32-bit word" if info.dtype == "U32" else
                        f"a quantization group of {unit}" if unit else "a unit of storage")
                cols = "input columns" if split.axis == "in" else "output rows"
                raise ModelFormatError(
                    f"{info.file.name}: tensor '{info.name}' {list(info.shape)}: a "
                    f"{self.plan.world}-way split of its {split.size} {cols} at {a}..{b} would "
                    f"cut {what}; use fewer tensor-parallel ranks")
            ranges.append((a * stored // split.size, b * stored // split.size))
        return axis, ranges

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def load(self, name: str) -> torch.Tensor:
        """This rank's shard of tensor `name` (U32 as int32 bits, as Checkpoint.load)."""
        cut = self._cuts.get(name)
        if cut is None:
            return self.ckpt.load(name)
        info = self.tensors[name]
        if cut == "zero":
            return torch.zeros(info.shape, dtype=DTYPES[info.dtype][0])
        axis, ranges = cut
        handle = self._handle(info.file)
        try:
            sl = handle.get_slice(name)
            parts = [sl[(slice(None),) * axis + (slice(a, b),)] for a, b in ranges]
        except Exception as e:  # noqa: BLE001 -- safetensors raises its own error types
            raise ModelFormatError(f"{info.file}: tensor {name!r}: read failed ({e})") from None
        # torch has no uint32 ops (cat): the same bits as int32, as Checkpoint.load gives them
        parts = [p.view(torch.int32) if p.dtype == torch.uint32 else p for p in parts]
        t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=axis)
        return t.contiguous()

    def _handle(self, file: Path):
        from safetensors import safe_open

        h = self._handles.get(file)
        if h is None:
            h = self._handles[file] = safe_open(str(file), framework="pt")
        return h

    def close(self) -> None:
        self._handles.clear()
        self.ckpt.close()

    def __enter__(self) -> ShardedCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
