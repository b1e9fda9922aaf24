"""Compile the fused decode GEMV (mlxr.ops.triton_fgemv) for sm_90 without a GPU and report its
resources and instruction mix: a workbench for sessions without device time (registers,
spills, shared memory, SASS opcode counts per code of the program's tile).

    PYTHONPATH=. python benchmarks/sass_fgemv.py K BITS GROUP PRO BLOCK_N KT [num_warps]

PRO: 0 plain, 1 add + RMSNorm, 2 gated act. Uses the ptxas/cuobjdump that Triton ships.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mlxr.ops import triton_fgemv as F


def compile_sm90(k, bits, group, pro, block_n, kt, num_warps=4):
    sig = {"x_ptr": "*bf16", "r_ptr": "*bf16", "nw_ptr": "*bf16", "h_ptr": "*bf16",
           "w_ptr": "*i32", "s_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16",
           "N": "i32", "eps": "fp32", "offset": "fp32", "zero": "i32"}
    const = {"K": k, "BITS": bits, "GROUP": group, "PRO": pro, "HAS_R": pro == 1,
             "HAS_OFFSET": False, "ACT": 0, "BLOCK_N": block_n, "KT": kt,
             "BLOCK_E": triton.next_power_of_2(k), "GDC": False}
    sig.update(dict.fromkeys(const, "constexpr"))
    names = list(sig)
    src = ASTSource(F._fgemv_kernel, sig, constexprs={(names.index(n),): v
                                                      for n, v in const.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def main(argv: list[str]) -> None:
    k, bits, group, pro, block_n, kt = (int(a) for a in argv[:6])
    num_warps = int(argv[6]) if len(argv) > 6 else 4
    ck = compile_sm90(k, bits, group, pro, block_n, kt, num_warps)
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ck.asm["cubin"])
        f.flush()
        usage = subprocess.run([f"{tools}/cuobjdump", "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([f"{tools}/cuobjdump", "--dump-sass", f.name],
                              capture_output=True, text=True, check=True).stdout
    ops: collections.Counter = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
        if m:
            ops[m.group(2)] += 1
    codes_per_thread = block_n * kt // (32 * num_warps)  # one tile (NT tiles run the same body)
    total = sum(ops.values())
    print(usage.strip().splitlines()[-1].strip())
    print(f"{total} SASS instructions, {codes_per_thread} codes per thread per tile "
          f"({total / codes_per_thread:.1f} per code incl. fixed costs)")
    print(", ".join(f"{op} {n}" for op, n in ops.most_common(16)))


if __name__ == "__main__":
    main(sys.argv[1:])
