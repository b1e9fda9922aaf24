"""A decoder call as it crosses from rank 0 to the followers: tensors go as CPU tensors and
come back on the follower's device; KV pools and sequence caches go as references (the
follower keeps its own, shaped for its shard, under the same key); RoPE tables keyed by rank
0's spec ids go keyed by the rope's index.
"""

from __future__ import annotations

import itertools
import pickle
import weakref
from dataclasses import dataclass, fields, is_dataclass, replace

import torch

from ..engine.kv_cache import KVPool, SequenceCache, new_cache


def send(conn, msg: tuple) -> None:
    """Send one message by value (plain pickle: multiprocessing's own pickler would pass
    tensors as shared-memory handles, which a process it did not start cannot open)."""
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def recv(conn) -> tuple:
    return pickle.loads(conn.recv_bytes())


@dataclass(frozen=True)
class PoolRef:
    key: int
    num_blocks: int
    block_size: int


@dataclass(frozen=True)
class CacheRef:
    key: int
    capacity: int
    length: int


@dataclass(frozen=True)
class RopeTables:
    tables: dict  # rope index -> (cos, sin)


class CallEncoder:
    """Rank 0's side: `encode` a call's arguments; `released` keys of pools and caches that
    rank 0 dropped since the last call (the followers drop theirs)."""

    def __init__(self, decoder):
        self._rope_index: dict[int, int] = {}
        for i, rope in enumerate(decoder.ropes):
            self._rope_index.setdefault(id(rope.spec), i)
        self._keys: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._next = itertools.count()
        self._released: list[int] = []

    def key(self, obj) -> int:
        """The key that names `obj` (a pool or cache of rank 0) to the followers."""
        key = self._keys.get(obj)
        if key is None:
            key = self._keys[obj] = next(self._next)
            weakref.finalize(obj, self._released.append, key)
        return key

    def released(self) -> list[int]:
        out, self._released[:] = list(self._released), []
        return out

    def encode(self, obj):
        if isinstance(obj, torch.Tensor):
            return obj.detach().cpu()
        if isinstance(obj, KVPool):
            return PoolRef(self.key(obj), obj.num_blocks, obj.block_size)
        if isinstance(obj, SequenceCache):
            return CacheRef(self.key(obj), obj.capacity, obj.length)
        if isinstance(obj, dict) and obj and all(k in self._rope_index for k in obj):
            return RopeTables({self._rope_index[k]: self.encode(v) for k, v in obj.items()})
        if is_dataclass(obj) and not isinstance(obj, type):
            return replace(obj, **{f.name: self.encode(getattr(obj, f.name))
                                   for f in fields(obj) if f.init})
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.encode(v) for v in obj)
        if isinstance(obj, dict):
            return {k: self.encode(v) for k, v in obj.items()}
        return obj


class CallDecoder:
    """A follower's side: the inverse of `CallEncoder.encode` against its own decoder."""

    def __init__(self, decoder):
        self.decoder = decoder
        self.pools: dict[int, KVPool] = {}
        self.caches: dict[int, SequenceCache] = {}

    def release(self, keys: list[int]) -> None:
        for key in keys:
            self.pools.pop(key, None)
            self.caches.pop(key, None)

    def cache(self, key: int, capacity: int) -> SequenceCache:
        """The follower's cache for rank 0's cache `key` (made at `capacity` on first use)."""
        cache = self.caches.get(key)
        if cache is None:
            cache = self.caches[key] = new_cache(self.decoder, capacity)
        return cache

    def decode(self, obj):
        d = self.decoder
        if isinstance(obj, torch.Tensor):
            return obj.to(d.device)
        if isinstance(obj, PoolRef):
            pool = self.pools.get(obj.key)
            if pool is None:
                c = d.config
                pool = self.pools[obj.key] = KVPool(c.num_layers, c.num_kv_heads, c.head_dim,
                                                    obj.num_blocks, obj.block_size, d.dtype,
                                                    d.device)
            return pool
        if isinstance(obj, CacheRef):
            cache = self.cache(obj.key, obj.capacity)
            cache.length = obj.length
            return cache
        if isinstance(obj, RopeTables):
            return {id(d.ropes[i].spec): self.decode(v) for i, v in obj.tables.items()}
        if is_dataclass(obj) and not isinstance(obj, type):
            return replace(obj, **{f.name: self.decode(getattr(obj, f.name))
                                   for f in fields(obj) if f.init})
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.decode(v) for v in obj)
        if isinstance(obj, dict):
            return {k: self.decode(v) for k, v in obj.items()}
        return obj
