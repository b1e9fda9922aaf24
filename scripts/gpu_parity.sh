#!/usr/bin/env bash
# GPU parity run: mlx-lm references are made on a CPU machine (mlx does not run on the GPU
# machine), then the suite runs on the GPU against them.
#
#   here (CPU, with the test extras):  scripts/gpu_parity.sh make
#   on the GPU machine, repo root:     scripts/gpu_parity.sh run      (carry .gpu_fixtures)
#   on the GPU machine, benchmarks:    scripts/gpu_parity.sh bench
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  make) rm -rf .gpu_fixtures && python scripts/make_gpu_fixtures.py .gpu_fixtures ;;
  run) MLXR_GPU_FIXTURES=.gpu_fixtures PYTHONPATH=. python3 -m pytest -q tests/test_gpu.py ;;
  bench)
    export PYTHONPATH=.
    python3 benchmarks/make_checkpoint.py qwen3-0.6b /tmp/q06 >/dev/null
    python3 -m mlxr bench /tmp/q06 -p 512 -n 128 --device cuda
    python3 benchmarks/gpu_profile.py /tmp/q06
    python3 benchmarks/make_checkpoint.py llama-3.1-8b /tmp/l8 >/dev/null
    python3 -m mlxr bench /tmp/l8 -p 512 -n 64 --device cuda --repeats 2 ;;
  *) echo "usage: $0 make|run|bench" >&2; exit 2 ;;
esac
