"""Layers built from checkpoint tensors: linear (float or quantized), embedding, RoPE tables.

Layers hold weights only; their math lives in `mlxr.ops` (reference torch on CPU, Triton on CUDA).
"""

from __future__ import annotations

import math

import torch

from . import ops
from .config import RopeSpec
from .quant import QuantWeight


class Linear:
    """y = x @ W^T (+ b). W is a float tensor [out, in] or a QuantWeight kept packed."""

    def __init__(self, weight: torch.Tensor | QuantWeight, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight, bias
        # QuantWeight (and the loader's shape-only stand-in) carry out_features; tensors a shape.
        self.out_features = getattr(weight, "out_features", None) or weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, QuantWeight):
            y = self.weight.linear(x)
        else:
            y = x @ self.weight.t()
        return y if self.bias is None else y + self.bias

    def gated(self, x: torch.Tensor, act: str) -> torch.Tensor:
        """act(gate) * up of this projection's output halves [gate | up] (an MLP's gate_up):
        in the GEMV's launch where the weight serves it (`QuantWeight.gated`), else as
        `ops.gated_act` over the halves."""
        if self.bias is None and isinstance(self.weight, QuantWeight):
            y = self.weight.gated(x, act)
            if y is not None:
                return y
        gate, up = self(x).chunk(2, dim=-1)
        return ops.gated_act(gate, up, act)


class Embedding:
    """Token embedding [V, E], float or quantized; `as_linear` is the tied LM head."""

    def __init__(self, weight: torch.Tensor | QuantWeight):
        self.weight = weight
        self.as_linear = Linear(weight)  # x [N, E] -> logits [N, V]

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, QuantWeight):
            return self.weight.embed(ids)
        return self.weight[ids]


def rope_inv_freq(spec: RopeSpec, seq_len: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dims/2] (float32) and the q/k pre-scale for one layer's RoPE.

    Follows mlx-lm's rope_utils exactly (incl. its deviations from HF: longrope always uses
    long factors, yarn ignores truncate/attention_factor). `seq_len` matters only for dynamic NTK.
    """
    d = spec.dims
    s = spec.scaling or {}
    kind = s.get("rope_type", "default")
    base = spec.base
    if kind == "dynamic":
        max_pos = spec.max_position_embeddings or seq_len
        n = max(seq_len, max_pos)
        f = s["factor"]
        base = base * ((f * n / max_pos) - (f - 1)) ** (d / (d - 2))
    periods = base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)  # mlx "freqs": periods
    scale = 1.0
    if kind == "linear":
        periods = periods * s["factor"]
    elif kind == "llama3":
        f = s["factor"]
        low, high = s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
        old = s.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi * periods
        p = torch.where(wavelen > old / low, periods * f, periods)
        medium = (wavelen > old / high) & (wavelen < old / low)
        smooth = (old / wavelen - low) / (high - low)
        periods = torch.where(medium, p / ((1 - smooth) / f + smooth), p)
    elif kind == "yarn":
        f = s["factor"]
        old = s.get("original_max_position_embeddings", 4096)
        beta_fast, beta_slow = s.get("beta_fast", 32), s.get("beta_slow", 1)

        def corr(rot):
            return d * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(spec.base))

        lo, hi = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), d - 1)
        if lo == hi:
            hi += 0.001
        ramp = ((torch.arange(d // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
        mask = 1.0 - ramp
        inter = f * periods
        periods = (inter * periods) / (inter * mask + periods * (1 - mask))

        def mscale(m):
            return 1.0 if f <= 1 else 0.1 * m * math.log(f) + 1.0

        scale = mscale(s.get("mscale", 1)) / mscale(s.get("mscale_all_dim", 0))
    elif kind == "proportional":
        # gemma4's full layers: the first `rotated` dims turn with exponents over all d dims,
        # the rest never turn (mlx: infinite periods; inverse frequency 0, cos 1, sin 0)
        rot = s["rotated"]
        periods = torch.cat((s["factor"] * periods[:rot // 2],
                             torch.full(((d - rot) // 2,), math.inf)))
    elif kind in ("longrope", "su"):
        periods = torch.tensor(s["long_factor"], dtype=torch.float32) * periods
        old = s["original_max_position_embeddings"]
        f = (spec.max_position_embeddings or old) / old
        scale = s.get("long_mscale") or (
            1.0 if f <= 1.0 else math.sqrt(1 + math.log(f) / math.log(old))
        )
    return 1.0 / periods, scale


class Rope:
    """Per-layer RoPE tables; cos/sin for any positions, cached by the layer's spec."""

    def __init__(self, spec: RopeSpec, device: torch.device):
        self.spec, self.device = spec, device
        self._inv, self.scale = rope_inv_freq(spec, 0)
        self._dynamic = (spec.scaling or {}).get("rope_type") == "dynamic"
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def dynamic(self) -> bool:
        """Whether the frequencies depend on the sequence length (dynamic NTK)."""
        return self._dynamic

    @staticmethod
    def _angles(inv: torch.Tensor, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end, dtype=torch.float32)
        return pos[:, None] * inv[None, :]

    def cos_sin(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Angles for positions [start, start+length): cos, sin each [length, dims/2] float32.

        Static RoPE reads slices of a table kept on the device (grown geometrically): computing
        the angles on the host and copying them per call cost ~4 ms of a 512-token GPU prefill.
        The values are the same either way (the same float32 ops per position)."""
        end = start + length
        if self._dynamic:  # the frequencies depend on the sequence length
            inv, _ = rope_inv_freq(self.spec, end)
            ang = self._angles(inv, start, end)
            return ang.cos().to(self.device), ang.sin().to(self.device)
        if self._table is None or self._table[0].shape[0] < end:
            cap = max(end, 4096, 2 * (0 if self._table is None else self._table[0].shape[0]))
            ang = self._angles(self._inv, 0, cap)
            self._table = (ang.cos().to(self.device), ang.sin().to(self.device))
        cos, sin = self._table
        return cos[start:end], sin[start:end]
