"""llama.cpp's CUDA build (sm_90) beside `mlxr bench --device cuda` on the H200, same random
real-shape models, alternating in one call (issues #28, #29: the MoE and hybrid shapes; the
dense ones as in ../shared/docs/perf-anchors.md). The CPU script's code, split into calls
that each fit the GPU machine's 10-minute limit:

    # here (PyPI reachable): the trimmed llama.cpp tree to carry (~5 MB)
    PYTHONPATH=$PWD python benchmarks/gpu/llamacpp_side_by_side.py --work /tmp/lcw \\
        --make-src .llamacpp/src.tar.xz
    # GPU call 1: build in the background; the dense and small shapes' checkpoints
    PYTHONPATH=$PWD python3 benchmarks/gpu/llamacpp_side_by_side.py prep --work /tmp/w \\
        --src .llamacpp/src.tar.xz --shapes qwen3-0.6b,llama-3.1-8b,qwen3.5-0.8b
    # GPU call 2: the MoE and hybrid shapes' checkpoints (and the build, if still running)
    ... prep --work /tmp/w --src ... --shapes qwen3-30b-a3b:16,gpt-oss-20b,qwen3.5-2b,gemma-4-e2b
    # GPU call 3: the benches (llama-bench -ngl 99 -fa 1 -p 512 -n 128 / mlxr bench)
    ... run --work /tmp/w --shapes <all of the above>

Every artefact stays under --work and is reused by the next call.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/llamacpp

from llamacpp.cli import main  # noqa: E402

if __name__ == "__main__":
    main("cuda")
