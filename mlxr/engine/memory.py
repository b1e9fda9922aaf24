"""How many bytes a loaded model holds, per device, measured from its tensors (not estimated
from file sizes: float weights may be upcast at load, 4-bit ones get a batched-decode copy), and
how many KV blocks its serving engine's pool gets: what a memory budget leaves after the
weights, or a share of the free memory, never more than `max_num_seqs` full contexts."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from ..errors import MemoryBudgetError
from ..models.hybrid_cache import KVShape, StateShape, layer_shapes

# the smallest pool a budget may leave: one request of this many tokens (or the whole context
# when shorter); smaller would refuse ordinary prompts
MIN_POOL_TOKENS = 4096
# slots a per-sequence cache is made with beyond its tokens (engine.seq_caches)
CACHE_SLACK = 16


@dataclass(frozen=True)
class PoolPlan:
    """A model's KV memory in blocks: bytes per block of `block_size` positions, the fewest
    blocks worth serving with, the most it can use (max_num_seqs full contexts), and what it
    holds whatever its blocks: `seq_bytes` for each of `max_seqs` running sequences and
    `fixed_bytes` in all (the hybrids' prefix snapshots). A paged pool (dense families) has
    only blocks."""

    block_bytes: int
    min_blocks: int
    full_blocks: int
    seq_bytes: int = 0
    max_seqs: int = 0
    fixed_bytes: int = 0

    def bytes(self, blocks: int) -> int:
        return blocks * self.block_bytes + self.base_bytes

    @property
    def base_bytes(self) -> int:
        return self.max_seqs * self.seq_bytes + self.fixed_bytes


def pool_plan(config, dtype: torch.dtype, block_size: int, max_num_seqs: int) -> PoolPlan:
    """The plan for a decoder config (layers, KV heads, head dim, context; a tensor-parallel
    rank's config gives its share of the heads) whose cache is in `dtype`."""
    c = config
    block = 2 * c.num_layers * c.num_kv_heads * c.head_dim * block_size * \
        torch.tensor([], dtype=dtype).element_size()
    per_seq = -(-c.context_length // block_size)
    least = -(-min(c.context_length, MIN_POOL_TOKENS) // block_size)
    return PoolPlan(block, least, max(least, max_num_seqs * per_seq))


def sequence_caches_plan(config, dtype: torch.dtype, block_size: int, max_num_seqs: int,
                         snapshot_bytes: int) -> PoolPlan:
    """The plan of a hybrid family's per-sequence caches (engine.seq_caches: `HybridCache`, or
    the uniform `SequenceCache` of a dense config), whose positions the engine's blocks meter.
    A cache made for L positions holds L + CACHE_SLACK slots and grows by doubling, so it never
    holds more than 2 x its computed positions + CACHE_SLACK: a block counts twice its K/V over
    the layers that keep every position, and each sequence its slack, its sliding-window rings
    at their full window and its recurrent states; the prefix snapshots (`snapshot_bytes`)
    are fixed."""
    elem = torch.tensor([], dtype=dtype).element_size()
    per_position = ring = state = 0
    for s in layer_shapes(config):
        if isinstance(s, KVShape):
            kv = 2 * s.kv_heads * s.head_dim * elem
            if s.window is None:
                per_position += kv
            else:
                ring += min(s.window, config.context_length) * kv
        elif isinstance(s, StateShape):
            state += s.conv[0] * s.conv[1] * elem + s.ssm[0] * s.ssm[1] * s.ssm[2] * 4
    dense = pool_plan(config, dtype, block_size, max_num_seqs)
    return PoolPlan(2 * per_position * block_size, dense.min_blocks, dense.full_blocks,
                    CACHE_SLACK * per_position + ring + state, max_num_seqs, snapshot_bytes)


def snapshot_budget(device: torch.device, prefix_snapshot_bytes: int | None) -> int:
    """The hybrids' prefix-snapshot bytes: as given, else 512 MiB on CUDA, 64 MiB on CPU."""
    if prefix_snapshot_bytes is not None:
        return prefix_snapshot_bytes
    return (512 if device.type == "cuda" else 64) << 20


def blocks_in_budget(plan: PoolPlan, budget: int, weights: int, spare: int, name: str) -> int:
    """Blocks for a model whose weights hold `weights` bytes when it may hold `budget` bytes
    in all (`spare` blocks beyond the usable ones are allocated too: the decode runner's trash
    block); MemoryBudgetError when not even the smallest pool fits."""
    n = min((budget - weights - plan.base_bytes) // max(1, plan.block_bytes) - spare,
             plan.full_blocks)
    if n < plan.min_blocks:
        need = weights + plan.bytes(plan.min_blocks + spare)
        raise MemoryBudgetError(
            f"{name} needs {need} bytes ({weights} of weights and a KV cache of at least "
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
    blocks = (budget - plan.base_bytes) // max(1, plan.block_bytes)
    return max(1, min(int(blocks), plan.full_blocks))


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
