"""Paged KV cache: one pool of fixed-size blocks shared by all sequences, with prefix caching.

Storage per layer: k, v [K, num_blocks * block_size, D] (head-major, so a sequence whose blocks
are consecutive is read as a [K, S, D] view without copying). A token's "slot" is
block * block_size + offset. Full blocks are content-hashed (hash of the previous block's hash
and the block's token ids), so a request that shares a prompt prefix with an earlier one (the
next turn of a conversation, a shared system prompt) reuses those blocks instead of recomputing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch


class KVPool:
    """The tensors: k[layer], v[layer] of shape [K, num_blocks * block_size, D]."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device | str):
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_kv_heads, num_blocks * block_size, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return 2 * sum(t.numel() * t.element_size() for t in self.k)


def block_hash(prev: int, tokens: Sequence[int]) -> int:
    return hash((prev, tuple(tokens)))


class Block:
    __slots__ = ("hash", "id", "ref_count", "tokens")

    def __init__(self, block_id: int):
        self.id, self.ref_count, self.hash, self.tokens = block_id, 0, -1, ()


class BlockManager:
    """Allocates blocks to sequences; reuses full blocks whose content hash matches.

    A sequence is any object with `token_ids: list[int]`, `block_table: list[int]`,
    `num_cached_tokens: int` (tokens whose KV came from the prefix cache) and `num_hashed: int`
    (leading blocks of its table already in the prefix cache; the manager keeps it) and
    `reuse_prefix: bool` (False: computes every token, e.g. an embedding pooled over them all).
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.block_size = block_size
        # off for models with recurrent layers: a cached block holds K/V, not the recurrent
        # state at its end, so a sequence could not resume from it
        self.prefix_caching = prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: deque[int] = deque(range(num_blocks))  # least recently freed first
        self.by_hash: dict[int, int] = {}
        self.queries = self.hits = 0  # prefix-cache statistics, in blocks

    @property
    def num_free(self) -> int:
        return len(self.free)

    def _take(self) -> Block:
        b = self.blocks[self.free.popleft()]
        if b.hash != -1 and self.by_hash.get(b.hash) == b.id:
            del self.by_hash[b.hash]  # its old content is about to be overwritten
        b.hash, b.tokens, b.ref_count = -1, (), 1
        return b

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq) -> bool:
        return self.num_free >= self.blocks_needed(len(seq.token_ids))

    def allocate(self, seq) -> None:
        """Give `seq` blocks for all its tokens, reusing cached full blocks of its prefix.

        At least the last prompt token is always recomputed (its logits are needed), so a fully
        cached prompt still leaves its last block to compute.
        """
        assert not seq.block_table
        bs, ids = self.block_size, seq.token_ids
        h = -1
        for i in range(self.blocks_needed(len(ids))):
            tokens = tuple(ids[i * bs:(i + 1) * bs])
            if len(tokens) < bs or (i + 1) * bs >= len(ids) or not self.prefix_caching \
                    or not seq.reuse_prefix:
                break
            h = block_hash(h, tokens)
            self.queries += 1
            cached = self.by_hash.get(h)
            if cached is None or self.blocks[cached].tokens != tokens:
                break
            b = self.blocks[cached]
            if b.ref_count == 0:
                self.free.remove(b.id)
            b.ref_count += 1
            self.hits += 1
            seq.block_table.append(b.id)
        seq.num_cached_tokens = len(seq.block_table) * bs
        while len(seq.block_table) < self.blocks_needed(len(ids)):
            seq.block_table.append(self._take().id)

    def register(self, seq, num_computed: int) -> None:
        """Enter `seq`'s full blocks whose KV is now computed into the prefix cache."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        full = num_computed // bs
        # From the first block not yet entered: a step costs O(new blocks), not O(context).
        for i in range(seq.num_hashed, full):
            b = self.blocks[seq.block_table[i]]
            if b.hash != -1:
                continue
            prev = self.blocks[seq.block_table[i - 1]].hash if i else -1
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            b.hash, b.tokens = block_hash(prev, tokens), tokens
            self.by_hash.setdefault(b.hash, b.id)
        seq.num_hashed = max(seq.num_hashed, full)

    def free_seq(self, seq) -> None:
        for block_id in reversed(seq.block_table):
            b = self.blocks[block_id]
            b.ref_count -= 1
            if b.ref_count == 0:
                self.free.append(block_id)
        seq.block_table = []  # a new list: holders of the old one (decode tables) see the change
        seq.num_cached_tokens = seq.num_hashed = 0

    def append(self, seq) -> None:
        """Allocate a block when the token just appended to `seq.token_ids` starts one."""
        if len(seq.token_ids) > len(seq.block_table) * self.block_size:
            seq.block_table.append(self._take().id)


class SequenceCache:
    """The KV of one sequence in one contiguous range (the single-request path: `Model.logits`,
    `Model.generate`, the CLI). Grows geometrically; positions [0, length) are filled."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, capacity: int = 256):
        self._args = (num_layers, num_kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.pool = KVPool(*self._args, 1, capacity, dtype, device)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.pool.block_size

    def reserve(self, length: int) -> None:
        if length <= self.capacity:
            return
        old = self.pool
        self.pool = KVPool(*self._args, 1, max(length, 2 * self.capacity), self.dtype,
                           self.device)
        for new, prev in ((self.pool.k, old.k), (self.pool.v, old.v)):
            for n, o in zip(new, prev):
                n[:, : self.length] = o[:, : self.length]


def new_cache(decoder, capacity: int = 256) -> SequenceCache:
    """A SequenceCache shaped for `decoder` (layers, kv heads, head dim, dtype, device), or the
    decoder's own single-sequence cache where it has one (the hybrid families)."""
    if hasattr(decoder, "new_cache"):
        return decoder.new_cache(max(1, capacity))
    c = decoder.config
    return SequenceCache(c.num_layers, c.num_kv_heads, c.head_dim, decoder.dtype,
                         decoder.device, max(1, capacity))
