#!/usr/bin/env bash
# GPU parity and benchmark runs. mlx-lm references are made on a CPU machine (mlx does not run
# on the GPU machine), then the suites run on the GPU against them.
#
#   here (CPU, with the test extras):  scripts/gpu_parity.sh make
#   on the GPU machine, repo root:     scripts/gpu_parity.sh run      (carry .gpu_fixtures)
#   on the GPU machine, benchmarks:    scripts/gpu_parity.sh bench    (single request, engine)
#   on the GPU machine, switches:      scripts/gpu_parity.sh ab       (each decode switch: are
#       greedy tokens and logits bit-identical on and off, then decode speed on and off;
#       AB="..." names the switches, MODELS="q06 l8" the checkpoints)
#   on the GPU machine, other formats: scripts/gpu_parity.sh widths   (8B-shape checkpoints of
#       each width and fp mode, WIDTHS="8 3 mxfp4 ..." to choose; decode / prefill with each
#       one's switch on and off: MLXR_PLANES for affine 2/3/5/6/8-bit, MLXR_FP_DEQUANT for
#       the fp modes; greedy tokens and last logits on vs off)
#   on the GPU machine, GPU memory:    scripts/gpu_parity.sh memory   (the copy dequantizer
#       against the words', then the 8B with its words kept and dropped: prefill 128 / 512,
#       decode, peak memory; greedy tokens and last logits kept vs dropped after a 100-token
#       prompt; the GPU parity test of dropped words first, if .gpu_fixtures is carried)
#   on the GPU machine, mxfp4 / nvfp4 / mxfp8: scripts/gpu_parity.sh fp4  (q4tc's fp4 and fp8
#       copies: their kernel tests and the fp GPU parity cases (carry .gpu_fixtures), the
#       per-projection workbench, then 8B-shape checkpoints of each mode (FP_MODES="..." to
#       choose): decode with the copy and with MLXR_FP4_TC=0 / MLXR_FP8_TC=0, greedy tokens
#       and last logits on vs off, and where they part, the candidates' gaps on each path and
#       on the float32 model; then MLXR_WORDS=drop: prefill 512 / decode / peak memory, and
#       kept vs dropped tokens and logits)
#   on the GPU machine, serving:       scripts/gpu_parity.sh serve    (needs the server's
#       packages there: carry wheels in .whl, see the device notes; a tokenizer dir in .gpu_tok)
#
# Outputs go to $OUT when it is set (the device tool brings that folder back), else ./gpu-out.
# Triton's compile cache is kept in .triton_cache (ignored), so later calls on the same warm
# machine skip the compiles.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-out}"
mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} TRITON_CACHE_DIR="$PWD/.triton_cache"
wheels() {
  if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
  fi
}
case "${1:-}" in
  make) rm -rf .gpu_fixtures && python scripts/make_gpu_fixtures.py .gpu_fixtures ;;
  run)
    # The parity suite is compile-bound (Triton JIT per shape, graph captures; ~4 s per case
    # on the H200 host): six processes share the GPU and the compile cache. Shard i takes every
    # 5th test of tests/test_gpu.py; the sixth process runs the engine tests.
    export MLXR_GPU_FIXTURES=.gpu_fixtures
    python3 -m pytest -q --collect-only tests/test_gpu.py | grep '::' > /tmp/gpu_ids
    for i in 0 1 2 3 4; do
      awk -v i="$i" 'NR % 5 == i' /tmp/gpu_ids > "/tmp/shard$i"
      python3 -m pytest -q -rf $(cat "/tmp/shard$i") > "$out/parity-gpu$i.txt" 2>&1 &
    done
    python3 -m pytest -q -rf tests/test_triton_paged.py tests/test_gpu_engine.py \
      tests/test_fused_decode.py \
      tests/test_gpu_prefill.py > "$out/parity-engine.txt" 2>&1 &
    wait
    tail -n 3 "$out"/parity-*.txt ;;
  bench)
    python3 benchmarks/make_checkpoint.py qwen3-0.6b /tmp/q06 >/dev/null
    python3 -m mlxr bench /tmp/q06 -p 512 -n 128 --device cuda | tee "$out/bench-0.6b.txt"
    python3 benchmarks/gpu/gpu_profile.py /tmp/q06 | tee "$out/profile-decode.txt"
    python3 benchmarks/gpu/gpu_profile_prefill.py /tmp/q06 | tee "$out/profile-prefill.txt"
    python3 benchmarks/engine_bench.py /tmp/q06 --device cuda | tee "$out/engine.txt"
    python3 benchmarks/gpu/gpu_profile_paged.py /tmp/q06 256 96 | tee "$out/profile-paged.txt"
    python3 benchmarks/make_checkpoint.py llama-3.1-8b /tmp/l8 >/dev/null
    python3 -m mlxr bench /tmp/l8 -p 512 -n 64 --device cuda --repeats 2 \
      | tee "$out/bench-8b.txt" ;;
  ab)
    python3 benchmarks/make_checkpoint.py qwen3-0.6b /tmp/q06 >/dev/null
    python3 benchmarks/make_checkpoint.py llama-3.1-8b /tmp/l8 >/dev/null
    for m in ${MODELS:-q06 l8}; do
      for sw in ${AB:-MLXR_DECODE_FUSED MLXR_PDL}; do
        for v in 1 0; do
          env "$sw=$v" python3 benchmarks/gpu/gpu_ab_check.py "/tmp/$m" "/tmp/$m-$v.pt" >/dev/null
          env "$sw=$v" python3 -m mlxr bench "/tmp/$m" -p 512 -n 128 --device cuda --repeats 2 \
            | tail -n 1 > "$out/ab-$m-$sw-$v.json"
        done
        echo "$m $sw: $(python3 benchmarks/gpu/gpu_ab_check.py --compare "/tmp/$m-1.pt" \
          "/tmp/$m-0.pt" || true)" | tee -a "$out/ab.txt"
      done
    done ;;
  widths)
    ws="${WIDTHS:-2 3 5 6 8 mxfp4 nvfp4 mxfp8}"
    for w in $ws; do  # the checkpoints in parallel (CPU), each marked done when written
      case $w in mx*|nv*) a="--mode $w" ;; *) a="--bits $w" ;; esac
      (python3 benchmarks/make_checkpoint.py llama-3.1-8b "/tmp/l8_$w" $a >/dev/null \
        && touch "/tmp/l8_$w.done") &
    done
    for w in $ws; do
      while [ ! -f "/tmp/l8_$w.done" ]; do sleep 2; done
      case $w in mx*|nv*) sw=MLXR_FP_DEQUANT ;; *) sw=MLXR_PLANES ;; esac
      for v in 1 0; do
        echo "$w $sw=$v $(env "$sw=$v" python3 -m mlxr bench "/tmp/l8_$w" -p 128 -n 64 \
          --device cuda --repeats 2 | tail -n 1)" >> "$out/widths.txt"
        env "$sw=$v" python3 benchmarks/gpu/gpu_ab_check.py "/tmp/l8_$w" "/tmp/l8_$w-$v.pt" >/dev/null
      done
      echo "$w $sw: $(python3 benchmarks/gpu/gpu_ab_check.py --compare "/tmp/l8_$w-1.pt" \
        "/tmp/l8_$w-0.pt" || true)" | tee -a "$out/widths.txt"
    done ;;
  memory)
    python3 benchmarks/make_checkpoint.py llama-3.1-8b /tmp/l8 >/dev/null &
    if [ -d .gpu_fixtures ]; then  # the dropped-words parity test (with .gpu_fixtures carried)
      MLXR_GPU_FIXTURES=.gpu_fixtures python3 -m pytest -q -rf tests/test_gpu.py -k dropped \
        > "$out/dropped-parity.txt" 2>&1 || true
      tail -n 1 "$out/dropped-parity.txt"
    fi
    wait
    python3 benchmarks/gpu/gpu_dequant_copy.py 4 | tee "$out/dequant-copy.txt"
    for arm in keep drop; do
      for p in 128 512; do
        echo "$arm p$p $(MLXR_WORDS=$arm python3 -m mlxr bench /tmp/l8 -p $p -n 32 --device cuda \
          --repeats 2 | tail -n 1)" | tee -a "$out/memory.txt"
      done
      MLXR_WORDS=$arm python3 benchmarks/gpu/gpu_ab_check.py /tmp/l8 "/tmp/l8-$arm.pt" 100 >/dev/null
    done
    echo "kept vs dropped: $(python3 benchmarks/gpu/gpu_ab_check.py --compare \
      /tmp/l8-keep.pt /tmp/l8-drop.pt || true)" | tee -a "$out/memory.txt" ;;
  fp4)
    for m in ${FP_MODES:-mxfp4 nvfp4 mxfp8}; do
      (python3 benchmarks/make_checkpoint.py llama-3.1-8b "/tmp/l8_$m" --mode "$m" >/dev/null \
        && touch "/tmp/l8_$m.done") &
    done
    python3 -m pytest -q -rf tests/test_triton_q4tc.py -k "fp4 or fp8" > "$out/fp4-kernels.txt" \
      2>&1 || true
    tail -n 1 "$out/fp4-kernels.txt"
    if [ -d .gpu_fixtures ]; then
      MLXR_GPU_FIXTURES=.gpu_fixtures python3 -m pytest -q -rf tests/test_gpu.py \
        -k "fp4 or fp8" > "$out/fp4-parity.txt" 2>&1 || true
      tail -n 1 "$out/fp4-parity.txt"
    fi
    python3 benchmarks/gpu/gpu_q4tc_fp4.py ${FP_MODES:-mxfp4 nvfp4 mxfp8} \
      | tee "$out/fp4-workbench.txt"
    for m in ${FP_MODES:-mxfp4 nvfp4 mxfp8}; do
      while [ ! -f "/tmp/l8_$m.done" ]; do sleep 2; done
      sw=MLXR_FP4_TC
      [ "$m" = mxfp8 ] && sw=MLXR_FP8_TC
      for v in 1 0; do
        echo "$m $sw=$v $(env "$sw=$v" python3 -m mlxr bench "/tmp/l8_$m" -p 128 \
          -n 64 --device cuda --repeats 2 | tail -n 1)" | tee -a "$out/fp4.txt"
        env "$sw=$v" python3 benchmarks/gpu/gpu_ab_check.py "/tmp/l8_$m" "/tmp/l8_$m-$v.pt" >/dev/null
      done
      if ! python3 benchmarks/gpu/gpu_ab_check.py --compare "/tmp/l8_$m-1.pt" "/tmp/l8_$m-0.pt" \
          | tee -a "$out/fp4.txt"; then
        python3 benchmarks/gpu/gpu_ab_logits.py "/tmp/l8_$m" "$sw" 1 0 300 60 \
          | tee -a "$out/fp4.txt"
      fi
      # the words dropped for the copy (prefill by dequant_copy from it): speed, memory, and
      # greedy tokens / last logits after a 100-token prompt against the words kept
      echo "$m MLXR_WORDS=drop $(MLXR_WORDS=drop python3 -m mlxr bench "/tmp/l8_$m" -p 512 \
        -n 32 --device cuda --repeats 2 | tail -n 1)" | tee -a "$out/fp4.txt"
      for w in keep drop; do
        MLXR_WORDS=$w python3 benchmarks/gpu/gpu_ab_check.py "/tmp/l8_$m" "/tmp/l8_$m-$w.pt" 100 \
          >/dev/null
      done
      python3 benchmarks/gpu/gpu_ab_check.py --compare "/tmp/l8_$m-keep.pt" "/tmp/l8_$m-drop.pt" \
        | tee -a "$out/fp4.txt" || true
    done ;;
  serve)
    wheels
    python3 benchmarks/make_checkpoint.py qwen3-0.6b /tmp/q06 --tokenizer .gpu_tok >/dev/null
    for ep in on off; do  # the engine in its own process (the CUDA default) vs in the server's
      python3 benchmarks/serve_bench.py /tmp/q06 --device cuda --clients 1,8,64,256 \
        --tokens 128 --engine-process "$ep" | tee "$out/serve-engine-process-$ep.txt"
    done
    python3 benchmarks/serve_bench.py /tmp/q06 --null-engine --null-step-ms 7 --clients 256 \
      --tokens 128 | tee "$out/serve-null.txt" ;;
  *) echo "usage: $0 make|run|bench|ab|widths|memory|fp4|serve" >&2; exit 2 ;;
esac
