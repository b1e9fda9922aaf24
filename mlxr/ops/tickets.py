"""Ticket counters: the int32 workspace of the kernels whose last program finishes a job the
others fed (the threadfence-reduction pattern: each program stores its part, passes a CTA
barrier, adds 1 to a counter with an acq_rel atomic at GPU scope; the program that draws the
last ticket reads every part back and finishes, then resets the counter to zero).

One zeroed workspace per device, in regions, one per kernel family, so that no two kinds of
launch share a counter; every launch leaves its counters at zero, so the kernels of a stream
(whose launches do not overlap; with programmatic dependent launch a kernel touches its
counter only after `griddepcontrol.wait`) reuse them step after step, also inside CUDA graphs.
Free of triton (imported by `mlxr.ops` users at start).
"""

from __future__ import annotations

import torch
from torch import Tensor

REGION = 1 << 14  # counters per region
MOE_GATE_UP, MOE_DOWN, MOE_ROUTER, RESIDUAL = range(4)  # the regions
REGIONS = 8
_WORKSPACE: dict = {}


def counters(device: torch.device, region: int) -> Tensor:
    """The device's zeroed int32 counters of `region` [REGION]. Allocated at the first call
    on the device (the engine and the graph runners run their steps eagerly before any CUDA
    graph capture); every kernel leaves its counters at zero."""
    key = (device.type, device.index)
    ws = _WORKSPACE.get(key)
    if ws is None:
        ws = _WORKSPACE[key] = torch.zeros(REGION * REGIONS, dtype=torch.int32, device=device)
    return ws[region * REGION:(region + 1) * REGION]
