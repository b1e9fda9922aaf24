"""The process group of one tensor-parallel model: rendezvous, backend, timeouts, and the two
collectives the sharded layers need.

gloo on the CPU (the tests: N CPU processes), NCCL on CUDA (one GPU per rank). Every
collective runs under the group's timeout (env MLXR_TP_TIMEOUT, seconds, default 60), so a
rank that stops answering ends in an error rather than a hang; a rank that dies is noticed
sooner by the launcher's watchdog (`launcher.Team`).
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from ..errors import MlxrError

BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
HOST = "127.0.0.1"  # one host: the ranks meet on the loopback interface


def collective_timeout() -> float:
    """Seconds a collective (and the rendezvous) may wait: env MLXR_TP_TIMEOUT, default 60."""
    raw = os.environ.get("MLXR_TP_TIMEOUT", "60")
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise MlxrError(f"MLXR_TP_TIMEOUT={raw!r}: expected a positive number of seconds")
    return value


def set_process_env() -> None:
    """What every process of the group runs with: NVLink SHARP (NVLS) multicast off (the
    machines this runs on do not offer it reliably)."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"


def master_store(world: int) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free loopback port (its `.port` goes to the workers)."""
    td = datetime.timedelta(seconds=collective_timeout())
    return dist.TCPStore(HOST, 0, world, is_master=True, timeout=td, wait_for_workers=False)


def join(store: dist.TCPStore | None, port: int, rank: int, world: int,
         device: torch.device) -> None:
    """Join the group as `rank` (rank 0 passes its master store, the others its port)."""
    set_process_env()
    td = datetime.timedelta(seconds=collective_timeout())
    if store is None:
        store = dist.TCPStore(HOST, port, world, is_master=False, timeout=td)
    kw = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(BACKENDS[device.type], store=store, rank=rank, world_size=world,
                            timeout=td, **kw)


def leave() -> None:
    """Destroy this process's group (a no-op when there is none)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    """The sum over the ranks of t, in place (and returned)."""
    dist.all_reduce(t)
    return t


def all_gather_last(t: torch.Tensor, width: int, total: int) -> torch.Tensor:
    """t [..., w_r] of every rank (w_r <= width: the last shards may be shorter) concatenated
    along the last dim in rank order, cut to `total` columns: [..., total]."""
    if t.shape[-1] < width:
        t = torch.nn.functional.pad(t, (0, width - t.shape[-1]))
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim=-1)[..., :total]
