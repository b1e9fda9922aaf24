"""Tensor parallelism: one model split over N processes (one GPU each over NCCL, or N CPU
processes over gloo), Megatron-style (docs/tensor_parallel.md).

`load_decoder` is what `mlxr.load(path, tensor_parallel=N)` calls: rank 0 is this process,
ranks 1..N-1 are worker processes it starts (`launcher`), each reading only its shard of the
file (`sharded_checkpoint`) as the plan says (`plan`), computing through the loader's own
layers with the collectives around them (`layers`, `build`), rank 0 driving (`driver`,
`wire`) and the others following (`worker`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import ModelConfig
from ..errors import MlxrError
from .build import build_shard, check_shards
from .driver import DriverDecoder
from .launcher import Team, TensorParallelError

__all__ = ["DriverDecoder", "TensorParallelError", "check_world", "load_decoder"]


def check_world(world, device: torch.device) -> int:
    """The number of ranks: a positive int, at most the visible GPUs on CUDA."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise MlxrError(f"tensor_parallel={world!r}: expected a positive number of ranks")
    if device.type == "cuda":
        have = torch.cuda.device_count() - (device.index or 0)
        if world > have:
            raise MlxrError(f"tensor_parallel={world}: only {have} CUDA GPUs from "
                            f"{device} on are visible")
    return world


def load_decoder(path: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 world: int) -> DriverDecoder:
    """Check that every rank's shard exists and splits on whole groups (headers only), start
    the followers, load rank 0's shard here, and return rank 0's decoder once every rank is
    ready (a TensorParallelError, with the followers stopped, if one fails)."""
    check_shards(path, config, world)
    team = Team(world)
    try:
        team.start(path, config, device, dtype)
        local = build_shard(path, config, team.group, dtype, device)
        team.wait_ready()
    except BaseException:
        team.close()
        raise
    return DriverDecoder(local, team)
