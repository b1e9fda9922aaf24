"""How many bytes a loaded model holds, per device, measured from its tensors (not estimated
from file sizes: float weights may be upcast at load, 4-bit ones get a batched-decode copy)."""

from __future__ import annotations

from collections import defaultdict

import torch


def tensor_bytes(root: object, max_objects: int = 1_000_000) -> dict[str, int]:
    """Bytes of every tensor reachable from `root` through attributes, lists, tuples and dicts,
    by device ("cpu", "cuda:0"): each storage counted once (views and tied weights share one).
    `max_objects` bounds the walk (a model graph has ~1e4 objects)."""
    seen_obj: set[int] = set()
    seen_storage: set[tuple[str, int]] = set()
    out: dict[str, int] = defaultdict(int)
    stack = [root]
    while stack and len(seen_obj) < max_objects:
        obj = stack.pop()
        if id(obj) in seen_obj or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
            continue
        seen_obj.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            key = (str(obj.device), storage.data_ptr())
            if key not in seen_storage:
                seen_storage.add(key)
                out[str(obj.device)] += storage.nbytes()
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, torch.nn.Module):
            stack.extend(obj.state_dict(keep_vars=True).values())
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            stack.extend(vars(obj).values())
        elif hasattr(obj, "__slots__"):
            stack.extend(getattr(obj, s, None) for s in obj.__slots__)
    return dict(out)
