#!/usr/bin/env bash
# GPU golden run (H200): record goldens on the CPU float32 reference path, gate CUDA against them.
#
#   scripts/gpu_golden.sh [MODEL ...]        (default: the bundled models)
#
# Environment:
#   OUT=dir          where goldens, check results and traces go (default: ./gpu-golden-out)
#   TOKENS=N         greedy tokens per golden (default 64)
#   PROMPT_IDS=ids   prompt token ids (default "1": BOS), or PROMPT="text"
#   DTYPES="..."     CUDA dtypes to gate (default "float32"; the exact gate. bfloat16 is reported
#                    with BF16_GATE=1 but only float32 failures fail the script unless
#                    STRICT_BF16=1)
#   TIE_TOL=x        tie tolerance (default 1e-6)
#   TRACE=1          also write a Chrome trace of one CUDA check per model (MLXR_TRACE)
#   PYTHON=python    interpreter
set -uo pipefail

PYTHON=${PYTHON:-python}
OUT=${OUT:-gpu-golden-out}
TOKENS=${TOKENS:-64}
TIE_TOL=${TIE_TOL:-1e-6}
DTYPES=${DTYPES:-float32}
if [ "${BF16_GATE:-0}" = 1 ]; then DTYPES="$DTYPES bfloat16"; fi
MODELS=("$@")
if [ ${#MODELS[@]} -eq 0 ]; then MODELS=(stories260K stories260K-8bit); fi
if [ -n "${PROMPT:-}" ]; then PROMPT_ARGS=(--prompt "$PROMPT"); else
  PROMPT_ARGS=(--prompt-ids "${PROMPT_IDS:-1}"); fi

mkdir -p "$OUT"
"$PYTHON" - <<'EOF' || { echo "CUDA is not available to torch" >&2; exit 2; }
import torch, sys
assert torch.cuda.is_available()
print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}", file=sys.stderr)
EOF

status=0
summary=()
for model in "${MODELS[@]}"; do
  name=$(basename "$model")
  golden="$OUT/$name.golden.json"
  echo "== $name: golden on cpu float32"
  if ! "$PYTHON" -m mlxr golden "$model" "${PROMPT_ARGS[@]}" --tokens "$TOKENS" --top-k 10 \
      --device cpu --dtype float32 --out "$golden"; then
    summary+=("$name golden: ERROR"); status=1; continue
  fi
  for dtype in $DTYPES; do
    echo "== $name: check on cuda $dtype"
    "$PYTHON" -m mlxr check "$model" "$golden" --device cuda --dtype "$dtype" \
      --tie-tol "$TIE_TOL" --free-run -1 --json "$OUT/$name.check.cuda.$dtype.json"
    rc=$?
    summary+=("$name cuda $dtype: $([ $rc -eq 0 ] && echo PASS || echo FAIL)")
    if [ $rc -ne 0 ] && { [ "$dtype" = float32 ] || [ "${STRICT_BF16:-0}" = 1 ]; }; then
      status=1
    fi
  done
  if [ "${TRACE:-0}" = 1 ]; then
    MLXR_TRACE="$OUT/$name.trace.json" MLXR_TRACE_KERNELS=1 MLXR_TRACE_SYNC=1 \
      "$PYTHON" -m mlxr check "$model" "$golden" --device cuda --dtype float32 >/dev/null
  fi
done

echo "== summary"
printf '%s\n' "${summary[@]}"
exit $status
