"""The sharding plan: which slice of every checkpoint tensor one rank of N holds, and the
config its local decoder is built with.

Megatron-style (column-parallel in, row-parallel out, one all-reduce per block):
- q/k/v (or a fused qkv_proj), g_proj, sinks: split by heads (output rows). KV heads split
  evenly over the ranks, or each KV head replicated on N/K ranks where K < N.
- gate/up (or a fused gate_up_proj) and the MoE experts' gate/up: split by output rows of the
  intermediate dim; o_proj, down_proj and the experts' down: by input columns (the partial
  products are all-reduced, `layers.AllReduced`).
- embed_tokens / lm_head: split by vocabulary rows (`layers.VocabEmbedding`, `GatheredHead`).
- norms, the MoE router and the shared-expert gate: replicated.

A split along input columns of a quantized weight must fall on whole quantization groups; the
checkpoint view (`sharded_checkpoint`) refuses one that would cut a group, naming the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import ModelConfig
from ..errors import ModelFormatError

Ranges = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Split:
    """One module's share on this rank: along `axis` ("out": output rows, "in": input
    columns) of a logical extent `size`, the concatenation of `ranges` [(start, stop)]."""

    axis: str
    size: int
    ranges: Ranges

    @property
    def length(self) -> int:
        return sum(b - a for a, b in self.ranges)


def _even(total: int, world: int, rank: int, what: str) -> tuple[int, int]:
    """Rank's [start, stop) of `total` items split evenly, or a one-line error."""
    if total % world:
        raise ModelFormatError(f"config.json: {what} = {total} does not split evenly over "
                               f"{world} tensor-parallel ranks")
    n = total // world
    return rank * n, (rank + 1) * n


def vocab_range(vocab: int, world: int, rank: int) -> tuple[int, int]:
    """Rank's vocabulary rows: ceil(V/N) each, the last rank's share shorter (or empty)."""
    per = -(-vocab // world)
    return min(vocab, rank * per), min(vocab, (rank + 1) * per)


def kv_heads(num_kv: int, num_heads: int, world: int, rank: int) -> tuple[int, int]:
    """Rank's KV heads [start, stop): K/N each, or (K < N, N a multiple of K) the one KV head
    that its query heads read, replicated on N/K ranks."""
    if num_kv % world == 0:
        return _even(num_kv, world, rank, "num_key_value_heads")
    if world % num_kv == 0 and num_heads % world == 0:
        h = rank // (world // num_kv)
        return h, h + 1
    raise ModelFormatError(f"config.json: num_key_value_heads = {num_kv} neither splits over "
                           f"nor divides {world} tensor-parallel ranks")


@dataclass(frozen=True)
class ShardPlan:
    """Rank `rank` of `world`: `splits` (module path -> Split; absent = replicated) and
    `local` (the config of this rank's decoder: its heads, KV heads, intermediate sizes and
    vocabulary rows)."""

    world: int
    rank: int
    vocab: tuple[int, int]
    splits: dict[str, Split]
    local: ModelConfig


def make_plan(c: ModelConfig, world: int, rank: int) -> ShardPlan:
    """The plan of one rank, or a one-line ModelFormatError for a model that cannot be split
    over `world` ranks (heads, KV heads or an intermediate size not divisible)."""
    if c.arch is not None:
        raise ModelFormatError(f"{c.model_type}: tensor parallelism covers the dense and MoE "
                               "decoder families, not the hybrid ones")
    d = c.head_dim
    k0, k1 = kv_heads(c.num_kv_heads, c.num_heads, world, rank)
    kv = Split("out", c.kv_size, ((k0 * d, k1 * d),))
    f0, f1 = _even(c.intermediate_size, world, rank, "intermediate_size")
    v0, v1 = vocab_range(c.vocab_size, world, rank)
    if vocab_range(c.vocab_size, world, world - 1)[0] >= c.vocab_size:
        raise ModelFormatError(f"config.json: vocab_size = {c.vocab_size} is too small to give "
                               f"each of {world} tensor-parallel ranks vocabulary rows")
    splits: dict[str, Split] = {"model.embed_tokens": Split("out", c.vocab_size, ((v0, v1),)),
                                "lm_head": Split("out", c.vocab_size, ((v0, v1),))}
    moe = c.moe
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        heads = c.heads(i)
        h0, h1 = _even(heads, world, rank, f"attention heads of layer {i}")
        if heads % c.num_kv_heads:
            raise ModelFormatError(f"config.json: layer {i} has {heads} heads, not a multiple "
                                   f"of num_key_value_heads = {c.num_kv_heads}")
        q = Split("out", heads * d, ((h0 * d, h1 * d),))
        if c.fused_qkv:
            qs = heads * d
            splits[a + "qkv_proj"] = Split("out", qs + 2 * c.kv_size, (
                q.ranges[0], (qs + k0 * d, qs + k1 * d),
                (qs + c.kv_size + k0 * d, qs + c.kv_size + k1 * d)))
        else:
            splits |= {a + "q_proj": q, a + "k_proj": kv, a + "v_proj": kv}
        splits[a + "o_proj"] = Split("in", heads * d, q.ranges)
        splits[a + "g_proj"] = splits[a + "sinks"] = Split("out", heads, ((h0, h1),))
        if moe is not None and moe.sparse_layers[i]:
            x0, x1 = _even(moe.expert_size, world, rank, "the experts' intermediate size")
            ex = f"{p}{moe.block}.{moe.experts_path}."
            fx = moe.expert_size
            splits |= {ex + "gate_proj": Split("out", fx, ((x0, x1),)),
                       ex + "up_proj": Split("out", fx, ((x0, x1),)),
                       ex + "down_proj": Split("in", fx, ((x0, x1),))}
            if moe.shared_size:
                s0, s1 = _even(moe.shared_size, world, rank, "shared_expert_intermediate_size")
                sp = f"{p}{moe.block}.shared_expert."
                ss = moe.shared_size
                splits |= {sp + "gate_proj": Split("out", ss, ((s0, s1),)),
                           sp + "up_proj": Split("out", ss, ((s0, s1),)),
                           sp + "down_proj": Split("in", ss, ((s0, s1),))}
            continue
        f = c.intermediate_size
        m = p + "mlp."
        if c.fused_gate_up:
            splits[m + "gate_up_proj"] = Split("out", 2 * f, ((f0, f1), (f + f0, f + f1)))
        else:
            splits[m + "gate_proj"] = splits[m + "up_proj"] = Split("out", f, ((f0, f1),))
        splits[m + "down_proj"] = Split("in", f, ((f0, f1),))
    local = replace(
        c, num_heads=c.num_heads // world, num_kv_heads=k1 - k0,
        intermediate_size=c.intermediate_size // world, vocab_size=v1 - v0,
        layer_heads=tuple(h // world for h in c.layer_heads),
        moe=None if moe is None else replace(
            moe, expert_size=moe.expert_size // world, shared_size=moe.shared_size // world))
    return ShardPlan(world, rank, (v0, v1), splits, local)
