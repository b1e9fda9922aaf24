"""llama.cpp's CPU build beside `mlxr bench --device cpu`, same random real-shape model, same
bytes per weight, alternating in one run (issue #32's comparison).

    PYTHONPATH=$PWD python benchmarks/cpu/llamacpp_side_by_side.py --work /tmp/lcw \\
        [--shapes qwen3-0.6b,llama-3.1-8b,qwen3-30b-a3b:12] [--threads 2,1] [--rounds 2]

One command: fetches the llama-cpp-python 0.3.36 sdist with pip (or takes --src), builds
llama.cpp's `llama-bench` and `llama-quantize` for this CPU, writes mlxr's MLX 4-bit g64
checkpoint (benchmarks/make_checkpoint.py) and a random HF bf16 checkpoint of the same shape,
converts that to GGUF f16 and quantizes it to Q4_0 with every tensor Q4_0 (4.5 bits/weight,
MLX 4-bit g64's bytes), then runs `llama-bench -p 512 -n 128 -t T` and `mlxr bench -p 512
-n 128 --threads T` alternately and prints both, the ratio and the box load. Python rather
than shell: the configs, the checkpoint writer and the table are unit-tested
(tests/test_llamacpp_side_by_side.py), and the GPU script runs the same code.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/llamacpp

from llamacpp.cli import main  # noqa: E402

if __name__ == "__main__":
    main("cpu")
