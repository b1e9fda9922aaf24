"""The read wall per size: how fast a kernel that only streams bytes (no math) reads each
decode GEMV's weight bytes, so a GEMV's time can be held against what reading its bytes in
one launch costs, not against the large-copy rate (launch and ramp dominate small reads).

    python benchmarks/gpu/gpu_read_wall.py          # the 8B and 0.6B decode shapes
    python benchmarks/gpu/gpu_read_wall.py q4tc     # the same read in q4tc's grid (N/16 programs)

Each launch: P programs, each streams its contiguous chunk of int32 words in tiles of BLOCK
(16-byte loads, .cg: past L1), XORs them into a register tile and stores one word (so the
loads stay live); its loop's trip count is a constant, so it is unrolled and a thread's loads
issue back to back. CUDA graphs over copies larger than the L2 (gpu_timing). Prints, per size,
the best launch and the sweep, with GB/s.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gpu_timing import L2_BYTES, graph_time_us  # noqa: E402

# weight bytes of one 4-bit g64 projection: N * K / 2 codes + 4 * N * K / 64 (scale, bias)
SHAPES = {"8b_qkv": (6144, 4096), "8b_o": (4096, 4096), "8b_gate_up": (28672, 4096),
          "8b_down": (4096, 14336), "0.6b_qkv": (4096, 1024), "0.6b_o": (1024, 2048),
          "0.6b_gate_up": (6144, 1024), "0.6b_down": (1024, 3072)}


@triton.jit
def _read_kernel(p, out, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program pid XORs words [pid * CHUNK, (pid + 1) * CHUNK) of p; one word out."""
    base = p + tl.program_id(0).to(tl.int64) * CHUNK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in tl.range(CHUNK // BLOCK):
        acc ^= tl.load(base + i * BLOCK, cache_modifier=".cg")
    tl.store(out + tl.program_id(0), tl.xor_sum(acc, axis=0))


def wall(nbytes: int) -> list[tuple[float, str]]:
    """[(us, launch label)] for a sweep of launches reading about nbytes, fastest first."""
    words = nbytes // 4
    res = []
    for block, nw in ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (8192, 16)):
        for per_prog in (block, 2 * block, 4 * block, 8 * block, 16 * block):
            progs = -(-words // per_prog)
            total = progs * per_prog
            copies = [torch.empty(total, dtype=torch.int32, device="cuda").random_()
                      for _ in range(max(1, -(-2 * L2_BYTES // (4 * total))))]
            out = torch.empty(progs, dtype=torch.int32, device="cuda")
            us = graph_time_us([lambda c=c: _read_kernel[(progs,)](
                c, out, CHUNK=per_prog, BLOCK=block, num_warps=nw) for c in copies])
            res.append((us, f"{progs} programs x {per_prog * 4 // 1024} KiB, block {block}, "
                        f"{nw} warps"))
    return sorted(res)


def q4tc_shaped(n: int, k: int) -> list[tuple[float, str]]:
    """The read alone in q4tc's grid: N/16 programs, each one row tile's 2K words in tiles of
    16 bytes per thread (one or two tiles per iteration), 8 or 16 warps. Holds the GEMV
    against its own grid's read, not only against the best grid's."""
    words = n // 16 * 2 * k
    copies = [torch.empty(words, dtype=torch.int32, device="cuda").random_()
              for _ in range(max(1, -(-2 * L2_BYTES // (4 * words))))]
    out = torch.empty(n // 16, dtype=torch.int32, device="cuda")
    res = []
    for nw in (8, 16):
        for tiles in (1, 2, 4):
            block = 128 * nw * tiles
            if (2 * k) % block:
                continue
            us = graph_time_us([lambda c=c: _read_kernel[(n // 16,)](
                c, out, CHUNK=2 * k, BLOCK=block, num_warps=nw) for c in copies])
            res.append((us, f"{nw} warps, {tiles} x 16 B per thread per iteration"))
    return res


def main() -> None:
    if sys.argv[1:] == ["q4tc"]:
        for name, (n, k) in SHAPES.items():
            nbytes = n * k // 2
            print(f"{name} (words only, {nbytes / 1e6:.2f} MB), q4tc's grid: " + "; ".join(
                f"{us:.2f} us {nbytes / us / 1e3:.0f} GB/s ({lb})"
                for us, lb in q4tc_shaped(n, k)), flush=True)
        return
    for name, (n, k) in SHAPES.items():
        nbytes = n * k // 2 + 4 * n * (k // 64)
        res = wall(nbytes)
        us, label = res[0]
        print(f"{name}: {nbytes / 1e6:.2f} MB, best {us:.2f} us ({nbytes / us / 1e3:.0f} GB/s) "
              f"with {label}; next: " + "; ".join(f"{u:.2f} ({lb})" for u, lb in res[1:4]),
              flush=True)


if __name__ == "__main__":
    main()
