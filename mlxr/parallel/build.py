"""Build one rank's decoder: the checkpoint's shard through the ordinary loader, then the
collectives around it (`layers`)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from ..checkpoint import open_checkpoint
from ..config import ModelConfig
from ..models.decoder import Decoder
from ..models.loader import build_decoder
from .group import Group
from .layers import AllReduced, GatheredHead, VocabEmbedding
from .plan import make_plan
from .sharded_checkpoint import ShardedCheckpoint


def check_shards(path: Path, config: ModelConfig, world: int) -> None:
    """Every rank's shard checked (plan, group boundaries, each tensor's shard shape against
    the local config) from the headers alone: a model that cannot be split fails here, in
    one line, before a worker starts."""
    with open_checkpoint(path) as ckpt:
        for rank in range(world):
            plan = make_plan(config, world, rank)
            build_decoder(ShardedCheckpoint(ckpt, plan), plan.local, torch.float32,
                          torch.device("cpu"), dry_run=True)


def build_shard(path: Path, config: ModelConfig, group: Group, dtype: torch.dtype,
                device: torch.device) -> Decoder:
    """Rank `rank`'s decoder: local heads, KV heads, intermediate and vocabulary rows, read
    from the file as that shard only; its config is the local one with the full vocabulary
    (what samplers and logits see)."""
    world = group.world
    plan = make_plan(config, world, group.rank)
    with open_checkpoint(path) as ckpt:
        dec = build_decoder(ShardedCheckpoint(ckpt, plan), plan.local, dtype, device)
    v0, v1 = plan.vocab
    vocab = config.vocab_size
    width = -(-vocab // world)  # every rank's logits padded to this for the gather
    for layer in dec.layers:
        layer.o_proj = AllReduced(layer.o_proj, group)
        if layer.moe is not None:
            layer.moe = AllReduced(layer.moe, group)
        else:
            layer.down_proj = AllReduced(layer.down_proj, group)
    dec.embed = VocabEmbedding(dec.embed, group, v0, v1, width, vocab)
    if dec.lm_head is not None:
        dec.lm_head = GatheredHead(dec.lm_head, group, width, vocab)
    dec.config = replace(plan.local, vocab_size=vocab)
    return dec
