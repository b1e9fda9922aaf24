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


class Group:
    """One model's ranks: a gloo or NCCL process group of its own (not torch's global default
    group, so that one process can hold several tensor-parallel models), joined as `rank`
    through rank 0's store (rank 0 passes it, the others its port)."""

    def __init__(self, store: dist.TCPStore | None, port: int, rank: int, world: int,
                 device: torch.device):
        set_process_env()
        td = datetime.timedelta(seconds=collective_timeout())
        if store is None:
            store = dist.TCPStore(HOST, port, world, is_master=False, timeout=td)
        self.rank, self.world, self.backend = rank, world, BACKENDS[device.type]
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = td
            self.pg = dist.ProcessGroupNCCL(store, rank, world, opts)
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = td
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=HOST)]
            self.pg = dist.ProcessGroupGloo(store, rank, world, opts)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of t, in place (and returned)."""
        self.pg.allreduce([t]).wait()
        return t

    def all_gather_last(self, t: torch.Tensor, width: int, total: int) -> torch.Tensor:
        """t [..., w_r] of every rank (w_r <= width: the last shards may be shorter)
        concatenated along the last dim in rank order, cut to `total` columns: [..., total]."""
        if t.shape[-1] < width:
            t = torch.nn.functional.pad(t, (0, width - t.shape[-1]))
        t = t.contiguous()
        # one collective into one buffer [W * N, width] (ranks along dim 0; no per-rank list,
        # so it is also what a CUDA graph captures): [W, N, width] -> [N, W * width]
        out = t.new_empty((self.world * t.shape[0], *t.shape[1:]))
        self.pg._allgather_base(out, t).wait()
        full = out.view(self.world, *t.shape).movedim(0, -2)
        return full.reshape(*t.shape[:-1], self.world * width)[..., :total]

    def abort(self) -> None:
        """Fail this rank's pending and later collectives at once (NCCL's communicator is
        aborted; gloo's fail by themselves when a peer's connections close)."""
        abort = getattr(self.pg, "abort", None)
        if self.backend == "nccl" and abort is not None:
            abort()
