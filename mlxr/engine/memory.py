"""How many bytes a loaded model holds, per device, measured from its tensors (not estimated
from file sizes: float weights may be upcast at load, 4-bit ones get a batched-decode copy), and
how many KV blocks its serving engine's pool gets: what a memory budget leaves after the
weights, or a share of the free memory, never more than `max_num_seqs` full contexts."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from ..errors import MemoryBudgetError

# the smallest pool a budget may leave: one request of this many tokens (or the whole context
# when shorter); smaller would refuse ordinary prompts
MIN_POOL_TOKENS = 4096


@dataclass(frozen=True)
class PoolPlan:
    """A paged KV pool's sizes for one model: bytes per block (K and V of every layer), the
    fewest blocks worth serving with, and the most it can use (max_num_seqs full contexts)."""

    block_bytes: int
    min_blocks: int
    full_blocks: int

    def bytes(self, blocks: int) -> int:
        return blocks * self.block_bytes


def pool_plan(config, dtype: torch.dtype, block_size: int, max_num_seqs: int) -> PoolPlan:
    """The plan for a decoder config (layers, KV heads, head dim, context; a tensor-parallel
    rank's config gives its share of the heads) whose cache is in `dtype`."""
    c = config
    block = 2 * c.num_layers * c.num_kv_heads * c.head_dim * block_size * \
        torch.tensor([], dtype=dtype).element_size()
    per_seq = -(-c.context_length // block_size)
    least = -(-min(c.context_length, MIN_POOL_TOKENS) // block_size)
    return PoolPlan(block, least, max(least, max_num_seqs * per_seq))


def blocks_in_budget(plan: PoolPlan, budget: int, weights: int, spare: int, name: str) -> int:
    """Blocks for a model whose weights hold `weights` bytes when it may hold `budget` bytes
    in all (`spare` blocks beyond the usable ones are allocated too: the decode runner's trash
    block); MemoryBudgetError when not even the smallest pool fits."""
    n = min((budget - weights) // plan.block_bytes - spare, plan.full_blocks)
    if n < plan.min_blocks:
        need = weights + plan.bytes(plan.min_blocks + spare)
        raise MemoryBudgetError(
            f"{name} needs {need} bytes ({weights} of weights and a KV pool of at least "
            f"{plan.bytes(plan.min_blocks + spare)}), more than the {budget} bytes the memory "
            "budget leaves it (--memory-budget)")
    return n


def free_memory_blocks(plan: PoolPlan, device: torch.device, fraction: float | None) -> int:
    """Without a budget: a share of the free memory (80% of the GPU's free memory, 25% of the
    available RAM, or `fraction` of it), capped at the plan's full pool."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = free * (fraction or 0.8)
    else:
        avail = 8 << 30
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        avail = int(line.split()[1]) * 1024
        except OSError:
            pass
        budget = avail * (fraction or 0.25)
    return max(1, min(int(budget // plan.block_bytes), plan.full_blocks))


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
