"""The derived bound on the chunked gated delta rule's difference from the sequential one
(shared by tests/test_triton_gdn_chunked.py and scripts/gdn_chunked_gpu.py).

Both forms compute the same function; they differ by float32 rounding in other orders. First
order, with u the unit roundoff of the products (2^-24 for float32):
* sequential: per token a Dk-term sum per state element, each off by <= Dk u of the sum of
  |terms| (|k| = 1): T tokens carry <= T Dk u M, M = the largest |state| entry over the run
  (the per-token map S -> g S (I - beta k k^T) contracts: carried errors do not grow).
* chunked, per chunk: sums of <= Dk + 2C terms (W H; the solve's and P U's C terms), whose
  magnitudes the triangular inverse T = (I + A)^-1 scales by up to kappa = max ||T||_inf on
  each side (its rows enter the solve and the products: kappa^2): nt chunks carry
  <= nt (Dk + 2C) kappa^2 u M.
The output y = S q adds <= |q|_1 (<= 1 for q normed to Dk^-0.5, as l2norm_qk gives) times
the state's error. kappa and M are measured in float64 on the data itself.
"""

from __future__ import annotations

import torch

U32 = 2.0**-24


def sequential_f64(q, k, v, g, beta, state) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The recurrence in float64: (y [B, T, Hv, Dv], final state [B, Hv, Dv, Dk], M the largest
    |state| entry over the run, start included)."""
    rep = v.shape[2] // k.shape[2]
    q64, k64 = (x.double().repeat_interleave(rep, 2) for x in (q, k))
    v64, g64, b64 = v.double(), g.double(), beta.double()
    s = state.double().clone()
    m = float(s.abs().max())
    ys = []
    for t in range(v.shape[1]):
        s = s * g64[:, t, :, None, None]
        kv = (s * k64[:, t, :, None, :]).sum(-1)
        d = (v64[:, t] - kv) * b64[:, t, :, None]
        s = s + d[..., None] * k64[:, t, :, None, :]
        ys.append((s * q64[:, t, :, None, :]).sum(-1))
        m = max(m, float(s.abs().max()))
    return torch.stack(ys, 1), s, m


def solve_growth(k, g, beta, chunk: int) -> float:
    """kappa: the largest ||(I + A)^-1||_inf over the chunks and heads, float64."""
    bsz, t, hv = beta.shape
    rep = hv // k.shape[2]
    nt = -(-t // chunk)
    pad = nt * chunk - t
    kk = torch.nn.functional.pad(k.double().repeat_interleave(rep, 2), (0, 0, 0, 0, 0, pad))
    bb = torch.nn.functional.pad(beta.double(), (0, 0, 0, pad))
    lg = torch.nn.functional.pad(torch.log(g.double()).clamp_min(-80.0), (0, 0, 0, pad))
    kk = kk.reshape(bsz, nt, chunk, hv, -1).movedim(3, 1)  # [B, Hv, NT, C, Dk]
    bb, lg = (x.reshape(bsz, nt, chunk, hv).movedim(3, 1) for x in (bb, lg))
    cum = lg.cumsum(-1)
    strict = torch.ones(chunk, chunk, dtype=torch.bool, device=k.device).tril(-1)
    decay = torch.exp(torch.where(strict, cum[..., :, None] - cum[..., None, :], 0.0))
    a = torch.where(strict, bb[..., :, None] * decay * (kk @ kk.transpose(-1, -2)), 0.0)
    eye = torch.eye(chunk, dtype=torch.float64, device=k.device).expand_as(a)
    tri = torch.linalg.solve_triangular(eye + a, eye, upper=False, unitriangular=True)
    return float(tri.abs().sum(-1).max())


def chunked_bound(q, k, v, g, beta, state, chunk: int, unit: float = U32,
                  with_sequential: bool = True) -> tuple[float, float, dict]:
    """(state tolerance, y tolerance) for chunked vs sequential (with_sequential) or chunked vs
    chunked (two float32 evaluations of the chunked form: twice its own term); unit: the
    chunked products' roundoff. Also returns the measured terms."""
    _, _, m = sequential_f64(q, k, v, g, beta, state)
    kappa = solve_growth(k, g, beta, chunk)
    t, dk = k.shape[1], k.shape[3]
    nt = -(-t // chunk)
    n_chunk = nt * (dk + 2 * chunk) * kappa**2 * unit
    n = n_chunk + t * dk * U32 if with_sequential else 2 * n_chunk
    q1 = float(q.double().abs().sum(-1).max())
    s_tol = n * m
    return s_tol, s_tol * max(1.0, q1), {"kappa": kappa, "M": m, "q1": q1}
