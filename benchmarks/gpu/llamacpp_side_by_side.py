"""llama.cpp's CUDA build (sm_90) beside `mlxr bench --device cuda` on the H200, same random
real-shape models, alternating in one call (issues #28, #29: the MoE and hybrid shapes; the
dense ones are in ../shared/docs/perf-anchors.md). The CPU script's code
(benchmarks/llamacpp), split into calls that each fit the GPU machine's 10-minute limit:

    # here, once (PyPI reachable): llama.cpp's tree trimmed to 4.7 MB, in an ignored folder
    PYTHONPATH=$PWD python benchmarks/gpu/llamacpp_side_by_side.py --work /tmp/lcw \\
        --make-src .llamacpp/src.tar.xz
    # on the GPU machine, carrying .llamacpp, calls back to back on one warm machine:
    G="python3 benchmarks/gpu/llamacpp_side_by_side.py"; S=".llamacpp/src.tar.xz"
    PYTHONPATH=$PWD $G prep --work /tmp/w --src $S --shapes qwen3-30b-a3b:12     # + build
    PYTHONPATH=$PWD $G prep --work /tmp/w --src $S --shapes gpt-oss-20b,qwen3.5-0.8b
    PYTHONPATH=$PWD $G prep --work /tmp/w --src $S --shapes qwen3.5-2b,gemma-4-e2b
    PYTHONPATH=$PWD $G run --work /tmp/w --shapes qwen3-30b-a3b:12,gpt-oss-20b
    PYTHONPATH=$PWD $G run --work /tmp/w --shapes qwen3.5-0.8b,qwen3.5-2b,gemma-4-e2b

`prep` starts the build in the background (cmake -DGGML_CUDA=ON
-DCMAKE_CUDA_ARCHITECTURES=90, llama-bench and llama-quantize only; ~6 min on 12+ cores),
writes the checkpoints meanwhile, waits up to --build-wait s for the build and quantizes; what
it could not quantize yet, the next `prep` or `run` does. `run` alternates `llama-bench -ngl 99
-fa 1 -p 512 -n 128 -r 3` and `mlxr bench --device cuda -p 512 -n 128 --repeats 3` for
--rounds rounds and prints the table. Every artefact stays under --work.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/llamacpp

from llamacpp.cli import main  # noqa: E402

if __name__ == "__main__":
    main("cuda")
